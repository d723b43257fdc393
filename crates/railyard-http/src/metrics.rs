//! Prometheus metrics: the server's own, in a registry shared with the rest
//! of the node, and the admin router that serves it.
//!
//! | name | type | labels |
//! |---|---|---|
//! | `railyard_http_requests_total` | counter | `route`, `method`, `status` |
//! | `railyard_http_request_duration_seconds` | histogram (50 us .. 10 s) | `route`, `method`, `status` |
//! | `railyard_http_open_connections` | gauge | |
//! | `railyard_http_connections_accepted_total` | counter | |
//! | `railyard_http_received_bytes_total` | counter | |
//! | `railyard_http_sent_bytes_total` | counter | |
//! | `railyard_http_connection_parks_total` | counter | (idle keep-alive connections parked: see `conn`) |
//! | `railyard_http_sendfile_bytes_total` | counter | (the part of sent bytes sent by `sendfile(2)`) |
//! | `railyard_http_cold_file_reads_total` | counter | (file windows read on the blocking pool because their pages were not cached) |
//!
//! `route` is the route pattern (`unmatched` for unknown paths), never the
//! raw path, so label cardinality stays bounded. The duration runs from the
//! parsed request head to the response head (bodies stream afterwards).
//!
//! # Per-core recording
//! The metrics touched on every request (request counts, durations, bytes in
//! and out) are recorded per core in `CoreStats`, which only that core's
//! thread writes (a plain load and store, no locked instruction, no cache
//! line shared with the other cores), and summed over the cores at each
//! scrape. A shared prometheus-client `Counter` or `Histogram` would make
//! every request of every core update the same cache lines (and take the
//! histogram's lock): at 10,000 connections that traffic showed in the
//! profile. The encoded names, types and labels are the same as theirs.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Response, StatusCode};
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::body::Body;
use crate::router::Router;

/// The node's metric registry, shared by every subsystem that reports.
/// Locked only to register and to encode a scrape.
pub type MetricsRegistry = Arc<Mutex<Registry>>;

/// Latency buckets in seconds: from 50 us (a cached response on loopback) to 10 s.
pub const LATENCY_BUCKETS: [f64; 17] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];

/// Buckets of a duration series, `+Inf` included.
const N_BUCKETS: usize = LATENCY_BUCKETS.len() + 1;

/// Labels of the per-request series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    pub(crate) route: String,
    pub(crate) method: &'static str,
    pub(crate) status: u16,
}

/// A counter with a single writer thread: adding is a plain load and store
/// (no locked read-modify-write); any thread may read it.
#[derive(Debug, Default)]
pub(crate) struct LocalCounter(AtomicU64);

impl LocalCounter {
    /// Adds `n`. Only the owning core's thread may call this (two writers
    /// would lose counts; nothing unsafe happens).
    pub(crate) fn add(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_add(n), Relaxed);
    }

    fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// One (route, method, status) series on one core: its duration histogram,
/// whose bucket total is also the request count. Aligned so that no other
/// allocation (another core's series) shares its cache lines.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Series {
    /// Observations per bucket (not cumulative), `+Inf` last.
    buckets: [LocalCounter; N_BUCKETS],
    /// Sum of the observations in seconds, as `f64` bits.
    sum_bits: AtomicU64,
}

impl Series {
    /// Records one request that took `secs`. Owning core only.
    pub(crate) fn observe(&self, secs: f64) {
        let i = LATENCY_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i].add(1);
        let sum = f64::from_bits(self.sum_bits.load(Relaxed)) + secs;
        self.sum_bits.store(sum.to_bits(), Relaxed);
    }
}

/// One core's hot-path metrics (see "Per-core recording" above).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct CoreStats {
    pub(crate) bytes_in: LocalCounter,
    pub(crate) bytes_out: LocalCounter,
    /// Requests answered by the fixed lane (see `lane`).
    pub(crate) lane_requests: LocalCounter,
    /// This core's series; locked to add one (once per core and series) and
    /// to scrape.
    series: Mutex<Vec<(RequestLabels, Arc<Series>)>>,
}

impl CoreStats {
    /// A new series for `labels` on this core (the caller caches it).
    pub(crate) fn series(&self, labels: RequestLabels) -> Arc<Series> {
        let s = Arc::new(Series::default());
        lock(&self.series).push((labels, s.clone()));
        s
    }
}

/// Every core's stats, ever: a core's counts stay after it stops, so
/// counters never go back.
type Cores = Arc<Mutex<Vec<Arc<CoreStats>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means another thread panicked holding it; the
    // data (counters) is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Per-series totals over all cores: bucket counts and sum.
fn merged(cores: &Cores) -> BTreeMap<RequestLabels, ([u64; N_BUCKETS], f64)> {
    let mut out: BTreeMap<RequestLabels, ([u64; N_BUCKETS], f64)> = BTreeMap::new();
    for core in lock(cores).iter() {
        for (labels, s) in lock(&core.series).iter() {
            let e = out.entry(labels.clone()).or_insert(([0; N_BUCKETS], 0.0));
            for (t, b) in e.0.iter_mut().zip(&s.buckets) {
                *t += b.get();
            }
            e.1 += f64::from_bits(s.sum_bits.load(Relaxed));
        }
    }
    out
}

/// `railyard_http_requests_total`, summed over the cores at scrape.
#[derive(Debug)]
struct RequestCounts(Cores);

impl EncodeMetric for RequestCounts {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, (buckets, _)) in merged(&self.0) {
            let n: u64 = buckets.iter().sum();
            encoder
                .encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
}

/// `railyard_http_request_duration_seconds`, summed over the cores at scrape.
#[derive(Debug)]
struct RequestDurations(Cores);

impl EncodeMetric for RequestDurations {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, (buckets, sum)) in merged(&self.0) {
            let count: u64 = buckets.iter().sum();
            let bounds: Vec<(f64, u64)> = LATENCY_BUCKETS
                .iter()
                .copied()
                .chain(std::iter::once(f64::MAX))
                .zip(buckets)
                .collect();
            encoder
                .encode_family(&labels)?
                .encode_histogram::<NoLabelSet>(sum, count, &bounds, None)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// A per-core counter summed over the cores at scrape.
#[derive(Debug)]
struct CoreCount {
    cores: Cores,
    which: fn(&CoreStats) -> &LocalCounter,
}

impl EncodeMetric for CoreCount {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let n: u64 = lock(&self.cores)
            .iter()
            .map(|c| (self.which)(c).get())
            .sum();
        encoder.encode_counter::<NoLabelSet, _, u64>(&n, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
}

/// The HTTP server's metrics. Cheap handles (atomics behind `Arc`s).
#[derive(Debug, Clone)]
pub struct HttpMetrics {
    cores: Cores,
    pub(crate) open_connections: Gauge,
    pub(crate) accepted: Counter,
    pub(crate) sendfile_bytes: Counter,
    pub(crate) cold_file_reads: Counter,
    pub(crate) parks: Counter,
}

impl HttpMetrics {
    /// Creates the metrics and registers them in `registry` under `railyard_http_`.
    pub fn register(registry: &MetricsRegistry) -> Arc<Self> {
        let m = Self {
            cores: Cores::default(),
            open_connections: Gauge::default(),
            accepted: Counter::default(),
            sendfile_bytes: Counter::default(),
            cold_file_reads: Counter::default(),
            parks: Counter::default(),
        };
        // A poisoned lock only means another thread panicked mid-registration;
        // the registry itself is still usable.
        let mut reg = registry.lock().unwrap_or_else(|p| p.into_inner());
        let r = reg.sub_registry_with_prefix("railyard_http");
        r.register(
            "requests",
            "HTTP requests answered, by route, method and status",
            RequestCounts(m.cores.clone()),
        );
        r.register(
            "request_duration_seconds",
            "Time from request head to response head",
            RequestDurations(m.cores.clone()),
        );
        r.register(
            "open_connections",
            "Client connections open now",
            m.open_connections.clone(),
        );
        r.register(
            "connections_accepted",
            "Client connections accepted",
            m.accepted.clone(),
        );
        r.register(
            "received_bytes",
            "Bytes read from client sockets",
            CoreCount {
                cores: m.cores.clone(),
                which: |c| &c.bytes_in,
            },
        );
        r.register(
            "sent_bytes",
            "Bytes written to client sockets, sendfile included",
            CoreCount {
                cores: m.cores.clone(),
                which: |c| &c.bytes_out,
            },
        );
        r.register(
            "fixed_lane_requests",
            "Requests answered by the fixed lane, without hyper (also counted in requests)",
            CoreCount {
                cores: m.cores.clone(),
                which: |c| &c.lane_requests,
            },
        );
        r.register(
            "connection_parks",
            "Times an idle keep-alive connection gave up hyper's state between requests",
            m.parks.clone(),
        );
        r.register(
            "sendfile_bytes",
            "Bytes written to client sockets by sendfile(2)",
            m.sendfile_bytes.clone(),
        );
        r.register(
            "cold_file_reads",
            "File windows (up to 1 MiB) found not cached before sendfile(2) and read on the blocking pool first",
            m.cold_file_reads.clone(),
        );
        Arc::new(m)
    }

    /// A fresh registry with only these metrics (tests, single-purpose servers).
    pub fn standalone() -> (MetricsRegistry, Arc<Self>) {
        let reg: MetricsRegistry = Arc::new(Mutex::new(Registry::default()));
        let m = Self::register(&reg);
        (reg, m)
    }

    /// Stats for one more core (an event-loop thread), summed with the
    /// others' at every scrape.
    pub(crate) fn core_stats(&self) -> Arc<CoreStats> {
        let c = Arc::new(CoreStats::default());
        lock(&self.cores).push(c.clone());
        c
    }
}

/// A method as a static label value.
pub(crate) fn method_label(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "other",
    }
}

/// Encodes `registry` as Prometheus (OpenMetrics) text.
pub fn encode(registry: &MetricsRegistry) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let reg = registry.lock().unwrap_or_else(|p| p.into_inner());
    // Writing into a String cannot fail.
    prometheus_client::encoding::text::encode(&mut out, &reg).expect("writing to a String");
    out
}

/// The admin app: `GET /metrics` in Prometheus text format.
pub fn admin_router(registry: MetricsRegistry) -> Router {
    Router::new().get("/metrics", move |_req| {
        let registry = registry.clone();
        async move {
            let mut r = Response::new(Body::from(encode(&registry)));
            *r.status_mut() = StatusCode::OK;
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            r
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, start: &str) -> &'a str {
        text.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no line starting with {start} in\n{text}"))
    }

    /// Two cores record the same series and bytes: a scrape shows the sums,
    /// with the names, types and cumulative buckets a shared prometheus-client
    /// counter and histogram would have.
    #[test]
    fn per_core_stats_are_summed_at_scrape() {
        let (reg, m) = HttpMetrics::standalone();
        let (a, b) = (m.core_stats(), m.core_stats());
        let labels = RequestLabels {
            route: "/x".into(),
            method: "GET",
            status: 200,
        };
        let sa = a.series(labels.clone());
        let sb = b.series(labels);
        sa.observe(0.000_04); // first bucket (50 us)
        sa.observe(0.003); // the 5 ms bucket
        sb.observe(20.0); // +Inf
        a.bytes_in.add(10);
        b.bytes_in.add(5);
        b.bytes_out.add(7);

        let text = encode(&reg);
        assert!(text.contains("# TYPE railyard_http_requests counter"));
        assert!(text.contains("# TYPE railyard_http_request_duration_seconds histogram"));
        let req = r#"railyard_http_requests_total{route="/x",method="GET",status="200"}"#;
        assert_eq!(line(&text, req), format!("{req} 3"));
        let dur = r#"railyard_http_request_duration_seconds"#;
        let lbl = r#"route="/x",method="GET",status="200""#;
        assert_eq!(
            line(&text, &format!("{dur}_count{{{lbl}}}")),
            format!("{dur}_count{{{lbl}}} 3")
        );
        let sum: f64 = line(&text, &format!("{dur}_sum{{{lbl}}}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!((sum - 20.003_04).abs() < 1e-9, "sum {sum}");
        for (le, n) in [
            ("0.00005", 1),
            ("0.0025", 1),
            ("0.005", 2),
            ("10.0", 2),
            ("+Inf", 3),
        ] {
            let start = format!("{dur}_bucket{{le=\"{le}\",{lbl}}}");
            assert_eq!(line(&text, &start), format!("{start} {n}"));
        }
        assert_eq!(
            line(&text, "railyard_http_received_bytes_total"),
            "railyard_http_received_bytes_total 15"
        );
        assert_eq!(
            line(&text, "railyard_http_sent_bytes_total"),
            "railyard_http_sent_bytes_total 7"
        );
    }
}
