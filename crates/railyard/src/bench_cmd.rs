//! `railyard bench ...`: parse options, run scenarios, print tables, write JSON.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use railyard_bench::cluster::{self, ClusterTarget, ServeConfig};
use railyard_bench::echo::{self, ConsumerKind, Delivery, EchoConfig, EchoResult, Method};
use railyard_bench::loops::RuntimeKind;
use railyard_bench::peer::{default_peers_dir, JavaPeer};
use railyard_bench::pingpong::{self, PingpongConfig, PingpongResult};
use railyard_bench::probe;
use railyard_bench::report::{median, table, thousands, write_json};
use railyard_cluster::EtcdServer;

#[derive(Debug, clap::Subcommand)]
pub(crate) enum BenchCommand {
    /// Seed 000: N request/reply messages between a producer and a consumer.
    Pingpong(PingpongArgs),
    /// Seed 001: echo round trips in a fixed window (optionally the whole matrix).
    Echo(EchoArgs),
    /// Request/reply round trips through the TCP event-bus bridge (node vs Vert.x's bridge).
    Bridge(crate::bench_bridge::BridgeArgs),
    /// Seed 004: the HTTP server under 10k connections (wrk, oha, RSS per connection).
    C10k(crate::bench_c10k::C10kArgs),
    /// Seed 002: a Redis-backed GET /test under vegeta, topology refresh on and off.
    RedisRefresh(crate::bench_redis::RedisRefreshArgs),
    /// Seed 003: the alpha-benchmark saga profile against the saga coordinator (omega or native).
    Saga(crate::bench_saga::SagaArgs),
    /// SVG charts of result files written with --json (bars per configuration and system, latency percentiles).
    Plot(crate::bench_plot::PlotArgs),
    /// The second node of a `--nodes 2` run (started by the bench itself).
    #[command(hide = true)]
    Serve(ServeArgs),
}

/// Options of the hidden `bench serve` (the second node).
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// etcd endpoint.
    #[arg(long)]
    etcd: String,
    /// Consumer address.
    #[arg(long)]
    address: String,
    /// Consumers, one per event loop.
    #[arg(long, default_value_t = 1)]
    instances: usize,
    /// Consumer kind.
    #[arg(long, value_enum, default_value_t = ConsumerArg::Consumer)]
    consumer: ConsumerArg,
    /// Reply, or send to the `replyTo` header.
    #[arg(long, value_enum, default_value_t = MethodArg::SendReply)]
    method: MethodArg,
    /// Event loops.
    #[arg(long, default_value_t = 1)]
    loops: usize,
}

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct CommonArgs {
    /// Also run the original system from peers/ in the same run.
    #[arg(long, value_enum)]
    vs: Option<Peer>,
    /// Cluster manager: `none` (a plain bus) or `etcd` (the bus joined to an
    /// etcd cluster; the bench starts its own etcd unless --etcd is given).
    #[arg(long, value_enum, default_value_t = ClusterArg::None)]
    cluster: ClusterArg,
    /// etcd endpoint to use instead of starting one (with --cluster etcd).
    #[arg(long, value_name = "URL")]
    etcd: Option<String>,
    /// Processes: 1, or 2 to run the consumers in a second `railyard`
    /// process so messages cross a real socket (needs --cluster etcd).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    nodes: u8,
    /// Runs per system; tables show the median.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Write every run as a JSON array to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Where the peers live (default: ./peers).
    #[arg(long)]
    peers_dir: Option<PathBuf>,
    /// Railyard's scheduling: `loops` (one single-threaded runtime per core, like
    /// Vert.x event loops; echo's default) or `multi` (one work-stealing tokio
    /// runtime; pingpong's default, where it measured faster).
    #[arg(long, value_enum)]
    runtime: Option<RuntimeArg>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ClusterArg {
    /// No cluster.
    None,
    /// etcd.
    Etcd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RuntimeArg {
    Multi,
    Loops,
}

impl RuntimeArg {
    fn kind(self) -> RuntimeKind {
        match self {
            RuntimeArg::Multi => RuntimeKind::Multi,
            RuntimeArg::Loops => RuntimeKind::Loops,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Peer {
    /// Vert.x 4.5 without a cluster (peers/vertx-eventbus).
    Vertx,
    /// Vert.x 4.5 clustered on Hazelcast (needs --cluster etcd on our side).
    VertxHazelcast,
    /// Vert.x 4.5 clustered on Infinispan (needs --cluster etcd on our side).
    VertxInfinispan,
    /// Vert.x 4.5 clustered on Zookeeper (needs --cluster etcd on our side).
    VertxZookeeper,
}

impl Peer {
    /// The peer's `--cluster` value.
    fn cluster(self) -> &'static str {
        match self {
            Peer::Vertx => "none",
            Peer::VertxHazelcast => "hazelcast",
            Peer::VertxInfinispan => "infinispan",
            Peer::VertxZookeeper => "zookeeper",
        }
    }

    /// Its name in tables and JSON rows.
    fn label(self) -> &'static str {
        match self {
            Peer::Vertx => "vertx",
            Peer::VertxHazelcast => "vertx-hazelcast",
            Peer::VertxInfinispan => "vertx-infinispan",
            Peer::VertxZookeeper => "vertx-zookeeper",
        }
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct PingpongArgs {
    /// Messages to send.
    #[arg(long, default_value_t = 500_000)]
    messages: u64,
    /// Hide the seed's progress lines.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Debug, clap::Args)]
pub(crate) struct EchoArgs {
    /// Measured window (e.g. 10s, 500ms).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration: Duration,
    /// Warm-up before the window, not counted, for every system [default:
    /// 2s; 5s with a clustered --vs peer and 10s with --nodes 2, which the
    /// JVMs need to reach their plateau (peers/vertx-eventbus/README.md)].
    #[arg(long, value_parser = parse_duration)]
    warmup: Option<Duration>,
    /// Tester instances.
    #[arg(long, default_value_t = 2)]
    instances: usize,
    /// Total concurrent chains, spread over the instances.
    #[arg(long, default_value_t = 64)]
    in_flight: usize,
    /// How the echoer registers.
    #[arg(long, value_enum, default_value_t = ConsumerArg::Consumer)]
    consumer: ConsumerArg,
    /// Delivery options.
    #[arg(long, value_enum, default_value_t = DeliveryArg::Default)]
    delivery: DeliveryArg,
    /// Round-trip method.
    #[arg(long, value_enum, default_value_t = MethodArg::SendReply)]
    method: MethodArg,
    /// Run every consumer x delivery x method combination and print seed 001's table.
    #[arg(long)]
    matrix: bool,
    /// Threads for Railyard per process (default: the number of cores, divided
    /// by the processes with --nodes 2, so two processes share the cores
    /// instead of oversubscribing them).
    #[arg(long)]
    loops: Option<usize>,
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ConsumerArg {
    Consumer,
    Local,
}
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum DeliveryArg {
    Default,
    LocalOnly,
}
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum MethodArg {
    SendReply,
    SendSend,
}

/// The longest duration an option takes: a year (deadlines computed as
/// `Instant + d` must not overflow), the HTTP config's own bound.
const MAX_DURATION_SECS: f64 = railyard_http::MAX_DURATION.as_secs_f64();

/// Parses `10s`, `500ms`, `2m`, `1.5s` or a bare number of seconds, up to a
/// year.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a duration; use e.g. 10s, 500ms, 2m"))?;
    let secs = match unit {
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("unknown unit `{unit}` in `{s}`; use ms, s or m")),
    };
    if !(secs.is_finite() && secs >= 0.0) {
        return Err(format!("`{s}` must be a non-negative duration"));
    }
    if secs > MAX_DURATION_SECS {
        return Err(format!("`{s}` is too long: at most a year (31536000s)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

pub(crate) async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Pingpong(a) => run_pingpong(a).await,
        BenchCommand::Echo(a) => run_echo(a).await,
        BenchCommand::Bridge(a) => crate::bench_bridge::run(a).await,
        BenchCommand::C10k(a) => crate::bench_c10k::run(a).await,
        BenchCommand::Serve(a) => run_serve(a).await,
        BenchCommand::RedisRefresh(a) => crate::bench_redis::run(a).await,
        BenchCommand::Saga(a) => crate::bench_saga::run(a).await,
        BenchCommand::Plot(a) => crate::bench_plot::run(&a),
    }
}

async fn run_serve(a: ServeArgs) -> anyhow::Result<()> {
    let cfg = ServeConfig {
        address: a.address,
        instances: a.instances,
        consumer: consumer_kind(a.consumer),
        method: method(a.method),
        loops: a.loops,
    };
    cluster::serve(&a.etcd, &cfg).await?;
    Ok(())
}

fn consumer_kind(c: ConsumerArg) -> ConsumerKind {
    match c {
        ConsumerArg::Consumer => ConsumerKind::Consumer,
        ConsumerArg::Local => ConsumerKind::Local,
    }
}

fn method(m: MethodArg) -> Method {
    match m {
        MethodArg::SendReply => Method::SendReply,
        MethodArg::SendSend => Method::SendSend,
    }
}

fn check_common(c: &CommonArgs) -> anyhow::Result<()> {
    if c.nodes == 2 && c.cluster == ClusterArg::None {
        bail!("--nodes 2 needs a cluster: add --cluster etcd");
    }
    match c.vs {
        Some(Peer::Vertx) if c.nodes == 2 => {
            bail!("--vs vertx has no cluster, so no second node: use --vs vertx-hazelcast (or -infinispan, -zookeeper)")
        }
        Some(p) if p != Peer::Vertx && c.cluster == ClusterArg::None => {
            bail!(
                "--vs {} compares clustered runs: add --cluster etcd",
                p.label()
            )
        }
        _ => {}
    }
    if c.runs == 0 {
        bail!("--runs must be at least 1");
    }
    Ok(())
}

/// The cluster a scenario runs in, and the etcd the bench started for it
/// (kept alive for the whole bench, stopped when dropped).
async fn cluster_target(
    c: &CommonArgs,
) -> anyhow::Result<(Option<ClusterTarget>, Option<EtcdServer>)> {
    if c.cluster == ClusterArg::None {
        return Ok((None, None));
    }
    let (etcd, server) = match &c.etcd {
        Some(url) => (url.clone(), None),
        None => {
            eprintln!("starting a private etcd on loopback");
            let s = tokio::task::spawn_blocking(EtcdServer::start).await??;
            (s.endpoint(), Some(s))
        }
    };
    let exe = std::env::current_exe().context("locating the railyard executable")?;
    Ok((
        Some(ClusterTarget {
            etcd,
            nodes: usize::from(c.nodes),
            exe,
        }),
        server,
    ))
}

fn vertx_peer(c: &CommonArgs) -> JavaPeer {
    let dir = c.peers_dir.clone().unwrap_or_else(default_peers_dir);
    JavaPeer::new(&dir, "vertx-eventbus", "vertx-eventbus-peer.jar")
}

fn finish(rows: &[serde_json::Value], c: &CommonArgs) -> anyhow::Result<()> {
    if let Some(path) = &c.json {
        write_json(path, rows).with_context(|| format!("writing {}", path.display()))?;
        crate::bench_plot::announce_json(path, rows.len());
    }
    Ok(())
}

async fn run_pingpong(a: PingpongArgs) -> anyhow::Result<()> {
    check_common(&a.common)?;
    let (cluster, _etcd) = cluster_target(&a.common).await?;
    let cfg = PingpongConfig {
        messages: a.messages,
        verbose: !a.quiet,
        runtime: a.common.runtime.unwrap_or(RuntimeArg::Multi).kind(),
        cluster,
    };
    let peer = a.common.vs.map(|_| vertx_peer(&a.common));
    if let Some(p) = &peer {
        p.ensure_built().await?;
    }
    let mut ours: Vec<PingpongResult> = Vec::new();
    let mut theirs: Vec<PingpongResult> = Vec::new();
    for run in 1..=a.common.runs {
        eprintln!("== pingpong run {run}/{}: railyard ==", a.common.runs);
        ours.push(pingpong::run(&cfg).await?);
        if let Some(p) = &peer {
            eprintln!(
                "== pingpong run {run}/{}: {} ==",
                a.common.runs,
                a.common.vs.map_or("vertx", Peer::label)
            );
            let vs = a.common.vs.expect("a peer is set");
            let args = vec![
                "pingpong".to_owned(),
                "--messages".to_owned(),
                a.messages.to_string(),
                "--cluster".to_owned(),
                vs.cluster().to_owned(),
                "--nodes".to_owned(),
                a.common.nodes.to_string(),
            ];
            let v = p.run(&args, !a.quiet).await?;
            let mut r: PingpongResult =
                serde_json::from_value(v).context("reading the peer's pingpong result")?;
            r.system = vs.label().to_owned();
            theirs.push(r);
        }
    }
    let med = |rs: &[PingpongResult], f: fn(&PingpongResult) -> f64| {
        median(&rs.iter().map(f).collect::<Vec<_>>())
    };
    let mut rows = vec![];
    let our_all = med(&ours, |r| r.all_replies_ms).unwrap_or(0.0);
    rows.push(vec![
        "railyard".to_owned(),
        thousands(a.messages),
        format!("{:.1}", med(&ours, |r| r.first_reply_ms).unwrap_or(0.0)),
        format!("{our_all:.1}"),
        "-".to_owned(),
    ]);
    if !theirs.is_empty() {
        let their_all = med(&theirs, |r| r.all_replies_ms).unwrap_or(0.0);
        rows.push(vec![
            a.common.vs.map_or("vertx", Peer::label).to_owned(),
            thousands(a.messages),
            format!("{:.1}", med(&theirs, |r| r.first_reply_ms).unwrap_or(0.0)),
            format!("{their_all:.1}"),
            format!("{:.2}x", their_all / our_all),
        ]);
        println!(
            "\nrailyard is {:.1}x faster than {} (median all_replies_ms)",
            their_all / our_all,
            a.common.vs.map_or("vertx", Peer::label)
        );
    }
    println!(
        "\npingpong, median of {} run(s)\n{}",
        a.common.runs,
        table(
            &[
                "system",
                "messages",
                "first reply ms",
                "all replies ms",
                "its time / railyard time"
            ],
            rows
        )
    );
    let json: Vec<serde_json::Value> = ours
        .iter()
        .chain(&theirs)
        .map(serde_json::to_value)
        .collect::<Result<_, _>>()?;
    finish(&json, &a.common)
}

/// The echo warm-up: `--warmup`, or long enough for the JVM peer of the
/// run's shape (the same for every system of the run).
fn echo_warmup(a: &EchoArgs) -> Duration {
    a.warmup.unwrap_or(match (a.common.nodes, a.common.vs) {
        (2, _) => Duration::from_secs(10),
        (_, Some(p)) if p != Peer::Vertx => Duration::from_secs(5),
        _ => Duration::from_secs(2),
    })
}

fn echo_configs(a: &EchoArgs, cluster: Option<ClusterTarget>) -> Vec<EchoConfig> {
    let base = EchoConfig {
        duration: a.duration,
        warmup: echo_warmup(a),
        instances: a.instances,
        in_flight: a.in_flight,
        consumer: consumer_kind(a.consumer),
        delivery: match a.delivery {
            DeliveryArg::Default => Delivery::Default,
            DeliveryArg::LocalOnly => Delivery::LocalOnly,
        },
        method: method(a.method),
        loops: a.loops.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            let processes = cluster.as_ref().map_or(1, |t| t.nodes.max(1));
            (cores / processes).max(1)
        }),
        runtime: a.common.runtime.unwrap_or(RuntimeArg::Loops).kind(),
        cluster,
    };
    if !a.matrix {
        return vec![base];
    }
    let mut out = vec![];
    for consumer in [ConsumerKind::Consumer, ConsumerKind::Local] {
        for delivery in [Delivery::Default, Delivery::LocalOnly] {
            for method in [Method::SendReply, Method::SendSend] {
                out.push(EchoConfig {
                    consumer,
                    delivery,
                    method,
                    ..base.clone()
                });
            }
        }
    }
    out
}

fn peer_echo_args(c: &EchoConfig, peer: Peer, nodes: u8) -> Vec<String> {
    let nodes = nodes.to_string();
    [
        "echo",
        "--duration",
        &c.duration.as_secs_f64().to_string(),
        "--warmup",
        &c.warmup.as_secs_f64().to_string(),
        "--instances",
        &c.instances.to_string(),
        "--in-flight",
        &c.in_flight.to_string(),
        "--consumer",
        c.consumer.as_str(),
        "--delivery",
        c.delivery.as_str(),
        "--method",
        c.method.as_str(),
        "--cluster",
        peer.cluster(),
        "--nodes",
        &nodes,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

pub(crate) fn progress_bar(label: String, total: Duration) -> ProgressBar {
    let pb = ProgressBar::new(total.as_millis() as u64);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>40} [{bar:30}] {elapsed:>3} {msg}")
            .expect("the template is valid")
            .progress_chars("=> "),
    );
    pb.set_prefix(label);
    pb
}

/// A spinner that shows how long its work has taken so far, for work of
/// unknown length (a build, a cluster converging).
pub(crate) fn spinner(msg: String) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{elapsed}]").expect("the template is valid"),
    );
    pb.set_message(msg);
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

/// A [`progress_bar`] for work that reports no progress of its own (a peer
/// process, a load tool): it moves with the clock toward `total`, the
/// work's expected length, and stops when finished.
pub(crate) fn clock_bar(label: String, total: Duration) -> ProgressBar {
    let pb = progress_bar(label, total);
    let ticking = pb.clone();
    let t0 = std::time::Instant::now();
    tokio::spawn(async move {
        while !ticking.is_finished() {
            ticking.set_position((t0.elapsed().min(total)).as_millis() as u64);
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    pb
}

async fn run_echo(a: EchoArgs) -> anyhow::Result<()> {
    check_common(&a.common)?;
    if a.instances == 0 || a.in_flight == 0 {
        bail!("--instances and --in-flight must be at least 1");
    }
    let peer = a.common.vs.map(|_| vertx_peer(&a.common));
    if let Some(p) = &peer {
        p.ensure_built().await?;
    }
    let (cluster, _etcd) = cluster_target(&a.common).await?;
    let configs = echo_configs(&a, cluster);
    let mut all: Vec<EchoResult> = vec![];
    let mut rows = vec![];
    for cfg in &configs {
        let label = format!(
            "{} | {} | {}",
            cfg.consumer.as_str(),
            cfg.delivery.as_str(),
            cfg.method.as_str()
        );
        let mut ours = vec![];
        let mut theirs = vec![];
        for run in 1..=a.common.runs {
            let pb = progress_bar(
                format!("railyard {label} #{run}"),
                cfg.warmup + cfg.duration,
            );
            let before = probe::line_round_trip_ns_async().await;
            let mut r = echo::run(cfg, |t, n| {
                pb.set_position(t.as_millis() as u64);
                pb.set_message(format!("{} round trips", thousands(n)));
            })
            .await?;
            r.line_ns = Some([before, probe::line_round_trip_ns_async().await]);
            pb.finish_with_message(format!(
                "{} round trips/s",
                thousands(r.round_trips_per_s as u64)
            ));
            ours.push(r);
            if let Some(p) = &peer {
                let name = a.common.vs.map_or("vertx", Peer::label);
                // The peer reports nothing until it is done: the bar moves
                // with the clock over its warm-up and window.
                let pb = clock_bar(format!("{name} {label} #{run}"), cfg.warmup + cfg.duration);
                let vs = a.common.vs.expect("a peer is set");
                let before = probe::line_round_trip_ns_async().await;
                let v = p
                    .run(&peer_echo_args(cfg, vs, a.common.nodes), false)
                    .await?;
                let mut r: EchoResult =
                    serde_json::from_value(v).context("reading the peer's echo result")?;
                r.system = name.to_owned();
                r.line_ns = Some([before, probe::line_round_trip_ns_async().await]);
                pb.finish_with_message(format!(
                    "{name} {label} #{run}: {} round trips/s",
                    thousands(r.round_trips_per_s as u64)
                ));
                theirs.push(r);
            }
        }
        let rate =
            |rs: &[EchoResult]| median(&rs.iter().map(|r| r.round_trips_per_s).collect::<Vec<_>>());
        let trips = |rs: &[EchoResult]| {
            median(&rs.iter().map(|r| r.round_trips as f64).collect::<Vec<_>>())
        };
        let our_rate = rate(&ours).unwrap_or(0.0);
        let mut row = vec![
            match &cfg.cluster {
                None => "No cluster".to_owned(),
                Some(t) if t.nodes >= 2 => format!("{}, 2 nodes", t.name()),
                Some(t) => t.name().to_owned(),
            },
            if cfg.consumer == ConsumerKind::Local {
                "localConsumer"
            } else {
                "consumer"
            }
            .to_owned(),
            if cfg.delivery == Delivery::LocalOnly {
                "localOnly"
            } else {
                "default"
            }
            .to_owned(),
            cfg.method.as_str().to_owned(),
            thousands(trips(&ours).unwrap_or(0.0) as u64),
            thousands(our_rate as u64),
        ];
        if !theirs.is_empty() {
            let their_rate = rate(&theirs).unwrap_or(0.0);
            row.push(thousands(their_rate as u64));
            row.push(format!("{:.2}x", our_rate / their_rate));
        }
        rows.push(row);
        all.extend(ours);
        all.extend(theirs);
    }
    let name = a.common.vs.map_or("vertx", Peer::label);
    let peer_cols = [
        format!("{name} round trips/s"),
        format!("railyard / {name}"),
    ];
    let mut header = vec![
        "ClusterManager",
        "useLocalConsumer?",
        "DeliveryOptions",
        "DeliveryMethod",
        "# of round trips",
        "railyard round trips/s",
    ];
    if peer.is_some() {
        header.extend(peer_cols.iter().map(String::as_str));
    }
    println!(
        "\necho: {} instances, {} in flight, {:?} window after {:?} warm-up, median of {} run(s)\n{}",
        a.instances,
        a.in_flight,
        a.duration,
        echo_warmup(&a),
        a.common.runs,
        table(&header, rows)
    );
    for line in failure_lines(&all) {
        println!("{line}");
    }
    println!("{}", mode_line(&all));
    let json: Vec<serde_json::Value> = all
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<_, _>>()?;
    finish(&json, &a.common)
}

/// One warning per system and configuration whose runs had failed round
/// trips inside the window (they are not counted as round trips, so a rate
/// never includes them; this says they happened).
fn failure_lines(results: &[EchoResult]) -> Vec<String> {
    let failed = results.iter().filter(|r| r.failures > 0);
    tally(failed, |r| {
        (
            format!("{} {} | {} | {}", r.system, r.consumer, r.delivery, r.method),
            r.failures,
        )
    })
    .into_iter()
    .map(|(label, n, runs)| {
        format!(
            "warning: {label}: {} round trips failed inside the window in {runs} run(s) (not counted; see the log and the JSON's `failures`)",
            thousands(n)
        )
    })
    .collect()
}

/// How many runs of each system had the machine's slow mode (a line round
/// trip between two threads above [`probe::SLOW_LINE_NS`] before or after
/// the run), so a reader can tell a ratio of modes from a ratio of systems.
fn mode_line(results: &[EchoResult]) -> String {
    let counts: Vec<String> = tally(results.iter(), |r| {
        let slow = r
            .line_ns
            .is_some_and(|[a, b]| a.max(b) > probe::SLOW_LINE_NS);
        (r.system.clone(), u64::from(slow))
    })
    .into_iter()
    .map(|(system, n, runs)| format!("{system} {n} of {runs}"))
    .collect();
    format!(
        "runs in the machine's slow mode (a cache line's round trip between two threads above {} ns before or after the run; JSON `line_ns`): {}",
        probe::SLOW_LINE_NS,
        counts.join(", ")
    )
}

/// Groups runs by the label `key` gives each, in first-seen order: the
/// label, the sum of the counts it gives, and how many runs had the label.
fn tally<'a>(
    runs: impl Iterator<Item = &'a EchoResult>,
    key: impl Fn(&EchoResult) -> (String, u64),
) -> Vec<(String, u64, usize)> {
    let mut out: Vec<(String, u64, usize)> = vec![];
    for r in runs {
        let (label, n) = key(r);
        match out.iter_mut().find(|(l, _, _)| *l == label) {
            Some((_, sum, count)) => {
                *sum += n;
                *count += 1;
            }
            None => out.push((label, n, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One echo result row for the report tests.
    fn row(system: &str, method: &str, failures: u64, line_ns: Option<[f64; 2]>) -> EchoResult {
        EchoResult {
            scenario: "echo".into(),
            system: system.into(),
            cluster: "none".into(),
            consumer: "consumer".into(),
            delivery: "default".into(),
            method: method.into(),
            instances: 2,
            in_flight: 64,
            duration_s: 1.0,
            warmup_s: 1.0,
            round_trips: 10,
            round_trips_per_s: 10.0,
            failures,
            nodes: 1,
            runtime: None,
            threads: None,
            line_ns,
        }
    }

    #[test]
    fn failed_round_trips_are_reported_per_system_and_configuration() {
        let run = |system: &str, method: &str, failures: u64| row(system, method, failures, None);
        let lines = failure_lines(&[
            run("railyard", "send-send", 0),
            run("railyard", "send-reply", 2),
            run("vertx", "send-reply", 0),
            run("railyard", "send-reply", 1_500),
            run("vertx", "send-send", 3),
        ]);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("warning: railyard consumer | default | send-reply: 1,502 round trips failed inside the window in 2 run(s)"), "{}", lines[0]);
        assert!(lines[1].starts_with("warning: vertx consumer | default | send-send: 3 round trips failed inside the window in 1 run(s)"), "{}", lines[1]);
        assert!(failure_lines(&[run("railyard", "send-send", 0)]).is_empty());
    }

    #[test]
    fn runs_in_the_slow_mode_are_counted_per_system() {
        let run = |system: &str, line: [f64; 2]| row(system, "send-send", 0, Some(line));
        let line = mode_line(&[
            run("railyard", [60.0, 58.0]),
            run("vertx", [61.0, 320.0]),
            run("railyard", [330.0, 59.0]),
            run("vertx", [55.0, 57.0]),
            row("railyard", "send-send", 0, None),
        ]);
        assert!(line.ends_with("railyard 1 of 3, vertx 1 of 2"), "{line}");
    }

    #[test]
    fn echo_warm_up_suits_the_peer_unless_given() {
        #[derive(clap::Parser)]
        struct T {
            #[command(flatten)]
            e: EchoArgs,
        }
        let warmup = |args: &[&str]| {
            let t = <T as clap::Parser>::try_parse_from(
                std::iter::once("t").chain(args.iter().copied()),
            )
            .unwrap();
            echo_warmup(&t.e)
        };
        assert_eq!(warmup(&[]), Duration::from_secs(2));
        assert_eq!(warmup(&["--vs", "vertx"]), Duration::from_secs(2));
        let clustered = ["--vs", "vertx-hazelcast", "--cluster", "etcd"];
        assert_eq!(warmup(&clustered), Duration::from_secs(5));
        let two = [
            "--vs",
            "vertx-hazelcast",
            "--cluster",
            "etcd",
            "--nodes",
            "2",
        ];
        assert_eq!(warmup(&two), Duration::from_secs(10));
        assert_eq!(
            warmup(&["--nodes", "2", "--cluster", "etcd"]),
            Duration::from_secs(10)
        );
        assert_eq!(
            warmup(&["--vs", "vertx-hazelcast", "--warmup", "1s"]),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5h").is_err());
        // Too long for a deadline (used to panic in the parser, or overflow
        // `Instant + d` later).
        assert!(parse_duration("100000000000000000000s").is_err());
        assert!(parse_duration("10000000000000000000").is_err());
        assert_eq!(
            parse_duration("31536000"),
            Ok(Duration::from_secs(31_536_000))
        );
    }
}
