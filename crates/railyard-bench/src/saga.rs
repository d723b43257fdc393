//! Seed 003: ServiceComb Pack's `alpha-benchmark` profile against a saga
//! coordinator, over real gRPC.
//!
//! Each transaction is 8 events: `SagaStarted`, `TxStarted`/`TxEnded` for
//! three services, `SagaEnded`. `concurrency` workers each run their share
//! of the transactions one after another, waiting for each event's answer
//! before sending the next, as the original tool's threads do.
//!
//! - [`Protocol::Omega`]: each event is one blocking unary
//!   `TxEventService/OnTxEvent` call, as Omega makes them. The workers share
//!   `channels` HTTP/2 connections (one per simulated Omega process); each
//!   process runs an instance of each of the four services (the saga starter
//!   and three participants), and each instance keeps its `OnConnected`
//!   stream open to receive compensation commands.
//! - [`Protocol::Native`]: the same through `railyard-saga-client`. Each
//!   simulated process has one connection and, by default
//!   ([`Sessions::Process`]), one batched session for its four participant
//!   instances, so the events of all of the process's concurrent sagas share
//!   frames; [`Sessions::Participant`] gives each instance its own session.
//!
//! With `abort_ratio > 0`, that share of the transactions (spread evenly)
//! fail on the third service: it reports `TxAborted` instead of `TxEnded`,
//! then the starter reports the saga's failure as Omega 0.7 does against a
//! coordinator that advertises `AkkaEnabled` (Railyard's default:
//! `SagaAborted` with `localTxId = globalTxId`; natively: `SAGA_ABORTED`),
//! still 8 events. The coordinator must then compensate the two ended steps:
//! the bench answers each compensation command as that Omega does
//! (`TxCompensateAckSucceed`; natively `TX_COMPENSATED`) and counts a transaction compensated when all its ended
//! steps were, at the moment the last answer was acknowledged (Omega) or the
//! last handler ran (native; its ack follows in the next batch).
//!
//! Latency is per transaction, from its first call to its last answer, into
//! an HdrHistogram (real percentiles, unlike the original tool). The time to
//! the terminal durable state is the same for a committed transaction (its
//! `SagaEnded` is acknowledged only once durable) and, for a compensated
//! one, up to its last compensation. A transaction is lost if it never
//! reached its terminal state: an event not acknowledged, an unexpected
//! answer, or compensations missing after the drain timeout.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hdrhistogram::Histogram;
use railyard_saga_client::{
    ClientStats, Compensation, Connection, Participant as SagaParticipant, SagaClient, Step,
    StepError,
};
use railyard_saga_proto::omega::{GrpcCompensateCommand, GrpcServiceConfig, GrpcTxEvent};
use serde::{Deserialize, Serialize};

use crate::omega_wire::OmegaWire;

/// Participant services per transaction (the starter is a fourth).
pub const SERVICES: usize = 3;
/// Events per transaction.
pub const EVENTS_PER_TX: u64 = 8;

/// How the load talks to the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// ServiceComb Pack's `TxEventService`: one unary call per event.
    Omega,
    /// Railyard's batched session stream, through the SDK.
    Native,
}

impl Protocol {
    /// `omega` or `native`.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Omega => "omega",
            Protocol::Native => "native",
        }
    }
}

/// Native only: how a simulated process's four participant instances (the
/// saga starter and the three services) talk to the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sessions {
    /// One session for all four ([`ClientBuilder::participant`]): the
    /// events of all of the process's sagas share batches.
    ///
    /// [`ClientBuilder::participant`]: railyard_saga_client::ClientBuilder::participant
    Process,
    /// A session each, over the process's one connection.
    Participant,
}

impl Sessions {
    /// `process` or `participant`.
    pub fn as_str(self) -> &'static str {
        match self {
            Sessions::Process => "process",
            Sessions::Participant => "participant",
        }
    }
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct SagaBenchConfig {
    /// Global transactions in all.
    pub transactions: u64,
    /// Workers, each running its share one transaction after another.
    pub concurrency: usize,
    /// Wire protocol.
    pub protocol: Protocol,
    /// The coordinator's store, for the result row (`embedded`, `postgres`).
    pub store: String,
    /// Share of transactions that abort on the third service, 0..=1.
    pub abort_ratio: f64,
    /// HTTP/2 connections (Omega and native; native sessions per
    /// [`SagaBenchConfig::sessions`]): the
    /// simulated participant processes.
    pub channels: usize,
    /// Threads of the load generator's own runtime (1: a current-thread
    /// runtime on a thread of its own; more: a multi-thread runtime).
    pub client_threads: usize,
    /// After the load, how long to wait for outstanding compensations.
    pub drain_timeout: Duration,
    /// Native only: unacknowledged batches per session (`None`: no limit).
    pub batches_in_flight: Option<usize>,
    /// Native only: sessions per process or per participant instance.
    pub sessions: Sessions,
}

/// Latency percentiles, milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct LatencyMs {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Maximum.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

impl LatencyMs {
    fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Self {
            p50: ms(h.value_at_quantile(0.5)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            max: ms(h.max()),
            mean: h.mean() / 1000.0,
        }
    }
}

/// One run's result row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SagaResult {
    /// Always `saga`.
    pub scenario: String,
    /// `railyard` (or a peer's name).
    pub system: String,
    /// `omega` or `native`.
    pub protocol: String,
    /// The coordinator's store.
    pub store: String,
    /// Transactions run.
    pub transactions: u64,
    /// Workers.
    pub concurrency: usize,
    /// Simulated processes, each with its connection (see [`SagaBenchConfig::channels`]).
    pub channels: usize,
    /// Native only: `process` (one session per simulated process) or
    /// `participant` (one per participant instance); empty for Omega and in
    /// rows written before the choice existed.
    #[serde(default)]
    pub sessions: String,
    /// Share of transactions made to abort.
    pub abort_ratio: f64,
    /// Load generator threads.
    pub client_threads: usize,
    /// From the first event to the last worker's last answer, seconds.
    pub duration_s: f64,
    /// Transactions whose every event was acknowledged, per second of
    /// `duration_s`.
    pub tx_per_s: f64,
    /// Acknowledged events per second of `duration_s`.
    pub events_per_s: f64,
    /// Events acknowledged.
    pub events: u64,
    /// Per-transaction latency, first call to last answer.
    pub latency_ms: LatencyMs,
    /// Time from a transaction's first call to its terminal durable state
    /// (committed, or every ended step compensated).
    pub terminal_ms: LatencyMs,
    /// Transactions committed.
    pub committed: u64,
    /// Transactions made to abort.
    pub aborted: u64,
    /// Aborted transactions whose ended steps were all compensated.
    pub compensated: u64,
    /// Compensation commands received (retries and duplicates included).
    pub compensation_commands: u64,
    /// Transactions that never reached their terminal state, plus (native)
    /// events still unacknowledged at the end, each counted as one lost
    /// transaction (an upper bound).
    pub lost: u64,
    /// Native only: events reported and never acknowledged by the end of the
    /// drain (compensation answers included).
    pub unacked_events: u64,
    /// Calls that failed or got an unexpected answer.
    pub errors: u64,
    /// Native only: mean events per batch frame (0 for Omega).
    pub mean_batch_events: f64,
    /// CPU seconds (user + system) of the whole bench process per 1000
    /// transactions (coordinator and load generator together when the
    /// coordinator runs in-process).
    pub process_cpu_s_per_1k_tx: f64,
}

/// Why a bench run failed (individual call failures are counted, not errors).
#[derive(Debug, thiserror::Error)]
pub enum SagaBenchError {
    /// A setting is out of range.
    #[error("invalid bench setting: {0}")]
    Config(String),
    /// The coordinator could not be reached.
    #[error("could not connect to the saga coordinator at {endpoint}: {reason}")]
    Connect {
        /// Where.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// The SDK could not open its sessions.
    #[error("opening a native session: {0}")]
    Client(#[from] railyard_saga_client::SagaError),
    /// The load runtime could not start.
    #[error("starting the load generator's runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// Whether transaction `i` aborts: exactly `floor(n * ratio)` of the first
/// `n`, spread evenly.
pub fn aborts(i: u64, ratio: f64) -> bool {
    if ratio <= 0.0 {
        return false;
    }
    ((i + 1) as f64 * ratio).floor() > (i as f64 * ratio).floor()
}

fn histogram() -> Histogram<u64> {
    // 1 µs .. 10 min at 3 significant digits; values beyond are clamped.
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("static bounds are valid")
}

fn micros(d: Duration) -> u64 {
    (d.as_micros() as u64).clamp(1, 600_000_000)
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn cpu_seconds_self() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn service_name(s: usize) -> String {
    format!("bench-service-{}", s + 1)
}

const STARTER: &str = "bench-starter";

/// The compensation method of service `s`, Omega-style (a Java signature).
fn compensation_method(s: usize) -> String {
    format!(
        "public void bench.Service{}.cancel(java.lang.String)",
        s + 1
    )
}

/// Aborted transactions waiting for their compensations, by global id.
#[derive(Default)]
struct Compensations {
    inner: Mutex<CompensationState>,
    commands: AtomicU64,
    compensated: AtomicU64,
}

#[derive(Default)]
struct CompensationState {
    /// Still-uncompensated ended steps of each aborted transaction, and when
    /// it started.
    waiting: HashMap<String, (Instant, Vec<String>)>,
    terminal: Option<Histogram<u64>>,
}

impl Compensations {
    /// Registers an aborted transaction before its abort is reported (its
    /// compensations can arrive before the abort's answer).
    fn expect(&self, global: String, started: Instant, steps: Vec<String>) {
        // The lock is only held for map updates, never across an await.
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        st.waiting.insert(global, (started, steps));
    }

    /// Forgets a transaction whose abort could not be reported.
    fn forget(&self, global: &str) {
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        st.waiting.remove(global);
    }

    /// One step compensated (answer acknowledged); a duplicate is ignored.
    fn done(&self, global: &str, local: &str) {
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let finished = match st.waiting.get_mut(global) {
            Some((started, steps)) => {
                steps.retain(|s| s != local);
                steps.is_empty().then_some(*started)
            }
            None => None,
        };
        if let Some(started) = finished {
            st.waiting.remove(global);
            st.terminal
                .get_or_insert_with(histogram)
                .saturating_record(micros(started.elapsed()));
            self.compensated.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn outstanding(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .waiting
            .len()
    }
}

/// What one worker measured.
///
/// Latencies are kept as plain microsecond lists and put into histograms
/// once at the end: a histogram per worker would be hundreds of kilobytes
/// to allocate and zero, times `concurrency`.
struct WorkerTotals {
    /// Every completed transaction, committed or aborted, in µs.
    latency: Vec<u64>,
    /// Committed ones only: their latency is their time to the terminal state.
    committed_latency: Vec<u64>,
    events: u64,
    committed: u64,
    completed: u64,
    aborted: u64,
    errors: u64,
}

impl WorkerTotals {
    fn new() -> Self {
        Self {
            latency: Vec::new(),
            committed_latency: Vec::new(),
            events: 0,
            committed: 0,
            completed: 0,
            aborted: 0,
            errors: 0,
        }
    }

    /// Counts one transaction that started at `started`: completed (with its
    /// latency, and as a committed one unless it was an abort) or an error.
    fn finish(&mut self, ok: bool, abort: bool, started: Instant, progress: &Progress) {
        if ok {
            self.completed += 1;
            let us = micros(started.elapsed());
            self.latency.push(us);
            if !abort {
                self.committed_latency.push(us);
            }
        } else {
            self.errors += 1;
        }
        progress.done.fetch_add(1, Ordering::Relaxed);
    }
}

/// Live counters for a progress display.
#[derive(Debug, Default)]
pub struct Progress {
    /// Transactions finished by the workers (all events answered or failed).
    pub done: AtomicU64,
    /// Transactions compensated so far.
    pub compensated: AtomicU64,
}

/// Runs one bench against the coordinator at `endpoint`
/// (`http://127.0.0.1:PORT`), on a runtime of its own.
///
/// # Errors
/// [`SagaBenchError`] if the settings are invalid or the coordinator cannot
/// be reached at all; failures of single calls are counted in the row.
pub async fn run(
    endpoint: &str,
    cfg: &SagaBenchConfig,
    progress: Arc<Progress>,
) -> Result<SagaResult, SagaBenchError> {
    if cfg.transactions == 0 || cfg.concurrency == 0 || cfg.channels == 0 {
        return Err(SagaBenchError::Config(
            "--transactions, --concurrency and --channels must be at least 1".into(),
        ));
    }
    if !(0.0..=1.0).contains(&cfg.abort_ratio) {
        return Err(SagaBenchError::Config(
            "--abort-ratio must be between 0 and 1".into(),
        ));
    }
    // The load generator runs on its own threads, apart from the
    // coordinator's runtime, so the two only share the cores. One thread is
    // a current-thread runtime on a thread of its own: its tasks wake and
    // queue each other without the work-stealing scheduler's atomics.
    let endpoint = endpoint.to_owned();
    let cfg2 = cfg.clone();
    let load = async move {
        match cfg2.protocol {
            Protocol::Omega => run_omega(&endpoint, &cfg2, progress).await,
            Protocol::Native => run_native(&endpoint, &cfg2, progress).await,
        }
    };
    if cfg.client_threads <= 1 {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("saga-load".into())
            .spawn(move || {
                let result = rt.block_on(load);
                // Its sessions and connections are gone before the result
                // is: a next run starts on a quiet machine.
                rt.shutdown_timeout(Duration::from_secs(2));
                result
            })?;
        // Joined off the async workers: the thread runs the whole load.
        return match tokio::task::spawn_blocking(move || thread.join()).await {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => Err(SagaBenchError::Runtime(std::io::Error::other(format!(
                "the load generator panicked: {}",
                panic_text(&*panic)
            )))),
            Err(e) => Err(SagaBenchError::Runtime(std::io::Error::other(e))),
        };
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.client_threads.max(1))
        .thread_name("saga-load")
        .enable_all()
        .build()?;
    let handle = rt.spawn(load);
    let result = handle.await;
    let _ = tokio::task::spawn_blocking(move || rt.shutdown_timeout(Duration::from_secs(2))).await;
    match result {
        Ok(r) => r,
        Err(e) => Err(SagaBenchError::Runtime(std::io::Error::other(e))),
    }
}

/// What a panic said, if it said it with a string.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Splits `n` transactions over `workers`: worker `w`'s range of indices.
fn share(n: u64, workers: usize, w: usize) -> std::ops::Range<u64> {
    let workers = workers as u64;
    let w = w as u64;
    let base = n / workers;
    let extra = n % workers;
    let start = w * base + w.min(extra);
    let len = base + u64::from(w < extra);
    start..start + len
}

#[allow(clippy::too_many_arguments)]
fn finish(
    cfg: &SagaBenchConfig,
    totals: Vec<WorkerTotals>,
    comps: &Compensations,
    elapsed: Duration,
    cpu: Option<f64>,
    mean_batch_events: f64,
    unacked_events: u64,
    failed_compensation_reports: u64,
) -> SagaResult {
    let mut latency = histogram();
    let mut terminal = histogram();
    let (mut events, mut committed, mut completed, mut aborted, mut errors) = (0, 0, 0, 0, 0);
    for t in &totals {
        for &us in &t.latency {
            latency.saturating_record(us);
        }
        events += t.events;
        committed += t.committed;
        completed += t.completed;
        aborted += t.aborted;
        errors += t.errors;
    }
    // Committed transactions are terminal when their SagaEnded is acked:
    // their latency is their time to the terminal durable state.
    for t in &totals {
        for &us in &t.committed_latency {
            terminal.saturating_record(us);
        }
    }
    {
        let st = comps.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = &st.terminal {
            let _ = terminal.add(h);
        }
    }
    // A compensation counts when its handler ran; a result the coordinator
    // then refused (or that was never sent) did not compensate its
    // transaction: take one transaction off per such report, at worst.
    let compensated = comps
        .compensated
        .load(Ordering::Relaxed)
        .saturating_sub(failed_compensation_reports);
    let secs = elapsed.as_secs_f64().max(1e-9);
    SagaResult {
        scenario: "saga".into(),
        system: "railyard".into(),
        protocol: cfg.protocol.as_str().into(),
        store: cfg.store.clone(),
        transactions: cfg.transactions,
        concurrency: cfg.concurrency,
        channels: cfg.channels,
        sessions: match cfg.protocol {
            Protocol::Native => cfg.sessions.as_str().into(),
            Protocol::Omega => String::new(),
        },
        abort_ratio: cfg.abort_ratio,
        client_threads: cfg.client_threads,
        duration_s: secs,
        tx_per_s: completed as f64 / secs,
        events_per_s: events as f64 / secs,
        events,
        latency_ms: LatencyMs::of(&latency),
        terminal_ms: LatencyMs::of(&terminal),
        committed,
        aborted,
        compensated,
        compensation_commands: comps.commands.load(Ordering::Relaxed),
        lost: cfg.transactions.saturating_sub(committed + compensated) + unacked_events,
        unacked_events,
        errors,
        mean_batch_events,
        process_cpu_s_per_1k_tx: cpu.map_or(0.0, |c| c * 1000.0 / cfg.transactions as f64),
    }
}

/// Waits until no compensation is outstanding, or the drain timeout.
async fn drain(comps: &Compensations, timeout: Duration, progress: &Progress) {
    let deadline = Instant::now() + timeout;
    while comps.outstanding() > 0 && Instant::now() < deadline {
        progress
            .compensated
            .store(comps.compensated.load(Ordering::Relaxed), Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    progress
        .compensated
        .store(comps.compensated.load(Ordering::Relaxed), Ordering::Relaxed);
}

// ---------------------------------------------------------------- Omega --

fn instance_id(service: &str, k: usize) -> String {
    format!("{service}-{k}")
}

/// One simulated Omega process's instance of `service` on `wire`: keeps
/// its `OnConnected` stream open and answers every compensation command with
/// `TxCompensateAckSucceedEvent` (Omega 0.7 with `AkkaEnabled`, which
/// Railyard advertises by default). Returns the task reading the stream, whose abort
/// ends the stream.
async fn omega_instance(
    wire: OmegaWire,
    service: String,
    instance: String,
    comps: Arc<Compensations>,
    errors: Arc<AtomicU64>,
) -> Result<tokio::task::JoinHandle<()>, SagaBenchError> {
    let config = GrpcServiceConfig {
        service_name: service.clone(),
        instance_id: instance.clone(),
    };
    let mut commands = wire
        .on_connected(&config)
        .await
        .map_err(|e| SagaBenchError::Connect {
            endpoint: wire.endpoint().to_owned(),
            reason: format!("OnConnected: {e}"),
        })?;
    Ok(tokio::spawn(async move {
        while let Ok(Some(cmd)) = commands.next().await {
            comps.commands.fetch_add(1, Ordering::Relaxed);
            let (wire, service, instance, comps, errors) = (
                wire.clone(),
                service.clone(),
                instance.clone(),
                comps.clone(),
                errors.clone(),
            );
            tokio::spawn(async move {
                let GrpcCompensateCommand {
                    global_tx_id,
                    local_tx_id,
                    parent_tx_id,
                    compensation_method,
                    ..
                } = cmd;
                let event = GrpcTxEvent {
                    timestamp: now_ms(),
                    global_tx_id: global_tx_id.clone(),
                    local_tx_id: local_tx_id.clone(),
                    parent_tx_id,
                    r#type: "TxCompensateAckSucceedEvent".into(),
                    compensation_method,
                    service_name: service,
                    instance_id: instance,
                    ..GrpcTxEvent::default()
                };
                match wire.on_tx_event(&event).await {
                    Ok(_) => comps.done(&global_tx_id, &local_tx_id),
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    }))
}

async fn run_omega(
    endpoint: &str,
    cfg: &SagaBenchConfig,
    progress: Arc<Progress>,
) -> Result<SagaResult, SagaBenchError> {
    let comps = Arc::new(Compensations::default());
    let comp_errors = Arc::new(AtomicU64::new(0));
    let mut channels = Vec::with_capacity(cfg.channels);
    let mut streams = Vec::new();
    for k in 0..cfg.channels {
        let ch = OmegaWire::connect(endpoint)
            .await
            .map_err(|reason| SagaBenchError::Connect {
                endpoint: endpoint.to_owned(),
                reason,
            })?;
        for service in std::iter::once(STARTER.to_owned()).chain((0..SERVICES).map(service_name)) {
            let inst = instance_id(&service, k);
            streams.push(
                omega_instance(
                    ch.clone(),
                    service,
                    inst,
                    comps.clone(),
                    comp_errors.clone(),
                )
                .await?,
            );
        }
        channels.push(ch);
    }
    let prefix = format!("bench-{:x}", now_ms());
    let cpu0 = cpu_seconds_self();
    let t0 = Instant::now();
    let mut workers = Vec::with_capacity(cfg.concurrency);
    for w in 0..cfg.concurrency {
        let k = w % cfg.channels;
        let client = channels[k].clone();
        let range = share(cfg.transactions, cfg.concurrency, w);
        let (prefix, comps, progress) = (prefix.clone(), comps.clone(), progress.clone());
        let ratio = cfg.abort_ratio;
        workers.push(tokio::spawn(async move {
            omega_worker(client, k, range, ratio, &prefix, &comps, &progress).await
        }));
    }
    let totals = join_workers(workers).await?;
    let elapsed = t0.elapsed();
    drain(&comps, cfg.drain_timeout, &progress).await;
    let cpu = cpu0.zip(cpu_seconds_self()).map(|(a, b)| b - a);
    for s in streams {
        s.abort();
    }
    // Omega's answers are counted once the coordinator answered them.
    let mut r = finish(cfg, totals, &comps, elapsed, cpu, 0.0, 0, 0);
    r.errors += comp_errors.load(Ordering::Relaxed);
    Ok(r)
}

struct OmegaTx<'a> {
    client: &'a OmegaWire,
    global: &'a str,
}

/// A participant as the Omega load reports it: service, instance id (of
/// this simulated process), compensation method.
struct Participant {
    service: String,
    instance: String,
    method: String,
}

impl Participant {
    /// `service` as simulated process `k` reports it.
    fn new(service: String, k: usize, method: String) -> Self {
        Self {
            instance: instance_id(&service, k),
            service,
            method,
        }
    }
}

impl OmegaTx<'_> {
    /// One blocking call; `Some(aborted)` when answered.
    async fn call(&self, kind: &str, who: &Participant, local: &str, parent: &str) -> Option<bool> {
        let event = GrpcTxEvent {
            timestamp: now_ms(),
            global_tx_id: self.global.to_owned(),
            local_tx_id: local.to_owned(),
            parent_tx_id: parent.to_owned(),
            r#type: kind.to_owned(),
            compensation_method: who.method.clone(),
            service_name: who.service.clone(),
            instance_id: who.instance.clone(),
            ..GrpcTxEvent::default()
        };
        self.client
            .on_tx_event(&event)
            .await
            .ok()
            .map(|r| r.aborted)
    }
}

async fn omega_worker(
    client: OmegaWire,
    k: usize,
    range: std::ops::Range<u64>,
    ratio: f64,
    prefix: &str,
    comps: &Compensations,
    progress: &Progress,
) -> WorkerTotals {
    let mut t = WorkerTotals::new();
    // Built once per worker, not per call.
    let starter = Participant::new(STARTER.to_owned(), k, String::new());
    let services: Vec<Participant> = (0..SERVICES)
        .map(|s| Participant::new(service_name(s), k, compensation_method(s)))
        .collect();
    for i in range {
        let global = format!("{prefix}-{i}");
        let abort = aborts(i, ratio);
        let started = Instant::now();
        let tx = OmegaTx {
            client: &client,
            global: &global,
        };
        let ok = 'tx: {
            if tx
                .call("SagaStartedEvent", &starter, &global, "")
                .await
                .is_none()
            {
                break 'tx false;
            }
            t.events += 1;
            let mut ended = Vec::with_capacity(SERVICES);
            for (s, who) in services.iter().enumerate() {
                let local = format!("{global}-{}", s + 1);
                match tx.call("TxStartedEvent", who, &local, &global).await {
                    Some(false) => t.events += 1,
                    _ => break 'tx false,
                }
                let last = s + 1 == SERVICES;
                if abort && last {
                    comps.expect(global.clone(), started, std::mem::take(&mut ended));
                    if tx
                        .call("TxAbortedEvent", who, &local, &global)
                        .await
                        .is_none()
                    {
                        comps.forget(&global);
                        break 'tx false;
                    }
                } else {
                    if tx
                        .call("TxEndedEvent", who, &local, &global)
                        .await
                        .is_none()
                    {
                        break 'tx false;
                    }
                    ended.push(local);
                }
                t.events += 1;
            }
            if abort {
                // Omega 0.7 with AkkaEnabled: the failed @SagaStart.
                if tx
                    .call("SagaAbortedEvent", &starter, &global, "")
                    .await
                    .is_none()
                {
                    break 'tx false;
                }
                t.events += 1;
                t.aborted += 1;
                true
            } else {
                match tx.call("SagaEndedEvent", &starter, &global, "").await {
                    Some(false) => {
                        t.events += 1;
                        t.committed += 1;
                        true
                    }
                    _ => false,
                }
            }
        };
        t.finish(ok, abort, started, progress);
    }
    t
}

// --------------------------------------------------------------- native --

async fn run_native(
    endpoint: &str,
    cfg: &SagaBenchConfig,
    progress: Arc<Progress>,
) -> Result<SagaResult, SagaBenchError> {
    let comps = Arc::new(Compensations::default());
    let bif = cfg.batches_in_flight.unwrap_or(usize::MAX);
    // clients[k][0] is the starter, clients[k][1..] the three services.
    let mut clients: Vec<Vec<SagaClient>> = Vec::with_capacity(cfg.channels);
    for k in 0..cfg.channels {
        // One connection per simulated process, shared by its four service
        // instances, as the Omega load's processes share theirs.
        let conn = Connection::open(endpoint).await?;
        let builder = |name: &str| {
            SagaClient::builder(endpoint, name)
                .instance_id(instance_id(name, k))
                .connection(&conn)
                .max_batches_in_flight(bif)
        };
        // Every service's handler answers its compensation commands.
        let handler = || {
            let c = comps.clone();
            move |cmd: Compensation| {
                c.commands.fetch_add(1, Ordering::Relaxed);
                c.done(&cmd.global_tx_id, &cmd.local_tx_id);
                std::future::ready(Ok::<(), std::convert::Infallible>(()))
            }
        };
        let row = match cfg.sessions {
            Sessions::Process => {
                let mut b = builder(STARTER);
                for s in 0..SERVICES {
                    let name = service_name(s);
                    b = b.participant(
                        SagaParticipant::new(name.clone())
                            .instance_id(instance_id(&name, k))
                            .compensation(compensation_method(s), handler()),
                    );
                }
                b.connect_all().await?
            }
            Sessions::Participant => {
                let mut row = vec![builder(STARTER).connect().await?];
                for s in 0..SERVICES {
                    row.push(
                        builder(&service_name(s))
                            .compensation(compensation_method(s), handler())
                            .connect()
                            .await?,
                    );
                }
                row
            }
        };
        clients.push(row);
    }
    let cpu0 = cpu_seconds_self();
    let t0 = Instant::now();
    let mut workers = Vec::with_capacity(cfg.concurrency);
    for w in 0..cfg.concurrency {
        let row = clients[w % cfg.channels].clone();
        let range = share(cfg.transactions, cfg.concurrency, w);
        let (comps, progress) = (comps.clone(), progress.clone());
        let ratio = cfg.abort_ratio;
        workers.push(tokio::spawn(async move {
            native_worker(row, range, ratio, &comps, &progress).await
        }));
    }
    let totals = join_workers(workers).await?;
    let elapsed = t0.elapsed();
    let deadline = Instant::now() + cfg.drain_timeout;
    drain(&comps, cfg.drain_timeout, &progress).await;
    // Each session's counters once: a process's clients share one session
    // (and its counters) with `Sessions::Process`.
    let sessions = || -> Vec<ClientStats> {
        match cfg.sessions {
            Sessions::Process => clients
                .iter()
                .filter_map(|row| row.first())
                .map(SagaClient::stats)
                .collect(),
            Sessions::Participant => clients.iter().flatten().map(SagaClient::stats).collect(),
        }
    };
    // Compensation answers are acknowledged after their handler ran.
    let unacked = || -> u64 { sessions().iter().map(|s| s.in_flight).sum() };
    while unacked() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let unacked_events = unacked();
    let cpu = cpu0.zip(cpu_seconds_self()).map(|(a, b)| b - a);
    let (batches, events, failed_reports) = sessions().iter().fold((0, 0, 0), |(b, e, f), s| {
        (
            b + s.batches,
            e + s.events,
            f + s.compensation_reports_failed,
        )
    });
    for c in clients.iter().flatten() {
        c.close();
    }
    let mean_batch = if batches > 0 {
        events as f64 / batches as f64
    } else {
        0.0
    };
    Ok(finish(
        cfg,
        totals,
        &comps,
        elapsed,
        cpu,
        mean_batch,
        unacked_events,
        failed_reports,
    ))
}

#[derive(Debug)]
struct Fail;

async fn native_worker(
    clients: Vec<SagaClient>,
    range: std::ops::Range<u64>,
    ratio: f64,
    comps: &Compensations,
    progress: &Progress,
) -> WorkerTotals {
    let mut t = WorkerTotals::new();
    let methods: Vec<String> = (0..SERVICES).map(compensation_method).collect();
    for i in range {
        let abort = aborts(i, ratio);
        let started = Instant::now();
        let ok = 'tx: {
            let Ok(saga) = clients[0].start_saga(None).await else {
                break 'tx false;
            };
            t.events += 1;
            // One copy of the id, shared by the three participants' handles.
            let global = saga.shared_id();
            // The ended steps' ids, kept only for a transaction that aborts
            // (its compensations are matched against them).
            let mut ended = Vec::new();
            for (s, method) in methods.iter().enumerate() {
                let part = clients[s + 1].join_saga_shared(global.clone());
                let local = format!("{global}-{}", s + 1);
                let fail = abort && s + 1 == SERVICES;
                if fail {
                    comps.expect(String::from(&*global), started, std::mem::take(&mut ended));
                }
                let keep = (abort && !fail).then(|| local.clone());
                let step = Step::new(method.clone()).local_id(local);
                let r = part
                    .step(step, async {
                        if fail {
                            Err(Fail)
                        } else {
                            Ok(())
                        }
                    })
                    .await;
                match r {
                    Ok(()) => ended.extend(keep),
                    Err(StepError::Failed(Fail)) if fail => {}
                    Err(_) => {
                        if fail {
                            comps.forget(&global);
                        }
                        break 'tx false;
                    }
                }
                t.events += 2;
            }
            if abort {
                if saga.abort().await.is_err() {
                    break 'tx false;
                }
                t.events += 1;
                t.aborted += 1;
                true
            } else {
                if saga.end().await.is_err() {
                    break 'tx false;
                }
                t.events += 1;
                t.committed += 1;
                true
            }
        };
        t.finish(ok, abort, started, progress);
    }
    t
}

/// Waits for every worker task and collects their totals, in spawn order.
async fn join_workers<T>(
    workers: Vec<tokio::task::JoinHandle<T>>,
) -> Result<Vec<T>, SagaBenchError> {
    let mut totals = Vec::with_capacity(workers.len());
    for w in workers {
        totals.push(
            w.await
                .map_err(|e| SagaBenchError::Runtime(std::io::Error::other(e)))?,
        );
    }
    Ok(totals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aborts_are_spread_and_counted_exactly() {
        let n = 1000;
        assert_eq!((0..n).filter(|&i| aborts(i, 0.0)).count(), 0);
        assert_eq!((0..n).filter(|&i| aborts(i, 0.1)).count(), 100);
        assert_eq!((0..n).filter(|&i| aborts(i, 1.0)).count(), 1000);
        assert_eq!((0..n).filter(|&i| aborts(i, 0.333)).count(), 333);
        // Spread: no two aborts in a row at 10%.
        assert!(!(0..n).any(|i| aborts(i, 0.1) && aborts(i + 1, 0.1)));
    }

    #[test]
    fn shares_cover_every_transaction_once() {
        for (n, w) in [(10u64, 3usize), (50_000, 500), (7, 10), (1, 1)] {
            let mut next = 0;
            for i in 0..w {
                let r = share(n, w, i);
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, n);
        }
    }

    #[test]
    fn compensations_count_once_when_every_step_is_done() {
        let c = Compensations::default();
        c.expect("g".into(), Instant::now(), vec!["g-1".into(), "g-2".into()]);
        c.done("g", "g-2");
        assert_eq!(c.compensated.load(Ordering::Relaxed), 0);
        c.done("g", "g-2");
        c.done("g", "g-1");
        assert_eq!(c.compensated.load(Ordering::Relaxed), 1);
        c.done("g", "g-1");
        assert_eq!(c.compensated.load(Ordering::Relaxed), 1);
        assert_eq!(c.outstanding(), 0);
    }
}
