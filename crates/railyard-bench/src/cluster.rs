//! Clustered runs: a bus joined to etcd, and a second `railyard` process
//! that hosts the consumers when a scenario runs on two nodes.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use railyard_bus::EventBus;
use railyard_cluster::{ClusterConfig, ClusterNode, EtcdConfig, EtcdManager};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::echo::{ConsumerKind, Method};
use crate::loops::{EventLoops, RuntimeKind};

/// Where a clustered scenario runs.
#[derive(Debug, Clone)]
pub struct ClusterTarget {
    /// etcd client endpoint.
    pub etcd: String,
    /// 1: everything in this process (clustered bus, local delivery);
    /// 2: the consumers live in a second `railyard` process.
    pub nodes: usize,
    /// The `railyard` executable that serves the second node.
    pub exe: PathBuf,
}

impl ClusterTarget {
    /// The JSON spelling of the cluster manager.
    pub fn name(&self) -> &'static str {
        "etcd"
    }
}

/// Why a clustered run could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ClusterBenchError {
    /// etcd or the transport.
    #[error("joining the cluster: {0}")]
    Join(String),
    /// The second process.
    #[error("the second node: {0}")]
    Server(String),
}

static NEXT: AtomicU64 = AtomicU64::new(1);

/// A bus joined to the cluster as a fresh node.
///
/// # Errors
/// [`ClusterBenchError::Join`] if etcd is unreachable or the transport
/// cannot listen.
pub async fn join(etcd: &str, role: &str) -> Result<(EventBus, ClusterNode), ClusterBenchError> {
    let bus = EventBus::new();
    let manager = EtcdManager::connect(EtcdConfig::new(vec![etcd.to_owned()]))
        .await
        .map_err(|e| ClusterBenchError::Join(e.to_string()))?;
    let id = format!(
        "bench-{role}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let cfg = ClusterConfig::new(id, "127.0.0.1:0".parse().expect("a valid address"));
    let node = ClusterNode::start(bus.clone(), Arc::new(manager), cfg)
        .await
        .map_err(|e| ClusterBenchError::Join(e.to_string()))?;
    Ok((bus, node))
}

/// [`join`] run on loop `i` of `loops`: the node's tasks (links, membership)
/// then live on that loop, so traffic between a link and the consumers or
/// senders on the same loop never crosses threads.
///
/// # Errors
/// As [`join`].
pub async fn join_on(
    loops: &EventLoops,
    i: usize,
    etcd: &str,
    role: &'static str,
) -> Result<(EventBus, ClusterNode), ClusterBenchError> {
    let etcd = etcd.to_owned();
    loops
        .run_on(i, async move { join(&etcd, role).await })
        .await
}

/// Waits (at most 20 s) until `bus` routes each of `addresses` to another node.
///
/// # Errors
/// [`ClusterBenchError::Server`] naming the first address still missing.
pub async fn wait_routed(bus: &EventBus, addresses: &[String]) -> Result<(), ClusterBenchError> {
    for _ in 0..2000 {
        let routed = bus.remote_addresses();
        if addresses.iter().all(|a| routed.contains(a)) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let routed = bus.remote_addresses();
    let missing = addresses.iter().find(|a| !routed.contains(a));
    Err(ClusterBenchError::Server(format!(
        "no route to {missing:?} after 20 s"
    )))
}

/// The second node's service that says whether it routes given addresses.
pub const ROUTES_PROBE: &str = "railyard.bench.routes";

/// Waits (at most 20 s) until the second node routes every one of
/// `addresses` back to this node.
///
/// # Errors
/// [`ClusterBenchError::Server`] if it never does.
pub async fn wait_visible_remotely(
    bus: &EventBus,
    addresses: &[String],
) -> Result<(), ClusterBenchError> {
    wait_routed(bus, &[ROUTES_PROBE.to_owned()]).await?;
    let wanted = serde_json::Value::from(addresses.to_vec());
    for _ in 0..400 {
        if let Ok(m) = bus.request(ROUTES_PROBE, wanted.clone()).await {
            if m.body::<u64>() == Some(&1) {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(ClusterBenchError::Server(
        "the second node never routed the reply addresses back to this one".into(),
    ))
}

/// What the second node hosts.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address of the consumers.
    pub address: String,
    /// How many consumers (one per event loop, round-robin).
    pub instances: usize,
    /// Consumer kind.
    pub consumer: ConsumerKind,
    /// send-reply: reply; send-send: send to the `replyTo` header.
    pub method: Method,
    /// Event loops.
    pub loops: usize,
}

/// Runs the second node until stdin closes (the bench exits or dies) or
/// the process is signalled: consumers at `address`, then `READY` on stdout.
///
/// # Errors
/// [`ClusterBenchError`] if joining or registering fails.
pub async fn serve(etcd: &str, cfg: &ServeConfig) -> Result<(), ClusterBenchError> {
    let loops = EventLoops::with_io(cfg.loops.max(1), RuntimeKind::Loops);
    let (bus, node) = join_on(&loops, 0, etcd, "server").await?;
    for i in 0..cfg.instances.max(1) {
        let (bus, address, kind, method) =
            (bus.clone(), cfg.address.clone(), cfg.consumer, cfg.method);
        loops
            .run_on(i, async move {
                let b = match kind {
                    ConsumerKind::Consumer => bus.consumer(address),
                    ConsumerKind::Local => bus.local_consumer(address),
                };
                let echo_bus = bus.clone();
                b.handler(move |mut m| {
                    let body = m.take_body();
                    match method {
                        Method::SendReply => {
                            let _ = m.reply(body);
                        }
                        Method::SendSend => {
                            if let Some(to) = m.headers().get(crate::echo::REPLY_TO) {
                                let _ = echo_bus.send(to, body);
                            }
                        }
                    }
                    std::future::ready(())
                })
                .await
                .map_err(|e| ClusterBenchError::Join(e.to_string()))
            })
            .await?;
    }
    // Answers whether this node routes every address in a JSON array to
    // another node, so a driver can wait until its reply addresses are
    // visible here before starting chains.
    let probe_bus = bus.clone();
    let _probe = bus
        .consumer(ROUTES_PROBE)
        .handler(move |mut m| {
            let wanted = m.body::<serde_json::Value>().cloned().unwrap_or_default();
            let routed = probe_bus.remote_addresses();
            let all = wanted.as_array().is_some_and(|a| {
                a.iter()
                    .all(|v| v.as_str().is_some_and(|s| routed.iter().any(|r| r == s)))
            });
            let _ = m.reply(u64::from(all));
            std::future::ready(())
        })
        .await
        .map_err(|e| ClusterBenchError::Join(e.to_string()))?;
    println!("READY {}", node.node_id());
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(_)) = lines.next_line().await {}
    // Leave while the loops still run: the etcd client and the manager's
    // tasks live on loop 0, so after the loops the lease could not be
    // revoked and the node stayed listed for one more TTL.
    leave_bounded(node).await;
    drop(loops);
    Ok(())
}

/// Leaves the cluster, waiting at most 10 s (a bench run must end even if
/// etcd no longer answers; the lease then expires on its own).
pub(crate) async fn leave_bounded(node: ClusterNode) {
    match tokio::time::timeout(Duration::from_secs(10), node.leave()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "leaving the cluster failed; the node's lease will expire on its own")
        }
        Err(_) => tracing::warn!(
            "leaving the cluster took over 10 s; the node's lease will expire on its own"
        ),
    }
}

/// The second node, as a child process; killed on drop.
pub struct ServerProcess {
    child: Child,
}

impl ServerProcess {
    /// Starts `exe bench serve ...` and waits for its `READY` line.
    ///
    /// # Errors
    /// [`ClusterBenchError::Server`] if it cannot start or never gets ready.
    pub async fn start(
        target: &ClusterTarget,
        cfg: &ServeConfig,
    ) -> Result<ServerProcess, ClusterBenchError> {
        let mut child = Command::new(&target.exe)
            .args([
                "bench",
                "serve",
                "--etcd",
                &target.etcd,
                "--address",
                &cfg.address,
                "--instances",
                &cfg.instances.to_string(),
                "--consumer",
                cfg.consumer.as_str(),
                "--method",
                cfg.method.as_str(),
                "--loops",
                &cfg.loops.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                ClusterBenchError::Server(format!("cannot start {}: {e}", target.exe.display()))
            })?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with("READY") {
                    return true;
                }
            }
            false
        })
        .await
        .unwrap_or(false);
        if !ready {
            let _ = child.kill().await;
            return Err(ClusterBenchError::Server(
                "it exited or did not report READY within 30 s".into(),
            ));
        }
        Ok(ServerProcess { child })
    }
}

impl ServerProcess {
    /// Asks it to leave the cluster (by closing its stdin) and waits up to
    /// 5 s for it to exit, then kills it. A clean leave matters: otherwise
    /// its routes linger until its etcd lease expires.
    pub async fn stop(mut self) {
        drop(self.child.stdin.take());
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}
