//! Topology refresh: the background task that keeps the slot table current.
//!
//! # Algorithm
//! - **Periodic rounds** (every `refresh_period`, if set) ask `sample_size`
//!   nodes, taken round-robin over all known nodes, what they see. Two kinds:
//!   - a **probe** (most rounds) asks for `CLUSTER INFO` and compares its
//!     summary (current epoch, known nodes, state, cluster size, slots
//!     assigned and failed) with the [`Baseline`]: the summaries the current
//!     table is known to cover. A higher epoch (every failover, and every
//!     finished slot migration that moves ownership past the highest epoch,
//!     raises it) asks for a full refresh at once. A shape the baseline does
//!     not list (a node joined, left or failed, or these nodes see the
//!     cluster differently from those sampled before) asks for a deep check
//!     of the same nodes: if their views are in the table, the shape joins
//!     the baseline, else a full refresh follows. A `CLUSTER INFO` reply is
//!     about 500 bytes (redis-server 7, 3 nodes): a probe reads about 1.5 KB
//!     at any cluster size, where a deep check at 1000 nodes reads about
//!     380 KB.
//!   - a **deep check** (every `deep_check_every`th round, with a cursor of
//!     its own) asks for `CLUSTER NODES` and fingerprints each reply on a
//!     blocking thread. If every fingerprint is one the current table was
//!     built from, nothing changed. It also sees what a summary does not: a
//!     slot reassigned without an epoch bump (`CLUSTER SETSLOT ... NODE` by
//!     hand), a node's address or flags.
//! - **Full refresh** (when a round sees a change, or on an adaptive trigger):
//!   ask every known node (and the seeds) for `CLUSTER NODES`, at most
//!   `refresh_concurrency` at a time. Replies stream to one blocking worker
//!   which fingerprints each and
//!   keeps one reply per distinct fingerprint with its vote count; only those
//!   few distinct views are parsed, and the table is built once by the
//!   consensus rule ([`crate::topology`]). The new table is swapped in with
//!   one atomic store; connection tasks never see a half-built table. The
//!   summaries that asked for it (read before any view) join the baseline.
//! - **Adaptive triggers** (MOVED, ASK, a redirect to an unknown node, an
//!   uncovered slot, a lost connection, repeated failed reconnects) wake the
//!   task at once, but full refreshes are at least `adaptive_min_interval`
//!   apart; triggers in between coalesce into one.
//!
//! Connection tasks only carry bytes: all parsing, hashing and building of
//! `CLUSTER NODES` runs in `spawn_blocking`, and its CPU time is counted in
//! [`RefreshStats`]. A `CLUSTER INFO` summary is parsed where it arrives, on
//! the topology thread (microseconds: a dozen short lines).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use bytes::Bytes;
use futures::stream::{self, StreamExt};
use tokio::sync::{mpsc, Notify};

use crate::client::Inner;
use crate::error::RedisError;
use crate::topology::{fingerprint, SlotTable, ViewTally};
use crate::value::{Cmd, Value};

/// Why an adaptive refresh was requested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Reason {
    /// A MOVED redirection.
    Moved = 1,
    /// An ASK redirection.
    Ask = 2,
    /// A redirection to a node the table does not list.
    UnknownNode = 4,
    /// A slot with no owner in the table.
    Uncovered = 8,
    /// Repeated failed reconnects to a node.
    Reconnects = 16,
    /// An established connection dropped.
    ConnectionLost = 32,
    /// A command got no answer in time: the node may be gone without a
    /// reset (powered off, partitioned), and its slots failed over.
    Timeout = 64,
}

#[derive(Debug, Default)]
struct TriggerInner {
    notify: Notify,
    reasons: AtomicU32,
    shutdown: AtomicBool,
}

/// Wakes the refresher; cheap to clone and to fire from anywhere.
#[derive(Debug, Clone, Default)]
pub(crate) struct Trigger(Arc<TriggerInner>);

impl Trigger {
    pub(crate) fn fire(&self, r: Reason) {
        self.0.reasons.fetch_or(r as u32, Ordering::Relaxed);
        self.0.notify.notify_one();
    }

    pub(crate) fn shutdown(&self) {
        self.0.shutdown.store(true, Ordering::Relaxed);
        self.0.notify.notify_one();
    }

    fn take(&self) -> u32 {
        self.0.reasons.swap(0, Ordering::Relaxed)
    }
}

/// Counters of the refresher's work.
#[derive(Debug, Default)]
pub(crate) struct StatsCells {
    checks: AtomicU64,
    probes: AtomicU64,
    full: AtomicU64,
    swaps: AtomicU64,
    failed: AtomicU64,
    adaptive: AtomicU64,
    check_cpu_ns: AtomicU64,
    full_cpu_ns: AtomicU64,
    last_full_cpu_ns: AtomicU64,
    last_full_wall_ns: AtomicU64,
    last_views: AtomicU64,
    last_distinct: AtomicU64,
    table_bytes: AtomicU64,
}

/// A snapshot of the refresher's counters.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct RefreshStats {
    /// Periodic deep checks run (whole `CLUSTER NODES` views compared).
    pub checks: u64,
    /// Periodic probes run (`CLUSTER INFO` summaries compared).
    #[serde(default)]
    pub probes: u64,
    /// Full refreshes run (initial, adaptive, or after a check saw a new view).
    pub full_refreshes: u64,
    /// Tables swapped in.
    pub swaps: u64,
    /// Refreshes that failed (no node answered).
    pub failed: u64,
    /// Full refreshes caused by adaptive triggers.
    pub adaptive: u64,
    /// CPU time of all checks' blocking work, ms.
    pub check_cpu_ms: f64,
    /// CPU time of all full refreshes' blocking work, ms.
    pub full_cpu_ms: f64,
    /// CPU time of the last full refresh's blocking work, ms.
    pub last_full_cpu_ms: f64,
    /// Wall time of the last full refresh (I/O included), ms.
    pub last_full_wall_ms: f64,
    /// Views the last full refresh received.
    pub last_views: u64,
    /// Distinct views among them.
    pub last_distinct_views: u64,
    /// Heap bytes of the current slot table.
    pub table_bytes: u64,
}

impl StatsCells {
    pub(crate) fn snapshot(&self) -> RefreshStats {
        let ms = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64 / 1e6;
        RefreshStats {
            checks: self.checks.load(Ordering::Relaxed),
            probes: self.probes.load(Ordering::Relaxed),
            full_refreshes: self.full.load(Ordering::Relaxed),
            swaps: self.swaps.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            adaptive: self.adaptive.load(Ordering::Relaxed),
            check_cpu_ms: ms(&self.check_cpu_ns),
            full_cpu_ms: ms(&self.full_cpu_ns),
            last_full_cpu_ms: ms(&self.last_full_cpu_ns),
            last_full_wall_ms: ms(&self.last_full_wall_ns),
            last_views: self.last_views.load(Ordering::Relaxed),
            last_distinct_views: self.last_distinct.load(Ordering::Relaxed),
            table_bytes: self.table_bytes.load(Ordering::Relaxed),
        }
    }
}

/// CPU time of the calling thread, in ns.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // Safety: `ts` is a valid, writable timespec and the clock id is a constant
    // the kernel knows; clock_gettime writes only into `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// What a full refresh built.
pub(crate) struct Built {
    pub(crate) table: SlotTable,
    cpu_ns: u64,
    views: u64,
    distinct: u64,
}

/// The blocking half of a full refresh: tallies replies as they arrive, then
/// builds the table.
fn build_from_stream(mut rx: mpsc::Receiver<(Arc<str>, Bytes)>) -> Result<Built, RedisError> {
    let start = thread_cpu_ns();
    let mut tally = ViewTally::default();
    while let Some((node, text)) = rx.blocking_recv() {
        tally.add(node, text);
    }
    match tally.finish() {
        Ok(t) => Ok(Built {
            table: t.table,
            cpu_ns: thread_cpu_ns().saturating_sub(start),
            views: t.views,
            distinct: t.distinct,
        }),
        Err((node, detail)) if &*node == "-" => Err(RedisError::NoSeed { detail }),
        Err((node, detail)) => Err(RedisError::Topology { node, detail }),
    }
}

/// The part of a node's `CLUSTER INFO` that describes the cluster's
/// configuration, without its epoch: message counters and `pfail` counts
/// (each node's own suspicions, which differ node to node) are left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    ok: bool,
    known_nodes: u64,
    size: Option<u64>,
    slots_assigned: Option<u64>,
    slots_fail: Option<u64>,
}

/// One node's `CLUSTER INFO`, reduced to what a probe compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Summary {
    /// `cluster_current_epoch`: the highest epoch the node knows of.
    epoch: u64,
    shape: Shape,
}

/// Reads a `CLUSTER INFO` reply. `cluster_state`, `cluster_current_epoch`
/// and `cluster_known_nodes` are required; the slot counts and the size are
/// compared when present.
pub(crate) fn parse_summary(text: &[u8]) -> Result<Summary, String> {
    let text = std::str::from_utf8(text).map_err(|_| "CLUSTER INFO is not UTF-8".to_owned())?;
    let (mut state, mut epoch, mut known) = (None, None, None);
    let mut shape = Shape {
        ok: false,
        known_nodes: 0,
        size: None,
        slots_assigned: None,
        slots_fail: None,
    };
    for line in text.lines() {
        let Some((key, value)) = line.trim_end_matches('\r').split_once(':') else {
            continue;
        };
        let num = || {
            value
                .trim()
                .parse::<u64>()
                .map_err(|_| format!("CLUSTER INFO {key} is not a number: {value:?}"))
        };
        match key {
            "cluster_state" => state = Some(value.trim() == "ok"),
            "cluster_current_epoch" => epoch = Some(num()?),
            "cluster_known_nodes" => known = Some(num()?),
            "cluster_size" => shape.size = Some(num()?),
            "cluster_slots_assigned" => shape.slots_assigned = Some(num()?),
            "cluster_slots_fail" => shape.slots_fail = Some(num()?),
            _ => {}
        }
    }
    let missing = |f: &str| format!("CLUSTER INFO has no {f}");
    shape.ok = state.ok_or_else(|| missing("cluster_state"))?;
    shape.known_nodes = known.ok_or_else(|| missing("cluster_known_nodes"))?;
    Ok(Summary {
        epoch: epoch.ok_or_else(|| missing("cluster_current_epoch"))?,
        shape,
    })
}

/// What `CLUSTER INFO` summaries the current table is known to cover: the
/// highest epoch read before a full refresh began (or confirmed by a deep
/// check of the nodes that reported it), and every shape read that way.
/// The epoch only rises: a full refresh that did not come from a probe
/// (adaptive, by hand) leaves it, at worst one refresh behind, which costs
/// one more refresh and never hides a change.
#[derive(Debug, Clone, Default)]
pub(crate) struct Baseline {
    epoch: u64,
    shapes: Vec<Shape>,
}

impl Baseline {
    fn from_summaries(seen: &[Summary]) -> Option<Self> {
        let epoch = seen.iter().map(|s| s.epoch).max()?;
        let mut shapes: Vec<Shape> = Vec::with_capacity(seen.len());
        for s in seen {
            if !shapes.contains(&s.shape) {
                shapes.push(s.shape);
            }
        }
        Some(Self { epoch, shapes })
    }

    /// Adds summaries the table is known to cover: the epoch only rises,
    /// shapes accumulate (up to [`MAX_SHAPES`]; past that, the list starts
    /// over from these).
    fn absorb(slot: &mut Option<Self>, seen: &[Summary]) {
        let Some(new) = Self::from_summaries(seen) else {
            return;
        };
        let Some(b) = slot else {
            *slot = Some(new);
            return;
        };
        b.epoch = b.epoch.max(new.epoch);
        for shape in &new.shapes {
            if !b.shapes.contains(shape) {
                if b.shapes.len() >= MAX_SHAPES {
                    b.shapes = new.shapes;
                    return;
                }
                b.shapes.push(*shape);
            }
        }
    }

    /// Whether the node saying `s` knows of a change the table may not
    /// have. (A lower epoch is a node that has not heard of the latest
    /// change yet; the table already has it from the others.)
    fn is_newer(&self, s: &Summary) -> bool {
        s.epoch > self.epoch
    }

    /// Whether the table is known to cover `s`'s shape.
    fn knows_shape(&self, s: &Summary) -> bool {
        self.shapes.contains(&s.shape)
    }
}

/// Shapes a baseline keeps at most (a cluster whose nodes see it in more
/// ways than this keeps costing deep checks, never full refreshes).
const MAX_SHAPES: usize = 32;

async fn fetch_summary(inner: &Inner, addr: &Arc<str>) -> Result<Summary, RedisError> {
    let text = fetch_text(inner, addr, "INFO").await?;
    parse_summary(&text).map_err(|detail| RedisError::Topology {
        node: addr.clone(),
        detail,
    })
}

/// Asks each of `addrs` for its summary at once. `Err` if a node answered
/// something that is not a summary (then only deep checks can tell);
/// nodes that did not answer are left out.
async fn summaries(inner: &Inner, addrs: Vec<Arc<str>>) -> Result<Vec<Summary>, RedisError> {
    let k = addrs.len().max(1);
    let answers: Vec<Result<Summary, RedisError>> = stream::iter(addrs)
        .map(|a| async move { fetch_summary(inner, &a).await })
        .buffer_unordered(k)
        .collect()
        .await;
    let mut out = Vec::with_capacity(answers.len());
    for a in answers {
        match a {
            Ok(s) => out.push(s),
            Err(e @ RedisError::Topology { .. }) => return Err(e),
            Err(_) => {}
        }
    }
    Ok(out)
}

/// `sample_size` of `nodes`, from `cursor` on, round-robin; advances it.
fn sample(inner: &Inner, nodes: &[Arc<str>], cursor: &mut usize) -> Vec<Arc<str>> {
    let k = inner.cfg.sample_size.min(nodes.len());
    let picked = (0..k)
        .map(|i| nodes[(*cursor + i) % nodes.len()].clone())
        .collect();
    *cursor = (*cursor + k) % nodes.len().max(1);
    picked
}

async fn fetch_view(inner: &Inner, addr: &Arc<str>) -> Result<Bytes, RedisError> {
    fetch_text(inner, addr, "NODES").await
}

/// `CLUSTER <sub>` on `addr`'s topology connection, whose answer is text.
async fn fetch_text(inner: &Inner, addr: &Arc<str>, sub: &str) -> Result<Bytes, RedisError> {
    let conn = inner.topo_conn(addr);
    let cmd = Cmd::new("CLUSTER").arg(sub);
    let topology = |detail: String| RedisError::Topology {
        node: addr.clone(),
        detail,
    };
    match conn.request(&[&cmd], inner.cfg.command_timeout).await? {
        Value::Bulk(b) | Value::Status(b) => Ok(b),
        Value::Error(e) => Err(topology(e)),
        other => Err(topology(format!(
            "CLUSTER {sub} answered with {}",
            other.describe()
        ))),
    }
}

/// Runs a full refresh over `addrs` and swaps the result in. `seen`: the
/// summaries that showed a change, if a probe asked for this refresh; they
/// were read before any view, so the new table covers them and they join
/// the baseline.
pub(crate) async fn full_refresh(
    inner: &Inner,
    addrs: Vec<Arc<str>>,
    seen: Vec<Summary>,
) -> Result<(), RedisError> {
    let _turn = inner.full_refresh_turn.lock().await;
    let wall = Instant::now();
    let (tx, rx) = mpsc::channel::<(Arc<str>, Bytes)>(inner.cfg.refresh_concurrency);
    let worker = tokio::task::spawn_blocking(move || build_from_stream(rx));
    let mut errors = Vec::new();
    let mut replies = stream::iter(addrs)
        .map(|a| async move {
            let r = fetch_view(inner, &a).await;
            (a, r)
        })
        .buffer_unordered(inner.cfg.refresh_concurrency);
    while let Some((addr, r)) = replies.next().await {
        match r {
            Ok(text) => {
                if tx.send((addr, text)).await.is_err() {
                    break;
                }
            }
            Err(e) => errors.push(format!("{addr}: {e}")),
        }
    }
    drop(tx);
    let built = match worker.await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            inner.stats.failed.fetch_add(1, Ordering::Relaxed);
            return Err(match e {
                RedisError::NoSeed { .. } => RedisError::NoSeed {
                    detail: errors.join("; "),
                },
                e => e,
            });
        }
        Err(join) => {
            inner.stats.failed.fetch_add(1, Ordering::Relaxed);
            return Err(RedisError::Topology {
                node: "-".into(),
                detail: format!("the topology worker failed: {join}"),
            });
        }
    };
    let s = &inner.stats;
    s.full.fetch_add(1, Ordering::Relaxed);
    s.full_cpu_ns.fetch_add(built.cpu_ns, Ordering::Relaxed);
    s.last_full_cpu_ns.store(built.cpu_ns, Ordering::Relaxed);
    s.last_full_wall_ns
        .store(wall.elapsed().as_nanos() as u64, Ordering::Relaxed);
    s.last_views.store(built.views, Ordering::Relaxed);
    s.last_distinct.store(built.distinct, Ordering::Relaxed);
    s.table_bytes
        .store(built.table.heap_bytes() as u64, Ordering::Relaxed);
    tracing::debug!(
        views = built.views,
        distinct = built.distinct,
        cpu_us = built.cpu_ns / 1000,
        "redis topology refreshed"
    );
    inner.install(built.table);
    Baseline::absorb(&mut inner.baseline.lock(), &seen);
    s.swaps.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// What a deep check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Deep {
    /// Every sampled view is one `table` was built from.
    Current,
    /// A sampled view is new: a full refresh is due.
    Changed,
    /// Nobody answered (connection triggers handle dead nodes).
    Unknown,
}

/// A deep check of `sample_size` of `table`'s nodes from `cursor` on.
async fn check(inner: &Inner, table: &SlotTable, cursor: &mut usize) -> Deep {
    let nodes = table.nodes();
    if nodes.is_empty() {
        return Deep::Changed;
    }
    let picked = sample(inner, nodes, cursor);
    let k = picked.len();
    let texts: Vec<Bytes> = stream::iter(picked)
        .map(|a| async move { fetch_view(inner, &a).await.ok() })
        .buffer_unordered(k.max(1))
        .filter_map(|r| async move { r })
        .collect()
        .await;
    inner.stats.checks.fetch_add(1, Ordering::Relaxed);
    if texts.is_empty() {
        return Deep::Unknown;
    }
    let known: Vec<u64> = table.fingerprints().to_vec();
    let res = tokio::task::spawn_blocking(move || {
        let start = thread_cpu_ns();
        let all_known = texts
            .iter()
            .all(|t| fingerprint(t).is_ok_and(|fp| known.binary_search(&fp).is_ok()));
        (all_known, thread_cpu_ns().saturating_sub(start))
    })
    .await;
    match res {
        Ok((all_known, cpu)) => {
            inner.stats.check_cpu_ns.fetch_add(cpu, Ordering::Relaxed);
            if all_known {
                Deep::Current
            } else {
                Deep::Changed
            }
        }
        Err(_) => Deep::Changed,
    }
}

/// What a probe found.
enum Probe {
    /// Every summary is covered by the baseline (or nobody answered:
    /// connection triggers handle dead nodes).
    Unchanged,
    /// A node knows a higher epoch than the baseline: a full refresh is due.
    NewEpoch(Vec<Summary>),
    /// No higher epoch, but a shape the baseline does not list (a node
    /// joined or left, a master failed, or these nodes simply see the
    /// cluster differently from those sampled before, as a partitioned
    /// minority does for as long as the partition lasts).
    NewShape(Vec<Summary>),
    /// There is no baseline yet.
    NoBaseline(Vec<Summary>),
    /// A node answered something that is not a summary: only a deep check
    /// can tell.
    Unreadable,
}

/// A probe: compares sampled nodes' `CLUSTER INFO` with the baseline.
async fn probe(inner: &Inner, nodes: &[Arc<str>], cursor: &mut usize) -> Probe {
    let picked = sample(inner, nodes, cursor);
    let seen = summaries(inner, picked).await;
    inner.stats.probes.fetch_add(1, Ordering::Relaxed);
    let seen = match seen {
        Ok(seen) => seen,
        Err(e) => {
            tracing::debug!(error = %e, "a CLUSTER INFO probe could not be read; comparing whole views");
            return Probe::Unreadable;
        }
    };
    match &*inner.baseline.lock() {
        None => Probe::NoBaseline(seen),
        Some(b) if seen.iter().any(|s| b.is_newer(s)) => Probe::NewEpoch(seen),
        Some(b) if seen.iter().all(|s| b.knows_shape(s)) => Probe::Unchanged,
        Some(_) => Probe::NewShape(seen),
    }
}

/// Where periodic rounds sample next: probes and deep checks each go
/// round-robin over all nodes on their own, so that neither keeps sampling
/// the same few when the counts line up.
#[derive(Debug, Default)]
struct Cursors {
    probe: usize,
    deep: usize,
}

/// One periodic round: `Some(summaries that showed the change)` when a full
/// refresh is due.
async fn round(inner: &Inner, round: u32, cursors: &mut Cursors) -> Option<Vec<Summary>> {
    let table = inner.table.load_full();
    if round % inner.cfg.deep_check_every.max(1) == 0 {
        let found = check(inner, &table, &mut cursors.deep).await;
        return (found == Deep::Changed).then(Vec::new);
    }
    if table.nodes().is_empty() {
        return Some(Vec::new());
    }
    let at = cursors.probe;
    let probed = probe(inner, table.nodes(), &mut cursors.probe).await;
    // A deep check of the nodes just probed: if their views are in the
    // table, so is what they summarized.
    let mut same = at;
    match probed {
        Probe::Unchanged => None,
        Probe::NewEpoch(seen) => Some(seen),
        Probe::Unreadable => {
            let found = check(inner, &table, &mut same).await;
            (found == Deep::Changed).then(Vec::new)
        }
        Probe::NewShape(seen) | Probe::NoBaseline(seen) => {
            match check(inner, &table, &mut same).await {
                Deep::Changed => Some(seen),
                Deep::Unknown => None,
                Deep::Current => {
                    // Unless a refresh swapped the table meanwhile (it may
                    // have read its views before these summaries).
                    if Arc::ptr_eq(&inner.table.load_full(), &table) {
                        Baseline::absorb(&mut inner.baseline.lock(), &seen);
                    }
                    None
                }
            }
        }
    }
}

/// The refresher task. Holds only a weak reference: it ends when the client
/// is dropped (which also fires [`Trigger::shutdown`]).
pub(crate) async fn run(weak: Weak<Inner>, trigger: Trigger) {
    let mut cursors = Cursors::default();
    let mut rounds = 0u32;
    let mut last_full = Instant::now();
    let (period, min_interval, adaptive_on) = match weak.upgrade() {
        Some(i) => (
            i.cfg.refresh_period,
            i.cfg.adaptive_min_interval,
            i.cfg.adaptive,
        ),
        None => return,
    };
    let mut ticker = period.map(|p| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + p, p);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    loop {
        let adaptive = tokio::select! {
            _ = async { ticker.as_mut().expect("guarded by the if").tick().await }, if ticker.is_some() => false,
            () = trigger.0.notify.notified() => true,
        };
        if trigger.0.shutdown.load(Ordering::Relaxed) {
            return;
        }
        if adaptive && !adaptive_on {
            // Connection tasks fire triggers regardless of the setting.
            trigger.take();
            continue;
        }
        if adaptive {
            // Rate limit: wait out the rest of the interval, coalescing triggers.
            let since = last_full.elapsed();
            if since < min_interval {
                tokio::time::sleep(min_interval - since).await;
            }
            if trigger.0.shutdown.load(Ordering::Relaxed) {
                return;
            }
        }
        let Some(inner) = weak.upgrade() else { return };
        // `Some(summaries that showed the change)` when a full refresh is due.
        let need_full = if adaptive {
            let reasons = trigger.take();
            if reasons == 0 {
                // A stale wake-up whose triggers the last refresh answered.
                continue;
            }
            tracing::debug!(reasons, "adaptive redis topology refresh");
            inner.stats.adaptive.fetch_add(1, Ordering::Relaxed);
            Some(Vec::new())
        } else {
            rounds = rounds.wrapping_add(1);
            round(&inner, rounds, &mut cursors).await
        };
        if let Some(seen) = need_full {
            let addrs = inner.refresh_targets();
            if let Err(e) = full_refresh(&inner, addrs, seen).await {
                tracing::warn!(error = %e, "redis topology refresh failed");
            }
            last_full = Instant::now();
            // Triggers fired by the refresh's own traffic are already answered.
            trigger.take();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `redis-server` 7.0 answers (a 3-master cluster).
    const REAL: &str = "cluster_state:ok\r\ncluster_slots_assigned:16384\r\ncluster_slots_ok:16384\r\n\
        cluster_slots_pfail:0\r\ncluster_slots_fail:0\r\ncluster_known_nodes:3\r\ncluster_size:3\r\n\
        cluster_current_epoch:3\r\ncluster_my_epoch:1\r\ncluster_stats_messages_ping_sent:4\r\n\
        cluster_stats_messages_sent:10\r\ntotal_cluster_links_buffer_limit_exceeded:0\r\n";

    fn with(from: &str, to: &str) -> Summary {
        parse_summary(REAL.replace(from, to).as_bytes()).unwrap()
    }

    /// A node saying `s` shows no change to `b`.
    fn covers(b: &Baseline, s: &Summary) -> bool {
        !b.is_newer(s) && b.knows_shape(s)
    }

    #[test]
    fn a_summary_keeps_the_configuration_and_drops_the_counters() {
        let s = parse_summary(REAL.as_bytes()).unwrap();
        assert_eq!(s.epoch, 3);
        assert!(s.shape.ok);
        assert_eq!(s.shape.known_nodes, 3);
        assert_eq!(s.shape.size, Some(3));
        assert_eq!(s.shape.slots_assigned, Some(16384));
        assert_eq!(s.shape.slots_fail, Some(0));
        // Message counters and each node's own suspicions do not count.
        assert_eq!(with("messages_sent:10", "messages_sent:99"), s);
        assert_eq!(with("cluster_slots_pfail:0", "cluster_slots_pfail:7"), s);
        assert_eq!(with("cluster_my_epoch:1", "cluster_my_epoch:2"), s);
    }

    #[test]
    fn a_reply_without_the_required_fields_is_a_typed_error() {
        let no_epoch = REAL.replace("cluster_current_epoch:3\r\n", "");
        assert!(parse_summary(no_epoch.as_bytes())
            .unwrap_err()
            .contains("cluster_current_epoch"));
        assert!(parse_summary(b"-ERR nope").is_err());
        assert!(parse_summary(
            REAL.replace(":3\r\ncluster_size", ":x\r\ncluster_size")
                .as_bytes()
        )
        .unwrap_err()
        .contains("not a number"));
        assert!(parse_summary(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn the_baseline_covers_lagging_nodes_and_nothing_new() {
        let s = parse_summary(REAL.as_bytes()).unwrap();
        let b = Baseline::from_summaries(&[
            s,
            with("cluster_current_epoch:3", "cluster_current_epoch:2"),
        ])
        .unwrap();
        assert_eq!(b.epoch, 3);
        assert!(covers(&b, &s));
        // A node that has not heard of the last change yet.
        assert!(covers(
            &b,
            &with("cluster_current_epoch:3", "cluster_current_epoch:1")
        ));
        // A failover or a finished migration raised the epoch.
        assert!(!covers(
            &b,
            &with("cluster_current_epoch:3", "cluster_current_epoch:4")
        ));
        // A node joined; a master failed; the cluster went down.
        assert!(!covers(
            &b,
            &with("cluster_known_nodes:3", "cluster_known_nodes:4")
        ));
        assert!(!covers(
            &b,
            &with("cluster_slots_fail:0", "cluster_slots_fail:5461")
        ));
        assert!(!covers(&b, &with("cluster_state:ok", "cluster_state:fail")));
        assert!(Baseline::from_summaries(&[]).is_none());
    }

    #[test]
    fn absorbing_raises_the_epoch_only_and_keeps_shapes_up_to_the_cap() {
        let s = parse_summary(REAL.as_bytes()).unwrap();
        let mut b = None;
        Baseline::absorb(&mut b, &[]);
        assert!(b.is_none(), "nothing seen, nothing learned");
        Baseline::absorb(&mut b, &[s]);
        let joined = with("cluster_known_nodes:3", "cluster_known_nodes:4");
        let older = with("cluster_current_epoch:3", "cluster_current_epoch:1");
        Baseline::absorb(&mut b, &[joined, older]);
        let b1 = b.clone().unwrap();
        assert_eq!(b1.epoch, 3, "a lower epoch never lowers it");
        assert!(covers(&b1, &s) && covers(&b1, &joined));
        // Past the cap, the list starts over from what was just seen.
        for n in 0..MAX_SHAPES {
            let other = with(
                "cluster_known_nodes:3",
                &format!("cluster_known_nodes:{}", 100 + n),
            );
            Baseline::absorb(&mut b, &[other]);
        }
        let b2 = b.unwrap();
        assert!(b2.shapes.len() <= MAX_SHAPES);
        assert!(!covers(&b2, &s), "the oldest shapes went with the reset");
    }
}
