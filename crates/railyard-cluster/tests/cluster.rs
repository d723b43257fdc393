//! Several nodes in one process, each with its own bus and a real TCP
//! transport on loopback, sharing the in-process cluster manager.

use std::sync::Arc;
use std::time::Duration;

use railyard_bus::{BusError, DeliveryOptions, EventBus};
use railyard_cluster::{
    ClusterConfig, ClusterManager, ClusterNode, InProcessManager, InProcessRegistry, ManagerError,
    NodeInfo,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn start(reg: &InProcessRegistry, id: &str) -> (EventBus, ClusterNode) {
    start_with(reg, id, |_| {}).await
}

async fn start_pinging(
    reg: &InProcessRegistry,
    id: &str,
    ping_interval: Duration,
) -> (EventBus, ClusterNode) {
    start_with(reg, id, |c| {
        c.ping_interval = ping_interval;
        c.ping_timeout = ping_interval * 15;
    })
    .await
}

/// A node pinging every 100 ms (deadline 1.5 s), with `configure` applied.
async fn start_with(
    reg: &InProcessRegistry,
    id: &str,
    configure: impl FnOnce(&mut ClusterConfig),
) -> (EventBus, ClusterNode) {
    let bus = EventBus::new();
    let mut cfg = ClusterConfig::new(id, "127.0.0.1:0".parse().unwrap());
    cfg.ping_interval = Duration::from_millis(100);
    cfg.ping_timeout = Duration::from_millis(1500);
    configure(&mut cfg);
    let node = ClusterNode::start(bus.clone(), Arc::new(reg.manager()), cfg)
        .await
        .expect("node starts");
    (bus, node)
}

/// Registers `id` as a member of `reg`, for a raw TCP client that greets
/// the nodes as `id` (a node only accepts a HELLO from a member). Its
/// address is never dialed: give it an id below the nodes' ids, so they
/// wait for it to dial. Keep the manager for the test's length.
async fn member(reg: &InProcessRegistry, id: &str) -> InProcessManager {
    let m = reg.manager();
    m.join(NodeInfo {
        id: id.into(),
        addr: "127.0.0.1:9".parse().unwrap(),
    })
    .await
    .expect("registers");
    m
}

/// Waits (bounded) until `bus` routes `address` to at least one other node.
async fn routed(bus: &EventBus, address: &str) {
    for _ in 0..500 {
        if bus.remote_addresses().iter().any(|a| a == address) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{address} never became routable to another node");
}

/// Waits (up to 10 s) until `bus` routes `address` to `n` other nodes.
async fn routed_to(bus: &EventBus, address: &str, n: usize) {
    for _ in 0..1000 {
        if bus.remote_node_count(address) == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let now = bus.remote_node_count(address);
    panic!("{address} is routed to {now} other nodes, expected {n}");
}

async fn echo(bus: &EventBus, address: &str) -> railyard_bus::Consumer {
    bus.consumer(address)
        .handler(|mut m| async move {
            let body = m.take_body();
            let _ = m.reply(body);
        })
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_reply_crosses_nodes_with_every_codec() {
    let reg = InProcessRegistry::new();
    let (a, _na) = start(&reg, "a").await;
    let (b, _nb) = start(&reg, "b").await;
    let _e = echo(&b, "echo").await;
    routed(&a, "echo").await;

    let r = a.request("echo", String::from("hello")).await.unwrap();
    assert_eq!(r.body::<String>().unwrap(), "hello");
    let r = a
        .request("echo", bytes::Bytes::from_static(b"\x00\x01"))
        .await
        .unwrap();
    assert_eq!(r.body::<bytes::Bytes>().unwrap().as_ref(), b"\x00\x01");
    let v = serde_json::json!({"k": [1, 2, 3]});
    let r = a.request("echo", v.clone()).await.unwrap();
    assert_eq!(r.body::<serde_json::Value>().unwrap(), &v);

    // Headers travel both ways.
    let opts = DeliveryOptions::new().header("x-trace", "42");
    let _h = b
        .consumer("headers")
        .handler(|mut m| async move {
            let seen = m.headers().get("x-trace").unwrap_or("none").to_owned();
            let _ = m.reply(seen);
        })
        .await
        .unwrap();
    routed(&a, "headers").await;
    let r = a.request_with("headers", (), &opts).await.unwrap();
    assert_eq!(r.body::<String>().unwrap(), "42");

    // A body no codec knows fails the request with a clear error.
    #[derive(Debug)]
    struct Opaque;
    let err = a.request("echo", Opaque).await.unwrap_err();
    assert!(matches!(err, BusError::Cluster { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_round_robin_over_nodes_and_publish_reaches_every_node() {
    let reg = InProcessRegistry::new();
    let (a, _na) = start(&reg, "a").await;
    let (b, _nb) = start(&reg, "b").await;
    let (c, _nc) = start(&reg, "c").await;
    let mut sa = a.consumer("work").stream().await.unwrap();
    let mut sb = b.consumer("work").stream().await.unwrap();
    let mut sc = c.consumer("work").stream().await.unwrap();
    // a routes `work` to both other nodes (its view applied on the
    // blocking pool), and has its own consumer; b, which publishes below,
    // routes it to a and c.
    routed_to(&a, "work", 2).await;
    assert_eq!(a.consumer_count("work"), 1);
    routed_to(&b, "work", 2).await;
    for i in 0..30u64 {
        a.send("work", format!("m{i}")).unwrap();
    }
    use futures::StreamExt;
    let mut got = [0usize; 3];
    for _ in 0..30 {
        tokio::select! {
            Some(_) = sa.next() => got[0] += 1,
            Some(_) = sb.next() => got[1] += 1,
            Some(_) = sc.next() => got[2] += 1,
        }
    }
    assert_eq!(
        got,
        [10, 10, 10],
        "round-robin over one local and two remote consumers"
    );

    let report = b.publish("work", String::from("all")).unwrap();
    assert_eq!(report.delivered, 3, "one local consumer and two nodes");
    for s in [&mut sa, &mut sb, &mut sc] {
        let m = tokio::time::timeout(Duration::from_secs(5), s.next())
            .await
            .expect("published message arrives")
            .unwrap();
        assert_eq!(m.body::<String>().unwrap(), "all");
    }
}

/// `send` takes every consumer in the cluster in turn, not every node: with
/// one consumer on a and three on b, a's sends go one in four to its own
/// consumer and three in four to b, which takes its three in turn. A
/// publish still reaches b once, and b hands it to each of its consumers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_take_every_consumer_in_turn_whatever_its_node() {
    let reg = InProcessRegistry::new();
    let (a, _na) = start(&reg, "a").await;
    let (b, _nb) = start(&reg, "b").await;
    let mut sa = a.consumer("work").stream().await.unwrap();
    let mut sb = Vec::new();
    for _ in 0..3 {
        sb.push(b.consumer("work").stream().await.unwrap());
    }
    // a's route to b weighs b's three consumers (its view is applied on
    // the blocking pool).
    for _ in 0..1000 {
        if a.send_target_count("work") == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(a.send_target_count("work"), 4, "1 local + b weighing 3");
    for i in 0..400u64 {
        a.send("work", i).unwrap();
    }
    use futures::StreamExt;
    let mut got = [0usize; 4];
    let [b0, b1, b2] = &mut sb[..] else {
        unreachable!("three consumers on b")
    };
    for _ in 0..400 {
        tokio::time::timeout(Duration::from_secs(10), async {
            tokio::select! {
                Some(_) = sa.next() => got[0] += 1,
                Some(_) = b0.next() => got[1] += 1,
                Some(_) = b1.next() => got[2] += 1,
                Some(_) = b2.next() => got[3] += 1,
            }
        })
        .await
        .expect("every send arrives");
    }
    // a's own split is exact: one sending thread, one round-robin cursor.
    // b's link hands its 300 on from whichever worker runs it, each with
    // its own cursor, so b's split is exact per worker, even within a few.
    assert_eq!(got[0], 100, "a's consumer its quarter: {got:?}");
    assert_eq!(got[1..].iter().sum::<usize>(), 300, "{got:?}");
    assert!(
        got[1..].iter().all(|n| (90..=110).contains(n)),
        "b's consumers a quarter each: {got:?}"
    );

    // One of b's consumers leaves: a weighs b by two.
    drop(sb.pop());
    for _ in 0..1000 {
        if a.send_target_count("work") == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(a.send_target_count("work"), 3, "1 local + b weighing 2");

    let report = a.publish("work", 7u64).unwrap();
    assert_eq!(report.delivered, 2, "a's consumer and node b, once");
    let mut arrived = 0;
    for s in std::iter::once(&mut sa).chain(sb.iter_mut()) {
        tokio::time::timeout(Duration::from_secs(5), s.next())
            .await
            .expect("the published message reaches every consumer")
            .unwrap();
        arrived += 1;
    }
    assert_eq!(arrived, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_cross_nodes_with_their_kind() {
    let reg = InProcessRegistry::new();
    let (a, _na) = start(&reg, "a").await;
    let (b, _nb) = start(&reg, "b").await;
    let _f = b
        .consumer("fails")
        .handler(|mut m| async move {
            let _ = m.fail(418, "teapot");
        })
        .await
        .unwrap();
    let _silent = b
        .consumer("silent")
        .handler(|m| async move {
            // Holds the request past the requester's timeout.
            tokio::time::sleep(Duration::from_secs(2)).await;
            drop(m);
        })
        .await
        .unwrap();
    routed(&a, "fails").await;
    routed(&a, "silent").await;

    let err = a.request("fails", ()).await.unwrap_err();
    assert_eq!(
        err,
        BusError::RecipientFailure {
            code: 418,
            message: "teapot".into()
        }
    );
    let short = DeliveryOptions::new().timeout(Duration::from_millis(200));
    let err = a.request_with("silent", (), &short).await.unwrap_err();
    assert_eq!(err.kind().as_str(), "TIMEOUT");
    let err = a.request("nowhere", ()).await.unwrap_err();
    assert_eq!(err.kind().as_str(), "NO_HANDLERS");
    // local_only never leaves the node.
    let err = a
        .request_with("fails", (), &DeliveryOptions::new().local_only(true))
        .await
        .unwrap_err();
    assert_eq!(err.kind().as_str(), "NO_HANDLERS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_fail_fast_when_their_node_is_lost() {
    let reg = InProcessRegistry::new();
    let (a, _na) = start(&reg, "a").await;
    let (b, nb) = start(&reg, "b").await;
    // The handler says when the request reached b, then holds it.
    let (reached_tx, mut reached) = tokio::sync::mpsc::unbounded_channel::<()>();
    let _hold = b
        .consumer("hold")
        .capacity(64)
        .handler(move |m| {
            let _ = reached_tx.send(());
            async move {
                tokio::time::sleep(Duration::from_secs(60)).await;
                drop(m);
            }
        })
        .await
        .unwrap();
    routed(&a, "hold").await;
    let a2 = a.clone();
    let waiting = tokio::spawn(async move { a2.request("hold", ()).await });
    tokio::time::timeout(Duration::from_secs(10), reached.recv())
        .await
        .expect("the request reaches b");
    // b vanishes without leaving (as if killed); its registry entry expires.
    drop(nb);
    reg.expire("b");
    let result = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the request must not wait for its 30 s timeout")
        .unwrap();
    let err = result.unwrap_err();
    assert_eq!(err.kind().as_str(), "ERROR", "{err:?}");
    // Its consumers are no longer chosen.
    for _ in 0..500 {
        if a.remote_addresses().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(a.remote_addresses().is_empty());
    assert_eq!(
        a.request("hold", ()).await.unwrap_err().kind().as_str(),
        "NO_HANDLERS"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_frame_closes_only_that_connection() {
    let reg = InProcessRegistry::new();
    let (a, na) = start(&reg, "a").await;
    let (b, _nb) = start(&reg, "b").await;
    let _e = echo(&a, "echo").await;
    routed(&b, "echo").await;

    for garbage in [
        &b"\xff\xff\xff\xff"[..],     // oversized length
        &b"\x00\x00\x00\x01\x63"[..], // unknown kind
        &b"GET / HTTP/1.1\r\n\r\n"[..],
    ] {
        let mut s = tokio::net::TcpStream::connect(na.addr()).await.unwrap();
        s.write_all(garbage).await.unwrap();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("the node closes the connection")
            .unwrap_or(0);
        assert_eq!(n, 0, "closed without a reply");
    }
    // The real link between the nodes still works.
    let r = b.request("echo", String::from("still here")).await.unwrap();
    assert_eq!(r.body::<String>().unwrap(), "still here");
    assert!(na.counters().malformed.get() >= 3);
}

/// A dialer may write its first frames in the same segment as its HELLO
/// (the link pings as soon as it is up): the acceptor must keep them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_sent_with_the_hello_are_not_lost() {
    use railyard_cluster::Frame;
    let reg = InProcessRegistry::new();
    let _dialer = member(&reg, "a-dialer").await;
    let (_z, nz) = start(&reg, "z").await;
    let mut out = hello("a-dialer");
    Frame::Ping(7).encode(&mut out);
    let mut s = tokio::net::TcpStream::connect(nz.addr()).await.unwrap();
    s.write_all(&out).await.unwrap();
    let mut inbuf = bytes::BytesMut::new();
    let pong = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Some(f) = Frame::decode(&mut inbuf, 1 << 20).unwrap() {
                if let Frame::Pong(n) = f {
                    return n;
                }
                continue;
            }
            let n = s.read_buf(&mut inbuf).await.unwrap();
            assert!(
                n > 0,
                "the node closed a connection whose HELLO came with a PING"
            );
        }
    })
    .await
    .expect("a PONG for the PING that came with the HELLO");
    assert_eq!(pong, 7);
    assert_eq!(nz.counters().malformed.get(), 0);
}

/// Waits (bounded) until `bus` routes no address to another node.
async fn unrouted(bus: &EventBus) {
    for _ in 0..500 {
        if bus.remote_addresses().is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("still routed to other nodes: {:?}", bus.remote_addresses());
}

/// Nodes `a` and `b`, with an echo consumer at `over-there` on `b` that
/// `a` routes to; `b`'s side is returned to be kept for the test's length.
async fn a_routing_to_b(
    reg: &InProcessRegistry,
) -> (
    (EventBus, ClusterNode),
    (EventBus, ClusterNode, railyard_bus::Consumer),
) {
    let (a, na) = start(reg, "a").await;
    let (b, nb) = start(reg, "b").await;
    let c = echo(&b, "over-there").await;
    routed(&a, "over-there").await;
    ((a, na), (b, nb, c))
}

/// `leave` clears the node's remote routes before it returns (the clearing
/// runs on the blocking pool, and `leave` waits for it).
#[tokio::test(flavor = "current_thread")]
async fn leaving_clears_the_remote_routes_before_it_returns() {
    let reg = InProcessRegistry::new();
    let ((a, na), _b) = a_routing_to_b(&reg).await;
    na.leave().await.expect("leaves");
    assert!(a.remote_addresses().is_empty());
    let r = a.request("over-there", String::from("x")).await;
    assert!(matches!(r, Err(BusError::NoHandlers { .. })), "{r:?}");
}

/// Dropping a node on a single-threaded runtime clears its routes soon
/// after, off the loop (the loop keeps running meanwhile).
#[tokio::test(flavor = "current_thread")]
async fn dropping_a_node_clears_its_remote_routes() {
    let reg = InProcessRegistry::new();
    let ((a, na), _b) = a_routing_to_b(&reg).await;
    drop(na);
    unrouted(&a).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistering_withdraws_the_route_everywhere() {
    let reg = InProcessRegistry::new();
    let (a, _na) = start(&reg, "a").await;
    let (b, _nb) = start(&reg, "b").await;
    let c = echo(&b, "temp").await;
    let _l = b.local_consumer("hidden").stream().await.unwrap();
    routed(&a, "temp").await;
    assert!(
        !reg.snapshot().subscriptions.contains_key("hidden"),
        "local consumers are never advertised"
    );
    c.unregister().await;
    unrouted(&a).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_link_makes_requests_wait_not_fail() {
    let reg = InProcessRegistry::new();
    let bus_a = EventBus::new();
    let mut cfg = ClusterConfig::new("a", "127.0.0.1:0".parse().unwrap());
    cfg.link_queue = 4;
    let _na = ClusterNode::start(bus_a.clone(), Arc::new(reg.manager()), cfg)
        .await
        .unwrap();
    let (b, _nb) = start(&reg, "b").await;
    let _e = echo(&b, "echo").await;
    routed(&bus_a, "echo").await;
    // Far more requests at once than the link queue holds.
    let replies: Vec<_> = (0..2000u64).map(|i| bus_a.request("echo", i)).collect();
    let mut n = 0;
    for (i, r) in replies.into_iter().enumerate() {
        let m = r.await.expect("waits for room instead of failing");
        assert_eq!(*m.body::<u64>().unwrap(), i as u64);
        n += 1;
    }
    assert_eq!(n, 2000);
    // Plain sends see Full and get the body back; send_wait waits.
    let mut full = 0;
    for i in 0..2000u64 {
        match bus_a.send("echo", i) {
            Ok(()) => {}
            Err(e) => {
                assert!(matches!(e.error, BusError::Full { .. }), "{e:?}");
                full += 1;
            }
        }
    }
    for i in 0..2000u64 {
        bus_a
            .send_wait("echo", i, &DeliveryOptions::new())
            .await
            .expect("waits for room");
    }
    assert!(
        full > 0,
        "a 4-message link queue must fill under 2000 sends"
    );
}

/// A burst far larger than the link's read chunk: the receiving link
/// handles it a chunk at a time and writes answers in between, and still
/// delivers one sender's messages in order and answers every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_larger_than_a_read_chunk_keep_order_and_answers() {
    const SENDS: u64 = 2_000;
    const REQUESTS: u64 = 500;
    let reg = InProcessRegistry::new();
    // No pings during the test: a frame left unhandled in the read buffer
    // would then wait forever (and fail the test) instead of being picked
    // up when the next ping arrives.
    let quiet = Duration::from_secs(3600);
    let (a, na) = start_pinging(&reg, "a", quiet).await;
    let (b, nb) = start_pinging(&reg, "b", quiet).await;
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    // Every message to "burst" is recorded and answered with a send back
    // to node a (send-send), while more frames of the burst are pending.
    let _c = b
        .consumer("burst")
        .capacity(4 * SENDS as usize)
        .handler({
            let b = b.clone();
            move |m| {
                let n = *m.body::<u64>().unwrap();
                s2.lock().push(n);
                let _ = b.send("back", n);
                std::future::ready(())
            }
        })
        .await
        .unwrap();
    let _back = a
        .consumer("back")
        .capacity(4 * SENDS as usize)
        .handler(move |m| {
            let _ = done_tx.send(*m.body::<u64>().unwrap());
            std::future::ready(())
        })
        .await
        .unwrap();
    let _e = echo(&b, "echo").await;
    routed(&a, "burst").await;
    routed(&a, "echo").await;
    routed(&b, "back").await;

    let requests: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let a = a.clone();
            tokio::spawn(async move { (i, a.request("echo", i).await) })
        })
        .collect();
    for n in 0..SENDS {
        a.send("burst", n).unwrap();
    }
    for r in requests {
        let (i, reply) = r.await.unwrap();
        assert_eq!(*reply.unwrap().body::<u64>().unwrap(), i);
    }
    let mut back = Vec::new();
    while back.len() < SENDS as usize {
        let n = tokio::time::timeout(Duration::from_secs(10), done_rx.recv())
            .await
            .expect("every message comes back within 10 s")
            .unwrap();
        back.push(n);
    }
    assert_eq!(*seen.lock(), (0..SENDS).collect::<Vec<_>>());
    assert_eq!(back, (0..SENDS).collect::<Vec<_>>());
    // Every frame is counted, answers included: a wrote the sends and the
    // requests, b the sends back and the replies. (Counts are added once
    // per read chunk or write, so the last ones may land just after.)
    let both_ways = SENDS + REQUESTS;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (ca, cb) = (na.counters(), nb.counters());
        let counts = [
            ca.frames_out.get(),
            cb.frames_in.get(),
            cb.frames_out.get(),
            ca.frames_in.get(),
        ];
        if counts.iter().all(|&n| n >= both_ways) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "frames counted (a out, b in, b out, a in): {counts:?}, expected {both_ways} each"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// 4,000 requests in flight at once, each answered with 1 KiB (4 MiB of
/// answers, many writes' worth): every answer arrives, intact, to its own
/// requester.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_large_answers_in_flight_arrive_intact() {
    const REQUESTS: usize = 4_000;
    let reg = InProcessRegistry::new();
    let (a, _na) = start(&reg, "a").await;
    let (b, _nb) = start(&reg, "b").await;
    let _e = echo(&b, "echo").await;
    routed(&a, "echo").await;
    let opts = DeliveryOptions::new().timeout(Duration::from_secs(20));
    let requests: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let (a, opts) = (a.clone(), opts.clone());
            tokio::spawn(async move {
                let body = bytes::Bytes::from(vec![(i % 251) as u8; 1024]);
                (i, a.request_with("echo", body, &opts).await)
            })
        })
        .collect();
    for r in requests {
        let (i, reply) = r.await.unwrap();
        let reply = reply.unwrap_or_else(|e| panic!("request {i} failed: {e}"));
        let body = reply.body::<bytes::Bytes>().unwrap();
        assert_eq!(body.len(), 1024);
        assert!(body.iter().all(|&x| x == (i % 251) as u8));
    }
}

/// Two nodes flooding each other with large requests at once: each side's
/// writes fill the other's socket, so a side that stopped reading while
/// its write waited would wait on the other for good. Every request is
/// answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_flooding_each_other_both_finish() {
    flood_both_ways(None, None).await;
}

/// The same at small in-flight limits, equal and unequal: requests wait for
/// room and the readers' answer bounds never stop both nodes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_flooding_each_other_at_small_in_flight_limits_both_finish() {
    flood_both_ways(Some(4), Some(4)).await;
    flood_both_ways(Some(2), Some(64)).await;
}

/// A node with `max_in_flight` set to `limit` (the default if `None`).
async fn start_limited(
    reg: &InProcessRegistry,
    id: &str,
    limit: Option<usize>,
) -> (EventBus, ClusterNode) {
    start_with(reg, id, |c| {
        if let Some(l) = limit {
            c.max_in_flight = l;
        }
    })
    .await
}

async fn flood_both_ways(limit_a: Option<usize>, limit_b: Option<usize>) {
    const EACH_WAY: usize = 300;
    let reg = InProcessRegistry::new();
    let (a, _na) = start_limited(&reg, "a", limit_a).await;
    let (b, _nb) = start_limited(&reg, "b", limit_b).await;
    let _ea = echo(&a, "echo.a").await;
    let _eb = echo(&b, "echo.b").await;
    routed(&a, "echo.b").await;
    routed(&b, "echo.a").await;
    let opts = DeliveryOptions::new().timeout(Duration::from_secs(20));
    let body = bytes::Bytes::from(vec![7u8; 64 * 1024]);
    let mut calls = Vec::new();
    for _ in 0..EACH_WAY {
        for (from, to) in [(&a, "echo.b"), (&b, "echo.a")] {
            let (bus, opts, body) = (from.clone(), opts.clone(), body.clone());
            calls.push(tokio::spawn(async move {
                bus.request_with(to, body, &opts).await
            }));
        }
    }
    for c in calls {
        let reply = c.await.unwrap().expect("every request is answered");
        assert_eq!(reply.body::<bytes::Bytes>().unwrap().len(), 64 * 1024);
    }
}

/// A node that dies and comes back under the same name numbers its requests
/// from 1 again: an answer its first run was owed must not complete the
/// second run's request with the same number (it did, when answers were not
/// tied to the connection their request came on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_owed_to_a_restarted_nodes_first_run_never_answers_its_second() {
    let reg = InProcessRegistry::new();
    let (a, na) = start(&reg, "a").await;
    let (held_tx, mut held) = tokio::sync::mpsc::unbounded_channel();
    let _slow = a
        .consumer("slow")
        .handler(move |m| {
            let t = held_tx.clone();
            async move {
                let _ = t.send(m);
            }
        })
        .await
        .unwrap();
    let wait = Duration::from_secs(10);

    // First run of b: request 1, held unanswered by a's consumer.
    let (b1, nb1) = start(&reg, "b").await;
    routed(&b1, "slow").await;
    let b1c = b1.clone();
    let first = tokio::spawn(async move { b1c.request("slow", String::from("first run")).await });
    let mut old = tokio::time::timeout(wait, held.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(old.body::<String>().unwrap(), "first run");
    // b dies without leaving; its request fails at once on its side.
    drop(nb1);
    let gone = tokio::time::timeout(wait, first).await.unwrap().unwrap();
    assert!(gone.is_err());
    drop(b1);

    // Second run under the same name, before its entry expires: request 1 again.
    let (b2, _nb2) = start(&reg, "b").await;
    routed(&b2, "slow").await;
    let b2c = b2.clone();
    let second = tokio::spawn(async move { b2c.request("slow", String::from("second run")).await });
    let mut new = tokio::time::timeout(wait, held.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(new.body::<String>().unwrap(), "second run");

    // The first run's answer comes late: it is dropped, not written.
    old.reply(String::from("answer owed to the first run"))
        .unwrap();
    for _ in 0..500 {
        if na.counters().stale_answers.get() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(na.counters().stale_answers.get(), 1);
    new.reply(String::from("answer for the second run"))
        .unwrap();
    let r = tokio::time::timeout(wait, second)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(r.body::<String>().unwrap(), "answer for the second run");
}

/// A body too large for one frame fails its own request with a clear error;
/// it is not written (the peer would refuse the frame and close the link,
/// failing every other request on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_frame_limit_fails_its_request_and_the_link_stays_up() {
    let reg = InProcessRegistry::new();
    let start_small = |id: &'static str| {
        let reg = &reg;
        async move {
            let bus = EventBus::new();
            let mut cfg = ClusterConfig::new(id, "127.0.0.1:0".parse().unwrap());
            cfg.max_frame = 64 * 1024;
            let node = ClusterNode::start(bus.clone(), Arc::new(reg.manager()), cfg)
                .await
                .expect("node starts");
            (bus, node)
        }
    };
    let (a, na) = start_small("a").await;
    let (b, nb) = start_small("b").await;
    let _e = echo(&b, "echo").await;
    // Answers with a body four times the limit, whatever it was asked.
    let _big = b
        .consumer("big")
        .handler(|mut m| async move {
            let _ = m.reply(vec![7u8; 256 * 1024]);
        })
        .await
        .unwrap();
    routed(&a, "echo").await;
    routed(&a, "big").await;

    let err = a.request("echo", vec![1u8; 100 * 1024]).await.unwrap_err();
    assert_eq!(err.kind().as_str(), "ERROR", "{err:?}");
    assert!(err.to_string().contains("frame limit"), "{err}");

    let err = a.request("big", ()).await.unwrap_err();
    assert_eq!(err.kind().as_str(), "ERROR", "{err:?}");
    assert!(err.to_string().contains("frame limit"), "{err}");

    // The link was never dropped: a small request still crosses, and
    // neither side saw a malformed frame or lost the connection.
    let r = a.request("echo", String::from("small")).await.unwrap();
    assert_eq!(r.body::<String>().unwrap(), "small");
    for n in [&na, &nb] {
        assert_eq!(n.counters().malformed.get(), 0);
        assert_eq!(n.counters().disconnects.get(), 0);
    }
    assert_eq!(na.counters().encode_failures.get(), 1);
    assert_eq!(nb.counters().encode_failures.get(), 1);
}

/// A node whose reader waits for room in a full local buffer (more than the
/// 1,024 inbound messages that may wait in tasks) reads nothing meanwhile;
/// it must keep pinging, or after the ping deadline its live peer declares
/// it dead and fails every request pending on the link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_waiting_for_room_keeps_the_link_alive() {
    let reg = InProcessRegistry::new();
    // Deadline: 15 pings of 100 ms = 1.5 s.
    let (a, na) = start_pinging(&reg, "a", Duration::from_millis(100)).await;
    let (b, nb) = start_pinging(&reg, "b", Duration::from_millis(100)).await;
    let (open_tx, open_rx) = tokio::sync::watch::channel(false);
    let handled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let h = handled.clone();
    let _full = b
        .consumer("full")
        .capacity(16)
        .handler(move |_m| {
            let mut open = open_rx.clone();
            let h = h.clone();
            async move {
                let _ = open.wait_for(|o| *o).await;
                h.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        })
        .await
        .unwrap();
    let _e = echo(&b, "echo").await;
    routed(&a, "full").await;
    routed(&a, "echo").await;

    // 16 buffered, 1,024 waiting in tasks, and b's reader waits inline.
    for i in 0..3_000u64 {
        a.send("full", i).unwrap();
    }
    let a2 = a.clone();
    let request = tokio::spawn(async move { a2.request("echo", String::from("behind")).await });
    // Twice the deadline with b's reader stalled.
    tokio::time::sleep(Duration::from_secs(3)).await;
    open_tx.send(true).unwrap();
    let r = tokio::time::timeout(Duration::from_secs(20), request)
        .await
        .expect("answered once b reads again")
        .unwrap()
        .expect("not failed by a ping deadline");
    assert_eq!(r.body::<String>().unwrap(), "behind");
    for n in [&na, &nb] {
        assert_eq!(n.counters().disconnects.get(), 0);
    }
    // And every message sent reached the consumer.
    for _ in 0..2_000 {
        if handled.load(std::sync::atomic::Ordering::Relaxed) == 3_000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(handled.load(std::sync::atomic::Ordering::Relaxed), 3_000);
}

/// One sender's messages reach a consumer in send order even when its
/// buffer keeps filling: a message that must wait for room is not
/// overtaken by the next one, and those waiting are delivered in turn (a
/// request among them too). A message for another address does not wait
/// behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_consumer_still_gets_one_senders_messages_in_order() {
    const SENDS: u64 = 3_000;
    let reg = InProcessRegistry::new();
    let quiet = Duration::from_secs(3600);
    let (a, _na) = start_pinging(&reg, "a", quiet).await;
    let (b, nb) = start_pinging(&reg, "b", quiet).await;
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    // A buffer of 2 and a handler that takes a little while: most messages
    // find the buffer full, and room keeps appearing while they wait.
    let _slow = b
        .consumer("slow")
        .capacity(2)
        .handler(move |mut m| {
            let n = *m.body::<u64>().unwrap();
            s2.lock().push(n);
            if m.expects_reply() {
                m.reply(n).unwrap();
            }
            async {
                tokio::time::sleep(Duration::from_micros(50)).await;
            }
        })
        .await
        .unwrap();
    let _e = echo(&b, "echo").await;
    routed(&a, "slow").await;
    routed(&a, "echo").await;
    for n in 0..SENDS {
        if n % 100 == 99 {
            // Behind the sends still waiting at b, and answered.
            let r = a.request("slow", n).await.expect("answered");
            assert_eq!(*r.body::<u64>().unwrap(), n);
        } else {
            a.send_wait("slow", n, &DeliveryOptions::new())
                .await
                .unwrap();
        }
    }
    // Another address is answered while "slow" still has a backlog.
    let r = tokio::time::timeout(Duration::from_secs(10), a.request("echo", 7u64))
        .await
        .expect("not held behind another address's messages")
        .unwrap();
    assert_eq!(*r.body::<u64>().unwrap(), 7);
    for _ in 0..2_000 {
        if seen.lock().len() as u64 == SENDS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seen = seen.lock().clone();
    assert_eq!(seen.len() as u64, SENDS);
    let first_out_of_order = seen.windows(2).position(|w| w[1] < w[0]);
    if let Some(i) = first_out_of_order {
        eprintln!(
            "around {i}: {:?}",
            &seen[i.saturating_sub(3)..(i + 4).min(seen.len())]
        );
    }
    assert_eq!(first_out_of_order, None, "delivered out of send order");
    assert_eq!(nb.counters().disconnects.get(), 0);
}

/// Messages a `hold` consumer keeps, unanswered until the test answers them.
type Held = Arc<std::sync::Mutex<Vec<railyard_bus::Message>>>;

/// A consumer at `hold` on `bus` that keeps every message it gets.
async fn holder(bus: &EventBus) -> (railyard_bus::Consumer, Held) {
    let held: Held = Arc::default();
    let h = held.clone();
    let consumer = bus
        .consumer("hold")
        .handler(move |m| {
            h.lock().unwrap().push(m);
            std::future::ready(())
        })
        .await
        .unwrap();
    (consumer, held)
}

/// A requester keeps at most `max_in_flight` requests unanswered on a link:
/// the rest wait for room, and go out as answers come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_keeps_at_most_max_in_flight_requests_unanswered() {
    const LIMIT: usize = 8;
    const REQUESTS: usize = 40;
    let reg = InProcessRegistry::new();
    let (bus_a, na) = start_limited(&reg, "a", Some(LIMIT)).await;
    let (b, _nb) = start(&reg, "b").await;
    // Holds every request unanswered until the test answers it.
    let (_hold, held) = holder(&b).await;
    routed(&bus_a, "hold").await;
    let replies: Vec<_> = (0..REQUESTS as u64)
        .map(|i| {
            let a = bus_a.clone();
            tokio::spawn(async move { a.request("hold", i).await })
        })
        .collect();
    let mut answered = 0;
    for _ in 0..2_000 {
        // Whatever reached b is at most the limit beyond what was answered.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let batch: Vec<_> = std::mem::take(&mut *held.lock().unwrap());
        assert!(
            batch.len() <= LIMIT,
            "{} requests in flight on a link limited to {LIMIT}",
            batch.len()
        );
        if batch.len() == LIMIT {
            // The limit holds while nothing is answered.
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(
                held.lock().unwrap().is_empty(),
                "a request beyond the limit went out"
            );
        }
        for mut m in batch {
            let v = *m.body::<u64>().unwrap();
            m.reply(v).unwrap();
            answered += 1;
        }
        if answered == REQUESTS {
            break;
        }
    }
    assert_eq!(answered, REQUESTS);
    for (i, r) in replies.into_iter().enumerate() {
        let m = r.await.unwrap().expect("answered after waiting for room");
        assert_eq!(*m.body::<u64>().unwrap(), i as u64);
    }
    assert!(
        na.counters().link_full.get() > 0,
        "some requests waited for room"
    );
}

/// A request whose requester gave up (timed out) gives its slot under the
/// in-flight limit back, even if the peer never answers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_given_up_on_free_their_in_flight_slots() {
    const LIMIT: usize = 2;
    let reg = InProcessRegistry::new();
    let (a, na) = start_limited(&reg, "a", Some(LIMIT)).await;
    let (b, _nb) = start(&reg, "b").await;
    // Never answers: keeps every request.
    let (_hold, held) = holder(&b).await;
    routed(&a, "hold").await;
    // Long enough for a request that waits for room (until the next ping,
    // every 100 ms, forgets the given-up ones) to reach b before it times
    // out, with room for a loaded machine's stalls.
    let quick = DeliveryOptions::new().timeout(Duration::from_millis(2500));
    for round in 0..3 {
        let calls: Vec<_> = (0..LIMIT)
            .map(|_| a.request_with("hold", String::from("hi"), &quick))
            .collect();
        for c in calls {
            let e = c.await.expect_err("nobody answers");
            assert_eq!(e.kind().as_str(), "TIMEOUT", "round {round}: {e:?}");
        }
    }
    // Every round got its requests through: 6 reached b, none was refused
    // for good (the last may still be on its way).
    for _ in 0..1000 {
        if held.lock().unwrap().len() == 3 * LIMIT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(held.lock().unwrap().len(), 3 * LIMIT);
    assert!(
        na.counters().link_full.get() > 0,
        "the later rounds waited for room"
    );
}

/// A peer that sends requests but does not read the answers: the node
/// stops reading from it once `max_in_flight` (plus a few pongs) answers
/// for it wait to be written, so the answers it queues stay bounded; when
/// the peer reads again, every answer arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_answers_is_not_read_from() {
    use railyard_cluster::{Frame, Mode};
    // Small requests, large answers: the node takes requests far faster
    // than the peer (which reads nothing) takes answers.
    const REQUESTS: u64 = 2_000;
    const BODY: usize = 16 * 1024;
    let reg = InProcessRegistry::new();
    let _greedy = member(&reg, "a-greedy").await;
    let (bus, nz) = start_with(&reg, "z", |c| {
        c.max_in_flight = 16;
        c.ping_timeout = Duration::from_secs(60);
    })
    .await;
    let handled = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let h = handled.clone();
    let answer = bytes::Bytes::from(vec![7u8; BODY]);
    let _e = bus
        .consumer("echo")
        .handler(move |mut m| {
            h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = m.reply(answer.clone());
            std::future::ready(())
        })
        .await
        .unwrap();

    // A small receive buffer, so the node's answers (32 MB) fill the
    // socket long before they are all written (after about 270 of them).
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(64 * 1024).unwrap();
    let s = sock.connect(nz.addr()).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let mut out = hello("a-greedy");
        wr.write_all(&out).await.unwrap();
        let body = bytes::Bytes::from_static(b"?");
        for id in 1..=REQUESTS {
            out.clear();
            Frame::Msg {
                mode: Mode::Request,
                id,
                timeout_ms: 60_000,
                address: "echo".into(),
                headers: railyard_bus::Headers::new(),
                codec: "bytes".into(),
                body: body.clone(),
            }
            .encode(&mut out);
            wr.write_all(&out).await.unwrap();
        }
        wr
    });
    // Not reading: the node pauses its reader for this peer.
    let mut paused = false;
    for _ in 0..1_000 {
        if nz.counters().answer_pauses.get() > 0 {
            paused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        paused,
        "the node kept reading from a peer that reads nothing"
    );
    // And it stays paused: no more requests are taken in once those read
    // before the pause are handled (a first pause may lift while the writer
    // is only behind, until the socket is full): the count settles for
    // 500 ms (bounded), then stays put for 500 ms more.
    let count = || handled.load(std::sync::atomic::Ordering::SeqCst);
    let mut before = count();
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = count();
        if now == before {
            break;
        }
        before = now;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = count();
    assert_eq!(before, after, "requests were handled while paused");
    assert!(
        after < REQUESTS,
        "every request was taken in: nothing paused"
    );

    // Now read: every request is answered once, intact.
    let mut inbuf = bytes::BytesMut::new();
    let mut seen = std::collections::HashSet::new();
    tokio::time::timeout(Duration::from_secs(60), async {
        while (seen.len() as u64) < REQUESTS {
            while let Some(f) = Frame::decode(&mut inbuf, 1 << 20).unwrap() {
                match f {
                    Frame::Reply { id, body, .. } => {
                        assert_eq!(body.len(), BODY);
                        assert!(seen.insert(id), "request {id} answered twice");
                    }
                    Frame::Ping(_) | Frame::Pong(_) => {}
                    other => panic!("unexpected frame {other:?}"),
                }
            }
            let n = rd.read_buf(&mut inbuf).await.unwrap();
            assert!(n > 0, "the node closed the connection");
        }
    })
    .await
    .expect("every answer arrives once the peer reads");
    assert_eq!(seen.len() as u64, REQUESTS);
    let _wr = writer.await.unwrap();
    assert_eq!(nz.counters().malformed.get(), 0);
}

/// The in-process manager with its subscription writes slowed down, to
/// widen the windows in which registrations and withdrawals overlap.
struct Slow {
    inner: InProcessManager,
    subscribe: Duration,
    unsubscribe: Duration,
    /// Subscribe writes first and then waits (the write is done while the
    /// call still looks pending), instead of waiting first.
    write_first: bool,
}

impl ClusterManager for Slow {
    fn join(&self, node: NodeInfo) -> railyard_cluster::BoxFuture<'_, Result<(), ManagerError>> {
        self.inner.join(node)
    }
    fn leave(&self) -> railyard_cluster::BoxFuture<'_, Result<(), ManagerError>> {
        self.inner.leave()
    }
    fn subscribe(
        &self,
        address: &str,
        consumers: u32,
    ) -> railyard_cluster::BoxFuture<'_, Result<(), ManagerError>> {
        let a = address.to_owned();
        Box::pin(async move {
            if self.write_first {
                self.inner.subscribe(&a, consumers).await?;
                tokio::time::sleep(self.subscribe).await;
                return Ok(());
            }
            tokio::time::sleep(self.subscribe).await;
            self.inner.subscribe(&a, consumers).await
        })
    }
    fn unsubscribe(
        &self,
        address: &str,
    ) -> railyard_cluster::BoxFuture<'_, Result<(), ManagerError>> {
        let a = address.to_owned();
        Box::pin(async move {
            tokio::time::sleep(self.unsubscribe).await;
            self.inner.unsubscribe(&a).await
        })
    }
    fn view(&self) -> tokio::sync::watch::Receiver<Arc<railyard_cluster::ClusterView>> {
        self.inner.view()
    }
}

async fn start_slow(
    reg: &InProcessRegistry,
    id: &str,
    subscribe: Duration,
    unsubscribe: Duration,
) -> (EventBus, ClusterNode) {
    start_slow_with(
        Slow {
            inner: reg.manager(),
            subscribe,
            unsubscribe,
            write_first: false,
        },
        id,
    )
    .await
}

async fn start_slow_with(m: Slow, id: &str) -> (EventBus, ClusterNode) {
    let bus = EventBus::new();
    let cfg = ClusterConfig::new(id, "127.0.0.1:0".parse().unwrap());
    let node = ClusterNode::start(bus.clone(), Arc::new(m), cfg)
        .await
        .expect("node starts");
    (bus, node)
}

fn subscribed(reg: &InProcessRegistry, address: &str, node: &str) -> bool {
    reg.snapshot()
        .subscriptions
        .get(address)
        .is_some_and(|n| n.contains_key(node))
}

/// A consumer registered again right after the address's last one left:
/// the slow withdrawal of the first must not land after the new
/// registration and leave the address unadvertised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_withdrawal_never_undoes_a_later_registration() {
    let reg = InProcessRegistry::new();
    let (b, _nb) = start_slow(&reg, "b", Duration::ZERO, Duration::from_millis(300)).await;
    let first = echo(&b, "again").await;
    assert!(subscribed(&reg, "again", "b"));
    first.unregister().await;
    let _second = echo(&b, "again").await;
    assert!(subscribed(&reg, "again", "b"), "resolved, so advertised");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        subscribed(&reg, "again", "b"),
        "still advertised after the withdrawal's time has passed"
    );
}

/// A second consumer at an address whose first one is still being
/// advertised resolves only once the cluster knows of the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_registration_waits_for_the_first_ones_advertisement() {
    let reg = InProcessRegistry::new();
    let (b, _nb) = start_slow(&reg, "b", Duration::from_millis(300), Duration::ZERO).await;
    let bus = b.clone();
    let first = tokio::spawn(async move { echo(&bus, "pair").await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _second = echo(&b, "pair").await;
    assert!(
        subscribed(&reg, "pair", "b"),
        "the second registration resolved before the cluster knew of the address"
    );
    let _first = first.await.unwrap();
}

/// A registration given up on while it is being advertised (a timeout
/// around it) leaves no consumer behind, and the subscription, which the
/// manager had written though its call had not returned, is withdrawn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_dropped_midway_leaves_no_consumer() {
    let reg = InProcessRegistry::new();
    let slow = Slow {
        inner: reg.manager(),
        // Far past the 50 ms the registration is given, even after a stall.
        subscribe: Duration::from_secs(3),
        unsubscribe: Duration::ZERO,
        write_first: true,
    };
    let (b, _nb) = start_slow_with(slow, "b").await;
    let r = tokio::time::timeout(Duration::from_millis(50), b.consumer("ghost").stream()).await;
    assert!(r.is_err(), "timed out while advertising");
    let sent = b.request("ghost", String::from("x")).await;
    assert!(
        matches!(sent, Err(BusError::NoHandlers { .. })),
        "no queue left registered without its consumer: {sent:?}"
    );
    // The subscription that was under way is withdrawn again.
    for _ in 0..500 {
        if !subscribed(&reg, "ghost", "b") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!subscribed(&reg, "ghost", "b"));
}

/// A header too long for a frame's string fails its own request (and an
/// answer's, its requester) instead of arriving cut short; the link stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_too_long_for_a_frame_fails_its_request_not_the_link() {
    let reg = InProcessRegistry::new();
    let (a, na) = start(&reg, "a").await;
    let (b, nb) = start(&reg, "b").await;
    let _e = echo(&b, "echo").await;
    let _long = b
        .consumer("long-answer")
        .handler(|mut m| async move {
            let opts = DeliveryOptions::new().header("h", "v".repeat(70_000));
            let _ = m.reply_with(String::from("x"), &opts);
        })
        .await
        .unwrap();
    routed(&a, "echo").await;
    routed(&a, "long-answer").await;
    let opts = DeliveryOptions::new().header("big", "x".repeat(70_000));
    let err = a
        .request_with("echo", String::from("hi"), &opts)
        .await
        .unwrap_err();
    assert_eq!(err.kind().as_str(), "ERROR", "{err:?}");
    assert!(err.to_string().contains("cannot cross nodes"), "{err}");
    let err = a.request("long-answer", ()).await.unwrap_err();
    assert!(err.to_string().contains("the reply"), "{err}");
    let r = a.request("echo", String::from("small")).await.unwrap();
    assert_eq!(r.body::<String>().unwrap(), "small");
    for n in [&na, &nb] {
        assert_eq!(n.counters().malformed.get(), 0);
        assert_eq!(n.counters().disconnects.get(), 0);
        assert_eq!(n.counters().encode_failures.get(), 1);
    }
}

/// A codec that fails after writing part of a body into the link's batch
/// (`encode_into` appends straight to it) fails that message or answer
/// alone: what it wrote is taken back, the frames around it go out whole,
/// and the link stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_codec_failing_midway_fails_its_message_not_the_link() {
    use bytes::{Bytes, BytesMut};
    use railyard_bus::{Body, CodecError, MessageCodec};

    /// Writes half its body, then fails.
    struct HalfThenFail;
    impl MessageCodec for HalfThenFail {
        fn name(&self) -> &str {
            "half"
        }
        fn encode(&self, _: &Body) -> Result<Bytes, CodecError> {
            Err(CodecError::NoDefault("half"))
        }
        fn encode_into(&self, _: &Body, out: &mut BytesMut) -> Result<(), CodecError> {
            out.extend_from_slice(b"half a bo");
            Err(CodecError::Malformed {
                codec: "half".into(),
                reason: "gave up midway".into(),
            })
        }
        fn decode(&self, _: Bytes) -> Result<Body, CodecError> {
            Err(CodecError::NoDefault("half"))
        }
    }
    #[derive(Debug)]
    struct Half;
    let reg = InProcessRegistry::new();
    let (a, na) = start(&reg, "a").await;
    let (b, nb) = start(&reg, "b").await;
    for bus in [&a, &b] {
        bus.register_codec(Arc::new(HalfThenFail)).unwrap();
        bus.set_default_codec::<Half>("half").unwrap();
    }
    let _e = echo(&b, "echo").await;
    let _h = b
        .consumer("half-answer")
        .handler(|mut m| async move {
            let _ = m.reply(Half);
        })
        .await
        .unwrap();
    routed(&a, "echo").await;
    routed(&a, "half-answer").await;
    let err = a.request("echo", Half).await.unwrap_err();
    assert!(err.to_string().contains("cannot cross nodes"), "{err}");
    let err = a.request("half-answer", ()).await.unwrap_err();
    assert!(err.to_string().contains("reply body cannot cross"), "{err}");
    // Messages queued around the failed one arrive intact.
    let (first, second) = tokio::join!(
        a.request("echo", String::from("before")),
        a.request("echo", String::from("after"))
    );
    assert_eq!(first.unwrap().body::<String>().unwrap(), "before");
    assert_eq!(second.unwrap().body::<String>().unwrap(), "after");
    for n in [&na, &nb] {
        assert_eq!(n.counters().malformed.get(), 0);
        assert_eq!(n.counters().disconnects.get(), 0);
    }
    assert_eq!(na.counters().encode_failures.get(), 1);
}

/// A node listening on every interface with a port the system picks
/// advertises the host it is told with the port it got, not `0.0.0.0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_picked_port_is_advertised_on_the_given_host() {
    let reg = InProcessRegistry::new();
    let bus = EventBus::new();
    let mut cfg = ClusterConfig::new("any", "0.0.0.0:0".parse().unwrap());
    cfg.advertise_host = Some("127.0.0.1".parse().unwrap());
    let node = ClusterNode::start(bus, Arc::new(reg.manager()), cfg)
        .await
        .expect("node starts");
    let addr = node.addr();
    assert_eq!(addr.ip().to_string(), "127.0.0.1");
    assert_ne!(addr.port(), 0);
    assert_eq!(reg.snapshot().members.get("any"), Some(&addr));
}

/// A node that dies without leaving stays a member until its lease
/// expires, but once its connection is lost it is no longer chosen: every
/// request goes to the address's other node at once, none waits for the
/// dead one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_connection_is_lost_is_skipped_before_it_leaves() {
    let reg = InProcessRegistry::new();
    let (a, _na) = start(&reg, "a").await;
    let (b, nb) = start(&reg, "b").await;
    let (c, nc) = start(&reg, "c").await;
    let _ea = echo(&a, "x").await;
    let _eb = echo(&b, "x").await;
    routed_to(&c, "x", 2).await;
    // Both answer while both are up.
    let opts = DeliveryOptions::new().timeout(Duration::from_secs(30));
    for i in 0..4u32 {
        let r = c.request_with("x", format!("up {i}"), &opts).await;
        assert!(r.is_ok(), "{r:?}");
    }
    let lost = nc.observer().counters().disconnects.get();
    drop(nb);
    drop(b);
    assert!(reg.snapshot().members.contains_key("b"), "still a member");
    // c's link to b sees the connection end (bounded wait).
    for _ in 0..1000 {
        if nc.observer().counters().disconnects.get() > lost {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(reg.snapshot().members.contains_key("b"), "still a member");
    // A request sent to b now would wait its whole 30 s and fail.
    let t0 = std::time::Instant::now();
    for i in 0..20u32 {
        let r = c.request_with("x", format!("after {i}"), &opts).await;
        assert!(r.is_ok(), "request {i}: {r:?}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "no request waited for the dead node: {:?}",
        t0.elapsed()
    );
}

/// A loopback address that refuses connections: a listener's, dropped.
fn refusing_addr() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// Registers `id` at `addr` with a subscription to `address`, as a node
/// that never serves it itself (a raw peer may later speak for it). Keep
/// the manager for the test's length.
async fn subscribed_member(
    reg: &InProcessRegistry,
    id: &str,
    addr: std::net::SocketAddr,
    address: &str,
) -> InProcessManager {
    let m = reg.manager();
    m.join(NodeInfo {
        id: id.into(),
        addr,
    })
    .await
    .expect("registers");
    m.subscribe(address, 1).await.expect("subscribes");
    m
}

/// Sends `n` requests to `x`, one after another, each with a 60 s timeout;
/// how many were answered, and the kinds of those that failed.
async fn ask_one_by_one(bus: &EventBus, n: usize) -> (usize, Vec<String>) {
    let opts = DeliveryOptions::new().timeout(Duration::from_secs(60));
    let mut ok = 0;
    let mut failed = Vec::new();
    for i in 0..n {
        match bus.request_with("x", format!("r{i}"), &opts).await {
            Ok(_) => ok += 1,
            Err(e) => failed.push(e.kind().as_str().to_owned()),
        }
    }
    (ok, failed)
}

/// Speaks for a member on `s` (whose HELLO, if it dials, is already
/// written): answers each PING with a PONG and fails each request with
/// RECIPIENT_FAILURE code 7, so a requester can tell it got there.
async fn answer_as_member(s: tokio::net::TcpStream) {
    use railyard_cluster::{FailKind, Frame, Mode};
    let (mut rd, mut wr) = s.into_split();
    let mut inbuf = bytes::BytesMut::new();
    loop {
        let mut out = bytes::BytesMut::new();
        while let Some(f) = Frame::decode(&mut inbuf, 1 << 20).unwrap() {
            match f {
                Frame::Ping(n) => Frame::Pong(n).encode(&mut out),
                Frame::Msg {
                    mode: Mode::Request,
                    id,
                    ..
                } => Frame::Fail {
                    id,
                    kind: FailKind::RecipientFailure,
                    code: 7,
                    message: "from the member".into(),
                }
                .encode(&mut out),
                _ => {}
            }
        }
        if !out.is_empty() && wr.write_all(&out).await.is_err() {
            return;
        }
        match rd.read_buf(&mut inbuf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Requests `x` (bounded: 100 tries) until one reaches the member that
/// answers with code 7 (see `answer_as_member`).
async fn reaches_the_member(bus: &EventBus) -> bool {
    let opts = DeliveryOptions::new().timeout(Duration::from_secs(10));
    for _ in 0..100 {
        if let Err(BusError::RecipientFailure { code: 7, .. }) =
            bus.request_with("x", String::from("?"), &opts).await
        {
            return true;
        }
    }
    false
}

/// Serves the member over `s` (see [`answer_as_member`]) until requests to
/// `x` reach it: it is chosen again.
async fn chosen_again(bus: &EventBus, s: tokio::net::TcpStream) {
    let member = tokio::spawn(answer_as_member(s));
    assert!(
        reaches_the_member(bus).await,
        "the member is never chosen again"
    );
    member.abort();
}

/// A HELLO from `node` (a raw peer speaking for that member), to send
/// first on its connection.
fn hello(node: &str) -> bytes::BytesMut {
    let mut out = bytes::BytesMut::new();
    railyard_cluster::Frame::Hello {
        version: railyard_cluster::VERSION,
        node: node.into(),
        cluster: "railyard".into(),
    }
    .encode(&mut out);
    out
}

/// 100 requests, one at a time with a 60 s timeout, all answered within
/// 20 s: at most one (queued on the link before it went down) failed, with
/// ERROR; the others went to the address's other target.
async fn answered_without_waiting(bus: &EventBus) {
    let (ok, failed) = tokio::time::timeout(Duration::from_secs(20), ask_one_by_one(bus, 100))
        .await
        .expect("a request waited for its 60 s timeout on a link that never connects");
    assert!(failed.iter().all(|k| k == "ERROR"), "{failed:?}");
    assert!(failed.len() <= 1, "{} requests failed", failed.len());
    assert_eq!(ok + failed.len(), 100);
}

/// A member whose advertised address refuses connections (a node
/// advertising 127.0.0.1 from another host, a partition) is not chosen
/// once a dial failed: requests go to the address's other target instead
/// of waiting for their timeout on a link that never connects. Once it can
/// be reached, it is chosen again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_address_refuses_connections_is_not_chosen() {
    let reg = InProcessRegistry::new();
    let dead = refusing_addr();
    // "z-dead" sorts above "a": a dials it, and every dial is refused.
    let _z = subscribed_member(&reg, "z-dead", dead, "x").await;
    let (a, _na) = start_with(&reg, "a", |c| c.backoff_max = Duration::from_millis(100)).await;
    let _here = echo(&a, "x").await;
    routed_to(&a, "x", 1).await;
    // One request may have been queued before the first dial failed: it
    // fails then, as on a lost connection.
    answered_without_waiting(&a).await;

    // Reachable again: a's next dial gets through and the member is chosen.
    let listener = tokio::net::TcpListener::bind(dead)
        .await
        .expect("the refusing port is free again");
    let (s, _) = tokio::time::timeout(Duration::from_secs(20), listener.accept())
        .await
        .expect("a dials the member again")
        .unwrap();
    chosen_again(&a, s).await;
}

/// A member that should dial this node and never does (the same partition
/// seen from the other side) is not chosen once the handshake timeout has
/// passed without a connection: what was queued for it fails (ERROR), and
/// requests go to the address's other target. Once it dials, it is chosen
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_never_dials_is_not_chosen_after_the_handshake_timeout() {
    use railyard_cluster::Frame;
    let reg = InProcessRegistry::new();
    // "a-silent" sorts below "b": b waits for it to dial, in vain.
    let _m = subscribed_member(&reg, "a-silent", refusing_addr(), "x").await;
    let (b, nb) = start_with(&reg, "b", |c| {
        c.handshake_timeout = Duration::from_millis(300);
    })
    .await;
    let _here = echo(&b, "x").await;
    routed_to(&b, "x", 1).await;
    answered_without_waiting(&b).await;

    // It dials at last: chosen again.
    let mut s = tokio::net::TcpStream::connect(nb.addr()).await.unwrap();
    let mut out = hello("a-silent");
    Frame::Ping(1).encode(&mut out);
    s.write_all(&out).await.unwrap();
    chosen_again(&b, s).await;
}

/// A request from another node that waits for room in a full consumer's
/// buffer is withdrawn when its timeout passes (answered TIMEOUT), and is
/// never delivered afterwards: it ran later with nobody waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_room_past_its_timeout_is_never_delivered() {
    use railyard_cluster::{FailKind, Frame, Mode};
    let reg = InProcessRegistry::new();
    let _peer = member(&reg, "a-peer").await;
    // No pings: the raw peer below never answers one.
    let (b, nb) = start_pinging(&reg, "b", Duration::from_secs(3600)).await;
    let seen = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let s2 = seen.clone();
    let slow = b
        .consumer("slow")
        .capacity(1)
        .paused()
        .handler(move |mut m| {
            let text = String::from_utf8_lossy(m.body::<bytes::Bytes>().unwrap()).into_owned();
            s2.lock().push(text);
            if m.expects_reply() {
                let _ = m.reply(String::from("handled"));
            }
            std::future::ready(())
        })
        .await
        .unwrap();
    // Its one slot taken.
    b.send("slow", bytes::Bytes::from_static(b"first")).unwrap();

    let mut s = tokio::net::TcpStream::connect(nb.addr()).await.unwrap();
    let mut out = hello("a-peer");
    let msg = |mode, id, timeout_ms, body: &'static [u8], out: &mut bytes::BytesMut| {
        Frame::Msg {
            mode,
            id,
            timeout_ms,
            address: "slow".into(),
            headers: railyard_bus::Headers::new(),
            codec: "bytes".into(),
            body: bytes::Bytes::from_static(body),
        }
        .encode(out);
    };
    // A request with a 200 ms timeout, and a send behind it (the same
    // address: it waits behind the request, in order).
    msg(Mode::Request, 1, 200, b"late", &mut out);
    msg(Mode::Send, 0, 0, b"after", &mut out);
    s.write_all(&out).await.unwrap();
    // b answers the request TIMEOUT when it withdraws it (bounded wait:
    // without that answer the test still resumes, and the check below
    // says what happened).
    let mut inbuf = bytes::BytesMut::new();
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(f) = Frame::decode(&mut inbuf, 1 << 20).unwrap() {
                match f {
                    Frame::Fail { id, kind, .. } => return Some((id, kind)),
                    Frame::Reply { id, .. } => panic!("request {id} answered while paused"),
                    _ => continue,
                }
            }
            if s.read_buf(&mut inbuf).await.unwrap_or(0) == 0 {
                return None;
            }
        }
    })
    .await
    .ok()
    .flatten();
    slow.resume();
    for _ in 0..1000 {
        if seen.lock().iter().any(|b| b == "after") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        *seen.lock(),
        vec!["first".to_string(), "after".to_string()],
        "the handler ran a request its requester had given up on"
    );
    assert_eq!(answer, Some((1, FailKind::Timeout)));
}

/// Settings a node cannot run with are refused by `start`, which names the
/// setting, before the node joins: a zero ping interval (every link task
/// panicked while `start` returned Ok), a ping deadline no longer than the
/// interval (links flap), a zero reconnect backoff (a dial loop without a
/// pause), a zero handshake timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_a_node_cannot_run_with_are_refused_at_start() {
    let reg = InProcessRegistry::new();
    type Set = fn(&mut ClusterConfig);
    let cases: [(&str, Set); 4] = [
        ("ping_interval", |c| c.ping_interval = Duration::ZERO),
        ("ping_timeout", |c| c.ping_timeout = c.ping_interval),
        ("backoff_max", |c| c.backoff_max = Duration::ZERO),
        ("handshake_timeout", |c| {
            c.handshake_timeout = Duration::ZERO;
        }),
    ];
    for (setting, set) in cases {
        let mut cfg = ClusterConfig::new("a", "127.0.0.1:0".parse().unwrap());
        set(&mut cfg);
        let Err(e) = ClusterNode::start(EventBus::new(), Arc::new(reg.manager()), cfg).await else {
            panic!("start accepted an unusable {setting}");
        };
        assert!(
            matches!(&e, railyard_cluster::ClusterError::Config { setting: s, .. } if *s == setting),
            "{setting}: {e:?}"
        );
        assert!(e.to_string().contains(setting), "{setting}: {e}");
    }
    assert!(
        reg.snapshot().members.is_empty(),
        "a node refused at start joined"
    );
}
