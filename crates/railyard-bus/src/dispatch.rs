//! Event-loop dispatch: handler consumers run by one task per loop instead of
//! one task each.
//!
//! A tokio task per consumer makes every hand-off to an idle consumer a task
//! wake-up: a state transition on the task header, a push onto the runtime's
//! run queue (a locked inject queue and an unpark when the sender is on
//! another thread), then a poll through the task harness. A send-send chain's
//! reply consumer is idle between any two messages, so it pays that on every
//! message. Vert.x instead pushes a closure onto the target event loop's
//! queue, and the loop runs it.
//!
//! This module is that model for tokio. A thread that runs one current-thread
//! runtime for its life (an event loop) calls [`enable_loop_dispatch`]; from
//! then on, handler consumers registered on that thread are *scheduled* on
//! the loop's [`Dispatcher`] instead of woken as tasks:
//! - a sender that finds the consumer idle marks it scheduled (under the
//!   queue's lock it already holds) and appends it to the dispatcher's ready
//!   list: a plain `VecDeque` when the sender is the dispatcher itself (a
//!   handler sending on its own loop: no atomic operation at all), a locked
//!   `Vec` otherwise, with a wake-up only when the dispatcher is parked;
//! - the dispatcher takes a batch from each ready consumer and calls its
//!   handler on each message, polling the returned future in place;
//! - a handler future that does not finish on its first poll moves the
//!   consumer onto a task of its own until that batch is done (order is kept:
//!   the consumer is not scheduled again meanwhile), then it comes back.
//!
//! Everything the queue promises (capacity, pause / fetch, per-sender order,
//! counters, unregister) is unchanged: only who runs the handler differs.

use std::cell::{Cell, RefCell, UnsafeCell};
use std::collections::VecDeque;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;
use tokio::runtime::{Handle, RuntimeFlavor};

use crate::consumer::admit;
use crate::queue::{ConsumerQueue, Envelope, Take, BATCH};
use crate::Message;

thread_local! {
    /// The dispatcher whose task this thread is polling right now, if any.
    static RUNNING: Cell<*const Dispatcher> = const { Cell::new(std::ptr::null()) };
    /// The dispatcher of the loop this thread runs (set by [`enable_loop_dispatch`]).
    static THIS_LOOP: RefCell<Option<Arc<Dispatcher>>> = const { RefCell::new(None) };
    /// Its address identifies this thread among live threads, without the
    /// reference count `std::thread::current()` would touch.
    static THREAD_MARK: u8 = const { 0 };
    /// Set when this thread hands a message or a reply to another node's
    /// transport (see [`note_sent_away`]).
    static SENT_AWAY: Cell<bool> = const { Cell::new(false) };
    /// This loop relays other threads' wake-ups of its tasks through its
    /// dispatcher (see [`enable_loop_dispatch_relaying_wakes`]).
    static RELAYS: Cell<bool> = const { Cell::new(false) };
    /// Reply waits registered on this thread through a relay waker (see
    /// [`with_reply_waker`]): a relaying dispatcher that saw this move since
    /// its last poll expects relayed wake-ups and does not park yet.
    static RELAYED_WAITS: Cell<u64> = const { Cell::new(0) };
}

/// The bus handed something to another node's transport on this thread: a
/// dispatcher running here lets the loop's other tasks (the link that
/// writes it) in at most [`SENT_AWAY_EVERY`] runs later (at its next run
/// count that is a multiple of it), instead of after a full poll.
///
/// Without this, a loop handling a burst of messages from a peer ran every
/// handler (up to [`RUNS_PER_POLL`]) before its link wrote one answer, so
/// two processes took turns on one batch, each idle while the other worked:
/// `bench echo --cluster etcd --nodes 2 --method send-send` went from about
/// 430k to 520k-760k round trips/s with the early turn (yielding every 16
/// runs unconditionally did the same there, and cost about 5% on one
/// process, where nothing leaves the node).
#[inline]
pub(crate) fn note_sent_away() {
    SENT_AWAY.with(|s| s.set(true));
}

fn thread_mark() -> usize {
    THREAD_MARK.with(|m| std::ptr::from_ref(m) as usize)
}

/// Makes handler consumers registered from this thread from now on run on a
/// dispatcher task of the current runtime instead of one task each (see the
/// module docs for why). Returns `false`, and changes nothing, unless called
/// from inside a current-thread tokio runtime.
///
/// Call it once, from the loop itself, on a thread that runs one
/// current-thread runtime for its whole life: consumers registered on this
/// thread afterwards are run by that runtime, so a second runtime on the
/// same thread would not run them. Handler consumers registered elsewhere,
/// and every [`MessageStream`](crate::MessageStream), keep their own tasks.
///
/// `unregister` on a consumer whose handler is in the middle of an await
/// checks, after pauses of 1 to 16 ms slept on the blocking pool, until that
/// handler is done (no runtime needs a timer for it), or until the loop's
/// runtime has shut down and dropped it.
pub fn enable_loop_dispatch() -> bool {
    let Ok(handle) = Handle::try_current() else {
        return false;
    };
    if handle.runtime_flavor() != RuntimeFlavor::CurrentThread {
        return false;
    }
    let dispatcher = Arc::new(Dispatcher::new());
    handle.spawn(DispatchTask {
        dispatcher: dispatcher.clone(),
        seen_waits: RELAYED_WAITS.with(Cell::get),
        batch: VecDeque::new(),
    });
    THIS_LOOP.with(|d| *d.borrow_mut() = Some(dispatcher));
    // Relays made for an earlier dispatcher of this thread would go through it.
    drop(take_relay_cache());
    true
}

/// [`enable_loop_dispatch`] for a loop whose runtime has an I/O driver
/// (`enable_io`, `enable_all`): in addition, a reply that another thread
/// sends to a request made on this loop wakes the requesting task through
/// the dispatcher instead of through tokio.
///
/// Why: a current-thread runtime with an I/O driver wakes its driver on
/// *every* wake-up from another thread, an `eventfd` write (a system call)
/// even while the loop is busy; without an I/O driver the same wake is an
/// atomic store unless the loop sleeps. Measured with `railyard bench echo
/// --consumer local --delivery local-only --method send-reply` on two loops,
/// the same loops with an I/O driver did 1.5-2.1M round trips/s against
/// 3.3-3.5M without. Relayed, such a wake is a push onto the dispatcher's
/// list, and the dispatcher, on the loop's own thread, wakes the task
/// there; tokio is woken only when the dispatcher is parked.
///
/// Returns `false`, and changes nothing, unless called from inside a
/// current-thread tokio runtime. Same contract as [`enable_loop_dispatch`].
pub fn enable_loop_dispatch_relaying_wakes() -> bool {
    if !enable_loop_dispatch() {
        return false;
    }
    RELAYS.with(|r| r.set(true));
    true
}

/// Slots in a relaying loop's cache of relay wakers (see [`with_reply_waker`]).
const RELAY_CACHE_SLOTS: usize = 256;

/// A relay waker made for one task of this loop, kept for the task's next
/// requests.
struct CachedRelay {
    /// The task's own waker, to recognise it (`will_wake`).
    task: Waker,
    /// The waker that relays other threads' wake-ups of it.
    relay: Waker,
}

/// A relaying loop's relay wakers, all made for one dispatcher.
struct RelayCache {
    /// Their dispatcher (null while empty): set by the first miss, and the
    /// cache is emptied when that dispatcher is dropped or replaced, so the
    /// hit path needs no look at the dispatcher itself (whose lines the
    /// other threads keep writing).
    dispatcher: *const Dispatcher,
    /// Direct-mapped by the task waker's address ([`relay_slot`]).
    slots: Vec<Option<CachedRelay>>,
}

thread_local! {
    /// This loop's relay wakers. Without it every request made an `Arc` of
    /// its own (allocated here, freed by whichever thread dropped the reply
    /// slot last) and cloned the task's and the dispatcher's reference
    /// counts. A slot holds its task's waker, so a task that has finished
    /// stays allocated until its slot is reused or the loop's dispatcher is
    /// dropped: at most `RELAY_CACHE_SLOTS` tasks per loop.
    static RELAY_CACHE: RefCell<RelayCache> = const {
        RefCell::new(RelayCache { dispatcher: std::ptr::null(), slots: Vec::new() })
    };
}

/// Empties this thread's relay cache; its entries are dropped by the caller,
/// outside the borrow (a waker's drop may run arbitrary code).
fn take_relay_cache() -> Option<Vec<Option<CachedRelay>>> {
    RELAY_CACHE
        .try_with(|c| {
            c.try_borrow_mut().ok().map(|mut c| {
                c.dispatcher = std::ptr::null();
                std::mem::take(&mut c.slots)
            })
        })
        .ok()
        .flatten()
}

/// Calls `f` with the waker a reply should wake for `task`, a task of this
/// thread: on a loop that relays wake-ups (see
/// [`enable_loop_dispatch_relaying_wakes`]) one that goes through the
/// loop's dispatcher when woken from another thread, made once per task and
/// cached; otherwise `task` itself.
///
/// `f` must not make requests or poll other replies (it is the reply
/// slot's poll): the cache is borrowed while it runs.
pub(crate) fn with_reply_waker<R>(task: &Waker, f: impl FnOnce(&Waker) -> R) -> R {
    if !RELAYS.with(Cell::get) {
        return f(task);
    }
    RELAYED_WAITS.with(|n| n.set(n.get().wrapping_add(1)));
    RELAY_CACHE.with(|cache| {
        let mut cache = cache.borrow_mut();
        let cache = &mut *cache;
        let index = relay_slot(task);
        let hit = cache
            .slots
            .get(index)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.task.will_wake(task));
        if !hit {
            let Some(d) = this_loop() else {
                return f(task);
            };
            if !std::ptr::eq(cache.dispatcher, Arc::as_ptr(&d)) {
                // First use, or a cache left by an earlier dispatcher.
                cache.slots.clear();
                cache.slots.resize_with(RELAY_CACHE_SLOTS, || None);
                cache.dispatcher = Arc::as_ptr(&d);
            }
            let relay = Waker::from(Arc::new(Relay {
                dispatcher: d,
                real: task.clone(),
                owner: thread_mark(),
            }));
            cache.slots[index] = Some(CachedRelay {
                task: task.clone(),
                relay,
            });
        }
        let cached = cache.slots[index]
            .as_ref()
            .expect("the slot was just filled");
        f(&cached.relay)
    })
}

/// The cache slot for a task waker: Fibonacci hashing of its address.
fn relay_slot(task: &Waker) -> usize {
    let addr = task.data() as usize as u64;
    let h = addr.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - RELAY_CACHE_SLOTS.trailing_zeros());
    // The shift leaves log2(RELAY_CACHE_SLOTS) bits: always an index.
    usize::try_from(h).unwrap_or(0)
}

/// See [`with_reply_waker`].
struct Relay {
    dispatcher: Arc<Dispatcher>,
    real: Waker,
    owner: usize,
}

impl std::task::Wake for Relay {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if thread_mark() == self.owner {
            // On the loop itself: tokio schedules locally, no system call.
            self.real.wake_by_ref();
        } else {
            self.dispatcher.relay(&self.real);
        }
    }
}

/// The dispatcher of this thread's loop, when enabled and still running.
pub(crate) fn this_loop() -> Option<Arc<Dispatcher>> {
    THIS_LOOP.with(|d| {
        d.borrow()
            .as_ref()
            .filter(|d| d.alive.load(Ordering::Acquire))
            .cloned()
    })
}

/// One loop's ready list of consumers and its task's parking spot.
pub(crate) struct Dispatcher {
    /// Consumers scheduled by the dispatcher's own thread while it runs.
    /// Touched only inside `DispatchTask::poll` (checked through `RUNNING`),
    /// which tokio never runs on two threads at once.
    local: UnsafeCell<VecDeque<Arc<ConsumerQueue>>>,
    /// Consumers scheduled by the loop's own thread outside the dispatcher's
    /// poll (plain tasks of the loop: a requester, a link reader). Touched
    /// only on the `owner` thread, which never runs two things at once.
    nearby: UnsafeCell<Vec<Arc<ConsumerQueue>>>,
    /// The dispatcher task's waker while it is parked, for `nearby`
    /// schedulers (owner thread only).
    nearby_parked: UnsafeCell<Option<Waker>>,
    /// `thread_mark()` of the thread that enabled dispatch.
    owner: usize,
    /// Set for good if the task is ever polled on another thread (the
    /// runtime moved, against `enable_loop_dispatch`'s contract): then
    /// `nearby` is no longer filled, since only the owner thread drains it.
    /// (Safety does not rest on this flag: every access to `nearby` checks
    /// that it runs on the owner thread, and no two live threads share a
    /// `thread_mark`.)
    migrated: AtomicBool,
    /// A hint, read without the lock: `remote` has consumers.
    has_remote: AtomicBool,
    /// Consumers scheduled from anywhere else.
    remote: Mutex<Remote>,
    /// An empty list with room, swapped with `Remote::ready` on each drain so
    /// that neither side allocates (a buffer freed on the other core costs
    /// the allocator a cross-thread free). Used like `local`.
    spare: UnsafeCell<Vec<Arc<ConsumerQueue>>>,
    /// The same for `Remote::wakes`.
    spare_wakes: UnsafeCell<Vec<Waker>>,
    /// Cleared when the dispatcher's task is dropped (runtime shut down).
    alive: AtomicBool,
    /// The consumers registered to run here, unregistered when the
    /// dispatcher's task is dropped (see [`Dispatcher::enlist`]).
    members: Mutex<Members>,
}

/// A dispatcher's consumers, each with the registry it is in.
#[derive(Default)]
struct Members {
    list: Vec<(Weak<ConsumerQueue>, Weak<crate::bus::Inner>)>,
    /// The list's length at which unregistered consumers are next pruned.
    prune_at: usize,
}

// Safety: `local` is only accessed by the thread polling this dispatcher's
// task (see `schedule` and `DispatchTask::poll`), one thread at a time; every
// other field is thread-safe.
unsafe impl Sync for Dispatcher {}
// Safety: as above; nothing in it is tied to a thread.
unsafe impl Send for Dispatcher {}

#[derive(Default)]
struct Remote {
    ready: Vec<Arc<ConsumerQueue>>,
    /// Tasks of this loop that other threads woke (see [`with_reply_waker`]).
    wakes: Vec<Waker>,
    /// The dispatcher task's waker, present only while it is parked.
    parked: Option<Waker>,
    /// Cleared, under this lock, when the dispatcher's task is dropped: a
    /// relayed wake-up then goes to the task directly.
    closed: bool,
}

impl Dispatcher {
    fn new() -> Self {
        Self {
            local: UnsafeCell::new(VecDeque::new()),
            nearby: UnsafeCell::new(Vec::new()),
            nearby_parked: UnsafeCell::new(None),
            owner: thread_mark(),
            migrated: AtomicBool::new(false),
            has_remote: AtomicBool::new(false),
            remote: Mutex::new(Remote::default()),
            spare: UnsafeCell::new(Vec::new()),
            spare_wakes: UnsafeCell::new(Vec::new()),
            alive: AtomicBool::new(true),
            members: Mutex::new(Members::default()),
        }
    }

    /// Records `queue`, a consumer this dispatcher runs, registered in
    /// `registry`: if the dispatcher's task is dropped (its runtime shut
    /// down), the consumer is unregistered, as a handler consumer with a
    /// task of its own is when that task is dropped. Otherwise it would stay
    /// registered and take messages nobody runs: sends accepted and never
    /// handled, requests waiting their whole timeout. Returns `false` if the
    /// task is already gone (the caller unregisters the consumer itself).
    pub(crate) fn enlist(
        &self,
        queue: &Arc<ConsumerQueue>,
        registry: Weak<crate::bus::Inner>,
    ) -> bool {
        let mut m = self.members.lock();
        // The task's drop clears `alive` before it takes the list under
        // this lock: read under the lock, `alive` tells whether the list
        // will still be taken.
        if !self.alive.load(Ordering::Acquire) {
            return false;
        }
        if m.list.len() >= m.prune_at {
            // Amortized: the list is at most twice its live members.
            m.list.retain(|(q, _)| q.strong_count() > 0);
            m.prune_at = (2 * m.list.len()).max(64);
        }
        m.list.push((Arc::downgrade(queue), registry));
        true
    }

    /// Puts a consumer that has work on the ready list. The caller has just
    /// marked it scheduled, so it is on no list already.
    #[inline]
    pub(crate) fn schedule(&self, queue: Arc<ConsumerQueue>) {
        if in_poll_of(self) {
            // Safety: this thread is inside this dispatcher's poll (see `local`).
            unsafe { (*self.local.get()).push_back(queue) };
            return;
        }
        if thread_mark() == self.owner && !self.migrated.load(Ordering::Relaxed) {
            // Safety: only the owner thread touches `nearby` and
            // `nearby_parked`, and this thread is not inside this
            // dispatcher's poll (checked above), the only other place it does.
            unsafe {
                (*self.nearby.get()).push(queue);
                if let Some(w) = (*self.nearby_parked.get()).take() {
                    w.wake();
                }
            }
            return;
        }
        let parked = {
            let mut r = self.remote.lock();
            r.ready.push(queue);
            self.has_remote.store(true, Ordering::Relaxed);
            r.parked.take()
        };
        if let Some(w) = parked {
            w.wake();
        }
    }

    /// Another thread woke `task`, a task of this loop: the dispatcher wakes
    /// it from the loop's own thread.
    fn relay(&self, task: &Waker) {
        let parked = {
            let mut r = self.remote.lock();
            if r.closed {
                drop(r);
                task.wake_by_ref();
                return;
            }
            r.wakes.push(task.clone());
            self.has_remote.store(true, Ordering::Relaxed);
            r.parked.take()
        };
        if let Some(w) = parked {
            w.wake();
        }
    }

    /// Moves consumers scheduled by the loop's other tasks (`nearby`, on the
    /// owner thread) and by other threads (`remote`, when its hint is set)
    /// onto `local`. Returns whether there were any. Inside this
    /// dispatcher's poll only.
    fn take_others(&self, on_owner: bool) -> bool {
        let mut any = false;
        if on_owner {
            // Safety: owner thread, inside the poll; no borrow outlives this.
            unsafe {
                let nearby = &mut *self.nearby.get();
                if !nearby.is_empty() {
                    (*self.local.get()).extend(nearby.drain(..));
                    any = true;
                }
                *self.nearby_parked.get() = None;
            }
        }
        if self.has_remote.load(Ordering::Relaxed) {
            let mut r = self.remote.lock();
            self.has_remote.store(false, Ordering::Relaxed);
            r.parked = None;
            // Safety: as above (`spare` and `spare_wakes` are used like
            // `local`).
            let (spare, wakes) = unsafe { (&mut *self.spare.get(), &mut *self.spare_wakes.get()) };
            std::mem::swap(&mut r.ready, spare);
            std::mem::swap(&mut r.wakes, wakes);
            drop(r);
            if !spare.is_empty() {
                // Safety: as above.
                unsafe { (*self.local.get()).extend(spare.drain(..)) };
                any = true;
            }
            // On the owner thread these are local wake-ups.
            wakes.drain(..).for_each(Waker::wake);
        }
        any
    }
}

/// Most consumer runs per poll before the dispatcher yields to the other
/// tasks of its runtime (timers, sockets, plain tasks).
const RUNS_PER_POLL: usize = 256;

/// Consumer runs between two looks at what other tasks and threads
/// scheduled, so they are not starved by a loop that never runs dry.
const OTHERS_EVERY: usize = 16;

/// Consumer runs after which a dispatcher whose handlers sent to another
/// node yields, so the link writes (see [`note_sent_away`]); a multiple of
/// [`OTHERS_EVERY`]. 16 on the machine it was first measured on; 32 since
/// 2026-11-26, swept together with the cluster link's frames per turn
/// (`READ_CHUNK` in `railyard-cluster`'s `link.rs`, whose doc gives the
/// figures; docs/benchmarks.md).
const SENT_AWAY_EVERY: usize = 32;
const _: () = assert!(SENT_AWAY_EVERY % OTHERS_EVERY == 0);

/// The task that runs a loop's ready consumers.
struct DispatchTask {
    dispatcher: Arc<Dispatcher>,
    /// `RELAYED_WAITS` at this dispatcher's last look (see [`linger`]).
    seen_waits: u64,
    /// The batch being run, empty between batches. Kept across polls: a
    /// consumer's queue takes it in exchange for its messages (a swap), so
    /// a buffer made per poll left each queue to regrow from nothing. One
    /// larger than four batches is dropped after its batch.
    batch: VecDeque<Envelope>,
}

impl Drop for DispatchTask {
    fn drop(&mut self) {
        self.dispatcher.alive.store(false, Ordering::Release);
        // Nobody runs this loop's consumers any more: they leave their
        // registries (and clusters), and what they held fails at once.
        let members = std::mem::take(&mut self.dispatcher.members.lock().list);
        for (queue, registry) in members {
            if let Some(queue) = queue.upgrade() {
                crate::consumer::unregister_or_close(&queue, &registry);
            }
        }
        // Break the queue -> dispatcher -> queue cycle of consumers still
        // listed, and wake the tasks relayed here (from now on, relays wake
        // them directly).
        let (left, wakes) = {
            let mut r = self.dispatcher.remote.lock();
            r.closed = true;
            (std::mem::take(&mut r.ready), std::mem::take(&mut r.wakes))
        };
        drop(left);
        wakes.into_iter().for_each(Waker::wake);
        // Safety: the task is being dropped, so nobody is polling it; `local`
        // is not borrowed.
        let local = unsafe { std::mem::take(&mut *self.dispatcher.local.get()) };
        drop(local);
        if thread_mark() == self.dispatcher.owner
            && !self.dispatcher.migrated.load(Ordering::Relaxed)
        {
            // Safety: owner thread, and this task (the only reader) is being
            // dropped. Elsewhere `nearby` is left alone (a leak at shutdown
            // rather than a race).
            let nearby = unsafe { std::mem::take(&mut *self.dispatcher.nearby.get()) };
            drop(nearby);
            // The relay cache is this dispatcher's: its entries (and the
            // tasks they hold) go with it, not at the thread's exit.
            drop(take_relay_cache());
        }
    }
}

/// On a loop that relays wake-ups, whether to stay scheduled instead of
/// parking now that the dispatcher ran dry: yes while the loop is busy,
/// i.e. this poll ran consumers, or tasks of the loop registered relayed
/// reply waits since the last such poll (they expect relayed wake-ups).
///
/// Why: a parked dispatcher is woken through tokio, and on a loop with an
/// I/O driver every such wake from another thread is an `eventfd` write,
/// busy loop or not (see [`enable_loop_dispatch_relaying_wakes`]). The
/// dispatcher parked whenever it ran dry between two requesters' turns,
/// so relays paid that system call anyway: `bench echo --cluster etcd
/// --consumer consumer --delivery local-only --method send-reply` made
/// 232k-444k `write` calls per 4-s run (the plain bus 53; docs/benchmarks.md).
/// Staying scheduled costs one poll per round of the loop's run queue; a
/// loop with nothing else to run comes back at once, finds nothing new, and
/// parks.
fn linger(seen_waits: &mut u64, runs: usize) -> bool {
    if !RELAYS.with(Cell::get) {
        return false;
    }
    let waits = RELAYED_WAITS.with(Cell::get);
    let busy = runs > 0 || waits != *seen_waits;
    *seen_waits = waits;
    busy
}

/// Sets `RUNNING` for the duration of one poll, and resets it even on unwind.
struct RunningGuard(*const Dispatcher);

impl RunningGuard {
    fn enter(d: &Dispatcher) -> Self {
        Self(RUNNING.with(|r| r.replace(std::ptr::from_ref(d))))
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        RUNNING.with(|r| r.set(self.0));
    }
}

impl Future for DispatchTask {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let d = &*this.dispatcher;
        let _running = RunningGuard::enter(d);
        let on_owner = thread_mark() == d.owner && !d.migrated.load(Ordering::Relaxed);
        if !on_owner {
            d.migrated.store(true, Ordering::Relaxed);
        }
        let mut runs = 0;
        // Only what this poll's handlers send away counts.
        SENT_AWAY.with(|s| s.set(false));
        loop {
            if runs % OTHERS_EVERY == 0 {
                if runs > 0 && runs % SENT_AWAY_EVERY == 0 && SENT_AWAY.with(|s| s.replace(false)) {
                    // Let the link write what the handlers sent, and come
                    // back at once (see `note_sent_away`).
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                d.take_others(on_owner);
            }
            // Safety: inside this dispatcher's poll; the borrow ends before
            // any handler runs (handlers may schedule onto `local`).
            let next = unsafe { (*d.local.get()).pop_front() };
            let Some(queue) = next else {
                if d.take_others(on_owner) {
                    continue;
                }
                if on_owner && linger(&mut this.seen_waits, runs) {
                    // Come back after the loop's other ready tasks.
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                // Park. `remote` is checked under its lock, with the waker
                // stored in the same critical section; if something came,
                // its scheduler set the hint under this lock, so the next
                // `take_others` takes it.
                let mut r = d.remote.lock();
                if !r.ready.is_empty() || !r.wakes.is_empty() {
                    continue;
                }
                match &r.parked {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => r.parked = Some(cx.waker().clone()),
                }
                drop(r);
                if on_owner {
                    // Safety: on the owner thread, inside the poll.
                    unsafe { *d.nearby_parked.get() = Some(cx.waker().clone()) };
                }
                return Poll::Pending;
            };
            run_consumer(&queue, &mut this.batch, cx);
            crate::idle_spin::note_loop_work();
            if this.batch.capacity() > 4 * BATCH {
                // A buffer a burst grew (a consumer's whole queue, swapped
                // in): freed here, not handed on to the next consumer.
                this.batch = VecDeque::new();
            }
            runs += 1;
            if runs >= RUNS_PER_POLL {
                // Let the runtime's other tasks in, and come back at once.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
    }
}

thread_local! {
    /// The dispatched consumer whose handler this thread is polling on a
    /// task of its own (`finish_on_task`), if any: its `unregister`, called
    /// from that handler, must not wait for the batch the handler itself is
    /// in. (Inside the dispatcher's own poll, `RUNNING` tells the same
    /// without a per-batch cost: see [`in_poll_of`].)
    static HANDLING: std::cell::Cell<*const ConsumerQueue> = const { std::cell::Cell::new(std::ptr::null()) };
}

/// Marks `queue`'s handler as being polled on this thread until dropped.
struct Running(*const ConsumerQueue);

impl Running {
    fn enter(queue: &ConsumerQueue) -> Self {
        Self(HANDLING.replace(std::ptr::from_ref(queue)))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        HANDLING.set(self.0);
    }
}

/// Whether this thread is polling `queue`'s handler on the handler's own
/// task right now.
pub(crate) fn is_running(queue: &ConsumerQueue) -> bool {
    std::ptr::eq(HANDLING.get(), queue)
}

/// Whether this thread is inside `dispatcher`'s poll. (For `unregister`:
/// a consumer of it whose batch is active and not on a task of its own is
/// then the one whose handler this poll is running, one at a time.)
#[inline]
pub(crate) fn in_poll_of(dispatcher: &Dispatcher) -> bool {
    RUNNING.with(Cell::get) == std::ptr::from_ref(dispatcher)
}

/// Runs one batch of a scheduled consumer's messages.
fn run_consumer(queue: &Arc<ConsumerQueue>, batch: &mut VecDeque<Envelope>, cx: &mut Context<'_>) {
    debug_assert!(batch.is_empty(), "a batch left over from another consumer");
    let Some(runner) = queue.runner() else {
        return;
    };
    let more = match queue.take_scheduled(batch, BATCH) {
        Take::Skip | Take::Empty => return,
        Take::Batch { more } => more,
    };
    while let Some(env) = batch.pop_front() {
        let Some(msg) = admit(queue, env) else {
            continue;
        };
        // Safety: this dispatcher holds the consumer's run token from
        // `take_scheduled` until `batch_done` or `enter_task`.
        if unsafe { runner.start(msg, cx) }.is_pending() {
            // The handler awaits something: finish this batch on a task of
            // its own so the loop's other consumers keep running.
            queue.enter_task();
            let rest: VecDeque<Envelope> = std::mem::take(batch);
            // An argument, so it ends the batch when dropped even if the
            // task is dropped before its first poll.
            let task = BatchTask {
                queue: queue.clone(),
                finished: false,
            };
            tokio::spawn(finish_on_task(task, rest));
            return;
        }
    }
    queue.batch_done();
    if more {
        // Still scheduled: back of the line, after the consumers that waited
        // (`schedule` from inside the dispatcher's poll appends to `local`).
        if let Some(d) = queue.dispatcher() {
            d.schedule(queue.clone());
        }
    }
}

/// The consumer whose batch a task finishes. Dropped unfinished (its
/// loop's runtime shut down while a handler was mid-await), it ends the
/// batch (clears the consumer's `active` flag): without that `unregister`
/// waited for the batch forever. The run token stays taken, so nobody polls
/// the handler's abandoned future again; it is dropped with the consumer.
struct BatchTask {
    queue: Arc<ConsumerQueue>,
    finished: bool,
}

impl Drop for BatchTask {
    fn drop(&mut self) {
        if !self.finished {
            self.queue.batch_done();
        }
    }
}

/// A consumer's batch whose handler did not finish in one poll.
async fn finish_on_task(mut task: BatchTask, rest: VecDeque<Envelope>) {
    let queue = &task.queue;
    let runner = queue.runner().expect("a dispatched consumer has a runner");
    // Safety (here and below): this task holds the consumer's run token
    // from `enter_task` until `leave_task`.
    std::future::poll_fn(|cx| {
        let _running = Running::enter(queue);
        unsafe { runner.resume(cx) }
    })
    .await;
    for env in rest {
        let Some(msg) = admit(queue, env) else {
            continue;
        };
        let mut msg = Some(msg);
        std::future::poll_fn(|cx| {
            let _running = Running::enter(queue);
            match msg.take() {
                Some(m) => unsafe { runner.start(m, cx) },
                None => unsafe { runner.resume(cx) },
            }
        })
        .await;
    }
    queue.leave_task();
    task.finished = true;
}

/// A handler with its message type erased, polled in place.
///
/// Its methods may only be called by the holder of the consumer's *run
/// token*: the dispatcher from a `Take::Batch` until `batch_done` or
/// `enter_task`, or the consumer's task from `enter_task` until `leave_task`.
/// The queue's `scheduled` / `in_task` flags, changed under its lock, let
/// at most one party hold it, so the future slot needs no lock of its own.
pub(crate) trait Runner: Send + Sync {
    /// Calls the handler on `msg` and polls its future once. `Pending` leaves
    /// the future in the runner for [`resume`](Runner::resume).
    ///
    /// # Safety
    /// The caller holds the consumer's run token.
    unsafe fn start(&self, msg: Message, cx: &mut Context<'_>) -> Poll<()>;
    /// Polls the future `start` left pending.
    ///
    /// # Safety
    /// As [`start`](Runner::start).
    unsafe fn resume(&self, cx: &mut Context<'_>) -> Poll<()>;
}

/// The [`Runner`] of one consumer: its handler and one reusable slot for the
/// future in progress (pinned once, on the heap, so no message allocates).
pub(crate) struct HandlerRunner<F, Fut> {
    handler: F,
    /// Touched only by the holder of the run token (see [`Runner`]).
    slot: UnsafeCell<Pin<Box<Option<Fut>>>>,
    address: Arc<str>,
}

impl<F, Fut> HandlerRunner<F, Fut> {
    pub(crate) fn new(handler: F, address: Arc<str>) -> Self {
        Self {
            handler,
            slot: UnsafeCell::new(Box::pin(None)),
            address,
        }
    }
}

// Safety: the slot is used by one thread at a time (the run token holder),
// and the future in it is `Send`; the handler is `Sync`.
unsafe impl<F: Sync, Fut: Send> Sync for HandlerRunner<F, Fut> {}

impl<F, Fut> HandlerRunner<F, Fut>
where
    Fut: Future<Output = ()>,
{
    fn poll_slot(&self, slot: &mut Pin<Box<Option<Fut>>>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(fut) = slot.as_mut().as_pin_mut() else {
            return Poll::Ready(());
        };
        match std::panic::catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(())) => {
                slot.set(None);
                Poll::Ready(())
            }
            Err(_) => {
                slot.set(None);
                tracing::error!(address = %self.address, "consumer handler panicked; message dropped");
                Poll::Ready(())
            }
        }
    }
}

impl<F, Fut> Runner for HandlerRunner<F, Fut>
where
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    unsafe fn start(&self, msg: Message, cx: &mut Context<'_>) -> Poll<()> {
        let fut = match std::panic::catch_unwind(AssertUnwindSafe(|| (self.handler)(msg))) {
            Ok(f) => f,
            Err(_) => {
                tracing::error!(address = %self.address, "consumer handler panicked; message dropped");
                return Poll::Ready(());
            }
        };
        // Safety: the caller holds the run token, so nobody else uses the slot.
        let slot = unsafe { &mut *self.slot.get() };
        slot.set(Some(fut));
        self.poll_slot(slot, cx)
    }

    unsafe fn resume(&self, cx: &mut Context<'_>) -> Poll<()> {
        // Safety: as in `start`.
        let slot = unsafe { &mut *self.slot.get() };
        self.poll_slot(slot, cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A task waker that counts its wake-ups.
    struct Counting(AtomicUsize);

    impl std::task::Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn loop_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime")
    }

    #[test]
    fn a_tasks_requests_share_one_relay_waker_and_each_task_has_its_own() {
        let (c1, c2) = (
            Arc::new(Counting(AtomicUsize::new(0))),
            Arc::new(Counting(AtomicUsize::new(0))),
        );
        let rt = loop_runtime();
        rt.block_on(async {
            let (t1, t2) = (Waker::from(c1.clone()), Waker::from(c2.clone()));
            // Not relaying yet: the task's own waker.
            assert_eq!(with_reply_waker(&t1, |w| w.data()), t1.data());
            assert!(enable_loop_dispatch_relaying_wakes());
            let first = with_reply_waker(&t1, |w| w.data());
            assert_ne!(first, t1.data(), "a relaying loop hands out a relay");
            assert_eq!(
                with_reply_waker(&t1, |w| w.data()),
                first,
                "made once per task"
            );
            let other = with_reply_waker(&t2, |w| w.data());
            assert_ne!(other, first);
            // Woken on the loop's own thread, a relay wakes its task directly.
            with_reply_waker(&t2, Waker::wake_by_ref);
            assert_eq!(c2.0.load(Ordering::SeqCst), 1);
            assert_eq!(c1.0.load(Ordering::SeqCst), 0);
        });
        assert!(Arc::strong_count(&c1) > 1, "the cache holds the task");
        // The loop's dispatcher goes with its runtime, and the cache with it.
        drop(rt);
        assert_eq!(Arc::strong_count(&c1), 1);
        assert_eq!(Arc::strong_count(&c2), 1);
    }

    #[test]
    fn relays_woken_from_another_thread_reach_their_tasks_through_the_dispatcher() {
        loop_runtime().block_on(async {
            assert!(enable_loop_dispatch_relaying_wakes());
            // More tasks than cache slots, so slots are taken over again and
            // again: every relay must still wake its own task, once.
            let tasks: Vec<Arc<Counting>> = (0..RELAY_CACHE_SLOTS * 3)
                .map(|_| Arc::new(Counting(AtomicUsize::new(0))))
                .collect();
            let relays: Vec<Waker> = tasks
                .iter()
                .map(|t| with_reply_waker(&Waker::from(t.clone()), Waker::clone))
                .collect();
            std::thread::spawn(move || relays.iter().for_each(Waker::wake_by_ref))
                .join()
                .expect("the waking thread");
            // The dispatcher runs on this loop and wakes them from here.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while tasks.iter().any(|t| t.0.load(Ordering::SeqCst) == 0)
                && std::time::Instant::now() < deadline
            {
                tokio::task::yield_now().await;
            }
            for (i, t) in tasks.iter().enumerate() {
                assert_eq!(t.0.load(Ordering::SeqCst), 1, "task {i}");
            }
        });
    }

    fn dispatcher_parked(d: &Dispatcher) -> bool {
        d.remote.lock().parked.is_some()
    }

    #[test]
    fn a_relaying_dispatcher_that_ran_dry_lingers_while_relays_are_expected_then_parks() {
        loop_runtime().block_on(async {
            assert!(enable_loop_dispatch_relaying_wakes());
            let d = this_loop().expect("this loop's dispatcher");
            // Polled by hand (the spawned task never runs: this future does
            // not yield), with a waker that counts re-schedulings.
            let mut task = DispatchTask {
                dispatcher: d.clone(),
                seen_waits: RELAYED_WAITS.with(Cell::get),
                batch: VecDeque::new(),
            };
            let own = Arc::new(Counting(AtomicUsize::new(0)));
            let own_waker = Waker::from(own.clone());
            let mut cx = Context::from_waker(&own_waker);
            let mut poll = || Pin::new(&mut task).poll(&mut cx);
            // Nothing ran, nothing expected: it parks.
            assert!(poll().is_pending());
            assert!(dispatcher_parked(&d), "an idle dispatcher parks");
            assert_eq!(own.0.load(Ordering::SeqCst), 0);
            // A task of the loop now waits through a relay: the next poll
            // that runs dry stays scheduled instead of parking, so relayed
            // wake-ups of that task need no wake of the dispatcher.
            let waiter = Waker::from(Arc::new(Counting(AtomicUsize::new(0))));
            with_reply_waker(&waiter, |_| ());
            d.remote.lock().parked = None;
            assert!(poll().is_pending());
            assert!(!dispatcher_parked(&d), "it lingers");
            assert_eq!(own.0.load(Ordering::SeqCst), 1, "and re-schedules itself");
            // Nothing new since: it parks, so an idle loop can sleep.
            assert!(poll().is_pending());
            assert!(dispatcher_parked(&d), "then parks");
            assert_eq!(own.0.load(Ordering::SeqCst), 1);
        });
    }
}
