//! The etcd cluster manager.
//!
//! Keys, all under `/railyard/<cluster>/` and all attached to the node's
//! lease, so a node that dies disappears when its lease expires:
//! - `nodes/<node id>` = the node's transport address;
//! - `subs/<node id>/<address>` = empty: the node has a public consumer at
//!   `<address>`.
//!
//! A keep-alive task renews the lease every TTL/3. A follower task reads the
//! whole prefix once, then watches it from the next revision, applying each
//! event to a local copy that it publishes as the [`ClusterView`]. If etcd
//! becomes unreachable, the view keeps its last contents with
//! `connected = false` (routes keep working) while both tasks retry with
//! backoff; if the lease expired meanwhile, the node re-registers itself and
//! its subscriptions under a new lease.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
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
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Default)]
struct State {
    node: Option<NodeInfo>,
    lease: i64,
    /// Our subscriptions, to re-create under a new lease.
    subs: BTreeSet<String>,
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
            .with_keep_alive(Duration::from_secs(2), cfg.op_timeout);
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

/// Registers the node and its subscriptions under a fresh lease.
async fn register(
    mut client: Client,
    cfg: &EtcdConfig,
    prefix: &str,
    state: &Mutex<State>,
) -> Result<i64, ManagerError> {
    let ttl = i64::try_from(cfg.lease_ttl.as_secs().max(1)).unwrap_or(5);
    let lease = tokio::time::timeout(cfg.op_timeout, client.lease_grant(ttl, None))
        .await
        .map_err(|_| unavailable("lease grant timed out"))?
        .map_err(unavailable)?
        .id();
    let (node, subs) = {
        let s = state.lock();
        (s.node.clone().ok_or(ManagerError::Stopped)?, s.subs.clone())
    };
    let put = |key: String, value: String| {
        let mut c = client.clone();
        async move {
            tokio::time::timeout(
                cfg.op_timeout,
                c.put(key, value, Some(PutOptions::new().with_lease(lease))),
            )
            .await
            .map_err(|_| unavailable("put timed out"))?
            .map_err(unavailable)
            .map(|_| ())
        }
    };
    put(format!("{prefix}nodes/{}", node.id), node.addr.to_string()).await?;
    for a in subs {
        put(format!("{prefix}subs/{}/{a}", node.id), String::new()).await?;
    }
    state.lock().lease = lease;
    Ok(lease)
}

/// Renews the lease; re-registers under a new one if it was lost.
async fn keep_alive(client: Client, cfg: EtcdConfig, prefix: String, state: Arc<Mutex<State>>) {
    let period = (cfg.lease_ttl / 3).max(Duration::from_millis(200));
    let mut c = client.clone();
    loop {
        tokio::time::sleep(period).await;
        let lease = state.lock().lease;
        let alive = async {
            let (mut keeper, mut stream) = c.lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            Ok::<_, etcd_client::Error>(stream.message().await?.map(|r| r.ttl()))
        };
        match tokio::time::timeout(cfg.op_timeout, alive).await {
            Ok(Ok(Some(ttl))) if ttl > 0 => {}
            Ok(Ok(_)) => {
                tracing::warn!("etcd lease expired; registering the node again");
                if let Err(e) = register(client.clone(), &cfg, &prefix, &state).await {
                    tracing::warn!(error = %e, "re-registering with etcd failed; will retry");
                }
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "etcd keep-alive failed; will retry"),
            Err(_) => tracing::warn!("etcd keep-alive timed out; will retry"),
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
            view.subscriptions
                .entry(address.to_owned())
                .or_default()
                .insert(node.to_owned());
        } else if let Some(s) = view.subscriptions.get_mut(address) {
            s.remove(node);
            if s.is_empty() {
                view.subscriptions.remove(address);
            }
        }
    }
}

/// Keeps the view in step with etcd: full read, then watch; on failure keep
/// the last view (marked disconnected) and start over.
async fn follow(
    client: Client,
    prefix: String,
    op_timeout: Duration,
    tx: Arc<watch::Sender<Arc<ClusterView>>>,
) {
    let mut backoff = Duration::from_millis(100);
    let mut view = ClusterView::default();
    loop {
        let mut c = client.clone();
        let outcome: Result<(), String> = async {
            let resp = tokio::time::timeout(
                op_timeout,
                c.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
            )
            .await
            .map_err(|_| "read timed out".to_string())?
            .map_err(|e| e.to_string())?;
            let revision = resp.header().map_or(0, |h| h.revision());
            let mut fresh = ClusterView {
                connected: true,
                ..ClusterView::default()
            };
            for kv in resp.kvs() {
                apply_key(&mut fresh, &prefix, kv.key(), kv.value(), true);
            }
            view = fresh;
            tx.send_replace(Arc::new(view.clone()));
            backoff = Duration::from_millis(100);
            let mut stream = c
                .watch(
                    prefix.clone(),
                    Some(
                        WatchOptions::new()
                            .with_prefix()
                            .with_start_revision(revision + 1),
                    ),
                )
                .await
                .map_err(|e| e.to_string())?;
            loop {
                let Some(resp) = stream.message().await.map_err(|e| e.to_string())? else {
                    return Err("watch ended".into());
                };
                if resp.canceled() {
                    return Err(format!("watch canceled: {}", resp.cancel_reason()));
                }
                for ev in resp.events() {
                    if let Some(kv) = ev.kv() {
                        let put = ev.event_type() == EventType::Put;
                        apply_key(&mut view, &prefix, kv.key(), kv.value(), put);
                    }
                }
                tx.send_replace(Arc::new(view.clone()));
            }
        }
        .await;
        if let Err(e) = outcome {
            tracing::warn!(error = %e, "lost the etcd watch; keeping the last known view");
        }
        if view.connected {
            view.connected = false;
            tx.send_replace(Arc::new(view.clone()));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

impl ClusterManager for EtcdManager {
    fn join(&self, node: NodeInfo) -> BoxFuture<'_, Result<(), ManagerError>> {
        Box::pin(async move {
            check_node_id(&node.id)?;
            self.state.lock().node = Some(node);
            register(self.client.clone(), &self.cfg, &self.prefix, &self.state).await?;
            let mut tasks = self.tasks.lock();
            tasks.push(tokio::spawn(keep_alive(
                self.client.clone(),
                self.cfg.clone(),
                self.prefix.clone(),
                self.state.clone(),
            )));
            tasks.push(tokio::spawn(follow(
                self.client.clone(),
                self.prefix.clone(),
                self.cfg.op_timeout,
                self.view_tx.clone(),
            )));
            Ok(())
        })
    }

    fn leave(&self) -> BoxFuture<'_, Result<(), ManagerError>> {
        Box::pin(async move {
            for t in self.tasks.lock().drain(..) {
                t.abort();
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

    fn subscribe(&self, address: &str) -> BoxFuture<'_, Result<(), ManagerError>> {
        let address = address.to_owned();
        Box::pin(async move {
            let id = self.node_id()?;
            let lease = {
                let mut s = self.state.lock();
                s.subs.insert(address.clone());
                s.lease
            };
            let mut c = self.client.clone();
            let key = self.sub_key(&id, &address);
            self.with_timeout(c.put(key, "", Some(PutOptions::new().with_lease(lease))))
                .await
                .map(|_| ())
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
