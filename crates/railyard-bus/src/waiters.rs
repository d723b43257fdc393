//! Senders waiting for room: the wakers a full buffer keeps, bounded.
//!
//! Used by the bus's consumer queues and by the cluster's links (one
//! mechanism, so the two cannot drift apart).

use std::task::Waker;

/// Wakers of senders waiting for room in a bounded buffer (`send_wait`,
/// blocked requests), woken together when room comes.
///
/// A waiter that gives up (a request that timed out while blocked, a
/// dropped `send_wait`) leaves its waker here until room comes; a buffer
/// that never drains would let them pile up, one per attempt. So at a bound
/// every waiter is woken and the list starts over (those still waiting
/// register again), and the bound doubles, so that many live waiters do not
/// make a wake-up storm: the list holds at most about twice the live
/// waiters, plus [`RoomWaiters::BASE_BOUND`]. The bound starts over at
/// [`take_all`](Self::take_all).
#[derive(Debug)]
pub struct RoomWaiters {
    wakers: Vec<Waker>,
    /// How many `wakers` may hold before they are all woken.
    bound: usize,
}

impl Default for RoomWaiters {
    fn default() -> Self {
        Self {
            wakers: Vec::new(),
            bound: Self::BASE_BOUND,
        }
    }
}

impl RoomWaiters {
    /// Wakers kept before the first wake-all.
    pub const BASE_BOUND: usize = 1024;

    /// Registers `waker`; returns the wakers to wake once the caller's lock
    /// is released (all of them when the bound was reached: those still
    /// waiting register again).
    ///
    /// Only the last waiter is checked for a repeat poll: a full scan made
    /// many blocked senders quadratic. A duplicate costs one spurious
    /// wake-up.
    #[must_use]
    pub fn register(&mut self, waker: &Waker) -> Vec<Waker> {
        if self.wakers.last().is_some_and(|w| w.will_wake(waker)) {
            return Vec::new();
        }
        if self.wakers.len() >= self.bound {
            let stale = std::mem::take(&mut self.wakers);
            self.bound = self.bound.saturating_mul(2);
            self.wakers.push(waker.clone());
            return stale;
        }
        self.wakers.push(waker.clone());
        Vec::new()
    }

    /// Every waiter, to wake (room came, or the buffer closed); the bound
    /// starts over.
    #[inline]
    pub fn take_all(&mut self) -> Vec<Waker> {
        self.bound = Self::BASE_BOUND;
        std::mem::take(&mut self.wakers)
    }

    /// Wakers kept.
    pub fn len(&self) -> usize {
        self.wakers.len()
    }

    /// Whether no waker is kept.
    pub fn is_empty(&self) -> bool {
        self.wakers.is_empty()
    }
}
