//! The cluster client: configuration, routing, redirections, retries and the
//! typed commands.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use parking_lot::RwLock;
use tokio::time::Instant;

use crate::conn::{ConnConfig, NodeConn};
use crate::error::RedisError;
use crate::refresh::{self, Reason, RefreshStats, StatsCells, Trigger};
use crate::slot::key_slot;
use crate::topology::SlotTable;
use crate::value::{Cmd, Protocol, ToArg, Value, DEFAULT_MAX_REPLY_SIZE};

/// Where reads go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadFrom {
    /// Always the master (read-your-writes).
    #[default]
    Master,
    /// A replica of the slot's master, round-robin; the master if it has none.
    /// Replica reads may be stale.
    Replica,
}

/// Options for `SET`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SetOptions {
    /// Expire after this long (`PX`).
    pub expire: Option<Duration>,
    /// Only set if the key does not exist (`NX`).
    pub only_if_absent: bool,
    /// Only set if the key exists (`XX`).
    pub only_if_present: bool,
    /// Keep the existing time to live (`KEEPTTL`).
    pub keep_ttl: bool,
}

/// Builds a [`ClusterClient`]; every setter validates.
#[derive(Debug, Clone)]
pub struct ClusterClientBuilder {
    cfg: Config,
    error: Option<String>,
}

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) seeds: Vec<Arc<str>>,
    pub(crate) refresh_period: Option<Duration>,
    pub(crate) adaptive: bool,
    pub(crate) adaptive_min_interval: Duration,
    pub(crate) sample_size: usize,
    pub(crate) deep_check_every: u32,
    pub(crate) refresh_concurrency: usize,
    pub(crate) read_from: ReadFrom,
    pub(crate) command_timeout: Duration,
    pub(crate) max_redirects: u32,
    pub(crate) retry_delay: Duration,
    pub(crate) conn: ConnConfig,
}

impl ClusterClientBuilder {
    fn set(mut self, ok: bool, msg: &str, f: impl FnOnce(&mut Config)) -> Self {
        if ok {
            f(&mut self.cfg);
        } else if self.error.is_none() {
            self.error = Some(msg.to_owned());
        }
        self
    }

    /// Periodic topology check every `period` (`None`: off, the default).
    #[must_use]
    pub fn refresh_period(self, period: Option<Duration>) -> Self {
        let ok = period.is_none_or(|p| p >= Duration::from_millis(10));
        self.set(ok, "refresh_period must be at least 10ms", |c| {
            c.refresh_period = period;
        })
    }
    /// Adaptive refresh on MOVED/ASK/unknown node/uncovered slot/reconnects
    /// (default on), at most once per `min_interval` (default 1s).
    #[must_use]
    pub fn adaptive_refresh(self, on: bool, min_interval: Duration) -> Self {
        self.set(true, "", |c| {
            c.adaptive = on;
            c.adaptive_min_interval = min_interval;
        })
    }
    /// Nodes sampled by each periodic check (default 3).
    #[must_use]
    pub fn sample_size(self, n: usize) -> Self {
        self.set(n >= 1, "sample_size must be at least 1", |c| {
            c.sample_size = n
        })
    }
    /// Every `n`th periodic round compares whole `CLUSTER NODES` views; the
    /// rounds between compare only `CLUSTER INFO` summaries (epoch, known
    /// nodes, state, slot counts), a few hundred bytes instead of about
    /// 126 bytes per node per sampled node (default 10; 1 compares views
    /// every round). docs/redis.md ("Topology refresh") says what each kind
    /// of round sees.
    #[must_use]
    pub fn deep_check_every(self, n: u32) -> Self {
        self.set(n >= 1, "deep_check_every must be at least 1", |c| {
            c.deep_check_every = n;
        })
    }
    /// `CLUSTER NODES` requests in flight during a full refresh (default 64).
    #[must_use]
    pub fn refresh_concurrency(self, n: usize) -> Self {
        self.set(n >= 1, "refresh_concurrency must be at least 1", |c| {
            c.refresh_concurrency = n;
        })
    }
    /// Where reads go (default [`ReadFrom::Master`]).
    #[must_use]
    pub fn read_from(self, r: ReadFrom) -> Self {
        self.set(true, "", |c| {
            c.read_from = r;
            c.conn.readonly = r == ReadFrom::Replica;
        })
    }
    /// Time for one command including redirections and retries (default 2s).
    #[must_use]
    pub fn command_timeout(self, t: Duration) -> Self {
        self.set(!t.is_zero(), "command_timeout must be positive", |c| {
            c.command_timeout = t;
        })
    }
    /// Time to connect and handshake (default 1s).
    #[must_use]
    pub fn connect_timeout(self, t: Duration) -> Self {
        self.set(!t.is_zero(), "connect_timeout must be positive", |c| {
            c.conn.connect_timeout = t;
        })
    }
    /// MOVED/ASK hops before [`RedisError::TooManyRedirects`] (default 5).
    #[must_use]
    pub fn max_redirects(self, n: u32) -> Self {
        self.set(true, "", |c| c.max_redirects = n)
    }
    /// Commands waiting per node connection (default 4096); beyond it,
    /// [`RedisError::QueueFull`].
    #[must_use]
    pub fn queue_capacity(self, n: usize) -> Self {
        self.set(n >= 1, "queue_capacity must be at least 1", |c| {
            c.conn.queue_capacity = n;
        })
    }
    /// Commands written and awaiting replies per connection (default 1024).
    #[must_use]
    pub fn max_in_flight(self, n: usize) -> Self {
        self.set(n >= 1, "max_in_flight must be at least 1", |c| {
            c.conn.max_in_flight = n;
        })
    }
    /// Reconnect backoff bounds (default 50ms to 2s, doubling).
    #[must_use]
    pub fn reconnect_backoff(self, min: Duration, max: Duration) -> Self {
        self.set(
            !min.is_zero() && min <= max,
            "backoff needs 0 < min <= max",
            |c| {
                c.conn.backoff_min = min;
                c.conn.backoff_max = max;
            },
        )
    }
    /// Protocol spoken after connecting (default RESP2).
    #[must_use]
    pub fn protocol(self, p: Protocol) -> Self {
        self.set(true, "", |c| c.conn.protocol = p)
    }
    /// Bound on a reply's declared lengths and on the bytes buffered for a
    /// reply not yet complete (default 512 MiB, Redis's own
    /// `proto-max-bulk-len`; at least 1 KiB).
    ///
    /// It bounds each connection's read buffer: without it, one bad length
    /// prefix makes the client buffer bytes until memory runs out. A reply
    /// that declares a longer string or more elements, or that is still
    /// incomplete at this size, is refused with [`RedisError::Protocol`] and
    /// its connection closed and reopened; the other connections carry on.
    /// It is not a cap on a reply's total size: a reply made of many small
    /// elements that arrives complete within one read is decoded whatever
    /// its length (on the blocking pool, like every reply with more than
    /// 4 KiB for the decoder to read).
    /// Leave room for `CLUSTER NODES`, about 126 bytes per node.
    #[must_use]
    pub fn max_reply_size(self, bytes: usize) -> Self {
        self.set(
            bytes >= 1024,
            "max_reply_size must be at least 1 KiB",
            |c| {
                c.conn.max_reply = bytes;
            },
        )
    }

    /// Connects to the seeds, reads the topology and starts the refresher.
    ///
    /// # Errors
    /// [`RedisError::Config`] for a rejected setting, [`RedisError::NoSeed`]
    /// when no seed answers.
    pub async fn build(self) -> Result<ClusterClient, RedisError> {
        if let Some(e) = self.error {
            return Err(RedisError::Config(e));
        }
        if self.cfg.seeds.is_empty() {
            return Err(RedisError::Config(
                "at least one seed address is needed".into(),
            ));
        }
        let trigger = Trigger::default();
        let topo = TopologyRuntime::start()
            .map_err(|e| RedisError::Config(format!("cannot start the topology thread: {e}")))?;
        let inner = Arc::new(Inner {
            cfg: self.cfg,
            table: ArcSwap::from_pointee(SlotTable::empty()),
            pool: RwLock::new(HashMap::default()),
            topo_pool: RwLock::new(HashMap::default()),
            commands_rt: tokio::runtime::Handle::current(),
            topo,
            trigger: trigger.clone(),
            stats: StatsCells::default(),
            baseline: parking_lot::Mutex::new(None),
            full_refresh_turn: tokio::sync::Mutex::new(()),
            rr: AtomicUsize::new(0),
        });
        refresh::full_refresh(&inner, inner.cfg.seeds.clone(), Vec::new()).await?;
        inner
            .topo
            .handle
            .spawn(refresh::run(Arc::downgrade(&inner), trigger));
        Ok(ClusterClient { inner })
    }
}

/// The thread all topology work runs on: the refresher task, its own
/// connections to every node, and (through its blocking pool) the parsing
/// and table building. Commands never share a socket, a queue or a worker
/// thread with it, so a 126 MB full refresh of a 1000-node cluster cannot
/// sit in front of a GET.
struct TopologyRuntime {
    handle: tokio::runtime::Handle,
    /// Dropping it ends the thread's `block_on`, which drops the runtime and
    /// with it every topology task.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl TopologyRuntime {
    fn start() -> std::io::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(2)
            .thread_name("railyard-redis-topology")
            // Blocking-pool threads (the hashing and building) start here.
            .on_thread_start(lower_priority)
            .build()?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("railyard-redis-topology".into())
            .spawn(move || {
                lower_priority();
                rt.block_on(async {
                    let _ = stopped.await;
                });
                // Tasks still running (connections) are dropped with the runtime.
                rt.shutdown_background();
            })?;
        Ok(Self {
            handle,
            _stop: stop,
        })
    }
}

/// Niceness of topology threads: when they compete with command threads for
/// a core, the scheduler gives the command threads ~10x the share.
const TOPOLOGY_NICE: i32 = 10;

/// Lowers the calling thread's CPU priority (Linux: nice is per thread).
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // Safety: gettid takes no arguments; setpriority with PRIO_PROCESS and
        // a thread id changes only that thread's nice value. A failure (e.g.
        // not permitted) leaves the priority as it was, which is harmless.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, TOPOLOGY_NICE);
        }
    }
}

type Pool = RwLock<HashMap<Arc<str>, NodeConn, foldhash::fast::RandomState>>;

/// Removes the entries of `pool` whose address `known` refuses; returns how
/// many went.
///
/// This runs on the topology thread, which has a lower priority than the
/// command threads, and every command read-locks the command pool to find
/// its connection. Holding the write lock there while going over every
/// entry would let a preempted topology thread stall commands. So the stale
/// addresses are found under the read lock, which commands share; the write
/// lock is taken only when there is something to remove, and only to remove
/// those keys. The removed handles are dropped after it is released (a
/// connection's task ends when its last handle goes).
fn drop_unknown<V>(
    pool: &RwLock<HashMap<Arc<str>, V, foldhash::fast::RandomState>>,
    known: impl Fn(&str) -> bool,
) -> usize {
    let stale: Vec<Arc<str>> = pool.read().keys().filter(|a| !known(a)).cloned().collect();
    if stale.is_empty() {
        return 0;
    }
    let gone: Vec<V> = {
        let mut pool = pool.write();
        stale.iter().filter_map(|a| pool.remove(a)).collect()
    };
    gone.len()
}

pub(crate) struct Inner {
    pub(crate) cfg: Config,
    /// The routing table; replaced whole by the refresher, read lock-free.
    pub(crate) table: ArcSwap<SlotTable>,
    /// Command connections by `ip:port`, on the caller's runtime. A
    /// parking_lot lock is right here: it is held for a map lookup or insert
    /// only, never across an await. Lock order: `pool` before `topo_pool`
    /// (they are never held together today).
    pool: Pool,
    /// Topology connections by `ip:port`, on the topology thread.
    topo_pool: Pool,
    /// Where command connections are spawned.
    commands_rt: tokio::runtime::Handle,
    topo: TopologyRuntime,
    trigger: Trigger,
    pub(crate) stats: StatsCells,
    /// What `CLUSTER INFO` said before the current table's refresh began
    /// (`None`: unknown, so the next periodic round compares whole views).
    /// Touched once per round and per full refresh, never across an await.
    pub(crate) baseline: parking_lot::Mutex<Option<refresh::Baseline>>,
    rr: AtomicUsize,
    /// One full refresh at a time (the refresher's and `refresh_now`'s):
    /// one that read its views earlier must not install its table over one
    /// built from later views.
    pub(crate) full_refresh_turn: tokio::sync::Mutex<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.trigger.shutdown();
    }
}

impl Inner {
    /// The command connection to `addr`.
    pub(crate) fn conn(&self, addr: &Arc<str>) -> NodeConn {
        self.get_or_spawn(&self.pool, &self.commands_rt, addr, Some(&self.trigger))
    }

    /// The topology connection to `addr` (never carries commands). Its
    /// losses and failed connects fire no refresh: the refresh that uses it
    /// sees them itself, and a seed that is down (seeds are always refresh
    /// targets) would otherwise trigger a full refresh every backoff, for
    /// ever.
    pub(crate) fn topo_conn(&self, addr: &Arc<str>) -> NodeConn {
        self.get_or_spawn(&self.topo_pool, &self.topo.handle, addr, None)
    }

    fn get_or_spawn(
        &self,
        pool: &Pool,
        rt: &tokio::runtime::Handle,
        addr: &Arc<str>,
        trigger: Option<&Trigger>,
    ) -> NodeConn {
        if let Some(c) = pool.read().get(addr) {
            if !c.is_closed() {
                return c.clone();
            }
        }
        let mut pool = pool.write();
        match pool.get(addr) {
            Some(c) if !c.is_closed() => c.clone(),
            _ => {
                let c = NodeConn::spawn(rt, addr.clone(), self.cfg.conn.clone(), trigger.cloned());
                pool.insert(addr.clone(), c.clone());
                c
            }
        }
    }

    /// Every node of the current table plus the seeds.
    pub(crate) fn refresh_targets(&self) -> Vec<Arc<str>> {
        let t = self.table.load();
        let mut v: Vec<Arc<str>> = t.nodes().to_vec();
        v.extend(self.cfg.seeds.iter().cloned());
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Swaps `table` in and drops connections to nodes it no longer lists.
    pub(crate) fn install(&self, table: SlotTable) {
        let seeds = &self.cfg.seeds;
        // The table first: commands routed meanwhile by the old one would
        // otherwise re-create connections to the nodes being dropped.
        let table = Arc::new(table);
        self.table.store(table.clone());
        let known = |a: &str| table.knows(a) || seeds.iter().any(|s| &**s == a);
        drop_unknown(&self.pool, known);
        drop_unknown(&self.topo_pool, known);
    }

    fn fire(&self, r: Reason) {
        if self.cfg.adaptive {
            self.trigger.fire(r);
        }
    }
}

/// A Redis Cluster client. Cheap to clone; all clones share connections and
/// the slot table. Dropping the last clone stops the refresher and closes
/// the connections.
#[derive(Clone)]
pub struct ClusterClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ClusterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterClient")
            .field("seeds", &self.inner.cfg.seeds)
            .finish_non_exhaustive()
    }
}

enum Redirect {
    Moved(Arc<str>),
    Ask(Arc<str>),
}

fn parse_redirect(e: &str) -> Option<Redirect> {
    let mut it = e.split(' ');
    let kind = it.next()?;
    let _slot = it.next()?;
    let addr: Arc<str> = it.next()?.into();
    match kind {
        "MOVED" => Some(Redirect::Moved(addr)),
        "ASK" => Some(Redirect::Ask(addr)),
        _ => None,
    }
}

fn server_error(node: &Arc<str>, e: &str) -> RedisError {
    let (kind, message) = e.split_once(' ').unwrap_or((e, ""));
    RedisError::Server {
        node: node.clone(),
        kind: kind.to_owned(),
        message: message.to_owned(),
    }
}

fn unexpected(cmd: &str, v: &Value) -> RedisError {
    RedisError::UnexpectedReply {
        command: cmd.to_owned(),
        detail: v.describe(),
    }
}

impl ClusterClient {
    /// A builder with `seeds` (`host:port` of any cluster nodes) and defaults.
    pub fn builder<S: AsRef<str>>(seeds: impl IntoIterator<Item = S>) -> ClusterClientBuilder {
        ClusterClientBuilder {
            cfg: Config {
                seeds: seeds.into_iter().map(|s| Arc::from(s.as_ref())).collect(),
                refresh_period: None,
                adaptive: true,
                adaptive_min_interval: Duration::from_secs(1),
                sample_size: 3,
                deep_check_every: 10,
                refresh_concurrency: 64,
                read_from: ReadFrom::Master,
                command_timeout: Duration::from_secs(2),
                max_redirects: 5,
                retry_delay: Duration::from_millis(20),
                conn: ConnConfig {
                    connect_timeout: Duration::from_secs(1),
                    queue_capacity: 4096,
                    max_in_flight: 1024,
                    backoff_min: Duration::from_millis(50),
                    backoff_max: Duration::from_secs(2),
                    reconnects_before_refresh: 2,
                    protocol: Protocol::Resp2,
                    readonly: false,
                    max_reply: DEFAULT_MAX_REPLY_SIZE,
                },
            },
            error: None,
        }
    }

    /// The current slot table (a snapshot).
    pub fn table(&self) -> Arc<SlotTable> {
        self.inner.table.load_full()
    }

    /// The refresher's counters.
    pub fn refresh_stats(&self) -> RefreshStats {
        self.inner.stats.snapshot()
    }

    /// How many node connections are open right now.
    pub fn connected_nodes(&self) -> usize {
        self.inner
            .pool
            .read()
            .values()
            .filter(|c| c.is_connected())
            .count()
    }

    /// Runs a full topology refresh now and waits for it.
    ///
    /// # Errors
    /// When no node answered.
    pub async fn refresh_now(&self) -> Result<(), RedisError> {
        // On the topology thread, like every refresh, so even an explicit one
        // adds nothing to the caller's runtime.
        let inner = self.inner.clone();
        let task = self.inner.topo.handle.spawn(async move {
            let targets = inner.refresh_targets();
            refresh::full_refresh(&inner, targets, Vec::new()).await
        });
        task.await.unwrap_or(Err(RedisError::Shutdown))
    }

    fn pick(
        &self,
        table: &SlotTable,
        slot: Option<u16>,
        read: bool,
    ) -> Result<Arc<str>, RedisError> {
        let shard = match slot {
            Some(s) => table
                .shard(s)
                .ok_or(RedisError::SlotUncovered { slot: s })?,
            None => {
                let shards = table.shards();
                if shards.is_empty() {
                    return Err(RedisError::SlotUncovered { slot: 0 });
                }
                &shards[self.inner.rr.fetch_add(1, Ordering::Relaxed) % shards.len()]
            }
        };
        if read && self.inner.cfg.read_from == ReadFrom::Replica && !shard.replicas.is_empty() {
            let i = self.inner.rr.fetch_add(1, Ordering::Relaxed) % shard.replicas.len();
            return Ok(shard.replicas[i].clone());
        }
        Ok(shard.master.clone())
    }

    /// Sends `cmd` to the master of its key's slot (any master if it has no
    /// key), following MOVED/ASK and retrying, within the command timeout,
    /// when the command was not sent (node down, `CLUSTERDOWN`, `TRYAGAIN`).
    ///
    /// # Errors
    /// Any [`RedisError`]; error replies become [`RedisError::Server`].
    pub async fn cmd(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        Self::check_stateless(cmd)?;
        self.route(cmd, false).await
    }

    /// Like [`cmd`](Self::cmd) for a read-only command, which may go to a
    /// replica under [`ReadFrom::Replica`].
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd).
    pub async fn cmd_read(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        Self::check_stateless(cmd)?;
        self.route(cmd, true).await
    }

    /// Refuses `cmd` if it would change the shared connection's state (the
    /// typed helpers send only ordinary commands and skip the check).
    fn check_stateless(cmd: &Cmd) -> Result<(), RedisError> {
        if changes_connection_state(cmd) {
            return Err(RedisError::StatefulCommand(cmd.name().to_ascii_uppercase()));
        }
        Ok(())
    }

    async fn route(&self, cmd: &Cmd, read: bool) -> Result<Value, RedisError> {
        let inner = &self.inner;
        let slot = cmd.routing_key().map(|k| key_slot(k));
        let deadline = Instant::now() + inner.cfg.command_timeout;
        let mut redirects = 0u32;
        let mut target: Option<Redirect> = None;
        let mut attempt = 0u32;
        let asking = Cmd::new("ASKING");
        // A read that failed on a replica (down but not yet flagged, still
        // loading) tries the master next: it is there, and the replica may
        // stay unusable for the whole cluster-node-timeout.
        let mut on_replica = read;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let (addr, ask) = match target.take() {
                Some(Redirect::Moved(a)) => (a, false),
                Some(Redirect::Ask(a)) => (a, true),
                None => match self.pick(&inner.table.load(), slot, on_replica) {
                    Ok(a) => (a, false),
                    Err(e) => {
                        inner.fire(Reason::Uncovered);
                        if remaining > inner.cfg.retry_delay {
                            tokio::time::sleep(inner.cfg.retry_delay).await;
                            continue;
                        }
                        return Err(e);
                    }
                },
            };
            if remaining.is_zero() {
                return Err(RedisError::Timeout {
                    node: addr,
                    timeout: inner.cfg.command_timeout,
                });
            }
            let conn = inner.conn(&addr);
            let r = if ask {
                conn.request(&[&asking, cmd], remaining).await
            } else {
                conn.request(&[cmd], remaining).await
            };
            let err = match r {
                Ok(Value::Error(e)) => match parse_redirect(&e) {
                    Some(redirect) => {
                        redirects += 1;
                        if redirects > inner.cfg.max_redirects {
                            return Err(RedisError::TooManyRedirects {
                                slot: slot.unwrap_or(0),
                                max: inner.cfg.max_redirects,
                            });
                        }
                        let to = match &redirect {
                            Redirect::Moved(a) | Redirect::Ask(a) => a,
                        };
                        if !inner.table.load().knows(to) {
                            inner.fire(Reason::UnknownNode);
                        }
                        inner.fire(match redirect {
                            Redirect::Moved(_) => Reason::Moved,
                            Redirect::Ask(_) => Reason::Ask,
                        });
                        target = Some(redirect);
                        continue;
                    }
                    None => server_error(&addr, &e),
                },
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            // Retry only what was certainly not executed. A full queue is
            // back-pressure: the caller hears about it at once.
            let not_sent = matches!(err, RedisError::Disconnected { .. })
                || err.is_retryable() && matches!(err, RedisError::Server { .. });
            match err {
                RedisError::Disconnected { .. } => inner.fire(Reason::ConnectionLost),
                // A node that went silent without a reset never drops its
                // connection: only timeouts tell, and a failover moved its
                // slots elsewhere.
                RedisError::Timeout { .. } => inner.fire(Reason::Timeout),
                _ => {}
            }
            if not_sent {
                on_replica = false;
            }
            let delay = inner.cfg.retry_delay * 2u32.saturating_pow(attempt.min(4));
            if not_sent && deadline.saturating_duration_since(Instant::now()) > delay {
                attempt += 1;
                tokio::time::sleep(delay).await;
                continue;
            }
            return Err(err);
        }
    }

    /// `GET key`.
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd).
    pub async fn get(&self, key: impl ToArg) -> Result<Option<Bytes>, RedisError> {
        match self.route(&Cmd::new("GET").key(key), true).await? {
            Value::Nil => Ok(None),
            Value::Bulk(b) => Ok(Some(b)),
            v => Err(unexpected("GET", &v)),
        }
    }

    /// `SET key value`.
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd).
    pub async fn set(&self, key: impl ToArg, value: impl ToArg) -> Result<(), RedisError> {
        self.set_with(key, value, SetOptions::default())
            .await
            .map(|_| ())
    }

    /// `SET key value [PX ms] [NX|XX] [KEEPTTL]`; `Ok(false)` when NX/XX
    /// prevented the write.
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd); [`RedisError::Config`] for NX with XX.
    pub async fn set_with(
        &self,
        key: impl ToArg,
        value: impl ToArg,
        opts: SetOptions,
    ) -> Result<bool, RedisError> {
        if opts.only_if_absent && opts.only_if_present {
            return Err(RedisError::Config("SET cannot be both NX and XX".into()));
        }
        let mut c = Cmd::new("SET").key(key).arg(value);
        if let Some(t) = opts.expire {
            c = c.arg("PX").arg(t.as_millis().max(1) as u64);
        }
        if opts.only_if_absent {
            c = c.arg("NX");
        }
        if opts.only_if_present {
            c = c.arg("XX");
        }
        if opts.keep_ttl {
            c = c.arg("KEEPTTL");
        }
        match self.route(&c, false).await? {
            Value::Status(_) => Ok(true),
            Value::Nil => Ok(false),
            v => Err(unexpected("SET", &v)),
        }
    }

    fn int(cmd: &str, v: Value) -> Result<i64, RedisError> {
        match v {
            Value::Int(i) => Ok(i),
            v => Err(unexpected(cmd, &v)),
        }
    }

    /// `DEL key...`, split per slot, every slot's command in flight at once;
    /// returns how many keys were removed. Not atomic across slots: with an
    /// error, the other slots' keys may be deleted.
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd) (the error of the lowest failing slot).
    pub async fn del<K: ToArg>(&self, keys: &[K]) -> Result<i64, RedisError> {
        let cmds = group_by_slot(keys.iter().map(ToArg::to_arg))
            .into_iter()
            .map(|(_, group)| {
                group
                    .into_iter()
                    .fold(Cmd::new("DEL"), |c, (_, k)| c.key(k))
            });
        let mut total = 0;
        for n in self.per_slot(cmds).await? {
            total += Self::int("DEL", n)?;
        }
        Ok(total)
    }

    /// `EXPIRE key seconds`; whether the key exists.
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd).
    pub async fn expire(&self, key: impl ToArg, ttl: Duration) -> Result<bool, RedisError> {
        let v = self
            .route(
                &Cmd::new("PEXPIRE").key(key).arg(ttl.as_millis() as u64),
                false,
            )
            .await?;
        Ok(Self::int("PEXPIRE", v)? == 1)
    }

    /// `INCR key`.
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd).
    pub async fn incr(&self, key: impl ToArg) -> Result<i64, RedisError> {
        Self::int("INCR", self.route(&Cmd::new("INCR").key(key), false).await?)
    }

    /// `MGET`, one command per slot, all in flight at once; values in key order.
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd).
    pub async fn mget<K: ToArg>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, RedisError> {
        let groups = group_by_slot(keys.iter().map(ToArg::to_arg));
        let futs = groups.into_iter().map(|(_, group)| async move {
            let mut c = Cmd::new("MGET");
            for (_, k) in &group {
                c = c.key(k);
            }
            let v = self.route(&c, true).await?;
            Ok::<_, RedisError>((group, v))
        });
        let mut out = vec![None; keys.len()];
        for r in futures::future::join_all(futs).await {
            let (group, v) = r?;
            let Value::Array(vals) = v else {
                return Err(unexpected("MGET", &v));
            };
            if vals.len() != group.len() {
                return Err(RedisError::UnexpectedReply {
                    command: "MGET".into(),
                    detail: format!("{} values for {} keys", vals.len(), group.len()),
                });
            }
            for ((i, _), v) in group.into_iter().zip(vals) {
                out[i] = v.as_bytes().cloned();
            }
        }
        Ok(out)
    }

    /// `MSET`, one command per slot (atomic per slot only).
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd).
    pub async fn mset<K: ToArg, V: ToArg>(&self, pairs: &[(K, V)]) -> Result<(), RedisError> {
        let values: Vec<Bytes> = pairs.iter().map(|(_, v)| v.to_arg()).collect();
        let cmds = group_by_slot(pairs.iter().map(|(k, _)| k.to_arg()))
            .into_iter()
            .map(|(_, group)| {
                group
                    .into_iter()
                    .fold(Cmd::new("MSET"), |c, (i, k)| c.key(k).arg(&values[i]))
            });
        self.per_slot(cmds).await.map(drop)
    }

    /// Runs each of `cmds` (one per slot, routed as [`cmd`](Self::cmd) routes,
    /// without its stateful-command check: the typed helpers build only
    /// plain commands), all in flight at once; their answers in order, or
    /// the first error in order.
    async fn per_slot(&self, cmds: impl Iterator<Item = Cmd>) -> Result<Vec<Value>, RedisError> {
        let cmds: Vec<Cmd> = cmds.collect();
        futures::future::join_all(cmds.iter().map(|c| self.route(c, false)))
            .await
            .into_iter()
            .collect()
    }

    /// `HSET key field value`; 1 if the field is new.
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd).
    pub async fn hset(
        &self,
        key: impl ToArg,
        field: impl ToArg,
        value: impl ToArg,
    ) -> Result<i64, RedisError> {
        Self::int(
            "HSET",
            self.route(&Cmd::new("HSET").key(key).arg(field).arg(value), false)
                .await?,
        )
    }

    /// `HGET key field`.
    ///
    /// # Errors
    /// As [`cmd`](Self::cmd).
    pub async fn hget(
        &self,
        key: impl ToArg,
        field: impl ToArg,
    ) -> Result<Option<Bytes>, RedisError> {
        match self
            .route(&Cmd::new("HGET").key(key).arg(field), true)
            .await?
        {
            Value::Nil => Ok(None),
            Value::Bulk(b) => Ok(Some(b)),
            v => Err(unexpected("HGET", &v)),
        }
    }

    /// `EVALSHA sha numkeys keys... args...`; every key must hash to one slot.
    ///
    /// # Errors
    /// [`RedisError::CrossSlot`]; `NOSCRIPT` as [`RedisError::Server`].
    pub async fn evalsha<K: ToArg, A: ToArg>(
        &self,
        sha: &str,
        keys: &[K],
        args: &[A],
    ) -> Result<Value, RedisError> {
        let keys: Vec<Bytes> = keys.iter().map(ToArg::to_arg).collect();
        if keys.windows(2).any(|w| key_slot(&w[0]) != key_slot(&w[1])) {
            return Err(RedisError::CrossSlot {
                command: "EVALSHA".into(),
            });
        }
        let mut c = Cmd::new("EVALSHA").arg(sha).arg(keys.len());
        for k in keys {
            c = c.key(k);
        }
        for a in args {
            c = c.arg(a.to_arg());
        }
        self.route(&c, false).await
    }
}

/// Groups keys by slot, keeping each key's original index.
fn group_by_slot(keys: impl Iterator<Item = Bytes>) -> Vec<(u16, Vec<(usize, Bytes)>)> {
    let mut map: HashMap<u16, Vec<(usize, Bytes)>, foldhash::fast::RandomState> =
        HashMap::default();
    for (i, k) in keys.enumerate() {
        map.entry(key_slot(&k)).or_default().push((i, k));
    }
    let mut v: Vec<_> = map.into_iter().collect();
    v.sort_by_key(|(s, _)| *s);
    v
}

/// Whether `cmd` would change the state of the connection it is sent on: on
/// the connection every caller shares, a `MULTI` would turn other callers'
/// writes into `QUEUED`, a subscription or client tracking would put push
/// frames between replies, and a blocking pop (often with no timeout) would
/// hold up every caller of that node. `WAIT` stays allowed: it is bounded
/// by its own timeout, like any slow command.
fn changes_connection_state(cmd: &Cmd) -> bool {
    const STATEFUL: &[&[u8]] = &[
        b"MULTI",
        b"EXEC",
        b"DISCARD",
        b"WATCH",
        b"UNWATCH",
        b"SUBSCRIBE",
        b"PSUBSCRIBE",
        b"SSUBSCRIBE",
        b"UNSUBSCRIBE",
        b"PUNSUBSCRIBE",
        b"SUNSUBSCRIBE",
        b"MONITOR",
        b"RESET",
        b"QUIT",
        b"HELLO",
        b"AUTH",
        b"READONLY",
        b"READWRITE",
        b"SYNC",
        b"PSYNC",
        b"BLPOP",
        b"BRPOP",
        b"BRPOPLPUSH",
        b"BLMOVE",
        b"BLMPOP",
        b"BZPOPMIN",
        b"BZPOPMAX",
        b"BZMPOP",
    ];
    // The name's bytes, not a copy: this runs for every command.
    let Some(name) = cmd.arg_at(0) else {
        return false;
    };
    let is = |s: &[u8]| name.eq_ignore_ascii_case(s);
    if is(b"CLIENT") {
        // CLIENT TRACKING / REPLY change the connection; CLIENT INFO etc. do not.
        return cmd.arg_at(1).is_some_and(|a| {
            a.eq_ignore_ascii_case(b"TRACKING") || a.eq_ignore_ascii_case(b"REPLY")
        });
    }
    if is(b"XREAD") || is(b"XREADGROUP") {
        // BLOCK is an option before STREAMS; after it come stream names.
        return (1..)
            .map_while(|i| cmd.arg_at(i))
            .take_while(|a| !a.eq_ignore_ascii_case(b"STREAMS"))
            .any(|a| a.eq_ignore_ascii_case(b"BLOCK"));
    }
    STATEFUL.iter().any(|s| is(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_of(addrs: &[&str]) -> RwLock<HashMap<Arc<str>, u32, foldhash::fast::RandomState>> {
        RwLock::new(addrs.iter().map(|a| (Arc::from(*a), 0)).collect())
    }

    fn addrs<V>(pool: &RwLock<HashMap<Arc<str>, V, foldhash::fast::RandomState>>) -> Vec<String> {
        let mut v: Vec<String> = pool.read().keys().map(|a| a.to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn a_table_that_drops_nothing_never_takes_the_write_lock() {
        let pool = Arc::new(pool_of(&["a:1", "b:1", "c:1"]));
        // A command holds the read lock throughout: taking the write lock
        // would wait for it forever.
        let reader = pool.read();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let p = pool.clone();
        std::thread::spawn(move || {
            let n = drop_unknown(&p, |a| ["a:1", "b:1", "c:1", "d:1"].contains(&a));
            let _ = done_tx.send(n);
        });
        // A generous bound that only a deadlock reaches; not a timing claim.
        let n = done_rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("drop_unknown waited for the write lock with nothing to drop");
        assert_eq!(n, 0);
        drop(reader);
        assert_eq!(addrs(&pool), ["a:1", "b:1", "c:1"]);
    }

    #[test]
    fn only_unknown_addresses_are_dropped() {
        let pool = pool_of(&["a:1", "b:1", "c:1", "seed:1"]);
        let known = |a: &str| ["b:1", "seed:1", "new:1"].contains(&a);
        assert_eq!(drop_unknown(&pool, known), 2);
        assert_eq!(addrs(&pool), ["b:1", "seed:1"]);
        // Again: nothing left to drop.
        assert_eq!(drop_unknown(&pool, known), 0);
        assert_eq!(addrs(&pool), ["b:1", "seed:1"]);
    }
}
