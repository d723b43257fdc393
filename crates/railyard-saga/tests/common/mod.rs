//! Shared test set-up: a coordinator on a `MemoryStore` served over real
//! tonic on a free loopback port, and helpers to build Omega events.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use railyard_saga::{
    Coordinator, CoordinatorConfig, EventRecord, MemoryStore, SagaQuery, SagaState, SagaStore,
    SagaSummary, StoreError, StoreStats,
};
use railyard_saga_proto::omega::tx_event_service_client::TxEventServiceClient;
use railyard_saga_proto::omega::{GrpcCompensateCommand, GrpcServiceConfig, GrpcTxEvent};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

pub struct Server {
    pub addr: SocketAddr,
    pub coordinator: Coordinator,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Server {
    pub async fn start(store: Arc<dyn SagaStore>, config: CoordinatorConfig) -> Self {
        let coordinator = Coordinator::start(store, config)
            .await
            .expect("coordinator starts");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, rx) = oneshot::channel::<()>();
        let c = coordinator.clone();
        let task = tokio::spawn(async move {
            railyard_saga::serve(c, listener, async {
                let _ = rx.await;
            })
            .await
        });
        Self {
            addr,
            coordinator,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub async fn memory(config: CoordinatorConfig) -> (Self, Arc<MemoryStore>) {
        let store = Arc::new(MemoryStore::new());
        (Self::start(store.clone(), config).await, store)
    }

    pub async fn omega(&self) -> TxEventServiceClient<Channel> {
        TxEventServiceClient::connect(format!("http://{}", self.addr))
            .await
            .expect("connect")
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }

    /// Signals the stop and hands back the serving task, to watch it end.
    pub fn signal_stop(&mut self) -> JoinHandle<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.take().expect("the server is serving")
    }

    /// Waits (bounded) until `n` instances are registered.
    pub async fn wait_instances(&self, n: usize) {
        for _ in 0..500 {
            if self.coordinator.instances().len() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "instances never registered: {:?}",
            self.coordinator.instances()
        );
    }

    /// Waits (bounded) until the saga is in `state`.
    pub async fn wait_state(&self, gid: &str, state: SagaState) {
        for _ in 0..1000 {
            if self.coordinator.state(gid) == Some(state) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "saga {gid} never reached {state:?}; it is {:?}",
            self.coordinator.state(gid)
        );
    }
}

/// An Omega instance's `OnConnected` stream: commands arrive on `commands`.
pub struct OmegaInstance {
    pub commands: tonic::Streaming<GrpcCompensateCommand>,
    // Keeps the request stream open, as Omega does.
    _keep: mpsc::Sender<GrpcServiceConfig>,
}

impl OmegaInstance {
    pub async fn connect(
        client: &mut TxEventServiceClient<Channel>,
        service: &str,
        instance: &str,
    ) -> Self {
        let (tx, rx) = mpsc::channel(4);
        tx.send(GrpcServiceConfig {
            service_name: service.into(),
            instance_id: instance.into(),
        })
        .await
        .expect("queue config");
        let commands = client
            .on_connected(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .expect("OnConnected")
            .into_inner();
        Self {
            commands,
            _keep: tx,
        }
    }

    /// The next command, waiting at most 10 s.
    pub async fn next(&mut self) -> GrpcCompensateCommand {
        tokio::time::timeout(Duration::from_secs(10), self.commands.next())
            .await
            .expect("a command within 10 s")
            .expect("stream open")
            .expect("no error")
    }

    /// Asserts nothing arrives within `d`.
    pub async fn none_within(&mut self, d: Duration) {
        if let Ok(m) = tokio::time::timeout(d, self.commands.next()).await {
            panic!("unexpected command: {m:?}");
        }
    }
}

pub fn ev(kind: &str, gid: &str, lid: &str, service: &str) -> GrpcTxEvent {
    GrpcTxEvent {
        timestamp: 1_700_000_000_000,
        global_tx_id: gid.into(),
        local_tx_id: lid.into(),
        parent_tx_id: String::new(),
        r#type: kind.into(),
        service_name: service.into(),
        instance_id: format!("{service}-1"),
        ..GrpcTxEvent::default()
    }
}

pub fn started(gid: &str, lid: &str, service: &str, payload: &[u8]) -> GrpcTxEvent {
    GrpcTxEvent {
        compensation_method: format!("public void com.example.{service}.undo(java.lang.String)"),
        payloads: payload.to_vec(),
        parent_tx_id: gid.into(),
        ..ev("TxStartedEvent", gid, lid, service)
    }
}

/// Sends one event; returns `aborted`.
pub async fn send(client: &mut TxEventServiceClient<Channel>, e: GrpcTxEvent) -> bool {
    client
        .on_tx_event(e)
        .await
        .expect("ack")
        .into_inner()
        .aborted
}

/// One gRPC call written by hand on an HTTP/2 connection: `body` (raw gRPC
/// bytes) sent to `path` with the end of the request; the answer's
/// `grpc-status` (from the trailers, or the headers of a trailers-only
/// answer) and `grpc-message`.
pub async fn raw_grpc_call(
    send: &mut h2::client::SendRequest<bytes::Bytes>,
    path: &str,
    body: Vec<u8>,
) -> (String, String) {
    let req = http::Request::post(path)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (answer, mut stream) = send.send_request(req, false).unwrap();
    stream.send_data(bytes::Bytes::from(body), true).unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .expect("an answer within 10 s")
        .unwrap();
    assert_eq!(answer.status(), 200);
    let head = answer.headers().clone();
    let mut body = answer.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let trailers = body.trailers().await.unwrap().unwrap_or(head);
    let field = |name: &str| {
        trailers
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    };
    (field("grpc-status"), field("grpc-message"))
}

/// A memory store whose every append first passes `gate`: the gate can
/// fail it (a broken disk) or hold it (to see appends overlap).
pub struct GatedStore {
    pub inner: MemoryStore,
    gate: Box<dyn Fn() -> BoxFuture<'static, Result<(), StoreError>> + Send + Sync>,
    /// The next this many `finish` calls fail (a broken disk).
    pub finish_failures: std::sync::atomic::AtomicU32,
}

impl GatedStore {
    pub fn new(
        gate: impl Fn() -> BoxFuture<'static, Result<(), StoreError>> + Send + Sync + 'static,
    ) -> Self {
        Self {
            inner: MemoryStore::new(),
            gate: Box::new(gate),
            finish_failures: 0.into(),
        }
    }
}

impl SagaStore for GatedStore {
    fn name(&self) -> &'static str {
        "gated"
    }
    fn append(&self, events: Vec<EventRecord>) -> BoxFuture<'_, Result<(), StoreError>> {
        let gate = (self.gate)();
        Box::pin(async move {
            gate.await?;
            self.inner.append(events).await
        })
    }
    fn finish(&self, done: Vec<SagaSummary>) -> BoxFuture<'_, Result<(), StoreError>> {
        use std::sync::atomic::Ordering::SeqCst;
        let fail = self
            .finish_failures
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            return Box::pin(async { Err(StoreError::Unavailable("disk broken".into())) });
        }
        self.inner.finish(done)
    }
    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<EventRecord>, StoreError>> {
        self.inner.unfinished()
    }
    fn finished(&self, q: SagaQuery) -> BoxFuture<'_, Result<Vec<SagaSummary>, StoreError>> {
        self.inner.finished(q)
    }
    fn timeline(&self, g: String) -> BoxFuture<'_, Result<Vec<EventRecord>, StoreError>> {
        self.inner.timeline(g)
    }
    fn stats(&self) -> BoxFuture<'_, Result<StoreStats, StoreError>> {
        self.inner.stats()
    }
}

/// The summaries `store` keeps of sagas that finished in `state`.
pub async fn finished_in(store: &dyn SagaStore, state: SagaState) -> Vec<SagaSummary> {
    store
        .finished(SagaQuery {
            state: Some(state),
            ..SagaQuery::default()
        })
        .await
        .unwrap()
}

/// A store whose second append (the first after a test's set-up call)
/// waits until the returned sender says `true`, counting every append as it
/// arrives (the returned counter).
pub fn second_append_gated() -> (
    Arc<GatedStore>,
    Arc<std::sync::atomic::AtomicUsize>,
    tokio::sync::watch::Sender<bool>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let appends = Arc::new(AtomicUsize::new(0));
    let (open_tx, open_rx) = tokio::sync::watch::channel(false);
    let a = appends.clone();
    let store = Arc::new(GatedStore::new(move || {
        let n = a.fetch_add(1, Ordering::SeqCst);
        let mut o = open_rx.clone();
        Box::pin(async move {
            if n == 1 {
                let _ = o.wait_for(|open| *open).await;
            }
            Ok(())
        })
    }));
    (store, appends, open_tx)
}
