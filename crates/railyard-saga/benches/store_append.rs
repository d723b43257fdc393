//! Durable append throughput of the saga log: many concurrent callers
//! appending the 8 events of alpha-benchmark sagas (UUID-shaped ids), all 8
//! at once (native batches) or one per call (Omega), group-committed with a
//! real sync per commit.
//!
//! Engines measured, each behind the same shape (a bounded queue, one
//! writer draining everything waiting into one transaction, one sync, then
//! every waiter answered):
//! - `sqlite`: the real [`SqliteStore`] (WAL, `synchronous=FULL`: fsync);
//! - `fjall`: an LSM log written here for the comparison, laid out like the
//!   stores (one value per saga per commit in a partition keyed by sequence,
//!   plus a by-saga index partition), each batch committed with
//!   `PersistMode::SyncAll` (fsync, as SQLite's bundled build uses);
//! - `postgres`: the real [`PostgresStore`] on a throwaway server
//!   (`synchronous_commit=on`), skipped when PostgreSQL is not installed.
//!
//! Besides criterion's time per 8-event append (throughput in events/s),
//! each benchmark prints the p50/p99 latency of individual appends.
//!
//! Run: `flock /tmp/railyard-bench.lock cargo bench -p railyard-saga --bench store_append`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};
use futures::future::BoxFuture;
use parking_lot::Mutex;
use railyard_saga::store::encode_events;
use railyard_saga::{
    EventKind, EventRecord, PgServer, PostgresConfig, PostgresStore, Retention, SqliteConfig,
    SqliteStore, StoreError,
};
use tokio::sync::{mpsc, oneshot};

/// (concurrent callers, events per append): a native client appending a
/// whole saga at once with 64 and 512 sagas in flight, and Omega's shape
/// (one event per call, 512 sagas in flight).
const LOADS: [(usize, usize); 3] = [(64, 8), (512, 8), (512, 1)];

/// What the bench needs of a log.
trait Log: Send + Sync + 'static {
    fn append(&self, events: Vec<EventRecord>) -> BoxFuture<'_, Result<(), StoreError>>;
}

impl<S: railyard_saga::SagaStore> Log for S {
    fn append(&self, events: Vec<EventRecord>) -> BoxFuture<'_, Result<(), StoreError>> {
        railyard_saga::SagaStore::append(self, events)
    }
}

/// A UUID-shaped global id (Omega's are random UUIDs), so the by-saga
/// index sees random inserts as in production.
fn saga_id(n: u64) -> String {
    // splitmix64: cheap, well spread.
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let (a, b) = (mix(n.wrapping_add(0x9e37_79b9_7f4a_7c15)), mix(n ^ 0x5555));
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

fn saga(g: &str) -> Vec<EventRecord> {
    let mut v = Vec::with_capacity(8);
    let e = |local: String, kind| EventRecord {
        global_tx_id: g.to_owned(),
        local_tx_id: local,
        parent_tx_id: g.to_owned(),
        kind: Some(kind),
        service_name: "bench-service".into(),
        instance_id: "bench-service-127.0.0.1".into(),
        compensation_method: "public void org.Bench.cancel(java.lang.String)".into(),
        payloads: bytes::Bytes::from_static(b"\x00\x01payload-of-a-typical-size-32-by"),
        timestamp_ms: 1_700_000_000_000,
        ..EventRecord::default()
    };
    v.push(e(g.to_owned(), EventKind::SagaStarted));
    for i in 0..3 {
        v.push(e(format!("{g}-{i}"), EventKind::TxStarted));
        v.push(e(format!("{g}-{i}"), EventKind::TxEnded));
    }
    v.push(e(g.to_owned(), EventKind::SagaEnded));
    v
}

// ---- fjall, with the same group commit as the stores ----

/// One queued append and where its answer goes.
type FjallRequest = (Vec<EventRecord>, oneshot::Sender<Result<(), StoreError>>);

struct FjallLog {
    queue: mpsc::Sender<FjallRequest>,
}

impl FjallLog {
    fn open(dir: &std::path::Path) -> Self {
        let keyspace = fjall::Config::new(dir).open().expect("open fjall");
        let events = keyspace
            .open_partition("events", fjall::PartitionCreateOptions::default())
            .expect("partition");
        let by_saga = keyspace
            .open_partition("by_saga", fjall::PartitionCreateOptions::default())
            .expect("partition");
        let (tx, mut rx) = mpsc::channel::<FjallRequest>(4096);
        std::thread::Builder::new()
            .name("bench-fjall-writer".into())
            .spawn(move || {
                let mut seq: u64 = 0;
                while let Some(first) = rx.blocking_recv() {
                    let mut batch = vec![first];
                    let mut rows = batch[0].0.len();
                    while rows < 16_384 {
                        match rx.try_recv() {
                            Ok(r) => {
                                rows += r.0.len();
                                batch.push(r);
                            }
                            Err(_) => break,
                        }
                    }
                    let mut b = keyspace
                        .batch()
                        .durability(Some(fjall::PersistMode::SyncAll));
                    // One value per saga per commit, as the stores do.
                    let mut per_saga: Vec<(&str, Vec<&EventRecord>)> = Vec::new();
                    let mut at = std::collections::HashMap::new();
                    for (evs, _) in &batch {
                        for e in evs {
                            let i = *at.entry(e.global_tx_id.as_str()).or_insert_with(|| {
                                per_saga.push((e.global_tx_id.as_str(), Vec::new()));
                                per_saga.len() - 1
                            });
                            per_saga[i].1.push(e);
                        }
                    }
                    for (g, evs) in per_saga {
                        let value = encode_events(evs.iter().copied());
                        seq += 1;
                        b.insert(&events, seq.to_be_bytes(), value);
                        let mut k = g.as_bytes().to_vec();
                        k.push(0);
                        k.extend_from_slice(&seq.to_be_bytes());
                        b.insert(&by_saga, k, []);
                    }
                    let r = b.commit().map_err(|e| StoreError::Engine(e.to_string()));
                    for (_, done) in batch {
                        let _ = done.send(match &r {
                            Ok(()) => Ok(()),
                            Err(e) => Err(StoreError::Engine(e.to_string())),
                        });
                    }
                }
            })
            .expect("spawn");
        Self { queue: tx }
    }
}

impl Log for FjallLog {
    fn append(&self, events: Vec<EventRecord>) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            self.queue
                .send((events, tx))
                .await
                .map_err(|_| StoreError::Closed)?;
            rx.await.unwrap_or(Err(StoreError::Closed))
        })
    }
}

// ---- the load ----

/// `iters` appends spread over `callers` tasks, each appending its sagas'
/// 8 events `per_append` at a time; returns the wall time, and records each
/// append's latency (µs) in `lat`.
async fn load(
    log: Arc<dyn Log>,
    (callers, per_append): (usize, usize),
    iters: u64,
    lat: Arc<Mutex<Vec<u32>>>,
) -> Duration {
    static SAGA: AtomicU64 = AtomicU64::new(0);
    let left = Arc::new(AtomicU64::new(iters));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(callers);
    for _ in 0..callers {
        let log = log.clone();
        let left = left.clone();
        let lat = lat.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            let mut pending: Vec<EventRecord> = Vec::new();
            // Bounded: at most `iters` appends in all.
            while left
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
            {
                if pending.is_empty() {
                    pending = saga(&saga_id(SAGA.fetch_add(1, Ordering::Relaxed)));
                    pending.reverse();
                }
                let n = per_append.min(pending.len());
                let events: Vec<EventRecord> = pending.split_off(pending.len() - n);
                let events: Vec<EventRecord> = events.into_iter().rev().collect();
                let t = Instant::now();
                log.append(events).await.expect("durable append");
                mine.push(u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX));
            }
            lat.lock().extend(mine);
        }));
    }
    for t in tasks {
        t.await.expect("caller");
    }
    start.elapsed()
}

fn report(name: &str, lat: &Mutex<Vec<u32>>, events_per_s: f64) {
    let mut v = std::mem::take(&mut *lat.lock());
    if v.is_empty() {
        return;
    }
    v.sort_unstable();
    let pct = |p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)] as f64 / 1000.0;
    eprintln!(
        "{name}: {events_per_s:.0} durable events/s over the run, append latency p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} appends)",
        pct(0.50),
        pct(0.99),
        pct(1.0),
        v.len()
    );
}

fn bench_engine(c: &mut Criterion, rt: &tokio::runtime::Runtime, engine: &str, log: Arc<dyn Log>) {
    let mut group = c.benchmark_group(format!("store_append/{engine}"));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(2));
    group.measurement_time(Duration::from_secs(10));
    for (callers, per_append) in LOADS {
        group.throughput(Throughput::Elements(per_append as u64));
        let lat = Arc::new(Mutex::new(Vec::new()));
        let total = Arc::new(Mutex::new((0u64, Duration::ZERO)));
        let id = BenchmarkId::new(format!("{per_append}ev"), callers);
        group.bench_with_input(id, &(callers, per_append), |b, &shape| {
            b.iter_custom(|iters| {
                let d = rt.block_on(load(log.clone(), shape, iters, lat.clone()));
                let mut t = total.lock();
                t.0 += iters;
                t.1 += d;
                d
            });
        });
        let (n, d) = *total.lock();
        report(
            &format!("store_append/{engine}/{per_append}ev/{callers}"),
            &lat,
            (n * per_append as u64) as f64 / d.as_secs_f64().max(1e-9),
        );
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::Builder::new()
        .prefix("railyard-bench-store-")
        .tempdir()
        .expect("tempdir");

    let sqlite: Arc<dyn Log> = Arc::new(
        rt.block_on(SqliteStore::open(
            dir.path().join("sqlite"),
            SqliteConfig {
                retention: Retention::keep_all(),
                ..SqliteConfig::default()
            },
        ))
        .expect("open sqlite"),
    );
    bench_engine(c, &rt, "sqlite", sqlite.clone());
    drop(sqlite);

    let fjall: Arc<dyn Log> = Arc::new(FjallLog::open(&dir.path().join("fjall")));
    bench_engine(c, &rt, "fjall", fjall.clone());
    drop(fjall);

    match PgServer::start() {
        Ok(server) => {
            let pg: Arc<dyn Log> = Arc::new(
                rt.block_on(PostgresStore::connect(PostgresConfig::new(server.url())))
                    .expect("connect postgres"),
            );
            bench_engine(c, &rt, "postgres", pg.clone());
            drop(pg);
            drop(server);
        }
        // scripts/test (CI) sets RAILYARD_REQUIRE_INTEROP: there a missing
        // PostgreSQL fails the run instead of skipping silently.
        Err(e) if std::env::var_os("RAILYARD_REQUIRE_INTEROP").is_some() => {
            panic!("store_append/postgres: PostgreSQL did not start: {e}")
        }
        Err(e) => eprintln!("store_append/postgres skipped: {e}"),
    }
}

mod group {
    #![allow(missing_docs)]
    criterion::criterion_group!(store_append, super::benches);
}
use group::store_append;
criterion_main!(store_append);
