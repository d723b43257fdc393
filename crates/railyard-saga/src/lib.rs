//! Railyard's saga coordinator.
//!
//! Data moves through it like this: a participant reports an event (over
//! Omega's `TxEventService` or the native batched stream); the event is
//! appended to the durable log ([`store`], group-committed with every event
//! arriving at the same time); only then is it applied to its saga's state
//! machine and acknowledged. Aborts and timeouts turn into compensation
//! commands sent down the open stream of a live instance of the service that
//! ran each sub-transaction, in reverse order.
//!
//! Modules:
//! - [`event`]: the event record every layer shares, and its kinds;
//! - [`store`]: the [`SagaStore`] trait (append durably, recover, compact,
//!   query) and its implementations.

pub mod event;
pub mod store;

pub use event::{EventKind, EventRecord};
pub use store::{
    MemoryStore, PgServer, PgServerError, PostgresConfig, PostgresStore, Retention, SagaQuery,
    SagaState, SagaStore, SagaSummary, SqliteConfig, SqliteStore, StoreChoice, StoreError,
    StoreStats,
};
