//! A link's outbound queue: bounded, many senders, one reader that takes
//! everything queued at once.
//!
//! Hand-written in place of `tokio::sync::mpsc` because every message to
//! another node goes through it. A send here is one uncontended lock and a
//! push, and only the send that finds the reader waiting wakes it; the
//! reader takes a whole batch under one lock. tokio's bounded channel paid
//! a semaphore permit, a slot in its block list and a waker notification
//! per message, and a permit release per message taken: about 8 % of a
//! serving process's CPU in `bench echo --cluster etcd --nodes 2 --method
//! send-send` (docs/benchmarks.md).
//!
//! The lock is the bus's [`SpinLock`], whose release is a plain store: with
//! `parking_lot`'s mutex, whose release is a compare-and-swap, the two
//! locked instructions of a send were about 3 % of each process's samples
//! in that bench (the release the dearer, as it drains the stores of the
//! push). The sections under it are short: a push (which may grow the
//! buffer, copying what is queued, bounded by the capacity), a swap, a
//! waker's registration; a reader that finds more than its batch (or a
//! grown buffer) copies one batch out under it. Buffers and wakers given
//! up are freed after the lock is released.
//!
//! When full, a send is refused with the item back ([`Refused::Full`]); the
//! link turns that into `BusError::Full` and the sender may wait for room
//! (`Link::poll_room`). Once closed, sends are refused
//! ([`Refused::Closed`]); [`OutQueue::close`] returns what was queued, and
//! the reader then gets 0.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::task::{Poll, Waker};

use railyard_bus::SpinLock;

/// Slots of buffer the queue may keep or hand to the reader; a buffer a
/// burst grew past this is freed once the queue has emptied.
const KEEP: usize = 1024;

/// Why an item was not queued; it comes back.
#[derive(Debug)]
pub(crate) enum Refused<T> {
    Full(T),
    Closed(T),
}

impl<T> Refused<T> {
    pub(crate) fn into_inner(self) -> T {
        match self {
            Refused::Full(t) | Refused::Closed(t) => t,
        }
    }
}

#[derive(Debug)]
struct Inner<T> {
    items: VecDeque<T>,
    /// The reader, when it found the queue empty; taken by the send that
    /// wakes it.
    reader: Option<Waker>,
    closed: bool,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct OutQueue<T> {
    inner: SpinLock<Inner<T>>,
    cap: usize,
}

impl<T> OutQueue<T> {
    /// A queue of at most `cap` items (at least 1).
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            inner: SpinLock::new(Inner {
                items: VecDeque::new(),
                reader: None,
                closed: false,
            }),
            cap: cap.max(1),
        }
    }

    /// Queues `item`, or gives it back if the queue is full or closed.
    pub(crate) fn try_push(&self, item: T) -> Result<(), Refused<T>> {
        let reader = {
            let mut g = self.inner.lock();
            if g.closed {
                return Err(Refused::Closed(item));
            }
            if g.items.len() >= self.cap {
                return Err(Refused::Full(item));
            }
            g.items.push_back(item);
            g.reader.take()
        };
        if let Some(w) = reader {
            w.wake();
        }
        Ok(())
    }

    /// Whether a send is worth trying: there is room, or the queue is
    /// closed (the send is refused at once, so nobody waits for room that
    /// never comes).
    pub(crate) fn has_room(&self) -> bool {
        let g = self.inner.lock();
        g.closed || g.items.len() < self.cap
    }

    /// Moves up to `max` items into `out` (waiting while there are none);
    /// 0 once the queue is closed and empty. Cancel-safe: items are taken
    /// only when it returns.
    ///
    /// When everything queued fits, `out` is empty and the queue's buffer is
    /// no larger than [`KEEP`], the two are swapped: the lock is held for a
    /// pointer swap, not for a copy of every item (a message is about a
    /// hundred bytes), and the queue goes on with the reader's emptied
    /// buffer. A buffer a burst grew is drained instead, then freed once
    /// empty, and never passes to the reader.
    pub(crate) async fn recv_many(&self, out: &mut VecDeque<T>, max: usize) -> usize {
        poll_fn(|cx| {
            let mut g = self.inner.lock();
            if !g.items.is_empty() {
                let n = g.items.len().min(max.max(1));
                if n == g.items.len() && out.is_empty() && g.items.capacity() <= KEEP {
                    std::mem::swap(&mut g.items, out);
                    return Poll::Ready(n);
                }
                out.extend(g.items.drain(..n));
                if g.items.is_empty() && g.items.capacity() > KEEP {
                    // A burst is over: its buffer is freed after the lock
                    // is released (a large free can be a system call).
                    let grown = std::mem::take(&mut g.items);
                    drop(g);
                    drop(grown);
                }
                return Poll::Ready(n);
            }
            if g.closed {
                return Poll::Ready(0);
            }
            // A waker replaced is dropped after the lock is released.
            let old = match &g.reader {
                Some(w) if w.will_wake(cx.waker()) => None,
                _ => g.reader.replace(cx.waker().clone()),
            };
            drop(g);
            drop(old);
            Poll::Pending
        })
        .await
    }

    /// Refuses further sends and returns what was queued.
    pub(crate) fn close(&self) -> Vec<T> {
        let (left, reader) = {
            let mut g = self.inner.lock();
            g.closed = true;
            // Taken whole under the lock, copied out after it.
            (std::mem::take(&mut g.items), g.reader.take())
        };
        if let Some(w) = reader {
            w.wake();
        }
        left.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    /// A queue of `cap` holding `0..n`.
    fn filled(cap: usize, n: i32) -> OutQueue<i32> {
        let q = OutQueue::new(cap);
        for i in 0..n {
            q.try_push(i).unwrap();
        }
        q
    }

    #[test]
    fn a_full_queue_refuses_and_gives_the_item_back() {
        let q = filled(2, 2);
        assert!(!q.has_room());
        match q.try_push(3) {
            Err(Refused::Full(3)) => {}
            other => panic!("expected Full(3), got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_burst_is_given_back_once_the_queue_empties() {
        let q = filled(100_000, 50_000);
        let mut out = VecDeque::new();
        let mut got = 0;
        while got < 50_000 {
            got += q.recv_many(&mut out, 256).await;
            // As the link's writer does: the batch is used up each time.
            out.clear();
        }
        // Neither the queue nor the reader's batch keeps the burst's buffer.
        assert!(q.inner.lock().items.capacity() <= 2 * KEEP);
        assert!(out.capacity() <= 2 * KEEP, "batch kept {}", out.capacity());
    }

    #[tokio::test]
    async fn the_reader_takes_at_most_max_in_order_then_the_rest() {
        let q = filled(10, 5);
        let mut out = VecDeque::new();
        assert_eq!(q.recv_many(&mut out, 3).await, 3);
        assert_eq!(q.recv_many(&mut out, 3).await, 2);
        assert_eq!(out, vec![0, 1, 2, 3, 4]);
        assert!(q.has_room());
    }

    #[tokio::test]
    async fn an_empty_batch_takes_everything_by_swap_and_the_queue_goes_on() {
        let q = filled(10, 4);
        let mut out = VecDeque::with_capacity(64);
        assert_eq!(q.recv_many(&mut out, 8).await, 4);
        assert_eq!(out, vec![0, 1, 2, 3]);
        // The queue now holds the batch's old buffer: sends still land, in
        // order, up to the bound.
        for i in 4..14 {
            q.try_push(i).unwrap();
        }
        assert!(matches!(q.try_push(99), Err(Refused::Full(99))));
        out.clear();
        assert_eq!(q.recv_many(&mut out, 8).await, 8);
        assert_eq!(q.recv_many(&mut out, 8).await, 2);
        assert_eq!(out, (4..14).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_waiting_reader_is_woken_by_a_send_from_another_thread() {
        let q = Arc::new(OutQueue::new(4));
        let q2 = q.clone();
        let sender = std::thread::spawn(move || {
            for i in 0..1000u32 {
                // Bounded: the reader drains; retry while full, for a while.
                let mut item = i;
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                loop {
                    match q2.try_push(item) {
                        Ok(()) => break,
                        Err(Refused::Full(back)) if std::time::Instant::now() < deadline => {
                            item = back;
                            std::thread::yield_now();
                        }
                        Err(e) => panic!("send {i} refused: {e:?}"),
                    }
                }
            }
        });
        let mut got = VecDeque::new();
        let read = async {
            while got.len() < 1000 {
                let n = q.recv_many(&mut got, 256).await;
                assert!(n > 0);
            }
        };
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("every send reached the reader");
        sender.join().unwrap();
        assert_eq!(got, (0..1000).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn closing_refuses_sends_returns_what_was_queued_and_ends_the_reader() {
        let q = Arc::new(OutQueue::new(4));
        let q2 = q.clone();
        let reader = tokio::spawn(async move {
            let mut out = VecDeque::new();
            q2.recv_many(&mut out, 8).await
        });
        tokio::task::yield_now().await;
        assert!(q.close().is_empty());
        assert_eq!(reader.await.unwrap(), 0);
        match q.try_push(7) {
            Err(Refused::Closed(7)) => {}
            other => panic!("expected Closed(7), got {other:?}"),
        }
        assert!(q.has_room(), "a closed queue answers at once: worth trying");

        let q = filled(4, 2);
        assert_eq!(q.close(), vec![0, 1]);
        let mut out = VecDeque::new();
        assert_eq!(q.recv_many(&mut out, 8).await, 0);
    }
}
