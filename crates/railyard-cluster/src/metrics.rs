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
    /// Messages refused because a link's queue was full, or requests
    /// because `max_in_flight` were pending on it.
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
    /// Times a connection's reader paused because `max_in_flight` (plus a
    /// slack for pongs) answers for the peer waited to be written: the peer
    /// asks more than its limit, or does not read.
    pub answer_pauses: Counter,
    /// Bodies that could not be decoded.
    pub decode_failures: Counter,
    /// Sends from other nodes that found no local consumer.
    pub inbound_undelivered: Counter,
    /// Times the cluster store became unreachable.
    pub store_outages: Counter,
}

impl ClusterCounters {
    /// Every counter with its exported name (without the `railyard_cluster_`
    /// prefix and `_total` suffix) and help text, for exporters.
    pub fn all(&self) -> [(&'static str, &'static str, &Counter); 16] {
        [
            ("connects", "Link connections established", &self.connects),
            (
                "disconnects",
                "Link connections lost (not counting peers that left)",
                &self.disconnects,
            ),
            (
                "frames_out",
                "Frames written to other nodes",
                &self.frames_out,
            ),
            ("frames_in", "Frames read from other nodes", &self.frames_in),
            ("out_bytes", "Bytes written to other nodes", &self.bytes_out),
            ("in_bytes", "Bytes read from other nodes", &self.bytes_in),
            (
                "malformed",
                "Connections closed for a malformed frame",
                &self.malformed,
            ),
            (
                "link_full",
                "Messages refused: link queue full or max requests in flight",
                &self.link_full,
            ),
            (
                "failed_on_loss",
                "Requests failed early because their node was lost",
                &self.failed_on_loss,
            ),
            (
                "encode_failures",
                "Bodies that could not be encoded or exceeded the frame limit",
                &self.encode_failures,
            ),
            (
                "decode_failures",
                "Bodies from other nodes that could not be decoded",
                &self.decode_failures,
            ),
            (
                "stale_answers",
                "Answers dropped because their connection had ended",
                &self.stale_answers,
            ),
            (
                "unsent_failed",
                "Queued requests not sent because they had already failed",
                &self.unsent_failed,
            ),
            (
                "answer_pauses",
                "Times reading from a peer paused until answers to it were written",
                &self.answer_pauses,
            ),
            (
                "inbound_undelivered",
                "Sends from other nodes that found no local consumer",
                &self.inbound_undelivered,
            ),
            (
                "store_outages",
                "Times the cluster store (etcd) became unreachable",
                &self.store_outages,
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_is_listed_once_under_its_own_name() {
        let k = ClusterCounters::default();
        k.answer_pauses.add(3);
        let all = k.all();
        let mut names: Vec<&str> = all.iter().map(|(n, _, _)| *n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len(), "a name is listed twice");
        let (_, _, c) = all.iter().find(|(n, _, _)| *n == "answer_pauses").unwrap();
        assert_eq!(c.get(), 3);
        // Each entry refers to a different counter.
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert!(
                    !std::ptr::eq(a.2, b.2),
                    "{} and {} share a counter",
                    a.0,
                    b.0
                );
            }
        }
    }
}
