//! Runs `peers/omega-interop` (a Spring Boot service on the real Omega 0.7.1)
//! against a coordinator, for the interop tests of `railyard-saga` and of
//! the `railyard` binary (which includes this file by path).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

fn peer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../peers/omega-interop")
}

fn peer_jar() -> PathBuf {
    peer_dir().join("target/omega-interop-peer.jar")
}

fn have(tool: &str, arg: &str) -> bool {
    std::process::Command::new(tool)
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

/// Whether Java and the peer's jar are there (building the jar with Maven
/// if it can); `false` means skip (the reason was printed), and with
/// `RAILYARD_REQUIRE_INTEROP=1` a missing piece panics instead.
pub(crate) fn peer_ready() -> bool {
    if !need(
        "Java 17",
        have("java", "-version"),
        "install a JDK (apt-get install -y openjdk-17-jdk-headless)",
    ) {
        return false;
    }
    if !peer_jar().is_file() && have("mvn", "-v") {
        eprintln!("building peers/omega-interop with Maven (first run only)...");
        // Two test binaries (this crate's and the node's) may get here at
        // once; two Maven builds in one directory leave a jar without the
        // app's classes. `flock` serializes them, and the second one finds
        // the jar built and does nothing.
        let dir = peer_dir();
        let script = "[ -f target/omega-interop-peer.jar ] || mvn -q -B package -DskipTests";
        let _ = std::process::Command::new("flock")
            .arg(std::env::temp_dir().join("railyard-omega-peer-build.lock"))
            .args(["sh", "-c", script])
            .current_dir(dir)
            .status();
    }
    need(
        "the peers/omega-interop jar",
        peer_jar().is_file(),
        "build it with `mvn -q -B package -DskipTests` in peers/omega-interop (needs Maven)",
    )
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

/// A coordinator served over tonic on a free loopback port.
/// Runs the peer against the coordinator at `addr` (`ok` successful sagas,
/// `failing` ones failing at the steps in `fail_at`) and returns its RESULT.
pub(crate) async fn run_peer(addr: &str, ok: u32, failing: u32, fail_at: &str) -> Value {
    run_peer_with(addr, ok, failing, fail_at, &[]).await
}

/// As [`run_peer`], with more `--name=value` options for the peer.
pub(crate) async fn run_peer_with(
    addr: &str,
    ok: u32,
    failing: u32,
    fail_at: &str,
    extra: &[&str],
) -> Value {
    let mut child = Command::new("java")
        .args(jvm_flags())
        .arg("-jar")
        .arg(peer_jar())
        .arg(format!("--alpha.cluster.address={addr}"))
        .arg(format!("--interop.ok={ok}"))
        .arg(format!("--interop.failing={failing}"))
        .arg(format!("--interop.fail-at={fail_at}"))
        .arg("--interop.wait-seconds=30")
        .args(extra)
        .env("OMEGA_INTEROP_LOG", "WARN")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start the Omega peer");
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
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

pub(crate) fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|s| s.as_str().expect("a string"))
        .collect()
}
