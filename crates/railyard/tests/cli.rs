//! The binary's front door: `railyard node` starts and stops cleanly on
//! SIGTERM; bad options give clear errors.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn railyard() -> Command {
    Command::new(env!("CARGO_BIN_EXE_railyard"))
}

#[test]
fn node_starts_and_stops_gracefully_on_sigterm() {
    let saga_dir = std::env::temp_dir().join(format!("railyard-cli-saga-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&saga_dir);
    let mut child = railyard()
        .args([
            "node",
            "--name",
            "test-node",
            "--stats-every",
            "0",
            "--bridge-port",
            "0",
            "--http-port",
            "0",
            "--admin-port",
            "0",
            "--saga-port",
            "0",
            "--saga-data-dir",
        ])
        .arg(&saga_dir)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start railyard node");
    let stderr = child.stderr.take().expect("piped");
    let rx = support::log::lines(stderr);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut started = false;
    let mut addrs = None;
    let mut saga = None;
    while Instant::now() < deadline {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            if line.contains("http server listening") {
                addrs = Some((field(&line, "http"), field(&line, "admin")));
            }
            if line.contains("saga coordinator listening") {
                saga = Some(field(&line, "addr"));
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
    // The node's echo and info services.
    assert!(metrics.contains("railyard_bus_consumers 2"), "{metrics}");
    // The bridge's counters (its listener is up; nobody connected yet).
    assert!(
        metrics.contains("railyard_bridge_connections_accepted_total 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("railyard_bridge_connections_open 0"),
        "{metrics}"
    );
    // The saga coordinator: its REST API on its port (on the embedded store
    // in the data directory), its metrics on the admin port.
    let saga = saga.expect("the node logs the saga coordinator's address before it starts");
    let stats = http_get(&saga, "/api/stats");
    assert!(stats.starts_with("HTTP/1.1 200"), "{stats}");
    assert!(stats.contains(r#""name":"sqlite""#), "{stats}");
    assert!(saga_dir.join("saga.db").exists());
    assert!(metrics.contains("railyard_saga_"), "{metrics}");
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
    // The reader thread ends at EOF, which comes with the exit: wait for it
    // rather than race it for the last lines.
    let rest: Vec<String> = rx.iter().collect();
    assert!(rest.iter().any(|l| l.contains("node stopping")), "{rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("saga coordinator stopped")),
        "{rest:?}"
    );
    let _ = std::fs::remove_dir_all(&saga_dir);
}

/// `(soft, hard)` open-files limits of a process, from `/proc/<pid>/limits`.
fn open_files_limits(pid: &str) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let v: Vec<&str> = line.split_whitespace().collect();
    (v[3].to_string(), v[4].to_string())
}

/// A node raises its open-files limit whichever servers it runs (it used to
/// do so only when starting the bridge, so `--no-bridge` left the HTTP
/// server at the shell's soft limit, often 1,024).
#[test]
fn node_without_the_bridge_raises_its_open_files_limit() {
    let (_, hard) = open_files_limits("self");
    if hard != "unlimited" && hard.parse::<u64>().unwrap() <= 256 {
        eprintln!("hard open-files limit {hard}: nothing to raise here, skipped");
        return;
    }
    let mut child = Command::new("sh")
        .args(["-c", "ulimit -Sn 256 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "node",
            "--no-bridge",
            "--no-saga",
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
    let rx = support::log::lines(child.stderr.take().expect("piped"));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut started = false;
    while Instant::now() < deadline && !started {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            started = line.contains("node started");
        }
    }
    let limits = open_files_limits(&child.id().to_string());
    let _ = child.kill();
    let _ = child.wait();
    assert!(started, "the node did not log that it started");
    assert_eq!(limits.0, limits.1, "soft limit raised to the hard one");
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
    assert!(err.contains("invalid value 'zookeeper'"), "{err}");
    assert!(err.contains("etcd"), "the error lists what exists: {err}");

    let out = railyard()
        .args(["bench", "echo", "--nodes", "2", "--duration", "1s"])
        .output()
        .expect("run railyard");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--nodes 2 needs a cluster"), "{err}");

    let out = railyard()
        .args([
            "bench",
            "echo",
            "--vs",
            "vertx-hazelcast",
            "--duration",
            "1s",
        ])
        .output()
        .expect("run railyard");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("add --cluster etcd"), "{err}");
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

    // The files just written chart with `bench plot`: one SVG each (neither
    // scenario has a latency chart), titled in stdout.
    let charts = dir.join("charts");
    let out = railyard()
        .args(["bench", "plot", "--out"])
        .arg(&charts)
        .arg(dir.join("echo.json"))
        .arg(dir.join("pingpong.json"))
        .output()
        .expect("run railyard bench plot");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("echo.svg: echo: median of runs"),
        "{stdout}"
    );
    let mut names: Vec<String> = std::fs::read_dir(&charts)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["echo.svg", "pingpong.svg"]);
    let svg = std::fs::read_to_string(charts.join("echo.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("\nrailyard\n"), "the legend names the system");

    // A file that is not a results array is a clear error, not a panic.
    std::fs::write(dir.join("bad.json"), "{\"scenario\": \"echo\"}").unwrap();
    let out = railyard()
        .args(["bench", "plot"])
        .arg(dir.join("bad.json"))
        .output()
        .expect("run railyard bench plot");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a JSON array of result rows"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn clustered_bench_runs_cross_two_processes() {
    let dir = std::env::temp_dir().join(format!("railyard-cli-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for method in ["send-reply", "send-send"] {
        let (_, rows) = bench_json(
            &[
                "echo",
                "--cluster",
                "etcd",
                "--nodes",
                "2",
                "--duration",
                "500ms",
                "--warmup",
                "500ms",
                "--method",
                method,
            ],
            &dir.join(format!("echo-{method}.json")),
        );
        let r = &rows[0];
        assert_eq!(r["cluster"], "etcd");
        assert_eq!(r["nodes"], 2);
        assert_eq!(r["method"], method);
        assert!(r["round_trips"].as_u64().unwrap() > 0, "{r}");
    }
    let (_, rows) = bench_json(
        &[
            "pingpong",
            "--cluster",
            "etcd",
            "--nodes",
            "2",
            "--messages",
            "20000",
            "--quiet",
        ],
        &dir.join("pingpong.json"),
    );
    assert_eq!(rows[0]["nodes"], 2);
    assert_eq!(rows[0]["messages"], 20000);
    assert_eq!(rows[0]["failures"], 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `railyard node` child, killed (SIGKILL) on drop.
struct Node(std::process::Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `n` distinct free ports: all bound at once, then released, so none is
/// handed out twice (one at a time, a port could come back before the node
/// it was meant for had bound it).
fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|i| held[i].local_addr().unwrap().port())
}

#[test]
fn nodes_cluster_on_etcd_and_a_killed_node_drops_out() {
    let etcd = railyard_cluster::EtcdServer::start().expect("etcd (apt-get install etcd-server)");
    let [alpha_cluster, beta_cluster, beta_admin_port] = free_ports();
    let start = |name: &str, cluster: u16, admin: u16| {
        Node(
            railyard()
                .args([
                    "node",
                    "--name",
                    name,
                    "--stats-every",
                    "0",
                    "--cluster",
                    "etcd",
                    "--no-bridge",
                    "--no-saga",
                    "--http-port",
                    "0",
                    "--admin-port",
                    &admin.to_string(),
                ])
                .args(["--etcd", &etcd.endpoint(), "--lease-ttl", "2s"])
                .args(["--cluster-bind", "127.0.0.1"])
                .args(["--cluster-port", &cluster.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start railyard node"),
        )
    };
    let n1 = start("alpha", alpha_cluster, 0);
    let _n2 = start("beta", beta_cluster, beta_admin_port);
    let beta_admin = format!("127.0.0.1:{beta_admin_port}");
    // One metric line's value, from beta's admin port.
    let metric = |name: &str| -> Option<f64> {
        let text = http_get(&beta_admin, "/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // This test joins as a third node and asks who answers.
        let bus = railyard_bus::EventBus::new();
        let manager =
            railyard_cluster::EtcdManager::connect(railyard_cluster::EtcdConfig::new(vec![
                etcd.endpoint()
            ]))
            .await
            .unwrap();
        let cfg = railyard_cluster::ClusterConfig::new("probe", "127.0.0.1:0".parse().unwrap());
        let _probe =
            railyard_cluster::ClusterNode::start(bus.clone(), std::sync::Arc::new(manager), cfg)
                .await
                .unwrap();
        let names = |bus: railyard_bus::EventBus| async move {
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..20 {
                if let Ok(m) = bus.request("railyard.node.info", ()).await {
                    seen.insert(m.body::<String>().cloned().unwrap_or_default());
                }
            }
            seen
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = Default::default();
        while Instant::now() < deadline {
            seen = names(bus.clone()).await;
            if seen.len() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            seen,
            ["alpha".to_string(), "beta".to_string()]
                .into_iter()
                .collect(),
            "round-robin reaches both nodes"
        );
        // Beta's metrics show the cluster: alpha, beta and this probe, the
        // store reachable, links up. (A node joins the cluster before its
        // admin port is up: wait for it.)
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&beta_admin).is_err() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Polled, bounded: a 2 s lease can lapse for a moment under load.
        let deadline = Instant::now() + Duration::from_secs(15);
        while (metric("railyard_cluster_members") != Some(3.0)
            || metric("railyard_cluster_store_connected") != Some(1.0))
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(metric("railyard_cluster_members"), Some(3.0));
        assert_eq!(metric("railyard_cluster_store_connected"), Some(1.0));
        assert!(metric("railyard_cluster_connects_total").unwrap_or(0.0) >= 1.0);
        assert!(metric("railyard_cluster_frames_in_total").unwrap_or(0.0) >= 1.0);
        // SIGKILL alpha: after its lease expires only beta answers, and
        // requests never hang on the dead node.
        drop(n1);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            seen = names(bus.clone()).await;
            if seen.len() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(seen, ["beta".to_string()].into_iter().collect());
        // Beta's view has dropped alpha too (it may lag the probe's).
        let deadline = Instant::now() + Duration::from_secs(30);
        while metric("railyard_cluster_members") != Some(2.0) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(metric("railyard_cluster_members"), Some(2.0));
    });
}
