//! The bridge against a real listener on loopback, driven by raw frames:
//! every frame type, every error, permissions, bad input, cleanup, limits,
//! timeouts, authentication and back-pressure.

mod common;

use std::time::Duration;

use common::{eventually, open_config, start, wire, Client, WAIT};
use futures::StreamExt;
use railyard_bridge::{BridgeConfig, PermittedOptions};
use railyard_bus::{BusError, DeliveryOptions, EventBus};
use serde_json::{json, Value};

async fn echo(bus: &EventBus, address: &str) -> railyard_bus::Consumer {
    bus.consumer(address)
        .handler(|mut m| async move {
            let body = m.take_body();
            let _ = m.reply(body);
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn ping_gets_pong() {
    let bus = EventBus::new();
    let bridge = start(
        &bus,
        BridgeConfig {
            port: 0,
            ..BridgeConfig::default()
        },
    )
    .await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.ping_pong().await;
    assert_eq!(bridge.metrics().pings, 1);
    bridge.shutdown().await;
}

#[tokio::test]
async fn request_reply_through_the_bridge() {
    let bus = EventBus::new();
    let _e = bus
        .consumer("test.echo")
        .handler(|mut m| async move {
            let body = m.body::<Value>().cloned().unwrap();
            let seen = m.headers().get("x-trace").unwrap_or("-").to_owned();
            let opts = railyard_bus::DeliveryOptions::new().header("seen", seen);
            let _ = m.reply_with(body, &opts);
        })
        .await
        .unwrap();
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.send(
        json!({"type":"send","address":"test.echo","replyAddress":"r-1",
        "headers":{"x-trace":"abc","timeout":5000},"body":{"n":1,"s":"x"}}),
    )
    .await;
    assert_eq!(
        c.recv().await,
        json!({"type":"message","address":"r-1","headers":{"seen":"abc"},"body":{"n":1,"s":"x"},"send":true})
    );
    let m = bridge.metrics();
    assert_eq!((m.requests, m.request_replies), (1, 1));
    bridge.shutdown().await;
}

#[tokio::test]
async fn request_failures_become_err_frames() {
    let bus = EventBus::new();
    let _fail = bus
        .consumer("test.fail")
        .handler(|mut m| async move {
            let _ = m.fail(42, "boom");
        })
        .await
        .unwrap();
    // Holds requests without answering, so they time out.
    let mut hold = bus.consumer("test.hold").stream().await.unwrap();
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;

    c.send(json!({"type":"send","address":"test.fail","replyAddress":"r1","body":1}))
        .await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","address":"r1","sourceAddress":"test.fail","failureCode":42,
            "failureType":"RECIPIENT_FAILURE","message":"boom"})
    );

    c.send(json!({"type":"send","address":"test.nobody","replyAddress":"r2","body":1}))
        .await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","address":"r2","sourceAddress":"test.nobody","failureCode":-1,
            "failureType":"NO_HANDLERS","message":"No handlers for address test.nobody"})
    );

    c.send(json!({"type":"send","address":"test.hold","replyAddress":"r3","headers":{"timeout":50},"body":1}))
        .await;
    let held = hold.next().await.unwrap();
    let err = c.recv().await;
    assert_eq!(err["type"], "err");
    assert_eq!(err["address"], "r3");
    assert_eq!(err["failureType"], "TIMEOUT");
    assert_eq!(err["failureCode"], -1);
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .starts_with("Timed out after waiting 50(ms)"),
        "{err}"
    );
    drop(held);
    assert_eq!(bridge.metrics().request_failures, 3);
    bridge.shutdown().await;
}

#[tokio::test]
async fn send_and_publish_reach_bus_consumers_with_headers() {
    let bus = EventBus::new();
    let mut a = bus.consumer("test.news").stream().await.unwrap();
    let mut b = bus.consumer("test.news").stream().await.unwrap();
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;

    c.send(json!({"type":"send","address":"test.news","headers":{"k":"v","n":7,"localOnly":true},"body":[1,2]}))
        .await;
    c.send(json!({"type":"publish","address":"test.news","body":"all"}))
        .await;
    let first = tokio::time::timeout(WAIT, a.next()).await.unwrap().unwrap();
    assert!(first.is_send());
    assert_eq!(first.body::<Value>(), Some(&json!([1, 2])));
    assert_eq!(first.headers().get("k"), Some("v"));
    assert_eq!(first.headers().get("n"), Some("7"));
    assert!(
        !first.headers().contains("localOnly"),
        "delivery options are not headers"
    );
    let pa = tokio::time::timeout(WAIT, a.next()).await.unwrap().unwrap();
    let pb = tokio::time::timeout(WAIT, b.next()).await.unwrap().unwrap();
    for p in [&pa, &pb] {
        assert!(!p.is_send());
        assert_eq!(p.body::<Value>(), Some(&json!("all")));
    }
    let m = bridge.metrics();
    assert_eq!((m.sends, m.publishes), (1, 1));
    bridge.shutdown().await;
}

#[tokio::test]
async fn plain_send_refused_by_the_bus_is_reported() {
    let bus = EventBus::new();
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.send(json!({"type":"send","address":"test.nobody","body":1}))
        .await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","sourceAddress":"test.nobody","failureCode":-1,
            "failureType":"NO_HANDLERS","message":"No handlers for address test.nobody"})
    );
    bridge.shutdown().await;
}

#[tokio::test]
async fn registered_client_receives_sends_publishes_and_requests() {
    let bus = EventBus::new();
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.register(&bus, "test.inbox").await;

    bus.send("test.inbox", json!({"hello": 1})).unwrap();
    assert_eq!(
        c.recv().await,
        json!({"type":"message","address":"test.inbox","headers":{},"body":{"hello":1},"send":true})
    );
    bus.publish_with(
        "test.inbox",
        String::from("to all"),
        &railyard_bus::DeliveryOptions::new().header("h", "1"),
    )
    .unwrap();
    assert_eq!(
        c.recv().await,
        json!({"type":"message","address":"test.inbox","headers":{"h":"1"},"body":"to all","send":false})
    );

    // A request: the client answers by sending to the reply address it got.
    let bus2 = bus.clone();
    let asker = tokio::spawn(async move { bus2.request("test.inbox", json!("question")).await });
    let m = c.recv().await;
    assert_eq!(m["body"], "question");
    assert_eq!(m["send"], true);
    let ra = m["replyAddress"].as_str().unwrap().to_owned();
    c.send(json!({"type":"send","address":ra,"body":{"answer":42}}))
        .await;
    let reply = asker.await.unwrap().unwrap();
    assert_eq!(reply.body::<Value>(), Some(&json!({"answer": 42})));

    // And a failure.
    let bus3 = bus.clone();
    let asker = tokio::spawn(async move { bus3.request("test.inbox", 5u32).await });
    let m = c.recv().await;
    assert_eq!(m["body"], 5);
    let ra = m["replyAddress"].as_str().unwrap().to_owned();
    c.send(json!({"type":"send","address":ra,"failureCode":7,"message":"nope"}))
        .await;
    assert_eq!(
        asker.await.unwrap().unwrap_err(),
        BusError::RecipientFailure {
            code: 7,
            message: "nope".into()
        }
    );
    assert_eq!(bridge.metrics().client_answers, 2);

    c.send(json!({"type":"unregister","address":"test.inbox"}))
        .await;
    eventually("unregistered", || bus.consumer_count("test.inbox") == 0).await;
    c.send(json!({"type":"unregister","address":"test.inbox"}))
        .await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","message":"unknown_address"})
    );
    bridge.shutdown().await;
}

#[tokio::test]
async fn protocol_errors_keep_the_connection() {
    let bus = EventBus::new();
    let _e = echo(&bus, "test.echo").await;
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.send(json!({"type":"send","body":1})).await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","message":"missing_address"})
    );
    c.send(json!({"type":"shout","address":"test.x"})).await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","message":"unknown_type"})
    );
    c.send(json!({"address":"test.x"})).await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","message":"unknown_type"})
    );
    c.send(json!({"type":"send","address":"test.echo","replyAddress":"rc","headers":{"codecName":"nope"},"body":1}))
        .await;
    let e = c.recv().await;
    assert_eq!(
        (&e["type"], &e["address"], &e["failureType"]),
        (&json!("err"), &json!("rc"), &json!("ERROR")),
        "{e}"
    );
    assert!(
        e["message"].as_str().unwrap().contains("unknown codec"),
        "{e}"
    );
    c.send(json!({"type":"send","address":"test.x","headers":{"timeout":"soon"}}))
        .await;
    let e = c.recv().await;
    assert!(
        e["message"].as_str().unwrap().starts_with("invalid_header"),
        "{e}"
    );
    c.ping_pong().await;
    bridge.shutdown().await;
}

#[tokio::test]
async fn permissions_exact_and_regex_allow_and_deny() {
    let bus = EventBus::new();
    let _e = echo(&bus, "svc.echo").await;
    let _o = echo(&bus, "svc.other").await;
    let config = BridgeConfig {
        port: 0,
        inbound_permitted: vec![PermittedOptions::address("svc.echo")],
        outbound_permitted: vec![PermittedOptions::regex("feed\\.[0-9]+")],
        ..BridgeConfig::default()
    };
    let bridge = start(&bus, config).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    let denied = json!({"type":"err","message":"access_denied"});

    c.send(json!({"type":"send","address":"svc.echo","replyAddress":"r","body":1}))
        .await;
    assert_eq!(c.recv().await["type"], "message", "exact inbound allowed");
    c.send(json!({"type":"send","address":"svc.other","replyAddress":"r","body":1}))
        .await;
    assert_eq!(c.recv().await, denied, "inbound not listed");
    c.send(json!({"type":"publish","address":"svc.echo.x","body":1}))
        .await;
    assert_eq!(c.recv().await, denied, "exact means exact");

    c.send(json!({"type":"register","address":"feed.12"})).await;
    eventually("regex registration", || bus.consumer_count("feed.12") == 1).await;
    c.send(json!({"type":"register","address":"feed.12x"}))
        .await;
    assert_eq!(c.recv().await, denied, "regex must match the whole address");
    c.send(json!({"type":"register","address":"svc.echo"}))
        .await;
    assert_eq!(
        c.recv().await,
        denied,
        "inbound permission does not grant outbound"
    );
    c.send(json!({"type":"unregister","address":"svc.echo"}))
        .await;
    assert_eq!(c.recv().await, denied);
    assert_eq!(bridge.metrics().access_denied, 5);
    bridge.shutdown().await;

    // Empty lists deny everything.
    let bridge = start(
        &bus,
        BridgeConfig {
            port: 0,
            ..BridgeConfig::default()
        },
    )
    .await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.send(json!({"type":"send","address":"svc.echo","replyAddress":"r","body":1}))
        .await;
    assert_eq!(c.recv().await, denied);
    c.send(json!({"type":"register","address":"svc.echo"}))
        .await;
    assert_eq!(c.recv().await, denied);
    bridge.shutdown().await;
}

async fn assert_closed_with(
    bridge_addr: std::net::SocketAddr,
    bytes: &[u8],
    half_close: bool,
    message: &str,
) {
    let mut bad = Client::connect(bridge_addr).await;
    let mut good = Client::connect(bridge_addr).await;
    bad.send_raw(bytes).await;
    if half_close {
        use tokio::io::AsyncWriteExt;
        bad.stream.shutdown().await.unwrap();
    }
    assert_eq!(bad.recv().await, json!({"type":"err","message":message}));
    bad.expect_closed().await;
    good.ping_pong().await;
}

#[tokio::test]
async fn bad_frames_close_only_their_connection() {
    let bus = EventBus::new();
    let bridge = start(
        &bus,
        BridgeConfig {
            port: 0,
            max_frame_size: 1024,
            ..BridgeConfig::default()
        },
    )
    .await;
    let addr = bridge.local_addr();

    let mut malformed = 9u32.to_be_bytes().to_vec();
    malformed.extend_from_slice(b"{not json");
    assert_closed_with(addr, &malformed, false, "invalid_json").await;

    let mut not_object = 3u32.to_be_bytes().to_vec();
    not_object.extend_from_slice(b"[1]");
    assert_closed_with(addr, &not_object, false, "invalid_json").await;

    let mut oversized = 2000u32.to_be_bytes().to_vec();
    oversized.extend_from_slice(&[b' '; 100]);
    assert_closed_with(addr, &oversized, false, "frame_too_large").await;

    // A negative Java int as length.
    assert_closed_with(addr, &(-1i32).to_be_bytes(), false, "frame_too_large").await;

    // A length prefix promising more than ever comes.
    let mut short = 100u32.to_be_bytes().to_vec();
    short.extend_from_slice(b"{\"type\":");
    assert_closed_with(addr, &short, true, "truncated_frame").await;

    let m = bridge.metrics();
    assert_eq!(m.malformed_frames, 2);
    assert_eq!(m.oversized_frames, 2);
    bridge.shutdown().await;
}

#[tokio::test]
async fn disconnect_removes_registrations_and_fails_unanswered_requests() {
    let bus = EventBus::new();
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.send(json!({"type":"register","address":"test.a"})).await;
    c.send(json!({"type":"register","address":"test.b"})).await;
    eventually("both registered", || {
        bus.consumer_count("test.a") + bus.consumer_count("test.b") == 2
    })
    .await;

    let bus2 = bus.clone();
    let asker = tokio::spawn(async move { bus2.request("test.a", json!(1)).await });
    let m = c.recv().await;
    assert!(m["replyAddress"].is_string());
    drop(c);
    eventually("registrations removed", || {
        bus.consumer_count("test.a") + bus.consumer_count("test.b") == 0
    })
    .await;
    let err = tokio::time::timeout(WAIT, asker)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(
        err,
        BusError::NoReply,
        "the requester learns at once, not at its timeout"
    );
    eventually("connection counted closed", || {
        bridge.metrics().connections_open() == 0
    })
    .await;
    bridge.shutdown().await;
}

#[tokio::test]
async fn per_connection_limits_answer_with_err_frames() {
    let bus = EventBus::new();
    let mut hold = bus.consumer("test.hold").stream().await.unwrap();
    let config = BridgeConfig {
        max_registrations: 2,
        max_pending_requests: 1,
        max_pending_replies: 1,
        max_connections: 2,
        ..open_config()
    };
    let bridge = start(&bus, config).await;
    let mut c = Client::connect(bridge.local_addr()).await;

    for a in ["test.r1", "test.r2", "test.r3"] {
        c.send(json!({"type":"register","address":a})).await;
    }
    assert_eq!(
        c.recv().await,
        json!({"type":"err","message":"too_many_registrations"})
    );
    // Registering an address twice is one registration.
    c.send(json!({"type":"register","address":"test.r1"})).await;
    c.ping_pong().await;
    assert_eq!(bus.consumer_count("test.r1"), 1);

    c.send(json!({"type":"send","address":"test.hold","replyAddress":"q1","body":1}))
        .await;
    c.send(json!({"type":"send","address":"test.hold","replyAddress":"q2","body":2}))
        .await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","address":"q2","sourceAddress":"test.hold","failureCode":-1,
            "failureType":"ERROR","message":"too_many_pending_requests"})
    );
    let mut held = hold.next().await.unwrap();
    held.reply(json!("late")).unwrap();
    assert_eq!(c.recv().await["address"], "q1");

    // One unanswered bus request per client: the second fails at once.
    let first = tokio::spawn({
        let bus = bus.clone();
        async move { bus.request("test.r1", json!(1)).await }
    });
    let m = c.recv().await;
    assert!(m["replyAddress"].is_string());
    let second = bus.request("test.r1", json!(2)).await.unwrap_err();
    assert!(
        matches!(second, BusError::RecipientFailure { code: -1, .. }),
        "{second:?}"
    );
    c.send(json!({"type":"send","address":m["replyAddress"],"body":"ok"}))
        .await;
    assert_eq!(
        first.await.unwrap().unwrap().body::<Value>(),
        Some(&json!("ok"))
    );

    // Connections: two fit, the third is told and closed.
    let _second = Client::connect(bridge.local_addr()).await;
    let mut third = Client::connect(bridge.local_addr()).await;
    assert_eq!(
        third.recv().await,
        json!({"type":"err","message":"too_many_connections"})
    );
    third.expect_closed().await;
    let m = bridge.metrics();
    assert_eq!(
        (m.limit_rejections, m.replies_refused, m.connections_refused),
        (2, 1, 1)
    );
    bridge.shutdown().await;
}

/// A client that never answers its requests does not refuse every later one
/// for as long as it stays connected: at `max_pending_replies`, a request
/// whose requester gave up, or one held past `reply_timeout`, is let go to
/// make room (its requester, if still waiting, gets `NoReply`).
#[tokio::test]
async fn requests_a_client_never_answers_are_let_go_to_make_room() {
    let bus = EventBus::new();
    let config = BridgeConfig {
        max_pending_replies: 1,
        reply_timeout: Duration::from_millis(300),
        ..open_config()
    };
    let bridge = start(&bus, config).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.send(json!({"type":"register","address":"test.deaf"}))
        .await;
    c.ping_pong().await;

    // A requester that gives up (50 ms) frees its place at once.
    let quick = DeliveryOptions::new().timeout(Duration::from_millis(50));
    let gone = bus.request_with("test.deaf", json!(1), &quick).await;
    assert!(matches!(gone, Err(BusError::Timeout { .. })), "{gone:?}");
    assert_eq!(c.recv().await["body"], json!(1));
    let patient = tokio::spawn({
        let bus = bus.clone();
        async move { bus.request("test.deaf", json!(2)).await }
    });
    let m = c.recv().await;
    assert_eq!(m["body"], json!(2), "the gone requester's place was taken");

    // Its requester still waits (30 s): while it is younger than
    // reply_timeout, a new request is refused at once.
    let refused = bus.request("test.deaf", json!(3)).await.unwrap_err();
    assert!(
        matches!(refused, BusError::RecipientFailure { code: -1, .. }),
        "{refused:?}"
    );
    // Past reply_timeout it is let go: its requester learns, and the next
    // request reaches the client, which can answer it.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let next = tokio::spawn({
        let bus = bus.clone();
        async move { bus.request("test.deaf", json!(4)).await }
    });
    let m4 = c.recv().await;
    assert_eq!(m4["body"], json!(4));
    assert_eq!(patient.await.unwrap().unwrap_err(), BusError::NoReply);
    c.send(json!({"type":"send","address":m4["replyAddress"],"body":"ok"}))
        .await;
    assert_eq!(
        next.await.unwrap().unwrap().body::<Value>(),
        Some(&json!("ok"))
    );
    // The let-go request's late answer finds no request: it is an ordinary
    // send to an address the permissions do not list; the connection stays.
    c.send(json!({"type":"send","address":m["replyAddress"],"body":"late"}))
        .await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","message":"access_denied"})
    );
    c.ping_pong().await;
    eventually("counters flushed", || {
        let m = bridge.metrics();
        (m.replies_expired, m.replies_refused) == (2, 1)
    })
    .await;
    bridge.shutdown().await;
}

/// A cluster hook whose advertisements wait for `gate` (an etcd outage),
/// or fail.
struct StuckCluster {
    fail: bool,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
}

impl railyard_bus::ClusterHook for StuckCluster {
    fn advertise(&self, _address: &str, _consumers: usize) -> railyard_bus::Advertisement {
        let (fail, gate) = (self.fail, self.gate.clone());
        Box::pin(async move {
            if fail {
                return Err(BusError::Cluster {
                    reason: "etcd unreachable".into(),
                });
            }
            let _open = gate.acquire().await;
            Ok(())
        })
    }
    fn withdraw(&self, _address: &str, _consumers: usize) {}
}

/// A `register` the cluster takes long to advertise (an etcd outage) does
/// not stall its connection: pings and the client's other frames are
/// answered meanwhile, messages for it wait in its buffer and come once it
/// is advertised, and registering it again meanwhile is not a second
/// registration. One the cluster refuses is answered
/// `registration_failed`, not `invalid_address`.
#[tokio::test]
async fn a_registration_the_cluster_holds_up_does_not_stall_the_connection() {
    let bus = EventBus::new();
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    bus.set_cluster_hook(Some(std::sync::Arc::new(StuckCluster {
        fail: false,
        gate: gate.clone(),
    })));
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.send(json!({"type":"register","address":"test.slow"}))
        .await;
    c.ping_pong().await;
    c.send(json!({"type":"register","address":"test.slow"}))
        .await;
    c.ping_pong().await;
    // Unregistered while it is advertised: cancelled (no error), and not
    // registered once the advertisement completes.
    c.send(json!({"type":"register","address":"test.cancel"}))
        .await;
    c.send(json!({"type":"unregister","address":"test.cancel"}))
        .await;
    c.ping_pong().await;
    bus.publish("test.slow", json!("waits"))
        .expect("one consumer");
    c.ping_pong().await;
    gate.add_permits(10);
    assert_eq!(c.recv().await["body"], json!("waits"));
    let _ = bus.publish("test.cancel", json!("not for this client"));
    c.ping_pong().await;
    bus.publish("test.slow", json!("once"))
        .expect("one consumer");
    assert_eq!(c.recv().await["body"], json!("once"));
    c.ping_pong().await;
    bridge.shutdown().await;

    let bus = EventBus::new();
    bus.set_cluster_hook(Some(std::sync::Arc::new(StuckCluster {
        fail: true,
        gate: std::sync::Arc::new(tokio::sync::Semaphore::new(0)),
    })));
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.send(json!({"type":"register","address":"test.refused"}))
        .await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","message":"registration_failed"})
    );
    c.ping_pong().await;
    bridge.shutdown().await;
}

/// `registration_capacity` bounds what a client that does not read holds
/// for each of its registrations: past it the bus refuses sends to it.
#[tokio::test]
async fn registration_capacity_bounds_what_a_client_that_does_not_read_holds() {
    let bus = EventBus::new();
    let config = BridgeConfig {
        registration_capacity: 4,
        outbound_queue_bytes: 1024,
        ..open_config()
    };
    let bridge = start(&bus, config).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.send(json!({"type":"register","address":"test.full"}))
        .await;
    c.ping_pong().await;
    // The client reads nothing from here: the kernel's buffers fill, then
    // the connection's outbound queue, then the registration's 4 places.
    // 1,000 sends of 64 KiB (62.5 MiB) are more than the kernel's loopback
    // buffers take, and fewer than the default capacity (1,024) alone.
    let big = "x".repeat(64 * 1024);
    let mut accepted = 0;
    let mut refused = None;
    for _ in 0..1000 {
        match bus.send("test.full", json!(big.clone())) {
            Ok(()) => accepted += 1,
            Err(e) => {
                refused = Some(e.error);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        matches!(refused, Some(BusError::Full { .. })),
        "refused after {accepted} sends: {refused:?}"
    );
    bridge.shutdown().await;
}

#[tokio::test]
async fn too_many_headers_refuse_the_frame_and_keep_the_connection() {
    let bus = EventBus::new();
    let mut sink = bus.consumer("test.sink").stream().await.unwrap();
    let _e = echo(&bus, "test.echo").await;
    let config = BridgeConfig {
        max_headers: 3,
        ..open_config()
    };
    let bridge = start(&bus, config).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    let too_many = json!({"type":"err","message":"too_many_headers"});

    // Delivery options count: four keys is one too many.
    c.send(json!({"type":"send","address":"test.sink","headers":{"a":"1","b":"2","c":"3","timeout":100},"body":"no"}))
        .await;
    assert_eq!(c.recv().await, too_many);
    c.send(json!({"type":"publish","address":"test.sink","headers":{"a":"1","b":"2","c":"3","d":"4"},"body":"no"}))
        .await;
    assert_eq!(c.recv().await, too_many);
    c.send(json!({"type":"send","address":"test.echo","replyAddress":"r1","headers":{"a":"1","b":"2","c":"3","d":"4"},"body":"no"}))
        .await;
    assert_eq!(
        c.recv().await,
        too_many,
        "a request is refused the same way"
    );
    c.send(json!({"type":"register","address":"test.sink","headers":{"a":"1","b":"2","c":"3","d":"4"}}))
        .await;
    assert_eq!(c.recv().await, too_many);

    // The connection stays open and a frame at the limit goes through.
    c.ping_pong().await;
    c.send(json!({"type":"send","address":"test.sink","headers":{"a":"1","b":"2","c":"3"},"body":"yes"}))
        .await;
    let m = tokio::time::timeout(WAIT, sink.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        m.body::<Value>(),
        Some(&json!("yes")),
        "the refused frames never reached the bus"
    );
    assert_eq!(m.headers().len(), 3);
    assert_eq!(bus.consumer_count("test.sink"), 1, "register was refused");
    let metrics = bridge.metrics();
    assert_eq!((metrics.limit_rejections, metrics.sends), (4, 1));
    bridge.shutdown().await;
}

#[tokio::test]
async fn shared_token_authentication() {
    let bus = EventBus::new();
    let _e = echo(&bus, "test.echo").await;
    let config = BridgeConfig {
        auth_token: Some("s3cret".into()),
        ..open_config()
    };
    let bridge = start(&bus, config).await;

    let mut anon = Client::connect(bridge.local_addr()).await;
    anon.ping_pong().await; // pings need no token
    anon.send(json!({"type":"register","address":"test.x"}))
        .await;
    assert_eq!(
        anon.recv().await,
        json!({"type":"err","message":"authentication_failed"})
    );
    anon.expect_closed().await;

    let mut wrong = Client::connect(bridge.local_addr()).await;
    wrong
        .send(
            json!({"type":"send","address":"test.echo","headers":{"authToken":"s3creT"},"body":1}),
        )
        .await;
    assert_eq!(
        wrong.recv().await,
        json!({"type":"err","message":"authentication_failed"})
    );
    wrong.expect_closed().await;

    let mut ok = Client::connect(bridge.local_addr()).await;
    ok.send(json!({"type":"send","address":"test.echo","replyAddress":"r","headers":{"authToken":"s3cret"},"body":1}))
        .await;
    let reply = ok.recv().await;
    assert_eq!(reply["body"], 1);
    assert_eq!(
        reply["headers"],
        json!({}),
        "the token is not forwarded to the bus"
    );
    // Later frames need no token.
    ok.send(json!({"type":"send","address":"test.echo","replyAddress":"r","body":2}))
        .await;
    assert_eq!(ok.recv().await["body"], 2);
    assert_eq!(bridge.metrics().auth_failures, 2);
    bridge.shutdown().await;
}

#[tokio::test]
async fn slow_client_pauses_and_loses_nothing() {
    let bus = EventBus::new();
    let config = BridgeConfig {
        outbound_queue_bytes: 16 * 1024,
        ..open_config()
    };
    let bridge = start(&bus, config).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.register(&bus, "test.flood").await;

    // The client reads nothing while the bus sends 4 KiB messages until it refuses.
    let payload = "x".repeat(4096);
    let mut accepted = 0u64;
    let mut refused = false;
    for i in 0..100_000u64 {
        match bus.send("test.flood", json!({"i": i, "p": payload})) {
            Ok(()) => accepted += 1,
            Err(e) => {
                assert!(matches!(e.error, BusError::Full { .. }), "{e}");
                refused = true;
                break;
            }
        }
        if i % 64 == 0 {
            tokio::task::yield_now().await;
        }
    }
    assert!(
        refused,
        "a client that never reads must eventually push back on the bus"
    );
    assert!(bridge.metrics().outbound_pauses >= 1);
    // Everything the bus accepted reaches the client, in order.
    for i in 0..accepted {
        let m = c.recv().await;
        assert_eq!(m["body"]["i"], i);
    }
    assert!(c.quiet_for(Duration::from_millis(100)).await);
    bridge.shutdown().await;
}

#[tokio::test]
async fn shutdown_closes_connections() {
    let bus = EventBus::new();
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.send(json!({"type":"register","address":"test.s"})).await;
    c.ping_pong().await;
    bridge.shutdown().await;
    c.expect_closed().await;
    assert_eq!(bus.consumer_count("test.s"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_all_get_replies() {
    let bus = EventBus::new();
    let _e = echo(&bus, "test.echo").await;
    let bridge = start(&bus, open_config()).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    // 1,000 requests in one write: answers are interleaved with reading, and
    // every one arrives.
    let mut bytes = Vec::new();
    for i in 0..1000 {
        let text = serde_json::to_vec(
            &json!({"type":"send","address":"test.echo","replyAddress":"r","body":i}),
        )
        .unwrap();
        bytes.extend_from_slice(&(text.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&text);
    }
    c.send_raw(&bytes).await;
    let mut seen = vec![false; 1000];
    for _ in 0..1000 {
        let m = c.recv().await;
        assert_eq!(m["type"], "message", "{m}");
        seen[m["body"].as_u64().unwrap() as usize] = true;
    }
    assert!(seen.iter().all(|s| *s));
    assert_eq!(bridge.metrics().limit_rejections, 0);
    bridge.shutdown().await;
}

// The timeout tests run on paused time: the runtime jumps to the next timer
// whenever every task waits, so a 1 s timeout costs no real second and the
// client's bounded waits (5 s, `WAIT`) always outlast the bridge's timeouts.

/// One second, the frame timeout of the tests below.
const FRAME_TIMEOUT: Duration = Duration::from_secs(1);

/// A bridge with the tests' short frame timeout and `idle_timeout`.
async fn timed(bus: &EventBus, idle_timeout: Option<Duration>) -> railyard_bridge::RunningBridge {
    start(
        bus,
        BridgeConfig {
            frame_timeout: FRAME_TIMEOUT,
            idle_timeout,
            ..open_config()
        },
    )
    .await
}

#[tokio::test(start_paused = true)]
async fn partial_frames_time_out_and_close_only_their_connection() {
    let bus = EventBus::new();
    let bridge = timed(&bus, None).await;
    let addr = bridge.local_addr();
    // Two bytes of a length prefix, then nothing.
    assert_closed_with(addr, &[0, 0], false, "frame_timeout").await;
    // A whole prefix and part of the body, then nothing.
    let mut body = 100u32.to_be_bytes().to_vec();
    body.extend_from_slice(b"{\"type\":");
    assert_closed_with(addr, &body, false, "frame_timeout").await;
    // A whole frame followed by part of the next one: the first is answered,
    // the second times out.
    let mut c = Client::connect(addr).await;
    let mut bytes = wire(&json!({"type":"ping"}));
    bytes.extend_from_slice(&[0, 0, 0]);
    c.send_raw(&bytes).await;
    assert_eq!(c.recv().await, json!({"type":"pong"}));
    assert_eq!(
        c.recv().await,
        json!({"type":"err","message":"frame_timeout"})
    );
    c.expect_closed().await;

    let m = bridge.metrics();
    assert_eq!(m.frame_timeouts, 3);
    assert_eq!(m.idle_timeouts, 0);
    bridge.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn slow_but_whole_frames_are_not_timed_out() {
    let bus = EventBus::new();
    let bridge = timed(&bus, None).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    let ping = wire(&json!({"type":"ping"}));
    let pong = json!({"type":"pong"});
    for _ in 0..3 {
        // Whole frames with gaps of three frame timeouts.
        c.send_raw(&ping).await;
        assert_eq!(c.recv().await, pong);
        tokio::time::sleep(3 * FRAME_TIMEOUT).await;
        // A frame in two writes, the second well within the timeout.
        c.send_raw(&ping[..3]).await;
        tokio::time::sleep(FRAME_TIMEOUT / 2).await;
        c.send_raw(&ping[3..]).await;
        assert_eq!(c.recv().await, pong);
        tokio::time::sleep(3 * FRAME_TIMEOUT).await;
    }
    // Each write completes one frame and starts the next: every frame is
    // whole within the timeout, though the run of them takes longer.
    let split = ping.len() / 2;
    c.send_raw(&ping[..split]).await;
    for _ in 0..4 {
        tokio::time::sleep(FRAME_TIMEOUT * 6 / 10).await;
        let mut bytes = ping[split..].to_vec();
        bytes.extend_from_slice(&ping[..split]);
        c.send_raw(&bytes).await;
        assert_eq!(c.recv().await, pong);
    }
    c.send_raw(&ping[split..]).await;
    assert_eq!(c.recv().await, pong);
    assert_eq!(bridge.metrics().frame_timeouts, 0);
    bridge.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn without_idle_timeout_silent_connections_stay_open() {
    let bus = EventBus::new();
    let bridge = timed(&bus, None).await;
    let mut silent = Client::connect(bridge.local_addr()).await;
    let mut after_a_frame = Client::connect(bridge.local_addr()).await;
    after_a_frame.ping_pong().await;
    tokio::time::sleep(100 * FRAME_TIMEOUT).await;
    silent.ping_pong().await;
    after_a_frame.ping_pong().await;
    let m = bridge.metrics();
    assert_eq!((m.frame_timeouts, m.idle_timeouts), (0, 0));
    assert_eq!(m.connections_open(), 2);
    bridge.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn idle_timeout_closes_silent_connections_and_pings_keep_them() {
    let idle = Duration::from_secs(2);
    let bus = EventBus::new();
    let bridge = timed(&bus, Some(idle)).await;
    let addr = bridge.local_addr();
    let mut silent = Client::connect(addr).await;
    let mut pinger = Client::connect(addr).await;
    // Pings at half the idle timeout, for five idle timeouts.
    for _ in 0..10 {
        tokio::time::sleep(idle / 2).await;
        pinger.ping_pong().await;
    }
    assert_eq!(
        silent.recv().await,
        json!({"type":"err","message":"idle_timeout"})
    );
    silent.expect_closed().await;
    // The frame timeout still applies, and is the sooner one here.
    let mut partial = Client::connect(addr).await;
    partial.send_raw(&[0, 0]).await;
    assert_eq!(
        partial.recv().await,
        json!({"type":"err","message":"frame_timeout"})
    );
    partial.expect_closed().await;
    pinger.ping_pong().await;
    let m = bridge.metrics();
    assert_eq!((m.idle_timeouts, m.frame_timeouts), (1, 1));
    bridge.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_unfinished_frame_is_no_activity_for_idle_timeout() {
    let idle = Duration::from_secs(1);
    let bus = EventBus::new();
    let bridge = start(
        &bus,
        BridgeConfig {
            frame_timeout: Duration::from_secs(3),
            idle_timeout: Some(idle),
            ..open_config()
        },
    )
    .await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.ping_pong().await;
    c.send_raw(&[0, 0]).await;
    assert_eq!(
        c.recv().await,
        json!({"type":"err","message":"idle_timeout"})
    );
    c.expect_closed().await;
    bridge.shutdown().await;
}

/// A client cannot keep one frame partial forever by making the bridge pause
/// (not reading its replies): the frame's time stops while the bridge is
/// paused and goes on, not from zero, when it resumes.
#[tokio::test(start_paused = true)]
async fn a_pause_stops_a_partial_frames_clock_without_restarting_it() {
    let bus = EventBus::new();
    let bridge = start(
        &bus,
        BridgeConfig {
            frame_timeout: FRAME_TIMEOUT,
            outbound_queue_bytes: 16 * 1024,
            ..open_config()
        },
    )
    .await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.register(&bus, "test.flood").await;
    let ping = wire(&json!({"type":"ping"}));
    c.send_raw(&ping[..3]).await;
    // Paused time: it jumps to the next timer whenever every task waits, so
    // the timeout fires exactly at its deadline, whatever waits on sockets.
    let t0 = tokio::time::Instant::now();
    // 0.6 of the frame timeout while the bridge reads...
    tokio::time::sleep(FRAME_TIMEOUT * 6 / 10).await;
    // ...then the client stops reading until the bridge pauses (no time
    // passes: the loop never waits)...
    let payload = "x".repeat(4096);
    let mut accepted = 0u64;
    while bus
        .send("test.flood", json!({"i": accepted, "p": payload}))
        .is_ok()
    {
        accepted += 1;
        tokio::task::yield_now().await;
    }
    assert!(bridge.metrics().outbound_pauses >= 1);
    // ...and reads everything, so the bridge resumes: the frame's clock
    // goes on from 0.6 and ends 0.4 later (restarted, it would end 1.0
    // later).
    let mut received = 0;
    let err = loop {
        let m = c.recv().await;
        if m["type"] == "err" {
            break m;
        }
        assert_eq!(m["body"]["i"], received);
        received += 1;
    };
    let at = t0.elapsed();
    assert_eq!(received, accepted, "every accepted message came first");
    assert_eq!(err, json!({"type":"err","message":"frame_timeout"}));
    assert!(
        at >= FRAME_TIMEOUT && at < FRAME_TIMEOUT * 13 / 10,
        "timed out {at:?} after the frame began; the timeout is {FRAME_TIMEOUT:?} of reading time"
    );
    c.expect_closed().await;
    assert_eq!(bridge.metrics().frame_timeouts, 1);
    bridge.shutdown().await;
}

/// With a token required, pings alone (which need none) do not keep a
/// connection that never authenticates: it is closed `frame_timeout` after
/// it opened. One that authenticated may ping and idle as it likes.
#[tokio::test(start_paused = true)]
async fn a_connection_that_never_authenticates_is_closed_after_the_frame_timeout() {
    let bus = EventBus::new();
    let _e = echo(&bus, "test.echo").await;
    let bridge = start(
        &bus,
        BridgeConfig {
            frame_timeout: FRAME_TIMEOUT,
            auth_token: Some("s3cret".into()),
            ..open_config()
        },
    )
    .await;
    let t0 = tokio::time::Instant::now();
    let mut anon = Client::connect(bridge.local_addr()).await;
    let mut ok = Client::connect(bridge.local_addr()).await;
    ok.send(json!({"type":"send","address":"test.echo","replyAddress":"r","headers":{"authToken":"s3cret"},"body":1}))
        .await;
    assert_eq!(ok.recv().await["body"], 1);
    // Pings every third of the timeout: answered until the deadline.
    for _ in 0..2 {
        anon.ping_pong().await;
        tokio::time::sleep(FRAME_TIMEOUT / 3).await;
    }
    anon.ping_pong().await;
    assert_eq!(
        anon.recv().await,
        json!({"type":"err","message":"authentication_timeout"})
    );
    anon.expect_closed().await;
    let at = t0.elapsed();
    assert!(
        at >= FRAME_TIMEOUT && at < FRAME_TIMEOUT * 13 / 10,
        "closed {at:?} after it opened"
    );
    // The authenticated one stays, well past the deadline.
    tokio::time::sleep(5 * FRAME_TIMEOUT).await;
    ok.ping_pong().await;
    assert_eq!(bridge.metrics().auth_failures, 1);
    bridge.shutdown().await;
}

/// A client that receives a constant stream of deliveries is still read:
/// its ping is answered while the stream goes on (the connection's loop
/// gives input a turn after a few turns of output). Before that turn
/// existed, two of three runs of this test saw no pong within the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_flooded_with_deliveries_is_still_read() {
    flooded_client_is_read(false).await;
}

/// The same with a client that reads slowly, so the connection's outbound
/// buffer (small here) is full at most turns: input still gets its turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_flooded_with_deliveries_is_still_read() {
    flooded_client_is_read(true).await;
}

async fn flooded_client_is_read(slow: bool) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    // The pong waits behind what is queued and in the socket buffers (up to
    // several MB of deliveries, each parsed by this debug-built client on
    // a loaded machine): a long bound, which a bridge that stopped reading
    // would still miss.
    const PONG_WAIT: Duration = Duration::from_secs(30);
    let bus = EventBus::new();
    let config = BridgeConfig {
        outbound_queue_bytes: if slow { 16 * 1024 } else { 1 << 20 },
        ..open_config()
    };
    let bridge = start(&bus, config).await;
    let mut c = Client::connect(bridge.local_addr()).await;
    c.register(&bus, "test.flood").await;

    // Two threads publish without pause (bounded in count and time) until
    // told to stop, so the registration's buffer seldom runs dry.
    let stop = Arc::new(AtomicBool::new(false));
    let floods: Vec<_> = (0..2)
        .map(|_| {
            let (bus, stop) = (bus.clone(), stop.clone());
            tokio::task::spawn_blocking(move || {
                let deadline = std::time::Instant::now() + 2 * PONG_WAIT;
                let mut sent = 0u64;
                while !stop.load(Ordering::Relaxed)
                    && sent < 50_000_000
                    && std::time::Instant::now() < deadline
                {
                    if bus.publish("test.flood", String::from("x")).is_ok() {
                        sent += 1;
                    }
                }
                sent
            })
        })
        .collect();
    // The stream is under way before the ping.
    let mut before = 0u64;
    while before < 10_000 {
        assert_eq!(c.recv().await["type"], "message");
        before += 1;
    }
    c.send(json!({"type":"ping"})).await;
    let mut after = 0u64;
    let answered = tokio::time::timeout(PONG_WAIT, async {
        loop {
            let f = c.recv().await;
            if f["type"] == "pong" {
                return;
            }
            assert_eq!(f["type"], "message");
            after += 1;
            if slow && after % 100 == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut sent = 0;
    for f in floods {
        sent += f.await.unwrap();
    }
    assert!(
        answered.is_ok(),
        "no pong within {PONG_WAIT:?}: {after} deliveries after the ping, {sent} published"
    );
    bridge.shutdown().await;
}
