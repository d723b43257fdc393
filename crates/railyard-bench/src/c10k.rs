//! Seed 004: an HTTP server under 10,000 connections.
//!
//! One run against one system:
//! 1. start the server as its own process (`railyard node`, or the Vert.x
//!    peer) and wait until `GET /0k` answers;
//! 2. warm up (`wrk`, 100 connections, a few seconds; the JVM compiles);
//! 3. memory: read the server's RSS, open `idle_connections` keep-alive
//!    connections from this process (one `GET /0k` each, then idle for 6 s),
//!    read the RSS again: the difference per connection is `rss_per_conn_kb`;
//! 4. saturation: `wrk -t2 -c N` on `path` for `duration`, sampling the RSS
//!    (`rss_mb` is the peak); `requests_per_s` and socket errors come from here;
//! 5. latency at a fixed rate: `oha -q RATE --latency-correction` (no
//!    coordinated omission) with `rate_connections`; `latency_ms` comes from
//!    here. RATE defaults to half of step 4's throughput;
//! 6. stop the server with SIGTERM.
//!
//! The load tools are real, public ones: `wrk` (Debian) and `oha` (crates.io).

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// Why a c10k run failed.
#[derive(Debug, thiserror::Error)]
pub enum C10kError {
    /// A tool is missing or could not start.
    #[error("could not start `{tool}`: {source}; {hint}")]
    Spawn {
        /// The program.
        tool: String,
        /// The OS error.
        source: io::Error,
        /// How to get it.
        hint: &'static str,
    },
    /// The server did not answer in time.
    #[error("the {system} server did not answer GET /0k on port {port} within {secs} s (is the port free?)")]
    NotReady {
        /// Which system.
        system: String,
        /// Its port.
        port: u16,
        /// How long we waited.
        secs: u64,
    },
    /// The server exited early.
    #[error("the {system} server exited early ({status})")]
    Exited {
        /// Which system.
        system: String,
        /// Its exit status.
        status: String,
    },
    /// A load tool failed or printed something unexpected.
    #[error("{tool} failed: {detail}")]
    Tool {
        /// The program.
        tool: &'static str,
        /// What went wrong.
        detail: String,
    },
    /// Other I/O.
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
}

/// How to start a server under test.
#[derive(Debug, Clone)]
pub struct ServerCommand {
    /// `railyard`, `vertx`, ...
    pub system: String,
    /// Program and arguments.
    pub program: PathBuf,
    /// Arguments.
    pub args: Vec<String>,
    /// Working directory.
    pub cwd: Option<PathBuf>,
    /// Extra label for the row (e.g. Vert.x verticle instances).
    pub instances: Option<usize>,
}

/// One c10k run's settings.
#[derive(Debug, Clone, Serialize)]
pub struct C10kConfig {
    /// Connections held by wrk during the saturation run.
    pub connections: usize,
    /// Saturation and fixed-rate run length.
    #[serde(serialize_with = "secs")]
    pub duration: Duration,
    /// Warm-up before measuring (not counted).
    #[serde(serialize_with = "secs")]
    pub warmup: Duration,
    /// Path requested.
    pub path: String,
    /// Fixed request rate for the latency run (requests/s): `None` for half
    /// of this run's saturation throughput; `Some(0)` skips the latency run.
    pub rate: Option<u64>,
    /// Connections oha uses at the fixed rate.
    pub rate_connections: usize,
    /// Keep-alive connections opened for the idle-memory reading.
    pub idle_connections: usize,
    /// wrk threads.
    pub wrk_threads: usize,
    /// Server port.
    pub port: u16,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Latency figures in milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LatencyMs {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest.
    pub max: f64,
}

/// wrk's socket error counts.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SocketErrors {
    /// Failed connects.
    pub connect: u64,
    /// Failed reads.
    pub read: u64,
    /// Failed writes.
    pub write: u64,
    /// Requests that timed out (wrk's 2 s default).
    pub timeout: u64,
}

impl SocketErrors {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.connect + self.read + self.write + self.timeout
    }
}

/// One run's result row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct C10kResult {
    /// Always `c10k`.
    pub scenario: String,
    /// `railyard`, `vertx`, ...
    pub system: String,
    /// Vert.x verticle instances (None for Railyard).
    pub instances: Option<usize>,
    /// Path requested.
    pub path: String,
    /// wrk connections.
    pub connections: usize,
    /// Measured window in seconds.
    pub duration_s: f64,
    /// wrk's requests/s at saturation.
    pub requests_per_s: f64,
    /// Socket errors plus non-2xx/3xx answers at saturation.
    pub errors: u64,
    /// wrk's socket errors.
    pub socket_errors: SocketErrors,
    /// Non-2xx/3xx answers at saturation.
    pub non_2xx: u64,
    /// Latency at the fixed rate (oha, corrected for coordinated omission).
    pub latency_ms: LatencyMs,
    /// The fixed rate asked for (requests/s); 0 if skipped.
    pub rate: u64,
    /// The rate oha achieved.
    pub rate_achieved: f64,
    /// Requests that failed at the fixed rate (errors and non-2xx).
    pub rate_errors: u64,
    /// wrk's closed-loop latency at saturation (hides stalls; for reference).
    pub saturation_latency_ms: LatencyMs,
    /// Requests wrk completed at saturation.
    pub requests: u64,
    /// Server CPU time (user + system, all threads) per request at
    /// saturation, microseconds: robust to other load on the machine.
    pub cpu_us_per_request: f64,
    /// Peak server RSS during saturation, MiB.
    pub rss_mb: f64,
    /// Server RSS after warm-up, before the idle connections, MiB.
    pub rss_base_mb: f64,
    /// Server RSS with `idle_connections` idle keep-alive connections open, MiB.
    pub rss_idle_mb: f64,
    /// Idle keep-alive connections opened.
    pub idle_connections: usize,
    /// (idle RSS - base RSS) / idle connections, KiB.
    pub rss_per_conn_kb: f64,
}

/// Raises this process's open-file limit to its hard limit (children inherit
/// it: the server and wrk each need one descriptor per connection).
///
/// # Errors
/// If the limit cannot be read or set.
pub fn raise_nofile_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // Safety: `lim` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    lim.rlim_cur = lim.rlim_max;
    // Safety: `lim` is a valid rlimit; raising the soft limit to the hard one is allowed.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(lim.rlim_cur)
}

/// The server's resident set size in MiB, from `/proc/<pid>/status`.
pub fn rss_mb(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// The process's CPU time so far (user + system), seconds, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the line, i.e. the 12th and 13th after it.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // Safety: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Some(ticks / if hz > 0 { hz as f64 } else { 100.0 })
}

/// A running server under test; killed when dropped.
pub struct RunningServer {
    child: Child,
    /// Its pid.
    pub pid: u32,
    system: String,
}

impl RunningServer {
    /// Starts `cmd` and waits (up to 120 s) until `GET /0k` on `port` answers 200.
    ///
    /// # Errors
    /// [`C10kError::Spawn`], [`C10kError::NotReady`], [`C10kError::Exited`].
    pub async fn start(cmd: &ServerCommand, port: u16, verbose: bool) -> Result<Self, C10kError> {
        let mut c = Command::new(&cmd.program);
        c.args(&cmd.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(if verbose {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .kill_on_drop(true);
        if let Some(d) = &cmd.cwd {
            c.current_dir(d);
        }
        let mut child = c.spawn().map_err(|source| C10kError::Spawn {
            tool: cmd.program.display().to_string(),
            source,
            hint: "build it first",
        })?;
        let pid = child.id().unwrap_or(0);
        // Drain stdout so the server never blocks on a full pipe.
        if let Some(out) = child.stdout.take() {
            let system = cmd.system.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if verbose {
                        eprintln!("[{system}] {line}");
                    }
                }
            });
        }
        let mut server = Self {
            child,
            pid,
            system: cmd.system.clone(),
        };
        let limit = Duration::from_secs(120);
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = server.child.try_wait()? {
                return Err(C10kError::Exited {
                    system: server.system.clone(),
                    status: status.to_string(),
                });
            }
            if get_ok(port, "/0k").await {
                return Ok(server);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(C10kError::NotReady {
            system: server.system.clone(),
            port,
            secs: limit.as_secs(),
        })
    }

    /// SIGTERM, then wait up to 30 s (then SIGKILL).
    pub async fn stop(mut self) {
        // Safety: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.pid as libc::pid_t, libc::SIGTERM);
        }
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// One `GET` answered 200, on a fresh connection.
async fn get_ok(port: u16, path: &str) -> bool {
    let attempt = async {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = vec![0u8; 64];
        let n = s.read(&mut buf).await.ok()?;
        Some(buf[..n].starts_with(b"HTTP/1.1 200"))
    };
    tokio::time::timeout(Duration::from_secs(2), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Opens `n` keep-alive connections, each after one answered `GET /0k`.
/// Returns those that succeeded (the rest are counted as failures).
pub async fn open_idle_connections(port: u16, n: usize) -> (Vec<TcpStream>, usize) {
    let results: Vec<Option<TcpStream>> = stream::iter(0..n)
        .map(|_| async move {
            let attempt = async {
                let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
                s.write_all(b"GET /0k HTTP/1.1\r\nHost: localhost\r\n\r\n")
                    .await
                    .ok()?;
                let mut buf = Vec::with_capacity(512);
                let mut chunk = [0u8; 512];
                loop {
                    let k = s.read(&mut chunk).await.ok()?;
                    if k == 0 {
                        return None;
                    }
                    buf.extend_from_slice(&chunk[..k]);
                    if buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                buf.starts_with(b"HTTP/1.1 200").then_some(s)
            };
            tokio::time::timeout(Duration::from_secs(10), attempt)
                .await
                .ok()
                .flatten()
        })
        .buffer_unordered(256)
        .collect()
        .await;
    let failed = results.iter().filter(|r| r.is_none()).count();
    (results.into_iter().flatten().collect(), failed)
}

/// What wrk reported.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WrkReport {
    /// Requests/s.
    pub requests_per_s: f64,
    /// Requests completed.
    pub requests: u64,
    /// Socket errors.
    pub socket_errors: SocketErrors,
    /// Non-2xx/3xx responses.
    pub non_2xx: u64,
    /// Latency distribution (p99.9 not reported by wrk: set to p99).
    pub latency: LatencyMs,
}

/// Parses a duration as wrk prints it: `85.68ms`, `1.03s`, `512.00us`, `2.00m`.
fn wrk_ms(s: &str) -> Option<f64> {
    let s = s.trim();
    let (num, mult) = if let Some(v) = s.strip_suffix("us") {
        (v, 0.001)
    } else if let Some(v) = s.strip_suffix("ms") {
        (v, 1.0)
    } else if let Some(v) = s.strip_suffix('s') {
        (v, 1000.0)
    } else if let Some(v) = s.strip_suffix('m') {
        (v, 60_000.0)
    } else if let Some(v) = s.strip_suffix('h') {
        (v, 3_600_000.0)
    } else {
        (s, 1.0)
    };
    num.parse::<f64>().ok().map(|n| n * mult)
}

/// Parses wrk's text report (run with `--latency`).
pub fn parse_wrk(out: &str) -> Option<WrkReport> {
    let mut r = WrkReport::default();
    let mut saw_rate = false;
    for line in out.lines().map(str::trim) {
        if let Some(v) = line.strip_prefix("Requests/sec:") {
            r.requests_per_s = v.trim().parse().ok()?;
            saw_rate = true;
        } else if let Some(v) = line.strip_prefix("Socket errors:") {
            for part in v.split(',') {
                let mut it = part.split_whitespace();
                let (Some(k), Some(n)) = (it.next(), it.next().and_then(|n| n.parse().ok())) else {
                    continue;
                };
                match k {
                    "connect" => r.socket_errors.connect = n,
                    "read" => r.socket_errors.read = n,
                    "write" => r.socket_errors.write = n,
                    "timeout" => r.socket_errors.timeout = n,
                    _ => {}
                }
            }
        } else if line.contains(" requests in ") {
            r.requests = line.split_whitespace().next()?.parse().ok()?;
        } else if let Some(v) = line.strip_prefix("Non-2xx or 3xx responses:") {
            r.non_2xx = v.trim().parse().ok()?;
        } else if let Some(v) = line.strip_prefix("50%") {
            r.latency.p50 = wrk_ms(v)?;
        } else if let Some(v) = line.strip_prefix("99%") {
            r.latency.p99 = wrk_ms(v)?;
            r.latency.p999 = r.latency.p99;
        } else if let Some(v) = line.strip_prefix("Latency") {
            // "Latency   85.68ms   29.71ms   1.03s    75.52%": avg, stdev, max.
            let cols: Vec<&str> = v.split_whitespace().collect();
            if cols.len() >= 3 && !v.contains("Distribution") {
                r.latency.max = wrk_ms(cols[2]).unwrap_or(0.0);
            }
        }
    }
    saw_rate.then_some(r)
}

/// Runs wrk and parses its report.
///
/// # Errors
/// [`C10kError::Spawn`] when wrk is missing, [`C10kError::Tool`] when it fails.
pub async fn wrk(
    threads: usize,
    connections: usize,
    duration: Duration,
    url: &str,
) -> Result<WrkReport, C10kError> {
    let out = Command::new("wrk")
        .arg(format!("-t{threads}"))
        .arg(format!("-c{connections}"))
        .arg(format!("-d{}s", duration.as_secs().max(1)))
        .arg("--latency")
        .arg(url)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|source| C10kError::Spawn {
            tool: "wrk".into(),
            source,
            hint: "install it with `apt-get install -y wrk`",
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_wrk(&text).ok_or_else(|| C10kError::Tool {
        tool: "wrk",
        detail: format!(
            "unexpected output ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        ),
    })
}

/// What oha reported at a fixed rate.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OhaReport {
    /// Achieved requests/s.
    pub requests_per_s: f64,
    /// Latency, corrected for coordinated omission.
    pub latency: LatencyMs,
    /// Failed requests (errors and non-2xx).
    pub errors: u64,
}

/// Parses oha's `--output-format json` report.
pub fn parse_oha(json: &str) -> Option<OhaReport> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let pct = &v["latencyPercentiles"];
    let ms = |x: &serde_json::Value| x.as_f64().map(|s| s * 1000.0);
    let codes: BTreeMap<String, u64> =
        serde_json::from_value(v["statusCodeDistribution"].clone()).unwrap_or_default();
    let errors: BTreeMap<String, u64> =
        serde_json::from_value(v["errorDistribution"].clone()).unwrap_or_default();
    let bad_codes: u64 = codes
        .iter()
        .filter(|(c, _)| !c.starts_with('2') && !c.starts_with('3'))
        .map(|(_, n)| n)
        .sum();
    // Requests cut off by the end of the window are not failures.
    let real_errors: u64 = errors
        .iter()
        .filter(|(e, _)| !e.contains("deadline"))
        .map(|(_, n)| n)
        .sum();
    Some(OhaReport {
        requests_per_s: v["summary"]["requestsPerSec"].as_f64()?,
        latency: LatencyMs {
            p50: ms(&pct["p50"])?,
            p99: ms(&pct["p99"])?,
            p999: ms(&pct["p99.9"])?,
            max: ms(&v["summary"]["slowest"])?,
        },
        errors: bad_codes + real_errors,
    })
}

/// Runs oha at a fixed rate with latency correction.
///
/// # Errors
/// [`C10kError::Spawn`] when oha is missing, [`C10kError::Tool`] when it fails.
pub async fn oha(
    rate: u64,
    connections: usize,
    duration: Duration,
    url: &str,
) -> Result<OhaReport, C10kError> {
    let out = Command::new(oha_program())
        .arg("-z")
        .arg(format!("{}s", duration.as_secs().max(1)))
        .arg("-c")
        .arg(connections.to_string())
        .arg("-q")
        .arg(rate.to_string())
        .args([
            "--latency-correction",
            "--disable-compression",
            "--no-tui",
            "--output-format",
            "json",
        ])
        .arg(url)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|source| C10kError::Spawn {
            tool: "oha".into(),
            source,
            hint: "install it with `cargo install oha`",
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_oha(&text).ok_or_else(|| C10kError::Tool {
        tool: "oha",
        detail: format!(
            "unexpected output ({}): {}{}",
            out.status,
            text.chars().take(2000).collect::<String>(),
            String::from_utf8_lossy(&out.stderr)
        ),
    })
}

/// `oha` on the PATH, else in cargo's bin directory.
fn oha_program() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("oha").is_file()));
    if !on_path {
        if let Some(home) = std::env::var_os("CARGO_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        {
            let p = home.join("bin").join("oha");
            if p.is_file() {
                return p;
            }
        }
    }
    PathBuf::from("oha")
}

/// Progress callbacks: a phase name and its expected length.
pub trait Progress {
    /// A new phase starts.
    fn phase(&self, name: &str, expected: Duration);
}

impl<F: Fn(&str, Duration)> Progress for F {
    fn phase(&self, name: &str, expected: Duration) {
        self(name, expected)
    }
}

/// One full run against one system. See the module docs for the phases.
///
/// # Errors
/// Any [`C10kError`]; the server is stopped on every path.
pub async fn run(
    cmd: &ServerCommand,
    cfg: &C10kConfig,
    progress: &dyn Progress,
    verbose: bool,
) -> Result<C10kResult, C10kError> {
    progress.phase("starting the server", Duration::from_secs(5));
    let server = RunningServer::start(cmd, cfg.port, verbose).await?;
    let result = measure(&server, cmd, cfg, progress).await;
    progress.phase("stopping the server", Duration::from_secs(2));
    server.stop().await;
    result
}

async fn measure(
    server: &RunningServer,
    cmd: &ServerCommand,
    cfg: &C10kConfig,
    progress: &dyn Progress,
) -> Result<C10kResult, C10kError> {
    let url = format!("http://127.0.0.1:{}{}", cfg.port, cfg.path);
    if !cfg.warmup.is_zero() {
        progress.phase("warm-up (wrk, 100 connections)", cfg.warmup);
        wrk(cfg.wrk_threads, 100, cfg.warmup, &url).await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_base = rss_mb(server.pid).unwrap_or(0.0);

    progress.phase(
        &format!("{} idle keep-alive connections", cfg.idle_connections),
        Duration::from_secs(5),
    );
    let (idle, failed) = open_idle_connections(cfg.port, cfg.idle_connections).await;
    // Let the server settle: idle connections are idle for a while.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let rss_idle = rss_mb(server.pid).unwrap_or(0.0);
    let idle_open = idle.len();
    drop(idle);
    if failed > 0 {
        eprintln!(
            "warning: {failed} of {} idle connections could not be opened",
            cfg.idle_connections
        );
    }
    // Let the server notice the closes before loading it again.
    tokio::time::sleep(Duration::from_secs(2)).await;

    progress.phase(
        &format!("saturation (wrk, {} connections)", cfg.connections),
        cfg.duration,
    );
    let pid = server.pid;
    let peak_kb = Arc::new(AtomicU64::new(0));
    let sampler = {
        let peak_kb = peak_kb.clone();
        tokio::spawn(async move {
            // Bounded by the abort below, which follows wrk's bounded run.
            loop {
                if let Some(r) = rss_mb(pid) {
                    peak_kb.fetch_max((r * 1024.0) as u64, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let cpu_before = cpu_seconds(pid).unwrap_or(0.0);
    let sat = wrk(cfg.wrk_threads, cfg.connections, cfg.duration, &url).await;
    let cpu_used = cpu_seconds(pid).unwrap_or(0.0) - cpu_before;
    sampler.abort();
    let rss_busy = peak_kb.load(Ordering::Relaxed) as f64 / 1024.0;
    let sat = sat?;

    let mut latency = LatencyMs::default();
    let mut rate_achieved = 0.0;
    let mut rate_errors = 0;
    let rate = cfg.rate.unwrap_or((sat.requests_per_s / 2.0) as u64);
    if rate > 0 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        progress.phase(
            &format!(
                "fixed rate (oha, {} requests/s, {} connections)",
                rate, cfg.rate_connections
            ),
            cfg.duration,
        );
        let o = oha(rate, cfg.rate_connections, cfg.duration, &url).await?;
        latency = o.latency;
        rate_achieved = o.requests_per_s;
        rate_errors = o.errors;
    }
    let per_conn = if idle_open > 0 {
        (rss_idle - rss_base).max(0.0) * 1024.0 / idle_open as f64
    } else {
        0.0
    };
    Ok(C10kResult {
        scenario: "c10k".into(),
        system: cmd.system.clone(),
        instances: cmd.instances,
        path: cfg.path.clone(),
        connections: cfg.connections,
        duration_s: cfg.duration.as_secs_f64(),
        requests_per_s: sat.requests_per_s,
        errors: sat.socket_errors.total() + sat.non_2xx,
        requests: sat.requests,
        cpu_us_per_request: if sat.requests > 0 {
            cpu_used * 1e6 / sat.requests as f64
        } else {
            0.0
        },
        socket_errors: sat.socket_errors,
        non_2xx: sat.non_2xx,
        latency_ms: latency,
        rate,
        rate_achieved,
        rate_errors,
        saturation_latency_ms: sat.latency,
        rss_mb: rss_busy,
        rss_base_mb: rss_base,
        rss_idle_mb: rss_idle,
        idle_connections: idle_open,
        rss_per_conn_kb: per_conn,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_reports_parse() {
        let out = "Running 10s test @ http://127.0.0.1:8080/static/4k
  2 threads and 10000 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    85.68ms   29.71ms   1.03s    75.52%
    Req/Sec     7.04k     1.27k   19.43k    85.71%
  Latency Distribution
     50%   80.00ms
     75%  100.00ms
     90%  120.00ms
     99%  200.50ms
  3588359 requests in 32.10s, 13.83GB read
  Socket errors: connect 1, read 2, write 3, timeout 12
  Non-2xx or 3xx responses: 5
Requests/sec: 111789.39
Transfer/sec:    441.05MB
";
        let r = parse_wrk(out).unwrap();
        assert_eq!(r.requests_per_s, 111789.39);
        assert_eq!(r.requests, 3588359);
        assert_eq!(r.socket_errors.total(), 18);
        assert_eq!(r.socket_errors.timeout, 12);
        assert_eq!(r.non_2xx, 5);
        assert_eq!(r.latency.p50, 80.0);
        assert_eq!(r.latency.p99, 200.5);
        assert_eq!(r.latency.max, 1030.0);
        assert_eq!(wrk_ms("512.00us"), Some(0.512));
        assert!(parse_wrk("garbage").is_none());
    }

    #[test]
    fn oha_reports_parse() {
        let json = r#"{"summary":{"requestsPerSec":199.6,"slowest":0.014},
            "latencyPercentiles":{"p50":0.0005,"p99":0.0087,"p99.9":0.0140},
            "statusCodeDistribution":{"200":400,"503":2},
            "errorDistribution":{"aborted due to deadline":3,"connection reset":1}}"#;
        let r = parse_oha(json).unwrap();
        assert_eq!(r.requests_per_s, 199.6);
        assert!((r.latency.p99 - 8.7).abs() < 1e-9);
        assert!((r.latency.max - 14.0).abs() < 1e-9);
        assert_eq!(r.errors, 3);
    }
}
