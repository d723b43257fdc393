//! Graceful shutdown finishes in-flight requests, then stops accepting.

mod common;

use std::time::Duration;

use common::{Client, TestServer};
use http::Response;
use railyard_http::{Body, HttpConfig, Router};
use tokio::sync::Notify;

#[tokio::test]
async fn in_flight_requests_finish_before_the_server_stops() {
    let entered = std::sync::Arc::new(Notify::new());
    let e = entered.clone();
    let router = Router::new().get("/work", move |_req| {
        let e = e.clone();
        async move {
            e.notify_one();
            tokio::time::sleep(Duration::from_millis(300)).await;
            Response::new(Body::from("done"))
        }
    });
    let mut server = TestServer::start(router, HttpConfig::default()).await;
    let addr = server.addr;
    let mut busy = Client::connect(addr).await;
    let mut idle = Client::connect(addr).await;
    assert_eq!(idle.get("/missing", "").await.status, 404);
    busy.send(b"GET /work HTTP/1.1\r\nHost: t\r\n\r\n").await;
    tokio::time::timeout(common::PATIENCE, entered.notified())
        .await
        .expect("the handler started");
    server.signal_stop();
    // The in-flight request completes with its real answer...
    let r = busy.read_response().await.expect("the in-flight response");
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"done");
    // ...and both connections are closed, the idle one without an answer.
    assert!(busy.read_to_close().await.is_empty());
    assert!(idle.read_to_close().await.is_empty());
    let report = server.wait().await;
    assert_eq!(report.aborted_connections, 0);
    assert_eq!(report.cores, 2);
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no longer listening"
    );
}

#[tokio::test]
async fn connections_past_the_deadline_are_dropped_and_counted() {
    let entered = std::sync::Arc::new(Notify::new());
    let e = entered.clone();
    let router = Router::new().get("/forever", move |_req| {
        e.notify_one();
        async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Response::new(Body::empty())
        }
    });
    let config = HttpConfig {
        shutdown_deadline: Duration::from_millis(100),
        ..HttpConfig::default()
    };
    let mut server = TestServer::start(router, config).await;
    let mut c = Client::connect(server.addr).await;
    c.send(b"GET /forever HTTP/1.1\r\nHost: t\r\n\r\n").await;
    tokio::time::timeout(common::PATIENCE, entered.notified())
        .await
        .expect("the handler started");
    server.signal_stop();
    let report = server.wait().await;
    assert_eq!(report.aborted_connections, 1);
    assert!(c.read_to_close().await.is_empty());
}
