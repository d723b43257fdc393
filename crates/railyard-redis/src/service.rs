//! Seed 002's service on hyper: `GET /test` does a `SET key ok` and a
//! `GET key` through the cluster client and answers the value (2 bytes), as
//! the seed's Spring Boot app does. `GET /stats` answers the refresher's
//! counters as JSON (the bench reads them), and the time `/test` handlers
//! took from their start to their answer (`test_handler_us`: percentiles of
//! the requests since the previous `/stats` request, which resets them), so
//! a load tool's end-to-end tail can be split into the part spent in the
//! client and Redis and the part spent outside the handler (sockets, the
//! scheduler, the load tool itself).
//!
//! This is a small stand-alone router so the Redis crate does not depend on
//! the HTTP server crate; `app` is testable without a socket.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::client::ClusterClient;

/// The service's state.
#[derive(Debug, Clone)]
pub struct TestService {
    client: ClusterClient,
    key: Bytes,
    /// `/test` handler times in µs since the previous `/stats` request. The
    /// lock is held for one record (tens of ns), never across an await.
    handler_us: Arc<Mutex<Histogram<u64>>>,
}

/// Handler times above this (µs) are recorded as this.
const HANDLER_US_MAX: u64 = 60_000_000;

/// Connections served at once; further ones wait in the listen backlog.
const MAX_CONNECTIONS: usize = 10_000;

impl TestService {
    /// A service using `client`, reading and writing `key`.
    pub fn new(client: ClusterClient, key: &str) -> Self {
        let hist =
            Histogram::new_with_bounds(1, HANDLER_US_MAX, 3).expect("valid histogram bounds");
        Self {
            client,
            key: Bytes::copy_from_slice(key.as_bytes()),
            handler_us: Arc::new(Mutex::new(hist)),
        }
    }

    /// Answers one request.
    pub async fn app(&self, method: &Method, path: &str) -> Response<Full<Bytes>> {
        let reply = |status: StatusCode, body: Bytes, json: bool| {
            let mut r = Response::new(Full::new(body));
            *r.status_mut() = status;
            let ct = if json {
                "application/json"
            } else {
                "text/plain"
            };
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(ct),
            );
            r
        };
        if method != Method::GET {
            return reply(StatusCode::METHOD_NOT_ALLOWED, Bytes::new(), false);
        }
        match path {
            "/test" => {
                let started = Instant::now();
                let r = async {
                    self.client.set(&self.key, "ok").await?;
                    self.client.get(&self.key).await
                }
                .await;
                let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                self.handler_us
                    .lock()
                    .saturating_record(us.clamp(1, HANDLER_US_MAX));
                match r {
                    Ok(v) => reply(StatusCode::OK, v.unwrap_or_default(), false),
                    Err(e) => {
                        tracing::warn!(error = %e, "GET /test failed");
                        // No internal details in the body.
                        reply(
                            StatusCode::SERVICE_UNAVAILABLE,
                            Bytes::from_static(b"redis unavailable"),
                            false,
                        )
                    }
                }
            }
            "/stats" => {
                let handler = {
                    let mut h = self.handler_us.lock();
                    let q = |p: f64| h.value_at_quantile(p);
                    let v = serde_json::json!({
                        "count": h.len(),
                        "p50": q(0.5),
                        "p90": q(0.9),
                        "p99": q(0.99),
                        "p999": q(0.999),
                        "max": h.max(),
                    });
                    h.reset();
                    v
                };
                let body = serde_json::json!({
                    "refresh": self.client.refresh_stats(),
                    "test_handler_us": handler,
                    "connected_nodes": self.client.connected_nodes(),
                    "shards": self.client.table().shards().len(),
                });
                reply(StatusCode::OK, Bytes::from(body.to_string()), true)
            }
            _ => reply(StatusCode::NOT_FOUND, Bytes::new(), false),
        }
    }
}

/// Serves HTTP/1.1 on `listener` until `shutdown` completes.
///
/// # Errors
/// Never for one bad connection (it is logged and closed); only if the
/// listener itself fails persistently is the loop still running (it backs off).
pub async fn run(listener: TcpListener, svc: TestService, shutdown: impl Future<Output = ()>) {
    let svc = Arc::new(svc);
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => return,
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        let (sock, _) = tokio::select! {
            () = &mut shutdown => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = sock.set_nodelay(true);
        let svc = svc.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let handler = service_fn(move |req: Request<Incoming>| {
                let svc = svc.clone();
                async move { Ok::<_, Infallible>(svc.app(req.method(), req.uri().path()).await) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(sock), handler)
                .await
            {
                tracing::debug!(error = %e, "http connection ended with an error");
            }
        });
    }
}
