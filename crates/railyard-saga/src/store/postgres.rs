//! The PostgreSQL store: the log on a database server (its replication and
//! backups). One coordinator per database: rows carry no owner, so the
//! writer's session holds an advisory lock (`OWNER_LOCK`) and a second
//! coordinator on the same database is refused.
//!
//! # Client
//! `tokio-postgres` rather than sqlx: one connection is one task we drive
//! ourselves (exactly the "one writer owns the connection" shape), it
//! pipelines statements, binds Rust `Vec`s as PostgreSQL arrays (a commit's
//! summaries go in one `INSERT ... SELECT FROM UNNEST(...)` whatever their
//! number, under one prepared statement; its events are one `bytea`
//! segment), and it brings no compile-time query checking that would need a
//! database to build.
//!
//! # Group commit
//! One **writer task** owns the write connection. It runs on a thread of
//! its own (a current-thread runtime): packing a large commit (up to
//! `max_batch_rows` events) can take milliseconds of CPU, which must not
//! land on the coordinator's async workers. It waits for the first
//! request on the bounded queue (see [`queue`](super::queue) for
//! back-pressure), drains what else is waiting, and runs one transaction:
//! the commit's segment (unless the commit frees it at once), the old
//! segments it strips to their marks (read first, rarely: see
//! [`segment`](super::segment)), the segments it frees, the summaries of
//! its finishes, then `COMMIT`, all pipelined (sent in one burst, one
//! round trip). The session sets `synchronous_commit = on`, so `COMMIT` returns
//! only after the WAL record is flushed to disk: each waiter is answered
//! after that. While a commit is in flight the next batch accumulates in
//! the queue.
//!
//! # Layout
//! The embedded store's (see [`segment`](super::segment)): one
//! `railyard_saga_segments` row per group commit, every event and finish
//! of the commit packed in it in queue order, keyed by a `seq` the writer
//! assigns. A commit is one insert at the right edge of one B-tree,
//! however many sagas it carries. No index on saga ids: the writer keeps
//! the in-memory [`Index`] of which segments each unfinished saga has
//! entries in, rebuilt from the segments when the writer starts and after
//! a commit whose outcome it does not know (failed, timed out). A segment
//! nothing needs any more is deleted in the commit that frees it.
//!
//! Schema version 1 had one `railyard_saga_events` row per saga per
//! commit, indexed by saga id, and one summary per saga (unique). That
//! index was a third of the server's work under load (2026-11-28 profile,
//! docs/benchmarks.md), and deleting a finished saga's rows walked it
//! again. A version-1 database is migrated on connect: each row becomes a
//! one-entry segment under its `seq`.
//!
//! # Reads
//! A second connection serves `unfinished`, `finished`, `timeline` and
//! `stats`. `unfinished` and `timeline` replay the segments in order
//! (bounded by the sagas in flight, as the embedded store's).
//!
//! # Outages
//! When the server cannot be reached, calls fail with
//! [`StoreError::Unavailable`] naming the address; the next call reconnects.
//! Nothing is acknowledged that was not committed.
//!
//! # Schema
//! Tables `railyard_saga_segments`, `railyard_saga_summaries` (finishing a
//! saga twice keeps two, as the other stores do; newest first by `ord`,
//! indexed by finish time for pruning) and `railyard_saga_meta` (schema
//! version), created on connect under an advisory lock (a schema lock apart
//! from the owner lock above). A second coordinator on one database never
//! gets that far: the owner lock is taken first, when the schema step opens
//! its connection, and refuses it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::mpsc;

use tokio_postgres::{Client, NoTls, Row, Statement};

use super::queue::{answer, submit, take_batch, Retention, WriteOp, WriteRequest, DEFAULT_PAGE};
use super::segment::{self, Index, Rebuild, Replay, SegmentBuf, STRIP_LAG};
use super::sqlite::parse_state;
use super::{SagaQuery, SagaState, SagaStore, SagaSummary, StoreError, StoreStats};
use crate::event::EventRecord;

/// The schema this code writes, kept in `railyard_saga_meta`: 2 (segments,
/// see "Layout"; version 1 is migrated on connect).
const SCHEMA_VERSION: i32 = 2;

/// Settings of the PostgreSQL store.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PostgresConfig {
    /// Connection string, URL (`postgres://user@127.0.0.1:5432/db`) or
    /// key-value (`host=... port=... user=...`) form.
    pub url: String,
    /// Append/finish requests that may wait for the writer; callers wait
    /// when it is full. Default 4,096.
    pub queue_capacity: usize,
    /// Most rows (events or summaries) written in one group commit.
    /// Default 16,384.
    pub max_batch_rows: usize,
    /// How many finished summaries to keep.
    pub retention: Retention,
    /// How long to wait for a connection, seconds. Default 5.
    pub connect_timeout_secs: u64,
    /// How long one group commit may take, seconds. A server that stops
    /// answering without closing the connection (a host cut off, a stopped
    /// process) then fails the commit as `Unavailable` (nothing
    /// acknowledged; a restart recovers whatever did land) and the next one
    /// connects again, instead of every append waiting for TCP to give up
    /// (minutes to hours). Default 30.
    pub commit_timeout_secs: u64,
}

impl Default for PostgresConfig {
    fn default() -> Self {
        Self {
            url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            queue_capacity: 4096,
            max_batch_rows: 16_384,
            retention: Retention::default(),
            connect_timeout_secs: 5,
            commit_timeout_secs: 30,
        }
    }
}

impl PostgresConfig {
    /// Defaults with this connection string.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }
}

/// The PostgreSQL store. See the module docs.
///
/// Dropping it closes the queue; the writer task finishes what it took and
/// ends.
pub struct PostgresStore {
    queue: mpsc::Sender<WriteRequest>,
    reader: Arc<Connector>,
    commits: Arc<AtomicU64>,
    /// The writer's `index.live_events`, for `stats`.
    live_events: Arc<AtomicU64>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("server", &self.reader.target)
            .finish_non_exhaustive()
    }
}

/// Connects (and reconnects) one connection.
struct Connector {
    config: tokio_postgres::Config,
    /// `host:port` for messages (never the password).
    target: String,
    /// The live client, if any; a short std lock, never held across await.
    client: Mutex<Option<Arc<Client>>>,
    /// The writer's connector holds [`OWNER_LOCK`] in each session it opens
    /// (one coordinator per database); readers hold nothing.
    owner: bool,
    /// The server process of the writer's last session: a reconnect ends it
    /// first. After a commit timeout or a partition the server may keep
    /// that session (and its lock) until it notices the client is gone,
    /// which would lock this coordinator out of its own database.
    last_backend: Mutex<Option<i32>>,
    /// Bound on the set-up queries of a new session (`connect_timeout`).
    setup_timeout: Duration,
}

/// The session-level advisory lock the writer's connection holds: rows
/// carry no owner, so a second coordinator on the same database would
/// recover and drive the first one's sagas. (7261746 is the schema lock.)
const OWNER_LOCK: i64 = 7_261_747;

/// How long a new writer session waits for [`OWNER_LOCK`] before it takes
/// the holder for another coordinator (a killed coordinator's session lets
/// go of it once the server notices; a restart must not be refused for it).
const OWNER_WAIT: Duration = Duration::from_secs(5);

impl Connector {
    fn new(config: &PostgresConfig) -> Result<Self, StoreError> {
        let mut pg: tokio_postgres::Config = config.url.parse().map_err(|e| {
            StoreError::Unavailable(format!(
                "invalid PostgreSQL connection string: {e}; expected e.g. \
                 postgres://user@127.0.0.1:5432/dbname"
            ))
        })?;
        pg.connect_timeout(Duration::from_secs(config.connect_timeout_secs.max(1)));
        // A server that vanished without closing (host down, cable cut) is
        // noticed in about half a minute rather than TCP's defaults (2 h of
        // idle before keep-alives, ~15 min of retransmissions), unless the
        // connection string says otherwise.
        if pg.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
            pg.keepalives_idle(Duration::from_secs(10));
            pg.keepalives_interval(Duration::from_secs(5));
            pg.keepalives_retries(3);
        }
        if pg.get_tcp_user_timeout().is_none() {
            pg.tcp_user_timeout(Duration::from_secs(30));
        }
        pg.application_name("railyard-saga");
        let hosts: Vec<String> = pg
            .get_hosts()
            .iter()
            .map(|h| match h {
                tokio_postgres::config::Host::Tcp(s) => s.clone(),
                tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
            })
            .collect();
        let port = pg.get_ports().first().copied().unwrap_or(5432);
        Ok(Self {
            target: format!("{}:{port}", hosts.join(",")),
            config: pg,
            client: Mutex::new(None),
            owner: false,
            last_backend: Mutex::new(None),
            setup_timeout: Duration::from_secs(config.connect_timeout_secs.max(1)),
        })
    }

    /// The writer's connector: see [`OWNER_LOCK`].
    fn owner(config: &PostgresConfig) -> Result<Self, StoreError> {
        Ok(Self {
            owner: true,
            ..Self::new(config)?
        })
    }

    fn unavailable(&self, e: &tokio_postgres::Error) -> StoreError {
        StoreError::Unavailable(format!("PostgreSQL at {} ({e})", self.target))
    }

    /// Maps a query error: a lost connection is an outage, the rest is an
    /// engine error with the server's message.
    fn error(&self, e: &tokio_postgres::Error) -> StoreError {
        if e.is_closed() || e.as_db_error().is_none() {
            self.unavailable(e)
        } else {
            let msg = e
                .as_db_error()
                .map_or_else(|| e.to_string(), |d| d.message().to_owned());
            StoreError::Engine(format!("PostgreSQL: {msg}"))
        }
    }

    /// The current client, connecting if there is none or it closed.
    async fn get(&self) -> Result<Arc<Client>, StoreError> {
        if let Some(c) = self.client.lock().as_ref() {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let (client, conn) = self
            .config
            .connect(NoTls)
            .await
            .map_err(|e| self.unavailable(&e))?;
        // The connection task ends when the client is dropped or the server
        // goes away; the client then reports `is_closed`.
        let target = self.target.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(server = %target, error = %e, "saga store connection ended");
            }
        });
        tokio::time::timeout(self.setup_timeout + OWNER_WAIT, self.set_up(&client))
            .await
            .map_err(|_| {
                StoreError::Unavailable(format!(
                    "PostgreSQL at {} did not answer a new session's set-up within {:?}",
                    self.target,
                    self.setup_timeout + OWNER_WAIT
                ))
            })??;
        let client = Arc::new(client);
        *self.client.lock() = Some(client.clone());
        Ok(client)
    }

    /// A new session's settings; for the writer, its lock.
    async fn set_up(&self, client: &Client) -> Result<(), StoreError> {
        // Server-side keep-alives: the server notices a vanished client
        // (and ends its session, releasing its lock) in about half a
        // minute. Ignored on a Unix socket.
        client
            .batch_execute(
                "SET synchronous_commit = on; SET tcp_keepalives_idle = 10; \
                 SET tcp_keepalives_interval = 5; SET tcp_keepalives_count = 3",
            )
            .await
            .map_err(|e| self.error(&e))?;
        if self.owner {
            let old = self.last_backend.lock().take();
            if let Some(pid) = old {
                // This coordinator's previous session, if the server still
                // has it and it still holds the lock (a process id can be
                // reused): ours to end (same role).
                let _ = client
                    .execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_locks \
                         WHERE locktype = 'advisory' AND objid::bigint = $1 AND pid = $2",
                        &[&OWNER_LOCK, &pid],
                    )
                    .await;
            }
            // Held by this session until it ends (a reconnect takes it
            // again, unless another coordinator took it meanwhile). A
            // session that ended (ours just now, or a coordinator killed a
            // moment ago and restarting) lets go of it once its server
            // process notices and exits: asked again for up to OWNER_WAIT.
            let until = tokio::time::Instant::now() + OWNER_WAIT;
            let held = loop {
                let row = client
                    .query_one("SELECT pg_try_advisory_lock($1)", &[&OWNER_LOCK])
                    .await
                    .map_err(|e| self.error(&e))?;
                let held = row.get::<_, bool>(0);
                if held || tokio::time::Instant::now() >= until {
                    break held;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            if !held {
                return Err(StoreError::Engine(format!(
                    "another Railyard saga coordinator uses the database at {} (it holds \
                     advisory lock {OWNER_LOCK}): the PostgreSQL store takes one coordinator \
                     per database, since its rows carry no owner; give this coordinator a \
                     database of its own, or stop the other one (if its host died, the server \
                     keeps its session until it notices; end it now with SELECT \
                     pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND \
                     objid = {OWNER_LOCK})",
                    self.target
                )));
            }
            let row = client
                .query_one("SELECT pg_backend_pid()", &[])
                .await
                .map_err(|e| self.error(&e))?;
            *self.last_backend.lock() = Some(row.get::<_, i32>(0));
        }
        Ok(())
    }
}

const SUMMARY_COLUMNS: &str = "global_tx_id, service_name, state, started_ms, finished_ms, \
    sub_transactions, compensated, events";

/// The log's table: made with [`SCHEMA`] on a new database, and by
/// [`migrate_1_to_2`] on a version-1 one.
const SEGMENTS_TABLE: &str =
    "CREATE TABLE railyard_saga_segments (seq BIGINT PRIMARY KEY, data BYTEA NOT NULL)";

const SCHEMA: &str = "
CREATE TABLE railyard_saga_summaries (
    ord BIGSERIAL PRIMARY KEY,
    global_tx_id TEXT NOT NULL,
    service_name TEXT NOT NULL,
    state TEXT NOT NULL,
    started_ms BIGINT NOT NULL,
    finished_ms BIGINT NOT NULL,
    sub_transactions BIGINT NOT NULL,
    compensated BIGINT NOT NULL,
    events BIGINT NOT NULL
);
CREATE INDEX railyard_saga_summaries_by_finish ON railyard_saga_summaries (finished_ms);
";

/// Version 1 to 2, after the segments table exists and the version-1 rows
/// were copied into it: the per-saga rows and the uniqueness of summaries
/// go.
const MIGRATE_1_TO_2: &str = "
DROP TABLE railyard_saga_events;
ALTER TABLE railyard_saga_summaries DROP CONSTRAINT IF EXISTS railyard_saga_summaries_global_tx_id_key;
UPDATE railyard_saga_meta SET version = 2;
";

/// Creates the schema (once, under an advisory lock) and checks its version.
async fn ensure_schema(conn: &Connector) -> Result<(), StoreError> {
    let c = conn.get().await?;
    let err = |e: tokio_postgres::Error| conn.error(&e);
    c.batch_execute("BEGIN; SELECT pg_advisory_xact_lock(7261746);")
        .await
        .map_err(err)?;
    let result = async {
        c.batch_execute("CREATE TABLE IF NOT EXISTS railyard_saga_meta (version INT NOT NULL)")
            .await
            .map_err(err)?;
        let row = c
            .query_opt("SELECT max(version) FROM railyard_saga_meta", &[])
            .await
            .map_err(err)?;
        let version: Option<i32> = row.and_then(|r| r.get::<_, Option<i32>>(0));
        match version {
            None => {
                c.batch_execute(SEGMENTS_TABLE).await.map_err(err)?;
                c.batch_execute(SCHEMA).await.map_err(err)?;
                c.execute(
                    "INSERT INTO railyard_saga_meta (version) VALUES ($1)",
                    &[&SCHEMA_VERSION],
                )
                .await
                .map_err(err)?;
            }
            Some(1) => migrate_1_to_2(&c).await.map_err(|e| {
                StoreError::Corrupt(format!(
                    "cannot bring the saga schema from version 1 to {SCHEMA_VERSION}: {}",
                    conn.error(&e)
                ))
            })?,
            Some(SCHEMA_VERSION) => {}
            Some(v) if v > SCHEMA_VERSION => {
                return Err(StoreError::Corrupt(format!(
                    "the database holds saga schema version {v}, newer than this \
                     Railyard's ({SCHEMA_VERSION}); run a newer Railyard"
                )));
            }
            Some(v) => {
                return Err(StoreError::Corrupt(format!(
                    "the database holds saga schema version {v}, which no Railyard wrote; \
                     point the store at another database"
                )));
            }
        }
        c.batch_execute("COMMIT").await.map_err(err)
    }
    .await;
    if result.is_err() {
        let _ = c.batch_execute("ROLLBACK").await;
    }
    result
}

/// Version 1's `railyard_saga_events` rows (one saga's events of one
/// commit, packed by [`codec`](super::codec) version 1) become one-entry
/// segments under the same `seq`, so the order holds; then
/// [`MIGRATE_1_TO_2`]. Runs inside [`ensure_schema`]'s transaction.
async fn migrate_1_to_2(c: &Client) -> Result<(), tokio_postgres::Error> {
    c.batch_execute(SEGMENTS_TABLE).await?;
    let rows = c
        .query(
            "SELECT seq, global_tx_id, data FROM railyard_saga_events ORDER BY seq",
            &[],
        )
        .await?;
    let (seqs, data): (Vec<i64>, Vec<Vec<u8>>) = rows
        .iter()
        .map(|r| {
            (
                r.get::<_, i64>(0),
                SegmentBuf::packed(r.get::<_, &str>(1), r.get::<_, &[u8]>(2)),
            )
        })
        .unzip();
    c.execute(
        "INSERT INTO railyard_saga_segments (seq, data)
         SELECT * FROM UNNEST($1::int8[], $2::bytea[])",
        &[&seqs, &data],
    )
    .await?;
    c.batch_execute(MIGRATE_1_TO_2).await
}

impl PostgresStore {
    /// Connects, creates the schema if missing and starts the writer (a
    /// thread of its own). Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] if the server cannot be reached (the
    /// message names the address) or the string is invalid;
    /// [`StoreError::Corrupt`] if the database holds a newer or unknown
    /// schema, or its migration failed.
    pub async fn connect(config: PostgresConfig) -> Result<Self, StoreError> {
        let reader = Arc::new(Connector::new(&config)?);
        let mut writer = Writer {
            conn: Connector::owner(&config)?,
            statements: None,
            retention: config.retention.clone(),
            max_rows: config.max_batch_rows.max(1),
            commits: Arc::new(AtomicU64::new(0)),
            live_events: Arc::new(AtomicU64::new(0)),
            since_prune: 0,
            commit_timeout: Duration::from_secs(config.commit_timeout_secs.max(1)),
            index: Index::default(),
            next_seq: 1,
            seg: SegmentBuf::default(),
            stale: true,
        };
        let commits = writer.commits.clone();
        let live_events = writer.live_events.clone();
        let (tx, rx) = mpsc::channel(config.queue_capacity.max(1));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| StoreError::Engine(format!("cannot build the writer's runtime: {e}")))?;
        // The writer connects once, on its own thread, whose runtime then
        // drives every commit's socket I/O (not the caller's workers): the
        // schema and the first prune run there, and `connect` waits for them.
        let (mut ready_tx, ready) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("saga-pg-writer".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let set_up = async {
                        ensure_schema(&writer.conn).await?;
                        writer.load().await?;
                        writer.prune().await
                    };
                    // A caller that gave up on `connect` (dropped or timed
                    // out) stops the set-up too: no thread or connection is
                    // left waiting on the schema lock for it.
                    let set_up = tokio::select! {
                        r = set_up => r,
                        () = ready_tx.closed() => return,
                    };
                    let ok = set_up.is_ok();
                    if ready_tx.send(set_up).is_ok() && ok {
                        // Ends when every sender of the queue is gone (the
                        // store dropped).
                        writer.run(rx).await;
                    }
                });
            })
            .map_err(|e| StoreError::Engine(format!("cannot start the writer thread: {e}")))?;
        ready.await.map_err(|_| {
            StoreError::Engine("the store's writer thread stopped before it was ready".into())
        })??;
        reader.get().await?;
        Ok(Self {
            queue: tx,
            reader,
            commits,
            live_events,
        })
    }
}

/// Prepared statements of the writer's current connection.
struct Statements {
    client: Arc<Client>,
    /// The commit's segment.
    insert: Statement,
    /// Segments stripped to their marks (see [`segment`](super::segment)).
    strip: Statement,
    /// Segments nothing needs any more.
    delete: Statement,
    /// The commit's summaries.
    keep: Statement,
}

struct Writer {
    conn: Connector,
    statements: Option<Statements>,
    retention: Retention,
    max_rows: usize,
    commits: Arc<AtomicU64>,
    /// `index.live_events`, for `stats` on other threads.
    live_events: Arc<AtomicU64>,
    since_prune: u64,
    /// See [`PostgresConfig::commit_timeout_secs`].
    commit_timeout: Duration,
    /// Which segments each unfinished saga has entries in, and what keeps
    /// each segment (see [`segment`](super::segment)).
    index: Index,
    /// The next segment's `seq`: above every one stored, and never used
    /// twice (a commit whose answer was lost may have landed).
    next_seq: i64,
    /// The segment being built, kept across commits.
    seg: SegmentBuf,
    /// The index may disagree with the database (a commit failed or timed
    /// out after the index counted it): it is read back before the next
    /// commit.
    stale: bool,
}

impl Writer {
    /// Forgets the connection (and its prepared statements): the next
    /// commit connects again.
    fn drop_connection(&mut self) {
        self.statements = None;
        self.conn.client.lock().take();
    }

    async fn run(mut self, mut rx: mpsc::Receiver<WriteRequest>) {
        while let Some(first) = rx.recv().await {
            let batch = take_batch(first, &mut rx, self.max_rows);
            let result = match self.load_if_stale().await {
                Ok(()) => self.write(&batch).await,
                Err(e) => Err(e),
            };
            if let Err(e) = &result {
                tracing::error!(error = %e, requests = batch.len(), "saga store commit failed");
            }
            answer(batch, &result);
        }
    }

    /// Reads the index back if a commit left it unsure; until that
    /// succeeds nothing is written (tried again before each batch, so an
    /// outage need not wait for a restart).
    ///
    /// What it reads is final. A commit the server refused was rolled back
    /// on this session. One whose answer was lost (a timeout) went through
    /// a connection that was dropped, and the session that reads holds
    /// [`OWNER_LOCK`], which it got only once that session ended (ended by
    /// it, or noticed gone by the server): that commit has landed or rolled
    /// back.
    async fn load_if_stale(&mut self) -> Result<(), StoreError> {
        if !self.stale {
            return Ok(());
        }
        let result = match tokio::time::timeout(self.commit_timeout, self.load()).await {
            Ok(r) => r,
            Err(_) => {
                self.drop_connection();
                Err(StoreError::Unavailable(format!(
                    "PostgreSQL at {} did not answer reading the saga log within {:?}",
                    self.conn.target, self.commit_timeout
                )))
            }
        };
        match &result {
            Ok(()) => tracing::info!("the saga log was read back; the store writes again"),
            Err(e) => {
                tracing::error!(error = %e, "reading the saga log back after a failed commit failed; nothing is written until it reads back");
            }
        }
        result
    }

    /// (Re)builds the index from the stored segments and deletes those
    /// nothing needs (left by a crash between a commit and the next).
    async fn load(&mut self) -> Result<(), StoreError> {
        let c = self.conn.get().await?;
        let err = |e: tokio_postgres::Error| self.conn.error(&e);
        let rows = c
            .query(
                "SELECT seq, data FROM railyard_saga_segments ORDER BY seq",
                &[],
            )
            .await
            .map_err(err)?;
        let mut rebuild = Rebuild::default();
        for r in &rows {
            rebuild.segment(r.get(0), r.get(1))?;
        }
        drop(rows);
        let (index, gone, max_seq) = rebuild.finish();
        if !gone.is_empty() {
            c.execute(
                "DELETE FROM railyard_saga_segments WHERE seq = ANY($1)",
                &[&gone],
            )
            .await
            .map_err(err)?;
        }
        self.live_events.store(index.live_events, Ordering::Relaxed);
        self.index = index;
        self.next_seq = self.next_seq.max(max_seq + 1);
        self.stale = false;
        Ok(())
    }

    async fn statements(&mut self) -> Result<&Statements, StoreError> {
        let fresh = match &self.statements {
            Some(s) => s.client.is_closed(),
            None => true,
        };
        if fresh {
            self.statements = None;
            let client = self.conn.get().await?;
            let err = |e: tokio_postgres::Error| self.conn.error(&e);
            let insert = client
                .prepare("INSERT INTO railyard_saga_segments (seq, data) VALUES ($1, $2)")
                .await
                .map_err(err)?;
            let strip = client
                .prepare(
                    "UPDATE railyard_saga_segments SET data = t.d
                     FROM UNNEST($1::int8[], $2::bytea[]) AS t(s, d) WHERE seq = t.s",
                )
                .await
                .map_err(err)?;
            let delete = client
                .prepare("DELETE FROM railyard_saga_segments WHERE seq = ANY($1)")
                .await
                .map_err(err)?;
            let keep = client
                .prepare(&format!(
                    "INSERT INTO railyard_saga_summaries ({SUMMARY_COLUMNS})
                     SELECT c1, c2, c3, c4, c5, c6, c7, c8
                     FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[],
                        $6::int8[], $7::int8[], $8::int8[])
                     WITH ORDINALITY AS t(c1, c2, c3, c4, c5, c6, c7, c8, ord)
                     ORDER BY ord"
                ))
                .await
                .map_err(err)?;
            self.statements = Some(Statements {
                client,
                insert,
                strip,
                delete,
                keep,
            });
        }
        self.statements.as_ref().ok_or(StoreError::Closed)
    }

    /// One transaction for the whole batch: its segment, the segments it
    /// strips and frees, its summaries, in queue order. On error the index
    /// is marked stale (read back before the next commit).
    async fn write(&mut self, batch: &[WriteRequest]) -> Result<(), StoreError> {
        // The connection first: a server that cannot be reached fails the
        // batch before the index counted it.
        let st = self.statements().await?;
        let (c, insert, strip, delete, keep) = (
            st.client.clone(),
            st.insert.clone(),
            st.strip.clone(),
            st.delete.clone(),
            st.keep.clone(),
        );
        // Whatever happens below, this `seq` is never used again.
        let seq = self.next_seq;
        self.next_seq += 1;
        self.stale = true;
        let commit = segment::apply(batch, seq, &mut self.seg, &mut self.index);
        let summaries = commit.keep;
        let finished = summaries.len() as u64;
        let mut gone = commit.gone;
        // Old segments kept only by their pins lose their dead entries (see
        // `segment`'s module docs). Rare: only behind a saga that stays
        // unfinished for more than `STRIP_LAG` commits. They are read first
        // (one round trip): they are older than any commit in flight, and
        // this writer is the only one that changes them.
        let due = self.index.take_strip_due(seq - STRIP_LAG);
        let mut stripped: Vec<(i64, Vec<u8>)> = Vec::new();
        if !due.is_empty() {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&due];
            let read = c.query(
                "SELECT seq, data FROM railyard_saga_segments WHERE seq = ANY($1)",
                &params,
            );
            let rows = match tokio::time::timeout(self.commit_timeout, read).await {
                Ok(rows) => rows.map_err(|e| self.conn.error(&e))?,
                Err(_) => return Err(self.timed_out(c, "reading segments to strip")),
            };
            for r in &rows {
                let s: i64 = r.get(0);
                if let Some(marks) = segment::strip(s, r.get(1)) {
                    stripped.push((s, marks));
                }
            }
        }
        let (strip_seqs, strip_data): (Vec<i64>, Vec<Vec<u8>>) = stripped.into_iter().unzip();
        gone.extend(self.index.stripped(&strip_seqs));
        let col =
            |f: fn(&SagaSummary) -> i64| -> Vec<i64> { summaries.iter().map(|s| f(s)).collect() };
        let ids: Vec<&str> = summaries.iter().map(|s| s.global_tx_id.as_str()).collect();
        let services: Vec<&str> = summaries.iter().map(|s| s.service_name.as_str()).collect();
        let states: Vec<&str> = summaries.iter().map(|s| s.state.as_str()).collect();
        let nums = [
            col(|s| s.started_ms),
            col(|s| s.finished_ms),
            col(|s| i64::from(s.sub_transactions)),
            col(|s| i64::from(s.compensated)),
            col(|s| i64::from(s.events)),
        ];
        let data: Option<&[u8]> = commit.store_segment.then(|| self.seg.finish());

        let mut pipeline: Vec<BoxFuture<'_, Result<(), tokio_postgres::Error>>> = Vec::new();
        pipeline.push(Box::pin(c.batch_execute("BEGIN")));
        if let Some(data) = &data {
            pipeline.push(Box::pin(async {
                c.execute(&insert, &[&seq, data]).await.map(drop)
            }));
        }
        if !strip_seqs.is_empty() {
            pipeline.push(Box::pin(async {
                c.execute(&strip, &[&strip_seqs, &strip_data])
                    .await
                    .map(drop)
            }));
        }
        if !gone.is_empty() {
            pipeline.push(Box::pin(async {
                c.execute(&delete, &[&gone]).await.map(drop)
            }));
        }
        if !ids.is_empty() {
            pipeline.push(Box::pin(async {
                c.execute(
                    &keep,
                    &[
                        &ids, &services, &states, &nums[0], &nums[1], &nums[2], &nums[3], &nums[4],
                    ],
                )
                .await
                .map(drop)
            }));
        }
        // synchronous_commit = on: COMMIT returns once the WAL is flushed.
        pipeline.push(Box::pin(c.batch_execute("COMMIT")));
        let result = tokio::time::timeout(self.commit_timeout, in_order(pipeline)).await;
        let result = match result {
            Ok(r) => r,
            Err(_) => return Err(self.timed_out(c, "a commit")),
        };
        if let Err(e) = result {
            if !c.is_closed()
                && tokio::time::timeout(self.commit_timeout, c.batch_execute("ROLLBACK"))
                    .await
                    .is_err()
            {
                drop(c);
                self.drop_connection();
            }
            return Err(self.conn.error(&e));
        }
        self.stale = false;
        self.seg.give_back_if_large();
        self.live_events
            .store(self.index.live_events, Ordering::Relaxed);
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.since_prune = self.since_prune.saturating_add(finished);
        if finished > 0 && self.since_prune >= self.retention.slack() {
            self.since_prune = 0;
            // Bounded like a commit: a server gone silent here would
            // otherwise hold every later append.
            match tokio::time::timeout(self.commit_timeout, self.prune()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "pruning saga summaries failed"),
                Err(_) => {
                    self.drop_connection();
                    tracing::warn!(timeout = ?self.commit_timeout, "pruning saga summaries got no answer in time; reconnecting");
                }
            }
        }
        Ok(())
    }

    /// `what` got no answer within the commit timeout: the connection is
    /// dropped (the next commit connects again) and nothing of the commit
    /// was acknowledged.
    fn timed_out(&mut self, c: Arc<Client>, what: &str) -> StoreError {
        drop(c);
        self.drop_connection();
        StoreError::Unavailable(format!(
            "PostgreSQL at {} did not answer {what} within {:?}; nothing of it was \
             acknowledged (a restart recovers whatever landed); reconnecting",
            self.conn.target, self.commit_timeout
        ))
    }

    /// Drops summaries beyond the retention.
    async fn prune(&mut self) -> Result<(), StoreError> {
        let c = self.conn.get().await?;
        let err = |e: tokio_postgres::Error| self.conn.error(&e);
        if let Some(cutoff) = self.retention.cutoff_ms() {
            c.execute(
                "DELETE FROM railyard_saga_summaries WHERE finished_ms < $1",
                &[&cutoff],
            )
            .await
            .map_err(err)?;
        }
        if let Some(max) = self.retention.max_summaries {
            let max = i64::try_from(max).unwrap_or(i64::MAX);
            if max == 0 {
                c.execute("DELETE FROM railyard_saga_summaries", &[])
                    .await
                    .map_err(err)?;
            } else {
                c.execute(
                    "DELETE FROM railyard_saga_summaries WHERE ord < (
                        SELECT ord FROM railyard_saga_summaries
                        ORDER BY ord DESC OFFSET $1 LIMIT 1)",
                    &[&(max - 1)],
                )
                .await
                .map_err(err)?;
            }
        }
        Ok(())
    }
}

/// Runs statements pipelined: tokio-postgres sends a request when its
/// future is first polled, and this polls them in order every time, so the
/// whole transaction leaves in one burst and costs one round trip plus the
/// WAL flush. The first error (in order) wins; after it the server has
/// aborted the transaction and the final COMMIT rolls it back.
async fn in_order(
    mut futs: Vec<BoxFuture<'_, Result<(), tokio_postgres::Error>>>,
) -> Result<(), tokio_postgres::Error> {
    let mut done = vec![false; futs.len()];
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, d) in futs.iter_mut().zip(done.iter_mut()) {
            if *d {
                continue;
            }
            match f.as_mut().poll(cx) {
                std::task::Poll::Ready(Ok(())) => *d = true,
                std::task::Poll::Ready(Err(e)) => return std::task::Poll::Ready(Err(e)),
                std::task::Poll::Pending => pending = true,
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(Ok(()))
        }
    })
    .await
}

/// Replays segment rows (`data`, in `seq` order): the events left of
/// every unfinished saga, or of `only` that one, in append order.
fn replay(rows: &[Row], only: Option<&str>) -> Result<Vec<EventRecord>, StoreError> {
    let mut replay = Replay::default();
    for r in rows {
        replay
            .segment(r.get(0), only)
            .map_err(|e| StoreError::Corrupt(format!("log segment: {e}")))?;
    }
    Ok(replay.into_events())
}

fn summary_from_row(r: &Row) -> Result<SagaSummary, StoreError> {
    let state: &str = r.get(2);
    let state = parse_state(state)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown saga state {state}")))?;
    let n = |i: usize| u32::try_from(r.get::<_, i64>(i)).unwrap_or(u32::MAX);
    Ok(SagaSummary {
        global_tx_id: r.get(0),
        service_name: r.get(1),
        state,
        started_ms: r.get(3),
        finished_ms: r.get(4),
        sub_transactions: n(5),
        compensated: n(6),
        events: n(7),
    })
}

impl PostgresStore {
    async fn query(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let c = self.reader.get().await?;
        c.query(sql, params)
            .await
            .map_err(|e| self.reader.error(&e))
    }
}

/// Whether a text field holds `\0` (PostgreSQL's `text` cannot).
fn has_nul(e: &EventRecord) -> bool {
    [
        e.global_tx_id.as_str(),
        &e.local_tx_id,
        &e.parent_tx_id,
        &e.service_name,
        &e.instance_id,
        &e.compensation_method,
        &e.retry_method,
    ]
    .iter()
    .any(|s| s.contains('\0'))
}

impl SagaStore for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn append(&self, events: Vec<EventRecord>) -> BoxFuture<'_, Result<(), StoreError>> {
        self.append_shared(events.into())
    }

    fn append_shared(
        &self,
        events: std::sync::Arc<Vec<EventRecord>>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            if events.is_empty() {
                return Ok(());
            }
            // Rejected here, alone, rather than failing the whole group
            // commit it would join.
            if let Some(e) = events.iter().find(|e| has_nul(e)) {
                return Err(StoreError::Engine(format!(
                    "an event of saga {:?} has a NUL character in a text field, which \
                     PostgreSQL cannot store; nothing of this append was written",
                    e.global_tx_id
                )));
            }
            submit(&self.queue, WriteOp::Append(events)).await
        })
    }

    fn finish(&self, done: Vec<SagaSummary>) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            if done.is_empty() {
                return Ok(());
            }
            if let Some(s) = done
                .iter()
                .find(|s| s.global_tx_id.contains('\0') || s.service_name.contains('\0'))
            {
                return Err(StoreError::Engine(format!(
                    "the summary of saga {:?} has a NUL character, which PostgreSQL cannot \
                     store",
                    s.global_tx_id
                )));
            }
            submit(&self.queue, WriteOp::Finish(done)).await
        })
    }

    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<EventRecord>, StoreError>> {
        Box::pin(async move {
            let rows = self
                .query("SELECT data FROM railyard_saga_segments ORDER BY seq", &[])
                .await?;
            // The whole log after a crash: decoded off the async workers,
            // like the embedded store's replay.
            tokio::task::spawn_blocking(move || replay(&rows, None))
                .await
                .map_err(|e| StoreError::Engine(format!("decoding the saga log panicked: {e}")))?
        })
    }

    fn finished(&self, query: SagaQuery) -> BoxFuture<'_, Result<Vec<SagaSummary>, StoreError>> {
        Box::pin(async move {
            let limit = if query.limit == 0 {
                DEFAULT_PAGE
            } else {
                query.limit
            };
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let state = query.state.map(SagaState::as_str);
            let rows = self
                .query(
                    &format!(
                        "SELECT {SUMMARY_COLUMNS} FROM railyard_saga_summaries
                         WHERE ($1::text IS NULL OR state = $1)
                           AND ($2::text IS NULL OR service_name = $2)
                           AND ($3::int8 IS NULL OR started_ms >= $3)
                           AND ($4::int8 IS NULL OR started_ms < $4)
                           AND ($6::text IS NULL OR global_tx_id = $6)
                         ORDER BY started_ms DESC, ord DESC LIMIT $5"
                    ),
                    &[
                        &state,
                        &query.service_name,
                        &query.since_ms,
                        &query.until_ms,
                        &limit,
                        &query.global_tx_id,
                    ],
                )
                .await?;
            rows.iter().map(summary_from_row).collect()
        })
    }

    fn timeline(
        &self,
        global_tx_id: String,
    ) -> BoxFuture<'_, Result<Vec<EventRecord>, StoreError>> {
        Box::pin(async move {
            // No index on saga ids (see "Layout"): the log is replayed for
            // this saga alone; it holds only the sagas in flight.
            let rows = self
                .query("SELECT data FROM railyard_saga_segments ORDER BY seq", &[])
                .await?;
            tokio::task::spawn_blocking(move || replay(&rows, Some(&global_tx_id)))
                .await
                .map_err(|e| StoreError::Engine(format!("decoding the saga log panicked: {e}")))?
        })
    }

    fn stats(&self) -> BoxFuture<'_, Result<StoreStats, StoreError>> {
        Box::pin(async move {
            let finished = self
                .query(
                    "SELECT state, count(*) FROM railyard_saga_summaries
                     GROUP BY state ORDER BY state",
                    &[],
                )
                .await?;
            let size = self
                .query(
                    "SELECT pg_total_relation_size('railyard_saga_segments')
                          + pg_total_relation_size('railyard_saga_summaries')",
                    &[],
                )
                .await?;
            let size: Option<i64> = size.first().and_then(|r| r.get(0));
            Ok(StoreStats {
                events: self.live_events.load(Ordering::Relaxed),
                finished: finished
                    .iter()
                    .map(|r| {
                        (
                            r.get::<_, String>(0),
                            u64::try_from(r.get::<_, i64>(1)).unwrap_or(0),
                        )
                    })
                    .collect(),
                commits: self.commits.load(Ordering::Relaxed),
                disk_bytes: size.and_then(|s| u64::try_from(s).ok()),
            })
        })
    }
}
