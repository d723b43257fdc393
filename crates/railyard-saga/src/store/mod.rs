//! The durable event log behind the coordinator.
//!
//! The contract every implementation keeps:
//! - [`append`](SagaStore::append) resolves only once every event of the call
//!   is on stable storage (committed and fsynced); concurrent calls are
//!   group-committed (one sync for everything waiting), which is where the
//!   throughput comes from. Nothing is acknowledged to a participant before
//!   its `append` resolved.
//! - [`unfinished`](SagaStore::unfinished) returns, after a restart, every
//!   event of every saga not yet [`finish`](SagaStore::finish)ed, in append
//!   order, so the coordinator rebuilds its state machines and resumes
//!   pending compensations.
//! - `finish` compacts: a finished saga's events may be dropped, a
//!   [`SagaSummary`] is kept, and summaries beyond the store's retention are
//!   pruned, so disk stays bounded.
//! - No call blocks an async worker: implementations do their I/O on their
//!   own thread or an async driver.

mod choice;
mod codec;
mod memory;
mod pg_server;
mod postgres;
mod queue;
mod segment;
mod sqlite;

use futures::future::BoxFuture;

pub use choice::StoreChoice;
/// The versioned packed form the stores write for one saga's events per
/// group commit; public so that benchmarks of other engines pay the same
/// encoding.
pub use codec::encode as encode_events;
pub use memory::MemoryStore;
pub use pg_server::{PgServer, PgServerError};
pub use postgres::{PostgresConfig, PostgresStore};
pub use queue::Retention;
pub use sqlite::{SqliteConfig, SqliteStore};

use crate::event::EventRecord;

/// A saga's state, as summarised for queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SagaState {
    /// Started, sub-transactions running.
    Running,
    /// Aborted or timed out; compensations in progress.
    Compensating,
    /// Ended normally.
    Committed,
    /// Every completed sub-transaction was compensated.
    Compensated,
    /// Compensation itself was exhausted (retries spent): needs an operator.
    Failed,
}

impl SagaState {
    /// Whether the saga is over (nothing more will happen to it).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            SagaState::Committed | SagaState::Compensated | SagaState::Failed
        )
    }

    /// Upper-case name, as in the REST API.
    pub fn as_str(self) -> &'static str {
        match self {
            SagaState::Running => "RUNNING",
            SagaState::Compensating => "COMPENSATING",
            SagaState::Committed => "COMMITTED",
            SagaState::Compensated => "COMPENSATED",
            SagaState::Failed => "FAILED",
        }
    }
}

/// What is kept of a saga once it is finished (and shown for live ones).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SagaSummary {
    /// The global transaction id.
    pub global_tx_id: String,
    /// The service that started it.
    pub service_name: String,
    /// Its state.
    pub state: SagaState,
    /// When it started (reporter's clock, ms since the epoch).
    pub started_ms: i64,
    /// When it reached `state` if terminal (coordinator's clock), else 0.
    pub finished_ms: i64,
    /// Sub-transactions started.
    pub sub_transactions: u32,
    /// Sub-transactions compensated.
    pub compensated: u32,
    /// Events recorded for it.
    pub events: u32,
}

/// A filter for listing sagas; empty fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SagaQuery {
    /// Only sagas in this state.
    pub state: Option<SagaState>,
    /// Only sagas started by this service.
    pub service_name: Option<String>,
    /// Only sagas started at or after this time (ms since the epoch).
    pub since_ms: Option<i64>,
    /// Only sagas started before this time (ms since the epoch).
    pub until_ms: Option<i64>,
    /// Only this saga (the REST API's lookup of one finished saga). Stores
    /// keep no index on ids (random ids would slow every group commit), so
    /// this scans the summaries kept, which retention bounds.
    pub global_tx_id: Option<String>,
    /// At most this many, newest first (0 = the store's default page size).
    pub limit: usize,
}

/// Counts for the statistics endpoint and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct StoreStats {
    /// Events currently in the log (not yet compacted).
    pub events: u64,
    /// Summaries kept, per terminal state name.
    pub finished: Vec<(String, u64)>,
    /// Group commits so far (each one sync).
    pub commits: u64,
    /// Bytes on disk, if known.
    pub disk_bytes: Option<u64>,
}

/// Why the store failed. The coordinator answers participants with an error
/// (never an acknowledgement) when `append` fails.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The storage engine reported an error.
    #[error("saga store error: {0}")]
    Engine(String),
    /// The store cannot be reached (e.g. PostgreSQL is down).
    #[error("saga store unavailable: {0}; check that the database is running and reachable")]
    Unavailable(String),
    /// Stored data could not be read back.
    #[error("saga store holds data it cannot read: {0}")]
    Corrupt(String),
    /// The store was shut down.
    #[error("saga store is closed")]
    Closed,
}

/// The durable event log. See the module docs for the contract.
pub trait SagaStore: Send + Sync + 'static {
    /// A short name for logs and bench reports (`"sqlite"`, `"postgres"`, ...).
    fn name(&self) -> &'static str;

    /// Appends `events` durably; resolves once they are synced.
    ///
    /// # Errors
    /// [`StoreError`] if they could not be made durable: none of them may
    /// then be acknowledged.
    fn append(&self, events: Vec<EventRecord>) -> BoxFuture<'_, Result<(), StoreError>>;

    /// [`append`](SagaStore::append) for a caller that keeps the events
    /// (the coordinator applies them once they are durable): the same
    /// contract, without a copy of every event. The default copies them
    /// into `append`; the durable stores override it.
    ///
    /// # Errors
    /// As `append`.
    fn append_shared(
        &self,
        events: std::sync::Arc<Vec<EventRecord>>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move { self.append(events.to_vec()).await })
    }

    /// Marks sagas as finished: their events may be compacted and their
    /// summaries are kept (within the store's retention).
    ///
    /// # Errors
    /// [`StoreError`]; the sagas then stay unfinished and are recovered
    /// (idempotently) after a restart.
    fn finish(&self, done: Vec<SagaSummary>) -> BoxFuture<'_, Result<(), StoreError>>;

    /// Every event of every unfinished saga, in append order.
    ///
    /// # Errors
    /// [`StoreError`].
    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<EventRecord>, StoreError>>;

    /// Finished sagas matching `query`, newest started first (ties: the
    /// later finished first), at most `query.limit`.
    ///
    /// # Errors
    /// [`StoreError`].
    fn finished(&self, query: SagaQuery) -> BoxFuture<'_, Result<Vec<SagaSummary>, StoreError>>;

    /// The events still stored for one saga, in append order (empty once
    /// compacted).
    ///
    /// # Errors
    /// [`StoreError`].
    fn timeline(&self, global_tx_id: String)
        -> BoxFuture<'_, Result<Vec<EventRecord>, StoreError>>;

    /// Counts for statistics.
    ///
    /// # Errors
    /// [`StoreError`].
    fn stats(&self) -> BoxFuture<'_, Result<StoreStats, StoreError>>;
}
