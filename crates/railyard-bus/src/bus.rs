//! The event bus: registry, routing, send / publish / request.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};
use tokio::sync::oneshot;

use crate::consumer::ConsumerBuilder;
use crate::interceptor::{InterceptorId, MessageKind, Outbound, Verdict};
use crate::metrics::{shard_count, thread_shard, BusCounters, ConsumerStats};
use crate::queue::{ConsumerQueue, Envelope, Refused};
use crate::remote::{
    ClusterHook, RemoteKind, RemoteMessage, RemoteNode, ReplyHandle, ReplySink, Undelivered,
};
use crate::reply::{PendingReply, ReplySender};
use crate::timeouts::Timeouts;
use crate::{
    Body, BusError, CodecError, CodecRegistry, DeliveryOptions, Headers, Interceptor, Message,
    MessageCodec, MetricsSnapshot, SendError,
};

type Locals = Box<[Arc<ConsumerQueue>]>;
type Table = HashMap<Arc<str>, Arc<AddressEntry>, foldhash::fast::RandomState>;

/// Source of [`Inner::id`].
static NEXT_BUS_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's cached snapshot: (bus id, generation, table). No drop
    /// glue, so reading it is a plain thread-local load.
    static CACHED: std::cell::Cell<(u64, u64, *const Table)> =
        const { std::cell::Cell::new((0, 0, std::ptr::null())) };
    /// Set while a cached snapshot is borrowed (see `EventBus::snapshot`).
    static IN_USE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Owns the table `CACHED` points to; clears `CACHED` when the thread exits.
    static OWNED: OwnedTable = const { OwnedTable(std::cell::RefCell::new(None)) };
}

/// The owner of a thread's cached snapshot.
struct OwnedTable(std::cell::RefCell<Option<Arc<Table>>>);

impl OwnedTable {
    fn replace(&self, table: Option<Arc<Table>>) -> Option<Arc<Table>> {
        std::mem::replace(&mut *self.0.borrow_mut(), table)
    }
}

impl Drop for OwnedTable {
    fn drop(&mut self) {
        // The pointer must not outlive the table it points to.
        let _ = CACHED.try_with(|c| c.set((0, 0, std::ptr::null())));
    }
}

/// A registry snapshot: this thread's cached one, or a fresh `ArcSwap` guard.
enum Snapshot<'a> {
    Cached(&'a Table),
    Loaded(arc_swap::Guard<Arc<Table>>),
}

impl std::ops::Deref for Snapshot<'_> {
    type Target = Table;

    #[inline]
    fn deref(&self) -> &Table {
        match self {
            Snapshot::Cached(t) => t,
            Snapshot::Loaded(g) => g,
        }
    }
}

impl Drop for Snapshot<'_> {
    #[inline]
    fn drop(&mut self) {
        if matches!(self, Snapshot::Cached(_)) {
            IN_USE.set(false);
        }
    }
}

/// The consumers at one address. Immutable once published in the table:
/// a registration change builds a new entry.
struct AddressEntry {
    consumers: Box<[Arc<ConsumerQueue>]>,
    /// Other nodes with consumers here (clustered only). Chosen round-robin
    /// together with the local consumers, each as often as its weight.
    remotes: Box<[Arc<dyn RemoteNode>]>,
    /// The weight of each of `remotes` (how many consumers it has here, at
    /// most [`MAX_REMOTE_WEIGHT`]); empty when every weight is 1.
    weights: Box<[u32]>,
    /// With `weights`: the send targets after the local consumers, each an
    /// index into `remotes`, every remote as often as its weight,
    /// interleaved. Empty when every weight is 1 (target `locals + i` is
    /// then `remotes[i]`).
    slots: Box<[u32]>,
    /// Round-robin cursors, one cache line per thread shard, so two threads
    /// sending to one address do not bounce a shared counter between cores.
    cursors: Box<[CachePadded<AtomicUsize>]>,
}

/// The most a remote node weighs at one address: a node with more
/// consumers there gets this many shares of the sends, so the targets an
/// address lists stay bounded.
pub const MAX_REMOTE_WEIGHT: u32 = 256;

/// Remote nodes at one address, each with its weight (see
/// [`EventBus::set_weighted_remote_nodes_many`]).
pub type WeightedNodes = Vec<(Arc<dyn RemoteNode>, u32)>;

/// Round-robin cursors for an entry with `targets` send targets: the same
/// per-thread shards as the counters (a power of two), none for one target.
fn cursors(targets: usize) -> Box<[CachePadded<AtomicUsize>]> {
    let shards = if targets > 1 { shard_count() } else { 0 };
    (0..shards)
        .map(|_| CachePadded::new(AtomicUsize::new(0)))
        .collect()
}

impl AddressEntry {
    /// `weights` parallel to `remotes` (or empty: all 1).
    fn weighted(
        consumers: Box<[Arc<ConsumerQueue>]>,
        remotes: Box<[Arc<dyn RemoteNode>]>,
        weights: &[u32],
    ) -> Self {
        let weights: Box<[u32]> =
            if weights.len() == remotes.len() && weights.iter().any(|w| *w != 1) {
                weights
                    .iter()
                    .map(|w| (*w).clamp(1, MAX_REMOTE_WEIGHT))
                    .collect()
            } else {
                Box::new([])
            };
        let mut slots = Vec::new();
        for round in 0..weights.iter().copied().max().unwrap_or(0) {
            for (i, w) in weights.iter().enumerate() {
                if *w > round {
                    slots.push(u32::try_from(i).unwrap_or(u32::MAX));
                }
            }
        }
        let targets = consumers.len() + slots.len().max(remotes.len());
        Self {
            consumers,
            remotes,
            weights,
            slots: slots.into_boxed_slice(),
            cursors: cursors(targets),
        }
    }

    /// The same other nodes (weights and send order kept), with
    /// `consumers` here.
    fn with_consumers(&self, consumers: Locals) -> Self {
        let targets = consumers.len() + self.remote_targets();
        Self {
            consumers,
            remotes: self.remotes.clone(),
            weights: self.weights.clone(),
            slots: self.slots.clone(),
            cursors: cursors(targets),
        }
    }

    /// Non-local consumers here (what the cluster learns of).
    fn public_count(&self) -> usize {
        self.consumers.iter().filter(|q| !q.local).count()
    }

    /// Send targets on other nodes (each remote counted by its weight).
    #[inline]
    fn remote_targets(&self) -> usize {
        if self.slots.is_empty() {
            self.remotes.len()
        } else {
            self.slots.len()
        }
    }

    /// Whether this entry lists exactly `nodes` (the same nodes, in the same
    /// order, with the same weights).
    fn same_remotes(&self, nodes: &[(Arc<dyn RemoteNode>, u32)]) -> bool {
        self.remotes.len() == nodes.len()
            && self
                .remotes
                .iter()
                .enumerate()
                .zip(nodes)
                .all(|((i, x), (y, w))| {
                    Arc::ptr_eq(x, y)
                        && self.weights.get(i).copied().unwrap_or(1)
                            == (*w).clamp(1, MAX_REMOTE_WEIGHT)
                })
    }

    /// Index of the next of `n` targets for this thread.
    #[inline]
    fn next_start(&self, n: usize) -> usize {
        if n <= 1 || self.cursors.is_empty() {
            return 0;
        }
        let shard = thread_shard() & (self.cursors.len() - 1);
        // Only this thread's shard writes here in the common case; a relaxed
        // load + store (no lock prefix) is enough for round-robin fairness.
        let c = &self.cursors[shard];
        let v = c.load(Ordering::Relaxed);
        c.store(v.wrapping_add(1), Ordering::Relaxed);
        v % n
    }
}

pub(crate) struct Inner {
    /// Lock-free snapshot read on every send; replaced (copy on write) on
    /// every registration change.
    table: ArcSwap<Table>,
    /// This bus, for the per-thread snapshot cache (never reused, unlike an address).
    id: u64,
    /// Bumped after every `table` store: a thread's cached snapshot is
    /// current while the generation it was taken at is.
    generation: AtomicU64,
    /// Serializes registry writers so no update is lost between load and store.
    /// Never held across an await, never taken on the send path.
    write: Mutex<()>,
    /// Totals of consumers that were unregistered, so bus metrics never go down.
    retired: Mutex<ConsumerStats>,
    /// Told of registrations other nodes must learn of; `None` unless clustered.
    hook: RwLock<Option<Arc<dyn ClusterHook>>>,
    pub(crate) shared: Arc<Shared>,
}

/// What consumers and messages need from the bus, without the registry.
///
/// Each consumer queue holds one reference, taken at registration; a message
/// reaches it through its consumer's queue. So answering a request touches
/// only that consumer's reference count, never one shared by every core (and
/// no cycle forms: the registry holds queues, queues hold this, this holds no
/// queue).
pub(crate) struct Shared {
    pub(crate) counters: BusCounters,
    /// Checked with one relaxed load on the hot path; the list itself is only
    /// read when set.
    has_interceptors: AtomicBool,
    interceptors: ArcSwap<Vec<(InterceptorId, Arc<dyn Interceptor>)>>,
    codecs: RwLock<CodecRegistry>,
    /// Bumped (under the registry's write lock) whenever a codec is
    /// registered or a default changes: what a [`CodecCache`] checks.
    codecs_changed: AtomicU64,
    next_id: AtomicU64,
    /// Request timeouts (one sweeper task per bus instead of a timer per request).
    pub(crate) timeouts: Arc<Timeouts>,
}

impl Shared {
    /// Runs outbound interceptors, if any are installed.
    #[inline]
    pub(crate) fn outbound_check(
        &self,
        address: &str,
        kind: MessageKind,
        headers: &mut Headers,
        body: &Body,
    ) -> Result<(), BusError> {
        if !self.has_interceptors.load(Ordering::Acquire) {
            return Ok(());
        }
        let list = self.interceptors.load();
        let mut out = Outbound {
            address,
            kind,
            headers,
            body,
        };
        for (_, i) in list.iter() {
            if let Verdict::Reject(reason) = i.outbound(&mut out) {
                return Err(BusError::Rejected { reason });
            }
        }
        Ok(())
    }

    /// Runs inbound interceptors; `Err` carries the veto.
    #[inline]
    pub(crate) fn inbound_check(&self, msg: &mut Message) -> Result<(), BusError> {
        if !self.has_interceptors.load(Ordering::Acquire) {
            return Ok(());
        }
        let list = self.interceptors.load();
        for (_, i) in list.iter() {
            // Inbound interceptors run on the consumer's task or its loop's
            // dispatcher: a panic there would take down every consumer the
            // loop runs, so it counts as a veto of this message instead.
            let verdict = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| i.inbound(msg)))
                .unwrap_or_else(|_| {
                    Verdict::Reject("an inbound interceptor panicked on this message".into())
                });
            if let Verdict::Reject(reason) = verdict {
                return Err(BusError::Rejected { reason });
            }
        }
        Ok(())
    }
}

/// The event bus. Cheap to clone; all clones are the same bus.
///
/// # Delivery
/// - `send` / `request`: one consumer at the address, chosen round-robin
///   (per sending thread); consumers whose buffer is full are skipped.
/// - `publish`: every consumer at the address gets the message (the body is
///   shared, not copied).
/// - Local consumers and local-only delivery never leave this process. Until a
///   cluster manager is attached, every consumer is local.
///
/// # Ordering
/// Each call enqueues before it returns (or, for `request`, before the
/// returned future is first polled, when it had to wait for room). So messages
/// that one task sends one after another reach any single consumer in that
/// order, and that consumer handles them in that order. Messages from
/// different senders interleave arbitrarily.
///
/// # Back-pressure
/// Every consumer has a bounded buffer (default
/// [`DEFAULT_CAPACITY`](crate::DEFAULT_CAPACITY) messages). When every buffer
/// at an address is full:
/// - `send` fails with [`BusError::Full`] and hands the body back;
/// - `send_wait` waits for room;
/// - `request` waits for room inside its future (bounded by its timeout);
/// - `publish` skips the full consumers and reports how many it skipped.
///
/// Every refusal is counted in the consumer's `refused_full` metric.
#[derive(Clone)]
pub struct EventBus {
    pub(crate) inner: Arc<Inner>,
}

/// What a `publish` reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PublishReport {
    /// Consumers that accepted the message.
    pub delivered: usize,
    /// Consumers whose buffer was full; they did not get it.
    pub skipped_full: usize,
}

const DEFAULT_OPTIONS: DeliveryOptions = DeliveryOptions::DEFAULT;

impl Default for EventBus {
    fn default() -> Self {
        Self::new()
    }
}

impl EventBus {
    /// A new, empty bus.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                table: ArcSwap::from_pointee(Table::default()),
                id: NEXT_BUS_ID.fetch_add(1, Ordering::Relaxed),
                generation: AtomicU64::new(0),
                write: Mutex::new(()),
                retired: Mutex::new(ConsumerStats::default()),
                hook: RwLock::new(None),
                shared: Arc::new(Shared {
                    counters: BusCounters::new(),
                    has_interceptors: AtomicBool::new(false),
                    interceptors: ArcSwap::from_pointee(Vec::new()),
                    codecs: RwLock::new(CodecRegistry::new()),
                    codecs_changed: AtomicU64::new(0),
                    next_id: AtomicU64::new(1),
                    timeouts: Timeouts::new(),
                }),
            }),
        }
    }

    /// Starts registering a consumer at `address`. Finish with
    /// [`ConsumerBuilder::handler`] or [`ConsumerBuilder::stream`].
    ///
    /// Once clustered, a `consumer` is visible on every node.
    pub fn consumer(&self, address: impl Into<String>) -> ConsumerBuilder<'_> {
        ConsumerBuilder::new(self, address.into(), false)
    }

    /// Like [`consumer`](Self::consumer), but the registration never leaves
    /// this node, even when clustered.
    pub fn local_consumer(&self, address: impl Into<String>) -> ConsumerBuilder<'_> {
        ConsumerBuilder::new(self, address.into(), true)
    }

    /// Sends `body` to one consumer at `address`.
    ///
    /// # Errors
    /// [`BusError::NoHandlers`], [`BusError::Full`], [`BusError::Rejected`],
    /// [`BusError::UnknownCodec`], [`BusError::InvalidAddress`]; the body is
    /// handed back in the [`SendError`].
    #[inline]
    pub fn send<T: Any + Send + Sync>(&self, address: &str, body: T) -> Result<(), SendError> {
        self.send_with(address, body, &DEFAULT_OPTIONS)
    }

    /// [`send`](Self::send) with delivery options.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    #[inline]
    pub fn send_with<T: Any + Send + Sync>(
        &self,
        address: &str,
        body: T,
        options: &DeliveryOptions,
    ) -> Result<(), SendError> {
        self.send_body(address, Body::new(body), options)
    }

    /// [`send_with`](Self::send_with) for a transport that builds options
    /// per message (a cluster link, for each message it reads): the
    /// headers move from `options` into the message instead of being
    /// cloned (a reference count up, and down again when the options are
    /// dropped, per message). When it fails, `options` is given back as it
    /// was, for a retry that waits for room. With interceptors registered
    /// the headers are cloned as `send_with` does, since an interceptor may
    /// change the message's copy.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    pub fn send_moving_headers(
        &self,
        address: &str,
        body: Body,
        options: &mut DeliveryOptions,
    ) -> Result<(), SendError> {
        if self.inner.shared.has_interceptors.load(Ordering::Acquire) {
            return self.send_body(address, body, options);
        }
        // No interceptor: only the address and codec are checked (an
        // interceptor added meanwhile counts as added after this send), so
        // the headers come back untouched on a refusal.
        if let Err(e) = self.check_target(address, options) {
            return Err(SendError::new(e, body));
        }
        let env = Envelope {
            headers: std::mem::take(&mut options.headers),
            body,
            reply: None,
            send: true,
        };
        self.inner.shared.counters.sent.add(1);
        self.route(address, env, options).map_err(|(e, env, _)| {
            options.headers = env.headers;
            SendError::new(e, env.body)
        })
    }

    /// The non-generic body of [`send_with`](Self::send_with) (a [`Body`]
    /// passed to `send_with` is used as is, so transports call that).
    fn send_body(
        &self,
        address: &str,
        body: Body,
        options: &DeliveryOptions,
    ) -> Result<(), SendError> {
        let mut env = Envelope {
            headers: options.headers.clone(),
            body,
            reply: None,
            send: true,
        };
        if let Err(e) = self.prepare(address, MessageKind::Send, &mut env, options) {
            return Err(SendError::new(e, env.body));
        }
        self.inner.shared.counters.sent.add(1);
        self.route(address, env, options)
            .map_err(|(e, env, _)| SendError::new(e, env.body))
    }

    /// Sends `body` to one consumer, waiting for room if every buffer is full.
    ///
    /// # Errors
    /// As [`send`](Self::send), except [`BusError::Full`].
    ///
    /// # Cancel safety
    /// If cancelled while waiting, the message was not delivered.
    pub async fn send_wait<T: Any + Send + Sync>(
        &self,
        address: &str,
        body: T,
        options: &DeliveryOptions,
    ) -> Result<(), SendError> {
        let mut env = Envelope {
            headers: options.headers.clone(),
            body: Body::new(body),
            reply: None,
            send: true,
        };
        if let Err(e) = self.prepare(address, MessageKind::Send, &mut env, options) {
            return Err(SendError::new(e, env.body));
        }
        self.inner.shared.counters.sent.add(1);
        self.route_waiting(address, env, options)
            .await
            .map_err(|(e, env)| SendError::new(e, env.body))
    }

    /// Routes `env`, waiting for room (in a local buffer or a node's link)
    /// whenever every target is full.
    async fn route_waiting(
        &self,
        address: &str,
        mut env: Envelope,
        options: &DeliveryOptions,
    ) -> Result<(), (BusError, Envelope)> {
        loop {
            match self.route(address, env, options) {
                Ok(()) => return Ok(()),
                Err((BusError::Full { .. }, back, Some(Room::Local(queue)))) => {
                    let mut slot = Some(back);
                    match std::future::poll_fn(|cx| queue.poll_push(&mut slot, cx)).await {
                        Ok(()) => return Ok(()),
                        // Closed meanwhile: route again.
                        Err(_) => env = slot.take().expect("a refused push leaves the envelope"),
                    }
                }
                Err((BusError::Full { .. }, back, Some(Room::Remote(node)))) => {
                    if back.reply.is_some() {
                        std::future::poll_fn(|cx| node.poll_request_room(cx)).await;
                    } else {
                        std::future::poll_fn(|cx| node.poll_room(cx)).await;
                    }
                    env = back;
                }
                Err((e, back, _)) => return Err((e, back)),
            }
        }
    }

    /// Sends a request to one consumer at `address`; the returned future
    /// resolves to its reply or a typed failure. Default timeout 30 s.
    pub fn request<T: Any + Send + Sync>(&self, address: &str, body: T) -> PendingReply<'_> {
        self.request_with(address, body, &DEFAULT_OPTIONS)
    }

    /// [`request`](Self::request) with delivery options (timeout, headers...).
    #[inline]
    pub fn request_with<T: Any + Send + Sync>(
        &self,
        address: &str,
        body: T,
        options: &DeliveryOptions,
    ) -> PendingReply<'_> {
        self.request_body(address, Body::new(body), options)
    }

    /// The non-generic body of [`request_with`](Self::request_with).
    fn request_body(
        &self,
        address: &str,
        body: Body,
        options: &DeliveryOptions,
    ) -> PendingReply<'_> {
        let start = tokio::time::Instant::now();
        self.inner.shared.counters.requests.add(1);
        let (tx, rx) = oneshot::channel();
        let mut env = Envelope {
            headers: options.headers.clone(),
            body,
            reply: Some(ReplySender::Local(tx)),
            send: true,
        };
        if let Err(e) = self.prepare(address, MessageKind::Request, &mut env, options) {
            return PendingReply::failed(self, e);
        }
        self.inner.shared.counters.sent.add(1);
        match self.route(address, env, options) {
            Ok(()) => {
                PendingReply::waiting(&self.inner.shared, Some(self), rx, options.timeout, start)
            }
            Err((BusError::Full { .. }, env, Some(room))) => {
                PendingReply::blocked(self, room, env, address, rx, options, start)
            }
            Err((e, _, _)) => PendingReply::failed(self, e),
        }
    }

    /// Delivers `body` to every consumer at `address`. Publishing to an
    /// address with no consumer is not an error: the report says 0 delivered.
    ///
    /// # Errors
    /// [`BusError::Rejected`], [`BusError::UnknownCodec`], [`BusError::InvalidAddress`].
    pub fn publish<T: Any + Send + Sync>(
        &self,
        address: &str,
        body: T,
    ) -> Result<PublishReport, SendError> {
        self.publish_with(address, body, &DEFAULT_OPTIONS)
    }

    /// [`publish`](Self::publish) with delivery options.
    ///
    /// # Errors
    /// As [`publish`](Self::publish).
    #[inline]
    pub fn publish_with<T: Any + Send + Sync>(
        &self,
        address: &str,
        body: T,
        options: &DeliveryOptions,
    ) -> Result<PublishReport, SendError> {
        self.publish_body(address, Body::new(body), options)
    }

    /// The non-generic body of [`publish_with`](Self::publish_with).
    fn publish_body(
        &self,
        address: &str,
        body: Body,
        options: &DeliveryOptions,
    ) -> Result<PublishReport, SendError> {
        let mut env = Envelope {
            headers: options.headers.clone(),
            body,
            reply: None,
            send: false,
        };
        if let Err(e) = self.prepare(address, MessageKind::Publish, &mut env, options) {
            return Err(SendError::new(e, env.body));
        }
        self.inner.shared.counters.published.add(1);
        let table = self.snapshot();
        let mut report = PublishReport::default();
        if let Some((key, entry)) = table.get_key_value(address) {
            for q in entry.consumers.iter() {
                let copy = Envelope {
                    headers: env.headers.clone(),
                    body: env.body.clone(),
                    reply: None,
                    send: false,
                };
                match q.try_push(copy) {
                    Ok(()) => report.delivered += 1,
                    Err((Refused::Full, _)) => report.skipped_full += 1,
                    Err((Refused::Closed, _)) => {}
                }
            }
            if !options.local_only {
                for node in entry.remotes.iter() {
                    let msg = RemoteMessage {
                        // The registry's own key: no copy of the address.
                        address: key.clone(),
                        kind: RemoteKind::Publish,
                        headers: env.headers.clone(),
                        body: env.body.clone(),
                        codec: options.codec.clone(),
                        reply: None,
                    };
                    crate::dispatch::note_sent_away();
                    match node.deliver(msg) {
                        Ok(()) => report.delivered += 1,
                        Err(u) if matches!(u.error, BusError::Full { .. }) => {
                            report.skipped_full += 1;
                        }
                        Err(_) => {}
                    }
                }
            }
        }
        if report.delivered == 0 {
            self.inner.shared.counters.undeliverable.add(1);
        }
        Ok(report)
    }

    /// Installs an interceptor; it sees every message from now on.
    pub fn add_interceptor(&self, interceptor: Arc<dyn Interceptor>) -> InterceptorId {
        let id = InterceptorId(self.inner.shared.next_id.fetch_add(1, Ordering::Relaxed));
        let _w = self.inner.write.lock();
        let mut list = Vec::clone(&self.inner.shared.interceptors.load());
        list.push((id, interceptor));
        self.inner.shared.interceptors.store(Arc::new(list));
        self.inner
            .shared
            .has_interceptors
            .store(true, Ordering::Release);
        id
    }

    /// Removes an interceptor; returns whether it was installed.
    pub fn remove_interceptor(&self, id: InterceptorId) -> bool {
        let _w = self.inner.write.lock();
        let mut list = Vec::clone(&self.inner.shared.interceptors.load());
        let before = list.len();
        list.retain(|(i, _)| *i != id);
        let removed = list.len() != before;
        self.inner
            .shared
            .has_interceptors
            .store(!list.is_empty(), Ordering::Release);
        self.inner.shared.interceptors.store(Arc::new(list));
        removed
    }

    /// Registers a codec for the wire.
    ///
    /// # Errors
    /// [`CodecError::Duplicate`] if the name is taken.
    pub fn register_codec(&self, codec: Arc<dyn MessageCodec>) -> Result<(), CodecError> {
        self.change_codecs(|codecs| codecs.register(codec))
    }

    /// Makes a registered codec the default for bodies of type `T`.
    ///
    /// # Errors
    /// [`CodecError::Unknown`] if no codec has that name.
    pub fn set_default_codec<T: Any>(&self, name: &str) -> Result<(), CodecError> {
        self.change_codecs(|codecs| codecs.set_default::<T>(name))
    }

    /// Applies `change` to the codec registry under its write lock and, if
    /// it succeeded, tells every [`CodecCache`] to drop what it holds.
    fn change_codecs(
        &self,
        change: impl FnOnce(&mut CodecRegistry) -> Result<(), CodecError>,
    ) -> Result<(), CodecError> {
        let shared = &self.inner.shared;
        let mut codecs = shared.codecs.write();
        change(&mut codecs)?;
        shared.codecs_changed.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// A cache of the codecs one transport connection uses, for encoding and
    /// decoding bodies without the registry's lock (see [`CodecCache`]).
    pub fn codec_cache(&self) -> CodecCache {
        CodecCache {
            shared: self.inner.shared.clone(),
            seen: u64::MAX,
            default: None,
            named: None,
        }
    }

    /// A copy of the codec registry (for transports that encode off the bus).
    pub fn codecs(&self) -> CodecRegistry {
        self.inner.shared.codecs.read().clone()
    }

    /// Reads every counter. Costs one lock per registered consumer: meant for
    /// scrapes, not for the hot path.
    pub fn metrics(&self) -> MetricsSnapshot {
        let c = &self.inner.shared.counters;
        let requests = c.requests.get();
        let done = c.replies_done.get();
        let mut consumers = *self.inner.retired.lock();
        let table = self.inner.table.load();
        let mut registered = 0;
        for entry in table.values() {
            for q in entry.consumers.iter() {
                consumers.merge(&q.stats());
                registered += 1;
            }
        }
        MetricsSnapshot {
            sent: c.sent.get(),
            published: c.published.get(),
            requests,
            pending_replies: requests.saturating_sub(done),
            reply_failures: std::array::from_fn(|i| c.failures[i].get()),
            undeliverable: c.undeliverable.get(),
            consumers,
            registered_consumers: registered,
        }
    }

    /// Number of consumers registered at `address`.
    pub fn consumer_count(&self, address: &str) -> usize {
        self.inner
            .table
            .load()
            .get(address)
            .map_or(0, |e| e.consumers.len())
    }

    // ---- crate internals -------------------------------------------------

    /// Validation and outbound interceptors, before routing.
    #[inline]
    fn prepare(
        &self,
        address: &str,
        kind: MessageKind,
        env: &mut Envelope,
        options: &DeliveryOptions,
    ) -> Result<(), BusError> {
        self.check_target(address, options)?;
        self.inner
            .shared
            .outbound_check(address, kind, &mut env.headers, &env.body)
            .map_err(|e| self.refuse(e))
    }

    /// The checks of [`prepare`](Self::prepare) before the interceptors: a
    /// valid address, a registered codec.
    fn check_target(&self, address: &str, options: &DeliveryOptions) -> Result<(), BusError> {
        if address.is_empty() {
            return Err(self.refuse(BusError::InvalidAddress {
                address: address.to_owned(),
            }));
        }
        if let Some(name) = &options.codec {
            if !self.inner.shared.codecs.read().contains(name) {
                return Err(self.refuse(BusError::UnknownCodec {
                    name: name.to_string(),
                }));
            }
        }
        Ok(())
    }

    fn refuse(&self, e: BusError) -> BusError {
        self.inner.shared.counters.undeliverable.add(1);
        e
    }

    /// Puts a point-to-point envelope into one consumer's buffer, or hands it
    /// to a remote node's link.
    ///
    /// On `Full`, returns a local queue a waiting sender may wait on.
    // The refusal hands the envelope back by value: boxing it would allocate
    // on every full buffer, the path back-pressure exercises most.
    #[allow(clippy::result_large_err)]
    #[inline]
    pub(crate) fn route(
        &self,
        address: &str,
        mut env: Envelope,
        options: &DeliveryOptions,
    ) -> Result<(), (BusError, Envelope, Option<Room>)> {
        let table = self.snapshot();
        let entry = table.get_key_value(address);
        let (locals, remotes) = entry.map_or((0, 0), |(_, e)| {
            let remotes = if options.local_only {
                0
            } else {
                e.remote_targets()
            };
            (e.consumers.len(), remotes)
        });
        let n = locals + remotes;
        let Some((key, entry)) = entry.filter(|_| n > 0) else {
            self.inner.shared.counters.undeliverable.add(1);
            return Err((
                BusError::NoHandlers {
                    address: address.to_owned(),
                },
                env,
                None,
            ));
        };
        let pick = entry.next_start(n);
        // The pick is weighted; after a refusal the other targets are tried
        // once each, from there. A remote node holds as many of the `n`
        // shares as its weight, and a full or lost link refuses them all
        // alike: walking the shares would ask it up to weight times.
        let (start, n) = if remotes == 0 || entry.slots.is_empty() {
            (pick, n)
        } else {
            let first = match pick.checked_sub(locals) {
                Some(t) => locals + entry.slots[t] as usize,
                None => pick,
            };
            (first, locals + entry.remotes.len())
        };
        let mut full: Option<Room> = None;
        for k in 0..n {
            let idx = if start + k >= n {
                start + k - n
            } else {
                start + k
            };
            if idx < locals {
                match entry.consumers[idx].try_push(env) {
                    Ok(()) => return Ok(()),
                    Err((refused, back)) => {
                        if refused == Refused::Full && !matches!(full, Some(Room::Local(_))) {
                            full = Some(Room::Local(entry.consumers[idx].clone()));
                        }
                        env = back;
                    }
                }
            } else {
                let node = &entry.remotes[idx - locals];
                match self.route_remote(node, key, env, options) {
                    Ok(()) => return Ok(()),
                    Err((e, back)) => {
                        if matches!(e, BusError::Full { .. }) && full.is_none() {
                            full = Some(Room::Remote(node.clone()));
                        }
                        env = back;
                    }
                }
            }
        }
        self.inner.shared.counters.undeliverable.add(1);
        if full.is_some() {
            // A waiting sender waits on a full local buffer if there is one
            // (it drains fastest), else on a full link.
            Err((
                BusError::Full {
                    address: address.to_owned(),
                },
                env,
                full,
            ))
        } else {
            Err((
                BusError::NoHandlers {
                    address: address.to_owned(),
                },
                env,
                None,
            ))
        }
    }

    /// Hands a point-to-point envelope to another node's link.
    #[cold]
    fn route_remote(
        &self,
        node: &Arc<dyn RemoteNode>,
        address: &Arc<str>,
        env: Envelope,
        options: &DeliveryOptions,
    ) -> Result<(), (BusError, Envelope)> {
        let request = env.reply.is_some();
        let kind = if request {
            RemoteKind::Request {
                timeout: options.timeout,
            }
        } else {
            RemoteKind::Send
        };
        let msg = RemoteMessage {
            // The registry's own key: no copy of the address per message.
            address: address.clone(),
            kind,
            headers: env.headers,
            body: env.body,
            codec: options.codec.clone(),
            reply: env.reply.map(|tx| ReplyHandle { tx }),
        };
        crate::dispatch::note_sent_away();
        match node.deliver(msg) {
            Ok(()) => Ok(()),
            // A request handed back without its reply handle was already
            // answered (the link failed it, e.g. its peer was lost between
            // taking the request and refusing it): routing it on would
            // deliver it a second time, as a send nobody can answer.
            Err(u) if request && u.message.reply.is_none() => Ok(()),
            Err(u) => {
                let Undelivered { error, message: m } = *u;
                Err((
                    error,
                    Envelope {
                        headers: m.headers,
                        body: m.body,
                        reply: m.reply.map(|h| h.tx),
                        send: true,
                    },
                ))
            }
        }
    }

    /// The registry snapshot for one send or publish.
    ///
    /// Each thread keeps the snapshot it last used with the generation it
    /// was taken at; while no registration changed since, this costs one
    /// atomic load instead of `ArcSwap::load`, whose guard claims and then
    /// releases a debt slot with two locked instructions (measured: 15% of
    /// a local send-send round trip's CPU). A nested use on the same thread
    /// (none exists today: routing runs no user code) or another bus falls
    /// back to `ArcSwap::load`.
    #[inline]
    fn snapshot(&self) -> Snapshot<'_> {
        let generation = self.inner.generation.load(Ordering::Acquire);
        let (bus, at, table) = CACHED.get();
        if bus == self.inner.id && at == generation && !table.is_null() && !IN_USE.get() {
            IN_USE.set(true);
            // Safety: `table` came from `Arc::into_raw` of the Arc that
            // `OWNED` keeps; only `refresh_cache` replaces it, which never
            // runs while `IN_USE` is set (this snapshot clears it on drop).
            return Snapshot::Cached(unsafe { &*table });
        }
        self.refresh_cache(generation)
    }

    #[cold]
    fn refresh_cache(&self, generation: u64) -> Snapshot<'_> {
        if !IN_USE.get() {
            let table = self.inner.table.load_full();
            let raw = Arc::as_ptr(&table);
            let replaced = OWNED.with(|o| o.replace(Some(table)));
            CACHED.set((self.inner.id, generation, raw));
            drop(replaced);
        }
        Snapshot::Loaded(self.inner.table.load())
    }

    /// Publishes a new registry snapshot, then bumps the generation (in
    /// that order: a thread that sees the new generation loads at least
    /// this snapshot).
    fn store_table(&self, table: Table) {
        self.inner.table.store(Arc::new(table));
        self.inner.generation.fetch_add(1, Ordering::Release);
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.inner.shared.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Adds a consumer queue to the registry. When clustered and the queue
    /// is not local, returns the advertisement to await before the
    /// registration counts as done (also for a second consumer at an
    /// address whose first one is still being advertised).
    ///
    /// The hook is told under the registry's write lock, so it hears of
    /// registrations and withdrawals in the order the registry changed.
    pub(crate) fn register(&self, queue: Arc<ConsumerQueue>) -> Option<Advertisement> {
        let _w = self.inner.write.lock();
        let public = {
            let current = self.inner.table.load_full();
            let mut table = Table::clone(&current);
            let entry = match table.get(&*queue.address) {
                Some(e) => {
                    e.with_consumers(e.consumers.iter().cloned().chain([queue.clone()]).collect())
                }
                None => AddressEntry::weighted(Box::new([queue.clone()]), Box::new([]), &[]),
            };
            let public = entry.public_count();
            table.insert(queue.address.clone(), Arc::new(entry));
            self.store_table(table);
            public
        };
        if queue.local {
            return None;
        }
        let hook = self.inner.hook.read().clone()?;
        Some(hook.advertise(&queue.address, public))
    }

    /// Removes a consumer queue from the registry, closes it and fails what
    /// it still buffered. Idempotent.
    pub(crate) fn unregister(&self, queue: &ConsumerQueue) {
        {
            let _w = self.inner.write.lock();
            let current = self.inner.table.load_full();
            if let Some(e) = current.get(&*queue.address) {
                if e.consumers.iter().any(|q| q.id == queue.id) {
                    let mut table = Table::clone(&current);
                    let rest: Box<[Arc<ConsumerQueue>]> = e
                        .consumers
                        .iter()
                        .filter(|q| q.id != queue.id)
                        .cloned()
                        .collect();
                    let left = e.with_consumers(rest);
                    let public_left = left.public_count();
                    if left.consumers.is_empty() && left.remotes.is_empty() {
                        table.remove(&*queue.address);
                    } else {
                        table.insert(queue.address.clone(), Arc::new(left));
                    }
                    self.store_table(table);
                    if !queue.local {
                        // Under the write lock: in registry order (see `register`).
                        if let Some(hook) = self.inner.hook.read().clone() {
                            hook.withdraw(&queue.address, public_left);
                        }
                    }
                }
            }
        }
        if !queue.close_and_fail() {
            return;
        }
        self.inner.retired.lock().merge(&queue.stats());
    }

    // ---- the cluster's side door (see `remote`) --------------------------

    /// Installs (or with `None`, removes) the hook told about registrations
    /// other nodes must learn of. The addresses that already have non-local
    /// consumers here are advertised through it at once, under the same
    /// lock as every later registration and withdrawal (so a consumer that
    /// leaves meanwhile is withdrawn after, never before); returns each with
    /// its advertisement, for the caller to await.
    pub fn set_cluster_hook(
        &self,
        hook: Option<Arc<dyn ClusterHook>>,
    ) -> Vec<(String, Advertisement)> {
        let _w = self.inner.write.lock();
        *self.inner.hook.write() = hook.clone();
        let Some(hook) = hook else {
            return Vec::new();
        };
        let table = self.inner.table.load();
        table
            .iter()
            .filter_map(|(a, e)| {
                let public = e.public_count();
                (public > 0).then(|| (a.to_string(), hook.advertise(a, public)))
            })
            .collect()
    }

    /// Removes the cluster hook if it is `hook` (the same `Arc`), and
    /// leaves another one in place: a stopping cluster node then never
    /// removes the hook of a node started on the same bus after it.
    /// Returns whether it was removed.
    pub fn remove_cluster_hook(&self, hook: &Arc<dyn ClusterHook>) -> bool {
        let _w = self.inner.write.lock();
        let mut current = self.inner.hook.write();
        if current.as_ref().is_some_and(|h| Arc::ptr_eq(h, hook)) {
            *current = None;
            true
        } else {
            false
        }
    }

    /// Replaces the remote nodes that have consumers at `address` (an empty
    /// list removes them). The send path sees the change at once; it never
    /// calls back into the cluster. Several addresses at once: use
    /// [`set_remote_nodes_many`](Self::set_remote_nodes_many), which copies the
    /// registry once for all of them instead of once each.
    pub fn set_remote_nodes(&self, address: &str, nodes: Vec<Arc<dyn RemoteNode>>) {
        self.set_remote_nodes_many([(address, nodes)]);
    }

    /// Replaces the remote nodes at each address in `changes` (an empty list
    /// removes them) and publishes one new registry snapshot for the whole
    /// batch. Returns how many addresses changed.
    ///
    /// Why a batch: publishing a change copies the whole registry, under the
    /// registry's write lock, which local registrations wait on too. A cluster
    /// view change that touches S addresses, applied one address at a time,
    /// copied it S times (for 10,000 addresses, about 10^8 steps); here it is
    /// copied at most once.
    ///
    /// An address whose list is unchanged (the same nodes in the same order)
    /// keeps its entry, and if no address changed nothing is published. An
    /// address left with neither local consumers nor remote nodes leaves the
    /// registry. If an address appears twice, the later list wins.
    ///
    /// The one copy still grows with the registry: with many addresses, call
    /// this off the async workers (the cluster node does).
    pub fn set_remote_nodes_many<A: AsRef<str>>(
        &self,
        changes: impl IntoIterator<Item = (A, Vec<Arc<dyn RemoteNode>>)>,
    ) -> usize {
        self.set_weighted_remote_nodes_many(
            changes
                .into_iter()
                .map(|(a, nodes)| (a, nodes.into_iter().map(|n| (n, 1)).collect())),
        )
    }

    /// [`set_remote_nodes_many`](Self::set_remote_nodes_many) with a weight
    /// per node: how many consumers it has at the address. `send` and
    /// `request` choose each node that many times per round, so every
    /// consumer in the cluster gets its share (a weight is taken between 1
    /// and [`MAX_REMOTE_WEIGHT`]); `publish` still reaches each node once.
    pub fn set_weighted_remote_nodes_many<A: AsRef<str>>(
        &self,
        changes: impl IntoIterator<Item = (A, WeightedNodes)>,
    ) -> usize {
        let _w = self.inner.write.lock();
        let current = self.inner.table.load_full();
        // Copied on the first change only; later changes edit the copy.
        let mut next: Option<Table> = None;
        let mut changed = 0;
        for (address, nodes) in changes {
            let address = address.as_ref();
            let consumers = match next.as_ref().unwrap_or(&current).get(address) {
                Some(e) if e.same_remotes(&nodes) => continue,
                Some(e) => e.consumers.clone(),
                None if nodes.is_empty() => continue,
                None => Locals::default(),
            };
            let table = next.get_or_insert_with(|| Table::clone(&current));
            if consumers.is_empty() && nodes.is_empty() {
                table.remove(address);
            } else {
                let (nodes, weights): (Vec<_>, Vec<_>) = nodes.into_iter().unzip();
                let entry = Arc::new(AddressEntry::weighted(
                    consumers,
                    nodes.into_boxed_slice(),
                    &weights,
                ));
                match table.get_mut(address) {
                    // Keeps the key the table already has (no new `Arc<str>`).
                    Some(slot) => *slot = entry,
                    None => {
                        table.insert(address.into(), entry);
                    }
                }
            }
            changed += 1;
        }
        if let Some(table) = next {
            self.store_table(table);
        }
        changed
    }

    /// Removes, from the remote nodes of each of `addresses`, those for
    /// which `keep` is false, leaving the others (and the local consumers)
    /// as they are; like [`set_remote_nodes_many`](Self::set_remote_nodes_many),
    /// one registry copy and one store for the whole batch, none if nothing
    /// changed. Read and changed under the registry's write lock, so a
    /// concurrent `set_remote_nodes_many` is never undone: a stopping cluster
    /// node removes only its own links while a successor on the same bus
    /// sets its routes. Returns how many addresses changed.
    pub fn retain_remote_nodes_many<A: AsRef<str>>(
        &self,
        addresses: impl IntoIterator<Item = A>,
        keep: impl Fn(&Arc<dyn RemoteNode>) -> bool,
    ) -> usize {
        let _w = self.inner.write.lock();
        let current = self.inner.table.load_full();
        let mut next: Option<Table> = None;
        let mut changed = 0;
        for address in addresses {
            let address = address.as_ref();
            let Some(e) = next.as_ref().unwrap_or(&current).get(address) else {
                continue;
            };
            if e.remotes.iter().all(&keep) {
                continue;
            }
            let (remotes, weights): (Vec<_>, Vec<_>) = e
                .remotes
                .iter()
                .enumerate()
                .filter(|(_, n)| keep(n))
                .map(|(i, n)| (n.clone(), e.weights.get(i).copied().unwrap_or(1)))
                .unzip();
            let consumers = e.consumers.clone();
            let table = next.get_or_insert_with(|| Table::clone(&current));
            if consumers.is_empty() && remotes.is_empty() {
                table.remove(address);
            } else if let Some(slot) = table.get_mut(address) {
                *slot = Arc::new(AddressEntry::weighted(
                    consumers,
                    remotes.into_boxed_slice(),
                    &weights,
                ));
            }
            changed += 1;
        }
        if let Some(table) = next {
            self.store_table(table);
        }
        changed
    }

    /// How many times the registry snapshot has been replaced since the bus
    /// was created: each registration, unregistration and changed batch of
    /// remote nodes adds one. A diagnostic; tests use it to check that a
    /// batch of changes was published once.
    pub fn registry_generation(&self) -> u64 {
        self.inner.generation.load(Ordering::Acquire)
    }

    /// Delivers a request that came from another node: `sink.reply(id, ..)`
    /// is called once with the answer (or `NoReply` if the consumer drops
    /// it). Only local consumers are considered. Does not wait: when every
    /// buffer is full the body comes back with [`BusError::Full`]; use
    /// [`request_remote_wait`](Self::request_remote_wait) then.
    ///
    /// # Errors
    /// As [`send`](Self::send); `sink` is not called on error.
    pub fn request_remote(
        &self,
        address: &str,
        body: Body,
        options: &DeliveryOptions,
        sink: Arc<dyn ReplySink>,
        id: u64,
    ) -> Result<(), SendError> {
        let (env, local) = self
            .remote_request(address, body, options, sink, id)
            .map_err(|(e, env)| SendError::new(e, Self::disarm(env)))?;
        self.route(address, env, &local)
            .map_err(|(e, env, _)| SendError::new(e, Self::disarm(env)))
    }

    /// [`request_remote`](Self::request_remote), waiting for room when every
    /// buffer is full.
    ///
    /// # Errors
    /// As [`request_remote`](Self::request_remote), except `Full`.
    pub async fn request_remote_wait(
        &self,
        address: &str,
        body: Body,
        options: &DeliveryOptions,
        sink: Arc<dyn ReplySink>,
        id: u64,
    ) -> Result<(), SendError> {
        let (env, local) = self
            .remote_request(address, body, options, sink, id)
            .map_err(|(e, env)| SendError::new(e, Self::disarm(env)))?;
        self.route_waiting(address, env, &local)
            .await
            .map_err(|(e, env)| SendError::new(e, Self::disarm(env)))
    }

    /// The envelope of a request from another node, checked, and the options
    /// that keep it on this node.
    #[allow(clippy::result_large_err)] // as `route`
    fn remote_request(
        &self,
        address: &str,
        body: Body,
        options: &DeliveryOptions,
        sink: Arc<dyn ReplySink>,
        id: u64,
    ) -> Result<(Envelope, DeliveryOptions), (BusError, Envelope)> {
        let mut env = Envelope {
            headers: options.headers.clone(),
            body,
            reply: Some(ReplySender::remote(sink, id)),
            send: true,
        };
        if let Err(e) = self.prepare(address, MessageKind::Request, &mut env, options) {
            return Err((e, env));
        }
        let local = DeliveryOptions {
            local_only: true,
            ..options.clone()
        };
        Ok((env, local))
    }

    /// Takes the body back from a refused envelope, without answering its
    /// requester (the caller reports the refusal itself).
    fn disarm(mut env: Envelope) -> Body {
        if let Some(ReplySender::Remote(mut r)) = env.reply.take() {
            r.disarm();
        }
        env.body
    }

    /// How many other nodes `address` is routed to (0 when none).
    pub fn remote_node_count(&self, address: &str) -> usize {
        self.inner
            .table
            .load()
            .get(address)
            .map_or(0, |e| e.remotes.len())
    }

    /// How many shares one round of `send` to `address` has: its local
    /// consumers plus each remote node counted by its weight (see
    /// [`set_weighted_remote_nodes_many`](Self::set_weighted_remote_nodes_many)).
    pub fn send_target_count(&self, address: &str) -> usize {
        self.inner
            .table
            .load()
            .get(address)
            .map_or(0, |e| e.consumers.len() + e.remote_targets())
    }

    /// Addresses that currently list at least one remote node.
    pub fn remote_addresses(&self) -> Vec<String> {
        self.inner
            .table
            .load()
            .iter()
            .filter(|(_, e)| !e.remotes.is_empty())
            .map(|(a, _)| a.to_string())
            .collect()
    }
}

/// How a transport connection encodes bodies for the wire and decodes them:
/// with the codecs it used last, so that a body takes neither the registry's
/// lock nor a look-up while the connection keeps using the same ones (a
/// cluster link's messages nearly always do). Answers as the registry
/// does: the cache is dropped whenever a codec is registered or a default
/// changes (one atomic load per call checks). Measured: two-process
/// send-send, docs/benchmarks.md.
pub struct CodecCache {
    shared: Arc<Shared>,
    /// `codecs_changed` when the entries below were taken.
    seen: u64,
    /// The default codec of the last body type encoded without a name.
    default: Option<(TypeId, Arc<str>, Arc<dyn MessageCodec>)>,
    /// The last codec used by name.
    named: Option<(Arc<str>, Arc<dyn MessageCodec>)>,
}

impl CodecCache {
    fn check(&mut self) {
        let now = self.shared.codecs_changed.load(Ordering::Acquire);
        if now != self.seen {
            self.default = None;
            self.named = None;
            self.seen = now;
        }
    }

    /// The codec named `name`, from the cache when it was the last one used
    /// by name. Borrowed, so a hit costs no reference count.
    fn by_name(&mut self, name: &str) -> Result<&(Arc<str>, Arc<dyn MessageCodec>), CodecError> {
        let entry = match self.named.take() {
            Some(e) if *e.0 == *name => e,
            _ => {
                let codecs = self.shared.codecs.read();
                let (n, c) = codecs.named(name)?;
                (n.clone(), c.clone())
            }
        };
        Ok(self.named.insert(entry))
    }

    /// The codec for `body`: the one named, or the default for its type;
    /// `None` for an empty body with no codec named (codec `""`, no bytes).
    /// Borrowed from the cache.
    fn resolve(
        &mut self,
        body: &Body,
        codec: Option<&str>,
    ) -> Result<Option<(&str, &dyn MessageCodec)>, CodecError> {
        if body.is_empty() && codec.is_none() {
            return Ok(None);
        }
        self.check();
        if let Some(n) = codec {
            let (name, c) = self.by_name(n)?;
            return Ok(Some((name, &**c)));
        }
        let t = body.value_type_id();
        let entry = match self.default.take() {
            Some(e) if e.0 == t => e,
            _ => {
                let codecs = self.shared.codecs.read();
                let (n, c) = codecs.default_of(body)?;
                (t, n.clone(), c.clone())
            }
        };
        let (_, name, c) = self.default.insert(entry);
        Ok(Some((name, &**c)))
    }

    /// Encodes a body for the wire with the named codec, or the default codec
    /// for its type; an empty body encodes as codec `""` and no bytes. The
    /// codec's name is borrowed from the cache.
    ///
    /// # Errors
    /// [`CodecError`] for an unknown codec, a type without a default, or the
    /// codec's own error.
    pub fn encode(
        &mut self,
        body: &Body,
        codec: Option<&str>,
    ) -> Result<(&str, bytes::Bytes), CodecError> {
        match self.resolve(body, codec)? {
            None => Ok(("", bytes::Bytes::new())),
            Some((name, c)) => Ok((name, c.encode(body)?)),
        }
    }

    /// Encodes a body straight into `out`, with the codec
    /// [`encode`](Self::encode) would use: first `head(out, codec_name)`
    /// (what a frame puts before the body: the codec's name, the body's
    /// length), then the body's bytes ([`MessageCodec::encode_into`]). An
    /// empty body with no codec named writes only the head, with codec `""`.
    ///
    /// # Errors
    /// As [`encode`](Self::encode); `out` may then hold part of the head or
    /// body, which the caller truncates.
    pub fn encode_into(
        &mut self,
        body: &Body,
        codec: Option<&str>,
        out: &mut bytes::BytesMut,
        head: impl FnOnce(&mut bytes::BytesMut, &str),
    ) -> Result<(), CodecError> {
        match self.resolve(body, codec)? {
            None => {
                head(out, "");
                Ok(())
            }
            Some((name, c)) => {
                head(out, name);
                c.encode_into(body, out)
            }
        }
    }

    /// Decodes bytes that came off the wire; codec `""` is the empty body.
    ///
    /// # Errors
    /// [`CodecError`] for an unknown codec or malformed bytes.
    pub fn decode(&mut self, codec: &str, bytes: bytes::Bytes) -> Result<Body, CodecError> {
        if codec.is_empty() {
            return Ok(Body::default());
        }
        self.check();
        let (_, c) = self.by_name(codec)?;
        c.decode(bytes)
    }
}

impl std::fmt::Debug for CodecCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodecCache")
            .field("default", &self.default.as_ref().map(|(_, n, _)| n))
            .field("named", &self.named.as_ref().map(|(n, _)| n))
            .finish()
    }
}

/// Where a sender that found every target full waits for room.
pub(crate) enum Room {
    Local(Arc<ConsumerQueue>),
    Remote(Arc<dyn RemoteNode>),
}

/// A pending cluster advertisement of a subscription (see
/// [`ClusterHook::advertise`]).
pub type Advertisement =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), BusError>> + Send>>;

impl std::fmt::Debug for EventBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventBus")
            .field("addresses", &self.inner.table.load().len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A remote node that takes every message and counts them.
    #[derive(Debug)]
    struct Counting {
        id: &'static str,
        delivered: AtomicUsize,
    }

    impl RemoteNode for Counting {
        fn id(&self) -> &str {
            self.id
        }

        fn deliver(&self, _: RemoteMessage) -> Result<(), Box<Undelivered>> {
            self.delivered.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    fn counting(id: &'static str) -> Arc<Counting> {
        Arc::new(Counting {
            id,
            delivered: AtomicUsize::new(0),
        })
    }

    fn node(id: &'static str) -> Arc<dyn RemoteNode> {
        counting(id)
    }

    fn entry(bus: &EventBus, address: &str) -> Option<Arc<AddressEntry>> {
        bus.inner.table.load().get(address).cloned()
    }

    fn remote_ids(bus: &EventBus, address: &str) -> Vec<String> {
        entry(bus, address).map_or_else(Vec::new, |e| {
            e.remotes.iter().map(|n| n.id().to_owned()).collect()
        })
    }

    #[test]
    fn a_batch_applies_every_change_and_publishes_once() {
        let bus = EventBus::new();
        let (b, c) = (node("b"), node("c"));
        let before = bus.registry_generation();
        let changed = bus.set_remote_nodes_many([
            ("x", vec![b.clone()]),
            ("y", vec![b.clone(), c.clone()]),
            ("z", vec![c.clone()]),
        ]);
        assert_eq!(changed, 3);
        assert_eq!(bus.registry_generation(), before + 1, "one store per batch");
        assert_eq!(remote_ids(&bus, "x"), ["b"]);
        assert_eq!(remote_ids(&bus, "y"), ["b", "c"]);
        assert_eq!(remote_ids(&bus, "z"), ["c"]);
        assert_eq!(bus.remote_addresses().len(), 3);
    }

    #[test]
    fn a_batch_leaves_unchanged_addresses_alone_and_stores_nothing_if_none_changed() {
        let bus = EventBus::new();
        let (b, c) = (node("b"), node("c"));
        bus.set_remote_nodes_many([("x", vec![b.clone()]), ("y", vec![b.clone(), c.clone()])]);
        let (x, y) = (entry(&bus, "x").unwrap(), entry(&bus, "y").unwrap());
        let at = bus.registry_generation();

        // The same lists again (and an empty list for an address with none).
        let changed = bus.set_remote_nodes_many([
            ("x", vec![b.clone()]),
            ("y", vec![b.clone(), c.clone()]),
            ("nothing", Vec::new()),
        ]);
        assert_eq!(changed, 0);
        assert_eq!(bus.registry_generation(), at, "nothing changed: no store");
        assert!(entry(&bus, "nothing").is_none());

        // One change: only that address gets a new entry.
        let changed = bus.set_remote_nodes_many([("x", vec![b.clone()]), ("y", vec![c.clone()])]);
        assert_eq!(changed, 1);
        assert_eq!(bus.registry_generation(), at + 1);
        assert!(Arc::ptr_eq(&entry(&bus, "x").unwrap(), &x), "x untouched");
        assert!(!Arc::ptr_eq(&entry(&bus, "y").unwrap(), &y));
        assert_eq!(remote_ids(&bus, "y"), ["c"]);
    }

    #[tokio::test]
    async fn a_batch_removes_addresses_left_with_neither_consumers_nor_remotes() {
        let bus = EventBus::new();
        let b = node("b");
        let _here = bus.consumer("kept").stream().await.unwrap();
        bus.set_remote_nodes_many([("kept", vec![b.clone()]), ("gone", vec![b.clone()])]);
        let at = bus.registry_generation();

        let changed = bus.set_remote_nodes_many([("kept", Vec::new()), ("gone", Vec::new())]);
        assert_eq!(changed, 2);
        assert_eq!(bus.registry_generation(), at + 1);
        assert!(
            entry(&bus, "gone").is_none(),
            "no consumers, no remotes: removed"
        );
        let kept = entry(&bus, "kept").expect("its local consumer keeps it");
        assert_eq!(kept.consumers.len(), 1);
        assert!(kept.remotes.is_empty());
        assert_eq!(bus.consumer_count("kept"), 1);
        assert!(bus.remote_addresses().is_empty());
    }

    #[test]
    fn a_batch_naming_an_address_twice_keeps_the_later_list() {
        let bus = EventBus::new();
        let (b, c) = (node("b"), node("c"));
        bus.set_remote_nodes_many([("x", vec![b.clone()]), ("x", vec![c.clone()])]);
        assert_eq!(remote_ids(&bus, "x"), ["c"]);
        // Added then removed in one batch: the address is gone, the store made.
        let at = bus.registry_generation();
        bus.set_remote_nodes_many([("y", vec![b.clone()]), ("y", Vec::new())]);
        assert!(entry(&bus, "y").is_none());
        assert_eq!(bus.registry_generation(), at + 1);
    }

    #[test]
    fn the_single_form_is_a_batch_of_one() {
        let bus = EventBus::new();
        let b = node("b");
        let at = bus.registry_generation();
        bus.set_remote_nodes("x", vec![b.clone()]);
        bus.set_remote_nodes("x", vec![b.clone()]);
        assert_eq!(
            bus.registry_generation(),
            at + 1,
            "the repeat stored nothing"
        );
        bus.set_remote_nodes("x", Vec::new());
        assert_eq!(bus.registry_generation(), at + 2);
        assert!(entry(&bus, "x").is_none());
    }

    #[test]
    fn a_send_after_a_batch_sees_the_new_snapshot() {
        // The per-thread snapshot cache follows the generation a batch bumps.
        let bus = EventBus::new();
        assert!(matches!(
            bus.send("x", 1u8).unwrap_err().error,
            BusError::NoHandlers { .. }
        ));
        let b = counting("b");
        bus.set_remote_nodes_many([("x", vec![b.clone() as Arc<dyn RemoteNode>])]);
        bus.send("x", 1u8).unwrap();
        assert_eq!(b.delivered.load(Ordering::Relaxed), 1);
    }
}
