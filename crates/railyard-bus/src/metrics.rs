//! Counters the bus keeps, and the snapshot an exporter reads.
//!
//! Counters bumped on every message are sharded per thread ([`ShardedCounter`]):
//! each thread adds to its own cache line, so two cores sending at full speed
//! never fight over one. A snapshot sums the shards; it is exact for counters
//! that only grow and a close reading for gauges derived from them.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

use crate::FailureKind;

/// A counter split into per-thread cache lines.
pub(crate) struct ShardedCounter {
    shards: Box<[CachePadded<AtomicU64>]>,
}

static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's shard, assigned round-robin at first use.
    static SHARD: usize = NEXT_SHARD.fetch_add(1, Ordering::Relaxed);
}

/// This thread's shard number (callers mask it to their shard count).
#[inline]
pub(crate) fn thread_shard() -> usize {
    SHARD.with(|s| *s)
}

/// Shards per counter: four per core, so that the few hot threads of a
/// process (event loops, runtime workers), numbered in order of first use,
/// rarely land on the same cache line. A power of two, for masking.
pub(crate) fn shard_count() -> usize {
    (std::thread::available_parallelism().map_or(4, |n| n.get()) * 4)
        .next_power_of_two()
        .clamp(4, 256)
}

impl ShardedCounter {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..shard_count())
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
        }
    }

    #[inline]
    pub(crate) fn add(&self, n: u64) {
        let i = thread_shard() & (self.shards.len() - 1);
        self.shards[i].fetch_add(n, Ordering::Relaxed);
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
