//! The etcd manager against a real etcd (Debian's `etcd-server`) started on
//! free loopback ports for each test.

use std::sync::Arc;
use std::time::Duration;

use railyard_bus::{DeliveryOptions, EventBus};
use railyard_cluster::{
    ClusterConfig, ClusterManager, ClusterNode, EtcdConfig, EtcdManager, EtcdServer,
};

async fn manager(etcd: &EtcdServer, ttl: Duration) -> Arc<EtcdManager> {
    let mut cfg = EtcdConfig::new(vec![etcd.endpoint()]);
    cfg.lease_ttl = ttl;
    // Far above a loaded machine's etcd round trip (a put waits for its
    // fsync); also the gRPC keep-alive timeout.
    cfg.op_timeout = Duration::from_secs(5);
    Arc::new(EtcdManager::connect(cfg).await.expect("etcd reachable"))
}

/// A manager joined as node "a" (at an address nobody dials), without a
/// cluster node: the tests that use it look at etcd's keys only.
async fn joined_as_a(etcd: &EtcdServer, ttl: Duration) -> Arc<EtcdManager> {
    let m = manager(etcd, ttl).await;
    m.join(railyard_cluster::NodeInfo {
        id: "a".into(),
        addr: "127.0.0.1:9".parse().unwrap(),
    })
    .await
    .unwrap();
    m
}

async fn start(
    etcd: &EtcdServer,
    id: &str,
    ttl: Duration,
) -> (EventBus, ClusterNode, Arc<EtcdManager>) {
    let bus = EventBus::new();
    let m = manager(etcd, ttl).await;
    let mut cfg = ClusterConfig::new(id, "127.0.0.1:0".parse().unwrap());
    cfg.ping_interval = Duration::from_millis(200);
    cfg.ping_timeout = Duration::from_secs(2);
    let node = ClusterNode::start(bus.clone(), m.clone(), cfg)
        .await
        .expect("node joins");
    (bus, node, m)
}

/// Polls `cond` every 20 ms for at most `secs`.
async fn eventually(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..secs * 50 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting until {what}");
}

async fn echo(bus: &EventBus, address: &str) -> railyard_bus::Consumer {
    bus.consumer(address)
        .handler(|mut m| async move {
            let b = m.take_body();
            let _ = m.reply(b);
        })
        .await
        .unwrap()
}

/// A subscription carries the node's consumer count (other nodes weight
/// their sends by it); a later `subscribe` replaces it, and a key written
/// by an older node (empty value) counts as one consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_carries_its_consumer_count() {
    let etcd = EtcdServer::start().expect("etcd starts");
    let m = joined_as_a(&etcd, Duration::from_secs(5)).await;
    // The view is what the node's follower read back from etcd's feed.
    let view = m.view();
    let count = |address: &str| {
        view.borrow()
            .subscriptions
            .get(address)
            .and_then(|n| n.get("a").copied())
    };
    m.subscribe("x", 3).await.unwrap();
    eventually(10, "another node sees a's 3 consumers", || {
        count("x") == Some(3)
    })
    .await;
    m.subscribe("x", 2).await.unwrap();
    eventually(10, "the count follows", || count("x") == Some(2)).await;
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    c.put("/railyard/railyard/subs/a/old", "", None)
        .await
        .unwrap();
    eventually(10, "an old empty value counts as one", || {
        count("old") == Some(1)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_propagate_and_requests_cross_nodes() {
    let etcd = EtcdServer::start().expect("etcd starts");
    let (a, na, _ma) = start(&etcd, "node-a", Duration::from_secs(5)).await;
    let (b, _nb, mb) = start(&etcd, "node-b", Duration::from_secs(5)).await;
    // Once b's registration resolved, etcd holds it.
    let _e = echo(&b, "echo").await;
    let view = mb.view();
    eventually(10, "b sees its own subscription", || {
        view.borrow().subscriptions.contains_key("echo")
    })
    .await;
    eventually(10, "a routes echo to b", || {
        a.remote_addresses().iter().any(|x| x == "echo")
    })
    .await;
    let r = a.request("echo", String::from("over etcd")).await.unwrap();
    assert_eq!(r.body::<String>().unwrap(), "over etcd");
    assert!(na.view().members.contains_key("node-b"));
    // A local consumer of the same name on a joins the round-robin.
    let mut local = a.consumer("echo").stream().await.unwrap();
    for _ in 0..10 {
        a.send("echo", String::from("x")).unwrap();
    }
    use futures::StreamExt;
    for _ in 0..5 {
        tokio::time::timeout(Duration::from_secs(5), local.next())
            .await
            .expect("half the sends stay local")
            .unwrap();
    }
    assert_eq!(local.stats().received, 5);
}

/// A live node whose lease is lost (here revoked; in life, an outage of
/// etcd longer than the TTL) drops out of the others' views, registers again
/// with its subscriptions, and is routed to again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_node_whose_lease_is_lost_comes_back() {
    let etcd = EtcdServer::start().expect("etcd starts");
    let (a, na, _ma) = start(&etcd, "node-a", Duration::from_secs(3)).await;
    let (b, _nb, _mb) = start(&etcd, "node-b", Duration::from_secs(3)).await;
    let _e = echo(&b, "svc").await;
    eventually(10, "a routes svc to b", || !a.remote_addresses().is_empty()).await;
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    // b's lease: the one its node key is under.
    let key = c
        .get("/railyard/railyard/nodes/node-b", None)
        .await
        .unwrap();
    let lease = key.kvs()[0].lease();
    c.lease_revoke(lease).await.unwrap();
    eventually(10, "a forgets b", || {
        !na.view().members.contains_key("node-b")
    })
    .await;
    eventually(15, "b registers again and a routes svc to it", || {
        na.view().members.contains_key("node-b") && !a.remote_addresses().is_empty()
    })
    .await;
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        a.request("svc", String::from("back")),
    )
    .await
    .expect("answered")
    .unwrap();
    assert_eq!(r.body::<String>().unwrap(), "back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_node_disappears_when_its_lease_expires() {
    let etcd = EtcdServer::start().expect("etcd starts");
    let (a, _na, _ma) = start(&etcd, "node-a", Duration::from_secs(2)).await;
    let (b, nb, mb) = start(&etcd, "node-b", Duration::from_secs(2)).await;
    let _e = echo(&b, "svc").await;
    eventually(10, "a routes svc to b", || !a.remote_addresses().is_empty()).await;
    // b dies without deregistering: its tasks stop, its keys wait for the lease.
    drop(nb);
    drop(mb);
    eventually(15, "the lease expires and a forgets b", || {
        a.remote_addresses().is_empty()
    })
    .await;
    let err = a.request("svc", ()).await.unwrap_err();
    assert_eq!(err.kind().as_str(), "NO_HANDLERS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_keep_working_while_etcd_is_down() {
    let mut etcd = EtcdServer::start().expect("etcd starts");
    let (a, na, ma) = start(&etcd, "node-a", Duration::from_secs(10)).await;
    let (b, _nb, mb) = start(&etcd, "node-b", Duration::from_secs(10)).await;
    let _e = echo(&b, "svc").await;
    eventually(10, "a routes svc to b", || !a.remote_addresses().is_empty()).await;
    // What the outage must not undo is in place first: b's view lists a
    // (else b never accepts a's connection, and a's ping deadline drops it:
    // CI once stopped etcd before b's first read), and a request crossed.
    let b_view = mb.view();
    eventually(10, "b knows a", || {
        b_view.borrow().members.contains_key("node-a")
    })
    .await;
    let r = a.request("svc", String::from("before")).await.unwrap();
    assert_eq!(r.body::<String>().unwrap(), "before");
    let observer = na.observer();
    assert!(observer.view().connected);
    assert_eq!(observer.counters().store_outages.get(), 0);

    etcd.stop();
    let view = ma.view();
    eventually(15, "a notices etcd is gone", || !view.borrow().connected).await;
    // What the metrics exporter reads says so too.
    eventually(5, "the node counts the outage", || {
        observer.counters().store_outages.get() == 1
    })
    .await;
    assert!(!observer.view().connected);
    let quick = DeliveryOptions::new().timeout(Duration::from_secs(5));
    for i in 0..20u64 {
        let r = a.request_with("svc", format!("{i}"), &quick).await.unwrap();
        assert_eq!(r.body::<String>().unwrap(), &format!("{i}"));
    }

    etcd.restart().expect("etcd restarts");
    eventually(20, "a reconnects to etcd", || view.borrow().connected).await;
    eventually(10, "the subscription survived", || {
        view.borrow().subscriptions.contains_key("svc")
    })
    .await;
    let r = a.request("svc", String::from("after")).await.unwrap();
    assert_eq!(r.body::<String>().unwrap(), "after");
}

/// A node whose lease is lost (expired during an outage, or revoked)
/// registers again under a new one, with its subscriptions; and a
/// withdrawal that lands meanwhile stays withdrawn: the re-registration
/// writes the subscriptions of a snapshot taken before, and the withdrawal's
/// delete may run before that snapshot's put of the same key. (Before
/// 2026-11-27 neither held: etcd-client reports a lost lease as an error,
/// which the keep-alive took for a passing failure, so the node never came
/// back; with that fixed, the withdrawn key came back for the node's life.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withdrawal_during_re_registration_stays_withdrawn() {
    const SUBS: usize = 400;
    let etcd = EtcdServer::start().expect("etcd starts");
    let m = joined_as_a(&etcd, Duration::from_secs(3)).await;
    let name = |i: usize| format!("addr-{i:04}");
    for i in 0..SUBS {
        m.subscribe(&name(i), 1).await.unwrap();
    }
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let node_key = "/railyard/railyard/nodes/a";
    let sub_key = |i: usize| format!("/railyard/railyard/subs/a/{}", name(i));
    // Lose the lease: its keys go, and the keep-alive re-registers.
    let leases = c.leases().await.unwrap();
    for l in leases.leases() {
        c.lease_revoke(l.id()).await.unwrap();
    }
    let gone = c.get(node_key, None).await.unwrap();
    assert_eq!(gone.count(), 0);
    // As soon as the node key is back, the subscriptions are being put in
    // order: withdraw the last ones before their turn.
    let mut back = false;
    for _ in 0..2_000 {
        if c.get(node_key, None).await.unwrap().count() == 1 {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(back, "the node did not re-register");
    for i in SUBS - 5..SUBS {
        m.unsubscribe(&name(i)).await.unwrap();
    }
    // Once the re-registration is through (the first of the kept ones is
    // there again), none of the withdrawn keys may be.
    let mut kept = false;
    for _ in 0..1_000 {
        if c.get(sub_key(SUBS - 6), None).await.unwrap().count() == 1 {
            kept = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(kept, "the kept subscriptions were not put again");
    // The re-registration is through once etcd's revision stops moving for
    // half a second (keep-alives do not move it).
    let (mut last, mut still) = (0, 0);
    for _ in 0..400 {
        let now = c
            .get(node_key, None)
            .await
            .unwrap()
            .header()
            .unwrap()
            .revision();
        if now == last {
            still += 1;
            if still == 10 {
                break;
            }
        } else {
            (last, still) = (now, 0);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(still, 10, "etcd kept changing");
    for i in SUBS - 5..SUBS {
        let left = c.get(sub_key(i), None).await.unwrap().count();
        assert_eq!(left, 0, "{} came back after its withdrawal", name(i));
    }
    assert_eq!(c.get(sub_key(0), None).await.unwrap().count(), 1);
}

/// Keys under `prefix` in etcd, and how many distinct leases hold them.
async fn keys_and_leases(c: &mut etcd_client::Client, prefix: &str) -> (usize, usize) {
    let resp = c
        .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let leases: std::collections::BTreeSet<i64> = resp.kvs().iter().map(|kv| kv.lease()).collect();
    (resp.kvs().len(), leases.len())
}

/// A node with thousands of subscriptions whose lease is lost registers
/// them all again under one new lease, and stays registered. (Before
/// 2026-11-28 it put them one at a time with nothing renewing the new
/// lease meanwhile: with a 1 s TTL the lease expired partway, and the node
/// started over under another lease, for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_thousands_of_subscriptions_comes_back_whole() {
    const SUBS: usize = 5_000;
    let etcd = EtcdServer::start().expect("etcd starts");
    let m = joined_as_a(&etcd, Duration::from_secs(1)).await;
    // Subscribed 100 at a time (etcd shares their commits).
    for batch in (0..SUBS).collect::<Vec<_>>().chunks(100) {
        let puts = batch.iter().map(|i| {
            let m = m.clone();
            async move { m.subscribe(&format!("addr-{i:05}"), 1).await }
        });
        for r in futures::future::join_all(puts).await {
            r.unwrap();
        }
    }
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let prefix = "/railyard/railyard/";
    assert_eq!(keys_and_leases(&mut c, prefix).await, (SUBS + 1, 1));
    for l in c.leases().await.unwrap().leases() {
        c.lease_revoke(l.id()).await.unwrap();
    }
    let mut whole = false;
    for _ in 0..300 {
        if keys_and_leases(&mut c, prefix).await == (SUBS + 1, 1) {
            whole = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        whole,
        "the node's keys did not all come back under one lease"
    );
    // And they stay: three TTLs later, the same keys under a live lease.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(keys_and_leases(&mut c, prefix).await, (SUBS + 1, 1));
    let lease = c
        .get("/railyard/railyard/nodes/a", None)
        .await
        .unwrap()
        .kvs()[0]
        .lease();
    let ttl = c.lease_time_to_live(lease, None).await.unwrap().ttl();
    assert!(ttl > 0, "the node's lease is gone (TTL {ttl})");
}

/// A cluster whose keys take more than 4 MiB to read still gives a node its
/// view. (Before 2026-11-28 the node read them in one answer, which
/// etcd-client refused past 4 MiB: the view never connected.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_larger_than_one_answer_is_read_in_pages() {
    const KEYS: usize = 20_000;
    let etcd = EtcdServer::start().expect("etcd starts");
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    // 20,000 subscriptions of a peer, each name 240 bytes: about 5.5 MB.
    let pad = "x".repeat(230);
    let keys: Vec<String> = (0..KEYS)
        .map(|i| format!("/railyard/railyard/subs/peer/{pad}-{i:05}"))
        .collect();
    for chunk in keys.chunks(100) {
        let ops = chunk
            .iter()
            .map(|k| etcd_client::TxnOp::put(k.as_str(), "", None))
            .collect::<Vec<_>>();
        c.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap();
    }
    let m = joined_as_a(&etcd, Duration::from_secs(5)).await;
    let mut view = m.view();
    tokio::time::timeout(
        Duration::from_secs(30),
        view.wait_for(|v| v.connected && v.subscriptions.len() == KEYS),
    )
    .await
    .expect("the view holds every subscription")
    .unwrap();
}
