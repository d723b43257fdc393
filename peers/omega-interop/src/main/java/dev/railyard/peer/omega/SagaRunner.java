package dev.railyard.peer.omega;

import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;
import org.apache.servicecomb.pack.omega.context.OmegaContext;
import org.springframework.beans.factory.annotation.Value;
import org.springframework.boot.CommandLineRunner;
import org.springframework.boot.ExitCodeGenerator;
import org.springframework.stereotype.Component;

/**
 * Runs the sagas once Omega is connected: {@code interop.ok} successful ones, then
 * {@code interop.failing} failing ones (failing saga i fails at step
 * {@code interop.fail-at[i % n]}), one after another; then waits up to
 * {@code interop.wait-seconds} for every compensation the failures call for, plus
 * {@code interop.grace-ms} for any unexpected extra one, and prints {@code RESULT {json}}.
 */
@Component
public class SagaRunner implements CommandLineRunner, ExitCodeGenerator {

  private final Booking booking;
  private final Ledger ledger;
  private final OmegaContext omega;
  private final int ok;
  private final int failing;
  private final List<Integer> failAt;
  private final int waitSeconds;
  private final int graceMs;
  private final String address;
  private int exitCode = 1;

  public SagaRunner(
      Booking booking,
      Ledger ledger,
      OmegaContext omega,
      @Value("${interop.ok:1}") int ok,
      @Value("${interop.failing:1}") int failing,
      @Value("${interop.fail-at:3}") List<Integer> failAt,
      @Value("${interop.wait-seconds:30}") int waitSeconds,
      @Value("${interop.grace-ms:500}") int graceMs,
      @Value("${alpha.cluster.address}") String address) {
    this.booking = booking;
    this.ledger = ledger;
    this.omega = omega;
    this.ok = ok;
    this.failing = failing;
    this.failAt = failAt;
    this.waitSeconds = waitSeconds;
    this.graceMs = graceMs;
    this.address = address;
    for (int k : failAt) {
      if (k < 1 || k > Ledger.STEPS.size()) {
        throw new IllegalArgumentException(
            "interop.fail-at: each step must be 1.." + Ledger.STEPS.size() + ", got " + k);
      }
    }
  }

  @Override
  public void run(String... args) throws Exception {
    long t0 = System.nanoTime();
    List<String> ids = new ArrayList<>();
    for (int i = 0; i < ok; i++) {
      ids.add("ok-" + i);
      ledger.plan("ok-" + i, 0);
    }
    for (int i = 0; i < failing; i++) {
      int k = failAt.get(i % failAt.size());
      ids.add("fail" + k + "-" + i);
      ledger.plan("fail" + k + "-" + i, k);
    }
    for (String id : ids) {
      try {
        booking.book(id);
        ledger.finished(id, "committed", "");
      } catch (Exception e) {
        ledger.finished(id, "aborted", e.getClass().getSimpleName() + ": " + e.getMessage());
      }
    }
    boolean complete =
        ledger.awaitCompensations(System.nanoTime() + TimeUnit.SECONDS.toNanos(waitSeconds));
    // Anything extra (a compensation of a successful saga, of the failed step itself, or a
    // duplicate) would show up shortly after the expected ones: give it a moment.
    Thread.sleep(graceMs);
    double seconds = (System.nanoTime() - t0) / 1e9;
    System.out.println("RESULT " + result(complete, seconds));
    exitCode = complete && ledger.unexpected() == 0 ? 0 : 2;
  }

  private String result(boolean complete, double seconds) {
    List<Ledger.Saga> sagas = ledger.snapshot();
    int committed = 0;
    int aborted = 0;
    int[] progress = ledger.progress();
    StringBuilder list = new StringBuilder("[");
    for (int i = 0; i < sagas.size(); i++) {
      Ledger.Saga s = sagas.get(i);
      if (s.outcome.equals("committed")) {
        committed++;
      } else if (s.outcome.equals("aborted")) {
        aborted++;
      }
      if (i > 0) {
        list.append(',');
      }
      list.append("{\"id\":").append(Json.str(s.id))
          .append(",\"global_tx_id\":").append(Json.str(s.globalTxId))
          .append(",\"fail_at\":").append(s.failAt)
          .append(",\"outcome\":").append(Json.str(s.outcome))
          .append(",\"error\":").append(Json.str(s.error))
          .append(",\"ran\":").append(Json.strings(s.ran))
          .append(",\"expected_compensations\":").append(Json.strings(s.expected()))
          .append(",\"compensations\":").append(Json.strings(s.compensations))
          .append(",\"compensation_global_tx_ids\":")
          .append(Json.strings(s.compensationGlobalTxIds))
          .append('}');
    }
    list.append(']');
    return "{\"system\":\"omega-0.7.1\""
        + ",\"alpha_address\":" + Json.str(address)
        + ",\"akka_enabled\":" + omega.getAlphaMetas().isAkkaEnabled()
        + ",\"sagas_ok\":" + committed
        + ",\"sagas_failed\":" + aborted
        + ",\"compensations_expected\":" + progress[0]
        + ",\"compensations_invoked\":" + progress[1]
        + ",\"unexpected_compensations\":" + ledger.unexpected()
        + ",\"compensation_failures\":" + ledger.compensationFailures()
        + ",\"complete\":" + complete
        + ",\"seconds\":" + String.format("%.3f", seconds)
        + ",\"sagas\":" + list
        + "}";
  }

  @Override
  public int getExitCode() {
    return exitCode;
  }
}
