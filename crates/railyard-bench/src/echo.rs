//! Seed 001: echo round trips in a fixed window.
//!
//! `instances` testers, spread over the event loops. Each registers one echo
//! consumer at `echo` (a `consumer` or a `local_consumer`) and drives its
//! share of the `in_flight` concurrent chains. A chain sends to `echo`; when
//! the echo comes back it counts one round trip and sends again.
//! - send-reply: the chain `request`s, the echoer `reply`s.
//! - send-send: the chain registers its own consumer at a unique address and
//!   passes it in the `replyTo` header; the echoer `send`s to it.
//!
//! Round trips are counted per instance; the window opens after the warm-up
//! and only round trips completed inside it count.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use railyard_bus::{DeliveryOptions, EventBus};
use serde::{Deserialize, Serialize};

use crate::cluster::{self, ClusterBenchError, ClusterTarget, ServeConfig, ServerProcess};
use crate::loops::{EventLoops, RuntimeKind};

/// The seed's message body.
const BODY: &str = ":)";

/// Which registration the echoer (and send-send reply consumers) use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConsumerKind {
    /// `consumer`: visible cluster-wide once clustered.
    Consumer,
    /// `local_consumer`: never leaves the node.
    Local,
}

/// Delivery options used for every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Delivery {
    /// `DeliveryOptions::default()`.
    Default,
    /// `local_only = true`.
    LocalOnly,
}

/// How a round trip is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// request + reply.
    SendReply,
    /// send + send to a per-chain reply address.
    SendSend,
}

impl ConsumerKind {
    /// The CLI / JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ConsumerKind::Consumer => "consumer",
            ConsumerKind::Local => "local",
        }
    }
}

impl Delivery {
    /// The CLI / JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Delivery::Default => "default",
            Delivery::LocalOnly => "local-only",
        }
    }
}

impl Method {
    /// The CLI / JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::SendReply => "send-reply",
            Method::SendSend => "send-send",
        }
    }
}

/// Echo settings.
#[derive(Debug, Clone)]
pub struct EchoConfig {
    /// Measured window.
    pub duration: Duration,
    /// Not counted, before the window.
    pub warmup: Duration,
    /// Tester instances.
    pub instances: usize,
    /// Total concurrent chains over all instances.
    pub in_flight: usize,
    /// Echoer registration kind.
    pub consumer: ConsumerKind,
    /// Delivery options.
    pub delivery: Delivery,
    /// Round-trip method.
    pub method: Method,
    /// Threads the instances are spread over.
    pub loops: usize,
    /// How tasks are scheduled on those threads.
    pub runtime: RuntimeKind,
    /// `None`: a plain bus. `Some`: a bus joined to etcd, and with two nodes
    /// the echoers in a second process.
    pub cluster: Option<ClusterTarget>,
}

/// One echo run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EchoResult {
    /// Always `echo`.
    pub scenario: String,
    /// `railyard` or a peer's name.
    pub system: String,
    /// Cluster manager (`none`).
    pub cluster: String,
    /// `consumer` or `local`.
    pub consumer: String,
    /// `default` or `local-only`.
    pub delivery: String,
    /// `send-reply` or `send-send`.
    pub method: String,
    /// Tester instances.
    pub instances: usize,
    /// Total concurrent chains.
    pub in_flight: usize,
    /// Measured window, seconds.
    pub duration_s: f64,
    /// Warm-up, seconds.
    #[serde(default)]
    pub warmup_s: f64,
    /// Round trips completed inside the window.
    pub round_trips: u64,
    /// `round_trips / duration_s`.
    pub round_trips_per_s: f64,
    /// Round trips that failed inside the window (a failed request, an echo
    /// with another body, a send refused): not counted in `round_trips`.
    #[serde(default)]
    pub failures: u64,
    /// Processes (nodes) the run used: 1, or 2 with the echoers in the second.
    #[serde(default = "one")]
    pub nodes: usize,
    /// Railyard only: `loops` or `multi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// Railyard only: threads used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<usize>,
    /// A cache line's round trip between two threads, ns, measured just
    /// before the run and just after it ([`crate::probe`]): which of the
    /// machine's modes the run had. Set by the bench, for either system.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line_ns: Option<[f64; 2]>,
}

fn one() -> usize {
    1
}

const ECHO: &str = "echo";
/// The header that carries a send-send chain's reply address.
pub(crate) const REPLY_TO: &str = "replyTo";

/// One tester instance's counters: one per chain, and its failures.
struct Instance {
    chains: Box<[CachePadded<AtomicU64>]>,
    /// Rare: one shared counter, added to atomically.
    failures: CachePadded<AtomicU64>,
}

impl Instance {
    fn new(chains: usize) -> Self {
        Self {
            chains: (0..chains)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
            failures: CachePadded::new(AtomicU64::new(0)),
        }
    }

    /// Counts one round trip that failed.
    fn fail(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one round trip of chain `c`. A chain is sequential (one task,
    /// or one consumer whose handler runs one message at a time), so only one
    /// thread at a time writes its counter: a relaxed load + store is exact
    /// and, unlike `fetch_add`, costs no locked instruction.
    #[inline]
    fn count(&self, c: usize) {
        let n = &self.chains[c];
        n.store(n.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    fn total(&self) -> u64 {
        self.chains.iter().map(|n| n.load(Ordering::Relaxed)).sum()
    }
}

/// Runs echo on Railyard's bus; `progress` is called about every 100 ms with
/// the elapsed time and the round trips so far.
///
/// # Errors
/// [`ClusterBenchError`] when a clustered run cannot be set up.
///
/// # Panics
/// If a bench task panics or registration fails.
pub async fn run(
    cfg: &EchoConfig,
    mut progress: impl FnMut(Duration, u64),
) -> Result<EchoResult, ClusterBenchError> {
    let (loops, bus, node) = match &cfg.cluster {
        None => (
            EventLoops::new(cfg.loops, cfg.runtime),
            EventBus::new(),
            None,
        ),
        Some(t) => {
            let loops = EventLoops::with_io(cfg.loops, cfg.runtime);
            let (bus, node) = cluster::join_on(&loops, 0, &t.etcd, "bench").await?;
            (loops, bus, Some(node))
        }
    };
    let two_nodes = cfg.cluster.as_ref().is_some_and(|t| t.nodes >= 2);
    let server = match &cfg.cluster {
        Some(t) if two_nodes => {
            let serve = ServeConfig {
                address: ECHO.into(),
                instances: cfg.instances.max(1),
                consumer: cfg.consumer,
                method: cfg.method,
                loops: cfg.loops,
            };
            let server = ServerProcess::start(t, &serve).await?;
            cluster::wait_routed(&bus, &[ECHO.to_owned()]).await?;
            Some(server)
        }
        _ => None,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let opts = Arc::new(DeliveryOptions::new().local_only(cfg.delivery == Delivery::LocalOnly));
    let n = cfg.instances.max(1);
    let share = |i: usize| cfg.in_flight / n + usize::from(i < cfg.in_flight % n);
    let instances: Vec<Arc<Instance>> = (0..n).map(|i| Arc::new(Instance::new(share(i)))).collect();

    // Echoes this process's echoers could not send (the chain ends there).
    let echo_failures = Arc::new(AtomicU64::new(0));
    // Register every echoer first, so no chain starts against a partial set.
    // With two nodes the echoers live in the other process.
    for (i, _) in instances.iter().enumerate().filter(|_| !two_nodes) {
        let bus = bus.clone();
        let opts = opts.clone();
        let kind = cfg.consumer;
        let method = cfg.method;
        let echo_failures = echo_failures.clone();
        loops
            .run_on(i, async move {
                let b = match kind {
                    ConsumerKind::Consumer => bus.consumer(ECHO),
                    ConsumerKind::Local => bus.local_consumer(ECHO),
                };
                match method {
                    Method::SendReply => {
                        b.handler(|mut m| async move {
                            let body = m.take_body();
                            let _ = m.reply(body);
                        })
                        .await
                    }
                    Method::SendSend => {
                        let echo_bus = bus.clone();
                        b.handler(move |mut m| {
                            let body = m.take_body();
                            if let Some(to) = m.headers().get(REPLY_TO) {
                                if echo_bus.send_with(to, body, &opts).is_err() {
                                    echo_failures.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            std::future::ready(())
                        })
                        .await
                    }
                }
                .expect("register the echo consumer");
            })
            .await;
    }

    for (i, inst) in instances.iter().enumerate() {
        let share = share(i);
        let (bus, opts, stop, inst) = (bus.clone(), opts.clone(), stop.clone(), inst.clone());
        match cfg.method {
            Method::SendReply => {
                for c in 0..share {
                    let (bus, opts, stop, inst) =
                        (bus.clone(), opts.clone(), stop.clone(), inst.clone());
                    loops.spawn_on(i, send_reply_chain(bus, opts, stop, inst, c));
                }
            }
            Method::SendSend => {
                let kind = cfg.consumer;
                let kicks = loops
                    .run_on(
                        i,
                        send_send_chains(bus.clone(), opts, stop, inst, share, i, kind),
                    )
                    .await;
                if two_nodes {
                    // The echoers must route to every reply address before a
                    // chain starts, or its first echo would find no handler.
                    let addresses: Vec<String> = kicks.iter().map(|(a, _)| a.clone()).collect();
                    cluster::wait_visible_remotely(&bus, &addresses).await?;
                }
                let b = bus.clone();
                loops
                    .run_on(i, async move {
                        for (_, opts) in kicks {
                            let _ = b.send_with(ECHO, String::from(BODY), &opts);
                        }
                    })
                    .await;
            }
        }
    }

    let total = || instances.iter().map(|i| i.total()).sum::<u64>();
    let failed = || {
        instances
            .iter()
            .map(|i| i.failures.load(Ordering::Relaxed))
            .sum::<u64>()
            + echo_failures.load(Ordering::Relaxed)
    };
    let start = Instant::now();
    let end_warmup = start + cfg.warmup;
    let end = end_warmup + cfg.duration;
    let mut at_window_start = None;
    let tick = Duration::from_millis(100);
    loop {
        let now = Instant::now();
        if at_window_start.is_none() && now >= end_warmup {
            at_window_start = Some((total(), failed(), now));
        }
        if now >= end {
            break;
        }
        progress(now - start, total());
        let next = (now + tick).min(if at_window_start.is_none() {
            end_warmup
        } else {
            end
        });
        tokio::time::sleep_until(next.into()).await;
    }
    let (c0, f0, t0) = at_window_start.expect("the window opened before it closed");
    let c1 = total();
    let failures = failed() - f0;
    let measured = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    // Leave before the loops stop (see `cluster::leave_bounded`).
    if let Some(n) = node {
        cluster::leave_bounded(n).await;
    }
    drop(loops);
    if let Some(s) = server {
        s.stop().await;
    }
    let round_trips = c1 - c0;
    Ok(EchoResult {
        scenario: "echo".into(),
        system: "railyard".into(),
        cluster: cfg.cluster.as_ref().map_or("none", |t| t.name()).into(),
        consumer: cfg.consumer.as_str().into(),
        delivery: cfg.delivery.as_str().into(),
        method: cfg.method.as_str().into(),
        instances: n,
        in_flight: cfg.in_flight,
        duration_s: cfg.duration.as_secs_f64(),
        warmup_s: cfg.warmup.as_secs_f64(),
        round_trips,
        round_trips_per_s: round_trips as f64 / measured.as_secs_f64(),
        failures,
        nodes: if two_nodes { 2 } else { 1 },
        runtime: Some(cfg.runtime.as_str().into()),
        threads: Some(cfg.loops),
        line_ns: None,
    })
}

/// One send-reply chain: a task that requests, counts the echo and requests again.
async fn send_reply_chain(
    bus: EventBus,
    opts: Arc<DeliveryOptions>,
    stop: Arc<AtomicBool>,
    inst: Arc<Instance>,
    chain: usize,
) {
    let mut body = railyard_bus::Body::new(String::from(BODY));
    while !stop.load(Ordering::Relaxed) {
        match bus.request_with(ECHO, body, &opts).await {
            // Only the echo of what was sent counts, as the peer checks.
            Ok(mut m) if m.body::<String>().is_some_and(|b| b == BODY) => {
                body = m.take_body();
                inst.count(chain);
            }
            Ok(_) => {
                tracing::warn!("an echo came back with another body; not counted");
                inst.fail();
                body = railyard_bus::Body::new(String::from(BODY));
            }
            Err(e) => {
                // Not a round trip: only echoes that came back count.
                tracing::warn!(error = %e, "echo request failed");
                inst.fail();
                body = railyard_bus::Body::new(String::from(BODY));
            }
        }
    }
}

async fn send_send_chains(
    bus: EventBus,
    opts: Arc<DeliveryOptions>,
    stop: Arc<AtomicBool>,
    inst: Arc<Instance>,
    chains: usize,
    instance: usize,
    kind: ConsumerKind,
) -> Vec<(String, Arc<DeliveryOptions>)> {
    let mut kicks = Vec::with_capacity(chains);
    for c in 0..chains {
        let address = format!("echo.reply.{instance}.{c}");
        let send_opts = Arc::new(DeliveryOptions::clone(&opts).header(REPLY_TO, address.clone()));
        let b = match kind {
            ConsumerKind::Consumer => bus.consumer(address.clone()),
            ConsumerKind::Local => bus.local_consumer(address.clone()),
        };
        let (hb, ho, hs, hi) = (bus.clone(), send_opts.clone(), stop.clone(), inst.clone());
        // A synchronous handler (a ready future), like the peer's: nothing is
        // cloned per message.
        b.handler(move |mut m| {
            if !hs.load(Ordering::Relaxed) {
                // Only the echo of what was sent counts, as the peer checks.
                let body = if m.body::<String>().is_some_and(|b| b == BODY) {
                    hi.count(c);
                    m.take_body()
                } else {
                    tracing::warn!("an echo came back with another body; not counted");
                    hi.fail();
                    railyard_bus::Body::new(String::from(BODY))
                };
                if hb.send_with(ECHO, body, &ho).is_err() {
                    // The chain ends here.
                    hi.fail();
                }
            }
            std::future::ready(())
        })
        .await
        .expect("register a reply consumer");
        // The reply address is registered: the chain may start.
        kicks.push((address, send_opts));
    }
    kicks
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ClusterTarget;

    /// A clustered run leaves etcd as it found it: its node's keys are gone
    /// when the run returns, not one lease TTL later. Until 2026-11-28 the
    /// run stopped its loops first, where its etcd client and the manager's
    /// tasks live, so the lease could not be revoked and the node stayed
    /// listed into the next run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_clustered_run_leaves_no_keys_behind() {
        let etcd = railyard_cluster::EtcdServer::start().expect("etcd starts");
        let cfg = EchoConfig {
            duration: Duration::from_millis(200),
            warmup: Duration::from_millis(100),
            instances: 2,
            in_flight: 8,
            consumer: ConsumerKind::Consumer,
            delivery: Delivery::Default,
            method: Method::SendSend,
            loops: 2,
            runtime: RuntimeKind::Loops,
            cluster: Some(ClusterTarget {
                etcd: etcd.endpoint(),
                nodes: 1,
                exe: std::path::PathBuf::new(),
            }),
        };
        let r = run(&cfg, |_, _| {}).await.expect("the run completes");
        assert!(r.round_trips > 0, "{r:?}");
        let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
            .await
            .unwrap();
        let left = c
            .get(
                "/railyard/",
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_keys_only(),
                ),
            )
            .await
            .unwrap();
        let keys: Vec<String> = left
            .kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .collect();
        assert!(keys.is_empty(), "left in etcd: {keys:?}");
    }
}
