//! The bounded request queue in front of a durable store's single writer,
//! and the settings both durable stores share.
//!
//! Every `append` and `finish` becomes one [`WriteRequest`] carrying a
//! oneshot. The writer (a thread of its own for either store) takes the
//! first waiting request, drains whatever else is already queued (up to a
//! batch size), writes all of it in one transaction, syncs once, then answers
//! every oneshot with the same result: that is the group commit.
//!
//! # Back-pressure
//! The queue holds at most `queue_capacity` requests. When it is full,
//! callers wait (asynchronously) in `append`/`finish` until the writer takes
//! a batch: nothing is dropped and memory stays bounded.
//!
//! # Cancel safety
//! Dropping an `append` future after it was queued does not withdraw the
//! request: the events may still be written. They were never acknowledged,
//! and recovery replays them idempotently, so that is safe.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};

use super::{SagaSummary, StoreError};
use crate::event::EventRecord;

/// How many finished-saga summaries a durable store keeps.
///
/// Pruning runs in the writer after a `finish` once enough new summaries
/// accumulated (a 1/64 slack of `max_summaries`, at least 1; 1,024 when
/// only `max_age_secs` is set), so the count may overshoot `max_summaries`
/// by that slack between prunes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Retention {
    /// Keep at most this many summaries, newest first (`None`: no limit).
    /// Default 100,000.
    pub max_summaries: Option<u64>,
    /// Drop summaries whose saga finished longer ago than this many seconds
    /// (`None`: no limit). Default 7 days.
    pub max_age_secs: Option<u64>,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            max_summaries: Some(100_000),
            max_age_secs: Some(7 * 24 * 3600),
        }
    }
}

impl Retention {
    /// Keeps everything (no pruning).
    pub fn keep_all() -> Self {
        Self {
            max_summaries: None,
            max_age_secs: None,
        }
    }

    /// Summaries finished since the last prune after which the next prune
    /// runs: 1/64 of the count limit (at least 1); with only an age limit,
    /// [`AGE_ONLY_SLACK`]; with neither, never.
    pub(crate) fn slack(&self) -> u64 {
        match (self.max_summaries, self.max_age_secs) {
            (Some(max), _) => (max / 64).max(1),
            (None, Some(_)) => AGE_ONLY_SLACK,
            (None, None) => u64::MAX,
        }
    }

    /// The `finished_ms` before which summaries are too old, if aged out.
    pub(crate) fn cutoff_ms(&self) -> Option<i64> {
        let age = Duration::from_secs(self.max_age_secs?);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Some(i64::try_from(now.saturating_sub(age).as_millis()).unwrap_or(i64::MAX))
    }
}

/// Finishes between prunes when only an age limits the summaries: a prune
/// is its own commit (one sync), so not after every finish; the age limit
/// is then exceeded by at most the summaries of 1,024 finishes.
const AGE_ONLY_SLACK: u64 = 1024;

/// What the writer is asked to do.
#[derive(Debug)]
pub(crate) enum WriteOp {
    /// Append events (in order); shared with the caller, which applies
    /// them once they are durable.
    Append(std::sync::Arc<Vec<EventRecord>>),
    /// Delete these sagas' events and keep their summaries.
    Finish(Vec<SagaSummary>),
}

impl WriteOp {
    /// Rows this op writes, to bound a batch.
    pub(crate) fn weight(&self) -> usize {
        match self {
            WriteOp::Append(e) => e.len().max(1),
            WriteOp::Finish(s) => s.len().max(1),
        }
    }

    /// About how many bytes this op writes (its variable-length fields and
    /// a fixed allowance per row), to bound a batch.
    pub(crate) fn bytes(&self) -> usize {
        const ROW: usize = 64;
        match self {
            WriteOp::Append(e) => e
                .iter()
                .map(|ev| {
                    ROW + ev.global_tx_id.len()
                        + ev.local_tx_id.len()
                        + ev.parent_tx_id.len()
                        + ev.service_name.len()
                        + ev.instance_id.len()
                        + ev.compensation_method.len()
                        + ev.retry_method.len()
                        + ev.payloads.len()
                })
                .sum(),
            WriteOp::Finish(s) => s
                .iter()
                .map(|x| ROW + x.global_tx_id.len() + x.service_name.len())
                .sum(),
        }
    }
}

/// Most bytes (as [`WriteOp::bytes`] counts them) one group commit takes
/// from the queue: 64 MiB.
///
/// A commit is written as one value per engine call (SQLite's segment
/// BLOB, PostgreSQL's segment `bytea`), and both engines refuse a value
/// near 1 GB: without this bound, a burst of large payloads from one
/// participant would fail the whole commit, and with it the other
/// participants' events that shared it. The request that crosses the bound
/// still joins the batch (it is its last), so a commit holds at most this
/// plus one request (a native frame or Omega message: 64 MiB at most); a
/// larger request taken first commits alone.
pub(crate) const MAX_BATCH_BYTES: usize = 64 << 20;

/// One group commit's requests: `first`, then whatever is already queued,
/// until `max_rows` rows or [`MAX_BATCH_BYTES`] bytes are reached (the
/// request that crosses a bound is the batch's last one).
pub(crate) fn take_batch(
    first: WriteRequest,
    rx: &mut mpsc::Receiver<WriteRequest>,
    max_rows: usize,
) -> Vec<WriteRequest> {
    let mut rows = first.op.weight();
    let mut bytes = first.op.bytes();
    let mut batch = vec![first];
    while rows < max_rows && bytes < MAX_BATCH_BYTES {
        match rx.try_recv() {
            Ok(req) => {
                rows += req.op.weight();
                bytes += req.op.bytes();
                batch.push(req);
            }
            Err(_) => break,
        }
    }
    batch
}

/// One queued request and where its result goes.
#[derive(Debug)]
pub(crate) struct WriteRequest {
    pub(crate) op: WriteOp,
    pub(crate) done: oneshot::Sender<Result<(), StoreError>>,
}

/// Queues `op` (waiting while the queue is full) and waits for the group
/// commit that includes it.
pub(crate) async fn submit(
    queue: &mpsc::Sender<WriteRequest>,
    op: WriteOp,
) -> Result<(), StoreError> {
    let (done, result) = oneshot::channel();
    queue
        .send(WriteRequest { op, done })
        .await
        .map_err(|_| StoreError::Closed)?;
    // The writer answers every request it took, success or failure; a
    // dropped sender means it stopped mid-batch (store shut down).
    result.await.unwrap_or(Err(StoreError::Closed))
}

/// Answers every request of a batch with (a copy of) `result`.
pub(crate) fn answer(batch: Vec<WriteRequest>, result: &Result<(), StoreError>) {
    for req in batch {
        let r = match result {
            Ok(()) => Ok(()),
            Err(e) => Err(copy_error(e)),
        };
        // The caller may have gone away (future dropped): nothing to tell.
        let _ = req.done.send(r);
    }
}

fn copy_error(e: &StoreError) -> StoreError {
    match e {
        StoreError::Engine(m) => StoreError::Engine(m.clone()),
        StoreError::Unavailable(m) => StoreError::Unavailable(m.clone()),
        StoreError::Corrupt(m) => StoreError::Corrupt(m.clone()),
        StoreError::Closed => StoreError::Closed,
    }
}

/// Default page size of `finished` when the query's limit is 0 (as in
/// [`MemoryStore`](super::MemoryStore)).
pub(crate) const DEFAULT_PAGE: usize = 100;

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn append(
        events: usize,
        payload: usize,
    ) -> (WriteRequest, oneshot::Receiver<Result<(), StoreError>>) {
        let ev = EventRecord {
            global_tx_id: "g".into(),
            payloads: Bytes::from(vec![0u8; payload]),
            ..EventRecord::default()
        };
        let (done, rx) = oneshot::channel();
        let op = WriteOp::Append(std::sync::Arc::new(
            std::iter::repeat_n(ev, events).collect(),
        ));
        (WriteRequest { op, done }, rx)
    }

    #[test]
    fn a_batch_stops_at_the_row_bound() {
        let (tx, mut rx) = mpsc::channel(16);
        for _ in 0..5 {
            tx.try_send(append(3, 0).0).unwrap();
        }
        let (first, _) = append(3, 0);
        // 3 + 3 + 3 + 3 = 12 rows reach 10: four requests.
        assert_eq!(take_batch(first, &mut rx, 10).len(), 4);
        // What is left is taken by the next batch.
        let next = rx.try_recv().unwrap();
        assert_eq!(take_batch(next, &mut rx, 10).len(), 2);
    }

    #[test]
    fn a_batch_stops_at_the_byte_bound_and_a_large_request_commits_alone() {
        let (tx, mut rx) = mpsc::channel(16);
        let big = MAX_BATCH_BYTES / 3;
        for _ in 0..5 {
            tx.try_send(append(1, big).0).unwrap();
        }
        let (first, _) = append(1, big);
        // Three requests of a third each reach the bound.
        assert_eq!(take_batch(first, &mut rx, usize::MAX).len(), 3);
        while rx.try_recv().is_ok() {}
        tx.try_send(append(1, 0).0).unwrap();
        let (huge, _) = append(1, MAX_BATCH_BYTES + 1);
        assert_eq!(take_batch(huge, &mut rx, usize::MAX).len(), 1);
    }
}
