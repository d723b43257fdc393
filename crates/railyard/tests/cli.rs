//! The binary's front door: `railyard node` starts and stops cleanly on
//! SIGTERM; bad options give clear errors.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn railyard() -> Command {
    Command::new(env!("CARGO_BIN_EXE_railyard"))
}

#[test]
fn node_starts_and_stops_gracefully_on_sigterm() {
    let mut child = railyard()
        .args([
            "node",
            "--name",
            "test-node",
            "--stats-every",
            "0",
            "--http-port",
            "0",
            "--admin-port",
            "0",
        ])
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
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut started = false;
    let mut addrs = None;
    while Instant::now() < deadline {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            if line.contains("http server listening") {
                addrs = Some((field(&line, "http"), field(&line, "admin")));
            }
            if line.contains("node started") {
                assert!(line.contains("test-node"), "{line}");
                started = true;
                break;
            }
        }
    }
    if !started {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the node did not log that it started");
    }
    let (http, admin) = addrs.expect("the node logs its HTTP addresses before it starts");
    let page = http_get(&http, "/static/4k");
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(page.contains("content-length: 4096"), "{page}");
    let metrics = http_get(&admin, "/metrics");
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(
        metrics.contains(
            r#"railyard_http_requests_total{route="/static/4k",method="GET",status="200"} 1"#
        ),
        "{metrics}"
    );
    assert!(metrics.contains("railyard_bus_consumers 1"), "{metrics}");
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    let mut exited = None;
    while Instant::now() < deadline {
        if let Some(s) = child.try_wait().expect("wait") {
            exited = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let Some(status) = exited else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the node did not stop after SIGTERM");
    };
    assert!(status.success(), "{status}");
    let rest: Vec<String> = rx.try_iter().collect();
    assert!(rest.iter().any(|l| l.contains("node stopping")), "{rest:?}");
}

/// The value of `name=` in a text log line.
fn field(line: &str, name: &str) -> String {
    let at = line
        .find(&format!("{name}="))
        .unwrap_or_else(|| panic!("no {name}= in {line}"));
    line[at + name.len() + 1..]
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

/// One `GET` with `Connection: close`; the whole response as text.
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the node");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read the response");
    out
}

#[test]
fn unknown_cluster_manager_is_a_clear_error() {
    let out = railyard()
        .args([
            "bench",
            "echo",
            "--cluster",
            "zookeeper",
            "--duration",
            "1s",
        ])
        .output()
        .expect("run railyard");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("only `none` is available"), "{err}");
}

/// Runs `railyard bench <args> --json <file>`; returns its stdout and the JSON rows.
fn bench_json(args: &[&str], json: &std::path::Path) -> (String, Vec<serde_json::Value>) {
    let out = railyard()
        .arg("bench")
        .args(args)
        .arg("--json")
        .arg(json)
        .output()
        .expect("run railyard");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = serde_json::from_slice(&std::fs::read(json).expect("the JSON file exists"))
        .expect("the JSON file is an array of rows");
    (String::from_utf8_lossy(&out.stdout).into_owned(), rows)
}

#[test]
fn short_bench_runs_write_json_rows() {
    let dir = std::env::temp_dir().join(format!("railyard-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (_, rows) = bench_json(
        &[
            "echo",
            "--duration",
            "200ms",
            "--warmup",
            "100ms",
            "--method",
            "send-send",
        ],
        &dir.join("echo.json"),
    );
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r["scenario"], "echo");
    assert_eq!(r["system"], "railyard");
    assert_eq!(r["method"], "send-send");
    assert_eq!(r["in_flight"], 64);
    assert!(r["round_trips"].as_u64().unwrap() > 0, "{r}");

    let (stdout, rows) = bench_json(
        &["pingpong", "--messages", "20000"],
        &dir.join("pingpong.json"),
    );
    assert!(
        stdout.contains("20000 eventbus messages sent in"),
        "{stdout}"
    );
    assert!(stdout.contains("replyCount: 20000 after"), "{stdout}");
    assert!(stdout.contains("all replies received in"), "{stdout}");
    assert_eq!(rows[0]["messages"], 20000);
    assert_eq!(rows[0]["failures"], 0);
    assert!(
        rows[0]["all_replies_ms"].as_f64().unwrap() >= rows[0]["first_reply_ms"].as_f64().unwrap()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
