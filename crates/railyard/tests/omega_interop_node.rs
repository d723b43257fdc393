//! The real Omega client against `railyard node`: `peers/omega-interop`, a
//! Spring Boot service on Apache ServiceComb Pack's Omega 0.7.1 from Maven
//! Central (unmodified), runs two successful sagas and two failing ones
//! (third step, second step) against a `railyard node` process serving only
//! its saga coordinator on the default embedded store; the node's REST API
//! then reports the successful sagas COMMITTED and the failing ones
//! COMPENSATED, while the peer reports that Omega invoked exactly the
//! compensations of the completed steps, most recent first.
//!
//! (`crates/railyard-saga/tests/omega_interop.rs` checks the same through
//! the library API, in both of Omega's server-meta modes.) `scripts/test`
//! builds the peer and sets `RAILYARD_REQUIRE_INTEROP=1`, so in CI a missing
//! Java or jar fails this test; on a dev box without them it skips, loudly.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::AsyncBufReadExt;

fn peer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../peers/omega-interop")
}

fn peer_jar() -> PathBuf {
    peer_dir().join("target/omega-interop-peer.jar")
}

fn have(tool: &str, arg: &str) -> bool {
    Command::new(tool)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `false` means skip (the reason was printed); panics in CI instead.
fn need(what: &str, found: bool, how: &str) -> bool {
    if found {
        return true;
    }
    let msg = format!("Omega interop test needs {what}, which is missing; {how}");
    if std::env::var_os("RAILYARD_REQUIRE_INTEROP").is_some_and(|v| v == "1") {
        panic!("{msg} (RAILYARD_REQUIRE_INTEROP=1)");
    }
    eprintln!("SKIPPED: {msg}");
    false
}

/// The peer's JVM flags (`peers/omega-interop/jvm.options`, '#' comments).
fn jvm_flags() -> Vec<String> {
    std::fs::read_to_string(peer_dir().join("jvm.options"))
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// A `railyard node` serving only the saga coordinator; killed on drop.
struct Node {
    child: Child,
    addr: String,
    dir: PathBuf,
}

impl Node {
    fn start() -> Node {
        let dir = std::env::temp_dir().join(format!("railyard-omega-node-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut child = Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args([
                "node",
                "--stats-every",
                "0",
                "--no-http",
                "--no-bridge",
                "--saga-port",
                "0",
                "--saga-store",
                "embedded",
                "--saga-data-dir",
            ])
            .arg(&dir)
            .env("RAILYARD_LOG", "info")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start railyard node");
        let stderr = child.stderr.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
                if line.contains("saga coordinator listening") {
                    let at = line.find("addr=").expect("addr field") + 5;
                    let addr = line[at..].split_whitespace().next().unwrap().to_owned();
                    // Keep draining so the node never blocks on a full pipe.
                    std::thread::spawn(move || while rx.recv().is_ok() {});
                    return Node { child, addr, dir };
                }
                seen.push(line);
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the node never said its coordinator listens: {seen:?}");
    }

    /// `GET path` on the coordinator's port (its REST API): status and JSON body.
    fn get(&self, path: &str) -> (u16, Value) {
        let mut s = std::net::TcpStream::connect(&self.addr).expect("connect to the node");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.addr
        )
        .expect("send the request");
        let mut raw = String::new();
        s.read_to_string(&mut raw).expect("read the answer");
        let status = raw
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP answer: {raw}"));
        let body = raw.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        (
            status,
            serde_json::from_str(body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {raw}")),
        )
    }

    /// Waits (bounded) until the REST API reports `gid` in `state`.
    fn wait_state(&self, gid: &str, state: &str) {
        let mut last = Value::Null;
        for _ in 0..250 {
            let (code, body) = self.get(&format!("/api/sagas/{gid}"));
            if code == 200 && body["saga"]["state"] == state {
                return;
            }
            last = body;
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("saga {gid} never reached {state} on the node; last answer {last}");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs the peer against `addr` and returns its RESULT object.
async fn run_peer(addr: &str) -> Value {
    let mut child = tokio::process::Command::new("java")
        .args(jvm_flags())
        .arg("-jar")
        .arg(peer_jar())
        .arg(format!("--alpha.cluster.address={addr}"))
        .args([
            "--interop.ok=2",
            "--interop.failing=2",
            "--interop.fail-at=3,2",
            "--interop.wait-seconds=30",
        ])
        .env("OMEGA_INTEROP_LOG", "WARN")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start the Omega peer");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("piped")).lines();
    let result = tokio::time::timeout(Duration::from_secs(120), async {
        let mut result = None;
        while let Some(line) = lines.next_line().await.expect("read the peer's stdout") {
            if let Some(json) = line.strip_prefix("RESULT ") {
                result = Some(serde_json::from_str::<Value>(json).expect("RESULT is JSON"));
            } else {
                eprintln!("[omega-interop] {line}");
            }
        }
        result
    })
    .await
    .expect("the Omega peer finishes within 120 s")
    .expect("the Omega peer printed a RESULT line");
    let status = child.wait().await.expect("wait for the peer");
    eprintln!("[omega-interop] exited {status}; RESULT {result}");
    result
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|s| s.as_str().expect("a string"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_omega_against_railyard_node() {
    if !need(
        "Java 17",
        have("java", "-version"),
        "install a JDK (apt-get install -y openjdk-17-jdk-headless)",
    ) || !need(
        "the peers/omega-interop jar",
        peer_jar().is_file(),
        "build it with `mvn -q -B package -DskipTests` in peers/omega-interop (needs Maven)",
    ) {
        return;
    }
    let node = Node::start();
    let r = run_peer(&node.addr).await;

    assert_eq!(r["sagas_ok"], 2, "{r}");
    assert_eq!(r["sagas_failed"], 2, "{r}");
    assert_eq!(r["compensations_invoked"], 3, "{r}");
    assert_eq!(r["complete"], true, "{r}");
    assert_eq!(r["unexpected_compensations"], 0, "{r}");
    for s in r["sagas"].as_array().expect("sagas") {
        let gid = s["global_tx_id"].as_str().expect("global_tx_id");
        let (want, compensations): (&str, &[&str]) = match s["fail_at"].as_u64() {
            Some(0) => ("COMMITTED", &[]),
            Some(3) => ("COMPENSATED", &["charge", "reserve"]),
            Some(2) => ("COMPENSATED", &["reserve"]),
            other => panic!("unexpected fail_at {other:?}: {s}"),
        };
        assert_eq!(strings(&s["compensations"]), compensations, "{s}");
        // The node's REST API is polled with blocking I/O.
        tokio::task::block_in_place(|| node.wait_state(gid, want));
    }
    let (code, stats) = node.get("/api/stats");
    assert_eq!(code, 200, "{stats}");
    assert_eq!(stats["store"]["name"], "sqlite", "{stats}");
}
