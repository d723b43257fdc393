//! A `railyard node` process serving only its saga coordinator, for the
//! saga tests of this crate (`mod support;` in each test file).

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The node; killed (and reaped) on drop.
pub(crate) struct SagaNode {
    child: Child,
    /// The coordinator's address (gRPC and REST), from the node's log.
    pub(crate) addr: String,
}

impl SagaNode {
    /// Starts `railyard node --no-http --no-bridge --saga-port 0` plus
    /// `store_args` and waits (at most 60 s) until the coordinator listens.
    ///
    /// # Panics
    /// If the node cannot start or never says it listens.
    pub(crate) fn start<S: AsRef<OsStr>>(store_args: &[S]) -> SagaNode {
        let mut child = Command::new(env!("CARGO_BIN_EXE_railyard"))
            .args([
                "node",
                "--stats-every",
                "0",
                "--no-http",
                "--no-bridge",
                "--saga-port",
                "0",
            ])
            .args(store_args)
            .env("RAILYARD_LOG", "info")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start railyard node");
        let stderr = child.stderr.take().expect("piped");
        let rx = super::log::lines(stderr);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
                if line.contains("saga coordinator listening") {
                    let at = line.find("addr=").expect("addr field") + 5;
                    let addr = line[at..].split_whitespace().next().unwrap().to_owned();
                    // Keep draining so the node never blocks on a full pipe.
                    std::thread::spawn(move || while rx.recv().is_ok() {});
                    return SagaNode { child, addr };
                }
                seen.push(line);
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the node never said its coordinator listens: {seen:?}");
    }

    /// Kills the node with SIGKILL (no shutdown path runs) and reaps it.
    #[allow(dead_code)] // not every test file kills
    pub(crate) fn kill(mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }

    /// `GET path` on the coordinator's REST API: status and JSON body.
    ///
    /// # Panics
    /// If the node does not answer with HTTP and JSON.
    pub(crate) fn get(&self, path: &str) -> (u16, serde_json::Value) {
        let mut s = std::net::TcpStream::connect(&self.addr).expect("connect to the node");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
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
}

impl Drop for SagaNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
