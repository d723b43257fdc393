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
    /// How often to log the bus's counters (0 disables).
    #[arg(long, default_value = "60s", value_parser = crate::bench_cmd::parse_duration)]
    stats_every: Duration,
    #[command(flatten)]
    config: crate::node_config::ConfigArgs,
    #[command(flatten)]
    bridge: crate::bridge_node::BridgeArgs,
}

/// Address of the node's built-in echo service, handy for trying the bus.
const NODE_ECHO: &str = "railyard.node.echo";

pub(crate) async fn run(args: NodeArgs) -> anyhow::Result<()> {
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
    let bridge = crate::bridge_node::start(&bus, &args.bridge, file.bridge).await?;
    let shutdown = shutdown_signal();
    tracing::info!(node = %args.name, echo = NODE_ECHO, "node started; press Ctrl-C to stop");

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
            }
        }
    }
    tracing::info!(node = %args.name, "node stopping");
    if let Some(b) = bridge {
        b.shutdown().await;
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
