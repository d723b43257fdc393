//! The node's TCP event-bus bridge: command-line overrides for the
//! `[bridge]` section, and starting it.

use anyhow::Context;
use railyard_bridge::{BridgeConfig, BridgeServer, RunningBridge};
use railyard_bus::EventBus;

/// Bridge options for `railyard node` (override the config file's `[bridge]`).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BridgeArgs {
    /// TCP port of the event-bus bridge (default 7000, Vert.x clients' default; 0 picks one).
    #[arg(long, value_name = "PORT", env = "RAILYARD_BRIDGE_PORT")]
    bridge_port: Option<u16>,
    /// Interface the bridge listens on (default 127.0.0.1).
    #[arg(long, value_name = "HOST")]
    bridge_host: Option<String>,
    /// Do not serve the bridge.
    #[arg(long)]
    no_bridge: bool,
}

/// Starts the bridge unless disabled (the node raised its open-files limit
/// first: every client is a file descriptor).
pub(crate) async fn start(
    bus: &EventBus,
    args: &BridgeArgs,
    mut config: BridgeConfig,
) -> anyhow::Result<Option<RunningBridge>> {
    if args.no_bridge || !config.enabled {
        return Ok(None);
    }
    if let Some(port) = args.bridge_port {
        config.port = port;
    }
    if let Some(host) = &args.bridge_host {
        config.host.clone_from(host);
    }
    let server = BridgeServer::new(bus.clone(), config).context("the [bridge] configuration")?;
    let running = server.start().await.context("starting the bridge")?;
    let c = running.server().config();
    tracing::info!(
        addr = %running.local_addr(),
        inbound_rules = c.inbound_permitted.len(),
        outbound_rules = c.outbound_permitted.len(),
        auth = c.auth_token.is_some(),
        "bridge listening"
    );
    if c.inbound_permitted.is_empty() && c.outbound_permitted.is_empty() {
        tracing::warn!("bridge permits no address: add inbound_permitted / outbound_permitted to [bridge] in --config");
    }
    Ok(Some(running))
}

/// Logs the bridge's counters next to the bus's.
pub(crate) fn log_stats(bridge: Option<&RunningBridge>) {
    if let Some(b) = bridge {
        let m = b.metrics();
        tracing::info!(
            connections = m.connections_open(),
            frames_in = m.frames_in,
            frames_out = m.frames_out,
            requests = m.requests,
            err_frames = m.err_frames,
            outbound_pauses = m.outbound_pauses,
            "bridge counters"
        );
    }
}

/// The bridge's counters on the node's `/metrics`, as
/// `railyard_bridge_<name>_total`, read when scraped.
pub(crate) struct BridgeCollector {
    pub(crate) server: railyard_bridge::BridgeServer,
}

impl std::fmt::Debug for BridgeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BridgeCollector")
    }
}

impl prometheus_client::collector::Collector for BridgeCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let m = self.server.metrics();
        for (name, help, v) in m.all() {
            let c = ConstCounter::new(v);
            let name = format!("railyard_bridge_{name}");
            c.encode(encoder.encode_descriptor(&name, help.trim(), None, c.metric_type())?)?;
        }
        let open = ConstGauge::new(i64::try_from(m.connections_open()).unwrap_or(i64::MAX));
        open.encode(encoder.encode_descriptor(
            "railyard_bridge_connections_open",
            "Bridge connections open now",
            None,
            open.metric_type(),
        )?)?;
        Ok(())
    }
}
