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
//!
//! `route` is the route pattern (`unmatched` for unknown paths), never the
//! raw path, so label cardinality stays bounded. The duration runs from the
//! parsed request head to the response head (bodies stream afterwards).

use std::sync::{Arc, Mutex};

use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Response, StatusCode};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
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

/// Labels of the per-request series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    pub(crate) route: String,
    pub(crate) method: &'static str,
    pub(crate) status: u16,
}

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// The HTTP server's metrics. Cheap handles (atomics behind `Arc`s).
#[derive(Debug, Clone)]
pub struct HttpMetrics {
    requests: Family<RequestLabels, Counter>,
    duration: Family<RequestLabels, Histogram, fn() -> Histogram>,
    pub(crate) open_connections: Gauge,
    pub(crate) accepted: Counter,
    pub(crate) bytes_in: Counter,
    pub(crate) bytes_out: Counter,
    pub(crate) sendfile_bytes: Counter,
    pub(crate) parks: Counter,
}

impl HttpMetrics {
    /// Creates the metrics and registers them in `registry` under `railyard_http_`.
    pub fn register(registry: &MetricsRegistry) -> Arc<Self> {
        let m = Self {
            requests: Family::default(),
            duration: Family::new_with_constructor(latency_histogram),
            open_connections: Gauge::default(),
            accepted: Counter::default(),
            bytes_in: Counter::default(),
            bytes_out: Counter::default(),
            sendfile_bytes: Counter::default(),
            parks: Counter::default(),
        };
        // A poisoned lock only means another thread panicked mid-registration;
        // the registry itself is still usable.
        let mut reg = registry.lock().unwrap_or_else(|p| p.into_inner());
        let r = reg.sub_registry_with_prefix("railyard_http");
        r.register(
            "requests",
            "HTTP requests answered, by route, method and status",
            m.requests.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Time from request head to response head",
            m.duration.clone(),
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
            m.bytes_in.clone(),
        );
        r.register(
            "sent_bytes",
            "Bytes written to client sockets, sendfile included",
            m.bytes_out.clone(),
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
        Arc::new(m)
    }

    /// A fresh registry with only these metrics (tests, single-purpose servers).
    pub fn standalone() -> (MetricsRegistry, Arc<Self>) {
        let reg: MetricsRegistry = Arc::new(Mutex::new(Registry::default()));
        let m = Self::register(&reg);
        (reg, m)
    }

    /// The counter and histogram of one series (looked up once per core and
    /// series, then cached by the connection code).
    pub(crate) fn series(&self, labels: &RequestLabels) -> (Counter, Histogram) {
        (
            self.requests.get_or_create(labels).clone(),
            self.duration.get_or_create(labels).clone(),
        )
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
