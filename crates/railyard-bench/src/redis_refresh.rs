//! Seed 002: a `GET /test` service doing a Redis SET + GET through a cluster
//! client, driven at a fixed rate by `vegeta`, with periodic topology refresh
//! on and off.
//!
//! One run: start the service as its own process (Railyard's `railyard node
//! --redis-cluster ...` or the Lettuce peer's jar), wait until `/test`
//! answers, warm up, then `vegeta attack -rate R -duration D` and read
//! vegeta's report (its latency line and JSON), plus the service's CPU time
//! from `/proc` and, for Railyard, its refresher counters from `/stats`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A tool is missing or failed to start.
    #[error("could not run `{tool}`: {source}; {hint}")]
    Spawn {
        /// The program.
        tool: String,
        /// Where to get it.
        hint: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The service never answered `GET /test` with 200.
    #[error("the {system} service exited or did not answer GET /test within {0:?} (its stderr is above)", system = .1)]
    NotReady(Duration, String),
    /// vegeta failed.
    #[error("vegeta failed: {0}")]
    Vegeta(String),
    /// I/O.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Which service to run.
#[derive(Debug, Clone)]
pub enum System {
    /// `railyard node` at this executable path.
    Railyard {
        /// The `railyard` binary.
        exe: PathBuf,
    },
    /// The Lettuce peer jar.
    Lettuce {
        /// Label, e.g. `lettuce-6.1.6`.
        label: String,
        /// The jar.
        jar: PathBuf,
        /// JVM flags from the peer's `jvm.options`.
        jvm_flags: Vec<String>,
    },
}

impl System {
    /// The `system` field of result rows.
    pub fn label(&self) -> String {
        match self {
            System::Railyard { .. } => "railyard".into(),
            System::Lettuce { label, .. } => label.clone(),
        }
    }
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The service.
    pub system: System,
    /// Cluster seed addresses.
    pub seeds: Vec<String>,
    /// Nodes in the cluster (for the result row).
    pub nodes: usize,
    /// `real` or `double`.
    pub cluster: String,
    /// Refresh period, `None` = off.
    pub refresh: Option<Duration>,
    /// Requests per second.
    pub rate: u32,
    /// Measured attack.
    pub duration: Duration,
    /// Unmeasured attack first.
    pub warmup: Duration,
    /// Which run of several this is.
    pub run: usize,
}

/// Latency figures, ms.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Latency {
    /// Minimum.
    pub min: f64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile (exact, from vegeta's raw results).
    pub p999: f64,
    /// Maximum.
    pub max: f64,
}

/// Railyard only: how long the service's `/test` handlers took (client and
/// Redis), ms, over the measured attack; the rest of vegeta's figure is
/// spent outside the handler (sockets, scheduling, vegeta itself).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct HandlerLatency {
    /// Handlers timed.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Maximum.
    pub max: f64,
}

impl HandlerLatency {
    fn from_stats(v: &serde_json::Value) -> Option<Self> {
        let h = &v["test_handler_us"];
        let ms = |k: &str| Some(h[k].as_f64()? / 1e3);
        Some(Self {
            count: h["count"].as_u64()?,
            p50: ms("p50")?,
            p90: ms("p90")?,
            p99: ms("p99")?,
            p999: ms("p999")?,
            max: ms("max")?,
        })
    }
}

/// One result row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RedisRefreshResult {
    /// Always `redis-refresh`.
    pub scenario: String,
    /// `railyard`, `lettuce-6.1.6`, ...
    pub system: String,
    /// Cluster nodes.
    pub nodes: usize,
    /// `real` or `double`.
    pub cluster: String,
    /// Requests per second.
    pub rate: u32,
    /// Measured seconds.
    pub duration_s: f64,
    /// `off` or the period, e.g. `1s`.
    pub refresh: String,
    /// Run number.
    pub run: usize,
    /// Requests sent.
    pub requests: u64,
    /// Latencies.
    pub latency_ms: Latency,
    /// Share of 2xx answers.
    pub success_ratio: f64,
    /// vegeta's own latency line.
    pub vegeta_latencies: String,
    /// Service process CPU (user + system) during the measured attack, ms.
    pub process_cpu_ms: f64,
    /// CPU per refresh period that refreshing costs the process, ms: filled
    /// in by the caller for every system alike, as (process CPU with refresh
    /// - without) / periods.
    pub refresh_cpu_ms: Option<f64>,
    /// Railyard only: its own measurement of the thread CPU of its blocking
    /// check and refresh work per period, ms (probes not included).
    #[serde(default)]
    pub refresh_thread_cpu_ms: Option<f64>,
    /// Railyard only: full refreshes during the attack.
    pub full_refreshes: Option<u64>,
    /// Railyard only: periodic deep checks (`CLUSTER NODES`) during the attack.
    pub checks: Option<u64>,
    /// Railyard only: periodic probes (`CLUSTER INFO`) during the attack.
    #[serde(default)]
    pub probes: Option<u64>,
    /// Railyard only: CPU of the last full refresh, ms.
    pub last_full_refresh_cpu_ms: Option<f64>,
    /// Railyard only: the service's own `/test` handler times.
    #[serde(default)]
    pub handler_ms: Option<HandlerLatency>,
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Utime + stime of `pid`, in ms.
pub fn process_cpu_ms(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    // Safety: sysconf with a constant name reads no memory of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((utime + stime) * 1000.0 / if hz > 0.0 { hz } else { 100.0 })
}

/// `GET path` on loopback; returns the status and body.
pub async fn http_get(port: u16, path: &str) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.as_bytes().to_vec())
        .unwrap_or_default();
    Ok((status, body))
}

fn fmt_period(p: Option<Duration>) -> String {
    match p {
        None => "off".into(),
        Some(d) if d.subsec_millis() == 0 => format!("{}s", d.as_secs()),
        Some(d) => format!("{}ms", d.as_millis()),
    }
}

fn spawn_service(cfg: &RunConfig, port: u16) -> Result<Child, RunError> {
    let mut cmd = match &cfg.system {
        System::Railyard { exe } => {
            let mut c = Command::new(exe);
            c.arg("node")
                .arg("--no-saga")
                // Only `/test` is measured: nothing on the bridge's or the
                // HTTP server's default ports, which may be taken.
                .args(["--no-bridge", "--http-port", "0", "--admin-port", "0"])
                .arg("--stats-every")
                .arg("0")
                .arg("--redis-cluster")
                .arg(cfg.seeds.join(","))
                .arg("--redis-test-port")
                .arg(port.to_string())
                .arg("--redis-refresh")
                .arg(fmt_period(cfg.refresh))
                .env("RAILYARD_LOG", "warn");
            c
        }
        System::Lettuce { jar, jvm_flags, .. } => {
            let mut c = Command::new("java");
            c.args(jvm_flags)
                .arg("-jar")
                .arg(jar)
                .arg("--seeds")
                .arg(cfg.seeds.join(","))
                .arg("--port")
                .arg(port.to_string())
                .arg("--refresh-ms")
                .arg(cfg.refresh.map_or(0, |d| d.as_millis()).to_string());
            c
        }
    };
    cmd.stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let tool = match &cfg.system {
        System::Railyard { exe } => exe.display().to_string(),
        System::Lettuce { .. } => "java".into(),
    };
    cmd.spawn().map_err(|source| RunError::Spawn {
        tool,
        hint: "build railyard / install Java 17".into(),
        source,
    })
}

async fn vegeta(args: &[&str], stdin: Option<&[u8]>) -> Result<Vec<u8>, RunError> {
    let mut child = Command::new("vegeta")
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| RunError::Spawn {
            tool: "vegeta".into(),
            hint: "install it with scripts/install-vegeta".into(),
            source,
        })?;
    if let (Some(input), Some(mut si)) = (stdin, child.stdin.take()) {
        si.write_all(input).await?;
    }
    let out = child.wait_with_output().await?;
    if !out.status.success() {
        return Err(RunError::Vegeta(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    Ok(out.stdout)
}

#[derive(Deserialize)]
struct VegetaJson {
    latencies: VegetaLatencies,
    requests: u64,
    success: f64,
}

#[derive(Deserialize)]
struct VegetaLatencies {
    mean: f64,
    #[serde(rename = "50th")]
    p50: f64,
    #[serde(rename = "90th")]
    p90: f64,
    #[serde(rename = "95th")]
    p95: f64,
    #[serde(rename = "99th")]
    p99: f64,
    max: f64,
    min: f64,
}

/// Exact p99.9 from `vegeta encode --to csv` (latency is the third column, ns).
fn p999_from_csv(csv: &[u8]) -> f64 {
    let mut lat: Vec<u64> = String::from_utf8_lossy(csv)
        .lines()
        .filter_map(|l| l.split(',').nth(2)?.parse().ok())
        .collect();
    if lat.is_empty() {
        return 0.0;
    }
    lat.sort_unstable();
    let i = ((lat.len() as f64) * 0.999).ceil() as usize;
    lat[i.clamp(1, lat.len()) - 1] as f64 / 1e6
}

/// Runs one measured attack against a fresh service process.
///
/// # Errors
/// Any [`RunError`].
pub async fn run_one(cfg: &RunConfig, work_dir: &Path) -> Result<RedisRefreshResult, RunError> {
    let port = free_port()?;
    let mut child = spawn_service(cfg, port)?;
    let pid = child.id().unwrap_or(0);
    let ready_limit = Duration::from_secs(180);
    let started = Instant::now();
    loop {
        if let Ok((200, _)) = http_get(port, "/test").await {
            break;
        }
        if started.elapsed() > ready_limit || child.try_wait()?.is_some() {
            let _ = child.kill().await;
            return Err(RunError::NotReady(ready_limit, cfg.system.label()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let target = format!("GET http://127.0.0.1:{port}/test\n");
    let rate = format!("-rate={}", cfg.rate);
    if !cfg.warmup.is_zero() {
        let d = format!("-duration={}ms", cfg.warmup.as_millis());
        vegeta(
            &["attack", &rate, &d, "-output=/dev/null"],
            Some(target.as_bytes()),
        )
        .await?;
    }
    let stats_before = railyard_stats(cfg, port).await;
    let cpu_before = process_cpu_ms(pid).unwrap_or(0.0);
    let bin = work_dir.join(format!("vegeta-{}-{port}.bin", std::process::id()));
    let bin_s = bin.display().to_string();
    let d = format!("-duration={}ms", cfg.duration.as_millis());
    let out = format!("-output={bin_s}");
    vegeta(
        &["attack", &rate, &d, "-timeout=30s", &out],
        Some(target.as_bytes()),
    )
    .await?;
    let cpu_after = process_cpu_ms(pid).unwrap_or(0.0);
    let stats_after = railyard_stats(cfg, port).await;
    let _ = child.kill().await;

    let text = String::from_utf8_lossy(&vegeta(&["report", &bin_s], None).await?).into_owned();
    let json: VegetaJson =
        serde_json::from_slice(&vegeta(&["report", "-type=json", &bin_s], None).await?)
            .map_err(|e| RunError::Vegeta(format!("unreadable JSON report: {e}")))?;
    let csv = vegeta(&["encode", "--to=csv", &bin_s], None).await?;
    let _ = std::fs::remove_file(&bin);
    let line = text
        .lines()
        .find(|l| l.starts_with("Latencies"))
        .unwrap_or("")
        .trim()
        .to_owned();
    let ms = |ns: f64| ns / 1e6;
    let l = &json.latencies;
    let delta = |f: fn(&serde_json::Value) -> Option<f64>| match (&stats_before, &stats_after) {
        (Some(a), Some(b)) => Some(f(b)? - f(a)?),
        _ => None,
    };
    let periods = cfg
        .refresh
        .map(|p| cfg.duration.as_secs_f64() / p.as_secs_f64());
    let topo_cpu = delta(|v| {
        Some(v["refresh"]["full_cpu_ms"].as_f64()? + v["refresh"]["check_cpu_ms"].as_f64()?)
    });
    Ok(RedisRefreshResult {
        scenario: "redis-refresh".into(),
        system: cfg.system.label(),
        nodes: cfg.nodes,
        cluster: cfg.cluster.clone(),
        rate: cfg.rate,
        duration_s: cfg.duration.as_secs_f64(),
        refresh: fmt_period(cfg.refresh),
        run: cfg.run,
        requests: json.requests,
        latency_ms: Latency {
            min: ms(l.min),
            mean: ms(l.mean),
            p50: ms(l.p50),
            p90: ms(l.p90),
            p95: ms(l.p95),
            p99: ms(l.p99),
            p999: p999_from_csv(&csv),
            max: ms(l.max),
        },
        success_ratio: json.success,
        vegeta_latencies: line,
        process_cpu_ms: cpu_after - cpu_before,
        refresh_cpu_ms: None,
        refresh_thread_cpu_ms: match (topo_cpu, periods) {
            (Some(c), Some(p)) if p > 0.0 => Some(c / p),
            (Some(_), None) => Some(0.0),
            _ => None,
        },
        full_refreshes: delta(|v| v["refresh"]["full_refreshes"].as_f64()).map(|x| x as u64),
        checks: delta(|v| v["refresh"]["checks"].as_f64()).map(|x| x as u64),
        probes: delta(|v| v["refresh"]["probes"].as_f64()).map(|x| x as u64),
        last_full_refresh_cpu_ms: stats_after
            .as_ref()
            .and_then(|v| v["refresh"]["last_full_cpu_ms"].as_f64()),
        // Reading /stats before the attack reset the handler times, so this
        // covers the measured attack only.
        handler_ms: stats_after.as_ref().and_then(HandlerLatency::from_stats),
    })
}

async fn railyard_stats(cfg: &RunConfig, port: u16) -> Option<serde_json::Value> {
    if !matches!(cfg.system, System::Railyard { .. }) {
        return None;
    }
    let (status, body) = http_get(port, "/stats").await.ok()?;
    (status == 200).then(|| serde_json::from_slice(&body).ok())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p999_is_exact_over_raw_latencies() {
        let mut csv = String::new();
        for i in 1..=1000u64 {
            csv.push_str(&format!(
                "1700000000,200,{},0,2,,,,{i},GET,http://x,\n",
                i * 1_000_000
            ));
        }
        assert_eq!(p999_from_csv(csv.as_bytes()), 999.0);
        assert_eq!(p999_from_csv(b""), 0.0);
    }

    #[test]
    fn periods_format_like_the_cli() {
        assert_eq!(fmt_period(None), "off");
        assert_eq!(fmt_period(Some(Duration::from_secs(1))), "1s");
        assert_eq!(fmt_period(Some(Duration::from_millis(250))), "250ms");
    }
}
