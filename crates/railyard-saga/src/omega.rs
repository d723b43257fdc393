//! ServiceComb Pack's `TxEventService`, as Omega 0.7.x calls it.
//!
//! - `OnConnected`: Omega sends its `GrpcServiceConfig` once and keeps the
//!   stream open. The response stream is returned at once; a task reads the
//!   config, registers the instance and unregisters it when the stream ends.
//!   Commands for the instance are queued on a bounded queue
//!   (`omega_queue`); when it is full the command goes to another instance
//!   or waits (see `dispatch`). Registration may arrive after the
//!   instance's first events: a compensation for a service with no instance
//!   waits for one (bounded by `instance_wait`) instead of being lost.
//! - `OnTxEvent`: validated (malformed -> `INVALID_ARGUMENT`), appended
//!   durably, applied, then acknowledged with `aborted`. A store failure
//!   answers `UNAVAILABLE`, never an ack.
//! - `OnDisconnected`: unregisters that instance's links from the caller's
//!   address (instance ids are not unique across processes).
//! - `onGetServerMeta`: `AkkaEnabled` is `true` unless configured (Omega
//!   then reports `TxCompensateAck*Event`, a failed compensation included);
//!   both that and `TxCompensatedEvent` are accepted either way.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use railyard_saga_proto::omega::tx_event_service_server::TxEventService;
use railyard_saga_proto::omega::{
    GrpcAck, GrpcCompensateCommand, GrpcServiceConfig, GrpcTxEvent, ServerMeta,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use crate::dispatch::Outbound;
use crate::engine::{Engine, InvalidEvent, Outcome};
use crate::event::{EventKind, EventRecord};
use crate::metrics::ProtocolLabels;

/// The `TxEventService` implementation; build it with
/// [`Coordinator::omega_service`](crate::Coordinator::omega_service).
#[derive(Debug, Clone)]
pub struct OmegaService {
    pub(crate) engine: Arc<Engine>,
}

/// Converts Omega's event into the record kept by the store.
///
/// # Errors
/// [`InvalidEvent::UnknownType`] for a `type` string that names no event.
pub fn from_grpc(e: GrpcTxEvent) -> Result<EventRecord, InvalidEvent> {
    let kind = EventKind::parse(&e.r#type).ok_or(InvalidEvent::UnknownType(e.r#type))?;
    Ok(EventRecord {
        global_tx_id: e.global_tx_id,
        local_tx_id: e.local_tx_id,
        parent_tx_id: e.parent_tx_id,
        kind: Some(kind),
        service_name: e.service_name.into(),
        instance_id: e.instance_id.into(),
        compensation_method: e.compensation_method.into(),
        payloads: Bytes::from(e.payloads),
        timestamp_ms: e.timestamp,
        timeout_s: e.timeout,
        forward_timeout_s: e.forward_timeout,
        forward_retries: e.forward_retries,
        reverse_retries: e.reverse_retries,
        reverse_timeout_s: e.reverse_timeout,
        retry_delay_ms: e.retry_delay_in_milliseconds,
        retry_method: e.retry_method,
        // Omega's reports do not say which attempt they answer.
        attempt: 0,
    })
}

fn invalid(e: &InvalidEvent) -> Status {
    Status::invalid_argument(e.to_string())
}

impl OmegaService {
    /// `OnTxEvent`: validates, appends durably, applies, then acknowledges.
    /// Both the tonic service and the hand-written path
    /// ([`crate::unary`]) answer through this.
    pub(crate) async fn tx_event(&self, event: GrpcTxEvent) -> Result<GrpcAck, Status> {
        let ev = from_grpc(event).map_err(|e| {
            self.engine
                .metrics
                .rejected
                .get_or_create(&crate::metrics::ReasonLabels { reason: "invalid" })
                .inc();
            invalid(&e)
        })?;
        // Runs to completion even if Omega gives up on the call: an append
        // already under way is still applied (never durable but unapplied
        // until a restart). Polled inline; only a call dropped mid-way moves
        // its remainder to a task, instead of a task for every call (a few
        // percent of Omega throughput, within this machine's run-to-run
        // noise).
        let engine = self.engine.clone();
        let outcomes = FinishOnDrop::new(async move { engine.handle(vec![ev], "omega").await })
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        match outcomes.into_iter().next() {
            Some(Outcome::Done { aborted }) => {
                self.engine
                    .metrics
                    .acks
                    .get_or_create(&ProtocolLabels { protocol: "omega" })
                    .inc();
                Ok(GrpcAck { aborted })
            }
            Some(Outcome::Invalid(e)) => Err(invalid(&e)),
            None => Err(Status::internal("no outcome for the event")),
        }
    }
}

#[tonic::async_trait]
impl TxEventService for OmegaService {
    type OnConnectedStream = ReceiverStream<Result<GrpcCompensateCommand, Status>>;

    async fn on_connected(
        &self,
        request: Request<Streaming<GrpcServiceConfig>>,
    ) -> Result<Response<Self::OnConnectedStream>, Status> {
        let peer = request.remote_addr();
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(self.engine.config.omega_queue.max(1));
        let engine = self.engine.clone();
        // Ends when Omega closes its side, the connection drops, or the
        // response stream is dropped (then `tx.closed()` resolves).
        let closed = engine.closed();
        tokio::spawn(async move {
            let mut link = None;
            tokio::pin!(closed);
            loop {
                let msg = tokio::select! {
                    m = inbound.next() => m,
                    () = tx.closed() => break,
                    () = &mut closed => break,
                };
                match msg {
                    Some(Ok(cfg)) => {
                        if link.is_some() {
                            continue; // Omega sends its config once; later ones change nothing
                        }
                        if cfg.service_name.is_empty() {
                            let _ = tx
                                .send(Err(Status::invalid_argument(
                                    "serviceName is empty; OnConnected needs the participant's service name",
                                )))
                                .await;
                            break;
                        }
                        let id = engine.registry.register(
                            &cfg.service_name,
                            &cfg.instance_id,
                            peer,
                            Outbound::Omega(tx.clone()),
                        );
                        engine.metrics.instances.set(engine.registry.len() as i64);
                        tracing::debug!(service = %cfg.service_name, instance = %cfg.instance_id, "omega instance connected");
                        link = Some(id);
                        engine.instance_arrived(&cfg.service_name);
                    }
                    Some(Err(_)) | None => break,
                }
            }
            if let Some(link) = link {
                engine.registry.unregister(link.0);
                engine.links_ended(&[link]);
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn on_tx_event(
        &self,
        request: Request<GrpcTxEvent>,
    ) -> Result<Response<GrpcAck>, Status> {
        self.tx_event(request.into_inner()).await.map(Response::new)
    }

    async fn on_disconnected(
        &self,
        request: Request<GrpcServiceConfig>,
    ) -> Result<Response<GrpcAck>, Status> {
        let peer = request.remote_addr();
        let cfg = request.into_inner();
        let removed =
            self.engine
                .registry
                .unregister_instance(&cfg.service_name, &cfg.instance_id, peer);
        self.engine.links_ended(&removed);
        Ok(Response::new(GrpcAck { aborted: false }))
    }

    async fn on_get_server_meta(
        &self,
        _request: Request<GrpcServiceConfig>,
    ) -> Result<Response<ServerMeta>, Status> {
        Ok(Response::new(ServerMeta {
            meta: server_meta(self.engine.config.advertise_akka),
        }))
    }
}

/// The feature map advertised to clients (Omega's server meta, the native
/// `Welcome`).
pub(crate) fn server_meta(akka: bool) -> HashMap<String, String> {
    HashMap::from([
        ("AkkaEnabled".to_owned(), akka.to_string()),
        ("Server".to_owned(), "railyard".to_owned()),
    ])
}

/// A future that is polled by its owner but, if dropped before it is done,
/// finishes on a task of its own: cancel safety without a task per call.
struct FinishOnDrop<F: std::future::Future + Send + 'static> {
    fut: Option<std::pin::Pin<Box<F>>>,
}

impl<F: std::future::Future + Send + 'static> FinishOnDrop<F> {
    fn new(fut: F) -> Self {
        Self {
            fut: Some(Box::pin(fut)),
        }
    }
}

impl<F: std::future::Future + Send + 'static> std::future::Future for FinishOnDrop<F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        // `FinishOnDrop` is `Unpin` (the inner future is boxed).
        let Some(fut) = self.fut.as_mut() else {
            panic!("FinishOnDrop polled after completion");
        };
        let out = std::task::ready!(fut.as_mut().poll(cx));
        self.fut = None;
        std::task::Poll::Ready(out)
    }
}

impl<F: std::future::Future + Send + 'static> Drop for FinishOnDrop<F> {
    fn drop(&mut self) {
        if let Some(fut) = self.fut.take() {
            // Dropped mid-way (the caller went away): finish it anyway. Outside
            // a runtime (process teardown) there is nothing left to finish on.
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    let _ = fut.await;
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FinishOnDrop;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn a_call_dropped_mid_way_still_finishes() {
        let done = Arc::new(AtomicBool::new(false));
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let d = done.clone();
        let call = FinishOnDrop::new(async move {
            let _ = wait.await;
            d.store(true, Ordering::SeqCst);
        });
        // The caller gives up while the work waits (as on a cancelled RPC).
        assert!(tokio::time::timeout(Duration::from_millis(20), call)
            .await
            .is_err());
        assert!(!done.load(Ordering::SeqCst));
        go.send(()).unwrap();
        for _ in 0..100 {
            if done.load(Ordering::SeqCst) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the dropped call's work never finished");
    }

    #[tokio::test]
    async fn a_call_awaited_to_the_end_returns_its_output() {
        assert_eq!(FinishOnDrop::new(async { 7 }).await, 7);
    }
}
