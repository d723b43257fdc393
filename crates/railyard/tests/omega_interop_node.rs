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
// The peer runner the library's interop test uses.
#[path = "../../railyard-saga/tests/omega_peer/mod.rs"]
mod omega_peer;

use std::path::PathBuf;
use std::time::Duration;

use omega_peer::{peer_ready, run_peer, strings};
use serde_json::Value;
use support::saga_node::SagaNode;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_omega_against_railyard_node() {
    if !peer_ready() {
        return;
    }
    let node = Node::start();
    let r = run_peer(&node.addr, 2, 2, "3,2").await;

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
