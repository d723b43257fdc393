//! The node's HTTP side: seed 004's app on `--http-port` (8080) and the admin
//! server with `GET /metrics` on `--admin-port` (8081), the bus's counters
//! included.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use railyard_bus::{EventBus, FailureKind};
use railyard_http::c10k::{self, C10kOptions};
use railyard_http::{admin_router, bind, HttpConfig, HttpMetrics, MetricsRegistry, Server};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::bench_cmd::parse_duration;

/// The HTTP server's default port.
pub(crate) const HTTP_PORT: u16 = 8080;
/// The admin server's default port.
pub(crate) const ADMIN_PORT: u16 = 8081;

/// HTTP options of `railyard node`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct HttpArgs {
    /// Port of the HTTP server (seed 004's routes); 0 picks a free one.
    #[arg(long, default_value_t = HTTP_PORT, env = "RAILYARD_HTTP_PORT")]
    http_port: u16,
    /// Port of the admin server (GET /metrics); 0 picks a free one.
    #[arg(long, default_value_t = ADMIN_PORT, env = "RAILYARD_ADMIN_PORT")]
    admin_port: u16,
    /// Address both servers listen on.
    #[arg(long, default_value = "127.0.0.1")]
    http_host: IpAddr,
    /// HTTP event-loop threads, one SO_REUSEPORT listener each (default: one per core).
    #[arg(long)]
    http_threads: Option<usize>,
    /// Connections served at once, over all threads.
    #[arg(long, default_value_t = 100_000)]
    max_connections: usize,
    /// Time a client has to send a request head (also the keep-alive idle timeout).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    header_read_timeout: Duration,
    /// Time a handler has to answer before 408.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    request_timeout: Duration,
    /// On SIGTERM, how long in-flight requests get to finish.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    shutdown_deadline: Duration,
    /// Largest upload in bytes (POST /upload); larger gets 413.
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    max_upload_bytes: u64,
    /// Directory for the send file and uploads (default: railyard-http in the temp dir).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// File served at /sendFile/test (default: test in the data dir, created if missing).
    #[arg(long)]
    send_file: Option<PathBuf>,
    /// Keep hyper's state (about 10 KiB) on idle keep-alive connections
    /// instead of parking them between requests (for comparison).
    #[arg(long)]
    no_park_idle: bool,
    /// Let hyper answer every request, fixed bodies included, instead of
    /// the fixed lane (for comparison; same bytes, more CPU).
    #[arg(long)]
    no_fixed_lane: bool,
    /// Do not start the HTTP and admin servers.
    #[arg(long)]
    no_http: bool,
}

/// The running servers.
pub(crate) struct HttpHandle {
    stop: Vec<oneshot::Sender<()>>,
    tasks: Vec<(
        &'static str,
        JoinHandle<Result<railyard_http::ShutdownReport, railyard_http::HttpError>>,
    )>,
}

impl HttpHandle {
    /// Drains both servers (in-flight requests finish within the deadline).
    pub(crate) async fn stop(self) {
        for s in self.stop {
            let _ = s.send(());
        }
        for (name, t) in self.tasks {
            match t.await {
                Ok(Ok(r)) if r.aborted_connections > 0 => tracing::warn!(
                    server = name,
                    aborted = r.aborted_connections,
                    "connections dropped at the shutdown deadline"
                ),
                Ok(Ok(_)) => tracing::info!(server = name, "http server stopped"),
                Ok(Err(e)) => tracing::error!(server = name, error = %e, "http server failed"),
                Err(e) => tracing::error!(server = name, error = %e, "http server task failed"),
            }
        }
    }
}

/// Starts the HTTP and admin servers (unless `--no-http`).
///
/// # Errors
/// A port in use, a data directory that cannot be written.
/// `registry` is the node's: other subsystems (the saga coordinator) add
/// their metrics to it, and the admin port serves it.
pub(crate) async fn start(
    args: &HttpArgs,
    bus: &EventBus,
    registry: MetricsRegistry,
) -> anyhow::Result<Option<HttpHandle>> {
    if args.no_http {
        return Ok(None);
    }
    let config = HttpConfig {
        threads: args.http_threads.unwrap_or(0),
        max_connections: args.max_connections,
        header_read_timeout: args.header_read_timeout,
        request_timeout: args.request_timeout,
        shutdown_deadline: args.shutdown_deadline,
        max_body_bytes: args.max_upload_bytes,
        park_idle_connections: !args.no_park_idle,
        fixed_lane: !args.no_fixed_lane,
        ..HttpConfig::default()
    };
    config.validate().context("HTTP options")?;
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("railyard-http"));
    let mut opts = C10kOptions::in_dir(&data_dir);
    if let Some(f) = &args.send_file {
        opts.send_file = f.clone();
    }
    opts.max_upload_bytes = args.max_upload_bytes;
    opts.compress_min_bytes = config.compress_min_bytes;
    let app = {
        let opts = opts.clone();
        tokio::task::spawn_blocking(move || c10k::app(&opts))
            .await
            .context("building the HTTP app")?
            .with_context(|| format!("preparing the HTTP data directory {}", data_dir.display()))?
    };

    let metrics = HttpMetrics::register(&registry);
    registry
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .register_collector(Box::new(BusCollector { bus: bus.clone() }));

    let http_addr = SocketAddr::new(args.http_host, args.http_port);
    let listeners = bind(http_addr, config.effective_threads(), &config)?;
    let http_addr = listeners[0]
        .local_addr()
        .context("reading the HTTP address")?;
    let admin_config = HttpConfig {
        threads: 1,
        ..config.clone()
    };
    let admin_listeners = bind(
        SocketAddr::new(args.http_host, args.admin_port),
        1,
        &admin_config,
    )?;
    let admin_addr = admin_listeners[0]
        .local_addr()
        .context("reading the admin address")?;
    let threads = listeners.len();

    let (admin_metrics_registry, admin_metrics) = HttpMetrics::standalone();
    drop(admin_metrics_registry); // the admin port's own traffic is not the node's
    let server = Server::new(app, config, metrics)?;
    let admin = Server::new(admin_router(registry), admin_config, admin_metrics)?;
    let (stop_http, rx_http) = oneshot::channel::<()>();
    let (stop_admin, rx_admin) = oneshot::channel::<()>();
    let http_task = tokio::spawn(server.run(listeners, async {
        let _ = rx_http.await;
    }));
    let admin_task = tokio::spawn(admin.run(admin_listeners, async {
        let _ = rx_admin.await;
    }));
    tracing::info!(
        http = %http_addr,
        admin = %admin_addr,
        threads,
        send_file = %opts.send_file.display(),
        // Without cachestat (a kernel before 6.5), a cold file window is
        // read by sendfile on the event loop.
        cold_file_reads_off_loop = railyard_http::cachestat_available(),
        "http server listening"
    );
    Ok(Some(HttpHandle {
        stop: vec![stop_http, stop_admin],
        tasks: vec![("http", http_task), ("admin", admin_task)],
    }))
}

/// Exports the bus's [`railyard_bus::MetricsSnapshot`] on each scrape.
struct BusCollector {
    bus: EventBus,
}

impl fmt::Debug for BusCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BusCollector")
    }
}

impl prometheus_client::collector::Collector for BusCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let m = self.bus.metrics();
        let counters = [
            (
                "railyard_bus_sent",
                "Point-to-point messages sent (send and request)",
                m.sent,
            ),
            ("railyard_bus_published", "Messages published", m.published),
            ("railyard_bus_requests", "Requests started", m.requests),
            (
                "railyard_bus_undeliverable",
                "Messages refused before reaching any buffer",
                m.undeliverable,
            ),
            (
                "railyard_bus_received",
                "Messages accepted by consumers",
                m.received(),
            ),
            (
                "railyard_bus_delivered",
                "Messages handed to handlers or streams",
                m.delivered(),
            ),
            (
                "railyard_bus_discarded",
                "Messages discarded or refused for a full buffer",
                m.discarded(),
            ),
        ];
        for (name, help, v) in counters {
            let c = ConstCounter::new(v);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let gauges = [
            (
                "railyard_bus_pending_replies",
                "Requests waiting for a reply",
                m.pending_replies,
            ),
            (
                "railyard_bus_pending",
                "Messages waiting in consumer buffers",
                m.pending(),
            ),
            (
                "railyard_bus_consumers",
                "Consumers registered",
                m.registered_consumers,
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        let c = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "railyard_bus_reply_failures",
            "Requests that failed, by failure kind",
            None,
            c.metric_type(),
        )?;
        for kind in FailureKind::ALL {
            let c = ConstCounter::new(m.reply_failures(kind));
            c.encode(family.encode_family(&[("kind", kind.as_str())])?)?;
        }
        Ok(())
    }
}
