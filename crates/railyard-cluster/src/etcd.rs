//! The etcd cluster manager.
//!
//! Keys, all under `/railyard/<cluster>/` and all attached to the node's
//! lease, so a node that dies disappears when its lease expires:
//! - `nodes/<node id>` = the node's transport address;
//! - `subs/<node id>/<address>` = how many public consumers the node has
//!   at `<address>`, in decimal (an empty or unreadable value, as nodes
//!   before 2026-11-28 wrote, counts as 1).
//!
//! A keep-alive task renews the lease every TTL/3. A follower task reads the
//! whole prefix once, then watches it from the next revision, applying each
//! event to a local copy that it publishes as the [`ClusterView`]. Applying
//! and copying run on a blocking thread, and watch responses that arrive
//! meanwhile are taken together into one published view (see `Follower`,
//! and `docs/cluster.md`, "How a view change reaches the routes"). If etcd
//! becomes unreachable, the view keeps its last contents with
//! `connected = false` (routes keep working) while both tasks retry with
//! backoff; if the lease expired meanwhile, the node re-registers itself and
//! its subscriptions under a new lease.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
    WatchResponse, WatchStream,
};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::manager::{
    check_node_id, BoxFuture, ClusterManager, ClusterView, ManagerError, NodeInfo,
};

/// How to reach etcd. Plain data with defaults.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// Client endpoints, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Cluster name; keys live under `/railyard/<cluster>/`.
    pub cluster: String,
    /// Lease TTL: how long a dead node's routes survive (default 5 s).
    pub lease_ttl: Duration,
    /// Deadline for each etcd call (default 3 s).
    pub op_timeout: Duration,
}

impl EtcdConfig {
    /// Defaults for `endpoints`.
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            cluster: "railyard".into(),
            lease_ttl: Duration::from_secs(5),
            op_timeout: Duration::from_secs(3),
        }
    }
}

/// A [`ClusterManager`] backed by etcd.
pub struct EtcdManager {
    client: Client,
    cfg: EtcdConfig,
    prefix: String,
    state: Arc<Mutex<State>>,
    view_tx: Arc<watch::Sender<Arc<ClusterView>>>,
    view_rx: watch::Receiver<Arc<ClusterView>>,
    /// The follower's counts (tests read them).
    tally: Arc<Tally>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Default)]
struct State {
    node: Option<NodeInfo>,
    lease: i64,
    /// Our subscriptions and their consumer counts, to re-create under a
    /// new lease.
    subs: BTreeMap<String, u32>,
}

fn unavailable(e: impl std::fmt::Display) -> ManagerError {
    ManagerError::Unavailable(e.to_string())
}

impl EtcdManager {
    /// Connects to etcd.
    ///
    /// # Errors
    /// [`ManagerError::Unavailable`] if no endpoint answers.
    pub async fn connect(cfg: EtcdConfig) -> Result<Self, ManagerError> {
        let opts = ConnectOptions::new()
            .with_connect_timeout(cfg.op_timeout)
            .with_timeout(cfg.op_timeout)
            .with_keep_alive(Duration::from_secs(2), cfg.op_timeout)
            // etcd without a leader refuses calls and cancels watches,
            // instead of answering from a member cut off from the others:
            // the view is marked disconnected, as the issue asks of an
            // unreachable etcd.
            .with_require_leader(true);
        let client = tokio::time::timeout(
            cfg.op_timeout,
            Client::connect(cfg.endpoints.clone(), Some(opts)),
        )
        .await
        .map_err(|_| unavailable(format!("no answer from {:?}", cfg.endpoints)))?
        .map_err(unavailable)?;
        let prefix = format!("/railyard/{}/", cfg.cluster);
        let (view_tx, view_rx) = watch::channel(Arc::new(ClusterView::default()));
        Ok(Self {
            client,
            cfg,
            prefix,
            state: Arc::new(Mutex::new(State::default())),
            view_tx: Arc::new(view_tx),
            view_rx,
            tally: Arc::default(),
            tasks: Mutex::new(Vec::new()),
        })
    }

    fn node_key(&self, id: &str) -> String {
        format!("{}nodes/{id}", self.prefix)
    }

    fn sub_key(&self, id: &str, address: &str) -> String {
        format!("{}subs/{id}/{address}", self.prefix)
    }

    async fn with_timeout<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, ManagerError> {
        tokio::time::timeout(self.cfg.op_timeout, f)
            .await
            .map_err(|_| unavailable("etcd call timed out"))?
            .map_err(unavailable)
    }

    fn node_id(&self) -> Result<String, ManagerError> {
        self.state
            .lock()
            .node
            .as_ref()
            .map(|n| n.id.clone())
            .ok_or(ManagerError::Stopped)
    }
}

/// The most operations in one etcd transaction when (re-)registering
/// (etcd refuses more than `--max-txn-ops`, default 128).
const TXN_OPS: usize = 64;

/// Renews `lease` once; its TTL as etcd answered it (0 or less: gone).
///
/// etcd-client reports a lease that no longer exists as
/// `LeaseKeepAliveError("lease not found")`, not as a TTL-0 answer, but
/// reports a broken keep-alive channel the same way; so on that error ask
/// etcd whether the lease lives (TTL -1: gone, answered here as 0). Until
/// 2026-11-27 that error was taken for a passing failure, and a node whose
/// lease expired never registered again.
async fn renew_once(client: &Client, lease: i64) -> Result<i64, etcd_client::Error> {
    let mut c = client.clone();
    let renewed = async {
        let (mut keeper, mut stream) = c.lease_keep_alive(lease).await?;
        keeper.keep_alive().await?;
        stream.message().await
    }
    .await;
    match renewed {
        Ok(Some(r)) => Ok(r.ttl()),
        // The stream ended without an answer: says nothing of the lease
        // (taking it for lost would swap a live lease).
        Ok(None) => Err(etcd_client::Error::LeaseKeepAliveError(
            "the keep-alive stream ended without an answer".into(),
        )),
        // TTL -1: the lease is gone. etcd truncates the time left to whole
        // seconds, so a live lease with under a second left answers 0: a
        // failure to retry at once, not a loss.
        Err(etcd_client::Error::LeaseKeepAliveError(why)) => {
            match c.lease_time_to_live(lease, None).await?.ttl() {
                ttl if ttl < 0 => Ok(0),
                _ => Err(etcd_client::Error::LeaseKeepAliveError(format!(
                    "{why}; the lease lives"
                ))),
            }
        }
        Err(e) => Err(e),
    }
}

/// Registers the node and its subscriptions under `lease`, or under a fresh
/// lease if `lease` is 0.
///
/// The lease is published in `state` as soon as it is granted, so a
/// `subscribe` that runs meanwhile puts its key under it, and a
/// registration that fails midway is retried under the same lease while it
/// lives (the keep-alive loop renews it). The keys go in transactions of
/// [`TXN_OPS`], and the lease is renewed between them every half period:
/// one put at a time, a node with thousands of subscriptions outlived its new
/// lease before the last put, and started over for ever (until 2026-11-28).
async fn register(
    client: Client,
    cfg: &EtcdConfig,
    prefix: &str,
    state: &Mutex<State>,
    lease: i64,
) -> Result<i64, ManagerError> {
    let lease = if lease != 0 {
        lease
    } else {
        let ttl = i64::try_from(cfg.lease_ttl.as_secs().max(1)).unwrap_or(5);
        let mut c = client.clone();
        let lease = tokio::time::timeout(cfg.op_timeout, c.lease_grant(ttl, None))
            .await
            .map_err(|_| unavailable("lease grant timed out"))?
            .map_err(unavailable)?
            .id();
        state.lock().lease = lease;
        lease
    };
    let (node, subs) = {
        let s = state.lock();
        (s.node.clone().ok_or(ManagerError::Stopped)?, s.subs.clone())
    };
    // Each call here waits at most `period`, and the lease is renewed once
    // half a period passed since the last renewal, so a call that hangs to
    // its deadline still leaves time for the renewal after it.
    let period = renew_period(cfg);
    let call = call_deadline(cfg);
    let txn = |ops: Vec<TxnOp>| {
        let mut c = client.clone();
        async move {
            tokio::time::timeout(call, c.txn(Txn::new().and_then(ops)))
                .await
                .map_err(|_| unavailable("etcd transaction timed out"))?
                .map_err(unavailable)
                .map(drop)
        }
    };
    let with_lease = || Some(PutOptions::new().with_lease(lease));
    // The node's key first, in a transaction of its own.
    txn(vec![TxnOp::put(
        format!("{prefix}nodes/{}", node.id),
        node.addr.to_string(),
        with_lease(),
    )])
    .await?;
    let mut renewed = tokio::time::Instant::now();
    let subs: Vec<(String, u32)> = subs.into_iter().collect();
    for chunk in subs.chunks(TXN_OPS) {
        if renewed.elapsed() >= period / 2 {
            let ttl = tokio::time::timeout(call, renew_once(&client, lease))
                .await
                .map_err(|_| unavailable("lease renewal timed out"))?
                .map_err(unavailable)?;
            if ttl <= 0 {
                return Err(unavailable("the new lease expired while registering"));
            }
            renewed = tokio::time::Instant::now();
        }
        let keys: Vec<String> = chunk
            .iter()
            .map(|(a, _)| format!("{prefix}subs/{}/{a}", node.id))
            .collect();
        txn(keys
            .iter()
            .zip(chunk)
            .map(|(k, (_, n))| TxnOp::put(k.as_str(), n.to_string(), with_lease()))
            .collect())
        .await?;
        // Changed since the snapshot: a withdrawal's delete, or a `subscribe`
        // with a new count, may have run before this put, so it is done
        // again (each of them updates `subs` before its call, so one of the
        // two calls comes after this put).
        let changed: Vec<TxnOp> = {
            let s = state.lock();
            chunk
                .iter()
                .zip(&keys)
                .filter_map(|((a, n), k)| match s.subs.get(a) {
                    None => Some(TxnOp::delete(k.as_str(), None)),
                    Some(now) if now != n => {
                        Some(TxnOp::put(k.as_str(), now.to_string(), with_lease()))
                    }
                    Some(_) => None,
                })
                .collect()
        };
        if !changed.is_empty() {
            txn(changed).await?;
        }
    }
    Ok(lease)
}

/// How often the lease is renewed: a third of its TTL.
fn renew_period(cfg: &EtcdConfig) -> Duration {
    (cfg.lease_ttl / 3).max(Duration::from_millis(200))
}

/// How long one etcd call of the keep-alive loop (a renewal, a
/// registration's transaction) may wait for its answer: `op_timeout`, but at
/// most a renewal period, so after one call that hangs the next renewal
/// still starts, and has time to be answered, before the lease expires.
fn call_deadline(cfg: &EtcdConfig) -> Duration {
    cfg.op_timeout.min(renew_period(cfg))
}

/// The keep-alive loop's wait before its next attempt: a period while they
/// succeed; after a failure, another attempt soon (100 ms, doubling, at most
/// a period), not a whole period later. Until 2026-11-28 each attempt could
/// wait the whole `op_timeout` (3 s) and a failed one was followed by a full
/// period's wait: one slow answer lost a 5 s lease while etcd was healthy.
fn next_wait(cfg: &EtcdConfig, failures: u32) -> Duration {
    let period = renew_period(cfg);
    if failures == 0 {
        return period;
    }
    Duration::from_millis(100)
        .saturating_mul(1 << failures.min(16).saturating_sub(1))
        .min(period)
}

/// Renews the lease; registers again, under a new lease, if it was lost,
/// and finishes a registration that failed midway.
async fn keep_alive(client: Client, cfg: EtcdConfig, prefix: String, state: Arc<Mutex<State>>) {
    let mut failures = 0u32;
    // Whether the keys under the current lease are all there (`join`
    // registered them before this task started).
    let mut complete = true;
    loop {
        tokio::time::sleep(next_wait(&cfg, failures)).await;
        let lease = state.lock().lease;
        let renewed = tokio::time::timeout(call_deadline(&cfg), renew_once(&client, lease)).await;
        let lost = match renewed {
            Ok(Ok(ttl)) if ttl > 0 => false,
            Ok(Ok(_)) => {
                tracing::warn!("etcd lease expired; registering the node again");
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "etcd keep-alive failed; will retry");
                failures += 1;
                continue;
            }
            Err(_) => {
                tracing::warn!("etcd keep-alive timed out; will retry");
                failures += 1;
                continue;
            }
        };
        if !lost && complete {
            failures = 0;
            continue;
        }
        let under = if lost { 0 } else { lease };
        match register(client.clone(), &cfg, &prefix, &state, under).await {
            Ok(_) => {
                complete = true;
                failures = 0;
            }
            Err(e) => {
                tracing::warn!(error = %e, "registering with etcd failed; will retry");
                complete = false;
                failures += 1;
            }
        }
    }
}

/// Applies one key to `view`; `put` false means deleted.
fn apply_key(view: &mut ClusterView, prefix: &str, key: &[u8], value: &[u8], put: bool) {
    let Ok(key) = std::str::from_utf8(key) else {
        return;
    };
    let Some(rest) = key.strip_prefix(prefix) else {
        return;
    };
    if let Some(id) = rest.strip_prefix("nodes/") {
        if put {
            match std::str::from_utf8(value).ok().and_then(|v| v.parse().ok()) {
                Some(addr) => {
                    view.members.insert(id.to_owned(), addr);
                }
                None => tracing::warn!(node = id, "ignoring a node key with a bad address"),
            }
        } else {
            view.members.remove(id);
        }
    } else if let Some(sub) = rest.strip_prefix("subs/") {
        let Some((node, address)) = sub.split_once('/') else {
            return;
        };
        if put {
            let consumers = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse::<u32>().ok())
                .unwrap_or(1)
                .max(1);
            view.subscriptions
                .entry(address.to_owned())
                .or_default()
                .insert(node.to_owned(), consumers);
        } else if let Some(s) = view.subscriptions.get_mut(address) {
            s.remove(node);
            if s.is_empty() {
                view.subscriptions.remove(address);
            }
        }
    }
}

/// The most watch responses taken into one view change: responses keep
/// arriving during a long burst, and the view should still move on.
const MAX_BATCH: usize = 1024;

/// What the follower has done since it started; tests compare the two.
#[derive(Default)]
struct Tally {
    /// Watch responses read that carried events.
    responses: AtomicU64,
    /// Views published.
    published: AtomicU64,
}

/// The follower's own copy of the view, and where it publishes copies of it.
///
/// Each change is applied to the copy, and the copy cloned and published, on
/// a blocking thread, one change at a time; watch responses that arrive
/// meanwhile wait, and are taken together into the next change. The clone
/// is a deep copy (every address and its set of node ids), which takes
/// milliseconds for thousands of addresses: too long for an async worker,
/// once per watch response. So the async side only reads responses, and a
/// burst of N responses costs at most one copy per copy's duration (copies
/// follow one another, and all the responses that arrived during one go
/// into the next), never more than N. What is left is one deep copy per
/// published view, on a blocking thread, which also drops the view it
/// replaces if nothing else holds it (as costly); the node that receives
/// the view walks all of it on a blocking thread too. A change under way
/// when the follower is aborted (`leave`) is still published.
///
/// Not chosen: sharing structure between views (an `Arc` per address's node
/// set still copies every address per view, on the worker; a persistent map
/// crate, which is not in the dependency tree, would put a third-party map
/// in the public `ClusterView` that every manager and test builds), and
/// publishing at most once per interval (it delays every change, and each
/// publish would still be a deep copy on the worker).
struct Follower {
    prefix: Arc<str>,
    tx: Arc<watch::Sender<Arc<ClusterView>>>,
    tally: Arc<Tally>,
    /// Empty only while a change is being applied on a blocking thread.
    view: ClusterView,
}

/// Why the follower's read or watch stopped.
enum Stop {
    /// etcd failed or ended the watch: keep the view, start over.
    Lost(String),
    /// The runtime is shutting down: the follower ends.
    ShuttingDown,
}

impl From<String> for Stop {
    fn from(reason: String) -> Self {
        Stop::Lost(reason)
    }
}

impl Follower {
    /// Runs `change` on the view, then publishes a copy, on a blocking thread.
    async fn publish(
        &mut self,
        change: impl FnOnce(&mut ClusterView, &str) + Send + 'static,
    ) -> Result<(), Stop> {
        let mut view = std::mem::take(&mut self.view);
        let (prefix, tx, tally) = (self.prefix.clone(), self.tx.clone(), self.tally.clone());
        let job = tokio::task::spawn_blocking(move || {
            change(&mut view, &prefix);
            // Counted first, so whoever sees the view sees it counted.
            tally.published.fetch_add(1, Ordering::Relaxed);
            // The view replaced is dropped here too, off the async workers.
            drop(tx.send_replace(Arc::new(view.clone())));
            view
        });
        match job.await {
            Ok(view) => {
                self.view = view;
                Ok(())
            }
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(Stop::ShuttingDown),
        }
    }

    /// Applies a batch of watch responses and publishes the result, unless
    /// they carry no event (as the response that confirms the watch).
    async fn apply(&mut self, batch: Vec<WatchResponse>) -> Result<(), Stop> {
        let with_events = batch.iter().filter(|r| !r.events().is_empty()).count();
        if with_events == 0 {
            return Ok(());
        }
        self.tally
            .responses
            .fetch_add(with_events as u64, Ordering::Relaxed);
        self.publish(move |view, prefix| {
            for ev in batch.iter().flat_map(|r| r.events()) {
                if let Some(kv) = ev.kv() {
                    let put = ev.event_type() == EventType::Put;
                    apply_key(view, prefix, kv.key(), kv.value(), put);
                }
            }
        })
        .await
    }
}

/// Why the watch stopped, or the response it delivered.
fn watched(
    message: Result<Option<WatchResponse>, etcd_client::Error>,
) -> Result<WatchResponse, String> {
    let resp = message
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "watch ended".to_string())?;
    if resp.canceled() {
        return Err(format!("watch canceled: {}", resp.cancel_reason()));
    }
    Ok(resp)
}

/// The stream's next message if it is already there, without waiting.
fn ready(stream: &mut WatchStream) -> Option<Result<Option<WatchResponse>, etcd_client::Error>> {
    use futures_util::FutureExt as _;
    // `message` is cancel safe: dropping it unfinished loses nothing.
    stream.message().now_or_never()
}

/// Keys per page of the full read.
const PAGE_KEYS: i64 = 1_000;

/// Every key under `prefix`, read in pages of [`PAGE_KEYS`] at one revision,
/// and that revision. One read of the whole prefix fails once its answer
/// passes etcd-client's 4 MiB decoding limit (some 40,000 subscriptions),
/// and a node would then never get a view (until 2026-11-28).
async fn read_all(
    c: &mut Client,
    prefix: &str,
    op_timeout: Duration,
) -> Result<(i64, Vec<etcd_client::KeyValue>), String> {
    // The end of the prefix's range: its last byte plus one ('/' + 1).
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    let mut from = prefix.as_bytes().to_vec();
    let mut revision = 0;
    let mut kvs = Vec::new();
    loop {
        let mut opts = GetOptions::new()
            .with_range(end.clone())
            .with_limit(PAGE_KEYS);
        if revision != 0 {
            opts = opts.with_revision(revision);
        }
        let mut resp = tokio::time::timeout(op_timeout, c.get(from.clone(), Some(opts)))
            .await
            .map_err(|_| "read timed out".to_string())?
            .map_err(|e| e.to_string())?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        let page = resp.take_kvs();
        // The next page starts just after this one's last key.
        let next = page.last().filter(|_| resp.more()).map(|last| {
            let mut key = last.key().to_vec();
            key.push(0);
            key
        });
        kvs.extend(page);
        match next {
            Some(key) => from = key,
            None => return Ok((revision, kvs)),
        }
    }
}

/// Keeps the view in step with etcd: full read, then watch; on failure keep
/// the last view (marked disconnected) and start over.
async fn follow(client: Client, op_timeout: Duration, mut f: Follower) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut c = client.clone();
        let outcome: Result<(), Stop> = async {
            let (revision, kvs) = read_all(&mut c, &f.prefix, op_timeout).await?;
            f.publish(move |view, prefix| {
                *view = ClusterView {
                    connected: true,
                    ..ClusterView::default()
                };
                for kv in &kvs {
                    apply_key(view, prefix, kv.key(), kv.value(), true);
                }
            })
            .await?;
            backoff = Duration::from_millis(100);
            let mut stream = c
                .watch(
                    &*f.prefix,
                    Some(
                        WatchOptions::new()
                            .with_prefix()
                            .with_start_revision(revision + 1),
                    ),
                )
                .await
                .map_err(|e| e.to_string())?;
            loop {
                let first = watched(stream.message().await)?;
                let mut batch = vec![first];
                // Whatever arrived while the last change was applied joins
                // this one. An error ends the watch after the batch so far.
                let mut end = None;
                while batch.len() < MAX_BATCH {
                    match ready(&mut stream).map(watched) {
                        None => break,
                        Some(Ok(resp)) => batch.push(resp),
                        Some(Err(e)) => {
                            end = Some(e);
                            break;
                        }
                    }
                }
                f.apply(batch).await?;
                if let Some(e) = end {
                    return Err(e.into());
                }
            }
        }
        .await;
        match outcome {
            Ok(()) | Err(Stop::ShuttingDown) => return,
            Err(Stop::Lost(e)) => {
                tracing::warn!(error = %e, "lost the etcd watch; keeping the last known view");
            }
        }
        if f.view.connected && f.publish(|view, _| view.connected = false).await.is_err() {
            return;
        }
        tokio::time::sleep(crate::link::jittered(backoff)).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

impl ClusterManager for EtcdManager {
    fn join(&self, node: NodeInfo) -> BoxFuture<'_, Result<(), ManagerError>> {
        Box::pin(async move {
            check_node_id(&node.id)?;
            self.state.lock().node = Some(node);
            register(self.client.clone(), &self.cfg, &self.prefix, &self.state, 0).await?;
            let mut tasks = self.tasks.lock();
            tasks.push(tokio::spawn(keep_alive(
                self.client.clone(),
                self.cfg.clone(),
                self.prefix.clone(),
                self.state.clone(),
            )));
            tasks.push(tokio::spawn(follow(
                self.client.clone(),
                self.cfg.op_timeout,
                Follower {
                    prefix: self.prefix.as_str().into(),
                    tx: self.view_tx.clone(),
                    tally: self.tally.clone(),
                    view: ClusterView::default(),
                },
            )));
            Ok(())
        })
    }

    fn leave(&self) -> BoxFuture<'_, Result<(), ManagerError>> {
        Box::pin(async move {
            let tasks: Vec<JoinHandle<()>> = self.tasks.lock().drain(..).collect();
            for t in &tasks {
                t.abort();
            }
            // An abort takes effect at the task's next await: a keep-alive
            // that is re-registering on another worker may still publish a
            // new lease and put the node's key under it. Waiting for the
            // tasks to end first means the lease taken below is the last
            // one, so the node is gone from etcd when `leave` returns, not
            // one TTL later. (A grant whose answer the abort dropped has no
            // keys; it expires unused.)
            for t in tasks {
                let _ = t.await;
            }
            let lease = {
                let mut s = self.state.lock();
                s.node = None;
                s.subs.clear();
                std::mem::take(&mut s.lease)
            };
            if lease != 0 {
                let mut c = self.client.clone();
                self.with_timeout(c.lease_revoke(lease)).await?;
            }
            Ok(())
        })
    }

    fn subscribe(&self, address: &str, consumers: u32) -> BoxFuture<'_, Result<(), ManagerError>> {
        let address = address.to_owned();
        let consumers = consumers.max(1);
        Box::pin(async move {
            // The node and its lease are read under one lock: between two
            // looks, a `leave` could clear both, and a put under lease 0 is
            // a key without a lease, which etcd keeps for ever.
            let (id, mut lease) = {
                let mut s = self.state.lock();
                let id = s.node.as_ref().ok_or(ManagerError::Stopped)?.id.clone();
                if s.lease == 0 {
                    // `join` has not been granted its lease yet.
                    return Err(unavailable(
                        "the node is still joining the cluster; subscribe once join has returned",
                    ));
                }
                s.subs.insert(address.clone(), consumers);
                (id, s.lease)
            };
            let mut c = self.client.clone();
            let key = self.sub_key(&id, &address);
            // If the node re-registered under a new lease while this put
            // was under way, its snapshot of `subs` may have missed this
            // address: put it again under the new lease (bounded: each
            // round needs another re-registration to repeat).
            // A put under a lease that expired fails; if the node has
            // registered under a new one meanwhile, it is put again too.
            let mut done = Ok(());
            for _ in 0..3 {
                let put = c.put(
                    key.clone(),
                    consumers.to_string(),
                    Some(PutOptions::new().with_lease(lease)),
                );
                done = self.with_timeout(put).await.map(|_| ());
                let now = {
                    let s = self.state.lock();
                    (s.subs.contains_key(&address) && s.lease != lease).then_some(s.lease)
                };
                match now {
                    Some(newer) => lease = newer,
                    None => break,
                }
            }
            done
        })
    }

    fn unsubscribe(&self, address: &str) -> BoxFuture<'_, Result<(), ManagerError>> {
        let address = address.to_owned();
        Box::pin(async move {
            let id = self.node_id()?;
            self.state.lock().subs.remove(&address);
            let mut c = self.client.clone();
            let key = self.sub_key(&id, &address);
            self.with_timeout(c.delete(key, None)).await.map(|_| ())
        })
    }

    fn view(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.view_rx.clone()
    }
}

impl Drop for EtcdManager {
    fn drop(&mut self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }
}

impl EtcdManager {
    /// The key under which this node is registered (for operators and tests).
    pub fn registration_key(&self) -> Option<String> {
        let id = self.state.lock().node.as_ref().map(|n| n.id.clone())?;
        Some(self.node_key(&id))
    }
}

#[cfg(test)]
impl EtcdManager {
    /// Watch responses with events the follower read, and views it
    /// published, so far.
    fn tally(&self) -> (u64, u64) {
        (
            self.tally.responses.load(Ordering::Relaxed),
            self.tally.published.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use tokio::task::JoinSet;

    use super::*;
    use crate::etcd_server::EtcdServer;

    /// With the default TTL and call deadline, a renewal that hangs is
    /// followed by another that starts before the lease expires, with time
    /// left for its answer; failures back off to at most a period.
    #[test]
    fn one_hung_renewal_does_not_lose_the_lease() {
        let cfg = EtcdConfig::new(Vec::new());
        let period = renew_period(&cfg);
        assert_eq!(next_wait(&cfg, 0), period);
        // Renewed at 0; the next attempt at `period` hangs to its deadline;
        // the retry starts after the first failure's wait.
        let retry_at = next_wait(&cfg, 0) + call_deadline(&cfg) + next_wait(&cfg, 1);
        assert!(
            retry_at + Duration::from_millis(500) < cfg.lease_ttl,
            "retry at {retry_at:?}, lease TTL {:?}",
            cfg.lease_ttl
        );
        assert!(next_wait(&cfg, 2) > next_wait(&cfg, 1));
        assert_eq!(next_wait(&cfg, 40), period);
        assert!(call_deadline(&cfg) <= period);
    }

    /// Writes `keys` (deletes them if `put` is false) from 8 tasks at once.
    async fn write_all(client: &Client, keys: Vec<String>, put: bool) {
        let mut tasks = JoinSet::new();
        for chunk in keys.chunks(keys.len().div_ceil(8)) {
            let (mut c, chunk) = (client.clone(), chunk.to_vec());
            tasks.spawn(async move {
                for key in chunk {
                    if put {
                        c.put(key, "", None).await.expect("put");
                    } else {
                        c.delete(key, None).await.expect("delete");
                    }
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("writer task");
        }
    }

    /// 520 subscription changes written while the follower cannot publish
    /// (its one blocking thread is taken, as by a long copy) end in exactly
    /// the view etcd holds, published as fewer views than watch responses
    /// carrying events (one view per such response without the coalescing).
    #[test]
    fn a_burst_of_watch_events_is_published_in_few_views() {
        // One blocking thread, so the test can hold the follower's next
        // change back while the burst arrives.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let etcd = EtcdServer::start().expect("etcd starts");
            let m = EtcdManager::connect(EtcdConfig::new(vec![etcd.endpoint()]))
                .await
                .expect("etcd reachable");
            let addr: std::net::SocketAddr = "127.0.0.1:7000".parse().expect("an address");
            m.join(NodeInfo {
                id: "n".into(),
                addr,
            })
            .await
            .expect("joins");
            let mut rx = m.view();
            tokio::time::timeout(
                Duration::from_secs(10),
                rx.wait_for(|v| v.members.contains_key("n")),
            )
            .await
            .expect("the view lists the node")
            .expect("follower running");

            // Address i is subscribed by two of three peers; the burst then
            // drops one subscriber of each even address, and the other one
            // too of each tenth (which so disappears).
            let sub =
                |peer: usize, i: usize| format!("/railyard/railyard/subs/peer-{peer}/addr-{i}");
            let puts: Vec<String> = (0..200)
                .flat_map(|i| [sub(i % 3, i), sub((i + 1) % 3, i)])
                .collect();
            let deletes: Vec<String> = (0..200)
                .step_by(2)
                .map(|i| sub(i % 3, i))
                .chain((0..200).step_by(10).map(|i| sub((i + 1) % 3, i)))
                .collect();
            assert_eq!(puts.len() + deletes.len(), 520);
            let mut expected = ClusterView {
                members: BTreeMap::from([("n".to_owned(), addr)]),
                connected: true,
                ..ClusterView::default()
            };
            for i in (0..200).filter(|i| i % 10 != 0) {
                let mut peers = BTreeMap::from([(format!("peer-{}", (i + 1) % 3), 1)]);
                if i % 2 == 1 {
                    peers.insert(format!("peer-{}", i % 3), 1);
                }
                expected.subscriptions.insert(format!("addr-{i}"), peers);
            }

            let (responses_before, published_before) = m.tally();
            let (taken_tx, taken_rx) = tokio::sync::oneshot::channel();
            let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
            let holder = tokio::task::spawn_blocking(move || {
                let _ = taken_tx.send(());
                let _ = release_rx.recv();
            });
            taken_rx.await.expect("the blocking thread is taken");
            write_all(&m.client, puts, true).await;
            write_all(&m.client, deletes, false).await;
            let in_etcd = m
                .client
                .clone()
                .get(
                    "/railyard/railyard/subs/",
                    Some(GetOptions::new().with_prefix().with_count_only()),
                )
                .await
                .expect("count");
            assert_eq!(in_etcd.count(), 400 - 120);
            release_tx.send(()).expect("holder waiting");
            holder.await.expect("holder");

            tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|v| **v == expected))
                .await
                .expect("the published view reaches etcd's state")
                .expect("follower running");
            let (responses, published) = m.tally();
            let (responses, published) =
                (responses - responses_before, published - published_before);
            println!("520 events: {responses} watch responses with events, {published} views");
            assert!(responses > 0);
            assert!(
                published < responses,
                "{published} views published for {responses} watch responses with events"
            );
        });
    }
}
