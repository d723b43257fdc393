//! `railyard dev ...`: helpers for trying Railyard by hand.

use anyhow::Context;
use railyard_cluster::EtcdServer;

/// Developer helpers.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum DevCommand {
    /// Start a private etcd on free loopback ports (data in a temporary
    /// directory, removed on exit) and print its endpoint; Ctrl-C stops it.
    Etcd,
}

pub(crate) async fn run(cmd: DevCommand) -> anyhow::Result<()> {
    match cmd {
        DevCommand::Etcd => {
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
    }
}
