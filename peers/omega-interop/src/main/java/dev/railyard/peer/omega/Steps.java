package dev.railyard.peer.omega;

import org.apache.servicecomb.pack.omega.context.OmegaContext;
import org.apache.servicecomb.pack.omega.transaction.annotations.Compensable;
import org.springframework.stereotype.Service;

/**
 * The three sub-transactions of a booking, each an Omega {@code @Compensable} with its
 * compensation method. The forward methods do no work besides counting and, for sagas the runner
 * marked as failing at that step, throwing; the compensations record that Omega invoked them.
 *
 * <p>Every method takes the saga's business id (a String, which Omega serializes with Kryo into
 * the TxStartedEvent payloads and the coordinator must send back byte for byte).
 */
@Service
public class Steps {

  private final Ledger ledger;
  private final OmegaContext omega;

  public Steps(Ledger ledger, OmegaContext omega) {
    this.ledger = ledger;
    this.omega = omega;
  }

  @Compensable(compensationMethod = "cancelReserve")
  public void reserve(String sagaId) {
    forward(1, "reserve", sagaId);
  }

  public void cancelReserve(String sagaId) {
    ledger.compensated("reserve", sagaId, omega.globalTxId());
  }

  @Compensable(compensationMethod = "cancelCharge")
  public void charge(String sagaId) {
    forward(2, "charge", sagaId);
  }

  public void cancelCharge(String sagaId) {
    ledger.compensated("charge", sagaId, omega.globalTxId());
  }

  @Compensable(compensationMethod = "cancelShip")
  public void ship(String sagaId) {
    forward(3, "ship", sagaId);
  }

  public void cancelShip(String sagaId) {
    ledger.compensated("ship", sagaId, omega.globalTxId());
  }

  private void forward(int step, String name, String sagaId) {
    if (ledger.failsAt(sagaId) == step) {
      throw new StepFailed(name, sagaId);
    }
    ledger.ran(name, sagaId);
  }

  /** The business failure a step throws when its saga is marked to fail there. */
  public static final class StepFailed extends RuntimeException {
    StepFailed(String step, String sagaId) {
      super("step " + step + " of saga " + sagaId + " fails on purpose", null, false, false);
    }
  }
}
