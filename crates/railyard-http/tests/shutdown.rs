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

#[tokio::test]
async fn an_upload_dropped_at_the_deadline_leaves_no_file() {
    let dir = common::temp_dir("shutdown-upload");
    let opts = railyard_http::c10k::C10kOptions::in_dir(&dir);
    let config = HttpConfig {
        shutdown_deadline: Duration::from_millis(100),
        ..HttpConfig::default()
    };
    let mut server = TestServer::start(railyard_http::c10k::app(&opts).unwrap(), config).await;
    let mut c = Client::connect(server.addr).await;
    // A complete file part, then a second one that never ends.
    c.send(b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Type: multipart/form-data; boundary=B\r\nContent-Length: 100000\r\n\r\n--B\r\nContent-Disposition: form-data; name=\"a\"; filename=\"a\"\r\n\r\nfirst\r\n--B\r\nContent-Disposition: form-data; name=\"b\"; filename=\"b\"\r\n\r\nsecond, cut").await;
    let started = std::time::Instant::now();
    while common::entries(&opts.upload_dir).len() < 2 {
        assert!(
            started.elapsed() < common::PATIENCE,
            "the server never wrote both parts"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.signal_stop();
    let report = server.wait().await;
    assert_eq!(report.aborted_connections, 1);
    // Removed while the server stopped, not some time later.
    assert_eq!(common::entries(&opts.upload_dir), Vec::<String>::new());
    drop(c);
}
