//! Counters the cluster keeps, for logs and the Prometheus exporter.

use std::sync::atomic::{AtomicU64, Ordering};

/// A monotonic counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// Current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Per-node transport counters (summed over all links).
#[derive(Debug, Default)]
pub struct ClusterCounters {
    /// Connections established.
    pub connects: Counter,
    /// Connections lost (not counting closes because a peer left).
    pub disconnects: Counter,
    /// Frames written.
    pub frames_out: Counter,
    /// Frames read.
    pub frames_in: Counter,
    /// Bytes written.
    pub bytes_out: Counter,
    /// Bytes read.
    pub bytes_in: Counter,
    /// Connections closed because the peer sent a malformed frame.
    pub malformed: Counter,
    /// Messages refused because a link's queue was full.
    pub link_full: Counter,
    /// Requests failed early because their peer was lost.
    pub failed_on_loss: Counter,
    /// Bodies no codec could encode, or too large for one frame.
    pub encode_failures: Counter,
    /// Answers dropped because the connection their request came on had
    /// ended (the peer failed that request when it did).
    pub stale_answers: Counter,
    /// Queued requests not sent because their requester had already been
    /// told they failed (the link dropped while they waited).
    pub unsent_failed: Counter,
    /// Times a connection's reader paused because the peer had asked more
    /// requests than `max_in_flight` (plus a slack for pongs) without
    /// reading the answers; a peer that follows the protocol never causes it.
    pub answer_pauses: Counter,
    /// Bodies that could not be decoded.
    pub decode_failures: Counter,
    /// Sends from other nodes that found no local consumer.
    pub inbound_undelivered: Counter,
    /// Times the cluster store became unreachable.
    pub store_outages: Counter,
}
