//! `railyard node --redis-cluster ...`: seed 002's service (`GET /test`) on
//! the Redis Cluster client.
//!
//! # Threads
//! The service and its cluster client (the HTTP connections and the
//! per-node connection tasks) run on a runtime of their own, by default one
//! thread (`--redis-threads`): a `/test` request then never hops threads
//! between its HTTP task and the Redis node's connection task, so each step
//! is a task switch on one thread instead of a futex wake-up of another
//! (which is costly on these VMs). Measured at 96 nodes and 5,000 requests/s
//! with refresh every 1 s (docs/benchmarks.md, Seed 002, "Latest: the
//! service on one thread"): about 25 % less CPU per request and a lower
//! p99.9 than on the node's two-worker runtime. The topology refresh keeps
//! its own thread either way.

use std::time::Duration;

use anyhow::Context;
use railyard_redis::service::{self, TestService};
use railyard_redis::{ClusterClient, ReadFrom};
use tokio::sync::oneshot;

/// Parses `off` or a duration such as `1s`, `500ms`.
pub(crate) fn parse_refresh(s: &str) -> Result<Option<Duration>, String> {
    if s == "off" {
        return Ok(None);
    }
    let d = crate::bench_cmd::parse_duration(s)?;
    if d < Duration::from_millis(10) {
        return Err("the refresh period must be at least 10ms (or `off`)".into());
    }
    Ok(Some(d))
}

/// A refresh period or off (a newtype so clap does not read `Option` as "optional").
#[derive(Debug, Clone, Copy)]
pub(crate) struct Refresh(Option<Duration>);

fn parse_refresh_arg(s: &str) -> Result<Refresh, String> {
    parse_refresh(s).map(Refresh)
}

/// The `GET /test` service's default port: not one of the node's other
/// defaults (it once was the HTTP server's 8080, so a node started with
/// `--redis-cluster` and the defaults failed to bind).
const TEST_PORT: u16 = 8088;
const _: () = assert!(
    TEST_PORT != crate::http_node::HTTP_PORT
        && TEST_PORT != crate::http_node::ADMIN_PORT
        && TEST_PORT != railyard_saga::DEFAULT_GRPC_PORT
);

/// Options for the Redis Cluster service.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RedisNodeArgs {
    /// Redis Cluster seed nodes (`host:port,...`); enables the `GET /test` service.
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT,...")]
    redis_cluster: Vec<String>,
    /// Port of the `GET /test` service (on 127.0.0.1).
    #[arg(long, default_value_t = TEST_PORT)]
    redis_test_port: u16,
    /// Key `GET /test` sets and gets.
    #[arg(long, default_value = "test")]
    redis_test_key: String,
    /// Periodic topology refresh: `off` or a period such as `1s`.
    #[arg(long, default_value = "off", value_parser = parse_refresh_arg)]
    redis_refresh: Refresh,
    /// Every Nth periodic round compares whole `CLUSTER NODES` views; the
    /// rounds between compare `CLUSTER INFO` summaries only (1: whole views
    /// every round).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    redis_deep_check_every: u32,
    /// Read from replicas (may be stale).
    #[arg(long)]
    redis_read_replicas: bool,
    /// Threads of the `GET /test` service and its cluster client (1: one
    /// thread, no hand-off between threads within a request; more: a
    /// work-stealing runtime of that many workers, for rates one core cannot
    /// serve).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    redis_threads: u16,
}

/// Stops the service when dropped: its thread ends the runtime (and every
/// connection) on its own; nothing waits for it.
pub(crate) struct RedisNode {
    _stop: oneshot::Sender<()>,
}

/// Starts the service if `--redis-cluster` was given, on a runtime of its
/// own (see the module docs), and returns once it listens.
pub(crate) async fn start(args: &RedisNodeArgs) -> anyhow::Result<Option<RedisNode>> {
    if args.redis_cluster.is_empty() {
        return Ok(None);
    }
    let rt = runtime(args.redis_threads).context("starting the redis service's runtime")?;
    let (ready_tx, ready_rx) = oneshot::channel::<anyhow::Result<()>>();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let args = args.clone();
    std::thread::Builder::new()
        .name("redis-service".into())
        .spawn(move || {
            rt.block_on(async move {
                match listen(&args).await {
                    Ok((listener, svc)) => {
                        let _ = ready_tx.send(Ok(()));
                        service::run(listener, svc, async move {
                            let _ = stop_rx.await;
                        })
                        .await;
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            });
        })
        .context("starting the redis service's thread")?;
    ready_rx
        .await
        .context("the redis service's thread ended before it listened")??;
    Ok(Some(RedisNode { _stop: stop_tx }))
}

/// One thread for `threads == 1`, else a work-stealing runtime.
fn runtime(threads: u16) -> std::io::Result<tokio::runtime::Runtime> {
    if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(usize::from(threads))
            .thread_name("redis-service")
            .enable_all()
            .build()
    }
}

/// Connects the cluster client and binds the service's port (on the
/// service's runtime, so the client's connection tasks live there too).
async fn listen(args: &RedisNodeArgs) -> anyhow::Result<(tokio::net::TcpListener, TestService)> {
    let client = ClusterClient::builder(&args.redis_cluster)
        .refresh_period(args.redis_refresh.0)
        .deep_check_every(args.redis_deep_check_every)
        .read_from(if args.redis_read_replicas {
            ReadFrom::Replica
        } else {
            ReadFrom::Master
        })
        .build()
        .await
        .context("connecting to the Redis Cluster")?;
    let shards = client.table().shards().len();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.redis_test_port))
        .await
        .with_context(|| format!("binding 127.0.0.1:{}", args.redis_test_port))?;
    tracing::info!(
        port = args.redis_test_port,
        shards,
        refresh = ?args.redis_refresh.0,
        threads = args.redis_threads,
        "redis test service listening"
    );
    Ok((listener, TestService::new(client, &args.redis_test_key)))
}
