//! The embedded default: SQLite (bundled, nothing to install) in WAL mode in
//! a data directory.
//!
//! # Why SQLite
//! Measured against fjall (an embedded LSM) behind the same group commit
//! (`benches/store_append.rs`, figures and command in `docs/saga-store.md`):
//! medians of 3 runs on the 2-core machine, durable events/s (p99 append
//! latency): 8-event appends from 64 callers 328k (13.8 ms) vs 153k
//! (15.4 ms); from 512 callers 302k (43 ms) vs 261k (43 ms); Omega's
//! one-event appends from 512 callers 86k (24 ms) vs 80k (31 ms). SQLite
//! was as fast or faster in every shape, and it is the more trusted engine:
//! decades of use, exhaustive crash and power-loss testing, a stable
//! documented file format that operators can open with the `sqlite3` shell.
//!
//! # Durability
//! `journal_mode=WAL` with `synchronous=FULL`: every commit syncs the WAL
//! (`fsync`: the bundled build does not use `fdatasync`) before it returns,
//! so a committed transaction survives a process crash and a power loss. (`NORMAL`, SQLite's usual WAL pairing, only syncs at
//! checkpoints and would lose acknowledged events on power loss.) One
//! transaction, one sync, per group commit.
//!
//! # Threads
//! - one **writer thread** owns the write connection: it blocks on the
//!   bounded queue (see [`queue`](super::queue) for back-pressure), drains
//!   every waiting request, writes them in one transaction, commits (one
//!   sync) and answers each waiter;
//! - reads (`unfinished`, `finished`, `timeline`, `stats`) use a second
//!   connection on tokio's blocking pool, so they never stall an async
//!   worker nor the writer (WAL readers do not block the writer).
//!
//! # Layout
//! One row per group commit (`segments`: `seq`, and every event and finish
//! of that commit packed in queue order by [`segment`](super::segment)):
//! a commit is one B-tree insert however many events it carries, instead
//! of one row per saga (an earlier layout, which cost a row insert per
//! event and a delete per event at compaction, since a participant's
//! events rarely share a commit). No index on saga ids: the writer keeps
//! an in-memory [`Index`] of which segments each unfinished saga has
//! entries in (bounded by the sagas in flight, rebuilt on open by reading
//! the segments' headers). Recovery and `timeline` replay the segments in
//! order. Summaries are rows in `summaries`, newest first by `ord`,
//! indexed by finish time for pruning; finishing a saga twice keeps two
//! summaries (as [`MemoryStore`](super::MemoryStore)).
//!
//! # Bounded disk
//! `finish` writes a mark in the commit's segment and keeps a summary
//! row; a segment is deleted in the commit that makes it unneeded (no
//! unfinished saga in it, no mark in it covering an earlier segment still
//! stored; freed pages are reused by later appends); summaries beyond the [`Retention`] are
//! pruned. The WAL is checkpointed by the writer every 10,000 pages by default,
//! about 40 MiB ([`SqliteConfig::wal_checkpoint_pages`]; so it
//! can restart from its beginning and stays bounded) and truncated to 64 MiB
//! at most. Free pages stay in the file for later commits, so the file
//! keeps its high-water size (bounded by the sagas in flight and the
//! retention); a store created with [`SqliteConfig::reclaim_free_pages`]
//! (`auto_vacuum=INCREMENTAL`) instead returns free pages beyond 4 MiB to
//! the file system after each prune and every 1,024 commits, at the cost
//! of a pointer-map page written by every commit.
//!
//! # Files
//! `<dir>/saga.db` (+ `-wal`, `-shm`), and `<dir>/LOCK`, held with `flock`
//! so two coordinators never share one directory. Schema version in
//! `PRAGMA user_version` (4; versions 1 to 3 are migrated on open, a
//! newer one is refused).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use rusqlite::{params, Connection, OpenFlags, Row};
use tokio::sync::mpsc;

use super::queue::{answer, submit, take_batch, Retention, WriteOp, WriteRequest, DEFAULT_PAGE};
use super::segment::{self, Index, Rebuild, Replay, SegmentBuf, STRIP_LAG};
use super::{SagaQuery, SagaState, SagaStore, SagaSummary, StoreError, StoreStats};
use crate::event::EventRecord;

/// The schema this code writes; stored in `PRAGMA user_version`.
///
/// - 1: events with an index on the saga id, summaries unique per saga;
/// - 2: neither; one `events` row per saga per group commit;
/// - 3: one `segments` row per group commit (see "Layout"); versions 1
///   and 2 are migrated on open;
/// - 4: the same tables; new segments are written in segment version 2
///   (a string table, events in codec version 2), which a version-3
///   Railyard could not read. Version 3 opens as 4 unchanged: its
///   segments are still read.
const SCHEMA_VERSION: i64 = 4;

/// The current tables, created in a new store.
const SCHEMA: &str = "
    CREATE TABLE segments (
        seq INTEGER PRIMARY KEY,
        data BLOB NOT NULL
    );
    CREATE TABLE summaries (
        ord INTEGER PRIMARY KEY,
        global_tx_id TEXT NOT NULL,
        service_name TEXT NOT NULL,
        state TEXT NOT NULL,
        started_ms INTEGER NOT NULL,
        finished_ms INTEGER NOT NULL,
        sub_transactions INTEGER NOT NULL,
        compensated INTEGER NOT NULL,
        events INTEGER NOT NULL
    );
    CREATE INDEX summaries_by_finish ON summaries (finished_ms);
    PRAGMA user_version = 4;";

/// Version 1 to 2: drop the saga-id index, rebuild summaries without the
/// unique constraint (same rows, same order).
const MIGRATE_1_TO_2: &str = "
    DROP INDEX IF EXISTS events_by_saga;
    ALTER TABLE summaries RENAME TO summaries_v1;
    CREATE TABLE summaries (
        ord INTEGER PRIMARY KEY,
        global_tx_id TEXT NOT NULL,
        service_name TEXT NOT NULL,
        state TEXT NOT NULL,
        started_ms INTEGER NOT NULL,
        finished_ms INTEGER NOT NULL,
        sub_transactions INTEGER NOT NULL,
        compensated INTEGER NOT NULL,
        events INTEGER NOT NULL
    );
    INSERT INTO summaries SELECT ord, global_tx_id, service_name, state, started_ms,
        finished_ms, sub_transactions, compensated, events FROM summaries_v1 ORDER BY ord;
    DROP TABLE summaries_v1;
    CREATE INDEX summaries_by_finish ON summaries (finished_ms);
    PRAGMA user_version = 2;";

/// Settings of the embedded store; every field has a default.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SqliteConfig {
    /// Append/finish requests that may wait for the writer; callers wait
    /// when it is full. Default 4,096.
    pub queue_capacity: usize,
    /// Most rows (events or summaries) written in one group commit; more
    /// waiting requests go in the next one. Default 16,384.
    pub max_batch_rows: usize,
    /// How many finished summaries to keep.
    pub retention: Retention,
    /// The WAL is checkpointed into the database once it holds this many
    /// pages (4 KiB each). Default 10,000 (about 40 MiB of WAL on disk): a
    /// checkpoint writes each page once however many times the WAL holds
    /// it, so a longer interval writes the pages that deleted segments
    /// free and later commits reuse fewer times; a shorter one keeps the
    /// WAL file smaller.
    pub wal_checkpoint_pages: u32,
    /// Whether a store created with this setting gives free pages back to
    /// the file system (SQLite's `auto_vacuum=INCREMENTAL`: after a prune
    /// and every 1,024 commits, free pages beyond 4 MiB are cut from the
    /// file). Default `false`:
    /// free pages stay in the file and later commits reuse them, so the
    /// file keeps its high-water size, which the in-flight sagas and the
    /// retention bound. Incremental vacuum keeps a pointer map that every
    /// commit updates (each commit allocates its segment's pages and frees
    /// those of dead segments), one more page written per commit: measured
    /// with `railyard bench saga --protocol native --store embedded`, 4-7 %
    /// fewer transactions/s (see `docs/saga-store.md`). Fixed when the
    /// file is created: an existing store keeps the mode it was made with.
    pub reclaim_free_pages: bool,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 4096,
            max_batch_rows: 16_384,
            retention: Retention::default(),
            wal_checkpoint_pages: 10_000,
            reclaim_free_pages: false,
        }
    }
}

/// The embedded durable store. See the module docs.
///
/// Dropping it closes the queue and joins the writer thread once it has
/// written what was queued (a few milliseconds at most).
pub struct SqliteStore {
    queue: Option<mpsc::Sender<WriteRequest>>,
    reader: Arc<Mutex<Connection>>,
    commits: Arc<AtomicU64>,
    /// Events of unfinished sagas, kept by the writer.
    live_events: Arc<AtomicU64>,
    writer: Option<JoinHandle<()>>,
    dir: PathBuf,
    // Held for the store's life: the flock on `<dir>/LOCK`.
    _lock: File,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn engine(e: rusqlite::Error) -> StoreError {
    StoreError::Engine(e.to_string())
}

impl SqliteStore {
    /// Opens (creating if needed) the store in `dir` and starts its writer
    /// thread. The file work runs on tokio's blocking pool.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] if the directory cannot be created or is
    /// in use by another process; [`StoreError::Corrupt`] if it holds a
    /// newer schema or not a database; [`StoreError::Engine`] otherwise.
    pub async fn open(dir: impl AsRef<Path>, config: SqliteConfig) -> Result<Self, StoreError> {
        let dir = dir.as_ref().to_path_buf();
        tokio::task::spawn_blocking(move || Self::open_blocking(dir, config))
            .await
            .map_err(|e| StoreError::Engine(format!("opening the store panicked: {e}")))?
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn open_blocking(dir: PathBuf, config: SqliteConfig) -> Result<Self, StoreError> {
        std::fs::create_dir_all(&dir).map_err(|e| {
            StoreError::Unavailable(format!(
                "cannot create data directory {}: {e}",
                dir.display()
            ))
        })?;
        let lock = lock_dir(&dir)?;
        let path = dir.join("saga.db");
        let mut writer = Connection::open(&path).map_err(engine)?;
        let reclaims = prepare_writer(&mut writer, &config)?;
        let reader = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(engine)?;
        reader
            .busy_timeout(std::time::Duration::from_secs(10))
            .map_err(engine)?;
        let (tx, rx) = mpsc::channel(config.queue_capacity.max(1));
        let commits = Arc::new(AtomicU64::new(0));
        let live_events = Arc::new(AtomicU64::new(0));
        let summaries: i64 = writer
            .query_row("SELECT count(*) FROM summaries", [], |r| r.get(0))
            .map_err(engine)?;
        let mut w = Writer {
            conn: writer,
            config,
            commits: commits.clone(),
            live_events: live_events.clone(),
            since_prune: u64::MAX,
            index: Index::default(),
            next_seq: 1,
            summaries: u64::try_from(summaries).unwrap_or(0),
            seg: SegmentBuf::default(),
            reclaims,
            since_give_back: 0,
        };
        // Index the segments (and drop those nothing needs), then apply the
        // retention once (a smaller limit takes effect without waiting for
        // new summaries).
        w.load().map_err(corrupt_or_engine)?;
        w.prune().map_err(engine)?;
        w.since_prune = 0;
        let handle = std::thread::Builder::new()
            .name("saga-sqlite-writer".into())
            .spawn(move || w.run(rx))
            .map_err(|e| StoreError::Engine(format!("cannot start the writer thread: {e}")))?;
        Ok(Self {
            queue: Some(tx),
            reader: Arc::new(Mutex::new(reader)),
            commits,
            live_events,
            writer: Some(handle),
            dir,
            _lock: lock,
        })
    }

    fn queue(&self) -> Result<&mpsc::Sender<WriteRequest>, StoreError> {
        self.queue.as_ref().ok_or(StoreError::Closed)
    }

    /// Runs `f` with the reader connection on the blocking pool.
    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let reader = self.reader.clone();
        tokio::task::spawn_blocking(move || {
            // A std-style lock on a blocking-pool thread: reads are short and
            // rare (REST queries, recovery), so one connection suffices.
            let conn = reader.lock();
            f(&conn).map_err(engine)
        })
        .await
        .map_err(|e| StoreError::Engine(format!("a read panicked: {e}")))?
    }
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        // Closing the queue ends the writer after it answered what it took.
        self.queue = None;
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
    }
}

/// Takes an exclusive, non-blocking flock on `<dir>/LOCK`; released by the
/// kernel when the file closes or the process dies.
fn lock_dir(dir: &Path) -> Result<File, StoreError> {
    use std::os::fd::AsRawFd;
    let path = dir.join("LOCK");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| StoreError::Unavailable(format!("cannot open {}: {e}", path.display())))?;
    // Safety: `flock` on a file descriptor we own and keep open; no memory
    // is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        return Err(StoreError::Unavailable(format!(
            "data directory {} is in use by another process (it holds {})",
            dir.display(),
            path.display()
        )));
    }
    Ok(file)
}

/// Sets up the write connection (migrating an older schema) and returns
/// whether the file gives free pages back (`auto_vacuum=INCREMENTAL`; see
/// [`SqliteConfig::reclaim_free_pages`]).
fn prepare_writer(conn: &mut Connection, config: &SqliteConfig) -> Result<bool, StoreError> {
    conn.busy_timeout(std::time::Duration::from_secs(10))
        .map_err(engine)?;
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(|e| StoreError::Corrupt(format!("not a Railyard saga store: {e}")))?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::Corrupt(format!(
            "schema version {version} is newer than this Railyard's ({SCHEMA_VERSION}); \
             run a newer Railyard or point it at another data directory"
        )));
    }
    if version == 0 {
        // Must precede the first table to take effect.
        conn.execute_batch(if config.reclaim_free_pages {
            "PRAGMA auto_vacuum = INCREMENTAL"
        } else {
            "PRAGMA auto_vacuum = NONE"
        })
        .map_err(engine)?;
    }
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(engine)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Engine(format!(
            "the file system refused WAL mode (journal_mode is {mode})"
        )));
    }
    conn.execute_batch(&format!(
        "PRAGMA synchronous = FULL;
         PRAGMA wal_autocheckpoint = {};
         PRAGMA journal_size_limit = 67108864;",
        config.wal_checkpoint_pages.max(1)
    ))
    .map_err(engine)?;
    // 0 none, 1 full, 2 incremental (as created; only a VACUUM changes it).
    let vacuum: i64 = conn
        .query_row("PRAGMA auto_vacuum", [], |r| r.get(0))
        .map_err(engine)?;
    let reclaims = vacuum == 2;
    if version > 0 && reclaims != config.reclaim_free_pages {
        tracing::info!(
            reclaims,
            "the saga store keeps the free-page mode it was created with \
             (reclaim_free_pages applies to new stores)"
        );
    }
    if version == SCHEMA_VERSION {
        return Ok(reclaims);
    }
    let tx = conn.transaction().map_err(engine)?;
    let migrated = match version {
        0 => tx.execute_batch(SCHEMA),
        1 => tx
            .execute_batch(MIGRATE_1_TO_2)
            .and_then(|()| migrate_2_to_3(&tx))
            .and_then(|()| tx.execute_batch("PRAGMA user_version = 4")),
        2 => migrate_2_to_3(&tx).and_then(|()| tx.execute_batch("PRAGMA user_version = 4")),
        3 => tx.execute_batch("PRAGMA user_version = 4"),
        _ => {
            return Err(StoreError::Corrupt(format!(
                "schema version {version} is not one Railyard wrote; point it at another data directory"
            )))
        }
    };
    migrated.map_err(|e| {
        StoreError::Corrupt(format!(
            "cannot bring the schema from version {version} to {SCHEMA_VERSION}: {e}"
        ))
    })?;
    tx.commit().map_err(engine)?;
    Ok(reclaims)
}

/// Version 2 to 3: each `events` row (one saga's events of one commit)
/// becomes a segment with one entry, under the same `seq`, so the order
/// holds.
fn migrate_2_to_3(tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<()> {
    tx.execute_batch("CREATE TABLE segments (seq INTEGER PRIMARY KEY, data BLOB NOT NULL)")?;
    {
        let mut read = tx.prepare("SELECT seq, global_tx_id, data FROM events ORDER BY seq")?;
        let mut write = tx.prepare("INSERT INTO segments (seq, data) VALUES (?1, ?2)")?;
        let mut rows = read.query([])?;
        while let Some(r) = rows.next()? {
            let seq: i64 = r.get(0)?;
            let g: String = r.get(1)?;
            let data = r.get_ref(2)?.as_blob()?;
            write.execute(params![seq, SegmentBuf::packed(&g, data)])?;
        }
    }
    tx.execute_batch("DROP TABLE events; PRAGMA user_version = 3;")
}

/// The writer thread's state.
struct Writer {
    conn: Connection,
    config: SqliteConfig,
    commits: Arc<AtomicU64>,
    /// `index.live_events`, for `stats` on other threads.
    live_events: Arc<AtomicU64>,
    /// Summaries finished since the last prune.
    since_prune: u64,
    /// Which segments each unfinished saga has entries in, and what keeps
    /// each segment (see [`segment`](super::segment)).
    index: Index,
    /// The next segment's `seq` (above every one stored).
    next_seq: i64,
    /// Rows in `summaries`, so pruning by count needs no count query.
    summaries: u64,
    /// The segment being built, kept across commits (see [`SegmentBuf`]).
    seg: SegmentBuf,
    /// The file gives free pages back (see
    /// [`SqliteConfig::reclaim_free_pages`]).
    reclaims: bool,
    /// Commits since free pages were last given back (or checked); counted
    /// only in a file that gives them back.
    since_give_back: u64,
}

/// Commits between two checks for free pages to give back, in a file that
/// does (a check reads page 1; giving back writes what it moves).
const GIVE_BACK_COMMITS: u64 = 1024;

impl Writer {
    fn run(mut self, mut rx: mpsc::Receiver<WriteRequest>) {
        let max_rows = self.config.max_batch_rows.max(1);
        // `blocking_recv` is fine: this is a dedicated thread, not a tokio
        // worker. It returns `None` once every sender is gone.
        // Set when the index could not be rebuilt after a failed commit: it
        // may then disagree with the file (events of the failed commit
        // counted, segments its finishes freed forgotten), so nothing more
        // is written until the log reads back (tried before each batch).
        let mut broken: Option<String> = None;
        while let Some(first) = rx.blocking_recv() {
            let batch = take_batch(first, &mut rx, max_rows);
            if let Some(why) = &broken {
                // Tried again before each batch: a passing error (busy, I/O)
                // need not wait for a restart.
                match self.load() {
                    Ok(()) => {
                        tracing::info!("the saga log was re-read; the store writes again");
                        broken = None;
                    }
                    Err(_) => {
                        answer(batch, &Err(StoreError::Engine(why.clone())));
                        continue;
                    }
                }
            }
            let result = self.write(&batch).map_err(engine);
            if let Err(e) = &result {
                tracing::error!(error = %e, requests = batch.len(), "saga store commit failed");
                // The index already counted the failed commit: rebuild it
                // from what is stored.
                if let Err(e) = self.load() {
                    tracing::error!(error = %e, "re-reading the saga log after a failed commit failed; the store refuses writes until it reads back");
                    broken = Some(format!(
                        "the saga log could not be re-read after a failed commit ({e}); writes \
                         resume once it reads back: check the disk, or restart the coordinator \
                         (it rebuilds its index from the file)"
                    ));
                }
            }
            answer(batch, &result);
        }
    }

    /// (Re)builds the index from the stored segments and deletes those
    /// nothing needs (left by a crash between a commit and the next).
    fn load(&mut self) -> Result<(), StoreError> {
        let mut rebuild = Rebuild::default();
        {
            let mut st = self
                .conn
                .prepare_cached("SELECT seq, data FROM segments ORDER BY seq")
                .map_err(engine)?;
            let mut rows = st.query([]).map_err(engine)?;
            while let Some(r) = rows.next().map_err(engine)? {
                let seq: i64 = r.get(0).map_err(engine)?;
                let data = r
                    .get_ref(1)
                    .and_then(|v| Ok(v.as_blob()?))
                    .map_err(engine)?;
                rebuild.segment(seq, data)?;
            }
        }
        let (index, gone, max_seq) = rebuild.finish();
        if !gone.is_empty() {
            let tx = self.conn.transaction().map_err(engine)?;
            {
                let mut delete = tx
                    .prepare_cached("DELETE FROM segments WHERE seq = ?1")
                    .map_err(engine)?;
                for seq in gone {
                    delete.execute([seq]).map_err(engine)?;
                }
            }
            tx.commit().map_err(engine)?;
        }
        self.live_events.store(index.live_events, Ordering::Relaxed);
        self.index = index;
        self.next_seq = self.next_seq.max(max_seq + 1);
        Ok(())
    }

    /// One transaction for the whole batch: its segment, the segments it
    /// frees, its summaries; `commit` syncs the WAL.
    ///
    /// Requests are applied in queue order. On error the index is stale
    /// (the caller reloads it).
    fn write(&mut self, batch: &[WriteRequest]) -> rusqlite::Result<()> {
        let seq = self.next_seq;
        let seg = &mut self.seg;
        let commit = segment::apply(batch, seq, seg, &mut self.index);
        let finished = commit.keep.len() as u64;
        let mut gone = commit.gone;
        let tx = self.conn.transaction()?;
        {
            let mut keep = tx.prepare_cached(
                "INSERT INTO summaries (global_tx_id, service_name, state, started_ms,
                    finished_ms, sub_transactions, compensated, events)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?;
            for s in commit.keep {
                keep.execute(params![
                    s.global_tx_id,
                    s.service_name,
                    s.state.as_str(),
                    s.started_ms,
                    s.finished_ms,
                    s.sub_transactions,
                    s.compensated,
                    s.events,
                ])?;
            }
            if commit.store_segment {
                tx.prepare_cached("INSERT INTO segments (seq, data) VALUES (?1, ?2)")?
                    .execute(params![seq, seg.finish()])?;
            }
            // Old segments kept only by their pins lose their dead entries
            // (see `segment`'s module docs), which frees the segments whose
            // pins those entries held up. Rare: only behind a saga that
            // stays unfinished for more than `STRIP_LAG` commits.
            let mut stripped = Vec::new();
            for s in self.index.take_strip_due(seq - STRIP_LAG) {
                let data: Vec<u8> = tx
                    .prepare_cached("SELECT data FROM segments WHERE seq = ?1")?
                    .query_row([s], |r| r.get(0))?;
                if let Some(marks) = segment::strip(s, &data) {
                    tx.prepare_cached("UPDATE segments SET data = ?2 WHERE seq = ?1")?
                        .execute(params![s, marks])?;
                    stripped.push(s);
                }
            }
            gone.extend(self.index.stripped(&stripped));
            if !gone.is_empty() {
                let mut delete = tx.prepare_cached("DELETE FROM segments WHERE seq = ?1")?;
                for s in gone {
                    delete.execute([s])?;
                }
            }
        }
        self.next_seq += 1;
        tx.commit()?;
        self.seg.give_back_if_large();
        self.live_events
            .store(self.index.live_events, Ordering::Relaxed);
        self.summaries += finished;
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.since_prune = self.since_prune.saturating_add(finished);
        if finished > 0 && self.since_prune >= self.config.retention.slack() {
            self.since_prune = 0;
            // Pruning failing does not undo the commit: log and go on.
            if let Err(e) = self.prune() {
                tracing::warn!(error = %e, "pruning saga summaries failed");
            }
        } else if self.reclaims {
            self.since_give_back += 1;
            if self.since_give_back >= GIVE_BACK_COMMITS {
                if let Err(e) = self.give_back() {
                    tracing::warn!(error = %e, "giving free pages back failed");
                }
            }
        }
        Ok(())
    }

    /// Drops summaries beyond the retention (in one transaction, one
    /// sync), then gives back free pages. Costs what it deletes: the count
    /// is kept in memory and the oldest rows go first by `ord`.
    fn prune(&mut self) -> rusqlite::Result<()> {
        let r = &self.config.retention;
        let mut removed = 0;
        let tx = self.conn.transaction()?;
        if let Some(cutoff) = r.cutoff_ms() {
            removed += tx.execute("DELETE FROM summaries WHERE finished_ms < ?1", [cutoff])?;
        }
        let left = self.summaries.saturating_sub(removed as u64);
        if let Some(excess) = r.max_summaries.and_then(|max| left.checked_sub(max)) {
            if excess > 0 {
                removed += tx.execute(
                    "DELETE FROM summaries WHERE ord IN
                        (SELECT ord FROM summaries ORDER BY ord LIMIT ?1)",
                    [i64::try_from(excess).unwrap_or(i64::MAX)],
                )?;
            }
        }
        tx.commit()?;
        self.summaries = self.summaries.saturating_sub(removed as u64);
        self.give_back()
    }

    /// In a file made with [`SqliteConfig::reclaim_free_pages`]: returns
    /// free pages beyond 1,024 (4 MiB, kept for the next commits) to the
    /// file system. Runs after each prune and every [`GIVE_BACK_COMMITS`]
    /// commits (most free pages come from deleted segments, not from pruned
    /// summaries, and a retention that never prunes must not keep them).
    fn give_back(&mut self) -> rusqlite::Result<()> {
        self.since_give_back = 0;
        if !self.reclaims {
            return Ok(());
        }
        let free: i64 = self
            .conn
            .query_row("PRAGMA freelist_count", [], |row| row.get(0))?;
        if free > 1024 {
            // The pragma frees one page per step (each answers a row): step
            // it to the end. (`execute_batch` steps a statement once, which
            // gave back one page per prune until 2026-11-27.)
            let mut vacuum = self
                .conn
                .prepare(&format!("PRAGMA incremental_vacuum({})", free - 1024))?;
            let mut pages = vacuum.query([])?;
            while pages.next()?.is_some() {}
        }
        Ok(())
    }
}

const SUMMARY_COLUMNS: &str = "global_tx_id, service_name, state, started_ms, finished_ms,
    sub_transactions, compensated, events";

/// Replays rows of `data` (segments in `seq` order): the events left of
/// every unfinished saga, or of `only` that one, in append order.
fn replay_rows(
    rows: &mut rusqlite::Rows<'_>,
    only: Option<&str>,
) -> rusqlite::Result<Vec<EventRecord>> {
    let mut replay = Replay::default();
    while let Some(r) = rows.next()? {
        let data = r.get_ref(0)?.as_blob()?;
        replay.segment(data, only).map_err(|e| {
            rusqlite::Error::FromSqlConversionFailure(
                0,
                rusqlite::types::Type::Blob,
                format!("log segment: {e}").into(),
            )
        })?;
    }
    Ok(replay.into_events())
}

pub(crate) fn parse_state(s: &str) -> Option<SagaState> {
    [
        SagaState::Running,
        SagaState::Compensating,
        SagaState::Committed,
        SagaState::Compensated,
        SagaState::Failed,
    ]
    .into_iter()
    .find(|st| st.as_str() == s)
}

fn summary_from_row(r: &Row<'_>) -> rusqlite::Result<SagaSummary> {
    let state: String = r.get(2)?;
    let state = parse_state(&state).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            2,
            rusqlite::types::Type::Text,
            format!("unknown saga state {state}").into(),
        )
    })?;
    Ok(SagaSummary {
        global_tx_id: r.get(0)?,
        service_name: r.get(1)?,
        state,
        started_ms: r.get(3)?,
        finished_ms: r.get(4)?,
        sub_transactions: r.get(5)?,
        compensated: r.get(6)?,
        events: r.get(7)?,
    })
}

fn corrupt_or_engine(e: StoreError) -> StoreError {
    match e {
        StoreError::Engine(m) if m.contains("Conversion error") || m.contains("log segment") => {
            StoreError::Corrupt(m)
        }
        other => other,
    }
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

impl SagaStore for SqliteStore {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    fn append(&self, events: Vec<EventRecord>) -> BoxFuture<'_, Result<(), StoreError>> {
        self.append_shared(events.into())
    }

    fn append_shared(
        &self,
        events: Arc<Vec<EventRecord>>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            if events.is_empty() {
                return Ok(());
            }
            submit(self.queue()?, WriteOp::Append(events)).await
        })
    }

    fn finish(&self, done: Vec<SagaSummary>) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            if done.is_empty() {
                return Ok(());
            }
            submit(self.queue()?, WriteOp::Finish(done)).await
        })
    }

    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<EventRecord>, StoreError>> {
        Box::pin(async move {
            self.read(|c| {
                let mut st = c.prepare_cached("SELECT data FROM segments ORDER BY seq")?;
                let mut rows = st.query([])?;
                replay_rows(&mut rows, None)
            })
            .await
            .map_err(corrupt_or_engine)
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
            self.read(move |c| {
                let mut st = c.prepare_cached(&format!(
                    "SELECT {SUMMARY_COLUMNS} FROM summaries
                     WHERE (?1 IS NULL OR state = ?1)
                       AND (?2 IS NULL OR service_name = ?2)
                       AND (?3 IS NULL OR started_ms >= ?3)
                       AND (?4 IS NULL OR started_ms < ?4)
                       AND (?6 IS NULL OR global_tx_id = ?6)
                     ORDER BY started_ms DESC, ord DESC LIMIT ?5"
                ))?;
                let rows = st.query_map(
                    params![
                        query.state.map(SagaState::as_str),
                        query.service_name,
                        query.since_ms,
                        query.until_ms,
                        limit,
                        query.global_tx_id
                    ],
                    summary_from_row,
                )?;
                rows.collect()
            })
            .await
            .map_err(corrupt_or_engine)
        })
    }

    fn timeline(
        &self,
        global_tx_id: String,
    ) -> BoxFuture<'_, Result<Vec<EventRecord>, StoreError>> {
        Box::pin(async move {
            self.read(move |c| {
                let mut st = c.prepare_cached("SELECT data FROM segments ORDER BY seq")?;
                let mut rows = st.query([])?;
                replay_rows(&mut rows, Some(&global_tx_id))
            })
            .await
            .map_err(corrupt_or_engine)
        })
    }

    fn stats(&self) -> BoxFuture<'_, Result<StoreStats, StoreError>> {
        Box::pin(async move {
            let commits = self.commits.load(Ordering::Relaxed);
            let db = self.dir.join("saga.db");
            let events = self.live_events.load(Ordering::Relaxed);
            // The file sizes too are read on the blocking pool: `stat` is
            // file-system work, not for an async worker.
            let (finished, disk) = self
                .read(move |c| {
                    let mut st = c.prepare_cached(
                        "SELECT state, count(*) FROM summaries GROUP BY state ORDER BY state",
                    )?;
                    let finished = st
                        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?
                        .collect::<rusqlite::Result<Vec<_>>>()?;
                    let disk = file_len(&db)
                        + file_len(&db.with_extension("db-wal"))
                        + file_len(&db.with_extension("db-shm"));
                    Ok((finished, disk))
                })
                .await?;
            Ok(StoreStats {
                events,
                finished: finished
                    .into_iter()
                    .map(|(s, n)| (s, u64::try_from(n).unwrap_or(0)))
                    .collect(),
                commits,
                disk_bytes: Some(disk),
            })
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::codec;
    use super::*;
    use crate::event::EventKind;

    /// A TxStarted of `local` in saga `g` (also used by `segment`'s tests).
    pub(crate) fn ev(g: &str, local: &str) -> EventRecord {
        EventRecord {
            global_tx_id: g.into(),
            local_tx_id: local.into(),
            kind: Some(EventKind::TxStarted),
            ..EventRecord::default()
        }
    }

    pub(crate) fn summary(g: &str) -> SagaSummary {
        SagaSummary {
            global_tx_id: g.into(),
            service_name: "svc".into(),
            state: SagaState::Committed,
            started_ms: 1,
            finished_ms: 2,
            sub_transactions: 1,
            compensated: 0,
            events: 1,
        }
    }

    pub(crate) fn app(events: Vec<EventRecord>) -> WriteRequest {
        req(WriteOp::Append(events.into()))
    }

    pub(crate) fn req(op: WriteOp) -> WriteRequest {
        let (done, _) = tokio::sync::oneshot::channel();
        WriteRequest { op, done }
    }

    fn locals(conn: &Connection) -> Vec<String> {
        let mut st = conn
            .prepare("SELECT data FROM segments ORDER BY seq")
            .unwrap();
        let mut rows = st.query([]).unwrap();
        replay_rows(&mut rows, None)
            .unwrap()
            .into_iter()
            .map(|e| e.local_tx_id)
            .collect()
    }

    /// The default settings with a WAL checkpointed every 1,000 pages.
    fn small_wal() -> SqliteConfig {
        SqliteConfig {
            wal_checkpoint_pages: 1000,
            ..SqliteConfig::default()
        }
    }

    fn writer(conn: Connection) -> Writer {
        let mut w = Writer {
            conn,
            config: SqliteConfig::default(),
            commits: Arc::new(AtomicU64::new(0)),
            live_events: Arc::new(AtomicU64::new(0)),
            since_prune: 0,
            index: Index::default(),
            next_seq: 1,
            summaries: 0,
            seg: SegmentBuf::default(),
            reclaims: false,
            since_give_back: 0,
        };
        w.load().unwrap();
        w
    }

    fn segments(conn: &Connection) -> i64 {
        conn.query_row("SELECT count(*) FROM segments", [], |r| r.get(0))
            .unwrap()
    }

    /// Version-1 and version-2 stores (one row per saga per commit) open
    /// as version 4 with their events intact and in order (in version-1
    /// segments, which are still read beside new ones).
    #[test]
    fn migrates_versions_1_and_2() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("saga.db");
        {
            let c = Connection::open(&path).unwrap();
            c.execute_batch(
                "CREATE TABLE events (seq INTEGER PRIMARY KEY, global_tx_id TEXT NOT NULL,
                    n INTEGER NOT NULL, data BLOB NOT NULL);
                 CREATE INDEX events_by_saga ON events (global_tx_id, seq);
                 CREATE TABLE summaries (ord INTEGER PRIMARY KEY,
                    global_tx_id TEXT NOT NULL UNIQUE, service_name TEXT NOT NULL,
                    state TEXT NOT NULL, started_ms INTEGER NOT NULL,
                    finished_ms INTEGER NOT NULL, sub_transactions INTEGER NOT NULL,
                    compensated INTEGER NOT NULL, events INTEGER NOT NULL);
                 CREATE INDEX summaries_by_finish ON summaries (finished_ms);
                 INSERT INTO summaries VALUES (7, 'old', 'svc', 'COMMITTED', 1, 2, 1, 0, 8);
                 PRAGMA user_version = 1;",
            )
            .unwrap();
            for (g, l) in [("g", "l0"), ("h", "h0"), ("g", "l1")] {
                let data = codec::encode([ev(g, l)].iter());
                c.execute(
                    "INSERT INTO events (global_tx_id, n, data) VALUES (?1, 1, ?2)",
                    params![g, data],
                )
                .unwrap();
            }
        }
        let mut c = Connection::open(&path).unwrap();
        prepare_writer(&mut c, &small_wal()).unwrap();
        let v: i64 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        assert_eq!(locals(&c), ["l0", "h0", "l1"]);
        let old: i64 = c
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE name IN ('events', 'events_by_saga')",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(old, 0);
        // Summaries kept, and a second one for the same saga is accepted.
        c.execute(
            "INSERT INTO summaries (global_tx_id, service_name, state, started_ms, finished_ms,
                sub_transactions, compensated, events)
             VALUES ('old', 'svc', 'FAILED', 1, 3, 1, 0, 8)",
            [],
        )
        .unwrap();
        let ords: Vec<i64> = c
            .prepare("SELECT ord FROM summaries ORDER BY ord")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(ords, [7, 8]);
        // The writer indexes the migrated segments and goes on after them.
        let mut w = writer(c);
        assert_eq!(w.index.live_events, 3);
        assert_eq!(w.next_seq, 4);
        // A new commit (segment version 2) replays after the migrated
        // version-1 segments, and finishing a saga drops its events in both.
        w.write(&[app(vec![ev("h", "h1")])]).unwrap();
        assert_eq!(locals(&w.conn), ["l0", "h0", "l1", "h1"]);
        w.write(&[req(WriteOp::Finish(vec![summary("g")]))])
            .unwrap();
        assert_eq!(locals(&w.conn), ["h0", "h1"]);
        // And a newer schema is refused.
        let mut c = w.conn;
        c.execute_batch("PRAGMA user_version = 5").unwrap();
        assert!(matches!(
            prepare_writer(&mut c, &small_wal()),
            Err(StoreError::Corrupt(_))
        ));
        // And so is a version Railyard never wrote.
        c.execute_batch("PRAGMA user_version = -1").unwrap();
        assert!(matches!(
            prepare_writer(&mut c, &small_wal()),
            Err(StoreError::Corrupt(_))
        ));
    }

    /// Appends and finishes of one saga inside one group commit apply in
    /// queue order; segments go once nothing in them is needed, and an
    /// index rebuilt from the file equals the one kept by the writer.
    #[test]
    fn one_group_commit_applies_requests_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = Connection::open(dir.path().join("saga.db")).unwrap();
        prepare_writer(&mut conn, &small_wal()).unwrap();
        let mut w = writer(conn);
        w.write(&[app(vec![ev("a", "a0"), ev("b", "b0")])]).unwrap();
        w.write(&[
            app(vec![ev("a", "a1")]),
            app(vec![ev("b", "b1"), ev("a", "a2")]),
            req(WriteOp::Finish(vec![summary("a")])),
            // A late event after its saga finished is kept (as in memory).
            app(vec![ev("a", "a3")]),
            req(WriteOp::Finish(vec![summary("b")])),
            app(vec![ev("c", "c0")]),
        ])
        .unwrap();
        assert_eq!(locals(&w.conn), ["a3", "c0"]);
        // The first segment held only finished sagas: gone.
        assert_eq!(segments(&w.conn), 1);
        assert_eq!(w.index.live_events, 2);
        let mut rebuilt = writer(Connection::open(dir.path().join("saga.db")).unwrap());
        rebuilt.next_seq = w.next_seq;
        assert_eq!(rebuilt.index.live_events, w.index.live_events);
        assert_eq!(rebuilt.index.segments(), w.index.segments());
        // Finishing "a" again drops its late event too; "c" keeps the
        // segment.
        w.write(&[req(WriteOp::Finish(vec![summary("a")]))])
            .unwrap();
        assert_eq!(locals(&w.conn), ["c0"]);
        w.write(&[req(WriteOp::Finish(vec![summary("c")]))])
            .unwrap();
        assert_eq!(locals(&w.conn), Vec::<String>::new());
        assert_eq!(segments(&w.conn), 0);
        assert_eq!(w.index.live_events, 0);
        let summaries: i64 = w
            .conn
            .query_row("SELECT count(*) FROM summaries", [], |r| r.get(0))
            .unwrap();
        assert_eq!(summaries, 4);
    }
}
