//! Request timeouts without a timer per request.
//!
//! Arming a tokio `Sleep` for every request cost more than the rest of a
//! local round trip (a boxed, over-aligned timer entry, a runtime handle
//! lookup, a clock read and two timer-wheel locks). Nearly every request is
//! answered within microseconds, so Railyard defers the real bookkeeping:
//!
//! - **arm**: a request that has to wait takes a slot in its thread's shard
//!   (a slab entry holding the deadline and the waker) and is noted in the
//!   shard's `young` list. One uncontended lock, no allocation once warm.
//! - **cancel**: an answered request frees its slot. The `young` note goes
//!   stale and costs nothing.
//! - **sweep**: one task per bus wakes every [`TICK`]. It moves the `young`
//!   requests that are still waiting into a deadline heap (`old`), pops every
//!   expired deadline, and wakes those requesters, which then see `Fired`.
//!
//! So only requests older than one tick ever reach the heap. Timeouts fire
//! no earlier than their deadline and at most about one tick late.
//!
//! The sweeper is spawned on the runtime of the first request that waits,
//! holds only a weak reference (it ends with the bus), and is respawned if
//! its runtime shut down. It uses tokio's clock, so paused-time tests work.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::Waker;
use std::time::Duration;

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::metrics::thread_shard;

/// How often the sweeper runs: the worst-case lateness of a timeout.
pub(crate) const TICK: Duration = Duration::from_millis(5);

pub(crate) struct Timeouts {
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    /// Whether a sweeper task is alive; a drop guard inside it clears this.
    sweeper: AtomicBool,
}

#[derive(Default)]
struct Shard {
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Armed since the last sweep: (index, generation). Stale once cancelled.
    young: Vec<(u32, u32)>,
    /// Still waiting after a sweep: min-heap on the deadline.
    old: BinaryHeap<Reverse<(Instant, u32, u32)>>,
    /// Slots that are armed and not yet fired.
    armed: usize,
}

struct Slot {
    generation: u32,
    state: SlotState,
    deadline: Instant,
    waker: Option<Waker>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Armed,
    Fired,
}

/// Identifies one armed timeout.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TimerKey {
    shard: u32,
    index: u32,
    generation: u32,
}

impl Timeouts {
    pub(crate) fn new() -> Arc<Self> {
        let n = crate::metrics::shard_count();
        Arc::new(Self {
            shards: (0..n)
                .map(|_| CachePadded::new(Mutex::new(Shard::default())))
                .collect(),
            sweeper: AtomicBool::new(false),
        })
    }

    /// Arms a timeout at `deadline` that wakes `waker`.
    ///
    /// # Panics
    /// Outside a tokio runtime (the sweeper needs one), like tokio's own timers.
    pub(crate) fn arm(self: &Arc<Self>, deadline: Instant, waker: &Waker) -> TimerKey {
        if !self.sweeper.load(Ordering::Acquire) {
            self.start_sweeper();
        }
        let shard = thread_shard() & (self.shards.len() - 1);
        let mut s = self.shards[shard].lock();
        let index = match s.free.pop() {
            Some(i) => i,
            None => {
                s.slots.push(Slot {
                    generation: 0,
                    state: SlotState::Free,
                    deadline,
                    waker: None,
                });
                // More than 4 billion waiting requests on one shard is not a
                // state this process survives anyway.
                u32::try_from(s.slots.len() - 1).expect("fewer than 2^32 pending timeouts")
            }
        };
        let slot = &mut s.slots[index as usize];
        slot.generation = slot.generation.wrapping_add(1);
        slot.state = SlotState::Armed;
        slot.deadline = deadline;
        slot.waker = Some(waker.clone());
        let generation = slot.generation;
        s.young.push((index, generation));
        s.armed += 1;
        TimerKey {
            shard: shard as u32,
            index,
            generation,
        }
    }

    /// Whether the timeout fired; if not, makes sure `waker` is the one woken.
    pub(crate) fn poll_fired(&self, key: TimerKey, waker: &Waker) -> bool {
        let mut s = self.shards[key.shard as usize].lock();
        let slot = &mut s.slots[key.index as usize];
        if slot.generation != key.generation {
            return false;
        }
        match slot.state {
            SlotState::Fired => true,
            SlotState::Armed => {
                if !slot.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
                    slot.waker = Some(waker.clone());
                }
                false
            }
            SlotState::Free => false,
        }
    }

    /// Releases the slot (answered, fired and observed, or abandoned).
    pub(crate) fn cancel(&self, key: TimerKey) {
        let waker = {
            let mut s = self.shards[key.shard as usize].lock();
            let slot = &mut s.slots[key.index as usize];
            if slot.generation != key.generation || slot.state == SlotState::Free {
                return;
            }
            let was_armed = slot.state == SlotState::Armed;
            slot.state = SlotState::Free;
            let waker = slot.waker.take();
            s.free.push(key.index);
            if was_armed {
                s.armed -= 1;
            }
            waker
        };
        // Dropped outside the lock: a waker's drop may run arbitrary code.
        drop(waker);
    }

    fn start_sweeper(self: &Arc<Self>) {
        if self
            .sweeper
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let weak = Arc::downgrade(self);
        let guard = SweeperGuard(weak.clone());
        tokio::spawn(async move {
            let _guard = guard;
            sweep_forever(weak).await;
        });
    }

    /// One sweep: fires every expired timeout. Returns the wakers to wake.
    fn sweep(&self, now: Instant, wake: &mut Vec<Waker>) {
        for shard in self.shards.iter() {
            let mut guard = shard.lock();
            let s = &mut *guard;
            let young = std::mem::take(&mut s.young);
            for &(index, generation) in &young {
                let slot = &mut s.slots[index as usize];
                if slot.generation == generation && slot.state == SlotState::Armed {
                    s.old.push(Reverse((slot.deadline, index, generation)));
                }
            }
            // Keep the young list's allocation for the next tick.
            s.young = young;
            s.young.clear();
            while let Some(Reverse((deadline, index, generation))) = s.old.peek().copied() {
                if deadline > now {
                    break;
                }
                s.old.pop();
                let slot = &mut s.slots[index as usize];
                if slot.generation == generation && slot.state == SlotState::Armed {
                    slot.state = SlotState::Fired;
                    s.armed -= 1;
                    wake.extend(slot.waker.take());
                }
            }
            // Answered requests leave stale heap entries; drop them once they
            // outnumber the live ones, so the heap stays proportional to what waits.
            if s.old.len() > 1024 && s.old.len() > 2 * s.armed {
                let slots = &s.slots;
                let live: Vec<_> = s
                    .old
                    .drain()
                    .filter(|Reverse((_, i, g))| {
                        let slot = &slots[*i as usize];
                        slot.generation == *g && slot.state == SlotState::Armed
                    })
                    .collect();
                s.old = BinaryHeap::from(live);
            }
        }
    }
}

/// Clears the "sweeper alive" flag when the sweeper task ends for any reason
/// (bus dropped, or its runtime shut down), so the next timeout respawns it.
struct SweeperGuard(Weak<Timeouts>);

impl Drop for SweeperGuard {
    fn drop(&mut self) {
        if let Some(t) = self.0.upgrade() {
            t.sweeper.store(false, Ordering::Release);
        }
    }
}

async fn sweep_forever(weak: Weak<Timeouts>) {
    let mut wake = Vec::new();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(timeouts) = weak.upgrade() else {
            return;
        };
        timeouts.sweep(Instant::now(), &mut wake);
        drop(timeouts);
        for w in wake.drain(..) {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn fires_after_deadline_and_not_when_cancelled() {
        let t = Timeouts::new();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let start = Instant::now();
        let fires = t.arm(start + Duration::from_millis(20), &waker);
        let cancelled = t.arm(start + Duration::from_millis(20), &waker);
        t.cancel(cancelled);
        assert!(!t.poll_fired(fires, &waker));
        tokio::time::sleep(Duration::from_millis(19)).await;
        assert!(!t.poll_fired(fires, &waker), "never early");
        tokio::time::sleep(TICK * 2).await;
        assert!(t.poll_fired(fires, &waker));
        assert!(!t.poll_fired(cancelled, &waker));
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken once");
        t.cancel(fires);
        // A freed slot is reused with a new generation; old keys stay dead.
        let again = t.arm(start + Duration::from_secs(60), &waker);
        assert!(!t.poll_fired(fires, &waker));
        t.cancel(again);
    }

    #[tokio::test(start_paused = true)]
    async fn heap_of_stale_entries_is_compacted() {
        let t = Timeouts::new();
        let waker = Waker::from(Arc::new(Count(AtomicUsize::new(0))));
        let far = Instant::now() + Duration::from_secs(3600);
        let keys: Vec<_> = (0..5000).map(|_| t.arm(far, &waker)).collect();
        tokio::time::sleep(TICK * 2).await; // all move to the heap
        for k in keys {
            t.cancel(k);
        }
        tokio::time::sleep(TICK * 2).await;
        let s = t.shards.iter().map(|s| s.lock().old.len()).sum::<usize>();
        assert_eq!(s, 0, "stale heap entries were dropped");
    }
}
