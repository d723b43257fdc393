//! The coordinator under test, started in-process on a runtime of its own
//! (so the load generator's threads and the coordinator's are apart), with
//! the store the run asks for.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use railyard_saga::{
    serve, Coordinator, CoordinatorConfig, MemoryStore, PgServer, SagaStore, StoreChoice,
};

/// Which store backs the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// The embedded durable store (SQLite) in a throwaway data directory.
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
    /// The throwaway PostgreSQL.
    #[error("starting a throwaway PostgreSQL for the bench: {0}")]
    Postgres(#[from] railyard_saga::PgServerError),
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
    /// Stopped after the coordinator (its drop waits for the server to exit).
    postgres: Option<PgServer>,
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
        // Stops the server (blocking briefly): only reached when `stop`
        // was not called, e.g. on a panic.
        drop(self.postgres.take());
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
        let data_dir = (store == StoreKind::Embedded).then(|| {
            std::env::temp_dir().join(format!(
                "railyard-bench-saga-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos())
            ))
        });
        let postgres = if store == StoreKind::Postgres {
            // initdb and the server's start block for seconds.
            Some(
                tokio::task::spawn_blocking(PgServer::start)
                    .await
                    .map_err(|e| ServerError::Io(std::io::Error::other(e)))??,
            )
        } else {
            None
        };
        let choice = match (&data_dir, &postgres) {
            (Some(dir), _) => Some(StoreChoice::embedded(dir.clone())),
            (None, Some(pg)) => Some(StoreChoice::postgres(pg.url())),
            (None, None) => None,
        };
        // The store opens on the coordinator's runtime: its driver tasks
        // (PostgreSQL connections) must live there, not on the caller's.
        let started = rt
            .spawn(async move {
                let store: Arc<dyn SagaStore> = match choice {
                    None => Arc::new(MemoryStore::new()),
                    Some(choice) => choice.open().await.map_err(|e| ServerError::Store {
                        store: store.as_str(),
                        reason: e.to_string(),
                    })?,
                };
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let port = listener.local_addr()?.port();
                let coordinator = Coordinator::start(store, CoordinatorConfig::default())
                    .await
                    .map_err(|e| ServerError::Store {
                        store: "memory",
                        reason: e.to_string(),
                    })?;
                tokio::spawn(serve(coordinator, listener, std::future::pending()));
                Ok::<_, ServerError>(port)
            })
            .await;
        let mut me = Self {
            endpoint: String::new(),
            rt: Some(rt),
            data_dir,
            postgres,
        };
        match started {
            Ok(Ok(port)) => {
                me.endpoint = format!("http://127.0.0.1:{port}");
                Ok(me)
            }
            Ok(Err(e)) => {
                me.stop().await;
                Err(e)
            }
            Err(e) => {
                me.stop().await;
                Err(ServerError::Io(std::io::Error::other(e)))
            }
        }
    }

    /// Stops it off the async threads (the runtime's shutdown and the data
    /// directory's removal block).
    pub async fn stop(mut self) {
        let rt = self.rt.take();
        let dir = self.data_dir.take();
        let pg = self.postgres.take();
        let _ = tokio::task::spawn_blocking(move || {
            if let Some(rt) = rt {
                rt.shutdown_timeout(Duration::from_secs(2));
            }
            drop(pg);
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
