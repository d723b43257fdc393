//! A bus joined to a cluster: listener, links, and the view follower.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use parking_lot::Mutex;
use railyard_bus::{Advertisement, BusError, ClusterHook, EventBus, RemoteNode};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::frame::{Frame, DEFAULT_MAX_FRAME, VERSION};
use crate::link::{Link, LinkConfig, Side};
use crate::manager::{check_node_id, ClusterManager, ClusterView, ManagerError, NodeInfo};
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
    /// The address other nodes dial; default: `advertise_host` (or the
    /// listener's address) with the port the listener got.
    pub advertise: Option<SocketAddr>,
    /// The host other nodes dial when `advertise` is not set, with the port
    /// the listener got (so a port picked by the system, `listen` port 0,
    /// is advertised on a reachable host rather than on `0.0.0.0`).
    pub advertise_host: Option<std::net::IpAddr>,
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
    /// How often a link pings its peer (default 1 s; above zero).
    pub ping_interval: Duration,
    /// Silence after which a link is declared dead (default 3 s; longer
    /// than `ping_interval`). Before the peer's first frame on a
    /// connection, the larger of this and `handshake_timeout`: the acceptor
    /// is silent during its handshake.
    pub ping_timeout: Duration,
    /// Longest wait between reconnect attempts (default 2 s; above zero).
    pub backoff_max: Duration,
    /// Time an accepted connection has to complete its handshake: send its
    /// HELLO and, if it names a node this node's view does not list yet,
    /// for the view to list it (a joining node may dial before the watch
    /// here delivered its registration). Past it the connection is closed;
    /// the dialer retries with backoff (default 5 s; above zero). A peer
    /// that should dial this node and has not connected within it is not
    /// chosen until it does.
    pub handshake_timeout: Duration,
    /// Accepted connections that may be in their handshake at once
    /// (default 256). Beyond it a new connection is closed at once, without
    /// reading from it; a dialer retries with backoff.
    pub max_handshakes: usize,
}

impl ClusterConfig {
    /// Defaults for node `node_id` listening on `listen`.
    pub fn new(node_id: impl Into<String>, listen: SocketAddr) -> Self {
        Self {
            node_id: node_id.into(),
            cluster: "railyard".into(),
            listen,
            advertise: None,
            advertise_host: None,
            link_queue: 65_536,
            max_in_flight: 65_536,
            max_frame: DEFAULT_MAX_FRAME,
            ping_interval: Duration::from_secs(1),
            ping_timeout: Duration::from_secs(3),
            backoff_max: Duration::from_secs(2),
            handshake_timeout: Duration::from_secs(5),
            max_handshakes: 256,
        }
    }

    /// Checks for settings a node cannot run with; [`ClusterNode::start`]
    /// calls it before it binds or joins.
    ///
    /// # Errors
    /// [`ClusterError::Config`] naming the first such setting: a zero
    /// `ping_interval` (every link's task would panic), a `ping_timeout` not
    /// longer than `ping_interval` (links would be declared dead between two
    /// pings, over and over), a zero `backoff_max` (a dial loop without a
    /// pause) or a zero `handshake_timeout` (every connection refused).
    pub fn check(&self) -> Result<(), ClusterError> {
        let bad = |setting, problem: String, fix| {
            Err(ClusterError::Config {
                setting,
                problem,
                fix,
            })
        };
        if self.ping_interval.is_zero() {
            return bad(
                "ping_interval",
                "is zero".into(),
                "set it above zero (default 1 s)",
            );
        }
        if self.ping_timeout <= self.ping_interval {
            return bad(
                "ping_timeout",
                format!(
                    "({:?}) is not longer than ping_interval ({:?}): links would be declared dead between two pings",
                    self.ping_timeout, self.ping_interval
                ),
                "set it to several ping intervals (default 3 s with a 1 s interval)",
            );
        }
        if self.backoff_max.is_zero() {
            return bad(
                "backoff_max",
                "is zero: a node would redial an unreachable peer without a pause".into(),
                "set it above zero (default 2 s)",
            );
        }
        if self.handshake_timeout.is_zero() {
            return bad(
                "handshake_timeout",
                "is zero: every connection from a peer would be refused".into(),
                "set it above zero (default 5 s)",
            );
        }
        Ok(())
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
    /// A [`ClusterConfig`] setting the node cannot run with (see
    /// [`ClusterConfig::check`]).
    #[error("cluster setting `{setting}` {problem}; {fix}")]
    Config {
        /// The field of [`ClusterConfig`].
        setting: &'static str,
        /// What is wrong with its value.
        problem: String,
        /// What to do about it.
        fix: &'static str,
    },
}

/// A running cluster node. Dropping it stops its tasks; call
/// [`leave`](Self::leave) first to deregister cleanly (otherwise other nodes
/// drop it when its lease expires).
pub struct ClusterNode {
    inner: Arc<NodeInner>,
    tasks: Vec<JoinHandle<()>>,
    /// The hook this node installed on the bus (removed at stop only if
    /// still the bus's).
    hook: Arc<dyn ClusterHook>,
}

struct NodeInner {
    bus: EventBus,
    manager: Arc<dyn ClusterManager>,
    cfg: Arc<LinkConfig>,
    node_id: String,
    addr: SocketAddr,
    links: Mutex<HashMap<String, Arc<Link>>>,
    /// Set by shutdown before it takes the routes lock and empties `links`:
    /// an `apply` that starts after it does nothing (one under way finishes
    /// first, and shutdown clears what it set), and a handshake task still
    /// running (they are not aborted) finds it under the links lock and
    /// makes no link, so none outlives the node.
    closed: std::sync::atomic::AtomicBool,
    /// What the bus's remote routes were last computed from (`None` before
    /// the first `apply` and after shutdown). Held through
    /// all of `apply` and by `close`, so a stopping node clears the
    /// routes and links of the last `apply` and no `apply` runs after it
    /// (without it, an `apply` under way could re-add both). Taken before
    /// `links`, never while holding it.
    routes: Mutex<Option<Basis>>,
    counters: Arc<ClusterCounters>,
    max_frame: usize,
    handshake_timeout: Duration,
}

/// The view and the links the bus's routes were computed from. An address's
/// remote nodes depend only on its subscribers and these links, so while the
/// links are the same, an address whose subscribers did not change keeps its
/// route without being recomputed.
struct Basis {
    view: Arc<ClusterView>,
    links: HashMap<String, Arc<Link>>,
}

/// Keeps the manager's subscriptions in step with the bus's public
/// consumers, one address at a time.
///
/// The bus calls `advertise` and `withdraw` under its registry lock, in the
/// order its registry changed; each call only records what the address
/// should be (`wanted`) and starts a reconcile. Reconciles of one address
/// run one after another (its `applied` lock) and each makes the manager
/// match `wanted` as it is when the reconcile runs, so a withdrawal that
/// is slow to reach the manager can no longer land after a later
/// registration and leave it unadvertised; a second registrant waits for
/// the first one's subscription instead of resolving before it.
///
/// Every registration waits for the manager, but only one that makes the
/// manager list this node at the address fails with it. Once the node is
/// listed, peers already route here: a new consumer count that the manager
/// cannot take now (etcd unreachable) is retried in the background, like a
/// withdrawal, and the registration resolves (the count only shapes how
/// peers share their sends).
#[derive(Clone)]
struct Hook {
    manager: Arc<dyn ClusterManager>,
    /// One slot per address subscribed, wanted, or being reconciled;
    /// removed once neither wanted nor subscribed.
    slots: Arc<Mutex<HashMap<String, Arc<Slot>>>>,
    /// The node's runtime: background updates (withdrawals, counts; see
    /// `reconcile_in_background`) are spawned on it, also when the last
    /// consumer is dropped on a thread outside any runtime.
    runtime: tokio::runtime::Handle,
}

struct Slot {
    /// How many public consumers the manager should list for this node (0:
    /// not subscribed); the bus's latest word.
    wanted: std::sync::atomic::AtomicU32,
    /// What the manager lists, as far as the last successful call says
    /// (`None`: unknown, a call failed or was dropped midway, so the next
    /// reconcile calls the manager whatever is wanted); held across each
    /// manager call.
    applied: tokio::sync::Mutex<Option<u32>>,
    /// Bumped by every change of `wanted`.
    changes: std::sync::atomic::AtomicU64,
    /// Whether the manager lists this node at the address at all, as far
    /// as the last successful call says (a failed call changes nothing: a
    /// count it could not replace is still the old one).
    listed: std::sync::atomic::AtomicBool,
    /// A background task is making the manager match `wanted` (a
    /// withdrawal, a smaller count, a count a registration could not
    /// write): a later change leaves it to that task (one retrying task per
    /// address, however often the address comes and goes during an
    /// outage).
    retrying: std::sync::atomic::AtomicBool,
}

/// A background update (see [`Slot::retrying`]) that fails because the
/// manager is unreachable is retried, 200 ms apart and doubling up to 5 s,
/// until it succeeds (or the manager stopped). Until a withdrawal lands,
/// peers may still send here for the address, and a plain send finds no
/// consumer (counted in `inbound_undelivered`). A warning is logged at this
/// attempt, then every `RETRY_WARN_EVERY` attempts.
const RETRY_WARN_AT: u32 = 8;
const RETRY_WARN_EVERY: u32 = 60;

impl Hook {
    /// # Panics
    /// Outside a tokio runtime (the node starts inside one).
    fn new(manager: Arc<dyn ClusterManager>) -> Self {
        Self {
            manager,
            slots: Arc::new(Mutex::new(HashMap::new())),
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// Records `wanted` (public consumers, 0: none) for `address` and
    /// returns its slot.
    fn want(&self, address: &str, wanted: usize) -> Arc<Slot> {
        let wanted = u32::try_from(wanted).unwrap_or(u32::MAX);
        let mut slots = self.slots.lock();
        let slot = slots
            .entry(address.to_owned())
            .or_insert_with(|| {
                Arc::new(Slot {
                    wanted: std::sync::atomic::AtomicU32::new(0),
                    applied: tokio::sync::Mutex::new(Some(0)),
                    changes: std::sync::atomic::AtomicU64::new(0),
                    listed: std::sync::atomic::AtomicBool::new(false),
                    retrying: std::sync::atomic::AtomicBool::new(false),
                })
            })
            .clone();
        slot.wanted
            .store(wanted, std::sync::atomic::Ordering::SeqCst);
        slot.changes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        slot
    }

    /// Makes the manager match what `address` wants now; returns what was
    /// wanted.
    async fn reconcile(
        manager: &dyn ClusterManager,
        slot: &Slot,
        address: &str,
    ) -> Result<u32, ManagerError> {
        let mut applied = slot.applied.lock().await;
        let wanted = slot.wanted.load(std::sync::atomic::Ordering::SeqCst);
        if *applied != Some(wanted) {
            *applied = None;
            if wanted > 0 {
                manager.subscribe(address, wanted).await?;
            } else {
                manager.unsubscribe(address).await?;
            }
            *applied = Some(wanted);
            slot.listed
                .store(wanted > 0, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(wanted)
    }

    /// Reconciles `address` until the manager takes it, stopped, or refuses
    /// the address; backs off between attempts (see [`RETRY_WARN_AT`]).
    async fn reconcile_until_done(m: &dyn ClusterManager, slot: &Slot, a: &str) {
        let mut delay = Duration::from_millis(200);
        let mut attempt = 0u32;
        loop {
            attempt = attempt.saturating_add(1);
            match Self::reconcile(m, slot, a).await {
                Ok(_) => return,
                Err(e @ (ManagerError::Stopped | ManagerError::Invalid { .. })) => {
                    tracing::warn!(address = %a, error = %e, "could not update this node's subscription; not retrying");
                    return;
                }
                Err(e) => {
                    if attempt == RETRY_WARN_AT
                        || (attempt > RETRY_WARN_AT && attempt % RETRY_WARN_EVERY == 0)
                    {
                        tracing::warn!(address = %a, error = %e, attempts = attempt,
                            "could not update this node's subscription yet (a withdrawal: peers may still send here for it; a count: they share sends by the old one); retrying");
                    } else {
                        tracing::debug!(address = %a, error = %e, "updating this node's subscription failed; retrying");
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Drops `address`'s slot if it is idle, neither wanted nor subscribed.
    fn forget_if_idle(slots: &Mutex<HashMap<String, Arc<Slot>>>, address: &str, slot: &Arc<Slot>) {
        let mut slots = slots.lock();
        let idle = slot.wanted.load(std::sync::atomic::Ordering::SeqCst) == 0
            && slot.applied.try_lock().is_ok_and(|a| *a == Some(0));
        if idle && slots.get(address).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            slots.remove(address);
        }
    }

    /// Makes the manager match `address`'s slot in a background task, one
    /// per address at a time (see [`Slot::retrying`]).
    fn reconcile_in_background(&self, address: &str, slot: Arc<Slot>) {
        use std::sync::atomic::Ordering::SeqCst;
        if slot.retrying.swap(true, SeqCst) {
            // The task under way reads `wanted` on each attempt.
            return;
        }
        let (m, a) = (self.manager.clone(), address.to_owned());
        let slots = self.slots.clone();
        self.runtime.spawn(async move {
            loop {
                let seen = slot.changes.load(SeqCst);
                Self::reconcile_until_done(&*m, &slot, &a).await;
                slot.retrying.store(false, SeqCst);
                // A change that came meanwhile found this task under way and
                // left it here: go again, unless another task took over.
                if slot.changes.load(SeqCst) == seen || slot.retrying.swap(true, SeqCst) {
                    break;
                }
            }
            Self::forget_if_idle(&slots, &a, &slot);
        });
    }
}

impl ClusterHook for Hook {
    fn advertise(&self, address: &str, consumers: usize) -> Advertisement {
        let slot = self.want(address, consumers);
        let hook = self.clone();
        let a = address.to_owned();
        Box::pin(async move {
            // `Ok(0)`: withdrawn again since, so this registrant's consumer
            // is gone already; nothing to wait for.
            match Self::reconcile(&*hook.manager, &slot, &a).await {
                Ok(_) => Ok(()),
                Err(e) if slot.listed.load(std::sync::atomic::Ordering::SeqCst) => {
                    // Listed already: peers route here; the count follows.
                    tracing::warn!(address = %a, error = %e,
                        "could not write this node's new consumer count yet; retrying in the background");
                    hook.reconcile_in_background(&a, slot);
                    Ok(())
                }
                Err(e) => Err(BusError::Cluster {
                    reason: format!("could not advertise `{a}`: {e}"),
                }),
            }
        })
    }

    fn withdraw(&self, address: &str, consumers: usize) {
        let slot = self.want(address, consumers);
        self.reconcile_in_background(address, slot);
    }
}

impl ClusterNode {
    /// Joins `bus` to the cluster `manager` manages: listens, registers the
    /// node, advertises the bus's existing public consumers, and keeps the
    /// bus's remote routes in step with the cluster view.
    ///
    /// # Errors
    /// [`ClusterError::Config`] for a setting the node cannot run with
    /// (checked first: nothing is bound or joined then), otherwise
    /// [`ClusterError`] when the listener cannot bind or the manager fails.
    pub async fn start(
        bus: EventBus,
        manager: Arc<dyn ClusterManager>,
        cfg: ClusterConfig,
    ) -> Result<ClusterNode, ClusterError> {
        cfg.check()?;
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
        let addr = cfg.advertise.unwrap_or_else(|| {
            SocketAddr::new(cfg.advertise_host.unwrap_or(local.ip()), local.port())
        });
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
            handshake_timeout: cfg.handshake_timeout,
            backoff_max: cfg.backoff_max,
        });
        let inner = Arc::new(NodeInner {
            bus: bus.clone(),
            manager: manager.clone(),
            cfg: link_cfg,
            node_id: cfg.node_id.clone(),
            addr,
            links: Mutex::new(HashMap::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
            routes: Mutex::new(None),
            counters: Arc::new(ClusterCounters::default()),
            max_frame: cfg.max_frame,
            handshake_timeout: cfg.handshake_timeout,
        });
        // Owned from here on: should `start` fail or be dropped at one of
        // its awaits below, dropping this removes the hook, and the links
        // and routes an apply under way made.
        let hook: Arc<dyn ClusterHook> = Arc::new(Hook::new(manager.clone()));
        let mut node = ClusterNode {
            inner: inner.clone(),
            tasks: Vec::new(),
            hook: hook.clone(),
        };
        // Advertised by the bus under its registry lock, like every later
        // registration, so one withdrawn meanwhile is withdrawn after.
        for (address, advertisement) in bus.set_cluster_hook(Some(hook)) {
            advertisement
                .await
                .map_err(|e| ManagerError::Unavailable(format!("advertising `{address}`: {e}")))?;
        }
        // The view known now is applied before `start` returns, so the
        // node's first sends already see the routes and links it lists.
        let mut views = inner.manager.view();
        let known = views.borrow_and_update().clone();
        let connected = known.connected;
        if !apply_off_workers(&inner, known).await {
            return Err(ManagerError::Stopped.into());
        }
        node.tasks = vec![
            tokio::spawn(accept_loop(inner.clone(), listener, cfg.max_handshakes)),
            // Follows from the next view: this one is applied.
            tokio::spawn(follow_view(inner, views, connected)),
        ];
        tracing::info!(node = %cfg.node_id, %addr, "joined the cluster");
        Ok(node)
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

    /// Deregisters from the cluster and closes every link; the bus's
    /// remote routes are cleared when it returns.
    ///
    /// # Errors
    /// [`ManagerError`] if the store could not be told (the lease then
    /// removes the node).
    pub async fn leave(self) -> Result<(), ManagerError> {
        self.inner.bus.remove_cluster_hook(&self.hook);
        let r = self.inner.manager.leave().await;
        if let Some(clearing) = self.shut_down() {
            if let Err(e) = clearing.await {
                if e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        }
        r
    }

    /// Stops the node's tasks and marks it closed, then closes its links and
    /// clears its remote routes from the bus. That second part fails every
    /// request waiting on a link, waits for an `apply` under way and copies
    /// the bus's registry once (work that grows with the requests and the
    /// subscriptions), so on a runtime it runs on the blocking pool and the
    /// handle returned finishes it; without a runtime it runs here. Should
    /// the runtime drop the job unrun (its blocking pool shutting down), the
    /// job does its work as it is dropped. `None` once done or if another
    /// call did it.
    fn shut_down(&self) -> Option<tokio::task::JoinHandle<()>> {
        for t in &self.tasks {
            t.abort();
        }
        // From here an `apply` that starts does nothing and a handshake
        // makes no link; what one under way sets, `close` clears after it.
        if self
            .inner
            .closed
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return None;
        }
        let inner = self.inner.clone();
        crate::offload::run_blocking(move || inner.close())
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.inner.bus.remove_cluster_hook(&self.hook);
        // Finishes on its own; nobody is left to wait for it.
        drop(self.shut_down());
    }
}

/// Why an accepted connection's HELLO was refused. Each costs only that
/// connection; nothing is created for it.
#[derive(Debug, thiserror::Error)]
enum HelloRefused {
    #[error("it is a node of another cluster (`{0}`)")]
    OtherCluster(String),
    #[error(transparent)]
    InvalidId(ManagerError),
    #[error("it claims this node's own id")]
    OwnId,
    #[error("this node dials that node, not the reverse")]
    WrongSide,
    #[error("it is not a member of the cluster (waited {0:?} for the view to list it)")]
    NotMember(Duration),
    #[error("the cluster manager stopped")]
    Stopped,
}

/// Accepts peer connections; each must start with a HELLO from a member of
/// our cluster that should dial us, else it is closed. At most
/// `max_handshakes` connections are in their handshake at once; beyond it a
/// new one is closed at once.
async fn accept_loop(inner: Arc<NodeInner>, listener: TcpListener, max_handshakes: usize) {
    let handshakes = Arc::new(Semaphore::new(max_handshakes.max(1)));
    // Whether connections are being refused for the cap: logged once per
    // run of refusals, not once per connection.
    let mut refusing = false;
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cluster accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = handshakes.clone().try_acquire_owned() else {
            if !refusing {
                refusing = true;
                tracing::warn!(%from, max_handshakes, "too many cluster connections in their handshake; closing new ones until some finish");
            }
            drop(stream);
            continue;
        };
        refusing = false;
        let inner = inner.clone();
        tokio::spawn(async move {
            handshake(&inner, stream, from).await;
            drop(permit);
        });
    }
}

/// Reads an accepted connection's HELLO, checks it, and hands the
/// connection to the peer's link; the link is only created (if the view has
/// not created it already) once the HELLO passed every check.
async fn handshake(inner: &NodeInner, stream: TcpStream, from: SocketAddr) {
    let deadline = Instant::now() + inner.handshake_timeout;
    let hello = tokio::time::timeout_at(deadline, read_hello(stream, inner.max_frame)).await;
    let (stream, rest, node) = match hello {
        Ok(Ok((stream, rest, node, cluster))) => match inner.check_hello(&node, &cluster) {
            Ok(()) => (stream, rest, node),
            Err(why) => {
                tracing::warn!(%from, %node, reason = %why, "refusing a cluster connection");
                return;
            }
        },
        Ok(Err(e)) => {
            inner.counters.malformed.add(1);
            tracing::warn!(%from, error = %e, "closing a cluster connection with a bad greeting");
            return;
        }
        Err(_) => {
            tracing::warn!(%from, "closing a cluster connection that never said hello");
            return;
        }
    };
    let link = match tokio::time::timeout_at(deadline, inner.member_link(&node)).await {
        Ok(Ok(link)) => link,
        Ok(Err(why)) => {
            tracing::debug!(%from, %node, reason = %why, "refusing a cluster connection");
            return;
        }
        Err(_) => {
            let why = HelloRefused::NotMember(inner.handshake_timeout);
            tracing::warn!(%from, %node, reason = %why, "refusing a cluster connection");
            return;
        }
    };
    debug_assert_eq!(link.side(), Side::Accept, "checked by check_hello");
    link.hand_over(stream, rest);
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
                return Ok((stream, buf, node.into_owned(), cluster.into_owned()));
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
        self.link_in(&mut self.links.lock(), peer, addr)
    }

    /// `links`' entry for `peer`, started (towards `addr`) if missing.
    fn link_in(
        &self,
        links: &mut HashMap<String, Arc<Link>>,
        peer: &str,
        addr: SocketAddr,
    ) -> Arc<Link> {
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

    /// Checks what a HELLO says before anything is created for it: our
    /// cluster, a valid id that is not ours, and a node that dials us (the
    /// smaller id dials).
    fn check_hello(&self, node: &str, cluster: &str) -> Result<(), HelloRefused> {
        if cluster != self.cfg.cluster {
            return Err(HelloRefused::OtherCluster(cluster.to_owned()));
        }
        check_node_id(node).map_err(HelloRefused::InvalidId)?;
        if node == self.node_id {
            return Err(HelloRefused::OwnId);
        }
        if Side::towards(&self.node_id, node) != Side::Accept {
            return Err(HelloRefused::WrongSide);
        }
        Ok(())
    }

    /// The link to `peer` once the view lists it as a member: at once if it
    /// does, else when it does (the caller bounds the wait).
    async fn member_link(&self, peer: &str) -> Result<Arc<Link>, HelloRefused> {
        let mut rx = self.manager.view();
        loop {
            // Only the outcome: the view's lock is not held past this line.
            let listed = rx.wait_for(|v| v.members.contains_key(peer)).await.is_ok();
            if !listed {
                return Err(HelloRefused::Stopped);
            }
            if let Some(link) = self.link_if_member(peer, &rx) {
                return Ok(link);
            }
            // It left again between the two looks: wait for it to return.
        }
    }

    /// Closes every link and removes them from the bus's remote routes,
    /// after any `apply` under way (which holds the routes lock). Called
    /// once `closed` is set, so no `apply` or handshake adds either
    /// afterwards. Only this node's links are removed: a node started on
    /// the same bus meanwhile keeps the routes it set.
    fn close(&self) {
        // Requests waiting on the links fail before the wait for the lock.
        self.close_links();
        let mut routes = self.routes.lock();
        let basis = routes.take();
        // Links an `apply` under way made.
        self.close_links();
        if let Some(basis) = basis {
            let mine: std::collections::HashSet<*const ()> = basis
                .links
                .values()
                .map(|l| Arc::as_ptr(l).cast::<()>())
                .collect();
            self.bus
                .retain_remote_nodes_many(basis.view.subscriptions.keys(), |n| {
                    !mine.contains(&Arc::as_ptr(n).cast::<()>())
                });
        }
    }

    /// Closes and forgets every link.
    fn close_links(&self) {
        let links: Vec<Arc<Link>> = self.links.lock().drain().map(|(_, l)| l).collect();
        for l in links {
            l.close();
        }
    }

    /// The link to `peer` if the newest view lists it. Checked under the
    /// links lock: `apply` reads the view without it, so a link created here
    /// is either for a member of the newest view or pruned by the `apply`
    /// of a newer one.
    fn link_if_member(
        &self,
        peer: &str,
        view: &watch::Receiver<Arc<ClusterView>>,
    ) -> Option<Arc<Link>> {
        let mut links = self.links.lock();
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        let addr = *view.borrow().members.get(peer)?;
        Some(self.link_in(&mut links, peer, addr))
    }

    /// Brings links and the bus's remote routes in line with `view`.
    ///
    /// Runs on a blocking thread (see `follow_view`): its work grows with the
    /// number of subscribed addresses (a walk over the view, and one copy of
    /// the bus's whole registry per change), which for thousands of
    /// addresses can hold a thread for longer than an async task may block.
    fn apply(&self, view: &Arc<ClusterView>) {
        let mut routes = self.routes.lock();
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
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
        // Routes: every address with a live remote subscriber, in one batch
        // (one registry copy for the whole view change).
        let links = self.links.lock().clone();
        let changes = self.route_changes(routes.as_ref(), view, &links);
        self.bus.set_weighted_remote_nodes_many(changes);
        *routes = Some(Basis {
            view: view.clone(),
            links,
        });
        drop(routes);
        // Close links last, so no route points at a closed link for long.
        for l in gone {
            tracing::info!(peer = %l.id(), "node left the cluster; its requests failed");
            l.close();
        }
    }

    /// The remote node lists that differ between the routes computed from
    /// `basis` and those for `view` with `links`: each address of `view`,
    /// unless `basis` has the same links and the same subscribers for it,
    /// and an empty list for each address of `basis` that `view` lacks. (An
    /// unchanged list among them is skipped by the bus.)
    fn route_changes<'a>(
        &self,
        basis: Option<&'a Basis>,
        view: &'a ClusterView,
        links: &HashMap<String, Arc<Link>>,
    ) -> Vec<(&'a str, railyard_bus::WeightedNodes)> {
        let same_links = basis.is_some_and(|b| {
            b.links.len() == links.len()
                && b.links
                    .iter()
                    .all(|(id, l)| links.get(id).is_some_and(|n| Arc::ptr_eq(l, n)))
        });
        // Both maps are sorted by address: walk them side by side.
        let mut old = basis
            .map(|b| &b.view.subscriptions)
            .into_iter()
            .flatten()
            .peekable();
        let mut changes = Vec::new();
        for (address, nodes) in &view.subscriptions {
            let mut before = None;
            while let Some((a, subs)) = old.next_if(|(a, _)| *a <= address) {
                if a == address {
                    before = Some(subs);
                } else {
                    changes.push((a.as_str(), Vec::new()));
                }
            }
            if same_links && before == Some(nodes) {
                continue;
            }
            // Each node weighs its consumer count: sends reach every
            // consumer in the cluster in turn.
            let remotes: railyard_bus::WeightedNodes = nodes
                .iter()
                .filter(|(n, _)| **n != self.node_id)
                .filter_map(|(n, w)| links.get(n).map(|l| (l.clone() as Arc<dyn RemoteNode>, *w)))
                .collect();
            changes.push((address.as_str(), remotes));
        }
        changes.extend(old.map(|(a, _)| (a.as_str(), Vec::new())));
        changes
    }
}

/// Follows the manager's view for the node's lifetime.
/// `rx` has seen the view `start` applied; `connected` is whether that view
/// reached the store.
async fn follow_view(
    inner: Arc<NodeInner>,
    mut rx: watch::Receiver<Arc<ClusterView>>,
    connected: bool,
) {
    // `None` until the store was first reached: the manager's initial view
    // (before its first read) is not an outage.
    let mut connected: Option<bool> = connected.then_some(true);
    loop {
        if rx.changed().await.is_err() {
            return;
        }
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
        // Views that arrive meanwhile are coalesced: the next round applies
        // the newest.
        if !apply_off_workers(&inner, view).await {
            return;
        }
    }
}

/// Runs `apply` on a blocking thread, not an async worker: its work grows
/// with the view (see there). False if the runtime is shutting down; a
/// panic in it is re-raised here.
async fn apply_off_workers(inner: &Arc<NodeInner>, view: Arc<ClusterView>) -> bool {
    let applying = inner.clone();
    match tokio::task::spawn_blocking(move || applying.apply(&view)).await {
        Ok(()) => true,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => false,
    }
}

#[cfg(test)]
impl ClusterNode {
    /// Ids of the peers this node keeps a link to.
    fn link_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.inner.links.lock().keys().cloned().collect();
        ids.sort_unstable();
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inproc::InProcessRegistry;
    use tokio::io::AsyncWriteExt;

    /// A manager call that succeeds at once (the test managers' stubs).
    fn done<'a>() -> crate::manager::BoxFuture<'a, Result<(), ManagerError>> {
        Box::pin(async { Ok(()) })
    }

    async fn start_node(
        manager: Arc<dyn ClusterManager>,
        id: &str,
        configure: impl FnOnce(&mut ClusterConfig),
    ) -> (EventBus, ClusterNode) {
        let bus = EventBus::new();
        let mut cfg = ClusterConfig::new(id, "127.0.0.1:0".parse().unwrap());
        cfg.ping_interval = Duration::from_millis(100);
        cfg.ping_timeout = Duration::from_millis(1500);
        configure(&mut cfg);
        let node = ClusterNode::start(bus.clone(), manager, cfg)
            .await
            .expect("node starts");
        (bus, node)
    }

    /// Registers `id` in `reg`, as a node a raw client then speaks for.
    async fn member(reg: &InProcessRegistry, id: &str) -> crate::inproc::InProcessManager {
        let m = reg.manager();
        m.join(NodeInfo {
            id: id.into(),
            // Never dialed: the nodes under test have larger ids and accept.
            addr: "127.0.0.1:9".parse().unwrap(),
        })
        .await
        .unwrap();
        m
    }

    /// Connects to `addr` and writes a HELLO as `node` with a PING behind it.
    async fn greet(addr: SocketAddr, node: &str) -> TcpStream {
        let mut out = BytesMut::new();
        Frame::Hello {
            version: VERSION,
            node: node.into(),
            cluster: "railyard".into(),
        }
        .encode(&mut out);
        Frame::Ping(7).encode(&mut out);
        let mut s = TcpStream::connect(addr).await.unwrap();
        // A node that closes the connection at once may make the write
        // fail: `greeted` then reports it closed.
        let _ = s.write_all(&out).await;
        s
    }

    #[derive(Debug, PartialEq)]
    enum Greeted {
        /// The node answered the PING: the connection went to a link.
        Pong,
        /// The node closed the connection.
        Closed,
    }

    /// What the node did with a greeting; panics if it did neither within
    /// 10 s (far longer than any refusal or acceptance takes here).
    async fn greeted(s: &mut TcpStream) -> Greeted {
        let mut inbuf = BytesMut::new();
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(f) = Frame::decode(&mut inbuf, 1 << 20).unwrap() {
                    if f == Frame::Pong(7) {
                        return Greeted::Pong;
                    }
                    continue;
                }
                match s.read_buf(&mut inbuf).await {
                    Ok(0) | Err(_) => return Greeted::Closed,
                    Ok(_) => {}
                }
            }
        })
        .await
        .expect("the node neither answered nor closed the connection")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hello_from_a_node_that_is_not_a_member_is_refused_and_creates_nothing() {
        let reg = InProcessRegistry::new();
        let (_bus, node) = start_node(Arc::new(reg.manager()), "m", |c| {
            c.handshake_timeout = Duration::from_millis(200);
        })
        .await;
        for _ in 0..3 {
            let mut s = greet(node.addr(), "a-stranger").await;
            assert_eq!(greeted(&mut s).await, Greeted::Closed);
        }
        assert_eq!(node.link_ids(), Vec::<String>::new());
        // Refused without a frame error: not counted as malformed.
        assert_eq!(node.counters().malformed.get(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hello_naming_our_own_id_or_a_node_we_dial_or_an_invalid_id_creates_nothing() {
        let reg = InProcessRegistry::new();
        // A handshake timeout far beyond `greeted`'s bound: each refusal
        // below happens before any wait for the view.
        let (_bus, node) = start_node(Arc::new(reg.manager()), "m", |c| {
            c.handshake_timeout = Duration::from_secs(60);
        })
        .await;
        let too_long = "a".repeat(201);
        for id in ["m", "z-we-dial", "a/b", "", too_long.as_str()] {
            let mut s = greet(node.addr(), id).await;
            assert_eq!(greeted(&mut s).await, Greeted::Closed, "HELLO as {id:?}");
            assert_eq!(node.link_ids(), Vec::<String>::new(), "HELLO as {id:?}");
        }
    }

    /// A joining node registers and dials at once; the node it dials may
    /// see the registration only after the HELLO: it waits for its view.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hello_from_a_node_that_joins_meanwhile_is_accepted() {
        let reg = InProcessRegistry::new();
        let (_bus, node) = start_node(Arc::new(reg.manager()), "m", |_| {}).await;
        let mut s = greet(node.addr(), "a-joiner").await;
        // Let the HELLO arrive first (not needed for the outcome).
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _joiner = member(&reg, "a-joiner").await;
        assert_eq!(greeted(&mut s).await, Greeted::Pong);
        assert_eq!(node.link_ids(), vec!["a-joiner".to_string()]);
    }

    /// The dialer does not call an acceptor dead for the silence of its
    /// handshake: a request sent while the acceptor's view does not list
    /// the dialer yet is answered once it does, though that takes longer
    /// than the ping deadline (it failed with "disconnected" when the ping
    /// deadline applied from the start).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_waits_out_the_acceptors_handshake_past_the_ping_deadline() {
        let config = |c: &mut ClusterConfig| {
            c.ping_timeout = Duration::from_millis(300);
            c.handshake_timeout = Duration::from_secs(4);
        };
        let mb = TestManager::scripted(&[], &[]);
        let (b_bus, b) = start_node(mb.clone(), "b", config).await;
        let _echo = b_bus
            .local_consumer("svc")
            .handler(|mut m| async move {
                let body = m.take_body();
                let _ = m.reply(body);
            })
            .await
            .unwrap();
        let ma = TestManager::scripted(&[("b", b.addr())], &[("svc", "b")]);
        let (a_bus, a) = start_node(ma, "a", config).await;
        let quick = railyard_bus::DeliveryOptions::new().timeout(Duration::from_secs(6));
        let asked = tokio::spawn(async move {
            a_bus
                .request_with("svc", String::from("hi"), &quick)
                .await
                .map(|r| r.body::<String>().unwrap().clone())
        });
        // Three ping deadlines of silence: b holds a's HELLO, not listing a.
        tokio::time::sleep(Duration::from_millis(900)).await;
        mb.set(&[("a", a.addr()), ("b", b.addr())], &[]);
        let answer = asked.await.unwrap();
        assert_eq!(answer.unwrap(), "hi");
    }

    /// A stopping node's clean-up, which may run late on the blocking pool,
    /// removes only its own links and hook: a node started on the same bus
    /// meanwhile keeps its routes and its hook.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_clean_up_leaves_a_successors_routes_and_hook() {
        let reg = InProcessRegistry::new();
        let (b_bus, _b) = start_node(Arc::new(reg.manager()), "b", |_| {}).await;
        let _sub = b_bus.consumer("over-there").stream().await.unwrap();
        let bus = EventBus::new();
        let config = |id: &str| {
            let mut c = ClusterConfig::new(id, "127.0.0.1:0".parse().unwrap());
            c.ping_interval = Duration::from_millis(100);
            c.ping_timeout = Duration::from_millis(1500);
            c
        };
        let routed = |bus: &EventBus| bus.remote_addresses().iter().any(|a| a == "over-there");
        let old = ClusterNode::start(bus.clone(), Arc::new(reg.manager()), config("c"))
            .await
            .unwrap();
        assert!(
            routed(&bus),
            "the known view is applied before start returns"
        );
        // Stopped, its clean-up not run yet.
        let old_inner = old.inner.clone();
        old_inner
            .closed
            .store(true, std::sync::atomic::Ordering::Release);
        let new = ClusterNode::start(bus.clone(), Arc::new(reg.manager()), config("d"))
            .await
            .unwrap();
        // The clean-up runs now, and the old node goes.
        old_inner.close();
        drop(old);
        assert!(routed(&bus), "the successor's route survives");
        let _local = bus.consumer("advertised").stream().await.unwrap();
        let mut seen = false;
        for _ in 0..500 {
            if reg.snapshot().subscriptions.contains_key("advertised") {
                seen = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(seen, "the successor's hook still advertises registrations");
        drop(new);
    }

    /// A handshake that completes after the node shut down (its task is not
    /// aborted) makes no link.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_link_is_made_after_the_node_shut_down() {
        let reg = InProcessRegistry::new();
        let _member = member(&reg, "a-member").await;
        let (_bus, node) = start_node(Arc::new(reg.manager()), "m", |_| {}).await;
        assert_eq!(node.link_ids(), vec!["a-member".to_string()]);
        let inner = node.inner.clone();
        drop(node);
        // Closed on the blocking pool.
        for _ in 0..500 {
            if inner.links.lock().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(inner.links.lock().is_empty());
        let view = inner.manager.view();
        assert!(inner.link_if_member("a-member", &view).is_none());
        assert!(inner.links.lock().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn beyond_max_handshakes_new_connections_are_closed_at_once() {
        let reg = InProcessRegistry::new();
        let _member = member(&reg, "a-member").await;
        let (_bus, node) = start_node(Arc::new(reg.manager()), "m", |c| {
            c.max_handshakes = 4;
            c.handshake_timeout = Duration::from_secs(60);
        })
        .await;
        // Four connections that never say hello hold every handshake slot
        // (the node accepts connections in order).
        let mut silent = Vec::new();
        for _ in 0..4 {
            silent.push(TcpStream::connect(node.addr()).await.unwrap());
        }
        // A fifth is closed at once, not after the 60 s handshake timeout.
        let mut s = greet(node.addr(), "a-member").await;
        assert_eq!(greeted(&mut s).await, Greeted::Closed);
        assert_eq!(
            node.link_ids(),
            vec!["a-member".to_string()],
            "from the view"
        );
        // Once they go, greetings are served again.
        drop(silent);
        let mut answered = false;
        for _ in 0..200 {
            let mut s = greet(node.addr(), "a-member").await;
            if greeted(&mut s).await == Greeted::Pong {
                answered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            answered,
            "the node kept refusing after the slots were freed"
        );
    }

    /// The manager of these tests. Its view is what the test sets, so two
    /// nodes can disagree ([`TestManager::scripted`]). Its `unsubscribe`
    /// fails (unreachable) a number of times, or for good with `Stopped`;
    /// with `recounts_fail`, so does a `subscribe` that replaces the count
    /// of an address it lists.
    struct TestManager {
        fails_left: std::sync::atomic::AtomicU32,
        stopped: bool,
        recounts_fail: bool,
        calls: std::sync::atomic::AtomicU32,
        done: std::sync::atomic::AtomicU32,
        /// Addresses listed, with their counts.
        listed: Mutex<HashMap<String, u32>>,
        view: watch::Sender<Arc<ClusterView>>,
    }

    impl TestManager {
        fn new(fails: u32, stopped: bool) -> Arc<Self> {
            Arc::new(Self {
                fails_left: fails.into(),
                stopped,
                recounts_fail: false,
                calls: 0.into(),
                done: 0.into(),
                listed: Mutex::new(HashMap::new()),
                view: watch::channel(Arc::new(ClusterView::default())).0,
            })
        }

        /// Fails the next `fails` calls that can fail, recounts included.
        fn recounting(fails: u32) -> Arc<Self> {
            let mut m = Arc::into_inner(Self::new(fails, false)).expect("one owner");
            m.recounts_fail = true;
            Arc::new(m)
        }

        /// A manager that never fails, with this view (see [`Self::set`]).
        fn scripted(members: &[(&str, SocketAddr)], subs: &[(&str, &str)]) -> Arc<Self> {
            let m = Self::new(0, false);
            m.set(members, subs);
            m
        }

        /// Publishes a connected view of `members` and `subs` (address,
        /// node: one consumer each).
        fn set(&self, members: &[(&str, SocketAddr)], subs: &[(&str, &str)]) {
            let mut v = ClusterView {
                connected: true,
                ..ClusterView::default()
            };
            for (id, addr) in members {
                v.members.insert((*id).into(), *addr);
            }
            for (address, node) in subs {
                v.subscriptions
                    .entry((*address).into())
                    .or_default()
                    .insert((*node).into(), 1);
            }
            self.view.send_replace(Arc::new(v));
        }

        /// A call that can fail: fails while failures are left.
        fn answer(&self) -> Result<(), ManagerError> {
            use std::sync::atomic::Ordering::SeqCst;
            self.calls.fetch_add(1, SeqCst);
            if self.stopped {
                Err(ManagerError::Stopped)
            } else if self
                .fails_left
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                Err(ManagerError::Unavailable("etcd down".into()))
            } else {
                self.done.fetch_add(1, SeqCst);
                Ok(())
            }
        }
    }

    impl ClusterManager for TestManager {
        fn join(&self, _: NodeInfo) -> crate::manager::BoxFuture<'_, Result<(), ManagerError>> {
            done()
        }
        fn leave(&self) -> crate::manager::BoxFuture<'_, Result<(), ManagerError>> {
            done()
        }
        fn subscribe(
            &self,
            address: &str,
            consumers: u32,
        ) -> crate::manager::BoxFuture<'_, Result<(), ManagerError>> {
            let recount = self.recounts_fail && self.listed.lock().contains_key(address);
            let result = if recount { self.answer() } else { Ok(()) };
            if result.is_ok() {
                self.listed.lock().insert(address.to_owned(), consumers);
            }
            Box::pin(async move { result })
        }
        fn unsubscribe(
            &self,
            address: &str,
        ) -> crate::manager::BoxFuture<'_, Result<(), ManagerError>> {
            let result = self.answer();
            if result.is_ok() {
                self.listed.lock().remove(address);
            }
            Box::pin(async move { result })
        }
        fn view(&self) -> watch::Receiver<Arc<ClusterView>> {
            self.view.subscribe()
        }
    }

    /// A withdrawal the manager cannot take (etcd unreachable for minutes)
    /// is retried until it can: it used to stop after 8 attempts (about
    /// 16 s), leaving the subscription in the store for the node's life, so
    /// peers kept sending here for an address with no consumer. A stopped
    /// manager is not retried.
    #[tokio::test(start_paused = true)]
    async fn a_withdrawal_is_retried_until_the_manager_takes_it() {
        use std::sync::atomic::Ordering::SeqCst;
        let m = TestManager::new(40, false);
        let hook = Hook::new(m.clone());
        hook.advertise("x", 1).await.unwrap();
        hook.withdraw("x", 0);
        for _ in 0..600 {
            if m.done.load(SeqCst) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(
            m.done.load(SeqCst),
            1,
            "withdrawn once the manager answered"
        );
        assert_eq!(m.calls.load(SeqCst), 41);

        let stopped = TestManager::new(0, true);
        let hook = Hook::new(stopped.clone());
        hook.advertise("y", 1).await.unwrap();
        hook.withdraw("y", 0);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(
            stopped.calls.load(SeqCst),
            1,
            "a stopped manager is not retried"
        );

        // An address that comes and goes during the outage has one retrying
        // task, not one per withdrawal.
        let down = TestManager::new(u32::MAX, false);
        let hook = Hook::new(down.clone());
        for _ in 0..20 {
            hook.advertise("z", 1).await.unwrap();
            hook.withdraw("z", 0);
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_secs(20)).await;
        let calls = down.calls.load(SeqCst);
        // One task: 200 ms doubling to 5 s is about 8 calls in 20 s.
        assert!(
            calls <= 12,
            "{calls} withdrawal calls in 20 s: more than one task"
        );
    }

    /// A registration that only changes the consumer count of an address
    /// the manager lists already resolves when the manager cannot take the
    /// count (etcd unreachable): peers route here anyway. The count is
    /// written in the background once the manager answers. It used to fail
    /// the registration, which undid the consumer.
    #[tokio::test(start_paused = true)]
    async fn a_new_count_the_manager_cannot_take_does_not_fail_the_registration() {
        use std::sync::atomic::Ordering::SeqCst;
        let m = TestManager::recounting(5);
        let hook = Hook::new(m.clone());
        hook.advertise("x", 1).await.expect("listed");
        hook.advertise("x", 2)
            .await
            .expect("listed already: the registration resolves");
        assert_eq!(m.listed.lock().get("x"), Some(&1), "not taken yet");
        for _ in 0..120 {
            if m.done.load(SeqCst) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(m.listed.lock().get("x"), Some(&2), "the count followed");
        assert_eq!(m.calls.load(SeqCst), 6, "5 refused, then taken");
    }

    /// Waits (up to 10 s) until `bus` routes exactly `n` addresses to other nodes.
    async fn routed(bus: &EventBus, n: usize) {
        for _ in 0..1000 {
            if bus.remote_addresses().len() == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let now = bus.remote_addresses().len();
        panic!("the bus routes {now} addresses to other nodes, expected {n}");
    }

    /// A view change with thousands of addresses costs the bus one registry
    /// copy, not one per address; so does clearing them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_view_with_many_addresses_is_one_registry_change() {
        const N: usize = 2_000;
        // b is never reached: its routes exist as long as the view lists it.
        let unused: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let members = [("a", unused), ("b", unused)];
        let m = TestManager::scripted(&members, &[]);
        let (bus, _node) = start_node(m.clone(), "a", |_| {}).await;
        let _here = bus.local_consumer("addr-0").stream().await.unwrap();
        let names: Vec<String> = (0..N).map(|i| format!("addr-{i}")).collect();
        let all: Vec<(&str, &str)> = names.iter().map(|a| (a.as_str(), "b")).collect();
        // Applying the members-only view changed no route: nothing stored.
        let at = bus.registry_generation();

        m.set(&members, &all);
        routed(&bus, N).await;
        assert_eq!(
            bus.registry_generation(),
            at + 1,
            "one store for {N} routes"
        );

        // One address fewer: one store, the other routes kept.
        m.set(&members, &all[1..]);
        routed(&bus, N - 1).await;
        assert_eq!(bus.registry_generation(), at + 2);
        assert_eq!(bus.consumer_count("addr-0"), 1, "the local consumer stays");

        // Every address gone: one store clears them all.
        m.set(&members, &[]);
        routed(&bus, 0).await;
        assert_eq!(bus.registry_generation(), at + 3);
        assert_eq!(bus.consumer_count("addr-0"), 1);
    }

    /// An address whose subscribers did not change is still re-routed when
    /// a member joins or leaves: its subscribers' links may have changed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unchanged_subscribers_are_re_routed_when_the_members_change() {
        let unused: SocketAddr = "127.0.0.1:9".parse().unwrap();
        // b and c sort below m: m waits for them to dial, and their links
        // (never connected) stay chosen for the handshake timeout, past the
        // test's length. (Links m dialed would be down after their first
        // refused dial.)
        let patient = |c: &mut ClusterConfig| c.handshake_timeout = Duration::from_secs(600);
        // c subscribes before the view lists it as a member: no link, no route.
        let subs = [("x", "b"), ("x", "c"), ("y", "b")];
        let m = TestManager::scripted(&[("m", unused), ("b", unused)], &subs);
        let (bus, _node) = start_node(m.clone(), "m", patient).await;
        routed(&bus, 2).await;
        // A publish reaches each routed node once (queued on its link).
        assert_eq!(bus.publish("x", 1u8).unwrap().delivered, 1);

        m.set(&[("m", unused), ("b", unused), ("c", unused)], &subs);
        let mut delivered = 0;
        for _ in 0..1000 {
            delivered = bus.publish("x", 1u8).unwrap().delivered;
            if delivered == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(delivered, 2, "c's link was not added to x's route");

        // c leaves: x keeps b only.
        m.set(&[("m", unused), ("b", unused)], &subs);
        for _ in 0..1000 {
            delivered = bus.publish("x", 1u8).unwrap().delivered;
            if delivered == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(delivered, 1, "c's link stayed in x's route");
        assert_eq!(bus.publish("y", 1u8).unwrap().delivered, 1);
    }

    /// A connection refused right after its HELLO counts as a failed dial:
    /// the dialer waits its backoff (20 ms, doubling) before the next one
    /// instead of dialing again at once, over and over.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dialer_whose_connections_are_refused_backs_off() {
        let unused: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let (_b, nb) = start_node(TestManager::scripted(&[("b", unused)], &[]), "b", |_| {}).await;
        // a names another cluster in its HELLO: b refuses it at once.
        let ma = TestManager::scripted(&[("a", unused), ("b", nb.addr())], &[]);
        let (_a, na) = start_node(ma, "a", |c| c.cluster = "other".into()).await;
        for _ in 0..500 {
            if na.counters().connects.get() > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let first = na.counters().connects.get();
        assert!(first > 0, "a never dialed b");
        tokio::time::sleep(Duration::from_millis(500)).await;
        // With the backoff, at most 5 more dials fit in 500 ms (the waits
        // add up to 620 ms); a slower machine only makes fewer. Without it,
        // a dial per round trip: hundreds.
        let more = na.counters().connects.get() - first;
        assert!(more <= 10, "{more} connections in 500 ms: no backoff");
    }

    /// A dialer refused because the acceptor's view does not list it yet
    /// dials again, and gets through once the view lists it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dialer_refused_as_a_stranger_gets_through_once_the_view_lists_it() {
        let unused: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mb = TestManager::scripted(&[("b", unused)], &[]);
        let (b, nb) = start_node(mb.clone(), "b", |c| {
            c.handshake_timeout = Duration::from_millis(200);
        })
        .await;
        let _echo = b
            .consumer("echo")
            .handler(|mut m| async move {
                let body = m.take_body();
                let _ = m.reply(body);
            })
            .await
            .unwrap();
        let ma = TestManager::scripted(&[("a", unused), ("b", nb.addr())], &[("echo", "b")]);
        let (a, na) = start_node(ma.clone(), "a", |_| {}).await;
        // b refuses a's connection (a is no member in b's view): a sees it end.
        for _ in 0..500 {
            if na.counters().disconnects.get() > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(na.counters().disconnects.get() > 0, "b never refused a");
        assert_eq!(nb.link_ids(), Vec::<String>::new());
        // b's view catches up: a's next dial is accepted.
        mb.set(&[("a", unused), ("b", nb.addr())], &[("echo", "b")]);
        let quick = railyard_bus::DeliveryOptions::new().timeout(Duration::from_secs(2));
        let mut answer = None;
        for _ in 0..50 {
            // A request written on a connection b was refusing as it caught
            // up fails: try again.
            if let Ok(r) = a.request_with("echo", String::from("in"), &quick).await {
                answer = Some(r.body::<String>().unwrap().clone());
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(answer.as_deref(), Some("in"));
        assert_eq!(nb.link_ids(), vec!["a".to_string()]);
    }
}
