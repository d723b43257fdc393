//! Railyard's saga coordinator.
//!
//! Data moves through it like this: a participant reports an event (over
//! Omega's `TxEventService` or the native batched stream); the event is
//! appended to the durable log ([`store`], group-committed with every event
//! arriving at the same time); only then is it applied to its saga's state
//! machine and acknowledged. Aborts and timeouts turn into compensation
//! commands sent down the open stream of a live instance of the service that
//! ran each sub-transaction, in reverse order.
//!
//! Modules:
//! - [`event`]: the event record every layer shares, and its kinds;
//! - [`store`]: the [`SagaStore`] trait (append durably, recover, compact,
//!   query) and its implementations;
//! - `saga`: one saga's state machine (pure; the table is in `docs/saga.md`);
//! - `engine`: the sharded saga table, append-then-apply-then-answer,
//!   timers, recovery, batched `finish`;
//! - `dispatch`: connected participants and their bounded command queues;
//! - `omega`: the `TxEventService` gRPC service;
//! - `native`: the `SagaCoordinator.Session` gRPC service;
//! - [`api`]: the REST query API (axum router);
//! - [`coalesce`]: fewer, larger socket writes on the gRPC connections;
//! - `server`: the port: hyper connections, requests routed by path to the
//!   two gRPC services or the REST API;
//! - `metrics`: Prometheus metrics;
//! - [`config`]: the coordinator's settings, [`CoordinatorConfig`].
//!
//! The entry point is [`Coordinator::start`]; [`serve`] runs both gRPC
//! services (and the REST API) on one listener.

pub mod api;
pub mod coalesce;
pub mod config;
mod dispatch;
mod engine;
pub mod event;
pub mod grpc_frame;
mod metrics;
mod native;
mod omega;
mod saga;
mod server;
pub mod store;
mod unary;

use std::future::Future;
use std::sync::Arc;

pub use config::CoordinatorConfig;
pub use dispatch::InstanceInfo;
pub use engine::{validate, InvalidEvent, Outcome, SagaView, SubView};
pub use event::{EventKind, EventRecord};
pub use metrics::{encode as encode_metrics, MetricsRegistry};
pub use native::{from_native, NativeService};
pub use omega::{from_grpc, OmegaService};
pub use saga::{Command, SubState};
pub use store::{
    MemoryStore, PgServer, PgServerError, PostgresConfig, PostgresStore, Retention, SagaQuery,
    SagaState, SagaStore, SagaSummary, SqliteConfig, SqliteStore, StoreChoice, StoreError,
    StoreStats,
};

use railyard_saga_proto::native::saga_coordinator_server::SagaCoordinatorServer;
use railyard_saga_proto::omega::tx_event_service_server::TxEventServiceServer;

/// The default gRPC port of the coordinator (8080 is HTTP, 8081 admin,
/// 7000 the bridge).
pub const DEFAULT_GRPC_PORT: u16 = 8090;

/// The saga coordinator: a cheap handle (an `Arc`). Background tasks (the
/// deadline timer and the batched `finish`) stop when the last handle, and
/// every service built from it, is dropped.
#[derive(Debug, Clone)]
pub struct Coordinator {
    engine: Arc<engine::Engine>,
}

impl Coordinator {
    /// Starts a coordinator on `store`: replays `store.unfinished()`
    /// (in-flight sagas come back, pending compensations and saga timeouts
    /// resume) and starts its background tasks on the current runtime.
    ///
    /// # Errors
    /// [`StoreError`] if the unfinished events cannot be read.
    pub async fn start(
        store: Arc<dyn SagaStore>,
        config: CoordinatorConfig,
    ) -> Result<Self, StoreError> {
        Ok(Self {
            engine: engine::Engine::start(store, config).await?,
        })
    }

    /// Registers the coordinator's metrics in a shared registry (the node's,
    /// served on the admin port). Call once per registry.
    pub fn register_metrics(&self, registry: &MetricsRegistry) {
        self.engine.metrics.register(registry);
    }

    /// The Omega `TxEventService` as a tonic service.
    pub fn omega_service(&self) -> TxEventServiceServer<OmegaService> {
        TxEventServiceServer::new(OmegaService {
            engine: self.engine.clone(),
        })
        .max_decoding_message_size(unary::MAX_MESSAGE)
    }

    /// The native `SagaCoordinator` as a tonic service.
    pub fn native_service(&self) -> SagaCoordinatorServer<NativeService> {
        SagaCoordinatorServer::new(NativeService {
            engine: self.engine.clone(),
        })
        .max_decoding_message_size(railyard_saga_proto::MAX_NATIVE_FRAME_BYTES)
    }

    /// Records events and answers each (the path both gRPC services use);
    /// for embedding the coordinator without gRPC.
    ///
    /// # Errors
    /// [`StoreError`] if the append failed: nothing was applied, nothing
    /// may be acknowledged.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped mid-append, the events may be durable but
    /// stay unapplied until a restart replays them. Run it to completion
    /// (e.g. on a task of its own).
    pub async fn submit(&self, events: Vec<EventRecord>) -> Result<Vec<Outcome>, StoreError> {
        self.engine.handle(events, "embedded").await
    }

    /// Registers a participant reached through a channel instead of gRPC
    /// (embedding, tests): commands for `service` arrive on the returned
    /// receiver (capacity `capacity`). Dropping the receiver unregisters it
    /// at the next command.
    pub fn connect_local(
        &self,
        service: &str,
        instance: &str,
        capacity: usize,
    ) -> tokio::sync::mpsc::Receiver<Result<railyard_saga_proto::native::ServerFrame, tonic::Status>>
    {
        let (tx, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        self.engine
            .registry
            .register(service, instance, None, dispatch::Outbound::Native(tx, 0));
        self.engine
            .metrics
            .instances
            .set(self.engine.registry.len() as i64);
        self.engine.instance_arrived(service);
        rx
    }

    /// A live saga (in memory), with its sub-transactions.
    pub fn saga(&self, global_tx_id: &str) -> Option<SagaView> {
        self.engine.live_view(global_tx_id)
    }

    /// The state of a saga: live, or recently finished (remembered in
    /// memory). `None` if neither (ask the store's `finished` query).
    pub fn state(&self, global_tx_id: &str) -> Option<SagaState> {
        self.engine
            .live_view(global_tx_id)
            .map(|v| v.summary.state)
            .or_else(|| self.engine.finished_summary(global_tx_id).map(|s| s.state))
    }

    /// Connected participant instances.
    pub fn instances(&self) -> Vec<InstanceInfo> {
        self.engine.registry.instances()
    }

    /// The store behind the coordinator.
    pub fn store(&self) -> &Arc<dyn SagaStore> {
        &self.engine.store
    }

    /// Hands every terminal saga queued so far to `store.finish` now
    /// (normally batched in the background). For tests and shutdown.
    ///
    /// # Errors
    /// [`StoreError`] from `finish`.
    pub async fn flush(&self) -> Result<(), StoreError> {
        self.engine.flush().await
    }
}

/// Serves Omega's `TxEventService`, the native `SagaCoordinator` and, over
/// HTTP/1.1 or HTTP/2 on the same port, the REST query API ([`api::router`])
/// on `listener` until `shutdown` resolves. Then participant streams
/// (`OnConnected`, `Session`) are closed, the listener is dropped, in-flight
/// calls finish, and the function returns once every connection has closed;
/// the coordinator stays usable (e.g. to `flush`), but streams opened on it
/// afterwards close at once: serve a coordinator once. Accept errors (such
/// as running out of file descriptors) are logged and retried, so this
/// returns only after `shutdown`. How the port is served: `server.rs`.
pub async fn serve(
    coordinator: Coordinator,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) {
    let routes = server::Routes::new(&coordinator);
    let engine = coordinator.engine.clone();
    // Participant streams never end on their own: close them so the
    // graceful stop can complete.
    server::run(routes, listener, shutdown, move || engine.close_streams()).await;
}
