//! `railyard dev ...`: local infrastructure for development and benches.

use std::time::Duration;

use anyhow::{bail, Context};
use railyard_cluster::EtcdServer;
use railyard_redis::double::ClusterDouble;
use railyard_redis::local_cluster::{dev_dir, LocalCluster, MAX_PORT};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum DevCommand {
    /// Start a private etcd on free loopback ports (data in a temporary
    /// directory, removed on exit) and print its endpoint; Ctrl-C stops it.
    Etcd,
    /// Start a local Redis Cluster from Debian's redis-server (`down` stops it).
    RedisCluster(RedisClusterArgs),
    /// Serve the many-port Redis Cluster test double until Ctrl-C.
    RedisDouble(RedisDoubleArgs),
}

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct RedisClusterArgs {
    #[command(subcommand)]
    action: Option<ClusterAction>,
    /// Nodes in all (masters x (1 + replicas)).
    #[arg(long, default_value_t = 6)]
    nodes: usize,
    /// Replicas per master.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// First node port; nodes use base..base+nodes-1, bus ports +10000 (max 22767).
    #[arg(long, default_value_t = 17000)]
    base_port: u16,
    /// Cluster node timeout (failure detection).
    #[arg(long, default_value = "5s", value_parser = crate::bench_cmd::parse_duration)]
    node_timeout: Duration,
    /// How long to wait for every node to agree.
    #[arg(long, default_value = "300s", value_parser = crate::bench_cmd::parse_duration)]
    timeout: Duration,
}

#[derive(Debug, clap::Subcommand)]
enum ClusterAction {
    /// Stop the cluster started on --base-port and remove its files.
    Down {
        /// The base port it was started with.
        #[arg(long, default_value_t = 17000)]
        base_port: u16,
    },
}

#[derive(Debug, clap::Args)]
pub(crate) struct RedisDoubleArgs {
    /// Masters.
    #[arg(long, default_value_t = 500)]
    masters: usize,
    /// Replicas per master.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// First port (default: ports picked by the OS).
    #[arg(long)]
    base_port: Option<u16>,
}

pub(crate) async fn run(cmd: DevCommand) -> anyhow::Result<()> {
    match cmd {
        DevCommand::Etcd => etcd().await,
        DevCommand::RedisCluster(a) => match a.action {
            Some(ClusterAction::Down { base_port }) => down(base_port),
            None => up(&a).await,
        },
        DevCommand::RedisDouble(a) => double(&a).await,
    }
}

/// `railyard dev etcd`: a throwaway etcd for trying a cluster by hand.
async fn etcd() -> anyhow::Result<()> {
    let etcd = tokio::task::spawn_blocking(EtcdServer::start)
        .await?
        .context("starting etcd")?;
    println!("etcd is up at {}", etcd.endpoint());
    println!(
        "join nodes with: railyard node --cluster etcd --etcd {} --name <unique name> --cluster-port <free port>",
        etcd.endpoint()
    );
    println!(
        "data and log: {} (removed on exit); Ctrl-C to stop",
        etcd.dir().display()
    );
    tokio::signal::ctrl_c().await?;
    drop(etcd);
    Ok(())
}

/// Splits `nodes` into masters, checking the layout.
pub(crate) fn masters_for(nodes: usize, replicas: usize) -> anyhow::Result<usize> {
    if nodes % (1 + replicas) != 0 {
        bail!(
            "--nodes {nodes} is not a multiple of 1 + --replicas ({})",
            1 + replicas
        );
    }
    let masters = nodes / (1 + replicas);
    if masters < 3 {
        bail!("a Redis Cluster needs at least 3 masters; --nodes {nodes} --replicas {replicas} gives {masters}");
    }
    Ok(masters)
}

async fn up(a: &RedisClusterArgs) -> anyhow::Result<()> {
    let masters = masters_for(a.nodes, a.replicas)?;
    if usize::from(a.base_port) + a.nodes - 1 > usize::from(MAX_PORT) {
        bail!("--base-port {} with {} nodes exceeds port {MAX_PORT} (bus ports would enter the ephemeral range)", a.base_port, a.nodes);
    }
    let dir = dev_dir(a.base_port);
    if dir.join("ports").exists() {
        bail!(
            "a cluster already runs on base port {} ({}); stop it with `railyard dev redis-cluster down --base-port {}`",
            a.base_port,
            dir.display(),
            a.base_port
        );
    }
    let pb = crate::bench_cmd::spinner(format!(
        "starting {} nodes ({masters} masters, {} replicas each) and waiting until they agree...",
        a.nodes, a.replicas
    ));
    let started = std::time::Instant::now();
    let r = LocalCluster::start(
        &dir,
        masters,
        a.replicas,
        a.base_port,
        a.node_timeout,
        a.timeout,
        false,
    )
    .await;
    pb.finish_and_clear();
    let cluster = match r {
        Ok(c) => c,
        Err(e) => {
            // Leave nothing half-started behind.
            if let Ok(mut c) = LocalCluster::adopt(&dir) {
                c.down();
            } else {
                let mut c = LocalCluster::adopt_ports(&dir, a.base_port, a.nodes);
                c.down();
            }
            return Err(e).context("starting the local redis cluster");
        }
    };
    println!(
        "redis cluster up in {:.0?}: {} nodes on 127.0.0.1:{}-{} (files in {})",
        started.elapsed(),
        a.nodes,
        a.base_port,
        usize::from(a.base_port) + a.nodes - 1,
        cluster.dir().display()
    );
    println!("seeds: {}", cluster.addrs()[..3].join(","));
    println!(
        "stop it with: railyard dev redis-cluster down --base-port {}",
        a.base_port
    );
    Ok(())
}

fn down(base_port: u16) -> anyhow::Result<()> {
    let dir = dev_dir(base_port);
    let mut c = LocalCluster::adopt(&dir).with_context(|| {
        format!("no cluster found for base port {base_port}; was it started with --base-port {base_port}?")
    })?;
    let n = c.ports().len();
    c.down();
    println!("stopped {n} redis nodes and removed {}", dir.display());
    Ok(())
}

async fn double(a: &RedisDoubleArgs) -> anyhow::Result<()> {
    let d = ClusterDouble::start(a.masters, a.replicas, a.base_port)
        .await
        .context("binding the double's ports")?;
    let addrs = d.addrs();
    println!(
        "redis cluster double: {} nodes ({} masters), seeds {}",
        addrs.len(),
        a.masters,
        addrs[..3.min(addrs.len())].join(",")
    );
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    Ok(())
}
