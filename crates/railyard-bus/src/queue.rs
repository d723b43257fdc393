//! The bounded buffer in front of each consumer: the bus's hand-off point.
//!
//! One spin lock (`spin`: its release is a plain store) guards a `VecDeque`,
//! the consumer's waker and the waiters for room. A sender takes the lock once per message; the consumer
//! takes it once per batch (up to [`BATCH`] messages). The consumer's waker is
//! stored only while the consumer is idle, so a sender wakes it at most once
//! per idle period and never while it is already scheduled.
//!
//! Why a lock and not a lock-free ring: the critical section is a handful of
//! instructions, uncontended locking costs one CAS (and the release a plain
//! store), memory
//! grows with use instead of being preallocated per consumer (bridge clients
//! and send-send chains register many small consumers), and pause / fetch /
//! close stay trivially consistent with the buffer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use crossbeam_utils::CachePadded;

use crate::bus::Shared;
use crate::dispatch::{Dispatcher, Runner};
use crate::metrics::ConsumerStats;
use crate::reply::ReplySender;
use crate::spin::SpinLock;
use crate::waiters::RoomWaiters;
use crate::{Body, BusError, Headers};

/// Most messages a consumer takes per lock acquisition.
pub(crate) const BATCH: usize = 64;

/// A message in flight between a sender and a consumer.
#[derive(Debug)]
pub(crate) struct Envelope {
    pub(crate) headers: Headers,
    pub(crate) body: Body,
    pub(crate) reply: Option<ReplySender>,
    /// `true` for point-to-point (`send`, `request`), `false` for `publish`.
    pub(crate) send: bool,
}

impl Envelope {
    /// Drops a message no consumer will handle; a request among them fails
    /// at once with `NO_HANDLERS` instead of waiting for its timeout.
    pub(crate) fn fail_unhandled(self, address: &str) {
        if let Some(slot) = self.reply {
            let _ = slot.send(Err(BusError::NoHandlers {
                address: address.to_owned(),
            }));
        }
    }
}

/// Why a push was refused; the envelope comes back with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    Full,
    Closed,
}

impl std::fmt::Debug for ConsumerQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerQueue")
            .field("address", &self.address)
            .field("id", &self.id)
            .field("local", &self.local)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// Demand value meaning "flowing": the consumer takes whatever arrives.
const FLOWING: u64 = u64::MAX;

/// Aligned so that, inside its `Arc`, the reference counts (changed by every
/// scheduling on an event loop, from either core) sit on lines of their own,
/// apart from the fields both cores only read; `state` (written by every
/// hand-off) is padded onto its own lines too. Without this, each write to
/// one of them evicts the read-mostly fields from the other core's cache.
#[repr(align(128))]
pub(crate) struct ConsumerQueue {
    /// This consumer's own copy: messages clone it on the consumer's thread
    /// only, so its reference count never bounces between cores.
    pub(crate) address: Arc<str>,
    /// The bus's interceptors, counters and timeouts, for answering requests.
    pub(crate) shared: Arc<Shared>,
    pub(crate) id: u64,
    /// Registered with `local_consumer`: never advertised to a cluster.
    pub(crate) local: bool,
    capacity: usize,
    state: CachePadded<SpinLock<State>>,
    /// Set for a handler consumer run by an event loop's dispatcher
    /// (`dispatch`); `None` for a consumer with its own task or a stream.
    dispatch: Option<Dispatched>,
}

/// How a dispatched consumer is run, and how `unregister` waits for it.
pub(crate) struct Dispatched {
    dispatcher: Arc<Dispatcher>,
    runner: Box<dyn Runner>,
    /// A batch is being handled (by the dispatcher or the consumer's task).
    /// Cleared with a plain store: `unregister` polls it (see `wait_idle`)
    /// rather than the hot path paying a locked instruction per batch to
    /// tell it.
    active: AtomicBool,
}

impl Dispatched {
    pub(crate) fn new(dispatcher: Arc<Dispatcher>, runner: Box<dyn Runner>) -> Self {
        Self {
            dispatcher,
            runner,
            active: AtomicBool::new(false),
        }
    }
}

/// What a push or a demand change asks for after the lock is released.
enum Wake {
    /// Wake the consumer's task (or stream).
    Task(Waker),
    /// Put the consumer on its dispatcher's ready list.
    Schedule,
}

/// What the dispatcher got from a scheduled consumer.
pub(crate) enum Take {
    /// The consumer is finishing a batch on its own task; it reschedules itself.
    Skip,
    /// Nothing to run (empty, paused or closed): no longer scheduled.
    Empty,
    /// A batch was taken; `more` when messages remain and it stays scheduled.
    Batch { more: bool },
}

#[derive(Debug)]
// In declaration order: the fields a sender touches on every hand-off come
// first, so that with the lock flag before them (`SpinLock` is `repr(C)`)
// they share one cache line, and a message from another core moves one line
// of this state, not three.
#[repr(C)]
struct State {
    items: VecDeque<Envelope>,
    /// Messages the consumer may still take; `FLOWING` when not paused.
    demand: u64,
    /// Messages accepted into the buffer (`ConsumerStats::received`).
    received: u64,
    closed: bool,
    /// Dispatched consumers: on the dispatcher's ready list, being run, or on
    /// their own task. A sender schedules the consumer only when this is unset.
    scheduled: bool,
    /// Dispatched consumers: finishing a batch on their own task.
    in_task: bool,
    /// Set only while the consumer is parked with nothing it may take.
    consumer: Option<Waker>,
    /// Senders waiting for room (`send_wait`, blocked requests); woken when
    /// the consumer takes a batch.
    room_waiters: RoomWaiters,
    /// The other counters (`received` is kept above).
    stats: ConsumerStats,
}

impl State {
    /// Moves up to `max` messages, bounded by demand, into `out` and counts
    /// them delivered. The caller has checked that some may be taken.
    #[inline]
    fn take_into(&mut self, out: &mut VecDeque<Envelope>, max: usize) {
        let n = max
            .min(self.items.len())
            .min(usize::try_from(self.demand).unwrap_or(usize::MAX));
        if n == self.items.len() && out.is_empty() {
            // The common case: take everything by swapping buffers, O(1).
            std::mem::swap(&mut self.items, out);
        } else {
            out.extend(self.items.drain(..n));
        }
        if self.demand != FLOWING {
            self.demand -= n as u64;
        }
        self.stats.delivered += n as u64;
    }
}

impl ConsumerQueue {
    pub(crate) fn new(
        address: &str,
        shared: Arc<Shared>,
        id: u64,
        local: bool,
        capacity: usize,
        paused: bool,
        dispatch: Option<Dispatched>,
    ) -> Self {
        Self {
            address: address.into(),
            shared,
            id,
            local,
            capacity: capacity.max(1),
            state: CachePadded::new(SpinLock::new(State {
                items: VecDeque::new(),
                consumer: None,
                room_waiters: RoomWaiters::default(),
                demand: if paused { 0 } else { FLOWING },
                received: 0,
                closed: false,
                scheduled: false,
                in_task: false,
                stats: ConsumerStats::default(),
            })),
            dispatch,
        }
    }

    /// Who must learn of a message that just became takeable, if anyone.
    /// Called under the lock.
    #[inline]
    fn wake_for(&self, s: &mut State) -> Option<Wake> {
        if s.demand == 0 {
            return None;
        }
        if self.dispatch.is_some() {
            if s.scheduled {
                return None;
            }
            s.scheduled = true;
            return Some(Wake::Schedule);
        }
        s.consumer.take().map(Wake::Task)
    }

    /// Acts on `wake_for`'s answer, outside the lock (so the consumer never
    /// blocks on it right away).
    #[inline]
    fn wake(self: &Arc<Self>, wake: Option<Wake>) {
        match wake {
            None => {}
            Some(Wake::Task(w)) => w.wake(),
            Some(Wake::Schedule) => {
                if let Some(d) = &self.dispatch {
                    d.dispatcher.schedule(self.clone());
                }
            }
        }
    }

    pub(crate) fn runner(&self) -> Option<&dyn Runner> {
        self.dispatch.as_ref().map(|d| &*d.runner)
    }

    pub(crate) fn dispatcher(&self) -> Option<&Arc<Dispatcher>> {
        self.dispatch.as_ref().map(|d| &d.dispatcher)
    }

    /// The dispatcher's side of `poll_batch`: takes up to `max` messages
    /// (bounded by demand) from a scheduled consumer, and unschedules it when
    /// none are left. Marks a batch active until `batch_done` / `leave_task`.
    pub(crate) fn take_scheduled(&self, out: &mut VecDeque<Envelope>, max: usize) -> Take {
        let Some(d) = &self.dispatch else {
            return Take::Empty;
        };
        let waiters = {
            let mut s = self.state.lock();
            if s.in_task {
                return Take::Skip;
            }
            if s.closed || s.items.is_empty() || s.demand == 0 {
                s.scheduled = false;
                return Take::Empty;
            }
            s.take_into(out, max);
            let more = !s.items.is_empty() && s.demand > 0;
            s.scheduled = more;
            // Ordered by the lock against `close`, which `unregister` takes
            // before it looks at `active`.
            d.active.store(true, Ordering::Relaxed);
            // Room was made: wake the waiting senders.
            (s.room_waiters.take_all(), more)
        };
        let (waiters, more) = waiters;
        for w in waiters {
            w.wake();
        }
        Take::Batch { more }
    }

    /// The dispatcher finished a batch taken by `take_scheduled`.
    pub(crate) fn batch_done(&self) {
        if let Some(d) = &self.dispatch {
            d.active.store(false, Ordering::Release);
        }
    }

    /// The batch in progress continues on the consumer's own task: keep
    /// senders from scheduling the consumer until `leave_task`.
    pub(crate) fn enter_task(&self) {
        let mut s = self.state.lock();
        s.in_task = true;
        s.scheduled = true;
    }

    /// The consumer's task finished its batch: back to the dispatcher.
    pub(crate) fn leave_task(self: &Arc<Self>) {
        let wake = {
            let mut s = self.state.lock();
            s.in_task = false;
            s.scheduled = false;
            if s.items.is_empty() || s.closed {
                None
            } else {
                self.wake_for(&mut s)
            }
        };
        self.batch_done();
        self.wake(wake);
    }

    /// Resolves once no batch of this (closed) dispatched consumer is being
    /// handled; at once for other consumers.
    pub(crate) async fn wait_idle(&self) {
        let Some(d) = &self.dispatch else {
            return;
        };
        let inline = crate::dispatch::in_poll_of(&d.dispatcher) && !self.state.lock().in_task;
        if inline || crate::dispatch::is_running(self) {
            // Called from this consumer's own handler: the batch in progress
            // is the caller's, and it ends when the handler returns.
            return;
        }
        // The queue is closed, so no new batch starts: only the one in
        // progress can keep `active` set. A few yields cover a synchronous
        // handler on this loop; then check after pauses growing from 1 to
        // 16 ms. A pause is slept on the blocking pool, not with
        // `tokio::time`: the runtime awaiting `unregister` may have no timer
        // (it panicked there), and nothing blocks an async worker.
        let mut checks = 0u32;
        while d.active.load(Ordering::Acquire) {
            if checks < 8 {
                tokio::task::yield_now().await;
            } else {
                let pause = std::time::Duration::from_millis(1 << (checks - 8).min(4));
                if tokio::task::spawn_blocking(move || std::thread::sleep(pause))
                    .await
                    .is_err()
                {
                    // The runtime is shutting down.
                    tokio::task::yield_now().await;
                }
            }
            checks = checks.saturating_add(1);
        }
    }

    /// Appends `env` unless the buffer is full or closed.
    #[inline]
    pub(crate) fn try_push(self: &Arc<Self>, env: Envelope) -> Result<(), (Refused, Envelope)> {
        let wake = {
            let mut s = self.state.lock();
            if s.closed {
                return Err((Refused::Closed, env));
            }
            if s.items.len() >= self.capacity {
                s.stats.refused_full += 1;
                return Err((Refused::Full, env));
            }
            s.items.push_back(env);
            s.received += 1;
            self.wake_for(&mut s)
        };
        self.wake(wake);
        Ok(())
    }

    /// Appends the envelope in `slot` when there is room; otherwise registers
    /// for a wake-up when the consumer frees some. Leaves `slot` empty on success.
    pub(crate) fn poll_push(
        self: &Arc<Self>,
        slot: &mut Option<Envelope>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), Refused>> {
        let wake = {
            let mut s = self.state.lock();
            if s.closed {
                return Poll::Ready(Err(Refused::Closed));
            }
            if s.items.len() >= self.capacity {
                // Stale waiters (bounded, see `RoomWaiters`) are woken
                // after the lock is released.
                let stale = s.room_waiters.register(cx.waker());
                drop(s);
                stale.into_iter().for_each(Waker::wake);
                return Poll::Pending;
            }
            let Some(env) = slot.take() else {
                return Poll::Ready(Ok(()));
            };
            s.items.push_back(env);
            s.received += 1;
            self.wake_for(&mut s)
        };
        self.wake(wake);
        Poll::Ready(Ok(()))
    }

    /// Moves up to `max` messages (bounded by demand) into `out`.
    ///
    /// Returns `Ready(false)` once the queue is closed and empty.
    pub(crate) fn poll_batch(
        &self,
        cx: &mut Context<'_>,
        out: &mut VecDeque<Envelope>,
        max: usize,
    ) -> Poll<bool> {
        let waiters = {
            let mut s = self.state.lock();
            if s.items.is_empty() || s.demand == 0 {
                if s.closed {
                    return Poll::Ready(false);
                }
                match &s.consumer {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => s.consumer = Some(cx.waker().clone()),
                }
                return Poll::Pending;
            }
            s.take_into(out, max);
            // Room was made: the waiting senders are woken (and their
            // bound starts over).
            s.room_waiters.take_all()
        };
        for w in waiters {
            w.wake();
        }
        Poll::Ready(true)
    }

    /// Stops taking messages until [`resume`](Self::resume) or [`fetch`](Self::fetch).
    pub(crate) fn pause(&self) {
        self.state.lock().demand = 0;
    }

    /// Takes every message again.
    pub(crate) fn resume(self: &Arc<Self>) {
        self.set_demand(|_| FLOWING);
    }

    /// Allows `n` more messages while paused.
    pub(crate) fn fetch(self: &Arc<Self>, n: u64) {
        self.set_demand(|d| {
            if d == FLOWING {
                FLOWING
            } else {
                d.saturating_add(n).min(FLOWING - 1)
            }
        });
    }

    fn set_demand(self: &Arc<Self>, f: impl FnOnce(u64) -> u64) {
        let wake = {
            let mut s = self.state.lock();
            s.demand = f(s.demand);
            // (While on its own task a dispatched consumer stays scheduled,
            // so `wake_for` asks for nothing.)
            if s.items.is_empty() {
                None
            } else {
                self.wake_for(&mut s)
            }
        };
        self.wake(wake);
    }

    /// Counts a message the consumer took but then dropped (inbound veto).
    pub(crate) fn count_discarded(&self) {
        self.state.lock().stats.discarded += 1;
    }

    /// Closes the queue and fails what it still held (a request among it at
    /// once, with `NO_HANDLERS`). Returns whether it was open.
    pub(crate) fn close_and_fail(&self) -> bool {
        let Some(left) = self.close() else {
            return false;
        };
        for env in left {
            env.fail_unhandled(&self.address);
        }
        true
    }

    /// Closes the queue and returns what was still buffered, counted as discarded.
    /// Wakes the consumer (so it exits) and every waiting sender (so it retries elsewhere).
    /// Returns `None` if it was already closed.
    pub(crate) fn close(&self) -> Option<Vec<Envelope>> {
        let (left, consumer, waiters) = {
            let mut s = self.state.lock();
            if s.closed {
                return None;
            }
            s.closed = true;
            let left: Vec<Envelope> = s.items.drain(..).collect();
            s.stats.discarded += left.len() as u64;
            (left, s.consumer.take(), s.room_waiters.take_all())
        };
        consumer.into_iter().chain(waiters).for_each(Waker::wake);
        Some(left)
    }

    pub(crate) fn stats(&self) -> ConsumerStats {
        let s = self.state.lock();
        ConsumerStats {
            buffered: s.items.len() as u64,
            received: s.received,
            ..s.stats
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Body, Headers};

    struct Nobody;
    impl std::task::Wake for Nobody {
        fn wake(self: Arc<Self>) {}
    }

    /// A consumer queue with room for one message (and its bus).
    fn queue_of_one() -> (crate::EventBus, Arc<ConsumerQueue>) {
        let bus = crate::EventBus::new();
        let q = Arc::new(ConsumerQueue::new(
            "a",
            bus.inner.shared.clone(),
            1,
            false,
            1,
            false,
            None,
        ));
        (bus, q)
    }

    fn envelope() -> Envelope {
        Envelope {
            headers: Headers::new(),
            body: Body::new(1u32),
            reply: None,
            send: true,
        }
    }

    /// Senders that gave up waiting for room (a request that timed out
    /// while blocked) leave wakers behind; a consumer that takes nothing
    /// would let them pile up without bound.
    #[test]
    fn wakers_of_senders_that_gave_up_do_not_pile_up() {
        let (_bus, q) = queue_of_one();
        let waker = Waker::from(Arc::new(Nobody));
        let mut slot = Some(envelope());
        let r = q.poll_push(&mut slot, &mut Context::from_waker(&waker));
        assert!(matches!(r, Poll::Ready(Ok(()))), "room for one");
        for _ in 0..5 * RoomWaiters::BASE_BOUND {
            // A distinct waker each time: a sender that polled once and left.
            let waker = Waker::from(Arc::new(Nobody));
            let mut slot = Some(envelope());
            let r = q.poll_push(&mut slot, &mut Context::from_waker(&waker));
            assert!(r.is_pending(), "full");
        }
        // Stale wakers are bounded (the bound doubles at each wake-all, so
        // 5 x the base fits in base + 2 x base + 4 x base).
        let s = q.state.lock();
        assert!(
            s.room_waiters.len() <= 4 * RoomWaiters::BASE_BOUND,
            "{}",
            s.room_waiters.len()
        );
    }

    /// Many live senders waiting for room at once do not make a wake-up
    /// storm: each wake-all doubles the bound, so 5,000 waiters that poll
    /// again after every wake-up cost a handful of wake-alls, not one per
    /// poll past 1,024.
    #[test]
    fn many_live_waiters_are_not_woken_over_and_over() {
        use std::sync::atomic::{AtomicUsize, Ordering as O};
        struct Counter(AtomicUsize);
        impl std::task::Wake for Counter {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, O::Relaxed);
            }
        }
        let (_bus, q) = queue_of_one();
        let mut slot = Some(envelope());
        let w = Waker::from(Arc::new(Nobody));
        assert!(q
            .poll_push(&mut slot, &mut Context::from_waker(&w))
            .is_ready());
        let counters: Vec<Arc<Counter>> = (0..5000)
            .map(|_| Arc::new(Counter(AtomicUsize::new(0))))
            .collect();
        let wakers: Vec<Waker> = counters.iter().map(|c| Waker::from(c.clone())).collect();
        // Every waiter polls once, then again whenever it was woken, until
        // no more wake-ups come (bounded: 20 rounds).
        let mut seen = vec![0usize; wakers.len()];
        for round in 0..20 {
            let mut polled = 0;
            for (i, w) in wakers.iter().enumerate() {
                let woken = counters[i].0.load(O::Relaxed);
                if round == 0 || woken > seen[i] {
                    seen[i] = woken;
                    let mut slot = Some(envelope());
                    assert!(q
                        .poll_push(&mut slot, &mut Context::from_waker(w))
                        .is_pending());
                    polled += 1;
                }
            }
            if polled == 0 {
                break;
            }
        }
        let wakes: usize = counters.iter().map(|c| c.0.load(O::Relaxed)).sum();
        assert!(wakes < 4 * 5000, "{wakes} wake-ups for 5,000 waiters");
    }
}
