package dev.railyard.peer.omega;

import org.apache.servicecomb.pack.omega.context.OmegaContext;
import org.apache.servicecomb.pack.omega.context.annotations.SagaStart;
import org.springframework.stereotype.Service;

/** The global transaction: Omega's {@code @SagaStart} around three {@code @Compensable} steps. */
@Service
public class Booking {

  private final Steps steps;
  private final Ledger ledger;
  private final OmegaContext omega;

  public Booking(Steps steps, Ledger ledger, OmegaContext omega) {
    this.steps = steps;
    this.ledger = ledger;
    this.omega = omega;
  }

  @SagaStart
  public void book(String sagaId) {
    ledger.started(sagaId, omega.globalTxId());
    steps.reserve(sagaId);
    steps.charge(sagaId);
    steps.ship(sagaId);
  }
}
