//! Request/reply round trips through a TCP event-bus bridge.
//!
//! The server under test runs as its own process: `railyard node` with a
//! bridge config, or the Vert.x peer (`peers/vertx-bridge`, mode `server`),
//! both with the same permissions and an echo consumer at
//! [`ECHO_ADDRESS`]. The same load client drives both: `clients` tokio tasks,
//! each with its own connection and `in_flight` requests outstanding
//! (`send` with `replyAddress`, body `{"payload": "..."}`); every `message`
//! frame back counts one round trip and triggers the next request, every
//! `err` frame counts an error. Only round trips completed inside the
//! measured window (after the warm-up) count.
//!
//! With `idle > 0`, that many further connections are opened first, each
//! checked with a `ping`/`pong`, and held open through the measured window:
//! the "10,000 idle clients hold" check. The server's resident memory is
//! read from `/proc` after they connect.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

use crate::peer::JavaPeer;

/// The echo service both servers run (Railyard's node has it built in).
pub const ECHO_ADDRESS: &str = "railyard.node.echo";

/// The `[bridge]` section Railyard runs with: the Vert.x peer's permissions.
pub fn railyard_config(port: u16) -> String {
    format!(
        "[bridge]\nhost = \"127.0.0.1\"\nport = {port}\n\
         inbound_permitted = [{{ address = \"{ECHO_ADDRESS}\" }}, {{ address_regex = \"test\\\\..*\" }}]\n\
         outbound_permitted = [{{ address_regex = \"test\\\\..*\" }}]\n\
         max_connections = 19000\n"
    )
}

/// One bench run's settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BridgeBenchConfig {
    /// Load-generating connections.
    pub clients: usize,
    /// Requests each keeps outstanding.
    pub in_flight: usize,
    /// Measured window.
    pub duration: Duration,
    /// Not counted, before the window.
    pub warmup: Duration,
    /// Extra idle connections held open during the run (0: none).
    pub idle: usize,
    /// Bytes of payload text in each request body.
    pub body_bytes: usize,
    /// Threads the server under test runs its connections on: tokio
    /// workers for Railyard (`TOKIO_WORKER_THREADS`), event loops and
    /// bridge instances for Vert.x (`--instances`).
    pub server_threads: usize,
    /// Threads of the load client's own tokio runtime.
    pub client_threads: usize,
}

/// One run's result row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BridgeResult {
    /// Always `bridge`.
    pub scenario: String,
    /// `railyard` or `vertx`.
    pub system: String,
    /// Load connections.
    pub clients: usize,
    /// Requests outstanding per load connection.
    pub in_flight: usize,
    /// Measured window, seconds.
    pub duration_s: f64,
    /// Warm-up, seconds.
    pub warmup_s: f64,
    /// Request body payload bytes.
    pub body_bytes: usize,
    /// Server threads (see [`BridgeBenchConfig::server_threads`]).
    pub server_threads: usize,
    /// Load client threads.
    pub client_threads: usize,
    /// Round trips completed inside the window.
    pub round_trips: u64,
    /// `round_trips / duration_s`.
    pub round_trips_per_s: f64,
    /// `err` frames, unexpected frames and broken connections inside the window.
    pub errors: u64,
    /// Idle connections asked for.
    pub idle_clients: usize,
    /// Idle connections that connected and answered a ping.
    pub idle_ok: usize,
    /// Idle connections still open (answering a second ping) after the window.
    pub idle_held: usize,
    /// Server resident memory after the idle clients connected, MiB (0 if unknown).
    pub server_rss_mib: f64,
    /// CPU time (user + system) the server process used inside the window,
    /// per round trip, in microseconds: its cost, independent of how busy
    /// the machine was (0 if unknown).
    pub server_cpu_us_per_rt: f64,
    /// The same for the load client (this process), for context.
    pub client_cpu_us_per_rt: f64,
}

/// CPU seconds (user + system) a process has used, from `/proc/<pid>/stat`.
fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesized command name; utime and stime are the
    // 14th and 15th fields overall, in USER_HZ (100 per second on Linux).
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Why a bench run failed.
#[derive(Debug, thiserror::Error)]
pub enum BridgeBenchError {
    /// The server process could not start.
    #[error("starting the {system} bridge server: {source}")]
    Spawn {
        /// Which server.
        system: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// It did not accept connections in time.
    #[error("the {0} bridge server did not accept connections within 90 s")]
    NotListening(String),
    /// The load clients could not connect.
    #[error("load client could not connect to {addr}: {source}")]
    Connect {
        /// Where.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Writing the config file failed.
    #[error("writing the bench's node config: {0}")]
    Config(std::io::Error),
    /// The peer could not be built.
    #[error(transparent)]
    Peer(#[from] crate::peer::PeerError),
}

/// A bridge server process under test; killed on drop.
#[derive(Debug)]
pub struct ServerUnderTest {
    system: String,
    child: Child,
    addr: SocketAddr,
    _config_dir: Option<TempDir>,
}

#[derive(Debug)]
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl ServerUnderTest {
    /// `railyard_exe node --config <tmp> --stats-every 0` with [`railyard_config`].
    ///
    /// # Errors
    /// [`BridgeBenchError::Spawn`], [`BridgeBenchError::Config`], [`BridgeBenchError::NotListening`].
    pub async fn railyard(railyard_exe: &Path, threads: usize) -> Result<Self, BridgeBenchError> {
        let port = free_port().map_err(BridgeBenchError::Config)?;
        let dir = std::env::temp_dir().join(format!(
            "railyard-bench-bridge-{}-{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).map_err(BridgeBenchError::Config)?;
        let dir = TempDir(dir);
        let config = dir.0.join("node.toml");
        std::fs::write(&config, railyard_config(port)).map_err(BridgeBenchError::Config)?;
        let child = Command::new(railyard_exe)
            .args([
                "node",
                "--no-saga",
                "--http-port",
                "0",
                "--admin-port",
                "0",
                "--stats-every",
                "0",
                "--name",
                "bench-bridge",
                "--config",
            ])
            .arg(&config)
            .env("RAILYARD_LOG", "warn")
            .env("TOKIO_WORKER_THREADS", threads.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| BridgeBenchError::Spawn {
                system: "railyard".into(),
                source,
            })?;
        Self::ready("railyard", child, port, Some(dir)).await
    }

    /// The Vert.x peer's `server` mode on a free port.
    ///
    /// # Errors
    /// As [`railyard`](Self::railyard), and peer build errors.
    pub async fn vertx(peer: &JavaPeer, threads: usize) -> Result<Self, BridgeBenchError> {
        peer.ensure_built().await?;
        let port = free_port().map_err(BridgeBenchError::Config)?;
        let child = peer
            .java_command()
            .args([
                "server",
                "--port",
                &port.to_string(),
                "--instances",
                &threads.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| BridgeBenchError::Spawn {
                system: "vertx".into(),
                source,
            })?;
        Self::ready("vertx", child, port, None).await
    }

    async fn ready(
        system: &str,
        mut child: Child,
        port: u16,
        dir: Option<TempDir>,
    ) -> Result<Self, BridgeBenchError> {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            if let Ok(mut s) = TcpStream::connect(addr).await {
                // Listening is not enough: the bridge must answer.
                if ping(&mut s).await {
                    return Ok(Self {
                        system: system.to_owned(),
                        child,
                        addr,
                        _config_dir: dir,
                    });
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(BridgeBenchError::NotListening(system.to_owned()))
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Resident memory now, MiB (0 if unknown).
    pub fn rss_mib(&self) -> f64 {
        let Some(pid) = self.child.id() else {
            return 0.0;
        };
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|kb| kb.parse::<f64>().ok())
            })
            .map_or(0.0, |kb| kb / 1024.0)
    }

    /// CPU seconds it has used so far.
    pub fn cpu_seconds(&self) -> Option<f64> {
        cpu_seconds(&self.child.id()?.to_string())
    }

    /// Which system it is.
    pub fn system(&self) -> &str {
        &self.system
    }
}

fn frame(v: &serde_json::Value) -> Vec<u8> {
    let text = serde_json::to_vec(v).expect("in-memory JSON");
    let mut out = Vec::with_capacity(text.len() + 4);
    out.extend_from_slice(&(text.len() as u32).to_be_bytes());
    out.extend_from_slice(&text);
    out
}

/// Reads one frame's payload into `buf` (replacing it); `false` on EOF/error.
async fn read_frame(s: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut len = [0u8; 4];
    if s.read_exact(&mut len).await.is_err() {
        return false;
    }
    buf.resize(u32::from_be_bytes(len) as usize, 0);
    s.read_exact(buf).await.is_ok()
}

async fn ping(s: &mut TcpStream) -> bool {
    let ping = frame(&serde_json::json!({"type": "ping"}));
    let mut buf = Vec::new();
    let ok = tokio::time::timeout(Duration::from_secs(10), async {
        s.write_all(&ping).await.is_ok() && read_frame(s, &mut buf).await
    })
    .await
    .unwrap_or(false);
    ok && buf == br#"{"type":"pong"}"#
}

/// Buffered frame reading for the load client: one `read` per batch of
/// replies instead of two per frame.
#[derive(Default)]
struct FrameReader {
    buf: Vec<u8>,
    /// Start of the first unconsumed byte.
    pos: usize,
}

impl FrameReader {
    fn complete(&self) -> usize {
        let mut n = 0;
        let mut at = self.pos;
        while self.buf.len() - at >= 4 {
            let len = u32::from_be_bytes([
                self.buf[at],
                self.buf[at + 1],
                self.buf[at + 2],
                self.buf[at + 3],
            ]) as usize;
            if self.buf.len() - at - 4 < len {
                break;
            }
            at += 4 + len;
            n += 1;
        }
        n
    }

    /// Reads until at least one frame is complete; returns how many are. `None` on EOF or error.
    async fn fill(&mut self, s: &mut TcpStream) -> Option<usize> {
        loop {
            let n = self.complete();
            if n > 0 {
                return Some(n);
            }
            if self.pos > 0 {
                self.buf.drain(..self.pos);
                self.pos = 0;
            }
            if self.buf.capacity() - self.buf.len() < 1024 {
                self.buf.reserve(8192);
            }
            match s.read_buf(&mut self.buf).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    /// The next complete frame's payload (call only after `fill` said one is there).
    fn pop(&mut self) -> &[u8] {
        let at = self.pos;
        let len = u32::from_be_bytes([
            self.buf[at],
            self.buf[at + 1],
            self.buf[at + 2],
            self.buf[at + 3],
        ]) as usize;
        self.pos = at + 4 + len;
        &self.buf[at + 4..at + 4 + len]
    }
}

/// Opens `n` connections and pings each; returns those that answered.
async fn open_idle(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    // 256 connects at a time: fast, without overrunning the accept backlog.
    let mut left = n;
    while left > 0 {
        let batch = left.min(256);
        left -= batch;
        let tasks: Vec<_> = (0..batch)
            .map(|_| {
                tokio::spawn(async move {
                    let mut s =
                        tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr))
                            .await
                            .ok()?
                            .ok()?;
                    ping(&mut s).await.then_some(s)
                })
            })
            .collect();
        for t in tasks {
            if let Ok(Some(s)) = t.await {
                held.push(s);
            }
        }
    }
    held
}

/// How many of `held` still answer a ping.
async fn still_held(held: Vec<TcpStream>) -> usize {
    let tasks: Vec<_> = held
        .into_iter()
        .map(|mut s| tokio::spawn(async move { ping(&mut s).await }))
        .collect();
    let mut ok = 0;
    for t in tasks {
        if matches!(t.await, Ok(true)) {
            ok += 1;
        }
    }
    ok
}

/// Drops a runtime from async code: on a blocking thread, where that is allowed.
async fn stop_runtime(rt: tokio::runtime::Runtime) {
    let _ = tokio::task::spawn_blocking(move || rt.shutdown_timeout(Duration::from_secs(1))).await;
}

/// Runs the load against `server` and returns its row.
///
/// # Errors
/// [`BridgeBenchError::Connect`] if a load connection cannot be opened.
pub async fn run(
    server: &ServerUnderTest,
    cfg: &BridgeBenchConfig,
    progress: impl Fn(&str),
) -> Result<BridgeResult, BridgeBenchError> {
    let addr = server.addr();
    let idle = if cfg.idle > 0 {
        progress(&format!("opening {} idle connections", cfg.idle));
        open_idle(addr, cfg.idle).await
    } else {
        Vec::new()
    };
    let idle_ok = idle.len();
    let rss = server.rss_mib();

    let request = frame(&serde_json::json!({
        "type": "send",
        "address": ECHO_ADDRESS,
        "replyAddress": "bench.reply",
        "body": {"payload": "x".repeat(cfg.body_bytes)},
    }));
    let batch: Arc<Vec<u8>> = Arc::new(request.repeat(cfg.in_flight.max(1)));
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // The load client runs on its own runtime, so its thread count is a
    // setting of the bench, not of whoever called it.
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.client_threads.max(1))
        .thread_name("bridge-load")
        .enable_all()
        .build()
        .map_err(BridgeBenchError::Config)?;
    let clients = cfg.clients;
    let in_flight = cfg.in_flight.max(1);
    let (done2, errors2, stop2) = (done.clone(), errors.clone(), stop.clone());
    let started = client_rt.spawn(async move {
        let (done, errors, stop) = (done2, errors2, stop2);
        let mut tasks = Vec::with_capacity(clients);
        for _ in 0..clients {
            let mut s = TcpStream::connect(addr)
                .await
                .map_err(|source| BridgeBenchError::Connect { addr, source })?;
            let _ = s.set_nodelay(true);
            let (request, batch) = (request.clone(), batch.clone());
            let (done, errors, stop) = (done.clone(), errors.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                if s.write_all(&batch).await.is_err() {
                    errors.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let mut frames = FrameReader::default();
                while !stop.load(Ordering::Relaxed) {
                    // One read usually brings every reply that is ready; answer
                    // each with the next request, in one write.
                    let n = match frames.fill(&mut s).await {
                        Some(n) => n,
                        None => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    };
                    let (mut ok, mut bad) = (0u64, 0u64);
                    for _ in 0..n {
                        let payload = frames.pop();
                        if payload.starts_with(br#"{"type":"message""#) {
                            ok += 1;
                        } else {
                            bad += 1;
                        }
                    }
                    done.fetch_add(ok, Ordering::Relaxed);
                    if bad > 0 {
                        errors.fetch_add(bad, Ordering::Relaxed);
                    }
                    let out = if n == 1 {
                        &request[..]
                    } else {
                        &batch[..request.len() * n.min(in_flight)]
                    };
                    if s.write_all(out).await.is_err() {
                        errors.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            }));
        }
        Ok::<_, BridgeBenchError>(tasks)
    });
    let tasks = match started.await {
        Ok(Ok(tasks)) => tasks,
        Ok(Err(e)) => {
            stop_runtime(client_rt).await;
            return Err(e);
        }
        Err(e) => {
            stop_runtime(client_rt).await;
            return Err(BridgeBenchError::Config(std::io::Error::other(e)));
        }
    };
    progress("warming up");
    tokio::time::sleep(cfg.warmup).await;
    let (d0, e0) = (done.load(Ordering::Relaxed), errors.load(Ordering::Relaxed));
    let (s0, c0) = (server.cpu_seconds(), cpu_seconds("self"));
    let t0 = Instant::now();
    progress("measuring");
    tokio::time::sleep(cfg.duration).await;
    let (d1, e1) = (done.load(Ordering::Relaxed), errors.load(Ordering::Relaxed));
    let (s1, c1) = (server.cpu_seconds(), cpu_seconds("self"));
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        // Each task ends at its next reply; a stuck one is aborted.
        let abort = t.abort_handle();
        if tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
    stop_runtime(client_rt).await;
    let idle_held = if idle_ok > 0 {
        still_held(idle).await
    } else {
        0
    };
    let round_trips = d1 - d0;
    let per_rt = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if round_trips > 0 => (b - a) * 1e6 / round_trips as f64,
        _ => 0.0,
    };
    Ok(BridgeResult {
        server_cpu_us_per_rt: per_rt(s0, s1),
        client_cpu_us_per_rt: per_rt(c0, c1),
        scenario: "bridge".into(),
        system: server.system().to_owned(),
        clients: cfg.clients,
        in_flight: cfg.in_flight,
        duration_s: secs,
        warmup_s: cfg.warmup.as_secs_f64(),
        body_bytes: cfg.body_bytes,
        server_threads: cfg.server_threads,
        client_threads: cfg.client_threads,
        round_trips,
        round_trips_per_s: round_trips as f64 / secs,
        errors: e1 - e0,
        idle_clients: cfg.idle,
        idle_ok,
        idle_held,
        server_rss_mib: rss,
    })
}
