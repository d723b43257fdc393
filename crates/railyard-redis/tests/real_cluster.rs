//! The client against real `redis-server` clusters on free loopback ports:
//! key slots, the commands, MOVED and ASK during a manual slot migration, a
//! killed master whose replica takes over, and the periodic refresh.

use std::time::{Duration, Instant};

use bytes::Bytes;
use railyard_redis::local_cluster::{free_base_port, query, LocalCluster};
use railyard_redis::slot::key_slot;
use railyard_redis::{ClusterClient, Cmd, RedisError, SetOptions, Value};

async fn cluster(masters: usize, replicas: usize) -> LocalCluster {
    let n = masters * (1 + replicas);
    let base = free_base_port(n).expect("free loopback ports");
    let dir =
        std::env::temp_dir().join(format!("railyard-redis-test-{base}-{}", std::process::id()));
    LocalCluster::start(
        &dir,
        masters,
        replicas,
        base,
        Duration::from_millis(3000),
        Duration::from_secs(60),
        true,
    )
    .await
    .expect("starting a local redis cluster")
}

fn text(v: &Value) -> String {
    String::from_utf8_lossy(v.as_bytes().expect("a string reply")).into_owned()
}

async fn node_id(addr: &str) -> String {
    text(&query(addr, &Cmd::new("CLUSTER").arg("MYID")).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_slots_moved_and_ask() {
    let cl = cluster(3, 0).await;
    let addrs = cl.addrs();
    // Key slots agree with the server's CLUSTER KEYSLOT.
    for key in [
        "foo",
        "bar",
        "{user1000}.following",
        "foo{}{bar}",
        "foo{{bar}}zap",
        "a{b}c{d}",
    ] {
        let v = query(&addrs[0], &Cmd::new("CLUSTER").arg("KEYSLOT").arg(key))
            .await
            .unwrap();
        assert_eq!(v, Value::Int(i64::from(key_slot(key.as_bytes()))), "{key}");
    }

    let c = ClusterClient::builder(&addrs[..1]).build().await.unwrap();
    assert_eq!(c.table().shards().len(), 3);
    c.set("foo", "bar").await.unwrap();
    assert_eq!(
        c.get("foo").await.unwrap(),
        Some(Bytes::from_static(b"bar"))
    );
    assert_eq!(c.get("missing").await.unwrap(), None);
    let nx = SetOptions {
        only_if_absent: true,
        ..SetOptions::default()
    };
    assert!(!c.set_with("foo", "other", nx).await.unwrap());
    let ttl = SetOptions {
        expire: Some(Duration::from_secs(60)),
        ..SetOptions::default()
    };
    assert!(c.set_with("ttl", "x", ttl).await.unwrap());
    assert!(c.expire("foo", Duration::from_secs(100)).await.unwrap());
    assert_eq!(c.incr("n").await.unwrap(), 1);
    let pairs: Vec<(String, String)> = (0..50)
        .map(|i| (format!("m{i}"), format!("v{i}")))
        .collect();
    c.mset(&pairs).await.unwrap();
    let keys: Vec<String> = (0..51).map(|i| format!("m{i}")).collect();
    let got = c.mget(&keys).await.unwrap();
    assert_eq!(got.len(), 51);
    assert_eq!(got[7].as_deref(), Some(&b"v7"[..]));
    assert_eq!(got[50], None);
    assert_eq!(c.del(&keys).await.unwrap(), 50);
    assert_eq!(c.hset("h", "f", "1").await.unwrap(), 1);
    assert_eq!(c.hget("h", "f").await.unwrap().as_deref(), Some(&b"1"[..]));
    let err = c
        .cmd(&Cmd::new("LPUSH").key("h").arg("x"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, RedisError::Server { kind, .. } if kind == "WRONGTYPE"),
        "{err:?}"
    );
    // EVALSHA: NOSCRIPT until the script is loaded on the key's shard.
    let script = "return redis.call('GET', KEYS[1])";
    let sha = text(
        &c.cmd(&Cmd::new("SCRIPT").arg("LOAD").arg(script).route_by("{s}a"))
            .await
            .unwrap(),
    );
    let v = c.evalsha(&sha, &["{s}a"], &[] as &[&str]).await.unwrap();
    assert_eq!(v, Value::Nil);
    let err = c
        .evalsha(&sha, &["{s}a", "{t}b"], &[] as &[&str])
        .await
        .unwrap_err();
    assert!(matches!(err, RedisError::CrossSlot { .. }));
    let err = c
        .evalsha(
            "0000000000000000000000000000000000000000",
            &["k"],
            &[] as &[&str],
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, RedisError::Server { kind, .. } if kind == "NOSCRIPT"),
        "{err:?}"
    );

    // A manual migration of slot(foo) from its owner to another master.
    let slot = key_slot(b"foo");
    let src = c.table().shard(slot).unwrap().master.to_string();
    let dst = addrs.iter().find(|a| **a != src).unwrap().clone();
    let (src_id, dst_id) = (node_id(&src).await, node_id(&dst).await);
    let setslot = |state: &str, id: &str| {
        Cmd::new("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(state.to_owned())
            .arg(id.to_owned())
    };
    assert_eq!(
        text(&query(&dst, &setslot("IMPORTING", &src_id)).await.unwrap()),
        "OK"
    );
    assert_eq!(
        text(&query(&src, &setslot("MIGRATING", &dst_id)).await.unwrap()),
        "OK"
    );
    // A new key in the migrating slot: the source answers ASK, we follow with ASKING.
    c.set("{foo}new", "n").await.unwrap();
    // It landed on the destination: the source itself redirects a read of it.
    let on_src = query(&src, &Cmd::new("GET").arg("{foo}new")).await.unwrap();
    assert!(
        matches!(&on_src, Value::Error(e) if e.starts_with("ASK ")),
        "{on_src:?}"
    );
    // The existing key is still served by the source.
    assert_eq!(c.get("foo").await.unwrap().as_deref(), Some(&b"bar"[..]));
    // Move it; now reads of it are ASK-redirected too.
    let port = dst.rsplit(':').next().unwrap().to_owned();
    let m = query(
        &src,
        &Cmd::new("MIGRATE")
            .arg("127.0.0.1")
            .arg(port)
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("KEYS")
            .arg("foo"),
    )
    .await
    .unwrap();
    assert_eq!(text(&m), "OK");
    assert_eq!(c.get("foo").await.unwrap().as_deref(), Some(&b"bar"[..]));
    assert_eq!(c.get("{foo}new").await.unwrap().as_deref(), Some(&b"n"[..]));
    // Finish: every master learns the new owner; the client gets MOVED and
    // the adaptive refresh rebuilds the table.
    for a in &addrs {
        query(a, &setslot("NODE", &dst_id)).await.unwrap();
    }
    assert_eq!(c.get("foo").await.unwrap().as_deref(), Some(&b"bar"[..]));
    let deadline = Instant::now() + Duration::from_secs(10);
    while *c.table().shard(slot).unwrap().master != *dst {
        assert!(
            Instant::now() < deadline,
            "the adaptive refresh never moved the slot"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(c.refresh_stats().adaptive >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_is_replaced_by_its_replica() {
    let cl = cluster(3, 1).await;
    let c = ClusterClient::builder(cl.addrs())
        .command_timeout(Duration::from_secs(3))
        .adaptive_refresh(true, Duration::from_millis(200))
        .build()
        .await
        .unwrap();
    // Writes acknowledged and replicated (WAIT) before the crash must survive it.
    for i in 0..100 {
        c.set(format!("{{f}}k{i}"), format!("v{i}")).await.unwrap();
    }
    // The replica's first sync (a fork and a load) may outlast one WAIT on
    // a loaded machine: asked again, bounded.
    let mut acked = Value::Int(0);
    for _ in 0..15 {
        acked = c
            .cmd(&Cmd::new("WAIT").arg(1).arg(2000).route_by("{f}"))
            .await
            .unwrap();
        if acked == Value::Int(1) {
            break;
        }
    }
    assert_eq!(acked, Value::Int(1));
    let master = c
        .table()
        .shard(key_slot(b"{f}"))
        .unwrap()
        .master
        .to_string();
    let port: u16 = master.rsplit(':').next().unwrap().parse().unwrap();
    cl.kill(port);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.get("{f}k0").await {
            Ok(v) => {
                assert_eq!(v.as_deref(), Some(&b"v0"[..]));
                break;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "commands never recovered: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert_ne!(*c.table().shard(key_slot(b"{f}")).unwrap().master, *master);
    for i in 0..100 {
        assert_eq!(
            c.get(format!("{{f}}k{i}")).await.unwrap().as_deref(),
            Some(format!("v{i}").as_bytes())
        );
    }
    c.set("{f}after", "ok").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_periodic_refresh_sees_a_slot_moved_behind_its_back() {
    let cl = cluster(3, 0).await;
    let addrs = cl.addrs();
    let c = ClusterClient::builder(&addrs[..1])
        .refresh_period(Some(Duration::from_millis(200)))
        .adaptive_refresh(false, Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    // Past the first round, which learns the baseline with a deep check, so
    // that only a later deep check can find the move.
    let deadline = Instant::now() + Duration::from_secs(15);
    while c.refresh_stats().probes < 2 {
        assert!(Instant::now() < deadline, "{:?}", c.refresh_stats());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let checks_before = c.refresh_stats().checks;
    let slot = key_slot(b"periodic");
    let src = c.table().shard(slot).unwrap().master.to_string();
    let dst = addrs.iter().find(|a| **a != src).unwrap().clone();
    let dst_id = node_id(&dst).await;
    // The slot is empty, so it can be reassigned directly.
    for a in &addrs {
        query(
            a,
            &Cmd::new("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(dst_id.clone()),
        )
        .await
        .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while *c.table().shard(slot).unwrap().master != *dst {
        assert!(
            Instant::now() < deadline,
            "the periodic refresh never saw the move"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = c.refresh_stats();
    assert!(
        s.checks > checks_before && s.full_refreshes >= 2 && s.adaptive == 0,
        "{s:?}"
    );

    // A client that only probes after its first round: `CLUSTER INFO` shows a
    // raised epoch (what every failover and finished migration does), and
    // that alone brings a full refresh.
    let p = ClusterClient::builder(&addrs[..1])
        .refresh_period(Some(Duration::from_millis(100)))
        .deep_check_every(u32::MAX)
        .adaptive_refresh(false, Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while p.refresh_stats().probes < 3 {
        assert!(Instant::now() < deadline, "{:?}", p.refresh_stats());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = p.refresh_stats();
    assert_eq!(before.full_refreshes, 1, "nothing changed yet: {before:?}");
    for a in &addrs {
        query(a, &Cmd::new("CLUSTER").arg("BUMPEPOCH"))
            .await
            .unwrap();
    }
    while p.refresh_stats().full_refreshes < 2 {
        assert!(
            Instant::now() < deadline,
            "no probe saw the new epoch: {:?}",
            p.refresh_stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = p.refresh_stats();
    assert_eq!(s.checks, 1, "only the first round's deep check: {s:?}");
    assert_eq!(s.adaptive, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_replies_arrive_whole_while_small_commands_on_the_node_carry_on() {
    let cl = cluster(3, 0).await;
    let c = ClusterClient::builder(cl.addrs())
        .command_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let c3 = ClusterClient::builder(cl.addrs())
        .protocol(railyard_redis::Protocol::Resp3)
        .command_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    // Every key shares the hash tag, so every command below goes to one
    // node, over one connection per client.
    // A 4 MiB value: one bulk string, decoded on the connection's task (the
    // decoder slices the payload out of the read buffer).
    let big: Bytes = (0..4 << 20).map(|i: u32| (i % 251) as u8).collect();
    c.set("{big}v", big.clone()).await.unwrap();
    // A list of 40,000 elements: its LRANGE has far more than 4 KiB of
    // headers to decode, so it is framed and decoded on the blocking pool.
    let n = 40_000;
    for chunk in (0..n).collect::<Vec<u32>>().chunks(10_000) {
        let mut push = Cmd::new("RPUSH").key("{big}list");
        for i in chunk {
            push = push.arg(format!("e{i}"));
        }
        c.cmd(&push).await.unwrap();
    }
    // And a hash of 5,000 fields, a map under RESP3.
    let mut hset = Cmd::new("HSET").key("{big}hash");
    for i in 0..5_000 {
        hset = hset.arg(format!("f{i}")).arg(i);
    }
    c.cmd(&hset).await.unwrap();

    for round in 0..3 {
        let get = {
            let c = c.clone();
            tokio::spawn(async move { c.get("{big}v").await })
        };
        let lrange = {
            let c = c.clone();
            tokio::spawn(async move {
                c.cmd_read(&Cmd::new("LRANGE").key("{big}list").arg(0).arg(-1))
                    .await
            })
        };
        let hgetall = {
            let c3 = c3.clone();
            tokio::spawn(async move { c3.cmd_read(&Cmd::new("HGETALL").key("{big}hash")).await })
        };
        // Small commands on the same node and connections meanwhile.
        let small = (0..200).map(|i| {
            let (c, c3) = (c.clone(), c3.clone());
            tokio::spawn(async move {
                let a = c.incr("{big}n").await;
                let b = c3.get("{big}v-missing").await;
                (i, a, b)
            })
        });
        let small: Vec<_> = futures::future::join_all(small).await;
        for r in small {
            let (i, a, b) = r.unwrap();
            assert!(a.is_ok(), "round {round}, small command {i}: {a:?}");
            assert_eq!(b.unwrap(), None, "round {round}, small command {i}");
        }
        assert_eq!(get.await.unwrap().unwrap().as_ref(), Some(&big));
        let Value::Array(list) = lrange.await.unwrap().unwrap() else {
            panic!("LRANGE is not an array");
        };
        assert_eq!(list.len(), n as usize);
        for (i, e) in list.iter().enumerate() {
            assert_eq!(
                e.as_bytes().map(|b| &b[..]),
                Some(format!("e{i}").as_bytes())
            );
        }
        let Value::Map(hash) = hgetall.await.unwrap().unwrap() else {
            panic!("HGETALL under RESP3 is not a map");
        };
        assert_eq!(hash.len(), 5_000);
        for (k, v) in &hash {
            let k = text(k);
            assert_eq!(format!("f{}", text(v)), k);
        }
    }
    assert_eq!(c.incr("{big}n").await.unwrap(), 3 * 200 + 1);
}
