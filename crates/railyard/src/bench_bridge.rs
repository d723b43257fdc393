//! `railyard bench bridge`: request/reply round trips through the TCP
//! event-bus bridge, Railyard's node against Vert.x's bridge, each as its own
//! process, driven by the same Rust load client.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use railyard_bench::bridge::{self, BridgeBenchConfig, BridgeResult, ServerUnderTest};
use railyard_bench::peer::{default_peers_dir, JavaPeer};
use railyard_bench::report::{median, table, thousands, write_json};

/// Options for `railyard bench bridge`.
#[derive(Debug, clap::Args)]
pub(crate) struct BridgeArgs {
    /// Load connections, each a tokio task speaking the wire protocol.
    #[arg(long, default_value_t = 100)]
    clients: usize,
    /// Requests each connection keeps outstanding.
    #[arg(long, default_value_t = 1)]
    in_flight: usize,
    /// Measured window (e.g. 10s, 500ms).
    #[arg(long, default_value = "10s", value_parser = crate::bench_cmd::parse_duration)]
    duration: Duration,
    /// Warm-up before the window, not counted (the JVM's JIT needs a few seconds).
    #[arg(long, default_value = "5s", value_parser = crate::bench_cmd::parse_duration)]
    warmup: Duration,
    /// Also hold this many idle connections (each checked with ping/pong before
    /// and after the window), e.g. 10000.
    #[arg(long, default_value_t = 0)]
    idle: usize,
    /// Payload bytes in each request body.
    #[arg(long, default_value_t = 16)]
    body_bytes: usize,
    /// Threads each server runs connections on: Railyard's tokio workers,
    /// Vert.x's event loops (default: the number of cores).
    #[arg(long)]
    server_threads: Option<usize>,
    /// Threads of the load client's own runtime (the same client drives both servers).
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// Also run Vert.x 4.5.14's TCP bridge (peers/vertx-bridge) in the same run.
    #[arg(long, value_enum)]
    vs: Option<Peer>,
    /// Runs per system; the table shows the median.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Write every run as a JSON array to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Where the peers live (default: ./peers).
    #[arg(long)]
    peers_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Peer {
    /// Vert.x 4.5.14 with vertx-tcp-eventbus-bridge (peers/vertx-bridge).
    Vertx,
}

pub(crate) async fn run(a: BridgeArgs) -> anyhow::Result<()> {
    if a.runs == 0 || a.clients == 0 {
        bail!("--runs and --clients must be at least 1");
    }
    // Every connection is a file descriptor: 10k idle + the load clients.
    let limit = rlimit::increase_nofile_limit(u64::MAX).unwrap_or(0);
    if (limit as usize) < a.idle + a.clients + 64 {
        bail!(
            "the open-files limit is {limit}, too low for {} connections; raise the hard limit (ulimit -Hn)",
            a.idle + a.clients
        );
    }
    let exe = std::env::current_exe().context("finding the railyard executable")?;
    let peer = a.vs.map(|_| {
        let dir = a.peers_dir.clone().unwrap_or_else(default_peers_dir);
        JavaPeer::new(&dir, "vertx-bridge", "vertx-bridge-peer.jar")
    });
    if let Some(p) = &peer {
        p.ensure_built().await?;
    }
    let cfg = BridgeBenchConfig {
        clients: a.clients,
        in_flight: a.in_flight,
        duration: a.duration,
        warmup: a.warmup,
        idle: a.idle,
        body_bytes: a.body_bytes,
        server_threads: a
            .server_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
            .max(1),
        client_threads: a.client_threads.max(1),
    };
    let mut ours: Vec<BridgeResult> = Vec::new();
    let mut theirs: Vec<BridgeResult> = Vec::new();
    for run in 1..=a.runs {
        let systems: &[&str] = if peer.is_some() {
            &["railyard", "vertx"]
        } else {
            &["railyard"]
        };
        for &system in systems {
            eprintln!("== bridge run {run}/{}: {system} ==", a.runs);
            let server = match (system, &peer) {
                ("vertx", Some(p)) => ServerUnderTest::vertx(p, cfg.server_threads).await?,
                _ => ServerUnderTest::railyard(&exe, cfg.server_threads).await?,
            };
            let pb = crate::bench_cmd::progress_bar(
                format!("{system} run {run}"),
                cfg.warmup + cfg.duration,
            );
            let ticker = {
                let pb = pb.clone();
                tokio::spawn(async move {
                    let start = tokio::time::Instant::now();
                    loop {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        pb.set_position(start.elapsed().as_millis() as u64);
                    }
                })
            };
            let result = bridge::run(&server, &cfg, |what| pb.set_message(what.to_owned())).await;
            ticker.abort();
            pb.finish_and_clear();
            drop(server);
            let r = result?;
            eprintln!(
                "{system}: {} round trips/s, {} errors, server {:.1} µs CPU per round trip (load client {:.1}){}",
                thousands(r.round_trips_per_s as u64),
                r.errors,
                r.server_cpu_us_per_rt,
                r.client_cpu_us_per_rt,
                if r.idle_clients > 0 {
                    format!(
                        ", idle {}/{} held, server RSS {:.0} MiB",
                        r.idle_held, r.idle_clients, r.server_rss_mib
                    )
                } else {
                    String::new()
                }
            );
            if system == "vertx" {
                theirs.push(r);
            } else {
                ours.push(r);
            }
        }
    }
    let row = |name: &str, rs: &[BridgeResult], base: Option<f64>| {
        let rate =
            median(&rs.iter().map(|r| r.round_trips_per_s).collect::<Vec<_>>()).unwrap_or(0.0);
        let errors: u64 = rs.iter().map(|r| r.errors).sum();
        let held = rs.iter().map(|r| r.idle_held).min().unwrap_or(0);
        let rss = median(&rs.iter().map(|r| r.server_rss_mib).collect::<Vec<_>>()).unwrap_or(0.0);
        let cpu = median(
            &rs.iter()
                .map(|r| r.server_cpu_us_per_rt)
                .collect::<Vec<_>>(),
        )
        .unwrap_or(0.0);
        (
            rate,
            vec![
                name.to_owned(),
                a.clients.to_string(),
                thousands(rate as u64),
                format!("{cpu:.1}"),
                errors.to_string(),
                if a.idle > 0 {
                    format!("{held}/{}", a.idle)
                } else {
                    "-".into()
                },
                if a.idle > 0 {
                    format!("{rss:.0}")
                } else {
                    "-".into()
                },
                base.map_or("-".into(), |b| {
                    format!("{:.2}x", b / rate.max(f64::MIN_POSITIVE))
                }),
            ],
        )
    };
    let (our_rate, our_row) = row("railyard", &ours, None);
    let mut rows = vec![our_row];
    if !theirs.is_empty() {
        let (their_rate, their_row) = row("vertx", &theirs, Some(our_rate));
        rows.push(their_row);
        println!(
            "\nrailyard makes {:.2}x the round trips/s of vertx (medians of {} run(s))",
            our_rate / their_rate.max(f64::MIN_POSITIVE),
            a.runs
        );
    }
    println!(
        "\nbridge request/reply, {} clients x {} in flight, median of {} run(s)\n{}",
        a.clients,
        a.in_flight,
        a.runs,
        table(
            &[
                "system",
                "clients",
                "round trips/s",
                "server CPU µs/rt",
                "errors",
                "idle held",
                "server RSS MiB",
                "railyard / it"
            ],
            rows
        )
    );
    if let Some(path) = &a.json {
        let json: Vec<serde_json::Value> = ours
            .iter()
            .chain(&theirs)
            .map(serde_json::to_value)
            .collect::<Result<_, _>>()?;
        write_json(path, &json).with_context(|| format!("writing {}", path.display()))?;
        crate::bench_plot::announce_json(path, json.len());
    }
    Ok(())
}
