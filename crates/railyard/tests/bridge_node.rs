//! `railyard node --config FILE` serves the TCP bridge with the file's
//! permissions; a raw client reaches the node's echo service through it.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn frame(v: &serde_json::Value) -> Vec<u8> {
    let text = serde_json::to_vec(v).unwrap();
    let mut out = (text.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(&text);
    out
}

fn read_frame(s: &mut TcpStream) -> serde_json::Value {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut payload).unwrap();
    serde_json::from_slice(&payload).unwrap()
}

#[test]
fn node_serves_the_bridge_with_permissions_from_its_config_file() {
    let dir = std::env::temp_dir().join(format!("railyard-bridge-node-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("node.toml");
    std::fs::write(
        &config,
        "[bridge]\nport = 0\ninbound_permitted = [{ address = \"railyard.node.echo\" }]\nmax_frame_size = 4096\n",
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "node",
            "--no-saga",
            "--no-http",
            "--stats-every",
            "0",
            "--config",
        ])
        .arg(&config)
        .env("RAILYARD_LOG_FORMAT", "json")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start railyard node");
    let stderr = child.stderr.take().unwrap();
    let _reap = Reap(child);
    let rx = support::log::lines(stderr);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut addr = None;
    while addr.is_none() && Instant::now() < deadline {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            if v["fields"]["message"] == "bridge listening" {
                addr = v["fields"]["addr"].as_str().map(str::to_owned);
            }
        }
    }
    let addr = addr.expect("the node logs the bridge's address");
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&frame(&serde_json::json!({
        "type": "send", "address": "railyard.node.echo", "replyAddress": "r", "body": {"hi": 1}
    })))
    .unwrap();
    assert_eq!(
        read_frame(&mut s),
        serde_json::json!({"type":"message","address":"r","headers":{},"body":{"hi":1},"send":true})
    );
    s.write_all(&frame(
        &serde_json::json!({"type": "register", "address": "railyard.node.echo"}),
    ))
    .unwrap();
    assert_eq!(
        read_frame(&mut s),
        serde_json::json!({"type":"err","message":"access_denied"})
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_config_file_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("railyard-bridge-badcfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("node.toml");
    std::fs::write(
        &config,
        "[bridge]\ninbound_permitted = [{ address_regex = \"(\" }]\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["node", "--no-saga", "--bridge-port", "0", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("inbound_permitted") && err.contains("not a valid regular expression"),
        "{err}"
    );
    std::fs::write(&config, "[bridge]\nprot = 1\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["node", "--no-saga", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prot"), "unknown keys are named: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_bridge_writes_json_rows() {
    let dir =
        std::env::temp_dir().join(format!("railyard-bench-bridge-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("rows.json");
    let out = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "bench",
            "bridge",
            "--clients",
            "2",
            "--duration",
            "300ms",
            "--warmup",
            "100ms",
            "--idle",
            "3",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(
        (r["scenario"].as_str(), r["system"].as_str()),
        (Some("bridge"), Some("railyard"))
    );
    assert_eq!(r["clients"], 2);
    assert_eq!(
        (r["idle_ok"].as_u64(), r["idle_held"].as_u64()),
        (Some(3), Some(3))
    );
    assert!(r["round_trips"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["errors"], 0);
    let _ = std::fs::remove_dir_all(&dir);
}
