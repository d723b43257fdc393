//! The node's saga coordinator: Omega's `TxEventService`, the native
//! `SagaCoordinator` stream and the REST query API on `--saga-port` (8090),
//! on the embedded store (SQLite in `--saga-data-dir`) or PostgreSQL.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context as _;
use railyard_saga::{Coordinator, CoordinatorConfig, MetricsRegistry, StoreChoice};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Saga coordinator options of `railyard node`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SagaArgs {
    /// Port of the saga coordinator (gRPC for Omega and native clients, and
    /// the REST query API under /api); 0 picks a free one.
    #[arg(long, default_value_t = railyard_saga::DEFAULT_GRPC_PORT, env = "RAILYARD_SAGA_PORT")]
    saga_port: u16,
    /// Address the coordinator listens on.
    #[arg(long, default_value = "127.0.0.1")]
    saga_host: IpAddr,
    /// Where saga events are made durable.
    #[arg(long, value_enum, default_value_t = StoreKind::Embedded)]
    saga_store: StoreKind,
    /// Data directory of the embedded store.
    #[arg(long, default_value = "railyard-data/saga")]
    saga_data_dir: PathBuf,
    /// PostgreSQL connection string for `--saga-store postgres`
    /// (e.g. postgres://railyard@127.0.0.1:5432/railyard).
    #[arg(long, env = "RAILYARD_SAGA_POSTGRES_URL", hide_env_values = true)]
    saga_postgres_url: Option<String>,
    /// Do not start the saga coordinator.
    #[arg(long)]
    no_saga: bool,
}

/// The durable store behind the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum StoreKind {
    /// SQLite in WAL mode in `--saga-data-dir`, group-committed (nothing to install).
    Embedded,
    /// PostgreSQL at `--saga-postgres-url`, shared by coordinator nodes.
    Postgres,
}

/// The running coordinator.
pub(crate) struct SagaHandle {
    coordinator: Coordinator,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl SagaHandle {
    /// Closes participant streams, lets in-flight calls finish, and hands
    /// terminal sagas to the store.
    pub(crate) async fn stop(self) {
        let _ = self.stop.send(());
        match self.task.await {
            Ok(()) => tracing::info!("saga coordinator stopped"),
            Err(e) => tracing::error!(error = %e, "saga coordinator task failed"),
        }
        if let Err(e) = self.coordinator.flush().await {
            tracing::warn!(error = %e, "could not compact finished sagas at shutdown; they are recovered and compacted at the next start");
        }
    }
}

/// Opens the store, recovers unfinished sagas and starts serving (unless
/// `--no-saga`). The coordinator's metrics join `registry`.
///
/// # Errors
/// A store that cannot be opened or reached, a port in use.
pub(crate) async fn start(
    args: &SagaArgs,
    config: CoordinatorConfig,
    registry: Option<&MetricsRegistry>,
) -> anyhow::Result<Option<SagaHandle>> {
    if args.no_saga {
        return Ok(None);
    }
    let (choice, what) = match args.saga_store {
        StoreKind::Embedded => (
            StoreChoice::embedded(&args.saga_data_dir),
            format!(
                "opening the saga store in {} (pick another with --saga-data-dir)",
                args.saga_data_dir.display()
            ),
        ),
        StoreKind::Postgres => {
            let url = args.saga_postgres_url.clone().context(
                "--saga-store postgres needs --saga-postgres-url (or RAILYARD_SAGA_POSTGRES_URL)",
            )?;
            (
                StoreChoice::postgres(url),
                "connecting the saga store to PostgreSQL".to_owned(),
            )
        }
    };
    let store = choice.open().await.context(what)?;
    let store_name = store.name();
    let coordinator = Coordinator::start(store, config)
        .await
        .context("recovering unfinished sagas from the store")?;
    if let Some(r) = registry {
        coordinator.register_metrics(r);
    }
    let addr = SocketAddr::new(args.saga_host, args.saga_port);
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
        format!("saga coordinator cannot listen on {addr}; pick another --saga-port")
    })?;
    let addr = listener.local_addr().context("reading the saga address")?;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(railyard_saga::serve(coordinator.clone(), listener, async {
        let _ = stopped.await;
    }));
    tracing::info!(%addr, store = store_name, "saga coordinator listening (Omega TxEventService, native SagaCoordinator, REST /api)");
    Ok(Some(SagaHandle {
        coordinator,
        stop,
        task,
    }))
}
