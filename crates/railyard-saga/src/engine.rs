//! The engine: sharded saga table, append-then-apply-then-answer, timers,
//! recovery and the batched `finish` of terminal sagas.
//!
//! # Order of work per event
//! 1. validate (malformed events are rejected, never appended);
//! 2. classify under the saga's shard lock: events for a saga that already
//!    finished, and compensation reports about a saga never seen, are
//!    answered from memory without being recorded (`docs/saga.md`);
//! 3. `store.append` every remaining event of the call at once, with no lock
//!    held, so concurrent calls overlap and the store group-commits them;
//! 4. apply each event under its shard lock and drive compensation;
//! 5. return the answers; the caller acknowledges. If `append` failed,
//!    nothing is applied and the caller answers with an error.
//!
//! # Locks
//! `shards[i]` (a `parking_lot::Mutex`, held for microseconds, never across
//! an await) may be held while the participant registry's lock is taken
//! (to queue a command); never the reverse. `finish_queue.pending` is taken
//! alone, or inside `finish_queue.writing` (a tokio mutex held across one
//! `store.finish` call by the finisher or `flush`).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::config::CoordinatorConfig;
use crate::dispatch::Registry;
use crate::event::{EventKind, EventRecord};
use crate::metrics::{EventLabels, ReasonLabels, SagaMetrics};
use crate::saga::{self, DeadlineKind, DriveStats, Policy, Saga};
use crate::store::{SagaState, SagaStore, SagaSummary, StoreError};

/// Longest id accepted (global, local, parent, service, instance), bytes.
const MAX_ID_BYTES: usize = 512;

/// Why an event was refused before being recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidEvent {
    /// The `type` string names no known event.
    #[error("unknown event type {0:?}; expected one of SagaStartedEvent, TxStartedEvent, TxEndedEvent, TxAbortedEvent, TxCompensatedEvent, SagaEndedEvent, SagaAbortedEvent, TxCompensateAckSucceedEvent, TxCompensateAckFailedEvent")]
    UnknownType(String),
    /// `globalTxId` is empty.
    #[error("globalTxId is empty; every event needs its saga's global transaction id")]
    NoGlobalId,
    /// A sub-transaction event without `localTxId`.
    #[error("localTxId is empty; {0} needs the sub-transaction's id")]
    NoLocalId(&'static str),
    /// An id longer than the coordinator accepts.
    #[error("{0} is longer than {MAX_ID_BYTES} bytes")]
    TooLong(&'static str),
    /// A NUL character in an id or a name (PostgreSQL cannot store it in
    /// text, so no store accepts it).
    #[error("{0} contains a NUL character, which ids and names may not")]
    Nul(&'static str),
    /// Events the coordinator records itself, not accepted from participants.
    #[error("{0} is recorded by the coordinator and cannot be reported by a participant")]
    Reserved(&'static str),
    /// A native event naming a participant its session's `Hello` did not.
    #[error("participant {index} is not in this session, which has {count} (0 is Hello's own, 1 and up are Hello.others)")]
    UnknownParticipant {
        /// The event's `participant`.
        index: u32,
        /// How many the session has.
        count: usize,
    },
}

/// Checks one event before anything is recorded.
///
/// # Errors
/// [`InvalidEvent`] saying what is wrong.
pub fn validate(ev: &EventRecord) -> Result<(), InvalidEvent> {
    let Some(kind) = ev.kind else {
        return Err(InvalidEvent::UnknownType(String::new()));
    };
    if ev.global_tx_id.is_empty() {
        return Err(InvalidEvent::NoGlobalId);
    }
    if saga::is_sub_event(kind) && ev.local_tx_id.is_empty() {
        return Err(InvalidEvent::NoLocalId(kind.as_str()));
    }
    if matches!(
        kind,
        EventKind::SagaTimeout | EventKind::TxCompensate | EventKind::CompensateAckTimeout
    ) {
        return Err(InvalidEvent::Reserved(kind.as_str()));
    }
    // Ids are bounded in length; no text may hold NUL (PostgreSQL's `text`
    // cannot, so no store is offered one).
    for (name, v, id) in [
        ("globalTxId", ev.global_tx_id.as_str(), true),
        ("localTxId", &ev.local_tx_id, true),
        ("parentTxId", &ev.parent_tx_id, true),
        ("serviceName", &ev.service_name, true),
        ("instanceId", &ev.instance_id, true),
        ("compensationMethod", &ev.compensation_method, false),
        ("retryMethod", &ev.retry_method, false),
    ] {
        if id && v.len() > MAX_ID_BYTES {
            return Err(InvalidEvent::TooLong(name));
        }
        if v.contains('\0') {
            return Err(InvalidEvent::Nul(name));
        }
    }
    Ok(())
}

/// The answer to one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Recorded (or answered from a finished saga's state); `aborted` tells
    /// the participant whether the saga is aborted.
    Done {
        /// The saga is aborted.
        aborted: bool,
    },
    /// Refused; nothing was recorded.
    Invalid(InvalidEvent),
}

/// The hasher of the in-memory tables: foldhash, randomly seeded per table,
/// several times faster than SipHash on short ids.
type Hasher = foldhash::fast::RandomState;

/// Terminal sagas remembered per shard (bounded FIFO).
///
/// An entry holds what a summary holds but the id, which is the map's key,
/// and shares the saga's own copies of its id and service name: filling the
/// cache allocates nothing per saga beyond its two tables. (It held a clone
/// of the `SagaSummary` handed to the store before: two strings copied per
/// finished saga; a 100,000-transaction bench run peaked 13-15 MB lower
/// without them.)
#[derive(Debug, Default)]
struct FinishedCache {
    map: HashMap<Arc<str>, Finished, Hasher>,
    order: VecDeque<Arc<str>>,
}

/// A terminal saga as the cache remembers it; [`Finished::summary`] gives
/// back the store's summary.
#[derive(Debug)]
struct Finished {
    service_name: Arc<str>,
    state: SagaState,
    started_ms: i64,
    finished_ms: i64,
    sub_transactions: u32,
    compensated: u32,
    events: u32,
}

impl Finished {
    fn of(s: &SagaSummary, service_name: Arc<str>) -> Self {
        Self {
            service_name,
            state: s.state,
            started_ms: s.started_ms,
            finished_ms: s.finished_ms,
            sub_transactions: s.sub_transactions,
            compensated: s.compensated,
            events: s.events,
        }
    }

    fn summary(&self, global_tx_id: &str) -> SagaSummary {
        SagaSummary {
            global_tx_id: global_tx_id.to_owned(),
            service_name: self.service_name.to_string(),
            state: self.state,
            started_ms: self.started_ms,
            finished_ms: self.finished_ms,
            sub_transactions: self.sub_transactions,
            compensated: self.compensated,
            events: self.events,
        }
    }
}

impl FinishedCache {
    fn insert(&mut self, id: Arc<str>, f: Finished, cap: usize) {
        if self.map.insert(id.clone(), f).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > cap.max(1) {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

#[derive(Debug, Default)]
struct Shard {
    live: HashMap<Arc<str>, Saga, Hasher>,
    /// Every live saga's deadline, earliest first; kept equal to
    /// `saga.deadline` by `settle`.
    timers: BTreeSet<(Instant, Arc<str>)>,
    /// Live sagas whose current compensation waits for an instance of its
    /// service; kept equal to `saga.waiting_for_instance()` by `settle`, so
    /// that a registering instance visits only these, not every live saga.
    waiting: std::collections::HashSet<Arc<str>, Hasher>,
    finished: FinishedCache,
    /// Sagas (by the hash of their id) one call has events of between its
    /// classification and its apply, and which call: see [`Marks`].
    busy: HashMap<u64, (u64, u32), Hasher>,
    /// Calls waiting for one of this shard's marks to go.
    mark_waiters: u32,
}

/// Deadlines one timer tick handles at most; more wait for the next tick.
const EXPIRE_PER_TICK: usize = 2048;

/// Deadlines handled in one go on the async worker (well under half a
/// millisecond of work), with a yield before the next of a tick's chunks,
/// so the worker's other tasks are not held up for the whole tick.
const EXPIRE_CHUNK: usize = 256;

/// The sagas one call is recording events of, marked from its events'
/// classification until they are applied (or the call fails or is dropped).
///
/// Why: the store logs calls in the order they reach its queue, and each
/// call applies its own events once its append is durable. Two calls with
/// events of one saga could otherwise be applied in the other order than
/// logged (both answered by one group commit, their tasks woken together),
/// and a restart, which replays the log, would then rebuild another state
/// than the one the participants were answered from. So classifying an
/// event to be recorded marks its saga (by the hash of its id, with a
/// count of this call's events) in the saga's shard, under the lock
/// classifying takes anyway, and applying it takes the count down under
/// the lock applying takes anyway. A call that meets another call's mark
/// gives back the marks it took and waits for that mark to go, then
/// classifies again: it never waits holding marks, so calls cannot wait
/// for each other in a cycle. Calls about different sagas never wait.
struct Marks<'a> {
    engine: &'a Engine,
    holder: u64,
    /// Hashes of the sagas marked, one per event, until applied.
    taken: Vec<u64>,
}

/// Another call's mark was met: saga hash `hash`, in shard `shard`.
struct Conflict {
    shard: usize,
    hash: u64,
}

/// A call waiting for a mark of shard `i`: counted in `mark_waiters` (so
/// that releases there notify) until dropped.
struct MarkWaiter<'a> {
    engine: &'a Engine,
    i: usize,
}

impl Drop for MarkWaiter<'_> {
    fn drop(&mut self) {
        self.engine.shards[self.i].lock().mark_waiters -= 1;
    }
}

impl<'a> Marks<'a> {
    fn new(engine: &'a Engine) -> Self {
        Self {
            engine,
            holder: engine
                .next_holder
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            taken: Vec::new(),
        }
    }

    /// Marks `h` as this call's (once more if it is already) in `busy`, its
    /// shard's map; `false` if another call holds it.
    fn try_take(&mut self, busy: &mut HashMap<u64, (u64, u32), Hasher>, h: u64) -> bool {
        match busy.entry(h) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert((self.holder, 1));
            }
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let (who, count) = o.get_mut();
                if *who != self.holder {
                    return false;
                }
                *count += 1;
            }
        }
        self.taken.push(h);
        true
    }

    fn release(&mut self) {
        for h in self.taken.drain(..) {
            let i = self.engine.shard_index(h);
            let wake = {
                let mut shard = self.engine.shards[i].lock();
                unmark(&mut shard, h, self.holder)
            };
            if wake {
                self.engine.released[i].notify_waiters();
            }
        }
    }
}

impl Drop for Marks<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Takes one of `holder`'s marks on `h` down; whether a waiter should be
/// woken (the mark went and someone waits in this shard).
fn unmark(shard: &mut Shard, h: u64, holder: u64) -> bool {
    if let std::collections::hash_map::Entry::Occupied(mut e) = shard.busy.entry(h) {
        let (who, count) = e.get_mut();
        if *who == holder {
            *count -= 1;
            if *count == 0 {
                e.remove();
                return shard.mark_waiters > 0;
            }
        }
    }
    false
}

/// What [`Engine::classify`] found for an event.
#[derive(Debug)]
enum Class {
    /// Its saga is live, or an earlier event of the same call creates it:
    /// record and apply it.
    Live,
    /// Its saga is unknown and the event creates it: record and apply it.
    Creates,
    /// Its saga is unknown and the event does not create it (or it has no
    /// kind): answered without recording.
    Unknown,
    /// Answered from memory without recording (its saga finished).
    Answer(Outcome),
}

/// What [`Engine::settle`] needs of a saga after it changed, taken while
/// the caller holds it (so settling needs no second look-up).
#[derive(Debug, Clone, Copy)]
struct After {
    waiting: bool,
    deadline: Option<(Instant, DeadlineKind)>,
    state: SagaState,
}

impl After {
    fn of(saga: &Saga) -> Self {
        Self {
            waiting: saga.waiting_for_instance(),
            deadline: saga.deadline,
            state: saga.state,
        }
    }
}

/// Summaries waiting for one batched `store.finish`.
///
/// Not bounded by a count of its own, and it need not be: a summary is
/// queued only when a live saga finishes, and each saga finishes once
/// (it then leaves the live map), so the queue never holds more than the
/// sagas that were live. While the store refuses appends, sagas can still
/// finish on the coordinator's timers (retries exhausted, straggler or
/// instance waits), but no new saga becomes live, so the bound holds. While
/// the store is merely slow, the finisher takes everything queued in one
/// request per commit.
#[derive(Debug, Default)]
struct FinishQueue {
    pending: Mutex<Vec<SagaSummary>>,
    notify: Notify,
    /// Held while a batch is with the store, so that `flush` waits for a
    /// batch the background loop took.
    writing: tokio::sync::Mutex<()>,
}

/// Milliseconds since the Unix epoch, now.
pub(crate) fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A live saga's view for queries.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SagaView {
    /// The summary (state, counts).
    #[serde(flatten)]
    pub summary: SagaSummary,
    /// Its sub-transactions in start order.
    pub sub_transactions: Vec<SubView>,
}

/// A sub-transaction's view for queries.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SubView {
    /// Its id.
    pub local_tx_id: String,
    /// Its parent, or `""`.
    pub parent_tx_id: String,
    /// The service that ran it.
    pub service_name: String,
    /// The instance that ran it.
    pub instance_id: String,
    /// Its state.
    pub state: saga::SubState,
    /// Compensation attempts so far.
    pub attempts: u32,
    /// Its compensation method.
    pub compensation_method: String,
}

/// The coordinator's core. Shared by the gRPC services, the timer and the
/// finisher tasks (which hold it weakly, so dropping the last
/// [`Coordinator`](crate::Coordinator) stops them).
pub(crate) struct Engine {
    pub(crate) store: Arc<dyn SagaStore>,
    shards: Box<[Mutex<Shard>]>,
    /// One per shard: a mark of that shard went (see [`Marks`]).
    released: Box<[tokio::sync::Notify]>,
    /// Numbers the calls that take marks.
    next_holder: std::sync::atomic::AtomicU64,
    /// The shard the next timer tick starts from.
    expire_from: std::sync::atomic::AtomicUsize,
    hasher: foldhash::fast::FixedState,
    pub(crate) registry: Registry,
    policy: Policy,
    pub(crate) config: CoordinatorConfig,
    pub(crate) metrics: SagaMetrics,
    finish_queue: Arc<FinishQueue>,
    tasks: Mutex<Vec<AbortHandle>>,
    /// Set once the server stops: participant streams end.
    closing: tokio::sync::watch::Sender<bool>,
    /// Instances that arrived and the walk that drives their waiting sagas
    /// (see [`Engine::instance_arrived`]).
    arrivals: Mutex<Arrivals>,
    /// Room for native batches being appended, in KiB of their encoded
    /// size, across every session (`native_batch_bytes`).
    pub(crate) native_room: Arc<tokio::sync::Semaphore>,
}

/// Services an instance of which arrived, whose waiting sagas are not
/// driven yet, and whether a walk to drive them is scheduled.
#[derive(Default)]
struct Arrivals {
    pending: std::collections::HashSet<String>,
    /// Links that ended, whose unanswered commands are not sent again yet
    /// (see [`Engine::links_gone`]).
    gone: std::collections::HashSet<u64>,
    walk_scheduled: bool,
}

/// `native_batch_bytes` in KiB, at least 1 (a semaphore's permits).
pub(crate) fn native_room_kib(config: &CoordinatorConfig) -> u32 {
    u32::try_from(config.native_batch_bytes / 1024)
        .unwrap_or(u32::MAX)
        .clamp(1, tokio::sync::Semaphore::MAX_PERMITS as u32)
}

/// Waiting sagas an arrival's walk drives per hold of a shard lock.
const WALK_CHUNK: usize = 256;

/// [`Engine::drive_arrivals`] as a job for the blocking pool. If tokio drops
/// it unrun (the runtime shutting down), or the walk panics, the walk is no
/// longer scheduled, so a later arrival schedules one again.
struct ArrivalWalk(Option<Arc<Engine>>);

impl ArrivalWalk {
    fn run(mut self) {
        if let Some(engine) = &self.0 {
            engine.drive_arrivals();
        }
        // Finished: the walk cleared the flag itself (a panic above leaves
        // the engine here, for `drop` to clear it).
        self.0 = None;
    }
}

impl Drop for ArrivalWalk {
    fn drop(&mut self) {
        if let Some(engine) = self.0.take() {
            engine.arrivals.lock().walk_scheduled = false;
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for t in self.tasks.get_mut().drain(..) {
            t.abort();
        }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("store", &self.store.name())
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Builds the engine, replays `store.unfinished()` and starts the timer
    /// and finisher tasks (on the current runtime).
    pub(crate) async fn start(
        store: Arc<dyn SagaStore>,
        config: CoordinatorConfig,
    ) -> Result<Arc<Self>, StoreError> {
        let n = config.shards.max(1);
        let policy = Policy {
            default_reverse_retries: config.default_reverse_retries,
            default_reverse_timeout: config.default_reverse_timeout,
            default_retry_delay: config.default_retry_delay,
            instance_wait: config.instance_wait,
            straggler_wait: config.straggler_wait,
            orphan_wait: config.orphan_wait,
        };
        let native_room = Arc::new(tokio::sync::Semaphore::new(
            native_room_kib(&config) as usize
        ));
        let engine = Arc::new(Self {
            store,
            shards: (0..n).map(|_| Mutex::new(Shard::default())).collect(),
            released: (0..n).map(|_| tokio::sync::Notify::new()).collect(),
            next_holder: std::sync::atomic::AtomicU64::new(1),
            expire_from: std::sync::atomic::AtomicUsize::new(0),
            hasher: foldhash::fast::FixedState::with_seed(0x5a6a),
            registry: Registry::default(),
            policy,
            config,
            metrics: SagaMetrics::new(),
            finish_queue: Arc::new(FinishQueue::default()),
            tasks: Mutex::new(Vec::new()),
            closing: tokio::sync::watch::channel(false).0,
            arrivals: Mutex::new(Default::default()),
            native_room,
        });
        engine.recover().await?;
        let timer = tokio::spawn(timer_loop(
            Arc::downgrade(&engine),
            engine.config.timer_tick,
        ));
        let finisher = tokio::spawn(finish_loop(
            engine.store.clone(),
            engine.finish_queue.clone(),
        ));
        engine
            .tasks
            .lock()
            .extend([timer.abort_handle(), finisher.abort_handle()]);
        Ok(engine)
    }

    fn shard_of(&self, gid: &str) -> &Mutex<Shard> {
        &self.shards[self.shard_index(self.hasher.hash_one(gid))]
    }

    /// The shard of a saga whose id hashes to `h`.
    fn shard_index(&self, h: u64) -> usize {
        // The modulo keeps the index below `shards.len()`.
        usize::try_from(h % self.shards.len() as u64).unwrap_or(0)
    }

    /// Waits until the mark `h` (of shard `i`), which another call holds,
    /// may have gone. `marks` are given back first, so that no call waits
    /// while holding marks another may be waiting for, and only then does
    /// this call register as a waiter: giving its own back must not wake
    /// itself (it would spin, never yielding, while the holder waits for a
    /// worker to apply its events).
    async fn wait_for_mark(&self, i: usize, h: u64, marks: &mut Marks<'_>) {
        marks.release();
        let notified = self.released[i].notified();
        tokio::pin!(notified);
        {
            let mut shard = self.shards[i].lock();
            if shard
                .busy
                .get(&h)
                .is_none_or(|(who, _)| *who == marks.holder)
            {
                return; // gone meanwhile: classify again
            }
            // Registered before the lock goes: the release (which takes it)
            // cannot be missed.
            notified.as_mut().enable();
            shard.mark_waiters += 1;
        }
        // Counted down however the wait ends (also if the call is dropped).
        let _waiting = MarkWaiter { engine: self, i };
        notified.await;
    }

    /// Records `events` and answers each, in order: see the module docs.
    ///
    /// # Errors
    /// [`StoreError`] if the append failed: nothing was applied and nothing
    /// may be acknowledged.
    ///
    /// # Cancel safety
    /// Not cancel safe: if dropped while appending, the events may be
    /// durable but are not applied until a restart replays them. The gRPC
    /// handlers therefore run it on a task of its own.
    pub(crate) async fn handle(
        &self,
        events: Vec<EventRecord>,
        protocol: &'static str,
    ) -> Result<Vec<Outcome>, StoreError> {
        let n = events.len();
        // Refusals first; the other answers are found by classifying.
        let mut outcomes: Vec<Option<Outcome>> = events
            .iter()
            .map(|ev| {
                let e = validate(ev).err()?;
                self.metrics
                    .rejected
                    .get_or_create(&ReasonLabels { reason: "invalid" })
                    .inc();
                Some(Outcome::Invalid(e))
            })
            .collect();
        // Held until this call's events are applied (or it fails or is
        // dropped): see `Marks`.
        let mut marks = Marks::new(self);
        let keep = loop {
            match self.classify_call(&events, &mut outcomes, &mut marks) {
                Ok(keep) => break keep,
                Err(c) => {
                    // Classified again after the wait: only refusals stand.
                    // Every `Invalid` here is validation's (above):
                    // classifying never answers `Invalid`, so none of its
                    // answers survive this reset. A classification that
                    // could refuse would have to be told apart here.
                    for o in &mut outcomes {
                        if !matches!(o, Some(Outcome::Invalid(_))) {
                            *o = None;
                        }
                    }
                    self.wait_for_mark(c.shard, c.hash, &mut marks).await;
                }
            }
        };
        let slots: Vec<usize> = (0..n).filter(|&i| keep[i]).collect();
        // In place (an `Arc<[_]>` would copy every record once more).
        let mut events = events;
        let mut kept = keep.iter();
        events.retain(|_| kept.next().copied().unwrap_or(false));
        let to_append = Arc::new(events);
        if !to_append.is_empty() {
            let t0 = std::time::Instant::now();
            let count = to_append.len();
            // Shared with the store (no copy); applied once durable.
            if let Err(e) = self.store.append_shared(to_append.clone()).await {
                self.metrics
                    .rejected
                    .get_or_create(&ReasonLabels { reason: "store" })
                    .inc_by(count as u64);
                return Err(e);
            }
            self.metrics
                .append_seconds
                .observe(t0.elapsed().as_secs_f64());
            self.metrics.append_events.observe(count as f64);
            let now = Instant::now();
            let mut by_kind = [0u64; EventKind::ALL.len()];
            // `marks.taken` holds each recorded event's saga hash, in order.
            debug_assert_eq!(marks.taken.len(), to_append.len());
            for ((ev, slot), &h) in to_append.iter().zip(slots).zip(&marks.taken) {
                if let Some(kind) = ev.kind {
                    by_kind[usize::from(kind.code())] += 1;
                }
                outcomes[slot] = Some(self.apply_marked(ev, h, now, marks.holder));
            }
            // Each apply took its event's mark down.
            marks.taken.clear();
            for (kind, k) in EventKind::ALL.iter().zip(by_kind) {
                if k > 0 {
                    self.metrics
                        .events
                        .get_or_create(&EventLabels {
                            kind: kind.as_str(),
                            protocol,
                        })
                        .inc_by(k);
                }
            }
        }
        Ok(outcomes
            .into_iter()
            .map(|o| o.unwrap_or(Outcome::Done { aborted: false }))
            .collect())
    }

    /// Classifies a call's events that have no answer in `outcomes` yet
    /// (the refused ones have): answers those not to be recorded, in
    /// `outcomes`, and returns which are to be; marks the sagas of those
    /// (see [`Marks`]). `Err` when another call's mark was met (`marks`
    /// still holds what this pass took, `outcomes` what it answered).
    fn classify_call(
        &self,
        events: &[EventRecord],
        outcomes: &mut [Option<Outcome>],
        marks: &mut Marks<'_>,
    ) -> Result<Vec<bool>, Conflict> {
        let n = events.len();
        let mut keep = vec![false; n];
        // Sagas an earlier event of this call will create (a batch may
        // carry a saga's whole life): only creating events add to it, and
        // only events about an unknown saga look in it.
        let mut batch_sagas: std::collections::HashSet<&str, Hasher> =
            std::collections::HashSet::default();
        for (i, ev) in events.iter().enumerate() {
            if outcomes[i].is_some() {
                continue;
            }
            let in_batch =
                !batch_sagas.is_empty() && batch_sagas.contains(ev.global_tx_id.as_str());
            match self.classify(ev, in_batch, marks)? {
                Class::Live => keep[i] = true,
                Class::Creates => {
                    if n > 1 {
                        batch_sagas.insert(ev.global_tx_id.as_str());
                    }
                    keep[i] = true;
                }
                // Row "compensation report for an unknown saga".
                Class::Unknown => outcomes[i] = Some(Outcome::Done { aborted: false }),
                Class::Answer(answer) => outcomes[i] = Some(answer),
            }
        }
        Ok(keep)
    }

    /// What the saga's state says of an event before it is recorded
    /// (`in_batch`: an earlier event of the call creates its saga, so it is
    /// recorded too). An event to be recorded marks its saga as `marks`'s.
    fn classify(
        &self,
        ev: &EventRecord,
        in_batch: bool,
        marks: &mut Marks<'_>,
    ) -> Result<Class, Conflict> {
        // `validate` refused an event without a kind already.
        let Some(kind) = ev.kind else {
            return Ok(Class::Unknown);
        };
        let h = self.hasher.hash_one(ev.global_tx_id.as_str());
        let i = self.shard_index(h);
        let mut guard = self.shards[i].lock();
        let shard = &mut *guard;
        let gid = ev.global_tx_id.as_str();
        let class = if shard.live.contains_key(gid) || in_batch {
            Class::Live
        } else if let Some(s) = shard.finished.map.get(gid) {
            // Row "event after a terminal state".
            return Ok(Class::Answer(Outcome::Done {
                aborted: s.state != SagaState::Committed,
            }));
        } else if saga::creates_saga(kind) {
            Class::Creates
        } else {
            return Ok(Class::Unknown);
        };
        if !marks.try_take(&mut shard.busy, h) {
            return Err(Conflict { shard: i, hash: h });
        }
        Ok(class)
    }

    /// Applies one event whose saga id hashes to `h`, recorded by the call
    /// `holder`, and takes its mark down (under the same lock).
    fn apply_marked(&self, ev: &EventRecord, h: u64, now: Instant, holder: u64) -> Outcome {
        let i = self.shard_index(h);
        let (outcome, wake) = {
            let mut guard = self.shards[i].lock();
            let shard = &mut *guard;
            let outcome = self.apply_in(shard, ev, now);
            (outcome, unmark(shard, h, holder))
        };
        if wake {
            self.released[i].notify_waiters();
        }
        outcome
    }

    /// Applies one recorded event (live path or replay).
    fn apply(&self, ev: &EventRecord, now: Instant) -> Outcome {
        let mut shard = self.shard_of(&ev.global_tx_id).lock();
        self.apply_in(&mut shard, ev, now)
    }

    fn apply_in(&self, shard: &mut Shard, ev: &EventRecord, now: Instant) -> Outcome {
        let Some(kind) = ev.kind else {
            return Outcome::Done { aborted: false };
        };
        // The usual case, a live saga, costs one look-up.
        if let Some(outcome) = self.apply_live(shard, ev, now) {
            return outcome;
        }
        if let Some(s) = shard.finished.map.get(ev.global_tx_id.as_str()) {
            // Finished between classify and apply: the event is in the
            // log, so finish again (idempotent) to compact it.
            let aborted = s.state != SagaState::Committed;
            self.finish_queue
                .pending
                .lock()
                .push(s.summary(&ev.global_tx_id));
            self.finish_queue.notify.notify_one();
            return Outcome::Done { aborted };
        }
        if !saga::creates_saga(kind) {
            return Outcome::Done { aborted: false };
        }
        let id: Arc<str> = Arc::from(ev.global_tx_id.as_str());
        shard.live.insert(id.clone(), Saga::new(id, ev));
        self.metrics.transition(None, SagaState::Running);
        self.apply_live(shard, ev, now)
            .unwrap_or(Outcome::Done { aborted: false })
    }

    /// [`apply`](Self::apply) to a live saga; `None` if it is not live.
    fn apply_live(&self, shard: &mut Shard, ev: &EventRecord, now: Instant) -> Option<Outcome> {
        let saga = shard.live.get_mut(ev.global_tx_id.as_str())?;
        // The saga's own id is its key's `Arc`.
        let id = saga.global_tx_id.clone();
        let before = (saga.deadline, saga.state);
        let mut stats = DriveStats::default();
        let applied = saga.apply(ev, now, &mut stats);
        saga.drive(now, &self.registry, &self.policy, &mut stats);
        let after = After::of(saga);
        self.settle(shard, &id, before, after, stats);
        Some(Outcome::Done {
            aborted: applied.aborted,
        })
    }

    /// After a saga changed (`before` and `after` its change): keep the
    /// timer index, metrics and the finished cache in step; forget it and
    /// queue its summary if terminal.
    fn settle(
        &self,
        shard: &mut Shard,
        id: &Arc<str>,
        before: (Option<(Instant, DeadlineKind)>, SagaState),
        after: After,
        stats: DriveStats,
    ) {
        if stats != DriveStats::default() {
            self.metrics
                .compensations_sent
                .inc_by(u64::from(stats.sent));
            self.metrics
                .compensations_retried
                .inc_by(u64::from(stats.retried));
            self.metrics
                .compensations_failed
                .inc_by(u64::from(stats.failed));
            self.metrics
                .compensations_rerouted
                .inc_by(u64::from(stats.rerouted));
        }
        // The empty check keeps the usual case (nobody waiting) to a branch.
        if after.waiting {
            if shard.waiting.insert(id.clone()) {
                self.metrics.waiting_for_instance.inc();
            }
        } else if !shard.waiting.is_empty() && shard.waiting.remove(id) {
            self.metrics.waiting_for_instance.dec();
        }
        let state = after.state;
        let after = after.deadline;
        if before.0.map(|d| d.0) != after.map(|d| d.0) {
            if let Some((t, _)) = before.0 {
                shard.timers.remove(&(t, id.clone()));
            }
            if let Some((t, _)) = after {
                shard.timers.insert((t, id.clone()));
            }
        }
        self.metrics.transition(Some(before.1), state);
        if state.is_terminal() {
            if let Some((t, _)) = after {
                shard.timers.remove(&(t, id.clone()));
            }
            // Kept exact above: a terminal saga has nothing in flight. Should
            // that ever change, the index and its gauge still do not drift.
            debug_assert!(!shard.waiting.contains(id));
            if !shard.waiting.is_empty() && shard.waiting.remove(id) {
                self.metrics.waiting_for_instance.dec();
            }
            if let Some(saga) = shard.live.remove(id) {
                let summary = saga.summary(wall_ms());
                shard.finished.insert(
                    id.clone(),
                    Finished::of(&summary, saga.service_name),
                    self.config.finished_cache_per_shard,
                );
                self.finish_queue.pending.lock().push(summary);
                self.finish_queue.notify.notify_one();
            }
        }
    }

    /// Runs expired deadlines; adds to `timeouts` the sagas whose own
    /// timeout expired (their `SagaTimeout` must be recorded before it is
    /// applied), marked in `marks` as the timer's (see [`Marks`]) until that
    /// is done. A saga marked by a call under way has its timeout tried
    /// again on the next tick.
    ///
    /// Runs on an async worker, so one call handles at most `budget`
    /// deadlines; returns whether that stopped it (more are due).
    fn expire<'a>(
        &'a self,
        now: Instant,
        budget: usize,
        timeouts: &mut Vec<EventRecord>,
        marks: &mut Marks<'a>,
    ) -> bool {
        let mut budget = budget;
        let mut postponed = Vec::new();
        // Each call starts one shard further, so that when the budget runs
        // out the same shards do not always wait.
        let n = self.shards.len();
        let first = self
            .expire_from
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % n;
        for m in self.shards[first..].iter().chain(&self.shards[..first]) {
            if budget == 0 {
                break;
            }
            let mut shard = m.lock();
            let shard = &mut *shard;
            // Bounded by the number of expired entries and the budget.
            while let Some((t, id)) = shard.timers.first().cloned() {
                if t > now || budget == 0 {
                    break;
                }
                budget -= 1;
                shard.timers.pop_first();
                let Some(saga) = shard.live.get_mut(&id) else {
                    continue;
                };
                let before = (saga.deadline, saga.state);
                match saga.deadline {
                    Some((at, DeadlineKind::SagaTimeout)) if at <= now => {
                        let h = self.hasher.hash_one(&*id);
                        if !marks.try_take(&mut shard.busy, h) {
                            // Its events are being recorded: after them.
                            let next = now + self.config.timer_tick;
                            saga.deadline = Some((next, DeadlineKind::SagaTimeout));
                            postponed.push((next, id));
                            continue;
                        }
                        saga.deadline = None;
                        timeouts.push(EventRecord {
                            global_tx_id: id.to_string(),
                            local_tx_id: id.to_string(),
                            kind: Some(EventKind::SagaTimeout),
                            service_name: saga.service_name.clone(),
                            instance_id: saga.instance_id.clone(),
                            timestamp_ms: wall_ms(),
                            ..EventRecord::default()
                        });
                        // The entry was popped already; `before` must not
                        // name it again.
                        continue;
                    }
                    _ => {}
                }
                let mut stats = DriveStats::default();
                saga.on_timer(now, &self.registry, &self.policy, &mut stats);
                let after = After::of(saga);
                // The popped entry is gone: settle from "no deadline".
                self.settle(shard, &id, (None, before.1), after, stats);
            }
            // Put back after the loop, which would otherwise meet them again.
            for entry in postponed.drain(..) {
                shard.timers.insert(entry);
            }
        }
        budget == 0
    }

    /// Records and applies `SagaTimeout` for sagas whose timeout expired; on
    /// a store error they are tried again a second later.
    async fn record_timeouts(&self, timeouts: Vec<EventRecord>) {
        if timeouts.is_empty() {
            return;
        }
        match self.store.append(timeouts.clone()).await {
            Ok(()) => {
                let now = Instant::now();
                for ev in &timeouts {
                    self.metrics
                        .events
                        .get_or_create(&EventLabels {
                            kind: EventKind::SagaTimeout.as_str(),
                            protocol: "coordinator",
                        })
                        .inc();
                    self.apply(ev, now);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, sagas = timeouts.len(), "could not record saga timeouts; retrying");
                let at = Instant::now() + Duration::from_secs(1);
                for ev in timeouts {
                    let mut shard = self.shard_of(&ev.global_tx_id).lock();
                    let shard = &mut *shard;
                    let id = shard
                        .live
                        .get_key_value(ev.global_tx_id.as_str())
                        .map(|(k, _)| k.clone());
                    if let Some(id) = id {
                        if let Some(saga) = shard.live.get_mut(&id) {
                            if saga.state == SagaState::Running && saga.deadline.is_none() {
                                saga.deadline = Some((at, DeadlineKind::SagaTimeout));
                                shard.timers.insert((at, id));
                            }
                        }
                    }
                }
            }
        }
    }

    /// An instance of `service` registered: the sagas waiting for one are
    /// driven by [`on_instances`](Self::on_instances), off the async
    /// workers (it walks every saga waiting for an instance, which grows
    /// with how many wait: a service away for long can leave thousands).
    /// Arrivals are coalesced: one walk at a time, on the blocking pool,
    /// takes every service that arrived before it started, so a thousand
    /// instances reconnecting at once cost a few walks, not a thousand.
    /// Outside a runtime the walk runs here.
    pub(crate) fn instance_arrived(self: &Arc<Self>, service: &str) {
        let schedule = {
            let mut a = self.arrivals.lock();
            a.pending.insert(service.to_owned());
            !std::mem::replace(&mut a.walk_scheduled, true)
        };
        if schedule {
            self.schedule_walk();
        }
    }

    /// Participant links (connections) left the registry: updates the
    /// instances gauge, and sends again what those that ever carried a
    /// command left unanswered ([`links_gone`](Self::links_gone)). Each
    /// link's flag is claimed here, so a link reported twice (Omega's
    /// `OnDisconnected`, then its stream's end) is walked for once.
    pub(crate) fn links_ended(self: &Arc<Self>, links: &[crate::dispatch::Registered]) {
        self.metrics.instances.set(self.registry.len() as i64);
        let carried: Vec<u64> = links
            .iter()
            .filter(|(_, c)| c.swap(false, std::sync::atomic::Ordering::Relaxed))
            .map(|(id, _)| *id)
            .collect();
        self.links_gone(&carried);
    }

    /// Links ended: commands they took and did not answer are sent again
    /// now (see `Saga::on_links_gone`), by the same coalesced walk as
    /// arrivals. It visits the sagas with a deadline (every one awaiting an
    /// answer has one, and so does every running saga with a timeout).
    fn links_gone(self: &Arc<Self>, links: &[u64]) {
        if links.is_empty() {
            return;
        }
        let schedule = {
            let mut a = self.arrivals.lock();
            a.gone.extend(links.iter().copied());
            !std::mem::replace(&mut a.walk_scheduled, true)
        };
        if schedule {
            self.schedule_walk();
        }
    }

    /// Runs the arrivals' walk on the blocking pool (here outside a runtime).
    fn schedule_walk(self: &Arc<Self>) {
        let walk = ArrivalWalk(Some(self.clone()));
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || walk.run())),
            Err(_) => walk.run(),
        }
    }

    /// Drives the sagas waiting for the services that arrived, until no
    /// arrival is left; then a later arrival schedules a new walk.
    fn drive_arrivals(&self) {
        loop {
            let (services, gone) = {
                let mut a = self.arrivals.lock();
                if a.pending.is_empty() && a.gone.is_empty() {
                    a.walk_scheduled = false;
                    return;
                }
                (std::mem::take(&mut a.pending), std::mem::take(&mut a.gone))
            };
            if !gone.is_empty() {
                self.on_links_gone(&gone);
            }
            if !services.is_empty() {
                self.on_instances(&services);
            }
        }
    }

    /// Links ended: their sagas' unanswered commands go again.
    fn on_links_gone(&self, gone: &std::collections::HashSet<u64>) {
        let is_gone = |link: u64| gone.contains(&link);
        let now = Instant::now();
        let mut rerouted = 0u64;
        for m in self.shards.iter() {
            // WALK_CHUNK deadlines per hold of the shard lock, resuming after
            // the last one seen (a deadline moved meanwhile may be seen
            // twice or not at all; it then belongs to a saga whose command
            // was answered or timed out, which has nothing to send again).
            let mut after: Option<(Instant, Arc<str>)> = None;
            loop {
                let mut shard = m.lock();
                let shard = &mut *shard;
                let chunk: Vec<(Instant, Arc<str>)> = match &after {
                    None => shard.timers.iter().take(WALK_CHUNK).cloned().collect(),
                    Some(k) => shard
                        .timers
                        .range((
                            std::ops::Bound::Excluded(k.clone()),
                            std::ops::Bound::Unbounded,
                        ))
                        .take(WALK_CHUNK)
                        .cloned()
                        .collect(),
                };
                let Some(last) = chunk.last() else { break };
                after = Some(last.clone());
                for (_, id) in &chunk {
                    let Some(saga) = shard.live.get_mut(id) else {
                        continue; // finished meanwhile
                    };
                    let before = (saga.deadline, saga.state);
                    let mut stats = DriveStats::default();
                    if saga.on_links_gone(&is_gone, now, &self.registry, &self.policy, &mut stats) {
                        rerouted += 1;
                        let state = After::of(saga);
                        self.settle(shard, id, before, state, stats);
                    }
                }
            }
        }
        if rerouted > 0 {
            tracing::info!(
                links = gone.len(),
                commands = rerouted,
                "participant connections ended with compensations unanswered; sent again"
            );
        }
    }

    /// Instances of `services` registered: commands waiting for one go now.
    fn on_instances(&self, services: &std::collections::HashSet<String>) {
        let arrived = |service: &str| services.contains(service);
        let now = Instant::now();
        for m in self.shards.iter() {
            let waiting: Vec<Arc<str>> = {
                let shard = m.lock();
                if shard.waiting.is_empty() {
                    continue;
                }
                shard.waiting.iter().cloned().collect()
            };
            // The shard lock is let go between chunks: the calls and the
            // timer that need this shard wait for one chunk at most. A saga
            // that started waiting meanwhile saw the instance registered.
            for chunk in waiting.chunks(WALK_CHUNK) {
                let mut shard = m.lock();
                let shard = &mut *shard;
                for id in chunk {
                    let Some(saga) = shard.live.get_mut(id) else {
                        continue; // finished meanwhile
                    };
                    let before = (saga.deadline, saga.state);
                    let mut stats = DriveStats::default();
                    saga.on_instance(&arrived, now, &self.registry, &self.policy, &mut stats);
                    let after = After::of(saga);
                    self.settle(shard, id, before, after, stats);
                }
            }
        }
    }

    /// Rebuilds state from the store's unfinished events and resumes
    /// timeouts and compensations.
    async fn recover(self: &Arc<Self>) -> Result<(), StoreError> {
        let events = self.store.unfinished().await?;
        // Replaying a large log (every event of every unfinished saga) can
        // take seconds: not on an async worker, whose other tasks (the
        // node's HTTP server, its bus) would stall meanwhile.
        let engine = self.clone();
        match tokio::task::spawn_blocking(move || engine.replay(&events)).await {
            Ok(()) => Ok(()),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(StoreError::Engine(format!(
                "recovery was cancelled (the runtime is shutting down): {e}"
            ))),
        }
    }

    /// Rebuilds the live sagas from `events` (append order) and resumes
    /// them: timeouts re-armed, pending compensations driven again.
    fn replay(&self, events: &[EventRecord]) {
        let now = Instant::now();
        let count = events.len();
        for ev in events {
            let Some(kind) = ev.kind else { continue };
            let mut shard = self.shard_of(&ev.global_tx_id).lock();
            if !shard.live.contains_key(ev.global_tx_id.as_str()) {
                if !saga::creates_saga(kind) {
                    continue;
                }
                let id: Arc<str> = Arc::from(ev.global_tx_id.as_str());
                shard.live.insert(id.clone(), Saga::new(id, ev));
            }
            if let Some(saga) = shard.live.get_mut(ev.global_tx_id.as_str()) {
                // Replay: what it gives up was counted before the restart.
                saga.apply(ev, now, &mut DriveStats::default());
            }
        }
        let wall = wall_ms();
        let mut sagas = 0usize;
        for m in self.shards.iter() {
            let mut shard = m.lock();
            let shard = &mut *shard;
            let ids: Vec<Arc<str>> = shard.live.keys().cloned().collect();
            sagas += ids.len();
            for id in ids {
                let Some(saga) = shard.live.get_mut(&id) else {
                    continue;
                };
                self.metrics.transition(None, SagaState::Running);
                let before = (None, SagaState::Running);
                saga.deadline = None;
                if saga.state == SagaState::Running && saga.saga_started && saga.timeout_s > 0 {
                    // The timeout runs on the starter's clock: what is left
                    // of it now (expired ones fire on the first tick).
                    let end = saga
                        .started_ms
                        .saturating_add(i64::from(saga.timeout_s) * 1000);
                    let left = u64::try_from(end.saturating_sub(wall)).unwrap_or(0);
                    saga.deadline =
                        Some((now + Duration::from_millis(left), DeadlineKind::SagaTimeout));
                }
                saga.reset_after_recovery();
                let mut stats = DriveStats::default();
                saga.drive(now, &self.registry, &self.policy, &mut stats);
                let after = After::of(saga);
                self.settle(shard, &id, before, after, stats);
            }
        }
        if count > 0 {
            tracing::info!(
                events = count,
                sagas,
                store = self.store.name(),
                "recovered unfinished sagas"
            );
        }
    }

    /// Ends every participant stream (server shutdown): open streams would
    /// otherwise keep a graceful shutdown waiting forever.
    pub(crate) fn close_streams(&self) {
        self.closing.send_replace(true);
        self.registry.clear();
        self.metrics.instances.set(0);
    }

    /// Resolves once [`close_streams`](Self::close_streams) was called.
    pub(crate) fn closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.closing.subscribe();
        async move {
            let _ = rx.wait_for(|c| *c).await;
        }
    }

    /// A live saga's view, if it is in memory.
    pub(crate) fn live_view(&self, gid: &str) -> Option<SagaView> {
        let shard = self.shard_of(gid).lock();
        let saga = shard.live.get(gid)?;
        Some(view_of(saga))
    }

    /// A recently finished saga's summary, if remembered.
    pub(crate) fn finished_summary(&self, gid: &str) -> Option<SagaSummary> {
        self.shard_of(gid)
            .lock()
            .finished
            .map
            .get(gid)
            .map(|f| f.summary(gid))
    }

    /// Summaries of the `limit` most recently started live sagas matching
    /// `filter`, newest first.
    ///
    /// Walks every live saga (one shard lock at a time), so callers run it
    /// off the async workers; memory stays at `limit` summaries (a min-heap
    /// by start time) however many sagas match.
    pub(crate) fn live_summaries(
        &self,
        filter: &dyn Fn(&SagaSummary) -> bool,
        limit: usize,
    ) -> Vec<SagaSummary> {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        /// A kept summary, ordered by start time alone.
        struct ByStart(SagaSummary);
        impl PartialEq for ByStart {
            fn eq(&self, other: &Self) -> bool {
                self.0.started_ms == other.0.started_ms
            }
        }
        impl Eq for ByStart {}
        impl PartialOrd for ByStart {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }
        impl Ord for ByStart {
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                self.0.started_ms.cmp(&other.0.started_ms)
            }
        }
        if limit == 0 {
            return Vec::new();
        }
        // A min-heap by start time: its top is the oldest kept.
        let mut kept: BinaryHeap<Reverse<ByStart>> = BinaryHeap::with_capacity(limit + 1);
        for m in self.shards.iter() {
            let shard = m.lock();
            for s in shard.live.values() {
                if kept.len() == limit
                    && kept
                        .peek()
                        .is_some_and(|Reverse(old)| s.started_ms <= old.0.started_ms)
                {
                    continue;
                }
                let sum = s.summary(0);
                if !filter(&sum) {
                    continue;
                }
                kept.push(Reverse(ByStart(sum)));
                if kept.len() > limit {
                    kept.pop();
                }
            }
        }
        // Ascending `Reverse` order is newest first.
        kept.into_sorted_vec()
            .into_iter()
            .map(|Reverse(ByStart(s))| s)
            .collect()
    }

    /// Live sagas by state.
    pub(crate) fn live_counts(&self) -> (u64, u64) {
        let (mut running, mut compensating) = (0, 0);
        for m in self.shards.iter() {
            for s in m.lock().live.values() {
                match s.state {
                    SagaState::Running => running += 1,
                    SagaState::Compensating => compensating += 1,
                    _ => {}
                }
            }
        }
        (running, compensating)
    }

    /// Waits until every queued `finish` reached the store (tests, shutdown),
    /// including a batch the background loop is writing. A batch the store
    /// refuses goes back in the queue (the background loop retries it).
    pub(crate) async fn flush(&self) -> Result<(), StoreError> {
        let queue = &self.finish_queue;
        let _writing = queue.writing.lock().await;
        let batch = std::mem::take(&mut *queue.pending.lock());
        if batch.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.store.finish(batch.clone()).await {
            queue.pending.lock().extend(batch);
            queue.notify.notify_one();
            return Err(e);
        }
        Ok(())
    }
}

fn view_of(saga: &Saga) -> SagaView {
    SagaView {
        summary: saga.summary(0),
        sub_transactions: saga
            .subs
            .iter()
            .map(|s| SubView {
                local_tx_id: s.local_tx_id.clone(),
                parent_tx_id: s.parent_tx_id.clone(),
                service_name: s.service_name.to_string(),
                instance_id: s.instance_id.to_string(),
                state: s.state,
                attempts: s.attempts,
                compensation_method: s.compensation_method.to_string(),
            })
            .collect(),
    }
}

async fn timer_loop(engine: Weak<Engine>, tick: Duration) {
    let mut interval = tokio::time::interval(tick.max(Duration::from_millis(1)));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        // A tick's deadlines in chunks, yielding between them; after a
        // restart that found many expired, the rest wait for the next ticks.
        // The saga timeouts of the whole tick are recorded in one append.
        let mut timeouts = Vec::new();
        let mut marks = Marks::new(&engine);
        for chunk in 0..EXPIRE_PER_TICK / EXPIRE_CHUNK {
            if chunk > 0 {
                tokio::task::yield_now().await;
            }
            if !engine.expire(Instant::now(), EXPIRE_CHUNK, &mut timeouts, &mut marks) {
                break;
            }
        }
        engine.record_timeouts(timeouts).await;
        drop(marks);
    }
}

/// Hands terminal sagas to `store.finish` in batches: everything queued
/// while the previous call ran goes in the next one.
async fn finish_loop(store: Arc<dyn SagaStore>, queue: Arc<FinishQueue>) {
    loop {
        queue.notify.notified().await;
        loop {
            let writing = queue.writing.lock().await;
            let batch = std::mem::take(&mut *queue.pending.lock());
            if batch.is_empty() {
                break;
            }
            if let Err(e) = store.finish(batch.clone()).await {
                // They stay unfinished in the store and would be recovered
                // (idempotently) after a restart; try again shortly.
                tracing::warn!(error = %e, sagas = batch.len(), "could not finish sagas; retrying");
                queue.pending.lock().extend(batch);
                drop(writing);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    /// The arrivals' bookkeeping, driven by hand: while a walk is scheduled
    /// an arrival only joins its set (no second walk); the walk takes the
    /// set and clears the flag; a walk dropped unrun clears it too. (An
    /// arrival landing inside a running walk's `on_instances` is left to
    /// the integration test, which cannot force that timing either.)
    #[tokio::test]
    async fn an_arrival_during_a_walk_is_left_to_that_walk_and_the_flag_is_always_cleared() {
        let engine = Engine::start(Arc::new(MemoryStore::new()), CoordinatorConfig::default())
            .await
            .unwrap();
        // A walk under way: an arrival only adds its service for it.
        engine.arrivals.lock().walk_scheduled = true;
        engine.instance_arrived("billing");
        {
            let a = engine.arrivals.lock();
            assert!(a.walk_scheduled);
            assert!(a.pending.contains("billing"), "left for the walk under way");
        }
        // That walk's loop takes it before it ends, and clears the flag.
        engine.drive_arrivals();
        {
            let a = engine.arrivals.lock();
            assert!(a.pending.is_empty() && !a.walk_scheduled);
        }
        // A walk dropped unrun (the runtime shutting down) clears it too.
        engine.arrivals.lock().walk_scheduled = true;
        drop(ArrivalWalk(Some(engine.clone())));
        assert!(!engine.arrivals.lock().walk_scheduled);
        // With no walk scheduled, an arrival schedules one (here on the
        // blocking pool), which empties the set and clears the flag.
        engine.instance_arrived("shipping");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            {
                let a = engine.arrivals.lock();
                if a.pending.is_empty() && !a.walk_scheduled {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "the scheduled walk never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
