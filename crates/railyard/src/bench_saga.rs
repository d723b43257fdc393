//! `railyard bench saga`: seed 003's alpha-benchmark profile against the saga
//! coordinator, over Omega's unary gRPC or the native batched stream.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use railyard_bench::dtm::{run_dtm, DtmOptions, DtmStore};
use railyard_bench::peer::default_peers_dir;
use railyard_bench::report::{median, table, thousands, write_json};
use railyard_bench::saga::{self, Progress, Protocol, SagaBenchConfig, SagaResult};
use railyard_bench::saga_server::{CoordinatorUnderTest, StoreKind};

/// Options for `railyard bench saga`.
#[derive(Debug, clap::Args)]
pub(crate) struct SagaArgs {
    /// Global transactions, 8 events each.
    #[arg(long, default_value_t = 50_000)]
    transactions: u64,
    /// Workers, each running its share of the transactions one after another.
    #[arg(long, default_value_t = 500)]
    concurrency: usize,
    /// `omega`: one blocking unary OnTxEvent call per event (ServiceComb
    /// Pack's protocol); `native`: Railyard's SDK over the batched stream.
    #[arg(long, value_enum, default_value_t = ProtocolArg::Omega)]
    protocol: ProtocolArg,
    /// The coordinator's durable store.
    #[arg(long, value_enum, default_value_t = StoreArg::Embedded)]
    store: StoreArg,
    /// Share of transactions that fail on their third step and must be
    /// compensated end to end (0 to 1).
    #[arg(long, default_value_t = 0.0, value_parser = parse_ratio)]
    abort_ratio: f64,
    /// Simulated participant processes: HTTP/2 connections (omega) or
    /// connections of the native SDK (see --sessions); workers are spread over them.
    #[arg(long, default_value_t = 4)]
    channels: usize,
    /// Threads of the load generator's own runtime (apart from the coordinator's); 1 is a
    /// current-thread runtime, more a multi-thread one.
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// Worker threads of the in-process coordinator's runtime (default: the
    /// number of cores).
    #[arg(long)]
    server_threads: Option<usize>,
    /// Native only: batches each session may have unacknowledged (default:
    /// no limit; 1 or 2 make fewer, larger batches).
    #[arg(long)]
    batches_in_flight: Option<usize>,
    /// Native only: one session per simulated process for its four
    /// participant instances (`process`), or one per instance
    /// (`participant`); a process's sessions share its one connection
    /// either way.
    #[arg(long, value_enum, default_value_t = SessionsArg::Process)]
    sessions: SessionsArg,
    /// After the load, how long to wait for outstanding compensations.
    #[arg(long, default_value = "30s", value_parser = crate::bench_cmd::parse_duration)]
    drain: Duration,
    /// Drive an already running coordinator (e.g. `http://127.0.0.1:8090`)
    /// instead of starting one in-process.
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// Also run DTM (peers/dtm, built on first use; needs Go) with its
    /// equivalent saga on a durable store (see --dtm-store), in the same run.
    #[arg(long, value_enum)]
    vs: Option<Peer>,
    /// DTM's store with --vs dtm: `postgres` (default: DTM's fastest durable
    /// store here, whose writes share commits, the class of its published
    /// figures) or `boltdb` (its embedded store: one fsynced write at a time,
    /// which does not sustain 500 sagas in flight).
    #[arg(long, value_enum, default_value_t = DtmStoreArg::Postgres)]
    dtm_store: DtmStoreArg,
    /// Transactions for the peer (default: --transactions); DTM is slow
    /// enough that a smaller count measures its rate as well.
    #[arg(long)]
    peer_transactions: Option<u64>,
    /// Where the peers live (default: ./peers).
    #[arg(long)]
    peers_dir: Option<PathBuf>,
    /// Runs per system; the table shows the median.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Write every run as a JSON array to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ProtocolArg {
    /// ServiceComb Pack's TxEventService, as Omega calls it.
    Omega,
    /// Railyard's batched session stream (railyard-saga-client).
    Native,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SessionsArg {
    /// One session per process, carrying all its participant instances.
    Process,
    /// One session per participant instance.
    Participant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DtmStoreArg {
    /// A PostgreSQL of its own, with the settings of Railyard's.
    Postgres,
    /// bbolt in its working directory.
    Boltdb,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum StoreArg {
    /// The embedded store in a throwaway data directory.
    Embedded,
    /// A throwaway PostgreSQL started for the run.
    Postgres,
    /// The in-memory reference store: NOT durable, to isolate the protocol's cost.
    Memory,
}

impl StoreArg {
    fn kind(self) -> StoreKind {
        match self {
            StoreArg::Embedded => StoreKind::Embedded,
            StoreArg::Postgres => StoreKind::Postgres,
            StoreArg::Memory => StoreKind::Memory,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Peer {
    /// DTM with its durable store (peers/dtm).
    Dtm,
}

/// A coordinator the bench drives: one started in-process, or one already
/// running at `--endpoint`.
enum Target {
    InProcess(CoordinatorUnderTest),
    External(String),
}

impl Target {
    fn endpoint(&self) -> &str {
        match self {
            Target::InProcess(c) => c.endpoint(),
            Target::External(url) => url,
        }
    }

    async fn stop(self) {
        if let Target::InProcess(c) = self {
            c.stop().await;
        }
    }
}

async fn start_coordinator(a: &SagaArgs) -> anyhow::Result<Target> {
    if let Some(url) = &a.endpoint {
        return Ok(Target::External(url.clone()));
    }
    let threads = a
        .server_threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    Ok(Target::InProcess(
        CoordinatorUnderTest::start(a.store.kind(), threads).await?,
    ))
}

fn progress_bar(label: String, total: u64) -> ProgressBar {
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>24} [{bar:30}] {pos}/{len} tx {elapsed:>3} {msg}")
            .expect("the template is valid")
            .progress_chars("=> "),
    );
    pb.set_prefix(label);
    pb
}

pub(crate) async fn run(a: SagaArgs) -> anyhow::Result<()> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let dtm = match a.vs {
        None => None,
        Some(Peer::Dtm) => {
            if a.store == StoreArg::Memory {
                bail!("--vs dtm compares durable stores: use --store embedded or --store postgres");
            }
            if a.abort_ratio > 0.0 {
                bail!(
                    "--vs dtm compares committed sagas: with --abort-ratio above 0 the two sides \
                     would count aborted sagas differently (Railyard once the abort is \
                     acknowledged, DTM once compensation ends); run aborts without --vs"
                );
            }
            let store = match a.dtm_store {
                DtmStoreArg::Postgres => DtmStore::Postgres,
                DtmStoreArg::Boltdb => DtmStore::Boltdb,
            };
            if a.endpoint.is_some() {
                bail!("--vs dtm runs against the in-process coordinator: drop --endpoint");
            }
            let dir = a.peers_dir.clone().unwrap_or_else(default_peers_dir);
            let mut o = DtmOptions::new(&dir, store);
            o.transactions = a.peer_transactions.unwrap_or(a.transactions);
            o.concurrency = u32::try_from(a.concurrency).context("--concurrency is too large")?;
            o.abort_ratio = a.abort_ratio;
            Some(o)
        }
    };
    let protocol = match a.protocol {
        ProtocolArg::Omega => Protocol::Omega,
        ProtocolArg::Native => Protocol::Native,
    };
    let cfg = SagaBenchConfig {
        transactions: a.transactions,
        concurrency: a.concurrency,
        protocol,
        store: if a.endpoint.is_some() {
            "external".to_owned()
        } else {
            a.store.kind().as_str().to_owned()
        },
        abort_ratio: a.abort_ratio,
        channels: a.channels,
        client_threads: a.client_threads,
        drain_timeout: a.drain,
        batches_in_flight: a.batches_in_flight,
        sessions: match a.sessions {
            SessionsArg::Process => saga::Sessions::Process,
            SessionsArg::Participant => saga::Sessions::Participant,
        },
    };
    let mut ours: Vec<SagaResult> = Vec::new();
    let mut theirs: Vec<serde_json::Value> = Vec::new();
    for run in 1..=a.runs {
        eprintln!(
            "== saga run {run}/{}: railyard, {} protocol, {} store ==",
            a.runs,
            protocol.as_str(),
            cfg.store
        );
        let target = start_coordinator(&a).await?;
        let progress = Arc::new(Progress::default());
        let pb = progress_bar(format!("railyard run {run}"), a.transactions);
        let ticker = {
            let (pb, progress) = (pb.clone(), progress.clone());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    pb.set_position(progress.done.load(Ordering::Relaxed));
                    let c = progress.compensated.load(Ordering::Relaxed);
                    if c > 0 {
                        pb.set_message(format!("{} compensated", thousands(c)));
                    }
                }
            })
        };
        let result = saga::run(target.endpoint(), &cfg, progress).await;
        ticker.abort();
        pb.finish_and_clear();
        target.stop().await;
        let r = result?;
        eprintln!(
            "railyard: {} tx/s, {} events/s, p50 {:.1} ms, p99 {:.1} ms, {} compensated, {} lost, {} errors",
            thousands(r.tx_per_s as u64),
            thousands(r.events_per_s as u64),
            r.latency_ms.p50,
            r.latency_ms.p99,
            r.compensated,
            r.lost,
            r.errors
        );
        ours.push(r);
        if let Some(o) = &dtm {
            eprintln!(
                "== saga run {run}/{}: dtm, {} store, {} transactions ==",
                a.runs,
                o.store.as_str(),
                o.transactions
            );
            let pb = crate::bench_cmd::spinner(format!("dtm run {run} (the first run builds DTM)"));
            let v = run_dtm(o).await;
            pb.finish_and_clear();
            let v = v?;
            eprintln!(
                "dtm: {} tx/s, p50 {:.1} ms, p99 {:.1} ms, {} compensated, {} lost",
                thousands(num(&v, "tx_per_s") as u64),
                num(&v["latency_ms"], "p50"),
                num(&v["latency_ms"], "p99"),
                num(&v, "compensated"),
                num(&v, "lost"),
            );
            theirs.push(v);
        }
    }
    let med = |f: fn(&SagaResult) -> f64| median(&ours.iter().map(f).collect::<Vec<_>>());
    let our_rate = med(|r| r.tx_per_s).unwrap_or(0.0);
    let mut rows = vec![vec![
        "railyard".to_owned(),
        protocol.as_str().to_owned(),
        cfg.store.clone(),
        thousands(a.transactions),
        a.concurrency.to_string(),
        thousands(med(|r| r.tx_per_s).unwrap_or(0.0) as u64),
        thousands(med(|r| r.events_per_s).unwrap_or(0.0) as u64),
        format!("{:.1}", med(|r| r.latency_ms.p50).unwrap_or(0.0)),
        format!("{:.1}", med(|r| r.latency_ms.p99).unwrap_or(0.0)),
        format!("{:.1}", med(|r| r.latency_ms.p999).unwrap_or(0.0)),
        format!("{:.1}", med(|r| r.latency_ms.max).unwrap_or(0.0)),
        format!("{:.1}", med(|r| r.terminal_ms.p99).unwrap_or(0.0)),
        thousands(med(|r| r.compensated as f64).unwrap_or(0.0) as u64),
        thousands(ours.iter().map(|r| r.lost).max().unwrap_or(0)),
        if protocol == Protocol::Native {
            format!("{:.1}", med(|r| r.mean_batch_events).unwrap_or(0.0))
        } else {
            "-".to_owned()
        },
        "-".to_owned(),
    ]];
    if let Some(o) = &dtm {
        let tmed = |f: &dyn Fn(&serde_json::Value) -> f64| {
            median(&theirs.iter().map(f).collect::<Vec<_>>()).unwrap_or(0.0)
        };
        let their_rate = tmed(&|v| num(v, "tx_per_s"));
        rows.push(vec![
            "dtm".to_owned(),
            "http".to_owned(),
            o.store.as_str().to_owned(),
            thousands(o.transactions),
            a.concurrency.to_string(),
            thousands(their_rate as u64),
            "-".to_owned(),
            format!("{:.1}", tmed(&|v| num(&v["latency_ms"], "p50"))),
            format!("{:.1}", tmed(&|v| num(&v["latency_ms"], "p99"))),
            format!("{:.1}", tmed(&|v| num(&v["latency_ms"], "p999"))),
            format!("{:.1}", tmed(&|v| num(&v["latency_ms"], "max"))),
            "-".to_owned(),
            thousands(tmed(&|v| num(v, "compensated")) as u64),
            thousands(
                theirs
                    .iter()
                    .map(|v| num(v, "lost") as u64)
                    .max()
                    .unwrap_or(0),
            ),
            "-".to_owned(),
            format!("{:.1}x", our_rate / their_rate.max(f64::MIN_POSITIVE)),
        ]);
        println!(
            "\nrailyard ({}) makes {:.1}x the transactions/s of dtm ({}), medians of {} run(s)",
            protocol.as_str(),
            our_rate / their_rate.max(f64::MIN_POSITIVE),
            o.store.as_str(),
            a.runs
        );
    }
    println!(
        "\nsaga (alpha-benchmark profile, 8 events per transaction), abort ratio {}, {} channels, median of {} run(s)\n{}",
        a.abort_ratio,
        a.channels,
        a.runs,
        table(
            &[
                "system",
                "protocol",
                "store",
                "transactions",
                "concurrency",
                "tx/s",
                "events/s",
                "p50 ms",
                "p99 ms",
                "p99.9 ms",
                "max ms",
                "terminal p99 ms",
                "compensated",
                "lost (max)",
                "events/batch",
                "railyard / it",
            ],
            rows
        )
    );
    if let Some(path) = &a.json {
        let mut json: Vec<serde_json::Value> = ours
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<_, _>>()?;
        json.extend(theirs.iter().cloned());
        write_json(path, &json).with_context(|| format!("writing {}", path.display()))?;
        crate::bench_plot::announce_json(path, json.len());
    }
    Ok(())
}

/// A number field of a peer's result object (0 if missing).
fn num(v: &serde_json::Value, key: &str) -> f64 {
    v.get(key)
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(0.0)
}

/// A share from 0 to 1, checked when the command line is read (before any
/// coordinator or PostgreSQL is started).
fn parse_ratio(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number; give a share from 0 to 1, e.g. 0.1"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{v} is not a share from 0 to 1; e.g. 0.1 aborts one transaction in ten"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::parse_ratio;

    #[test]
    fn the_abort_ratio_is_a_share_checked_on_the_command_line() {
        assert_eq!(parse_ratio("0"), Ok(0.0));
        assert_eq!(parse_ratio("0.1"), Ok(0.1));
        assert_eq!(parse_ratio("1"), Ok(1.0));
        for bad in ["1.5", "-0.1", "NaN", "ten"] {
            assert!(parse_ratio(bad).is_err(), "{bad}");
        }
    }
}
