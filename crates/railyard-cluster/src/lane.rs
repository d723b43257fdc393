//! Inbound messages that found every local buffer full, delivered in the
//! order they arrived, per address.
//!
//! A link's reader hands a message it cannot deliver now (all the
//! address's consumers have full buffers) to the link's [`Lane`] and goes
//! on reading. Each address with waiting messages has one task that
//! delivers them one after another, each waiting for room. A later message
//! for an address that still has messages in the lane goes in behind them
//! instead of being delivered at once, so one sender's messages reach a
//! consumer in send order (before 2026-11-27 each waiting message had a
//! task of its own, and the next message, or another waiting task, could
//! get in first). Addresses do not wait for each other: a consumer that
//! stops taking messages holds back only its own address's.
//!
//! The lane holds at most its capacity, over all addresses; when it is full
//! the reader itself waits for room in it, reading nothing meanwhile, and
//! TCP then slows the peer down.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// One waiting message: delivering it (waiting for room) is awaiting this.
pub(crate) type Delivery = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The ordered waiting room of one link's inbound messages (see the module
/// docs).
pub(crate) struct Lane {
    /// Per address with messages held: those not yet being delivered, in
    /// arrival order. An address stays here, its queue maybe empty, while
    /// its task delivers its last message.
    queues: Mutex<HashMap<Box<str>, VecDeque<Delivery>>>,
    /// Messages held: queued plus those being delivered. Read without the
    /// lock for every inbound message, so the common case (nothing waits)
    /// costs one load.
    held: AtomicUsize,
    capacity: usize,
    /// Notified each time a held message has been delivered.
    room: Notify,
}

impl Lane {
    /// A lane that holds at most `capacity` messages.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            queues: Mutex::new(HashMap::new()),
            held: AtomicUsize::new(0),
            capacity: capacity.max(1),
            room: Notify::new(),
        }
    }

    /// Whether messages for `address` are waiting: the next one for it must
    /// go behind them ([`push`](Self::push)), not be delivered directly.
    pub(crate) fn holds(&self, address: &str) -> bool {
        self.held.load(Ordering::Acquire) > 0 && self.queues.lock().contains_key(address)
    }

    /// Queues `delivery` behind what the lane holds for `address`, and
    /// starts that address's task if none runs. A full lane gives it back.
    pub(crate) fn push(
        self: &Arc<Self>,
        address: &str,
        delivery: Delivery,
    ) -> Result<(), Delivery> {
        let start = {
            let mut queues = self.queues.lock();
            if self.held.load(Ordering::Relaxed) >= self.capacity {
                return Err(delivery);
            }
            self.held.fetch_add(1, Ordering::AcqRel);
            match queues.get_mut(address) {
                Some(q) => {
                    q.push_back(delivery);
                    None
                }
                None => {
                    queues.insert(address.into(), VecDeque::new());
                    Some(delivery)
                }
            }
        };
        if let Some(first) = start {
            let guard = Draining {
                lane: self.clone(),
                address: address.into(),
                in_flight: true,
                finished: false,
            };
            tokio::spawn(guard.drain(first));
        }
        Ok(())
    }

    /// As [`push`](Self::push), waiting for room in a full lane.
    pub(crate) async fn push_waiting(self: &Arc<Self>, address: &str, mut delivery: Delivery) {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            match self.push(address, delivery) {
                Ok(()) => return,
                Err(back) => delivery = back,
            }
            room.await;
        }
    }

    /// Messages held now (queued or being delivered).
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// One address's task: delivers its queue in order, then removes the
/// address. Dropped unfinished (its runtime shut down, a delivery
/// panicked), it still removes the address and gives back the room its
/// messages held, so the lane never stays blocked.
struct Draining {
    lane: Arc<Lane>,
    address: Box<str>,
    /// A message taken from the queue is being delivered.
    in_flight: bool,
    /// The queue was delivered and the address removed: nothing to undo.
    finished: bool,
}

impl Draining {
    async fn drain(mut self, first: Delivery) {
        let mut next = Some(first);
        while let Some(delivery) = next.take() {
            self.in_flight = true;
            delivery.await;
            self.in_flight = false;
            self.lane.held.fetch_sub(1, Ordering::AcqRel);
            self.lane.room.notify_waiters();
            let mut queues = self.lane.queues.lock();
            next = queues.get_mut(&self.address).and_then(VecDeque::pop_front);
            if next.is_none() {
                queues.remove(&self.address);
                // A later push for this address makes a new entry and task,
                // which this one's drop must not touch.
                self.finished = true;
            }
        }
    }
}

impl Drop for Draining {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let removed = self.lane.queues.lock().remove(&self.address);
        let left = removed.map_or(0, |q| q.len()) + usize::from(self.in_flight);
        if left > 0 {
            self.lane.held.fetch_sub(left, Ordering::AcqRel);
            self.lane.room.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A delivery that records `n` once `gate` opens.
    fn recording(
        n: u32,
        seen: &Arc<Mutex<Vec<u32>>>,
        gate: &tokio::sync::watch::Receiver<bool>,
    ) -> Delivery {
        let (seen, mut gate) = (seen.clone(), gate.clone());
        Box::pin(async move {
            let _ = gate.wait_for(|open| *open).await;
            seen.lock().push(n);
        })
    }

    async fn until_empty(lane: &Lane) {
        for _ in 0..1000 {
            if lane.held() == 0 {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the lane still holds {}", lane.held());
    }

    #[tokio::test]
    async fn delivers_in_order_per_address_and_bounds_itself() {
        let lane = Arc::new(Lane::new(3));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (open, gate) = tokio::sync::watch::channel(false);
        assert!(!lane.holds("a"));
        for n in 0..3 {
            let address = if n == 1 { "b" } else { "a" };
            assert!(lane.push(address, recording(n, &seen, &gate)).is_ok());
        }
        assert!(lane.holds("a") && lane.holds("b") && !lane.holds("c"));
        // Full: the fourth comes back, and waits for room when asked to.
        assert!(lane.push("c", recording(3, &seen, &gate)).is_err());
        let l2 = lane.clone();
        let (s2, g2) = (seen.clone(), gate.clone());
        let waiting =
            tokio::spawn(async move { l2.push_waiting("c", recording(3, &s2, &g2)).await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        open.send(true).unwrap();
        waiting.await.unwrap();
        until_empty(&lane).await;
        let seen_now = seen.lock().clone();
        // Per address in order: a's 0 before its 2.
        let at = |n| seen_now.iter().position(|&x| x == n).unwrap();
        assert!(at(0) < at(2), "{seen_now:?}");
        assert_eq!(seen_now.len(), 4);
        assert!(!lane.holds("a") && !lane.holds("c"));
        // An empty lane starts a new task for the next message.
        assert!(lane.push("a", recording(4, &seen, &gate)).is_ok());
        until_empty(&lane).await;
        assert_eq!(seen.lock().last(), Some(&4));
    }

    /// A consumer that never takes its messages holds back only its own
    /// address; a delivery that panics gives its room back.
    #[tokio::test]
    async fn a_stuck_or_panicking_address_holds_back_only_itself() {
        let lane = Arc::new(Lane::new(8));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (_never, stuck) = tokio::sync::watch::channel(false);
        let (_open, open) = tokio::sync::watch::channel(true);
        assert!(lane.push("stuck", recording(0, &seen, &stuck)).is_ok());
        assert!(lane.push("stuck", recording(1, &seen, &stuck)).is_ok());
        assert!(lane.push("free", recording(2, &seen, &open)).is_ok());
        assert!(lane
            .push("boom", Box::pin(async { panic!("a delivery panicked") }))
            .is_ok());
        for _ in 0..1000 {
            if lane.held() == 2 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(*seen.lock(), vec![2], "free went past stuck");
        assert_eq!(lane.held(), 2, "stuck's two held, boom's room given back");
        assert!(lane.holds("stuck") && !lane.holds("boom") && !lane.holds("free"));
    }
}
