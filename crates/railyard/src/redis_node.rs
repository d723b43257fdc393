//! `railyard node --redis-cluster ...`: seed 002's service (`GET /test`) on
//! the Redis Cluster client.

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

/// Options for the Redis Cluster service.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RedisNodeArgs {
    /// Redis Cluster seed nodes (`host:port,...`); enables the `GET /test` service.
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT,...")]
    redis_cluster: Vec<String>,
    /// Port of the `GET /test` service (on 127.0.0.1).
    #[arg(long, default_value_t = 8080)]
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
}

/// Stops the service when dropped.
pub(crate) struct RedisNode {
    _stop: oneshot::Sender<()>,
}

/// Starts the service if `--redis-cluster` was given.
pub(crate) async fn start(args: &RedisNodeArgs) -> anyhow::Result<Option<RedisNode>> {
    if args.redis_cluster.is_empty() {
        return Ok(None);
    }
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
    let (tx, rx) = oneshot::channel::<()>();
    let svc = TestService::new(client, &args.redis_test_key);
    tokio::spawn(service::run(listener, svc, async move {
        let _ = rx.await;
    }));
    tracing::info!(
        port = args.redis_test_port,
        shards,
        refresh = ?args.redis_refresh.0,
        "redis test service listening"
    );
    Ok(Some(RedisNode { _stop: tx }))
}
