//! Idle keep-alive connections park between requests (hyper's state is
//! dropped, the socket waits alone) and resume transparently: across a
//! partial head, with its deadline still running, and with parking off.

mod common;

use std::time::Duration;

use common::{Client, TestServer};
use railyard_http::c10k::{self, C10kOptions};
use railyard_http::{admin_router, HttpConfig};

fn app(tag: &str) -> railyard_http::Router {
    c10k::app(&C10kOptions::in_dir(&common::temp_dir(tag))).unwrap()
}

/// Reads `railyard_http_connection_parks_total` from the admin server.
async fn parks(admin: std::net::SocketAddr) -> f64 {
    let mut a = Client::connect(admin).await;
    let text = String::from_utf8(a.get("/metrics", "").await.body).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("railyard_http_connection_parks_total"))
        .expect("the parks counter");
    line.split_whitespace().last().unwrap().parse().unwrap()
}

#[tokio::test]
async fn keep_alive_connections_park_and_resume() {
    let config = HttpConfig {
        park_idle_after: Duration::from_millis(50),
        ..HttpConfig::default()
    };
    let server = TestServer::start(app("park"), config).await;
    let admin =
        TestServer::start(admin_router(server.registry.clone()), HttpConfig::default()).await;
    let mut c = Client::connect(server.addr).await;
    // A route hyper serves (the fixed lane answers `/static/*` without it).
    assert_eq!(c.get("/cached/4k", "").await.body.len(), 4096);
    // The park follows the flushed response; wait for it (bounded).
    let mut parked = 0.0;
    for _ in 0..200 {
        parked = parks(admin.addr).await;
        if parked >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(parked >= 1.0, "the idle connection parked");
    // The parked connection serves its next requests, sendfile included.
    for _ in 0..5 {
        assert_eq!(c.get("/static/8k", "").await.body.len(), 8192);
        let f = c.get("/sendFile/test", "").await;
        assert_eq!(f.body.len(), c10k::DEFAULT_SEND_FILE_LEN);
    }
    admin.stop().await;
    server.stop().await;
}

#[tokio::test]
async fn a_head_split_across_a_park_is_served() {
    let config = HttpConfig {
        park_idle_after: Duration::ZERO, // park after every response
        ..HttpConfig::default()
    };
    let server = TestServer::start(app("split"), config).await;
    let mut c = Client::connect(server.addr).await;
    assert_eq!(c.get("/0k", "").await.status, 200);
    c.send(b"GET /static/4k HTTP/1.1\r\nHo").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.send(b"st: t\r\n").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.send(b"\r\n").await;
    let r = c.read_response().await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body.len(), 4096);
    server.stop().await;
}

#[tokio::test]
async fn a_head_trickling_in_is_cut_off_at_its_deadline() {
    let config = HttpConfig {
        header_read_timeout: Duration::from_millis(300),
        park_idle_after: Duration::ZERO,
        ..HttpConfig::default()
    };
    let server = TestServer::start(app("trickle"), config).await;
    let mut c = Client::connect(server.addr).await;
    assert_eq!(c.get("/0k", "").await.status, 200);
    // One byte every 50 ms: each byte wakes the parked connection, but the
    // head's deadline does not restart. 60 bytes would take 3 s.
    let head = b"GET /static/4k HTTP/1.1\r\nHost: t\r\nX-Slow: aaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut cut = false;
    for b in head.iter() {
        if tokio::io::AsyncWriteExt::write_all(&mut c.stream, &[*b])
            .await
            .is_err()
        {
            cut = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rest = if cut { vec![] } else { c.read_to_close().await };
    assert!(
        !rest.starts_with(b"HTTP/1.1 200"),
        "the trickled request must not be served"
    );
    server.stop().await;
}

#[tokio::test]
async fn without_parking_keep_alive_still_works() {
    let config = HttpConfig {
        park_idle_connections: false,
        ..HttpConfig::default()
    };
    let server = TestServer::start(app("nopark"), config).await;
    let mut c = Client::connect(server.addr).await;
    for _ in 0..3 {
        assert_eq!(c.get("/static/4k", "").await.body.len(), 4096);
        assert_eq!(
            c.get("/sendFile/test", "").await.body.len(),
            c10k::DEFAULT_SEND_FILE_LEN
        );
    }
    server.stop().await;
}
