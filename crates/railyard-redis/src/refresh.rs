//! Topology refresh: the background task that keeps the slot table current.
//!
//! # Algorithm
//! - **Periodic check** (every `refresh_period`, if set): ask `sample_size`
//!   nodes, taken round-robin over all known nodes, for `CLUSTER NODES`, and
//!   fingerprint each reply on a blocking thread. If every fingerprint is one
//!   the current table was built from, nothing changed: done (this is the
//!   steady state, and costs a few small replies and a hash pass).
//! - **Full refresh** (when a sampled view is new, or on an adaptive trigger):
//!   ask every known node (and the seeds), at most `refresh_concurrency` at a
//!   time. Replies stream to one blocking worker which fingerprints each and
//!   keeps one reply per distinct fingerprint with its vote count; only those
//!   few distinct views are parsed, and the table is built once by the
//!   consensus rule ([`crate::topology`]). The new table is swapped in with
//!   one atomic store; connection tasks never see a half-built table.
//! - **Adaptive triggers** (MOVED, ASK, a redirect to an unknown node, an
//!   uncovered slot, a lost connection, repeated failed reconnects) wake the
//!   task at once, but full refreshes are at least `adaptive_min_interval`
//!   apart; triggers in between coalesce into one.
//!
//! Connection tasks only carry bytes: all parsing, hashing and building runs
//! in `spawn_blocking`, and its CPU time is counted in [`RefreshStats`].

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
    /// Periodic sampled checks run.
    pub checks: u64,
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

fn nodes_cmd() -> Cmd {
    Cmd::new("CLUSTER").arg("NODES")
}

async fn fetch_view(inner: &Inner, addr: &Arc<str>) -> Result<Bytes, RedisError> {
    let conn = inner.topo_conn(addr);
    match conn
        .request(&[&nodes_cmd()], inner.cfg.command_timeout)
        .await?
    {
        Value::Bulk(b) | Value::Status(b) => Ok(b),
        Value::Error(e) => Err(RedisError::Topology {
            node: addr.clone(),
            detail: e,
        }),
        other => Err(RedisError::Topology {
            node: addr.clone(),
            detail: format!("CLUSTER NODES answered with {}", other.describe()),
        }),
    }
}

/// Runs a full refresh over `addrs` and swaps the result in.
pub(crate) async fn full_refresh(inner: &Inner, addrs: Vec<Arc<str>>) -> Result<(), RedisError> {
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
    s.swaps.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// A periodic check: returns whether a full refresh is needed.
async fn check(inner: &Inner, cursor: &mut usize) -> bool {
    let table = inner.table.load_full();
    let nodes = table.nodes();
    if nodes.is_empty() {
        return true;
    }
    let k = inner.cfg.sample_size.min(nodes.len());
    let sample: Vec<Arc<str>> = (0..k)
        .map(|i| nodes[(*cursor + i) % nodes.len()].clone())
        .collect();
    *cursor = (*cursor + k) % nodes.len();
    let texts: Vec<Bytes> = stream::iter(sample)
        .map(|a| async move { fetch_view(inner, &a).await.ok() })
        .buffer_unordered(k.max(1))
        .filter_map(|r| async move { r })
        .collect()
        .await;
    inner.stats.checks.fetch_add(1, Ordering::Relaxed);
    if texts.is_empty() {
        // Nobody answered: connection triggers handle dead nodes.
        return false;
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
            !all_known
        }
        Err(_) => true,
    }
}

/// The refresher task. Holds only a weak reference: it ends when the client
/// is dropped (which also fires [`Trigger::shutdown`]).
pub(crate) async fn run(weak: Weak<Inner>, trigger: Trigger) {
    let mut cursor = 0usize;
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
        let need_full = if adaptive {
            let reasons = trigger.take();
            if reasons == 0 {
                // A stale wake-up whose triggers the last refresh answered.
                continue;
            }
            tracing::debug!(reasons, "adaptive redis topology refresh");
            inner.stats.adaptive.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            check(&inner, &mut cursor).await
        };
        if need_full {
            let addrs = inner.refresh_targets();
            if let Err(e) = full_refresh(&inner, addrs).await {
                tracing::warn!(error = %e, "redis topology refresh failed");
            }
            last_full = Instant::now();
            // Triggers fired by the refresh's own traffic are already answered.
            trigger.take();
        }
    }
}
