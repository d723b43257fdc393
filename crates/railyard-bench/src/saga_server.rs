//! The coordinator under test, started in-process on a runtime of its own
//! (so the load generator's threads and the coordinator's are apart), with
//! the store the run asks for.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use railyard_saga::{serve, Coordinator, CoordinatorConfig, MemoryStore, SagaStore};

/// Which store backs the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// The embedded durable store in a throwaway data directory.
    Embedded,
    /// A throwaway PostgreSQL started for the run.
    Postgres,
    /// The in-memory reference store (not durable; for comparison only).
    Memory,
}

impl StoreKind {
    /// `embedded`, `postgres` or `memory`.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreKind::Embedded => "embedded",
            StoreKind::Postgres => "postgres",
            StoreKind::Memory => "memory",
        }
    }
}

/// Why the coordinator could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Its runtime or listener.
    #[error("starting the coordinator: {0}")]
    Io(#[from] std::io::Error),
    /// Its store.
    #[error("opening the {store} store: {reason}")]
    Store {
        /// Which.
        store: &'static str,
        /// Why.
        reason: String,
    },
}

/// A running in-process coordinator; stopped (runtime dropped, data
/// directory removed) on drop.
pub struct CoordinatorUnderTest {
    endpoint: String,
    rt: Option<tokio::runtime::Runtime>,
    data_dir: Option<PathBuf>,
}

impl std::fmt::Debug for CoordinatorUnderTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorUnderTest")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl Drop for CoordinatorUnderTest {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        if let Some(d) = self.data_dir.take() {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

impl CoordinatorUnderTest {
    /// Starts a coordinator with `store` on `threads` worker threads,
    /// listening on a free loopback port.
    ///
    /// # Errors
    /// [`ServerError`] if the runtime, the listener or the store fail.
    pub async fn start(store: StoreKind, threads: usize) -> Result<Self, ServerError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("saga-coordinator")
            .enable_all()
            .build()?;
        let started = rt
            .spawn(async move {
                let store: Arc<dyn SagaStore> = match store {
                    StoreKind::Memory => Arc::new(MemoryStore::new()),
                    StoreKind::Embedded | StoreKind::Postgres => {
                        return Err(ServerError::Store {
                            store: store.as_str(),
                            reason: "not in this build yet".into(),
                        })
                    }
                };
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let port = listener.local_addr()?.port();
                let coordinator = Coordinator::start(store, CoordinatorConfig::default())
                    .await
                    .map_err(|e| ServerError::Store {
                        store: "memory",
                        reason: e.to_string(),
                    })?;
                tokio::spawn(async move {
                    if let Err(e) = serve(coordinator, listener, std::future::pending()).await {
                        tracing::error!(error = %e, "bench coordinator stopped");
                    }
                });
                Ok::<_, ServerError>(port)
            })
            .await;
        let port = match started {
            Ok(Ok(port)) => port,
            Ok(Err(e)) => {
                rt.shutdown_background();
                return Err(e);
            }
            Err(e) => {
                rt.shutdown_background();
                return Err(ServerError::Io(std::io::Error::other(e)));
            }
        };
        Ok(Self {
            endpoint: format!("http://127.0.0.1:{port}"),
            rt: Some(rt),
            data_dir: None,
        })
    }

    /// Stops it off the async threads (the runtime's shutdown and the data
    /// directory's removal block).
    pub async fn stop(mut self) {
        let rt = self.rt.take();
        let dir = self.data_dir.take();
        let _ = tokio::task::spawn_blocking(move || {
            if let Some(rt) = rt {
                rt.shutdown_timeout(Duration::from_secs(2));
            }
            if let Some(d) = dir {
                let _ = std::fs::remove_dir_all(d);
            }
        })
        .await;
    }

    /// Where it listens, e.g. `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}
