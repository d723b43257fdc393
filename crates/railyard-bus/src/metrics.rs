//! Counters the bus keeps, and the snapshot an exporter reads.
//!
//! Counters bumped on every message are sharded per thread ([`ShardedCounter`]):
//! each thread adds to its own cache line, so two cores sending at full speed
//! never fight over one. A snapshot sums the shards; it is exact for counters
//! that only grow and a close reading for gauges derived from them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use parking_lot::Mutex;

use crossbeam_utils::CachePadded;

use crate::FailureKind;

/// A counter split into per-thread cache lines.
///
/// The first [`shard_count`] threads to use the bus each own one shard
/// outright ([`thread_slot`]), so they add with a relaxed load and store: no
/// locked instruction, which on the hot path costs as much as the rest of a
/// hand-off. Threads beyond that share one extra shard and add atomically.
pub(crate) struct ShardedCounter {
    /// `shard_count()` owned shards, then the shared overflow shard.
    shards: Box<[CachePadded<AtomicU64>]>,
}

/// Slot numbers handed out so far, and those returned by exited threads.
static SLOTS: Mutex<(usize, Vec<usize>)> = Mutex::new((0, Vec::new()));

/// A thread's claim on a slot; returned when the thread exits, so a process
/// that keeps starting and stopping threads does not run out of owned slots.
struct SlotClaim(usize);

impl SlotClaim {
    fn claim() -> Self {
        let mut s = SLOTS.lock();
        let slot = match s.1.pop() {
            Some(slot) => slot,
            None => {
                s.0 += 1;
                s.0 - 1
            }
        };
        SlotClaim(slot)
    }
}

impl Drop for SlotClaim {
    fn drop(&mut self) {
        // The next owner takes the slot through this lock, so it sees every
        // value this thread stored.
        SLOTS.lock().1.push(self.0);
    }
}

thread_local! {
    static SLOT: SlotClaim = SlotClaim::claim();
}

/// This thread's slot: unique among live threads. Below [`shard_count`] it
/// names a shard this thread alone writes.
#[inline]
pub(crate) fn thread_slot() -> usize {
    // A thread being torn down may still send; it uses the shared shard.
    SLOT.try_with(|s| s.0).unwrap_or(usize::MAX)
}

/// This thread's shard number for structures that tolerate sharing (callers
/// mask it to their shard count).
#[inline]
pub(crate) fn thread_shard() -> usize {
    thread_slot()
}

/// Owned shards per counter: four per core, so the few hot threads of a
/// process (event loops, runtime workers) each get their own. A power of two,
/// for masking.
pub(crate) fn shard_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        (std::thread::available_parallelism().map_or(4, |n| n.get()) * 4)
            .next_power_of_two()
            .clamp(4, 256)
    })
}

impl ShardedCounter {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..=shard_count())
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
        }
    }

    #[inline]
    pub(crate) fn add(&self, n: u64) {
        let owned = self.shards.len() - 1;
        let slot = thread_slot();
        if slot < owned {
            // Only this thread writes this shard (see `thread_slot`).
            let s = &self.shards[slot];
            s.store(s.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
        } else {
            self.shards[owned].fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn get(&self) -> u64 {
        self.shards.iter().map(|s| s.load(Ordering::Relaxed)).sum()
    }
}

/// Bus-wide counters. Per-consumer counts live in each consumer's queue.
pub(crate) struct BusCounters {
    pub(crate) sent: ShardedCounter,
    pub(crate) published: ShardedCounter,
    pub(crate) requests: ShardedCounter,
    pub(crate) replies_done: ShardedCounter,
    pub(crate) failures: [ShardedCounter; 4],
    /// Messages refused at the outbound side: no handlers, every buffer full, vetoed.
    pub(crate) undeliverable: ShardedCounter,
}

impl BusCounters {
    pub(crate) fn new() -> Self {
        Self {
            sent: ShardedCounter::new(),
            published: ShardedCounter::new(),
            requests: ShardedCounter::new(),
            replies_done: ShardedCounter::new(),
            failures: std::array::from_fn(|_| ShardedCounter::new()),
            undeliverable: ShardedCounter::new(),
        }
    }

    #[inline]
    pub(crate) fn failure(&self, kind: FailureKind) {
        self.failures[kind.index()].add(1);
    }
}

/// Counts a consumer keeps. Updated under the consumer queue's lock, which the
/// hand-off takes anyway, so they cost no extra synchronization.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Messages accepted into the buffer.
    pub received: u64,
    /// Messages handed to the handler or stream.
    pub delivered: u64,
    /// Messages accepted but then dropped: vetoed by an inbound interceptor, or
    /// still buffered when the consumer was unregistered (requests among them
    /// were failed with `NO_HANDLERS`).
    pub discarded: u64,
    /// Messages refused because the buffer was full (the sender got `Full`,
    /// or, for publish, the publish report counted it).
    pub refused_full: u64,
    /// Messages waiting in the buffer now.
    pub buffered: u64,
}

impl ConsumerStats {
    pub(crate) fn merge(&mut self, o: &ConsumerStats) {
        self.received += o.received;
        self.delivered += o.delivered;
        self.discarded += o.discarded;
        self.refused_full += o.refused_full;
        self.buffered += o.buffered;
    }
}

/// A point-in-time reading of the bus's metrics, for exporters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Point-to-point messages sent (`send` and `request`, replies excluded).
    pub sent: u64,
    /// Messages published.
    pub published: u64,
    /// Requests started.
    pub requests: u64,
    /// Requests still waiting for a reply.
    pub pending_replies: u64,
    /// Reply failures by kind, indexed like [`FailureKind::ALL`].
    pub reply_failures: [u64; 4],
    /// Messages refused before reaching any buffer (no handlers, all full, vetoed).
    pub undeliverable: u64,
    /// Totals over every consumer, live and unregistered.
    pub consumers: ConsumerStats,
    /// Consumers registered now.
    pub registered_consumers: u64,
}

impl MetricsSnapshot {
    /// Reply failures of one kind.
    pub fn reply_failures(&self, kind: FailureKind) -> u64 {
        self.reply_failures[kind.index()]
    }

    /// Messages accepted by consumers (`received`).
    pub fn received(&self) -> u64 {
        self.consumers.received
    }

    /// Messages handed to handlers or streams.
    pub fn delivered(&self) -> u64 {
        self.consumers.delivered
    }

    /// Messages discarded after acceptance plus those refused for a full buffer.
    pub fn discarded(&self) -> u64 {
        self.consumers.discarded + self.consumers.refused_full
    }

    /// Messages waiting in consumer buffers.
    pub fn pending(&self) -> u64 {
        self.consumers.buffered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// More threads than owned shards, some exiting (returning their slot)
    /// while others start: every increment is counted exactly once.
    #[test]
    fn sharded_counter_is_exact_across_many_threads() {
        let c = std::sync::Arc::new(ShardedCounter::new());
        let threads = shard_count() * 3;
        let per_thread = 10_000u64;
        for wave in 0..2 {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let c = c.clone();
                    std::thread::spawn(move || {
                        for _ in 0..per_thread {
                            c.add(1);
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().expect("counting thread");
            }
            assert_eq!(c.get(), (wave + 1) * threads as u64 * per_thread);
        }
    }
}
