//! `railyard node`: host what exists on embedded defaults.

use std::time::Duration;

use anyhow::Context;
use railyard_bus::EventBus;

/// Options for `railyard node`.
#[derive(Debug, clap::Args)]
pub(crate) struct NodeArgs {
    /// Node name, used in logs.
    #[arg(long, default_value = "railyard-1", env = "RAILYARD_NODE_NAME")]
    name: String,
    /// How often to log the counters of the bus, the bridge and the cluster (0 disables).
    #[arg(long, default_value = "60s", value_parser = crate::bench_cmd::parse_duration)]
    stats_every: Duration,
    #[command(flatten)]
    cluster: crate::cluster_node::ClusterArgs,
    #[command(flatten)]
    config: crate::node_config::ConfigArgs,
    #[command(flatten)]
    bridge: crate::bridge_node::BridgeArgs,
    #[command(flatten)]
    http: crate::http_node::HttpArgs,
    #[command(flatten)]
    redis: crate::redis_node::RedisNodeArgs,
    #[command(flatten)]
    saga: crate::saga_node::SagaArgs,
}

/// Address of the node's built-in echo service, handy for trying the bus.
const NODE_ECHO: &str = "railyard.node.echo";
/// Address of the node's built-in info service: replies with the node's name
/// (a string), so a client can see which node answered.
const NODE_INFO: &str = "railyard.node.info";

/// Raises the open-files soft limit to the hard one: every bridge client
/// and HTTP connection is a file descriptor (10,000 connections need more
/// than Debian's default 1,024), whichever servers this node runs.
fn raise_open_files_limit() {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => tracing::debug!(limit = n, "open-files limit"),
        Err(e) => {
            tracing::warn!(error = %e, "cannot raise the open-files limit; servers may refuse connections early (raise it with `ulimit -n`)")
        }
    }
}

pub(crate) async fn run(args: NodeArgs) -> anyhow::Result<()> {
    raise_open_files_limit();
    let file = args.config.load().await?;
    let bus = EventBus::new();
    let _echo = bus
        .consumer(NODE_ECHO)
        .handler(|mut m| async move {
            let body = m.take_body();
            let _ = m.reply(body);
        })
        .await
        .context("registering the node's echo service")?;
    let name = args.name.clone();
    let _info = bus
        .consumer(NODE_INFO)
        .handler(move |mut m| {
            let _ = m.reply(name.clone());
            std::future::ready(())
        })
        .await
        .context("registering the node's info service")?;
    let cluster = crate::cluster_node::join(&bus, &args.cluster, &args.name).await?;
    let bridge = crate::bridge_node::start(&bus, &args.bridge, file.bridge).await?;
    let registry: railyard_http::MetricsRegistry = Default::default();
    if let Some(c) = &cluster {
        registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .register_collector(Box::new(crate::cluster_node::ClusterCollector {
                observer: c.observer(),
            }));
    }
    if let Some(b) = &bridge {
        registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .register_collector(Box::new(crate::bridge_node::BridgeCollector {
                server: b.server().clone(),
            }));
    }
    let saga = crate::saga_node::start(&args.saga, file.saga, Some(&registry)).await?;
    let http = crate::http_node::start(&args.http, &bus, registry).await?;
    let _redis = crate::redis_node::start(&args.redis).await?;
    let shutdown = shutdown_signal();
    tracing::info!(node = %args.name, echo = NODE_ECHO, clustered = cluster.is_some(), http = http.is_some(), saga = saga.is_some(), "node started; press Ctrl-C to stop");

    let mut ticker = (!args.stats_every.is_zero()).then(|| tokio::time::interval(args.stats_every));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = async { ticker.as_mut().expect("guarded").tick().await }, if ticker.is_some() => {
                let m = bus.metrics();
                tracing::info!(
                    sent = m.sent, published = m.published, delivered = m.delivered(),
                    pending = m.pending(), pending_replies = m.pending_replies,
                    consumers = m.registered_consumers, "bus counters"
                );
                crate::bridge_node::log_stats(bridge.as_ref());
                if let Some(c) = &cluster {
                    let k = c.counters();
                    let view = c.view();
                    tracing::info!(
                        members = view.members.len(), store_connected = view.connected,
                        frames_out = k.frames_out.get(), frames_in = k.frames_in.get(),
                        connects = k.connects.get(), disconnects = k.disconnects.get(),
                        failed_on_loss = k.failed_on_loss.get(), malformed = k.malformed.get(),
                        link_full = k.link_full.get(), store_outages = k.store_outages.get(),
                        encode_failures = k.encode_failures.get(),
                        stale_answers = k.stale_answers.get(), unsent_failed = k.unsent_failed.get(),
                        answer_pauses = k.answer_pauses.get(),
                        "cluster counters"
                    );
                }
            }
        }
    }
    tracing::info!(node = %args.name, "node stopping");
    if let Some(http) = http {
        http.stop().await;
    }
    if let Some(b) = bridge {
        b.shutdown().await;
    }
    if let Some(s) = saga {
        s.stop().await;
    }
    if let Some(c) = cluster {
        if let Err(e) = c.leave().await {
            tracing::warn!(error = %e, "could not deregister from the cluster; the lease will expire");
        }
    }
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM. The SIGTERM handler is installed when
/// this is called, not when first polled, so a signal sent right after the
/// node says it started is never taken by the default action.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term = match term {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the node");
                    let _ = ctrl_c.await;
                    return;
                }
            };
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = ctrl_c.await;
        }
    }
}
