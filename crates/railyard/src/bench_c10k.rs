//! `railyard bench c10k`: seed 004, Railyard's HTTP server against Vert.x
//! under 10k connections.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use indicatif::{ProgressBar, ProgressStyle};
use railyard_bench::c10k::{self, C10kConfig, C10kResult, ServerCommand};
use railyard_bench::peer::{default_peers_dir, JavaPeer};
use railyard_bench::report::{median, table, thousands, write_json};

use crate::bench_cmd::parse_duration;

/// Options of `railyard bench c10k`.
#[derive(Debug, clap::Args)]
pub(crate) struct C10kArgs {
    /// Connections wrk holds open at saturation.
    #[arg(long, default_value_t = 10_000)]
    connections: usize,
    /// Length of the saturation and of the fixed-rate runs.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    duration: Duration,
    /// Warm-up with 100 connections before measuring (not counted).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    warmup: Duration,
    /// Path requested.
    #[arg(long, default_value = "/static/4k")]
    path: String,
    /// Fixed rate (requests/s) for the latency run. Default: half the
    /// saturation throughput of the first system measured (Vert.x with one
    /// verticle per core under --vs vertx), then the same rate for all.
    #[arg(long)]
    rate: Option<u64>,
    /// Connections oha uses for the fixed-rate run.
    #[arg(long, default_value_t = 1000)]
    rate_connections: usize,
    /// Idle keep-alive connections for the memory reading (default: --connections).
    #[arg(long)]
    idle_connections: Option<usize>,
    /// Also run the original system, on the same ports, in turn.
    #[arg(long, value_enum)]
    vs: Option<C10kPeer>,
    /// Vert.x verticle instances per core to try; the best is compared.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    vertx_instances_per_core: Vec<usize>,
    /// Runs per system; tables show the median.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Write every run as a JSON array to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Where the peers live (default: ./peers).
    #[arg(long)]
    peers_dir: Option<PathBuf>,
    /// HTTP port of the server under test.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Admin/metrics port of the server under test.
    #[arg(long, default_value_t = 8081)]
    admin_port: u16,
    /// wrk threads.
    #[arg(long, default_value_t = 2)]
    wrk_threads: usize,
    /// Railyard's HTTP event-loop threads (default: one per core).
    #[arg(long)]
    http_threads: Option<usize>,
    /// Show the servers' output.
    #[arg(long)]
    verbose: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum C10kPeer {
    /// Vert.x 4.5 (peers/vertx-c10k).
    Vertx,
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

pub(crate) async fn run(a: C10kArgs) -> anyhow::Result<()> {
    if a.runs == 0 || a.connections == 0 || a.vertx_instances_per_core.contains(&0) {
        bail!("--runs, --connections and --vertx-instances-per-core must be at least 1");
    }
    if !a.path.starts_with('/') {
        bail!("--path must start with '/', e.g. /static/4k");
    }
    let limit = c10k::raise_nofile_limit().context("raising the open-file limit")?;
    let needed = a
        .connections
        .max(a.idle_connections.unwrap_or(a.connections)) as u64
        + 100;
    if limit < needed {
        bail!(
            "the open-file hard limit is {limit}, below the {needed} descriptors {} connections need; \
             lower --connections or raise the hard limit (ulimit -Hn)",
            a.connections
        );
    }
    let data_dir = std::env::temp_dir().join("railyard-c10k-bench");
    let send_file = data_dir.join("test");
    if !send_file.exists() {
        std::fs::create_dir_all(&data_dir)?;
        std::fs::write(
            &send_file,
            railyard_http::c10k::random_alnum(railyard_http::c10k::DEFAULT_SEND_FILE_LEN),
        )
        .context("writing the send file")?;
    }

    let mut systems = vec![];
    if a.vs.is_some() {
        let dir = a.peers_dir.clone().unwrap_or_else(default_peers_dir);
        let peer = JavaPeer::new(&dir, "vertx-c10k", "vertx-c10k-peer.jar");
        peer.ensure_built().await?;
        for ipc in &a.vertx_instances_per_core {
            let instances = ipc * cores();
            let args: Vec<String> = [
                "--port",
                &a.port.to_string(),
                "--metrics-port",
                &a.admin_port.to_string(),
                "--instances",
                &instances.to_string(),
                "--send-file",
                &send_file.display().to_string(),
                "--upload-dir",
                &data_dir.join("vertx-uploads").display().to_string(),
            ]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
            let (java_args, cwd) = peer.java_args(&args);
            systems.push(ServerCommand {
                system: "vertx".into(),
                program: "java".into(),
                args: java_args,
                cwd: Some(cwd),
                instances: Some(instances),
            });
        }
    }
    let mut node_args: Vec<String> = [
        "node",
        "--no-saga",
        // Only the HTTP server is measured: no listener on the bridge's default port.
        "--no-bridge",
        "--name",
        "c10k-bench",
        "--stats-every",
        "0",
        "--http-port",
        &a.port.to_string(),
        "--admin-port",
        &a.admin_port.to_string(),
        "--data-dir",
        &data_dir.display().to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    if let Some(t) = a.http_threads {
        node_args.extend(["--http-threads".to_owned(), t.to_string()]);
    }
    systems.push(ServerCommand {
        system: "railyard".into(),
        program: std::env::current_exe().context("finding the railyard binary")?,
        args: node_args,
        cwd: None,
        instances: None,
    });

    let mut rate = a.rate;
    let mut results: Vec<C10kResult> = vec![];
    for run in 1..=a.runs {
        for sys in &systems {
            let label = match sys.instances {
                Some(i) => format!("{} ({i} verticles)", sys.system),
                None => sys.system.clone(),
            };
            let cfg = C10kConfig {
                connections: a.connections,
                duration: a.duration,
                warmup: a.warmup,
                path: a.path.clone(),
                rate,
                rate_connections: a.rate_connections,
                idle_connections: a.idle_connections.unwrap_or(a.connections),
                wrk_threads: a.wrk_threads,
                port: a.port,
            };
            let pb = ProgressBar::new_spinner();
            pb.set_style(
                ProgressStyle::with_template("{spinner} {prefix} [{elapsed:>3}] {msg}")
                    .expect("the template is valid"),
            );
            pb.set_prefix(format!("c10k #{run}/{} {label}", a.runs));
            pb.enable_steady_tick(Duration::from_millis(200));
            let phase = |name: &str, expected: Duration| {
                pb.set_message(format!("{name} (~{}s)", expected.as_secs()));
            };
            // Another server on these ports (a running `railyard node`)
            // would answer instead of the one under test, unnoticed.
            ports_free(&[(a.port, "--port"), (a.admin_port, "--admin-port")]).await?;
            let r = c10k::run(sys, &cfg, &phase, a.verbose)
                .await
                .with_context(|| format!("c10k run {run} against {label}"))?;
            pb.finish_with_message(format!(
                "{} req/s, {:.1} CPU us/req, {} errors, p99 {:.2} ms at {} req/s, {:.1} KiB/idle conn",
                thousands(r.requests_per_s as u64),
                r.cpu_us_per_request,
                r.errors,
                r.latency_ms.p99,
                thousands(r.rate),
                r.rss_per_conn_kb
            ));
            rate.get_or_insert(r.rate);
            results.push(r);
        }
    }
    report(&a, &results);
    if let Some(path) = &a.json {
        let rows: Vec<serde_json::Value> = results
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<_, _>>()?;
        write_json(path, &rows).with_context(|| format!("writing {}", path.display()))?;
        crate::bench_plot::announce_json(path, rows.len());
    }
    Ok(())
}

/// Medians of one system configuration's runs.
struct Summary {
    label: String,
    rps: f64,
    errors: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    max: f64,
    rate: u64,
    rss_mb: f64,
    per_conn_kb: f64,
    cpu_us: f64,
}

fn summarize(label: String, rs: &[&C10kResult]) -> Summary {
    let m = |f: fn(&C10kResult) -> f64| {
        median(&rs.iter().map(|r| f(r)).collect::<Vec<_>>()).unwrap_or(0.0)
    };
    Summary {
        label,
        rps: m(|r| r.requests_per_s),
        errors: m(|r| r.errors as f64),
        p50: m(|r| r.latency_ms.p50),
        p99: m(|r| r.latency_ms.p99),
        p999: m(|r| r.latency_ms.p999),
        max: m(|r| r.latency_ms.max),
        rate: rs.first().map_or(0, |r| r.rate),
        rss_mb: m(|r| r.rss_mb),
        per_conn_kb: m(|r| r.rss_per_conn_kb),
        cpu_us: m(|r| r.cpu_us_per_request),
    }
}

/// Fails unless each port can be bound on loopback, waiting up to 5 s for
/// the previous run's server to let go of it.
async fn ports_free(ports: &[(u16, &str)]) -> anyhow::Result<()> {
    for &(port, flag) in ports {
        let mut tries = 0;
        while std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
            tries += 1;
            if tries >= 50 {
                bail!(
                    "port {port} is in use (a running `railyard node`, or another server?): \
                     the bench would measure that server instead of the one it starts; \
                     stop it, or pass {flag} with a free port"
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

fn report(a: &C10kArgs, results: &[C10kResult]) {
    let mut keys: Vec<(String, Option<usize>)> = vec![];
    for r in results {
        let k = (r.system.clone(), r.instances);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let sums: Vec<Summary> = keys
        .iter()
        .map(|(sys, inst)| {
            let rs: Vec<&C10kResult> = results
                .iter()
                .filter(|r| &r.system == sys && &r.instances == inst)
                .collect();
            let label = match inst {
                Some(i) => format!("{sys} ({i} verticles)"),
                None => sys.clone(),
            };
            summarize(label, &rs)
        })
        .collect();
    let rows = sums
        .iter()
        .map(|s| {
            vec![
                s.label.clone(),
                thousands(s.rps as u64),
                format!("{:.1}", s.cpu_us),
                format!("{}", s.errors),
                thousands(s.rate),
                format!("{:.2}", s.p50),
                format!("{:.2}", s.p99),
                format!("{:.2}", s.p999),
                format!("{:.2}", s.max),
                format!("{:.0}", s.rss_mb),
                format!("{:.1}", s.per_conn_kb),
            ]
        })
        .collect();
    println!(
        "\nc10k: GET {} with {} connections for {:?}, median of {} run(s)\n{}",
        a.path,
        thousands(a.connections as u64),
        a.duration,
        a.runs,
        table(
            &[
                "system",
                "req/s (wrk)",
                "CPU us/req",
                "errors",
                "fixed rate",
                "p50 ms",
                "p99 ms",
                "p99.9 ms",
                "max ms",
                "busy RSS MB",
                "KiB per idle conn",
            ],
            rows
        )
    );
    let ours = sums.iter().find(|s| s.label == "railyard");
    let best_vertx = sums
        .iter()
        .filter(|s| s.label.starts_with("vertx"))
        .max_by(|x, y| x.rps.total_cmp(&y.rps));
    if let (Some(o), Some(v)) = (ours, best_vertx) {
        println!(
            "railyard vs {} (Vert.x's best): {:.2}x requests/s, {:.2}x less CPU per request, p99 {:.2} ms vs {:.2} ms, {:.1} vs {:.1} KiB per idle connection",
            v.label,
            o.rps / v.rps,
            v.cpu_us / o.cpu_us,
            o.p99,
            v.p99,
            o.per_conn_kb,
            v.per_conn_kb
        );
    }
}

#[cfg(test)]
mod tests {
    use super::ports_free;

    /// A port another server holds is refused, naming the flag to change;
    /// a free one passes.
    #[tokio::test(start_paused = true)]
    async fn a_port_in_use_is_refused_before_the_run() {
        let held = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("bind");
        let port = held.local_addr().expect("addr").port();
        let err = ports_free(&[(port, "--port")]).await.expect_err("in use");
        let text = err.to_string();
        assert!(text.contains(&format!("port {port} is in use")), "{text}");
        assert!(text.contains("--port"), "{text}");
        drop(held);
        ports_free(&[(port, "--port")]).await.expect("free now");
    }
}
