//! The REST query API: through the router without a socket, and over
//! HTTP/1.1 on the gRPC port.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::Server;
use http_body_util::BodyExt;
use railyard_saga::{
    Coordinator, CoordinatorConfig, EventKind, EventRecord, MemoryStore, SagaQuery, SagaState,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

fn rec(kind: EventKind, gid: &str, lid: &str, service: &str, ts: i64) -> EventRecord {
    EventRecord {
        global_tx_id: gid.into(),
        local_tx_id: lid.into(),
        kind: Some(kind),
        service_name: service.into(),
        instance_id: format!("{service}-1").into(),
        timestamp_ms: ts,
        compensation_method: "undo".into(),
        payloads: Bytes::from_static(b"p"),
        ..EventRecord::default()
    }
}

async fn get(c: &Coordinator, uri: &str) -> (u16, serde_json::Value) {
    let res = railyard_saga::api::router(c.clone())
        .oneshot(
            http::Request::get(uri)
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = res.status().as_u16();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    (status, v)
}

async fn setup() -> Coordinator {
    let c = Coordinator::start(Arc::new(MemoryStore::new()), CoordinatorConfig::default())
        .await
        .unwrap();
    c.submit(vec![
        rec(EventKind::SagaStarted, "done", "done", "orders", 1000),
        rec(EventKind::TxStarted, "done", "l1", "stock", 1001),
        rec(EventKind::TxEnded, "done", "l1", "stock", 1002),
        rec(EventKind::SagaEnded, "done", "done", "orders", 1003),
        rec(EventKind::SagaStarted, "live", "live", "orders", 2000),
        rec(EventKind::TxStarted, "live", "l1", "stock", 2001),
        rec(EventKind::SagaStarted, "other", "other", "billing", 3000),
        rec(EventKind::TxStarted, "other", "b1", "bank", 3001),
        rec(EventKind::TxEnded, "other", "b1", "bank", 3002),
        rec(EventKind::TxAborted, "other", "other", "billing", 3003),
    ])
    .await
    .unwrap();
    c.flush().await.unwrap();
    c
}

fn ids(v: &serde_json::Value) -> Vec<String> {
    v["sagas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["global_tx_id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn a_live_list_keeps_the_newest_matches_up_to_its_limit() {
    let c = Coordinator::start(Arc::new(MemoryStore::new()), CoordinatorConfig::default())
        .await
        .unwrap();
    // 200 live sagas over every shard, started in a shuffled order; even
    // ones by "orders", odd ones by "billing".
    let mut events = Vec::new();
    for i in 0..200i64 {
        let t = (i * 37) % 200;
        let service = if t % 2 == 0 { "orders" } else { "billing" };
        let id = format!("s{t:03}");
        events.push(rec(EventKind::SagaStarted, &id, &id, service, 10_000 + t));
    }
    c.submit(events).await.unwrap();
    let (code, v) = get(&c, "/api/sagas?state=RUNNING&service=orders&limit=5").await;
    assert_eq!(code, 200);
    assert_eq!(ids(&v), ["s198", "s196", "s194", "s192", "s190"]);
    let (_, v) = get(&c, "/api/sagas?limit=3").await;
    assert_eq!(ids(&v), ["s199", "s198", "s197"]);
    let (_, v) = get(&c, "/api/sagas?state=RUNNING").await;
    assert_eq!(ids(&v).len(), 100, "the default page");
}

#[tokio::test]
async fn lists_filter_by_state_service_and_time() {
    let c = setup().await;
    let (code, v) = get(&c, "/api/sagas").await;
    assert_eq!(code, 200);
    assert_eq!(ids(&v), ["other", "live", "done"], "newest first");
    let (_, v) = get(&c, "/api/sagas?state=COMMITTED").await;
    assert_eq!(ids(&v), ["done"]);
    let (_, v) = get(&c, "/api/sagas?state=running").await;
    assert_eq!(ids(&v), ["live"]);
    let (_, v) = get(&c, "/api/sagas?state=COMPENSATING").await;
    assert_eq!(ids(&v), ["other"]);
    let (_, v) = get(&c, "/api/sagas?service=orders").await;
    assert_eq!(ids(&v), ["live", "done"]);
    let (_, v) = get(&c, "/api/sagas?since=1500&until=2500").await;
    assert_eq!(ids(&v), ["live"]);
    let (_, v) = get(&c, "/api/sagas?limit=1").await;
    assert_eq!(ids(&v), ["other"]);
    let (code, v) = get(&c, "/api/sagas?state=SUSPENDED").await;
    assert_eq!(code, 400);
    assert!(v["error"].as_str().unwrap().contains("unknown state"));
    let (code, _) = get(&c, "/api/sagas?color=red").await;
    assert_eq!(code, 400);
}

#[tokio::test]
async fn one_saga_has_its_timeline_and_stats_count() {
    let c = setup().await;
    let (code, v) = get(&c, "/api/sagas/other").await;
    assert_eq!(code, 200);
    assert_eq!(v["saga"]["state"], "COMPENSATING");
    assert_eq!(v["saga"]["sub_transactions"][0]["local_tx_id"], "b1");
    let kinds: Vec<&str> = v["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "SagaStartedEvent",
            "TxStartedEvent",
            "TxEndedEvent",
            "TxAbortedEvent"
        ]
    );
    // Finished and compacted: the summary, no timeline.
    let (code, v) = get(&c, "/api/sagas/done").await;
    assert_eq!(code, 200);
    assert_eq!(v["saga"]["state"], "COMMITTED");
    // Answered from the recent-finished cache (it holds the saga: `state`
    // reads only live sagas and that cache), which keeps the summary
    // without its id: every field comes back as the store holds it.
    assert_eq!(c.state("done"), Some(SagaState::Committed));
    let s = &v["saga"];
    assert_eq!(s["global_tx_id"], "done");
    assert_eq!(s["service_name"], "orders");
    assert_eq!(s["started_ms"], 1000);
    assert_eq!(s["sub_transactions"], 1);
    assert_eq!(s["compensated"], 0);
    assert_eq!(s["events"], 4);
    assert!(s["finished_ms"].as_i64().unwrap() > 0);
    let stored = c
        .store()
        .finished(SagaQuery {
            global_tx_id: Some("done".into()),
            limit: 1,
            ..SagaQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(
        serde_json::to_value(&stored[0]).unwrap(),
        *s,
        "the cached summary differs from the stored one"
    );
    assert_eq!(v["timeline"].as_array().unwrap().len(), 0);
    let (code, _) = get(&c, "/api/sagas/nope").await;
    assert_eq!(code, 404);

    let (code, v) = get(&c, "/api/stats").await;
    assert_eq!(code, 200);
    assert_eq!(v["live"]["RUNNING"], 1);
    assert_eq!(v["live"]["COMPENSATING"], 1);
    assert_eq!(v["store"]["finished"]["COMMITTED"], 1);
}

#[tokio::test]
async fn metrics_count_events_and_the_rest_api_answers_on_the_grpc_port() {
    let (server, _store) = Server::memory(CoordinatorConfig::default()).await;
    let mut c = server.omega().await;
    common::send(&mut c, common::ev("SagaStartedEvent", "g", "g", "svc")).await;
    let text = http11_get(server.addr, "/metrics").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.contains("railyard_saga_events_total{kind=\"SagaStartedEvent\",protocol=\"omega\"} 1"),
        "{text}"
    );
    assert!(text.contains("railyard_saga_append_seconds_bucket"));
    assert!(
        text.contains("railyard_saga_sagas{state=\"RUNNING\"} 1"),
        "{text}"
    );
    let text = http11_get(server.addr, "/api/sagas/g").await;
    assert!(text.contains("\"state\":\"RUNNING\""), "{text}");
    server.stop().await;
}

async fn http11_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        s.read_to_string(&mut out),
    )
    .await
    .unwrap()
    .unwrap();
    out
}
