//! The client against the in-process cluster double: routing, views that
//! disagree, periodic refresh, and malformed, too deep or too large replies
//! from a fake server.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use railyard_redis::double::ClusterDouble;
use railyard_redis::slot::key_slot;
use railyard_redis::{ClusterClient, ClusterClientBuilder, Cmd, Protocol, RedisError, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A client of `d` with a periodic round every `period_ms`, a deep check
/// every `deep_every`th round, and adaptive refresh off (so that only the
/// periodic rounds refresh).
async fn periodic_client(d: &ClusterDouble, period_ms: u64, deep_every: u32) -> ClusterClient {
    ClusterClient::builder(d.addrs())
        .refresh_period(Some(Duration::from_millis(period_ms)))
        .deep_check_every(deep_every)
        .adaptive_refresh(false, Duration::from_secs(1))
        .build()
        .await
        .unwrap()
}

/// Waits until `done` holds for the client (at most 10 s; fails the test
/// with the refresh counters otherwise).
async fn until(c: &ClusterClient, done: impl Fn(&ClusterClient) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done(c) {
        assert!(
            std::time::Instant::now() < deadline,
            "gave up waiting: {:?}",
            c.refresh_stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn commands_route_to_the_slot_owner() {
    let d = ClusterDouble::start(9, 1, None).await.unwrap();
    let c = ClusterClient::builder(&d.addrs()[..1])
        .build()
        .await
        .unwrap();
    assert_eq!(c.table().nodes().len(), 18);
    assert_eq!(c.table().uncovered(), 0);
    for i in 0..200 {
        c.set(format!("k{i}"), format!("v{i}")).await.unwrap();
    }
    for i in 0..200 {
        assert_eq!(
            c.get(format!("k{i}")).await.unwrap().as_deref(),
            Some(format!("v{i}").as_bytes())
        );
    }
    assert_eq!(c.incr("counter").await.unwrap(), 1);
    assert_eq!(c.incr("counter").await.unwrap(), 2);
    // No command needed a redirection, so nothing triggered a refresh.
    assert_eq!(c.refresh_stats().adaptive, 0);
}

#[tokio::test]
async fn disagreeing_views_resolve_by_config_epoch() {
    let d = ClusterDouble::start(6, 1, None).await.unwrap();
    let c = ClusterClient::builder(d.addrs())
        .adaptive_refresh(false, Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    let slot = key_slot(b"disputed");
    let old_owner = c.table().shard(slot).unwrap().master.clone();
    // Only two nodes (the new owner, master 5, and one replica) know that the
    // slot moved; the other ten still report the old owner.
    let mut t = d.topology(0);
    t.move_slots(slot, slot, 5);
    d.apply(t, Some(&[5, 11]));
    c.refresh_now().await.unwrap();
    let stats = c.refresh_stats();
    assert_eq!(stats.last_views, 12);
    assert_eq!(stats.last_distinct_views, 2);
    let table = c.table();
    let new_owner = &table.shard(slot).unwrap().master;
    assert_ne!(*new_owner, old_owner);
    assert_eq!(&**new_owner, d.addrs()[5].as_str());
    // Every other slot stays where the majority put it.
    assert_eq!(table.uncovered(), 0);
    assert_eq!(table.fingerprints().len(), 2);
    // And commands on the disputed slot reach the new owner.
    c.set("disputed", "x").await.unwrap();
    assert_eq!(c.get("disputed").await.unwrap().as_deref(), Some(&b"x"[..]));
}

#[tokio::test]
async fn the_periodic_check_finds_a_moved_slot() {
    let d = ClusterDouble::start(3, 1, None).await.unwrap();
    let c = ClusterClient::builder(d.addrs())
        .refresh_period(Some(Duration::from_millis(50)))
        .adaptive_refresh(false, Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    let slot = key_slot(b"moving");
    let mut t = d.topology(0);
    let to = (0..3)
        .find(|&m| d.addrs()[m] != *c.table().shard(slot).unwrap().master)
        .unwrap();
    t.move_slots(slot, slot, to);
    d.apply(t, None);
    let mut moved = false;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if *c.table().shard(slot).unwrap().master == *d.addrs()[to] {
            moved = true;
            break;
        }
    }
    assert!(moved, "the periodic refresh never picked up the new owner");
    let s = c.refresh_stats();
    assert!(s.checks >= 1);
    assert!(
        s.full_refreshes >= 2,
        "initial plus one after the check: {s:?}"
    );
    assert_eq!(s.adaptive, 0);
}

#[tokio::test]
async fn an_unchanged_cluster_costs_only_probes_and_checks() {
    let d = ClusterDouble::start(3, 1, None).await.unwrap();
    let c = ClusterClient::builder(d.addrs())
        .refresh_period(Some(Duration::from_millis(20)))
        .deep_check_every(3)
        .build()
        .await
        .unwrap();
    until(&c, |c| c.refresh_stats().checks >= 3).await;
    let s = c.refresh_stats();
    // Two probes (CLUSTER INFO) for every deep check (CLUSTER NODES).
    assert!(s.probes >= 2 * (s.checks - 1), "{s:?}");
    assert_eq!(s.full_refreshes, 1, "only the initial refresh: {s:?}");
    assert_eq!(s.swaps, 1);
}

/// Probes alone (no deep check after the one that confirms the first
/// baseline) see a slot moved at a new epoch, even while only its new owner
/// knows.
#[tokio::test]
async fn a_probe_sees_a_new_epoch() {
    let d = ClusterDouble::start(3, 1, None).await.unwrap();
    let c = periodic_client(&d, 20, u32::MAX).await;
    // Round 1 learns the baseline (a probe, then a deep check of the same
    // nodes); round 2 on are probes only.
    until(&c, |c| c.refresh_stats().probes >= 2).await;
    assert_eq!(c.refresh_stats().checks, 1, "{:?}", c.refresh_stats());
    let slot = key_slot(b"probed");
    let to = (0..3)
        .find(|&m| d.addrs()[m] != *c.table().shard(slot).unwrap().master)
        .unwrap();
    let mut t = d.topology(0);
    t.move_slots(slot, slot, to);
    // Only the new owner knows yet; its higher epoch wins the slot.
    d.apply(t, Some(&[to]));
    until(&c, |c| {
        *c.table().shard(slot).unwrap().master == *d.addrs()[to]
    })
    .await;
    let s = c.refresh_stats();
    assert_eq!(s.checks, 1, "seen by a probe: {s:?}");
    assert_eq!(s.full_refreshes, 2, "{s:?}");
    assert_eq!(s.adaptive, 0);
}

/// What a summary cannot show (a slot reassigned with no epoch bump), the
/// deep check finds.
#[tokio::test]
async fn a_deep_check_sees_what_a_probe_cannot() {
    let d = ClusterDouble::start(3, 1, None).await.unwrap();
    let c = periodic_client(&d, 20, 4).await;
    // Past the first round, which learns the baseline with a deep check.
    until(&c, |c| c.refresh_stats().probes >= 2).await;
    let checks_before = c.refresh_stats().checks;
    let slot = key_slot(b"by-hand");
    let to = (0..3)
        .find(|&m| d.addrs()[m] != *c.table().shard(slot).unwrap().master)
        .unwrap();
    let mut t = d.topology(0);
    let epochs: Vec<u64> = t.nodes.iter().map(|n| n.epoch).collect();
    t.move_slots(slot, slot, to);
    for (n, e) in t.nodes.iter_mut().zip(epochs) {
        n.epoch = e;
    }
    d.apply(t, None);
    until(&c, |c| {
        *c.table().shard(slot).unwrap().master == *d.addrs()[to]
    })
    .await;
    let s = c.refresh_stats();
    assert!(
        s.checks > checks_before,
        "found by a later deep check: {s:?}"
    );
    assert_eq!(s.full_refreshes, 2, "{s:?}");
}

/// Nodes that keep seeing the cluster differently (here half of them list
/// one more node, as during a join that never completes): their summaries
/// cost deep checks until each shape is learned, never full refreshes.
#[tokio::test]
async fn a_lasting_disagreement_costs_no_full_refreshes() {
    let d = ClusterDouble::start(3, 1, None).await.unwrap();
    let mut t = d.topology(0);
    let mut extra = t.nodes[5].clone();
    extra.id = "f".repeat(40);
    extra.port = 1;
    extra.epoch = 1;
    t.nodes.push(extra);
    d.apply(t, Some(&[0, 2, 4]));
    let c = periodic_client(&d, 10, u32::MAX).await;
    until(&c, |c| c.refresh_stats().probes >= 30).await;
    let s = c.refresh_stats();
    assert_eq!(s.full_refreshes, 1, "only the initial one: {s:?}");
    // The round that learns the baseline, then at most one per group of
    // nodes whose shape is new.
    assert!(s.checks <= 3, "{s:?}");
}

/// A one-node cluster on loopback that answers `CLUSTER NODES` and `HELLO`
/// properly and every other command with `reply`. Returns its address, a
/// count of accepted connections, and the accept loop (abort it at the end).
async fn fake_node(reply: Vec<u8>) -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let acc = accepted.clone();
    let reply: Arc<[u8]> = reply.into();
    let server = tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            acc.fetch_add(1, Ordering::SeqCst);
            let reply = reply.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                loop {
                    let n = match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let req = String::from_utf8_lossy(&buf[..n]).to_ascii_uppercase();
                    let out = if req.contains("NODES") {
                        let text = format!(
                            "{:040x} 127.0.0.1:{port}@{} myself,master - 0 0 1 connected 0-16383\n",
                            1,
                            u32::from(port) + 10000
                        );
                        format!("${}\r\n{text}\r\n", text.len()).into_bytes()
                    } else if req.contains("HELLO") {
                        b"%1\r\n+proto\r\n:3\r\n".to_vec()
                    } else {
                        reply.to_vec()
                    };
                    if s.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("127.0.0.1:{port}"), accepted, server)
}

fn client_of(addr: &str) -> ClusterClientBuilder {
    ClusterClient::builder([addr]).adaptive_refresh(false, Duration::from_secs(1))
}

/// The detail of a [`RedisError::Protocol`]; fails the test for anything else.
fn protocol_detail(r: Result<Value, RedisError>) -> String {
    match r {
        Err(RedisError::Protocol { detail, .. }) => detail,
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

/// Runs `cmd` again after the connection that just failed was closed: it
/// must go out on a connection the fake node accepted since (so the failed
/// one was closed and re-opened, and the process is still here); returns
/// the protocol error's detail that fresh connection got.
async fn again_on_a_fresh_connection(
    c: &ClusterClient,
    cmd: &Cmd,
    accepted: &AtomicUsize,
) -> String {
    let before = accepted.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let detail = protocol_detail(c.cmd(cmd).await);
    assert!(
        accepted.load(Ordering::SeqCst) > before,
        "the failed connection was not re-opened"
    );
    detail
}

#[tokio::test]
async fn a_malformed_reply_closes_the_connection_with_a_typed_error() {
    let (addr, accepted, server) = fake_node(b"?this is not RESP\r\n".to_vec()).await;
    let c = client_of(&addr).build().await.unwrap();
    let err = c.get("k").await.unwrap_err();
    assert!(matches!(err, RedisError::Protocol { .. }), "{err:?}");
    // The connection was closed and is re-opened for the next command.
    let err = c.get("k").await.unwrap_err();
    assert!(
        matches!(
            err,
            RedisError::Protocol { .. } | RedisError::Disconnected { .. }
        ),
        "{err:?}"
    );
    // A fresh connection gets the server's junk again: a protocol error,
    // not a disconnection.
    again_on_a_fresh_connection(&c, &Cmd::new("GET").key("k"), &accepted).await;
    server.abort();
}

#[tokio::test]
async fn a_deeply_nested_reply_is_a_typed_error_not_a_stack_overflow() {
    // 100,000 nested arrays, 400 KB: decoded recursively, this aborts the
    // whole test process with a stack overflow.
    let mut deep = b"*1\r\n".repeat(100_000);
    deep.extend_from_slice(b":1\r\n");
    let (addr, accepted, server) = fake_node(deep).await;
    for proto in [Protocol::Resp2, Protocol::Resp3] {
        let c = client_of(&addr).protocol(proto).build().await.unwrap();
        let get = Cmd::new("GET").key("k");
        let detail = protocol_detail(c.cmd(&get).await);
        assert!(
            detail.contains("deeper than 64 levels"),
            "{proto:?}: {detail}"
        );
        // Only that connection was closed: a fresh one gets the same typed
        // error, and the process is still here to see it.
        let detail = again_on_a_fresh_connection(&c, &get, &accepted).await;
        assert!(
            detail.contains("deeper than 64 levels"),
            "{proto:?}: {detail}"
        );
    }
    server.abort();
}

#[tokio::test]
async fn a_reply_nested_to_the_limit_still_arrives() {
    // 64 nested maps, the deepest allowed and the decoder's most
    // stack-hungry shape, decoded on the client's own runtime.
    let mut deep = b"%1\r\n+k\r\n".repeat(64);
    deep.extend_from_slice(b":7\r\n");
    let (addr, _, server) = fake_node(deep).await;
    let c = client_of(&addr)
        .protocol(Protocol::Resp3)
        .build()
        .await
        .unwrap();
    let mut v = c.cmd(&Cmd::new("GET").key("k")).await.unwrap();
    let mut depth = 0;
    while let Value::Map(mut m) = v {
        assert_eq!(m.len(), 1);
        v = m.pop().unwrap().1;
        depth += 1;
    }
    assert_eq!((depth, v), (64, Value::Int(7)));
    server.abort();
}

#[tokio::test]
async fn a_big_reply_is_decoded_off_the_connection_and_a_bad_one_fails_alone() {
    // 3,000 integers: too much to decode on the connection's task, so the
    // caller decodes it on the blocking pool.
    let mut many = b"*3000\r\n".to_vec();
    for i in 0..3_000 {
        many.extend(format!(":{i}\r\n").bytes());
    }
    for proto in [Protocol::Resp2, Protocol::Resp3] {
        let (addr, _, server) = fake_node(many.clone()).await;
        let c = client_of(&addr).protocol(proto).build().await.unwrap();
        let v = c.cmd(&Cmd::new("GET").key("k")).await.unwrap();
        let want: Vec<Value> = (0..3_000).map(Value::Int).collect();
        assert_eq!(v, Value::Array(want), "{proto:?}");
        server.abort();
    }
    // An error reply that long reaches the caller as the same typed error.
    let mut long = b"-WRONGTYPE ".to_vec();
    long.extend(b"x".repeat(10_000));
    long.extend(b"\r\n");
    let (addr, _, server) = fake_node(long).await;
    let c = client_of(&addr).build().await.unwrap();
    let err = c.get("k").await.unwrap_err();
    assert!(
        matches!(&err, RedisError::Server { kind, message, .. } if kind == "WRONGTYPE" && message.len() == 10_000),
        "{err:?}"
    );
    server.abort();
    // The last integer is not one: the walk found where the reply ends, the
    // decoder refuses it off the connection's task. The caller gets the
    // protocol error; the connection keeps its framing and stays open.
    let mut bad = many.clone();
    bad.truncate(bad.len() - b":2999\r\n".len());
    bad.extend(b":x\r\n");
    let (addr, accepted, server) = fake_node(bad).await;
    let c = client_of(&addr).build().await.unwrap();
    let get = Cmd::new("GET").key("k");
    let first = protocol_detail(c.cmd(&get).await);
    let before = accepted.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(protocol_detail(c.cmd(&get).await), first);
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        before,
        "the connection was reopened"
    );
    server.abort();
}

#[tokio::test]
async fn a_reply_over_max_reply_size_closes_the_connection() {
    // A declared length over the limit is refused at its header, before
    // any of the payload is buffered.
    let (addr, accepted, server) = fake_node(b"$1000000\r\nxyz".to_vec()).await;
    let c = client_of(&addr)
        .max_reply_size(64 * 1024)
        .build()
        .await
        .unwrap();
    let get = Cmd::new("GET").key("k");
    let detail = protocol_detail(c.cmd(&get).await);
    assert!(detail.contains("1000000-byte string"), "{detail}");
    // The connection was closed, not left holding a partial reply.
    let detail = again_on_a_fresh_connection(&c, &get, &accepted).await;
    assert!(detail.contains("1000000-byte string"), "{detail}");
    server.abort();
    // Elements that are each small but never end: refused once the
    // buffered reply passes the limit (80 KB sent, 64 KiB allowed).
    let mut endless = b"*60000\r\n".to_vec();
    endless.extend(b":1\r\n".repeat(20_000));
    let (addr, _, server) = fake_node(endless.clone()).await;
    let c = client_of(&addr)
        .max_reply_size(64 * 1024)
        .build()
        .await
        .unwrap();
    let detail = protocol_detail(c.cmd(&Cmd::new("GET").key("k")).await);
    assert!(
        detail.contains("incomplete reply already holds"),
        "{detail}"
    );
    // Under the default limit the same bytes are just a reply in progress:
    // the command times out waiting for the rest.
    let c = client_of(&addr)
        .command_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let err = c.cmd(&Cmd::new("GET").key("k")).await.unwrap_err();
    assert!(matches!(err, RedisError::Timeout { .. }), "{err:?}");
    server.abort();
    let err = ClusterClient::builder([addr])
        .max_reply_size(100)
        .build()
        .await
        .unwrap_err();
    assert!(matches!(err, RedisError::Config(_)), "{err:?}");
}

#[tokio::test]
async fn bad_configuration_is_a_typed_error() {
    let err = ClusterClient::builder(["127.0.0.1:1"])
        .sample_size(0)
        .build()
        .await
        .unwrap_err();
    assert!(matches!(err, RedisError::Config(_)));
    let err = ClusterClient::builder(["127.0.0.1:1"])
        .connect_timeout(Duration::from_millis(200))
        .build()
        .await
        .unwrap_err();
    assert!(matches!(err, RedisError::NoSeed { .. }), "{err:?}");
}

#[tokio::test]
async fn the_seed_service_sets_and_gets_through_the_cluster() {
    use railyard_redis::service::TestService;
    let d = ClusterDouble::start(3, 1, None).await.unwrap();
    let c = ClusterClient::builder(d.addrs()).build().await.unwrap();
    let svc = TestService::new(c, "test");
    let r = svc.app(&hyper::Method::GET, "/test").await;
    assert_eq!(r.status(), 200);
    use http_body_util::BodyExt;
    let body = r.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"ok");
    let r = svc.app(&hyper::Method::GET, "/stats").await;
    assert_eq!(r.status(), 200);
    let stats: serde_json::Value =
        serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(stats["shards"], 3);
    assert_eq!(stats["refresh"]["full_refreshes"], 1);
    // One /test so far; reading /stats resets the handler times.
    assert_eq!(stats["test_handler_us"]["count"], 1);
    assert!(stats["test_handler_us"]["max"].as_u64().unwrap() >= 1);
    let r = svc.app(&hyper::Method::GET, "/stats").await;
    let stats: serde_json::Value =
        serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(stats["test_handler_us"]["count"], 0);
    assert_eq!(svc.app(&hyper::Method::GET, "/nope").await.status(), 404);
    assert_eq!(svc.app(&hyper::Method::POST, "/test").await.status(), 405);
}

#[tokio::test]
async fn replica_reads_go_to_replicas_and_writes_to_masters() {
    use railyard_redis::ReadFrom;
    // 3 masters (nodes 0-2), replicas 3-5 (replica of master i is node 3 + i).
    let d = ClusterDouble::start(3, 1, None).await.unwrap();
    let c = ClusterClient::builder(d.addrs())
        .read_from(ReadFrom::Replica)
        .build()
        .await
        .unwrap();
    for i in 0..30 {
        c.set(format!("r{i}"), "v").await.unwrap();
    }
    let masters: u64 = (0..3).map(|i| d.served(i)).sum();
    assert_eq!(masters, 30);
    for i in 0..30 {
        assert_eq!(
            c.get(format!("r{i}")).await.unwrap().as_deref(),
            Some(&b"v"[..])
        );
    }
    // Every GET was served by a replica (READONLY was sent), none redirected.
    let replicas: u64 = (3..6).map(|i| d.served(i)).sum();
    assert_eq!(replicas, 30);
    assert_eq!((0..3).map(|i| d.served(i)).sum::<u64>(), 30);
}

/// A node that answers CLUSTER NODES (it owns every slot) and nothing else.
async fn silent_node() -> (u16, tokio::task::JoinHandle<()>) {
    let view = Arc::new(std::sync::Mutex::new(String::new()));
    let (port, h) = silent_node_with_view(view.clone()).await;
    *view.lock().unwrap() = owns_every_slot(port);
    (port, h)
}

/// A `CLUSTER NODES` view in which the node on `port` owns every slot.
fn owns_every_slot(port: u16) -> String {
    format!(
        "{:040x} 127.0.0.1:{port}@1 myself,master - 0 0 1 connected 0-16383\n",
        1
    )
}

#[tokio::test]
async fn a_full_queue_is_a_typed_error_and_a_silent_node_a_timeout() {
    let (port, server) = silent_node().await;
    let c = ClusterClient::builder([format!("127.0.0.1:{port}")])
        .queue_capacity(1)
        .max_in_flight(1)
        .command_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let results = futures::future::join_all((0..4).map(|i| {
        let c = c.clone();
        async move { c.get(format!("k{i}")).await }
    }))
    .await;
    let full = results
        .iter()
        .filter(|r| matches!(r, Err(RedisError::QueueFull { capacity: 1, .. })))
        .count();
    let timeouts = results
        .iter()
        .filter(|r| matches!(r, Err(RedisError::Timeout { .. })))
        .count();
    assert!(full >= 1, "{results:?}");
    assert!(timeouts >= 1, "{results:?}");
    assert_eq!(full + timeouts, 4, "{results:?}");
    server.abort();
}

/// A node that answers `CLUSTER NODES` with whatever `view` holds, and
/// nothing else: a master gone silent without a reset.
async fn silent_node_with_view(
    view: Arc<std::sync::Mutex<String>>,
) -> (u16, tokio::task::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let h = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let view = view.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                loop {
                    let n = match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if String::from_utf8_lossy(&buf[..n])
                        .to_ascii_uppercase()
                        .contains("NODES")
                    {
                        let text = view.lock().unwrap().clone();
                        let reply = format!("${}\r\n{text}\r\n", text.len());
                        if s.write_all(reply.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (port, h)
}

/// A master that goes silent without a reset (powered off, partitioned)
/// never drops its connection, so only timeouts tell: a timeout triggers a
/// refresh, which finds the slots' new owner after a failover. (Before, the
/// client kept sending to the silent node until a periodic refresh, off by
/// default.)
#[tokio::test]
async fn a_timeout_refreshes_the_table_and_finds_the_new_owner() {
    let d = ClusterDouble::start(1, 0, None).await.unwrap();
    let view = Arc::new(std::sync::Mutex::new(String::new()));
    let (port, server) = silent_node_with_view(view.clone()).await;
    *view.lock().unwrap() = owns_every_slot(port);
    let c = ClusterClient::builder([format!("127.0.0.1:{port}")])
        .command_timeout(Duration::from_millis(200))
        .adaptive_refresh(true, Duration::from_millis(10))
        .build()
        .await
        .unwrap();
    assert_eq!(
        &*c.table().shard(0).unwrap().master,
        format!("127.0.0.1:{port}")
    );
    // The failover: the silent node's slots now belong to the double's node
    // (the view every node would report).
    *view.lock().unwrap() = String::from_utf8(d.cluster_nodes_text(0).to_vec()).unwrap();
    let first = c.get("k").await;
    assert!(
        matches!(first, Err(RedisError::Timeout { .. })),
        "{first:?}"
    );
    let new_owner = d.addrs()[0].clone();
    until(&c, |c| {
        *c.table().shard(key_slot(b"k")).unwrap().master == *new_owner
    })
    .await;
    assert!(c.refresh_stats().adaptive >= 1);
    c.set("k", "v").await.unwrap();
    assert_eq!(c.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));
    server.abort();
}

/// DEL over keys of many slots (one command per slot, all in flight at
/// once) counts every key removed, and only those that existed.
#[tokio::test]
async fn del_across_slots_counts_every_removed_key() {
    let d = ClusterDouble::start(3, 0, None).await.unwrap();
    let c = ClusterClient::builder(d.addrs()).build().await.unwrap();
    let keys: Vec<String> = (0..300).map(|i| format!("del-{i}")).collect();
    for k in &keys[..200] {
        c.set(k.as_str(), "v").await.unwrap();
    }
    assert_eq!(c.del(&keys).await.unwrap(), 200);
    assert_eq!(c.del(&keys).await.unwrap(), 0);
    for k in &keys {
        assert_eq!(c.get(k.as_str()).await.unwrap(), None);
    }
}

/// A seed that is down (seeds stay refresh targets) does not set off a full
/// refresh every reconnect backoff: the topology connections' failures fire
/// no adaptive refresh (the refresh that uses them sees them itself). It
/// did, for ever: the seed-002 load this client exists to avoid.
#[tokio::test]
async fn a_dead_seed_does_not_trigger_refreshes() {
    let d = ClusterDouble::start(3, 0, None).await.unwrap();
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let mut seeds: Vec<String> = d.addrs().iter().map(ToString::to_string).collect();
    seeds.push(dead);
    let c = ClusterClient::builder(&seeds)
        .adaptive_refresh(true, Duration::from_millis(100))
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(100))
        .build()
        .await
        .unwrap();
    c.set("k", "v").await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let s = c.refresh_stats();
    assert_eq!(s.adaptive, 0, "{s:?}");
    assert_eq!(s.full_refreshes, 1, "only the initial refresh: {s:?}");
}

/// Commands that would change the shared pipelined connection's state are
/// refused before they are sent (a MULTI made other callers' SETs answer
/// QUEUED, read as success); ordinary ones, and XREAD without BLOCK, go.
#[tokio::test]
async fn commands_that_change_the_shared_connection_are_refused() {
    let d = ClusterDouble::start(3, 0, None).await.unwrap();
    let c = ClusterClient::builder(d.addrs()).build().await.unwrap();
    for cmd in [
        Cmd::new("MULTI"),
        Cmd::new("subscribe").arg("news"),
        Cmd::new("BLPOP").key("q").arg(0),
        Cmd::new("CLIENT").arg("TRACKING").arg("on"),
        Cmd::new("XREAD")
            .arg("BLOCK")
            .arg(0)
            .arg("STREAMS")
            .key("s")
            .arg("$"),
        Cmd::new("hello").arg(3),
        Cmd::new("READWRITE"),
    ] {
        let e = c.cmd(&cmd).await.unwrap_err();
        assert!(matches!(e, RedisError::StatefulCommand(_)), "{e}");
    }
    // A stream named "block" is not the BLOCK option.
    let not_blocking = Cmd::new("XREAD").arg("STREAMS").key("block").arg("0");
    assert!(
        !matches!(
            c.cmd(&not_blocking).await,
            Err(RedisError::StatefulCommand(_))
        ),
        "XREAD STREAMS block 0 is not blocking"
    );
    // Still usable: a plain SET and GET answer.
    c.set("k", "v").await.unwrap();
    assert_eq!(c.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));
}

/// A replica that cannot be reached (down, not yet flagged failed): a read
/// retried after it failed there goes to the master, which answers,
/// instead of retrying replicas until the command timeout.
#[tokio::test]
async fn a_read_falls_back_to_the_master_when_its_replica_is_unreachable() {
    use railyard_redis::double::Topology;
    use railyard_redis::ReadFrom;
    let d = ClusterDouble::start(3, 0, None).await.unwrap();
    let mut ports: Vec<u16> = d
        .addrs()
        .iter()
        .map(|a| a.rsplit(':').next().unwrap().parse().unwrap())
        .collect();
    for _ in 0..3 {
        // A port nothing listens on.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        ports.push(l.local_addr().unwrap().port());
    }
    d.apply(Topology::generate(3, &ports), None);
    let c = ClusterClient::builder(d.addrs())
        .read_from(ReadFrom::Replica)
        .command_timeout(Duration::from_secs(2))
        .adaptive_refresh(false, Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    assert_eq!(c.table().nodes().len(), 6, "the view lists the replicas");
    c.set("k", "v").await.unwrap();
    let t0 = std::time::Instant::now();
    assert_eq!(c.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
}
