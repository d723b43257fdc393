//! `railyard dev redis-cluster|redis-double` and `railyard node --redis-cluster`
//! as a user runs them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn railyard() -> Command {
    Command::new(env!("CARGO_BIN_EXE_railyard"))
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    Some((status, out.split_once("\r\n\r\n")?.1.to_owned()))
}

#[test]
fn bad_cluster_layouts_are_refused_with_a_reason() {
    let out = railyard()
        .args(["dev", "redis-cluster", "--nodes", "5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a multiple"));
    let out = railyard()
        .args([
            "dev",
            "redis-cluster",
            "--nodes",
            "6",
            "--base-port",
            "22765",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("22767"));
    let out = railyard()
        .args(["dev", "redis-cluster", "down", "--base-port", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no cluster found"));
}

#[test]
fn dev_cluster_starts_and_down_removes_it() {
    let base = railyard_redis::local_cluster::free_base_port(6).expect("free ports");
    let b = base.to_string();
    let out = railyard()
        .args([
            "dev",
            "redis-cluster",
            "--nodes",
            "6",
            "--replicas",
            "1",
            "--base-port",
            &b,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(&format!("127.0.0.1:{base}")), "{stdout}");
    assert!(TcpStream::connect(("127.0.0.1", base)).is_ok());
    let dir = railyard_redis::local_cluster::dev_dir(base);
    assert!(dir.exists());
    let out = railyard()
        .args(["dev", "redis-cluster", "down", "--base-port", &b])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!dir.exists());
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", base)).is_ok() {
        assert!(Instant::now() < deadline, "node still listening after down");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn node_serves_the_seed_service_over_the_double() {
    serves_the_seed_service(&[]);
}

/// The same with the service on a work-stealing runtime of two workers
/// instead of its default single thread.
#[test]
fn node_serves_the_seed_service_on_two_threads() {
    serves_the_seed_service(&["--redis-threads", "2"]);
}

/// A cluster that cannot be reached stops the node with the client's
/// reason (the service's thread reports it before the node goes on).
#[test]
fn node_without_a_reachable_cluster_exits_with_the_reason() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let out = railyard()
        .args(["node", "--no-saga", "--no-bridge", "--no-http"])
        .args([
            "--redis-cluster",
            &closed.to_string(),
            "--redis-test-port",
            "0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("connecting to the Redis Cluster"), "{err}");
    assert!(err.contains(&closed.to_string()), "{err}");
}

fn serves_the_seed_service(extra: &[&str]) {
    let mut double = railyard()
        .args(["dev", "redis-double", "--masters", "3", "--replicas", "1"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = first_line(&mut double);
    let _double = KillOnDrop(double);
    let seeds = out
        .split("seeds ")
        .nth(1)
        .expect("the double prints its seeds")
        .trim()
        .to_owned();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let node = railyard()
        .args([
            "node",
            "--no-saga",
            "--no-bridge",
            "--http-port",
            "0",
            "--admin-port",
            "0",
            "--stats-every",
            "0",
            "--redis-cluster",
            &seeds,
        ])
        .args([
            "--redis-test-port",
            &port.to_string(),
            "--redis-refresh",
            "100ms",
        ])
        .args(extra)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _node = KillOnDrop(node);
    let deadline = Instant::now() + Duration::from_secs(30);
    let (status, body) = loop {
        if let Some(r) = get(port, "/test") {
            break r;
        }
        assert!(Instant::now() < deadline, "the service never answered");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!((status, body.as_str()), (200, "ok"));
    // The node's first periodic check (every 100 ms) comes, bounded.
    let deadline = Instant::now() + Duration::from_secs(20);
    let v = loop {
        let (status, stats) = get(port, "/stats").unwrap();
        assert_eq!(status, 200);
        let v: serde_json::Value = serde_json::from_str(&stats).unwrap();
        if v["refresh"]["checks"].as_u64().unwrap() >= 1 || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(v["refresh"]["checks"].as_u64().unwrap() >= 1, "{v}");
    assert_eq!(v["shards"], 3);
}

fn first_line(child: &mut Child) -> String {
    let stdout = child.stdout.take().expect("piped");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("a line from the double");
    line
}
