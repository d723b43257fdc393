//! A real Redis Cluster on loopback, from Debian's `redis-server` and
//! `redis-cli` (no Docker): used by `railyard dev redis-cluster`, the tests
//! and the bench.
//!
//! Each node runs daemonized with its files (config, pid, log) in one
//! directory; [`LocalCluster::down`] (or dropping an owned cluster) stops the
//! nodes and removes the directory. Bus ports are `port + 10000`, so keep the
//! highest port at or below 22767 (out of the ephemeral range).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::topology::fingerprint;
use crate::value::{Cmd, Protocol, Reply, ReplyDecoder, Value, DEFAULT_MAX_REPLY_SIZE};

/// Why a local cluster could not be started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum LocalClusterError {
    /// A tool is missing.
    #[error("`{0}` not found: install it with `apt-get install -y redis-server redis-tools`")]
    Missing(&'static str),
    /// Bad parameters.
    #[error("invalid cluster layout: {0}")]
    Layout(String),
    /// A command failed.
    #[error("{0}")]
    Failed(String),
    /// File system trouble.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
    /// The nodes did not agree in time.
    #[error("the cluster did not converge within {0:?}: {1}")]
    NotConverged(Duration, String),
}

/// The highest base port whose bus port stays below the ephemeral range.
pub const MAX_PORT: u16 = 22767;

/// A running local cluster.
#[derive(Debug)]
pub struct LocalCluster {
    dir: PathBuf,
    ports: Vec<u16>,
    /// Stop the nodes and remove the files on drop (tests); `false` for
    /// `railyard dev`, whose cluster outlives the command.
    owned: bool,
}

/// Sends one command on a fresh connection and returns the reply.
///
/// # Errors
/// I/O errors and protocol errors as strings.
pub async fn query(addr: &str, cmd: &Cmd) -> Result<Value, String> {
    let fut = async {
        let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        s.write_all(&cmd.encode())
            .await
            .map_err(|e| e.to_string())?;
        let mut buf = BytesMut::with_capacity(4096);
        let mut reply = ReplyDecoder::new(Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE);
        loop {
            match reply.next_reply(&mut buf)? {
                Some(Reply::Value(v)) => return Ok(v),
                Some(Reply::Framed(f)) => {
                    return f
                        .decode_on_blocking_pool()
                        .await
                        .unwrap_or_else(|| Err("the runtime is shutting down".to_owned()));
                }
                None => {}
            }
            if s.read_buf(&mut buf).await.map_err(|e| e.to_string())? == 0 {
                return Err("connection closed".to_owned());
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .map_err(|_| format!("{addr} did not answer within 5s"))?
}

fn have(tool: &'static str) -> Result<(), LocalClusterError> {
    let ok = std::process::Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        Ok(())
    } else {
        Err(LocalClusterError::Missing(tool))
    }
}

/// Finds `n` consecutive ports (and their bus ports) free on loopback, in
/// 20000..=22767, starting from a pseudo-random point. A range handed out
/// is never handed out again in this process: parallel tests could
/// otherwise both find one free before either's servers bound it (a
/// daemonized `redis-server` that fails to bind still exits 0), and mix
/// two clusters.
pub fn free_base_port(n: usize) -> Option<u16> {
    static TAKEN: std::sync::Mutex<Vec<std::ops::Range<u16>>> = std::sync::Mutex::new(Vec::new());
    let mut taken = TAKEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let span = usize::from(MAX_PORT - 20000) + 1;
    if n == 0 || n > span {
        return None;
    }
    let seed = std::process::id() as usize
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as usize);
    for attempt in 0..50 {
        let base = 20000 + (seed.wrapping_add(attempt * 7919) % (span - n + 1)) as u16;
        let range = base..base + n as u16;
        if taken
            .iter()
            .any(|t| t.start < range.end && range.start < t.end)
        {
            continue;
        }
        let free = (0..n as u16).all(|i| {
            [base + i, base + i + 10000]
                .iter()
                .all(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        });
        if free {
            taken.push(range);
            return Some(base);
        }
    }
    None
}

/// The directory `railyard dev redis-cluster` uses for a base port.
pub fn dev_dir(base_port: u16) -> PathBuf {
    std::env::temp_dir().join(format!("railyard-redis-cluster-{base_port}"))
}

impl LocalCluster {
    /// Starts `masters x (1 + replicas)` nodes on `base_port..`, creates the
    /// cluster and waits until every node agrees (up to `timeout`).
    ///
    /// # Errors
    /// Missing tools, bad layout, a node failing to start, no convergence.
    pub async fn start(
        dir: &Path,
        masters: usize,
        replicas: usize,
        base_port: u16,
        node_timeout: Duration,
        timeout: Duration,
        owned: bool,
    ) -> Result<Self, LocalClusterError> {
        have("redis-server")?;
        have("redis-cli")?;
        let n = masters * (1 + replicas);
        if masters < 3 {
            return Err(LocalClusterError::Layout(
                "Redis Cluster needs at least 3 masters".into(),
            ));
        }
        if usize::from(base_port) + n - 1 > usize::from(MAX_PORT) {
            return Err(LocalClusterError::Layout(format!(
                "ports {base_port}..{} exceed {MAX_PORT}; bus ports (+10000) would enter the ephemeral range",
                usize::from(base_port) + n - 1
            )));
        }
        std::fs::create_dir_all(dir).map_err(|source| LocalClusterError::Io {
            context: format!("creating {}", dir.display()),
            source,
        })?;
        let ports: Vec<u16> = (0..n as u16).map(|i| base_port + i).collect();
        let cluster = Self {
            dir: dir.to_owned(),
            ports: ports.clone(),
            owned,
        };
        for &p in &ports {
            cluster.start_node(p, node_timeout)?;
        }
        // Every node answers PING.
        let started = Instant::now();
        for &p in &ports {
            loop {
                if query(&format!("127.0.0.1:{p}"), &Cmd::new("PING"))
                    .await
                    .is_ok()
                {
                    break;
                }
                if started.elapsed() > timeout {
                    return Err(LocalClusterError::NotConverged(
                        timeout,
                        format!("node {p} never answered PING"),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let mut create = tokio::process::Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for &p in &ports {
            create.arg(format!("127.0.0.1:{p}"));
        }
        create
            .arg("--cluster-replicas")
            .arg(replicas.to_string())
            .arg("--cluster-yes")
            .kill_on_drop(true);
        // redis-cli waits for the nodes to join with no limit of its own:
        // bound it by what is left of `timeout`.
        let out = tokio::time::timeout(timeout.saturating_sub(started.elapsed()), create.output())
            .await
            .map_err(|_| {
                LocalClusterError::NotConverged(
                    timeout,
                    "redis-cli --cluster create did not finish (the nodes never joined)".into(),
                )
            })?
            .map_err(|source| LocalClusterError::Io {
                context: "running redis-cli --cluster create".into(),
                source,
            })?;
        if !out.status.success() {
            return Err(LocalClusterError::Failed(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .last()
                    .unwrap_or("")
            )));
        }
        cluster
            .wait_converged(timeout.saturating_sub(started.elapsed()))
            .await?;
        std::fs::write(
            dir.join("ports"),
            ports.iter().map(|p| format!("{p}\n")).collect::<String>(),
        )
        .map_err(|source| LocalClusterError::Io {
            context: "writing the port list".into(),
            source,
        })?;
        Ok(cluster)
    }

    /// Starts one more empty node (not yet part of the cluster).
    ///
    /// # Errors
    /// When `redis-server` cannot start.
    pub fn start_node(&self, port: u16, node_timeout: Duration) -> Result<(), LocalClusterError> {
        let d = &self.dir;
        let status = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--protected-mode", "no"])
            .args(["--cluster-enabled", "yes"])
            .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
            .args([
                "--cluster-node-timeout",
                &node_timeout.as_millis().to_string(),
            ])
            .args(["--dir", &d.display().to_string()])
            .args(["--dbfilename", &format!("dump-{port}.rdb")])
            .args(["--save", "", "--appendonly", "no"])
            // Replicas sync at once instead of after the default 5 s delay.
            .args(["--repl-diskless-sync-delay", "0"])
            .args(["--daemonize", "yes"])
            .args([
                "--pidfile",
                &d.join(format!("{port}.pid")).display().to_string(),
            ])
            .args([
                "--logfile",
                &d.join(format!("{port}.log")).display().to_string(),
            ])
            .status()
            .map_err(|source| LocalClusterError::Io {
                context: "starting redis-server".into(),
                source,
            })?;
        if !status.success() {
            return Err(LocalClusterError::Failed(format!(
                "redis-server on port {port} failed to start"
            )));
        }
        Ok(())
    }

    /// Waits until every node lists every node, none is in handshake or
    /// failing, every slot is served and all views have one fingerprint.
    ///
    /// # Errors
    /// [`LocalClusterError::NotConverged`].
    pub async fn wait_converged(&self, timeout: Duration) -> Result<(), LocalClusterError> {
        let deadline = Instant::now() + timeout;
        let mut last: String;
        loop {
            match self.check_agreement().await {
                Ok(()) => return Ok(()),
                Err(why) => last = why,
            }
            if Instant::now() > deadline {
                return Err(LocalClusterError::NotConverged(timeout, last));
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    async fn check_agreement(&self) -> Result<(), String> {
        let mut fp = None;
        for &p in &self.ports {
            let addr = format!("127.0.0.1:{p}");
            let info = query(&addr, &Cmd::new("CLUSTER").arg("INFO")).await?;
            let info = info
                .as_bytes()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            if !info.contains("cluster_state:ok") {
                return Err(format!("{addr}: cluster_state is not ok"));
            }
            let nodes = query(&addr, &Cmd::new("CLUSTER").arg("NODES")).await?;
            let text = nodes.as_bytes().cloned().unwrap_or_default();
            let s = String::from_utf8_lossy(&text);
            let lines = s.lines().count();
            if lines != self.ports.len() {
                return Err(format!(
                    "{addr} knows {lines} of {} nodes",
                    self.ports.len()
                ));
            }
            if s.contains("handshake") || s.contains("fail") || s.contains("noaddr") {
                return Err(format!("{addr} still sees a node in handshake or failing"));
            }
            let f = fingerprint(&text)?;
            if *fp.get_or_insert(f) != f {
                return Err(format!("{addr} has a different view"));
            }
        }
        Ok(())
    }

    /// Adopts a cluster started earlier by `railyard dev redis-cluster`.
    ///
    /// # Errors
    /// When its directory or port list is missing.
    pub fn adopt(dir: &Path) -> Result<Self, LocalClusterError> {
        let text =
            std::fs::read_to_string(dir.join("ports")).map_err(|source| LocalClusterError::Io {
                context: format!("reading {}", dir.join("ports").display()),
                source,
            })?;
        let ports = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        Ok(Self {
            dir: dir.to_owned(),
            ports,
            owned: false,
        })
    }

    /// A handle for `n` nodes from `base_port` in `dir` (to clean up after
    /// a failed start, before the port list was written).
    pub fn adopt_ports(dir: &Path, base_port: u16, n: usize) -> Self {
        Self {
            dir: dir.to_owned(),
            ports: (0..n as u16).map(|i| base_port + i).collect(),
            owned: false,
        }
    }

    /// The node ports.
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// `127.0.0.1:port` of every node.
    pub fn addrs(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect()
    }

    /// The directory holding the nodes' files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The pid of the node on `port`, from its pid file.
    pub fn pid(&self, port: u16) -> Option<i32> {
        std::fs::read_to_string(self.dir.join(format!("{port}.pid")))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Kills the node on `port` with SIGKILL (a crash, not a shutdown).
    pub fn kill(&self, port: u16) {
        if let Some(pid) = self.pid(port) {
            // Safety: kill(2) with a pid read from the node's own pid file
            // and a constant signal; it touches no memory of ours.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }

    /// Stops every node and removes the directory.
    pub fn down(&mut self) {
        for &p in &self.ports.clone() {
            self.kill(p);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        self.ports.clear();
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        if self.owned {
            self.down();
        }
    }
}
