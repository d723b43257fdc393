//! Interop with clients this project did not write, and a side-by-side
//! cross-check against Vert.x 4.5.14's own TCP bridge.
//!
//! - The official Python client (PyPI `vertx-eventbus-client`, from the
//!   vertx-eventbus-bridge-clients repository) runs a script against
//!   Railyard's bridge, and against the Vert.x peer when Java is present;
//!   both transcripts must be identical.
//! - The official Java client (`io.vertx:vertx-eventbus-bridge-client`) is
//!   not on Maven Central, so, as the issue allows, the same raw-frame
//!   conversation runs against Railyard and against the real Vert.x bridge
//!   (`peers/vertx-bridge`, mode `server`), and every reply frame must match.
//!
//! `scripts/test` installs both (a venv with the Python client, the peer jar
//! with Maven) and sets `RAILYARD_REQUIRE_INTEROP=1`, so in CI a missing tool
//! fails these tests; on a dev box without them they skip, loudly.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::{peer_config, peer_services, start, Client};
use railyard_bus::EventBus;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `None` means skip (the reason was printed); panics in CI instead.
fn need(what: &str, found: bool, how: &str) -> bool {
    if found {
        return true;
    }
    let msg = format!("interop test needs {what}, which is missing; {how}");
    if std::env::var_os("RAILYARD_REQUIRE_INTEROP").is_some_and(|v| v == "1") {
        panic!("{msg} (RAILYARD_REQUIRE_INTEROP=1)");
    }
    eprintln!("SKIPPED: {msg}");
    false
}

fn python() -> PathBuf {
    std::env::var_os("RAILYARD_INTEROP_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/interop-venv/bin/python"))
}

fn peer_jar() -> PathBuf {
    workspace().join("peers/vertx-bridge/target/vertx-bridge-peer.jar")
}

fn have_java() -> bool {
    std::process::Command::new("java")
        .arg("-version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The real Vert.x 4.5.14 TCP bridge, killed on drop.
struct VertxBridge {
    _child: Child,
    port: u16,
}

async fn start_vertx() -> VertxBridge {
    let port = free_port();
    let mut child = Command::new("java")
        .args(["-Xmx256m", "-XX:+UseSerialGC", "-jar"])
        .arg(peer_jar())
        .args(["server", "--port", &port.to_string(), "--instances", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start the Vert.x peer");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.starts_with("LISTENING") {
                return;
            }
        }
        panic!("the Vert.x peer exited before listening");
    })
    .await
    .expect("the Vert.x peer listens within 60 s");
    VertxBridge {
        _child: child,
        port,
    }
}

async fn run_python(port: u16) -> Vec<Value> {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(python())
            .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/official_client.py"))
            .arg(port.to_string())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the Python client finishes within 60 s")
    .expect("run the Python client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("the script prints JSON lines"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_client_against_railyard_and_vertx() {
    if !need(
        "the official Python client (pip install vertx-eventbus-client)",
        python().is_file(),
        "run scripts/test, or set RAILYARD_INTEROP_PYTHON to a python that has it",
    ) {
        return;
    }
    let bus = EventBus::new();
    let _services = peer_services(&bus).await;
    let bridge = start(&bus, peer_config()).await;
    let ours = run_python(bridge.local_addr().port()).await;
    let expected = vec![
        json!({"event":"reply","data":{"type":"message","address":"<reply>","headers":{},"body":{"hello":"world","n":[1,2]},"send":true}}),
        json!({"event":"err","data":{"type":"err","address":"<reply>","sourceAddress":"test.fail","failureCode":42,"failureType":"RECIPIENT_FAILURE","message":"boom"}}),
        json!({"event":"err","data":"reply time out"}),
        json!({"event":"err","data":{"type":"err","message":"access_denied"}}),
        json!({"event":"in","data":{"type":"message","address":"test.in","headers":{},"body":{"n":1},"send":true}}),
        json!({"event":"in","data":{"type":"message","address":"test.in","headers":{},"body":{"n":2},"send":false}}),
        json!({"event":"in","data":{"type":"message","address":"test.in","replyAddress":"<reply>","headers":{},"body":{"n":3},"send":true}}),
        json!({"event":"in","data":{"type":"message","address":"test.in","headers":{},"body":{"reply":{"answer":3}},"send":true}}),
        json!({"event":"in","data":{"type":"message","address":"test.in","headers":{},"body":"to everyone","send":false}}),
        json!({"event":"done"}),
    ];
    assert_eq!(ours, expected);
    bridge.shutdown().await;

    if !need(
        "Java and the Vert.x peer jar",
        have_java() && peer_jar().is_file(),
        "run `mvn -q -B package -DskipTests` in peers/vertx-bridge",
    ) {
        return;
    }
    let vertx = start_vertx().await;
    let theirs = run_python(vertx.port).await;
    assert_eq!(
        ours, theirs,
        "the official client sees the same from Railyard and from Vert.x"
    );
}

/// One raw-frame conversation; returns every frame received, with generated
/// reply addresses normalized.
async fn conversation(port: u16) -> Vec<Value> {
    let mut c = Client::connect(std::net::SocketAddr::from(([127, 0, 0, 1], port))).await;
    let mut got = Vec::new();
    let steps: Vec<(Vec<Value>, usize)> = vec![
        (vec![json!({"type":"ping"})], 1),
        (
            vec![
                json!({"type":"send","address":"railyard.node.echo","replyAddress":"r1","body":{"b":1,"a":[true,null,1.5]}}),
            ],
            1,
        ),
        (
            vec![
                json!({"type":"send","address":"test.echo","replyAddress":"r2","headers":{"timeout":5000,"x-custom":"v"},"body":"text"}),
            ],
            1,
        ),
        (
            vec![json!({"type":"send","address":"test.echo","replyAddress":"r3"})],
            1,
        ),
        (
            vec![json!({"type":"send","address":"test.fail","replyAddress":"r4","body":1})],
            1,
        ),
        (
            vec![json!({"type":"send","address":"test.nobody","replyAddress":"r5","body":1})],
            1,
        ),
        (
            vec![json!({"type":"send","address":"elsewhere","body":1})],
            1,
        ),
        (
            vec![json!({"type":"publish","address":"elsewhere","body":1})],
            1,
        ),
        (vec![json!({"type":"register","address":"elsewhere"})], 1),
        (
            vec![
                json!({"type":"register","address":"test.in"}),
                json!({"type":"send","address":"test.trigger","body":{"to":"test.in"}}),
            ],
            3,
        ),
    ];
    for (frames, expect) in steps {
        for f in frames {
            c.send(f).await;
        }
        for _ in 0..expect {
            got.push(c.recv().await);
        }
    }
    // Answer the request among the last three, then a second round failed.
    let ra = got.last().unwrap()["replyAddress"]
        .as_str()
        .unwrap()
        .to_owned();
    c.send(json!({"type":"send","address":ra,"body":{"answer":3}}))
        .await;
    got.push(c.recv().await);
    c.send(json!({"type":"send","address":"test.trigger","body":{"to":"test.in"}}))
        .await;
    for _ in 0..3 {
        got.push(c.recv().await);
    }
    let ra = got.last().unwrap()["replyAddress"]
        .as_str()
        .unwrap()
        .to_owned();
    c.send(json!({"type":"send","address":ra,"failureCode":7,"message":"nope"}))
        .await;
    got.push(c.recv().await);
    let tail: Vec<(Value, usize)> = vec![
        (json!({"type":"unregister","address":"test.zz"}), 1),
        (json!({"type":"send","body":1}), 1),
        (
            json!({"type":"publish","address":"test.in","body":[1,2,3]}),
            1,
        ),
        (json!({"type":"unregister","address":"test.in"}), 0),
        (
            json!({"type":"publish","address":"test.in","body":"gone"}),
            0,
        ),
        (json!({"type":"ping"}), 1),
    ];
    for (f, expect) in tail {
        c.send(f).await;
        for _ in 0..expect {
            got.push(c.recv().await);
        }
    }
    for f in &mut got {
        if let Some(ra) = f.get_mut("replyAddress") {
            *ra = json!("<reply>");
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_frames_as_the_vertx_bridge() {
    if !need(
        "Java and the Vert.x peer jar",
        have_java() && peer_jar().is_file(),
        "run `mvn -q -B package -DskipTests` in peers/vertx-bridge",
    ) {
        return;
    }
    let bus = EventBus::new();
    let _services = peer_services(&bus).await;
    let bridge = start(&bus, peer_config()).await;
    let vertx = start_vertx().await;
    let ours = conversation(bridge.local_addr().port()).await;
    let theirs = conversation(vertx.port).await;
    assert_eq!(ours.len(), theirs.len());
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a, b, "frame {i} differs (railyard left, vertx right)");
    }
    // The conversation covered every server frame type.
    for t in ["pong", "message", "err"] {
        assert!(ours.iter().any(|f| f["type"] == t), "{t}");
    }
    bridge.shutdown().await;
}
