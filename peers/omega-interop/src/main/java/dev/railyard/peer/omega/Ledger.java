package dev.railyard.peer.omega;

import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.springframework.stereotype.Component;

/**
 * What happened to every saga of this run: its global transaction id (as Omega generated it), the
 * forward steps that ran, and the compensations Omega invoked, in invocation order. Compensations
 * arrive on gRPC threads while the runner waits, hence the monitor.
 */
@Component
public class Ledger {

  /** The steps of a booking, in forward order (step k is STEPS[k - 1]). */
  static final List<String> STEPS = List.of("reserve", "charge", "ship");

  /** One saga's record. */
  static final class Saga {
    final String id;
    final int failAt;
    String globalTxId = "";
    String outcome = "pending";
    String error = "";
    final List<String> ran = new ArrayList<>();
    final List<String> compensations = new ArrayList<>();
    /** The global tx id each compensation ran under (Omega's context during the callback). */
    final List<String> compensationGlobalTxIds = new ArrayList<>();

    Saga(String id, int failAt) {
      this.id = id;
      this.failAt = failAt;
    }

    /** The steps before the failing one, most recent first: what must be compensated. */
    List<String> expected() {
      List<String> out = new ArrayList<>();
      for (int k = failAt - 1; k >= 1; k--) {
        out.add(STEPS.get(k - 1));
      }
      return out;
    }
  }

  private final Map<String, Saga> sagas = new LinkedHashMap<>();
  private int unexpected;
  /** Step/saga pairs whose compensation already threw once (see Steps#undo). */
  private final Set<String> thrown = new HashSet<>();

  synchronized void plan(String id, int failAt) {
    sagas.put(id, new Saga(id, failAt));
  }

  synchronized int failsAt(String id) {
    Saga s = sagas.get(id);
    return s == null ? 0 : s.failAt;
  }

  synchronized void started(String id, String globalTxId) {
    Saga s = sagas.get(id);
    if (s != null) {
      s.globalTxId = globalTxId;
    }
  }

  synchronized void ran(String step, String id) {
    Saga s = sagas.get(id);
    if (s != null) {
      s.ran.add(step);
    }
  }

  synchronized void finished(String id, String outcome, String error) {
    Saga s = sagas.get(id);
    s.outcome = outcome;
    s.error = error;
  }

  /** Called by the compensation methods, on whichever thread Omega runs them. */
  void compensated(String step, String id, String globalTxId) {
    System.out.println("COMPENSATED " + step + " " + id);
    synchronized (this) {
      Saga s = sagas.get(id);
      if (s == null) {
        unexpected++;
      } else {
        s.compensations.add(step);
        s.compensationGlobalTxIds.add(globalTxId == null ? "" : globalTxId);
        if (s.compensations.size() > s.expected().size()) {
          unexpected++;
        }
      }
      notifyAll();
    }
  }

  /** Compensations expected in all, and invoked so far (only counting expected ones). */
  synchronized int[] progress() {
    int expected = 0;
    int invoked = 0;
    for (Saga s : sagas.values()) {
      int e = s.expected().size();
      expected += e;
      invoked += Math.min(e, s.compensations.size());
    }
    return new int[] {expected, invoked};
  }

  /** Waits until every expected compensation was invoked, or the deadline; true if they all were. */
  synchronized boolean awaitCompensations(long deadlineNanos) throws InterruptedException {
    while (true) {
      int[] p = progress();
      if (p[1] >= p[0]) {
        return true;
      }
      long left = deadlineNanos - System.nanoTime();
      if (left <= 0) {
        return false;
      }
      wait(Math.max(1, left / 1_000_000));
    }
  }

  synchronized int unexpected() {
    return unexpected;
  }

  /** True the first time it is asked for this step of this saga: its compensation throws then. */
  synchronized boolean firstCompensationAttempt(String step, String id) {
    return thrown.add(step + "/" + id);
  }

  /** Compensation invocations that threw on purpose. */
  synchronized int compensationFailures() {
    return thrown.size();
  }

  synchronized List<Saga> snapshot() {
    List<Saga> out = new ArrayList<>();
    for (Saga s : sagas.values()) {
      Saga c = new Saga(s.id, s.failAt);
      c.globalTxId = s.globalTxId;
      c.outcome = s.outcome;
      c.error = s.error;
      c.ran.addAll(s.ran);
      c.compensations.addAll(s.compensations);
      c.compensationGlobalTxIds.addAll(s.compensationGlobalTxIds);
      out.add(c);
    }
    return out;
  }
}
