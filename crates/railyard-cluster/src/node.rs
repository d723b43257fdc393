//! A bus joined to a cluster: listener, links, and the view follower.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use parking_lot::Mutex;
use railyard_bus::{BusError, ClusterHook, EventBus, RemoteNode};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::frame::{Frame, DEFAULT_MAX_FRAME, VERSION};
use crate::link::{Link, LinkConfig, Side};
use crate::manager::{ClusterManager, ClusterView, ManagerError, NodeInfo};
use crate::metrics::ClusterCounters;

/// How a node joins a cluster. Plain data with defaults; see each field.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// This node's id, unique in the cluster (no `/`).
    pub node_id: String,
    /// Cluster name: nodes only talk to nodes of the same cluster.
    pub cluster: String,
    /// Where the transport listens (port 0 picks a free one).
    pub listen: SocketAddr,
    /// The address other nodes dial; default: the listener's address.
    pub advertise: Option<SocketAddr>,
    /// Messages queued per peer link before `send` sees `Full` (default 65,536).
    pub link_queue: usize,
    /// Requests a link keeps unanswered at once (queued or sent, until the
    /// peer's answer is read; default 65,536). Beyond it `request` waits for
    /// room (or tries another node) as for a full queue. This is what bounds
    /// the answers a peer owes us, so it is also the limit this node holds
    /// its peers to: a connection whose peer asks more than this (plus a
    /// slack for pongs) before reading our answers is not read from until
    /// the answers are written.
    pub max_in_flight: usize,
    /// Largest frame accepted; a bigger one closes the connection (default 16 MiB).
    pub max_frame: usize,
    /// How often a link pings its peer (default 1 s).
    pub ping_interval: Duration,
    /// Silence after which a link is declared dead (default 3 s).
    pub ping_timeout: Duration,
    /// Longest wait between reconnect attempts (default 2 s).
    pub backoff_max: Duration,
}

impl ClusterConfig {
    /// Defaults for node `node_id` listening on `listen`.
    pub fn new(node_id: impl Into<String>, listen: SocketAddr) -> Self {
        Self {
            node_id: node_id.into(),
            cluster: "railyard".into(),
            listen,
            advertise: None,
            link_queue: 65_536,
            max_in_flight: 65_536,
            max_frame: DEFAULT_MAX_FRAME,
            ping_interval: Duration::from_secs(1),
            ping_timeout: Duration::from_secs(3),
            backoff_max: Duration::from_secs(2),
        }
    }
}

/// Reads a node's transport counters and cluster view; cheap to clone.
#[derive(Clone)]
pub struct ClusterObserver {
    counters: Arc<ClusterCounters>,
    manager: Arc<dyn ClusterManager>,
}

impl std::fmt::Debug for ClusterObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterObserver").finish_non_exhaustive()
    }
}

impl ClusterObserver {
    /// Transport counters.
    pub fn counters(&self) -> &ClusterCounters {
        &self.counters
    }

    /// The cluster as the node sees it now.
    pub fn view(&self) -> Arc<ClusterView> {
        self.manager.view().borrow().clone()
    }
}

/// Why a node could not join.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The transport could not listen.
    #[error("cannot listen on {addr}: {source}; pick another --cluster-port")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The cluster manager refused or is unreachable.
    #[error(transparent)]
    Manager(#[from] ManagerError),
}

/// A running cluster node. Dropping it stops its tasks; call
/// [`leave`](Self::leave) first to deregister cleanly (otherwise other nodes
/// drop it when its lease expires).
pub struct ClusterNode {
    inner: Arc<NodeInner>,
    tasks: Vec<JoinHandle<()>>,
}

struct NodeInner {
    bus: EventBus,
    manager: Arc<dyn ClusterManager>,
    cfg: Arc<LinkConfig>,
    node_id: String,
    addr: SocketAddr,
    links: Mutex<HashMap<String, Arc<Link>>>,
    /// Addresses we told the bus have remote nodes, to clear the stale ones.
    remote_addresses: Mutex<BTreeSet<String>>,
    counters: Arc<ClusterCounters>,
    max_frame: usize,
}

struct Hook {
    manager: Arc<dyn ClusterManager>,
}

impl ClusterHook for Hook {
    fn advertise(
        &self,
        address: &str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), BusError>> + Send>> {
        let (m, a) = (self.manager.clone(), address.to_owned());
        Box::pin(async move {
            m.subscribe(&a).await.map_err(|e| BusError::Cluster {
                reason: format!("could not advertise `{a}`: {e}"),
            })
        })
    }

    fn withdraw(&self, address: &str) {
        let (m, a) = (self.manager.clone(), address.to_owned());
        // Withdrawal is best effort: if it is lost, senders to this node get
        // NO_HANDLERS from it until the lease or a later update clears it.
        tokio::spawn(async move {
            if let Err(e) = m.unsubscribe(&a).await {
                tracing::warn!(address = %a, error = %e, "could not withdraw a subscription");
            }
        });
    }
}

impl ClusterNode {
    /// Joins `bus` to the cluster `manager` manages: listens, registers the
    /// node, advertises the bus's existing public consumers, and keeps the
    /// bus's remote routes in step with the cluster view.
    ///
    /// # Errors
    /// [`ClusterError`] when the listener cannot bind or the manager fails.
    pub async fn start(
        bus: EventBus,
        manager: Arc<dyn ClusterManager>,
        cfg: ClusterConfig,
    ) -> Result<ClusterNode, ClusterError> {
        let listener =
            TcpListener::bind(cfg.listen)
                .await
                .map_err(|source| ClusterError::Listen {
                    addr: cfg.listen,
                    source,
                })?;
        let local = listener
            .local_addr()
            .map_err(|source| ClusterError::Listen {
                addr: cfg.listen,
                source,
            })?;
        let addr = cfg.advertise.unwrap_or(local);
        manager
            .join(NodeInfo {
                id: cfg.node_id.clone(),
                addr,
            })
            .await?;
        let link_cfg = Arc::new(LinkConfig {
            node_id: cfg.node_id.clone(),
            cluster: cfg.cluster.clone(),
            queue: cfg.link_queue,
            max_in_flight: cfg.max_in_flight,
            max_frame: cfg.max_frame,
            ping_interval: cfg.ping_interval,
            ping_timeout: cfg.ping_timeout,
            backoff_max: cfg.backoff_max,
        });
        let inner = Arc::new(NodeInner {
            bus: bus.clone(),
            manager: manager.clone(),
            cfg: link_cfg,
            node_id: cfg.node_id.clone(),
            addr,
            links: Mutex::new(HashMap::new()),
            remote_addresses: Mutex::new(BTreeSet::new()),
            counters: Arc::new(ClusterCounters::default()),
            max_frame: cfg.max_frame,
        });
        let existing = bus.set_cluster_hook(Some(Arc::new(Hook {
            manager: manager.clone(),
        })));
        for address in existing {
            manager.subscribe(&address).await?;
        }
        let tasks = vec![
            tokio::spawn(accept_loop(inner.clone(), listener)),
            tokio::spawn(follow_view(inner.clone())),
        ];
        tracing::info!(node = %cfg.node_id, %addr, "joined the cluster");
        Ok(ClusterNode { inner, tasks })
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.inner.node_id
    }

    /// The address other nodes dial.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Transport counters.
    pub fn counters(&self) -> &ClusterCounters {
        &self.inner.counters
    }

    /// The cluster as this node sees it now.
    pub fn view(&self) -> Arc<ClusterView> {
        self.inner.manager.view().borrow().clone()
    }

    /// A handle that reads this node's counters and view for as long as it
    /// is kept (for a metrics exporter), without owning the node.
    pub fn observer(&self) -> ClusterObserver {
        ClusterObserver {
            counters: self.inner.counters.clone(),
            manager: self.inner.manager.clone(),
        }
    }

    /// Deregisters from the cluster and closes every link.
    ///
    /// # Errors
    /// [`ManagerError`] if the store could not be told (the lease then
    /// removes the node).
    pub async fn leave(self) -> Result<(), ManagerError> {
        self.inner.bus.set_cluster_hook(None);
        let r = self.inner.manager.leave().await;
        self.shutdown_links();
        r
    }

    fn shutdown_links(&self) {
        for t in &self.tasks {
            t.abort();
        }
        let links: Vec<Arc<Link>> = self.inner.links.lock().drain().map(|(_, l)| l).collect();
        for l in links {
            l.close();
        }
        for a in std::mem::take(&mut *self.inner.remote_addresses.lock()) {
            self.inner.bus.set_remote_nodes(&a, Vec::new());
        }
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.inner.bus.set_cluster_hook(None);
        self.shutdown_links();
    }
}

/// Accepts peer connections; each must start with a HELLO from a node of our
/// cluster that should dial us, else it is closed.
async fn accept_loop(inner: Arc<NodeInner>, listener: TcpListener) {
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cluster accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(Duration::from_secs(5), read_hello(stream, inner.max_frame))
                .await
            {
                Ok(Ok((stream, rest, node, cluster))) => {
                    if cluster != inner.cfg.cluster {
                        tracing::warn!(%from, %node, %cluster, "refusing a node of another cluster");
                        return;
                    }
                    let link = inner.link_for(&node, from);
                    if link.side() != Side::Accept {
                        tracing::warn!(%from, %node, "refusing a connection from a node we dial");
                        return;
                    }
                    link.hand_over(stream, rest);
                }
                Ok(Err(e)) => {
                    inner.counters.malformed.add(1);
                    tracing::warn!(%from, error = %e, "closing a cluster connection with a bad greeting");
                }
                Err(_) => {
                    tracing::warn!(%from, "closing a cluster connection that never said hello")
                }
            }
        });
    }
}

async fn read_hello(
    mut stream: TcpStream,
    max_frame: usize,
) -> Result<(TcpStream, BytesMut, String, String), String> {
    let mut buf = BytesMut::with_capacity(256);
    loop {
        match Frame::decode(&mut buf, max_frame.min(64 * 1024)) {
            Ok(Some(Frame::Hello {
                version,
                node,
                cluster,
            })) => {
                if version != VERSION {
                    return Err(format!("protocol version {version}, expected {VERSION}"));
                }
                // Frames the dialer wrote right after its HELLO (its first
                // PING, a batch) may share this read: the link parses them.
                stream.set_nodelay(true).map_err(|e| e.to_string())?;
                return Ok((stream, buf, node, cluster));
            }
            Ok(Some(other)) => return Err(format!("expected HELLO, got {other:?}")),
            Ok(None) => {}
            Err(e) => return Err(e.to_string()),
        }
        let n = stream.read_buf(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed before HELLO".into());
        }
    }
}

impl NodeInner {
    /// The link to `peer`, created on first need.
    fn link_for(&self, peer: &str, addr: SocketAddr) -> Arc<Link> {
        let mut links = self.links.lock();
        links
            .entry(peer.to_owned())
            .or_insert_with(|| {
                Link::start(
                    peer.to_owned(),
                    addr,
                    self.cfg.clone(),
                    self.bus.clone(),
                    self.counters.clone(),
                )
            })
            .clone()
    }

    /// Brings links and the bus's remote routes in line with `view`.
    fn apply(&self, view: &ClusterView) {
        // Links: one per live member other than us.
        let gone: Vec<Arc<Link>> = {
            let mut links = self.links.lock();
            let gone_ids: Vec<String> = links
                .keys()
                .filter(|id| !view.members.contains_key(*id))
                .cloned()
                .collect();
            gone_ids
                .into_iter()
                .filter_map(|id| links.remove(&id))
                .collect()
        };
        for (id, addr) in &view.members {
            if *id != self.node_id {
                self.link_for(id, *addr).set_addr(*addr);
            }
        }
        // Routes: every address with a live remote subscriber.
        let links = self.links.lock().clone();
        let mut now = BTreeSet::new();
        for (address, nodes) in &view.subscriptions {
            let remotes: Vec<Arc<dyn RemoteNode>> = nodes
                .iter()
                .filter(|n| **n != self.node_id)
                .filter_map(|n| links.get(n))
                .map(|l| l.clone() as Arc<dyn RemoteNode>)
                .collect();
            if !remotes.is_empty() {
                now.insert(address.clone());
                self.bus.set_remote_nodes(address, remotes);
            }
        }
        let before = std::mem::replace(&mut *self.remote_addresses.lock(), now.clone());
        for stale in before.difference(&now) {
            self.bus.set_remote_nodes(stale, Vec::new());
        }
        // Close links last, so no route points at a closed link for long.
        for l in gone {
            tracing::info!(peer = %l.id(), "node left the cluster; its requests failed");
            l.close();
        }
    }
}

/// Follows the manager's view for the node's lifetime.
async fn follow_view(inner: Arc<NodeInner>) {
    let mut rx = inner.manager.view();
    // `None` until the store was first reached: the manager's initial view
    // (before its first read) is not an outage.
    let mut connected: Option<bool> = None;
    loop {
        let view = rx.borrow_and_update().clone();
        match (connected, view.connected) {
            (Some(true), false) => {
                inner.counters.store_outages.add(1);
                tracing::warn!("cluster store unreachable: keeping the last known routes");
            }
            (Some(false), true) => tracing::info!("cluster store reachable again"),
            _ => {}
        }
        if view.connected || connected.is_some() {
            connected = Some(view.connected);
        }
        inner.apply(&view);
        if rx.changed().await.is_err() {
            return;
        }
    }
}
