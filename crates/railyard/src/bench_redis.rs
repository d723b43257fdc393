//! `railyard bench redis-refresh`: seed 002 (see `railyard_bench::redis_refresh`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use railyard_bench::peer::default_peers_dir;
use railyard_bench::redis_refresh::{self, RedisRefreshResult, RunConfig, System};
use railyard_bench::report::{median, table, write_json};
use railyard_redis::double::ClusterDouble;
use railyard_redis::local_cluster::{dev_dir, LocalCluster};

/// Lettuce versions the peer builds.
const LETTUCE_LATEST: &str = "6.8.2.RELEASE";
const LETTUCE_SEED: &str = "6.1.6.RELEASE";

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LettucePeer {
    /// The newest Lettuce 6.x (6.8.2).
    Lettuce,
    /// Lettuce 6.1.6, the version in seed 002.
    #[value(name = "lettuce-6.1.6")]
    Lettuce616,
}

#[derive(Debug, clap::Args)]
pub(crate) struct RedisRefreshArgs {
    /// Cluster nodes (masters x (1 + replicas)); 1000 or more use the test double.
    #[arg(long, default_value_t = 96)]
    nodes: usize,
    /// Replicas per master.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Use the in-process test double even below 1000 nodes.
    #[arg(long)]
    double: bool,
    /// With the double: move one slot to another master (new epoch) this
    /// often, so every refresh check finds a change and runs a full refresh.
    #[arg(long, value_parser = crate::bench_cmd::parse_duration)]
    churn: Option<Duration>,
    /// Requests per second.
    #[arg(long, default_value_t = 10)]
    rate: u32,
    /// Measured attack per run.
    #[arg(long, default_value = "120s", value_parser = crate::bench_cmd::parse_duration)]
    duration: Duration,
    /// Unmeasured attack before each run.
    #[arg(long, default_value = "3s", value_parser = crate::bench_cmd::parse_duration)]
    warmup: Duration,
    /// Refresh settings to run, e.g. `1s,off` (the default) or `off`.
    #[arg(long, value_delimiter = ',', default_value = "1s,off", value_parser = crate::redis_node::parse_refresh)]
    refresh: Vec<Option<Duration>>,
    /// Also run Lettuce (repeat for both versions).
    #[arg(long, value_enum)]
    vs: Vec<LettucePeer>,
    /// Runs per configuration; tables show the median.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// First port of the real cluster (reused if `railyard dev redis-cluster` runs there).
    #[arg(long, default_value_t = 17000)]
    base_port: u16,
    /// `cluster-node-timeout` of a cluster the bench starts (Redis's default,
    /// 15s). Shorter timeouts make every node ping every other node more
    /// often: at 96 nodes and 5s the idle cluster's gossip is thousands of
    /// process wake-ups a second, which on a small machine sets the tail of
    /// everything else (see docs/benchmarks.md, seed 002).
    #[arg(long, default_value = "15s", value_parser = crate::bench_cmd::parse_duration)]
    node_timeout: Duration,
    /// Write every run as a JSON array to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Where the peers live (default: ./peers).
    #[arg(long)]
    peers_dir: Option<PathBuf>,
}

async fn lettuce_system(
    peers: &std::path::Path,
    version: &str,
    label: &str,
) -> anyhow::Result<System> {
    let dir = peers.join("lettuce-cluster");
    let dir = std::fs::canonicalize(&dir)
        .with_context(|| format!("peer directory {} not found", dir.display()))?;
    let jar = dir
        .join("target")
        .join(format!("lettuce-cluster-peer-{version}.jar"));
    if !jar.is_file() {
        eprintln!("building the Lettuce {version} peer with Maven (first run only)...");
        let st = tokio::process::Command::new("mvn")
            .args(["-q", "-B", "package", "-DskipTests"])
            .arg(format!("-Dlettuce.version={version}"))
            .current_dir(&dir)
            .status()
            .await
            .context("running mvn (install Maven and Java 17)")?;
        if !st.success() || !jar.is_file() {
            bail!("building the Lettuce peer failed; run `mvn package -Dlettuce.version={version}` in {}", dir.display());
        }
    }
    let jvm_flags = std::fs::read_to_string(dir.join("jvm.options"))
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    Ok(System::Lettuce {
        label: label.to_owned(),
        jar,
        jvm_flags,
    })
}

fn fmt_refresh(r: Option<Duration>) -> String {
    match r {
        None => "off".into(),
        Some(d) if d.subsec_millis() == 0 => format!("{}s", d.as_secs()),
        Some(d) => format!("{}ms", d.as_millis()),
    }
}

pub(crate) async fn run(a: RedisRefreshArgs) -> anyhow::Result<()> {
    if a.runs == 0 || a.rate == 0 {
        bail!("--runs and --rate must be at least 1");
    }
    let masters = crate::dev::masters_for(a.nodes, a.replicas)?;
    let peers = a.peers_dir.clone().unwrap_or_else(default_peers_dir);
    let mut systems = vec![System::Railyard {
        exe: std::env::current_exe().context("locating the railyard binary")?,
    }];
    for v in &a.vs {
        systems.push(match v {
            LettucePeer::Lettuce => lettuce_system(&peers, LETTUCE_LATEST, "lettuce-6.8.2").await?,
            LettucePeer::Lettuce616 => {
                lettuce_system(&peers, LETTUCE_SEED, "lettuce-6.1.6").await?
            }
        });
    }

    // The cluster: the double for 1000 nodes (or --double), else a real one.
    let use_double = a.double || a.nodes >= 1000;
    let mut _owned: Option<LocalCluster> = None;
    let _double: Option<std::sync::Arc<ClusterDouble>>;
    let mut _churn: Option<tokio::task::JoinHandle<()>> = None;
    if a.churn.is_some() && !(a.double || a.nodes >= 1000) {
        bail!("--churn needs the test double (--nodes 1000 or --double)");
    }
    let seeds: Vec<String>;
    if use_double {
        let d = ClusterDouble::start(masters, a.replicas, None)
            .await
            .context("starting the cluster double")?;
        seeds = d.addrs()[..3].to_vec();
        eprintln!("cluster double: {} nodes ({masters} masters)", a.nodes);
        let d = std::sync::Arc::new(d);
        if let Some(every) = a.churn {
            let d = d.clone();
            _churn = Some(tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.tick().await;
                for slot in (0..16384u16).cycle() {
                    tick.tick().await;
                    let d = d.clone();
                    // Rendering 1000 nodes' lines is CPU work: off the double's I/O workers.
                    let _ = tokio::task::spawn_blocking(move || {
                        let mut t = d.topology(0);
                        let to = (usize::from(t.owner[usize::from(slot)]) + 1) % masters;
                        t.move_slots(slot, slot, to);
                        d.apply(t, None);
                    })
                    .await;
                }
            }));
        }
        _double = Some(d);
    } else {
        _double = None;
        let dir = dev_dir(a.base_port);
        let existing = LocalCluster::adopt(&dir)
            .ok()
            .filter(|c| c.ports().len() == a.nodes);
        let cluster = match existing {
            Some(c) => {
                // Its node timeout sets how much gossip runs beside the bench.
                let timeout = tokio::process::Command::new("redis-cli")
                    .args(["-p", &a.base_port.to_string()])
                    .args(["config", "get", "cluster-node-timeout"])
                    .output()
                    .await
                    .ok()
                    .and_then(|o| {
                        String::from_utf8_lossy(&o.stdout)
                            .lines()
                            .nth(1)
                            .map(str::to_owned)
                    });
                let wanted = a.node_timeout.as_millis().to_string();
                if timeout.as_deref().is_some_and(|ms| ms != wanted) {
                    eprintln!(
                        "warning: the reused cluster's cluster-node-timeout is {} ms, not --node-timeout's {wanted} ms: \
                         its gossip differs from a fresh cluster's and skews the tail; stop it \
                         (railyard dev redis-cluster down --base-port {}) to let the bench start one",
                        timeout.as_deref().unwrap_or("?"),
                        a.base_port
                    );
                }
                let timeout = timeout.map_or_else(|| "unknown".to_owned(), |ms| format!("{ms} ms"));
                eprintln!(
                    "reusing the redis cluster on base port {} ({} nodes, cluster-node-timeout {timeout})",
                    a.base_port, a.nodes
                );
                c
            }
            None => {
                let pb = crate::bench_cmd::spinner(format!(
                    "starting a {}-node redis cluster and waiting until it agrees...",
                    a.nodes
                ));
                let c = LocalCluster::start(
                    &dir,
                    masters,
                    a.replicas,
                    a.base_port,
                    a.node_timeout,
                    Duration::from_secs(600),
                    true,
                )
                .await;
                pb.finish_and_clear();
                c.context("starting the redis cluster")?
            }
        };
        seeds = cluster.addrs()[..3].to_vec();
        _owned = Some(cluster);
    }

    let work = std::env::temp_dir();
    let mut all: Vec<RedisRefreshResult> = Vec::new();
    for run in 1..=a.runs {
        for &refresh in &a.refresh {
            for system in &systems {
                let cfg = RunConfig {
                    system: system.clone(),
                    seeds: seeds.clone(),
                    nodes: a.nodes,
                    cluster: match (use_double, a.churn) {
                        (false, _) => "real".into(),
                        (true, None) => "double".into(),
                        (true, Some(c)) => format!("double, churn every {c:?}"),
                    },
                    refresh,
                    rate: a.rate,
                    duration: a.duration,
                    warmup: a.warmup,
                    run,
                };
                let pb = crate::bench_cmd::clock_bar(
                    format!(
                        "run {run}/{}: {} refresh {} at {}/s",
                        a.runs,
                        system.label(),
                        fmt_refresh(refresh),
                        a.rate
                    ),
                    a.warmup + a.duration,
                );
                let r = redis_refresh::run_one(&cfg, &work).await;
                pb.finish_and_clear();
                let r = r.with_context(|| {
                    format!("{} refresh {}", system.label(), fmt_refresh(refresh))
                })?;
                println!(
                    "{:>14} refresh {:>5} run {run}: {}  success {:.2}%",
                    r.system,
                    r.refresh,
                    r.vegeta_latencies,
                    r.success_ratio * 100.0
                );
                all.push(r);
            }
        }
    }

    // Every system's refresh CPU the same way: (process CPU with refresh -
    // without) per period. (Railyard's own thread measurement has a column
    // of its own.)
    let med = |rs: &[&RedisRefreshResult], f: fn(&RedisRefreshResult) -> f64| {
        median(&rs.iter().map(|r| f(r)).collect::<Vec<_>>()).unwrap_or(0.0)
    };
    let labels: Vec<String> = systems.iter().map(System::label).collect();
    for label in &labels {
        let off: Vec<&RedisRefreshResult> = all
            .iter()
            .filter(|r| &r.system == label && r.refresh == "off")
            .collect();
        let cpu_off = (!off.is_empty()).then(|| med(&off, |r| r.process_cpu_ms));
        for r in all
            .iter_mut()
            .filter(|r| &r.system == label && r.refresh != "off")
        {
            if let (Some(off), Some(p)) = (
                cpu_off,
                r.refresh
                    .strip_suffix('s')
                    .and_then(|s| s.parse::<f64>().ok()),
            ) {
                r.refresh_cpu_ms = Some(((r.process_cpu_ms - off) / (r.duration_s / p)).max(0.0));
            }
        }
    }

    let mut rows = vec![];
    for label in &labels {
        for &refresh in &a.refresh {
            let rs: Vec<&RedisRefreshResult> = all
                .iter()
                .filter(|r| &r.system == label && r.refresh == fmt_refresh(refresh))
                .collect();
            if rs.is_empty() {
                continue;
            }
            let f = |x: f64| format!("{x:.2}");
            rows.push(vec![
                label.clone(),
                fmt_refresh(refresh),
                f(med(&rs, |r| r.latency_ms.p50)),
                f(med(&rs, |r| r.latency_ms.p90)),
                f(med(&rs, |r| r.latency_ms.p99)),
                f(med(&rs, |r| r.latency_ms.p999)),
                f(med(&rs, |r| r.latency_ms.max)),
                {
                    let h: Vec<f64> = rs
                        .iter()
                        .filter_map(|r| r.handler_ms.map(|h| h.p999))
                        .collect();
                    median(&h).map_or_else(|| "-".to_owned(), f)
                },
                format!("{:.2}%", med(&rs, |r| r.success_ratio) * 100.0),
                format!("{:.0}", med(&rs, |r| r.process_cpu_ms)),
                rs.iter()
                    .filter_map(|r| r.refresh_cpu_ms)
                    .collect::<Vec<_>>()
                    .pipe_median(),
                rs.iter()
                    .filter_map(|r| r.refresh_thread_cpu_ms)
                    .collect::<Vec<_>>()
                    .pipe_median(),
            ]);
        }
    }
    println!(
        "\nredis-refresh: {} nodes ({}), {}/s for {:?}, median of {} run(s)\n{}",
        a.nodes,
        match (use_double, a.churn) {
            (false, _) => "real cluster".to_owned(),
            (true, None) => "double".to_owned(),
            (true, Some(c)) => format!("double, a slot moves every {c:?}"),
        },
        a.rate,
        a.duration,
        a.runs,
        table(
            &[
                "system",
                "refresh",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "p99.9 ms",
                "max ms",
                "handler p99.9 ms",
                "success",
                "process cpu ms",
                "refresh cpu ms/period",
                "railyard refresh thread cpu ms/period",
            ],
            rows
        )
    );
    for label in &labels {
        let p99 = |refresh: &str| {
            let rs: Vec<&RedisRefreshResult> = all
                .iter()
                .filter(|r| &r.system == label && r.refresh == refresh)
                .collect();
            (!rs.is_empty()).then(|| med(&rs, |r| r.latency_ms.p99))
        };
        for &refresh in a.refresh.iter().flatten() {
            if let (Some(on), Some(off)) = (p99(&fmt_refresh(Some(refresh))), p99("off")) {
                println!(
                    "{label}: p99 with refresh {} / p99 with refresh off = {:.2}x",
                    fmt_refresh(Some(refresh)),
                    on / off
                );
            }
        }
    }
    if let Some(h) = _churn.take() {
        h.abort();
    }
    if let Some(path) = &a.json {
        let rows: Vec<serde_json::Value> = all
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<_, _>>()?;
        write_json(path, &rows).with_context(|| format!("writing {}", path.display()))?;
        crate::bench_plot::announce_json(path, rows.len());
    }
    Ok(())
}

trait PipeMedian {
    fn pipe_median(self) -> String;
}

impl PipeMedian for Vec<f64> {
    fn pipe_median(self) -> String {
        median(&self).map_or_else(|| "-".to_owned(), |m| format!("{m:.2}"))
    }
}
