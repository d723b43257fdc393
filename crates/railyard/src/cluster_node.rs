//! `railyard node` cluster options: join an etcd cluster.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use railyard_bus::EventBus;
use railyard_cluster::{ClusterConfig, ClusterNode, EtcdConfig, EtcdManager};

/// Cluster options for `railyard node`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ClusterArgs {
    /// Cluster manager: `none` (a single node) or `etcd`.
    #[arg(long = "cluster", value_enum, default_value_t = Manager::None, env = "RAILYARD_CLUSTER")]
    manager: Manager,
    /// etcd client endpoints, comma-separated (with --cluster etcd).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379",
        env = "RAILYARD_ETCD"
    )]
    etcd: Vec<String>,
    /// Address the cluster transport listens on.
    #[arg(long, default_value = "0.0.0.0", env = "RAILYARD_CLUSTER_BIND")]
    cluster_bind: IpAddr,
    /// Port of the cluster transport (0: any free port).
    #[arg(long, default_value_t = 7200, env = "RAILYARD_CLUSTER_PORT")]
    cluster_port: u16,
    /// Host other nodes dial to reach this one (default: the bind address,
    /// or 127.0.0.1 when binding to all interfaces).
    #[arg(long, env = "RAILYARD_CLUSTER_HOST")]
    cluster_host: Option<IpAddr>,
    /// Cluster name: nodes only talk to nodes of the same cluster.
    #[arg(long, default_value = "railyard", env = "RAILYARD_CLUSTER_NAME")]
    cluster_name: String,
    /// How long a dead node's routes survive (its etcd lease TTL).
    #[arg(long, default_value = "5s", value_parser = crate::bench_cmd::parse_duration)]
    lease_ttl: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Manager {
    /// A single node.
    None,
    /// etcd.
    Etcd,
}

/// Joins `bus` to the configured cluster, if any.
pub(crate) async fn join(
    bus: &EventBus,
    args: &ClusterArgs,
    node_id: &str,
) -> anyhow::Result<Option<ClusterNode>> {
    if args.manager == Manager::None {
        return Ok(None);
    }
    let mut ecfg = EtcdConfig::new(args.etcd.clone());
    ecfg.cluster = args.cluster_name.clone();
    ecfg.lease_ttl = args.lease_ttl;
    let manager = EtcdManager::connect(ecfg).await.with_context(|| {
        format!(
            "connecting to etcd at {} (start one with `railyard dev etcd`, or pass --etcd)",
            args.etcd.join(",")
        )
    })?;
    let listen = SocketAddr::new(args.cluster_bind, args.cluster_port);
    let mut cfg = ClusterConfig::new(node_id, listen);
    cfg.cluster = args.cluster_name.clone();
    let host = args
        .cluster_host
        .unwrap_or(if args.cluster_bind.is_unspecified() {
            IpAddr::from([127, 0, 0, 1])
        } else {
            args.cluster_bind
        });
    // With the port the listener gets (also one the system picks, port 0).
    cfg.advertise_host = Some(host);
    let node = ClusterNode::start(bus.clone(), Arc::new(manager), cfg)
        .await
        .context("joining the cluster")?;
    Ok(Some(node))
}

/// Exports a node's cluster transport counters and view on each scrape
/// (`railyard_cluster_*` on the admin port's `/metrics`).
pub(crate) struct ClusterCollector {
    pub(crate) observer: railyard_cluster::ClusterObserver,
}

impl std::fmt::Debug for ClusterCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterCollector")
    }
}

impl prometheus_client::collector::Collector for ClusterCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        for (name, help, v) in self.observer.counters().all() {
            let c = ConstCounter::new(v.get());
            let name = format!("railyard_cluster_{name}");
            c.encode(encoder.encode_descriptor(&name, help, None, c.metric_type())?)?;
        }
        let view = self.observer.view();
        let gauges = [
            (
                "railyard_cluster_store_connected",
                "1 while the cluster store (etcd) is reachable, 0 while routes are the last known",
                i64::from(view.connected),
            ),
            (
                "railyard_cluster_members",
                "Live members of the cluster, this node included",
                i64::try_from(view.members.len()).unwrap_or(i64::MAX),
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}
