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

mod support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::saga_node::SagaNode;

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

/// The node on an embedded store in its own data directory, removed on drop.
struct Node {
    node: SagaNode,
    dir: PathBuf,
}

impl std::ops::Deref for Node {
    type Target = SagaNode;
    fn deref(&self) -> &SagaNode {
        &self.node
    }
}

impl Node {
    fn start() -> Node {
        let dir = std::env::temp_dir().join(format!("railyard-omega-node-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let node = SagaNode::start(&[
            "--saga-store".as_ref(),
            "embedded".as_ref(),
            "--saga-data-dir".as_ref(),
            dir.as_os_str(),
        ]);
        Node { node, dir }
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
        // The node (a field) is killed after this; the directory is removed
        // here, which Linux allows while the node still has it open.
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
