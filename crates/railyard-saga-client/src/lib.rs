//! Rust SDK for Railyard's saga coordinator, over its native
//! `railyard.saga.v1.SagaCoordinator.Session` stream.
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use railyard_saga_client::{CompensationError, SagaClient, Step};
//! let client = SagaClient::builder("http://127.0.0.1:8090", "orders")
//!     .compensation("cancel-order", |c| async move {
//!         // undo the order described by c.payloads
//!         Ok::<(), CompensationError>(())
//!     })
//!     .connect()
//!     .await?;
//! let saga = client.start_saga(None).await?;
//! let order_id = saga
//!     .step(Step::new("cancel-order").payload(&b"order 42"[..]), async {
//!         Ok::<_, std::io::Error>(42) // the real work
//!     })
//!     .await?;
//! saga.end().await?;
//! # Ok(()) }
//! ```
//!
//! # Map
//! - [`client`](SagaClient): the handle and its [`ClientBuilder`]; one
//!   client is one participant instance (service name + instance id) with
//!   one session, or several instances a process hosts ([`Participant`],
//!   [`ClientBuilder::connect_all`]) with one session for all of them, so
//!   their events share batches. Every call reports events through a
//!   bounded in-flight budget into the session task's queue and waits for
//!   the event's ack.
//! - `session`: the task that owns the stream. It coalesces the events of
//!   all concurrent sagas of the client into `EventBatch` frames (a batch
//!   leaves as soon as the transport took the previous one, with everything
//!   queued by then, at most [`ClientBuilder::max_batch_events`]; before
//!   building it the task yields once to the scheduler so that sagas woken
//!   by the last ack can queue their next events; no timer ever holds an
//!   event back), matches each `Ack` to its batch by `seq` and
//!   wakes each event's waiter, runs `Compensate` commands, and reconnects.
//! - `frame`: the frames the session sends; a batch's events are shared
//!   between the frame and the batch kept for its ack (and resending), and
//!   encoded to the same bytes as the generated `ClientFrame`.
//! - [`Saga`] and [`Step`]: start, step (reports `TX_STARTED`, runs the
//!   work, reports `TX_ENDED` or `TX_ABORTED`), end, abort.
//! - [`Compensation`]: what a compensation handler gets; handlers are
//!   registered by compensation method name and answer `TX_COMPENSATED` or
//!   `TX_COMPENSATE_FAILED`. Up to
//!   [`ClientBuilder::max_concurrent_compensations`] run at once and as
//!   many wait; further commands are dropped unanswered (the coordinator
//!   counts that attempt as failed after the step's reverse timeout and
//!   sends them again while the step has attempts left). A command for a
//!   compensation still held joins it (no second run alongside); results
//!   carry the attempt they answer.
//! - [`SagaError`], [`StepError`], [`CompensationError`]: typed errors.
//!
//! # Sizes
//! An event may be at most [`MAX_EVENT_BYTES`] encoded (a larger one fails
//! with [`SagaError::TooLarge`], nothing sent), and a batch frame closes
//! before it would pass [`MAX_BATCH_BYTES`].
//!
//! # Back-pressure
//! At most [`ClientBuilder::max_in_flight_events`] events are reported and
//! not yet acknowledged; a call that would exceed it waits for acks. The
//! session's queue is bounded by the same number, so it is never full.
//!
//! # Reconnection, and what the client assumes of the coordinator
//! When the stream breaks (anything but a refusal: `INVALID_ARGUMENT`, `OUT_OF_RANGE`,
//! `UNAUTHENTICATED`, `PERMISSION_DENIED`, `UNIMPLEMENTED` close the
//! client, since sending the same frames again cannot help), the session task
//! reconnects with exponential backoff (with jitter, capped), sends `Hello`
//! with the same instance ids, waits for `Welcome`, then sends again every batch that was not
//! acknowledged, in the original order, under new `seq` numbers, before any
//! newer event. Waiting callers notice nothing but the delay. So the client
//! assumes of the coordinator:
//! - an `Ack` means every event of the batch is durable (it is never sent
//!   again after an ack);
//! - an event received again (same saga, step, type) after a lost ack is a
//!   duplicate: recorded once, and acknowledged again with the saga's current
//!   `aborted` flag;
//! - `seq` is only an echo: it is unique per client across sessions, and
//!   the coordinator need not check it;
//! - a `Compensate` whose answer was lost is sent again (possibly with a
//!   higher `attempt`), so handlers must be idempotent.
//!
//! An event whose ack did not arrive is never reported as failed because of
//! an outage: it waits, and is resent, until acknowledged or the client is
//! closed.

/// The largest event, encoded, a client sends: 16 MiB, the size of the
/// largest Omega message the coordinator takes. A larger one fails with
/// [`SagaError::TooLarge`] before it is queued.
pub const MAX_EVENT_BYTES: usize = railyard_saga_proto::MAX_EVENT_BYTES;

/// The most a batch's events add up to, encoded (each event's own length,
/// not its few bytes of tag and length prefix): 32 MiB, half the
/// coordinator's 64 MiB limit on a native frame
/// ([`MAX_NATIVE_FRAME_BYTES`](railyard_saga_proto::MAX_NATIVE_FRAME_BYTES)),
/// which leaves room for those prefixes. A batch closes before the event
/// that would take it past this (an event is never split, and
/// [`MAX_EVENT_BYTES`] keeps a lone event well under the limit), so no
/// frame the client sends is refused for its size.
pub const MAX_BATCH_BYTES: usize = railyard_saga_proto::MAX_NATIVE_FRAME_BYTES / 2;

mod client;
mod compensation;
mod error;
mod frame;
mod saga;
mod session;

pub use client::{ClientBuilder, ClientStats, Connection, Participant, SagaClient};
pub use compensation::Compensation;
pub use error::{CompensationError, EventKindName, SagaError, StepError};
pub use railyard_saga_proto::native::{EventType, SagaEvent};
/// The most participant instances one session carries (the client's own
/// and each [`ClientBuilder::participant`]).
pub use railyard_saga_proto::MAX_SESSION_PARTICIPANTS;
pub use saga::{Saga, Step};

#[cfg(test)]
mod tests {
    use super::*;

    fn is_send_sync<T: Send + Sync>() {}

    #[test]
    fn public_types_are_send_and_sync() {
        is_send_sync::<SagaClient>();
        is_send_sync::<Saga>();
        is_send_sync::<Step>();
        is_send_sync::<SagaError>();
        is_send_sync::<Compensation>();
    }

    fn future_is_send_sync<F: std::future::Future + Send + Sync>(_: &F) {}

    /// The futures of the saga API may be held across awaits by futures
    /// that must be `Send + Sync` (checked at compile time; never run).
    #[allow(dead_code, clippy::let_underscore_future)]
    fn public_futures_are_send_and_sync(client: &SagaClient, saga: &Saga) {
        future_is_send_sync(&client.start_saga(None));
        future_is_send_sync(&client.report(SagaEvent::default()));
        future_is_send_sync(&saga.step(Step::new("undo"), async { Ok::<(), ()>(()) }));
        future_is_send_sync(&saga.end());
        future_is_send_sync(&saga.abort());
    }

    #[test]
    fn errors_say_what_to_do() {
        let e = SagaError::Closed(Some("closed by the application".into()));
        assert_eq!(
            e.to_string(),
            "the saga client is closed: closed by the application"
        );
        assert_eq!(
            SagaError::Closed(None).to_string(),
            "the saga client is closed"
        );
        let e: StepError<std::io::Error> = StepError::SagaAborted("g1".into());
        assert!(e.to_string().contains("skipped"));
    }
}
