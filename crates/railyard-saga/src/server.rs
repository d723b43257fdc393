//! The coordinator's listener: both gRPC services and the REST API on one
//! port, over hyper directly.
//!
//! Every accepted socket gets one hyper connection (HTTP/2 or HTTP/1.1,
//! told apart by the preface), and every request goes to one of three
//! services by its path: `/<gRPC service name>/...` to Omega's
//! `TxEventService` or the native `SagaCoordinator`, anything else to the
//! REST router ([`crate::api::router`]). A name neither service has falls to
//! the REST router too, whose answer is 404.
//!
//! Hand-written instead of `tonic::transport::Server` because of measured
//! cost. With tonic's server, the request path of every call went through
//! an axum router (which allocates its URL parameters), a `ConnectInfo`
//! layer (an `Extensions` map allocated per request), the `grpc-timeout`
//! layer, a boxed request body and several future wrappers that each move
//! the call's state: in a profile of `railyard bench saga --protocol omega`
//! (`perf record --call-graph dwarf`) those layers held 16.6 % of the
//! coordinator's samples. Here a call is one path comparison away from the
//! generated service. The generated services are tonic's, unchanged.
//!
//! What tonic's server did that this one does too: `TCP_NODELAY`, HTTP/2
//! keep-alive pings (every 30 s), hyper's HTTP/1 header-read timeout, and a
//! graceful stop (stop accepting, then `GOAWAY` on every connection and wait
//! until each has finished its calls). What it does not: `grpc-timeout`
//! headers are not enforced on the server (the clients enforce their own
//! deadlines; no call here waits on anything but the store, which answers or
//! fails by itself).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use railyard_saga_proto::native::saga_coordinator_server::SagaCoordinatorServer;
use railyard_saga_proto::omega::tx_event_service_server::TxEventServiceServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::codegen::{BoxFuture, Service as _};
use tonic::server::NamedService;
use tonic::transport::server::TcpConnectInfo;

use crate::coalesce::Coalesced;
use crate::{unary, Coordinator, NativeService, OmegaService};

/// How often an HTTP/2 connection is pinged to detect dead peers.
const KEEPALIVE: Duration = Duration::from_secs(30);
/// The pause after an accept error (e.g. out of file descriptors) before
/// accepting again, so that the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Whatever a route answers with.
type Body = unary::Body;

/// The three services behind the port, and the hand-written `OnTxEvent`
/// path ([`unary`]) in front of the Omega one.
#[derive(Clone)]
pub(crate) struct Routes {
    omega: TxEventServiceServer<OmegaService>,
    /// The same service, called directly by the `OnTxEvent` path.
    omega_calls: OmegaService,
    native: SagaCoordinatorServer<NativeService>,
    rest: axum::Router,
    /// The connection's client address, handed to the generated Omega
    /// service's calls (`Request::remote_addr`): `OnDisconnected` uses it
    /// to tell which instance's link to drop. Set per connection.
    peer: Option<SocketAddr>,
}

/// Which service serves `path`.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    Omega,
    Native,
    Rest,
}

fn target(path: &str) -> Target {
    let service = path
        .strip_prefix('/')
        .and_then(|rest| rest.split_once('/'))
        .map(|(service, _)| service);
    match service {
        Some(TxEventServiceServer::<OmegaService>::NAME) => Target::Omega,
        Some(SagaCoordinatorServer::<NativeService>::NAME) => Target::Native,
        _ => Target::Rest,
    }
}

impl Routes {
    /// `coordinator`'s services and REST router.
    pub(crate) fn new(coordinator: &Coordinator) -> Self {
        Self {
            omega: coordinator.omega_service(),
            omega_calls: OmegaService {
                engine: coordinator.engine.clone(),
            },
            native: coordinator.native_service(),
            rest: crate::api::router(coordinator.clone()),
            peer: None,
        }
    }
}

/// A route's answer in the making: the generated services' futures come
/// boxed already, so they are kept as they are instead of boxed again.
pub(crate) enum RouteFuture {
    Grpc(BoxFuture<Response<tonic::body::Body>, Infallible>),
    Other(Pin<Box<dyn Future<Output = Response<Body>> + Send>>),
}

impl Future for RouteFuture {
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Self::Grpc(f) => f
                .as_mut()
                .poll(cx)
                .map(|r| r.map(|res| res.map(Body::Tonic))),
            Self::Other(f) => f.as_mut().poll(cx).map(Ok),
        }
    }
}

impl hyper::service::Service<Request<Incoming>> for Routes {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = RouteFuture;

    fn call(&self, mut req: Request<Incoming>) -> RouteFuture {
        // The generated services and the router are always ready (their
        // `poll_ready` returns `Ready` at once), and cheap to clone (an
        // `Arc` each): `call` needs `&mut`.
        match target(req.uri().path()) {
            Target::Omega if unary::handles(&req) => {
                RouteFuture::Other(Box::pin(unary::on_tx_event(self.omega_calls.clone(), req)))
            }
            Target::Omega => {
                // OnConnected, OnDisconnected, onGetServerMeta: rare calls
                // (the hot OnTxEvent is the hand-written path above).
                req.extensions_mut().insert(TcpConnectInfo {
                    local_addr: None,
                    remote_addr: self.peer,
                });
                RouteFuture::Grpc(self.omega.clone().call(req))
            }
            Target::Native => RouteFuture::Grpc(self.native.clone().call(req)),
            Target::Rest => {
                let fut = self.rest.clone().call(req);
                RouteFuture::Other(Box::pin(async move {
                    match fut.await {
                        Ok(res) => res.map(|b| Body::Tonic(tonic::body::Body::new(b))),
                        Err(never) => match never {},
                    }
                }))
            }
        }
    }
}

/// Accepts on `listener` and serves `routes` until `shutdown` resolves,
/// then runs `on_stop`, asks every connection to finish (HTTP/2 `GOAWAY`;
/// HTTP/1.1 closes after the request in progress) and returns once all have.
pub(crate) async fn run(
    routes: Routes,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    on_stop: impl FnOnce(),
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(KEEPALIVE));
    // hyper enforces its HTTP/1 header-read timeout only with a timer.
    builder.http1().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    let (stop_tx, stop_rx) = watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "saga listener: accept failed; retrying");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        tokio::spawn(serve_connection(
            builder.clone(),
            Routes {
                peer: Some(peer),
                ..routes.clone()
            },
            tcp,
            stop_rx.clone(),
        ));
    }
    // Stop accepting at once: the kernel refuses new connections from here.
    drop(listener);
    on_stop();
    let _ = stop_tx.send(());
    drop(stop_rx);
    // Every connection task holds a receiver until it ends.
    stop_tx.closed().await;
}

async fn serve_connection(
    builder: Arc<auto::Builder<TokioExecutor>>,
    routes: Routes,
    tcp: tokio::net::TcpStream,
    mut stop: watch::Receiver<()>,
) {
    let io = TokioIo::new(Coalesced::new(tcp));
    let conn = builder.serve_connection(io, routes);
    tokio::pin!(conn);
    // `stop` was cloned before the stop was signalled, so `changed`
    // resolves even if the signal came before this task first ran.
    let mut stopping = false;
    loop {
        tokio::select! {
            res = conn.as_mut() => {
                if let Err(e) = res {
                    tracing::debug!(error = %e, "saga connection ended with an error");
                }
                return;
            }
            // An error (the server is gone) means stop too.
            _ = stop.changed(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_paths_go_to_their_service_and_everything_else_to_rest() {
        let omega = format!("/{}/OnTxEvent", TxEventServiceServer::<OmegaService>::NAME);
        let native = format!("/{}/Session", SagaCoordinatorServer::<NativeService>::NAME);
        assert_eq!(target(&omega), Target::Omega);
        assert_eq!(target(&native), Target::Native);
        assert_eq!(target("/sagas/abc"), Target::Rest);
        assert_eq!(target("/"), Target::Rest);
        assert_eq!(target(""), Target::Rest);
        // The service name must match whole, not as a prefix.
        let longer = format!("/{}X/OnTxEvent", TxEventServiceServer::<OmegaService>::NAME);
        assert_eq!(target(&longer), Target::Rest);
        assert_eq!(target("/unknown.Service/Method"), Target::Rest);
    }

    #[test]
    fn the_hand_written_path_is_the_generated_services_on_tx_event() {
        let omega = format!("/{}/OnTxEvent", TxEventServiceServer::<OmegaService>::NAME);
        assert_eq!(unary::ON_TX_EVENT, omega);
    }
}
