package dev.railyard.peer.omega;

import org.apache.servicecomb.pack.omega.context.OmegaContext;
import org.apache.servicecomb.pack.omega.transaction.annotations.Compensable;
import org.springframework.beans.factory.annotation.Value;
import org.springframework.stereotype.Service;

/**
 * The three sub-transactions of a booking, each an Omega {@code @Compensable} with its
 * compensation method. The forward methods do no work besides counting and, for sagas the runner
 * marked as failing at that step, throwing; the compensations record that Omega invoked them.
 *
 * <p>Every method takes the saga's business id (a String, which Omega serializes with Kryo into
 * the TxStartedEvent payloads and the coordinator must send back byte for byte).
 *
 * <p>With {@code interop.flaky-compensation=<step>}, that step's compensation throws the first
 * time it is invoked for a saga: the coordinator must learn that it failed and invoke it again.
 */
@Service
public class Steps {

  private final Ledger ledger;
  private final OmegaContext omega;
  private final String flaky;

  public Steps(
      Ledger ledger,
      OmegaContext omega,
      @Value("${interop.flaky-compensation:}") String flaky) {
    this.ledger = ledger;
    this.omega = omega;
    this.flaky = flaky;
  }

  @Compensable(compensationMethod = "cancelReserve")
  public void reserve(String sagaId) {
    forward(1, "reserve", sagaId);
  }

  public void cancelReserve(String sagaId) {
    undo("reserve", sagaId);
  }

  @Compensable(compensationMethod = "cancelCharge")
  public void charge(String sagaId) {
    forward(2, "charge", sagaId);
  }

  public void cancelCharge(String sagaId) {
    undo("charge", sagaId);
  }

  @Compensable(compensationMethod = "cancelShip")
  public void ship(String sagaId) {
    forward(3, "ship", sagaId);
  }

  public void cancelShip(String sagaId) {
    undo("ship", sagaId);
  }

  private void undo(String name, String sagaId) {
    if (name.equals(flaky) && ledger.firstCompensationAttempt(name, sagaId)) {
      throw new CompensationFailed(name, sagaId);
    }
    ledger.compensated(name, sagaId, omega.globalTxId());
  }

  private void forward(int step, String name, String sagaId) {
    if (ledger.failsAt(sagaId) == step) {
      throw new StepFailed(name, sagaId);
    }
    ledger.ran(name, sagaId);
  }

  /** A compensation's failure on its first invocation, with interop.flaky-compensation. */
  public static final class CompensationFailed extends RuntimeException {
    CompensationFailed(String step, String sagaId) {
      super("compensation of " + step + " in saga " + sagaId + " fails once on purpose", null,
          false, false);
    }
  }

  /** The business failure a step throws when its saga is marked to fail there. */
  public static final class StepFailed extends RuntimeException {
    StepFailed(String step, String sagaId) {
      super("step " + step + " of saga " + sagaId + " fails on purpose", null, false, false);
    }
  }
}
