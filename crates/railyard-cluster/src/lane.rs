//! Inbound messages that found every local buffer full, delivered in the
//! order they arrived.
//!
//! A link's reader hands a message it cannot deliver now (all the
//! address's consumers have full buffers) to the link's [`Lane`] and goes
//! on reading. One task delivers what the lane holds, one message after
//! another, each waiting for room. A later message for an address that
//! still has messages in the lane goes in behind them instead of being
//! delivered at once, so one sender's messages reach a consumer in send
//! order (before 2026-11-27 each waiting message had a task of its own,
//! and the next message, or another waiting task, could get in first). A
//! message for another address does not wait behind them.
//!
//! The lane holds at most its capacity; when it is full the reader itself
//! waits for room in it, reading nothing meanwhile, and TCP then slows the
//! peer down.

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
    state: Mutex<State>,
    /// Messages held: queued plus the one being delivered. Read without
    /// the lock for every inbound message, so the common case (nothing
    /// waits) costs one load.
    held: AtomicUsize,
    capacity: usize,
    /// Notified each time a held message has been delivered.
    room: Notify,
}

#[derive(Default)]
struct State {
    queue: VecDeque<(Box<str>, Delivery)>,
    /// Held messages per address, the one being delivered included: a
    /// message for an address listed here goes behind them.
    by_address: HashMap<Box<str>, usize>,
    /// A task is delivering the queue.
    draining: bool,
}

impl Lane {
    /// A lane that holds at most `capacity` messages.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            state: Mutex::new(State::default()),
            held: AtomicUsize::new(0),
            capacity: capacity.max(1),
            room: Notify::new(),
        }
    }

    /// Whether messages for `address` are waiting: the next one for it must
    /// go behind them ([`push`](Self::push)), not be delivered directly.
    pub(crate) fn holds(&self, address: &str) -> bool {
        self.held.load(Ordering::Acquire) > 0 && self.state.lock().by_address.contains_key(address)
    }

    /// Queues `delivery` for `address` behind what the lane holds, and
    /// starts the delivering task if none runs. A full lane gives it back.
    pub(crate) fn push(
        self: &Arc<Self>,
        address: &str,
        delivery: Delivery,
    ) -> Result<(), Delivery> {
        let start = {
            let mut s = self.state.lock();
            if self.held.load(Ordering::Relaxed) >= self.capacity {
                return Err(delivery);
            }
            self.held.fetch_add(1, Ordering::AcqRel);
            match s.by_address.get_mut(address) {
                Some(n) => *n += 1,
                None => {
                    s.by_address.insert(address.into(), 1);
                }
            }
            s.queue.push_back((address.into(), delivery));
            !std::mem::replace(&mut s.draining, true)
        };
        if start {
            tokio::spawn(self.clone().drain());
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

    /// Delivers the queue in order until it is empty. An address leaves
    /// `by_address` only once its last message was delivered.
    async fn drain(self: Arc<Self>) {
        loop {
            let next = {
                let mut s = self.state.lock();
                match s.queue.pop_front() {
                    Some(next) => next,
                    None => {
                        s.draining = false;
                        return;
                    }
                }
            };
            let (address, delivery) = next;
            delivery.await;
            {
                let mut s = self.state.lock();
                if let Some(n) = s.by_address.get_mut(&address) {
                    *n -= 1;
                    if *n == 0 {
                        s.by_address.remove(&address);
                    }
                }
                self.held.fetch_sub(1, Ordering::AcqRel);
            }
            self.room.notify_waiters();
        }
    }

    /// Messages held now (queued or being delivered).
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
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

    #[tokio::test]
    async fn delivers_in_order_holds_per_address_and_bounds_itself() {
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
        for _ in 0..1000 {
            if lane.held() == 0 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(*seen.lock(), vec![0, 1, 2, 3]);
        assert_eq!(lane.held(), 0);
        assert!(!lane.holds("a") && !lane.holds("c"));
        // An empty lane starts a new task for the next message.
        assert!(lane.push("a", recording(4, &seen, &gate)).is_ok());
        for _ in 0..1000 {
            if lane.held() == 0 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(*seen.lock(), vec![0, 1, 2, 3, 4]);
    }
}
