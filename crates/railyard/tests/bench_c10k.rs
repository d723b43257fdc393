//! `railyard bench c10k` end to end on a tiny scale: starts `railyard node`
//! on free ports, drives it with wrk (installed by scripts/test), measures
//! idle-connection memory and writes its JSON row. The fixed-rate phase
//! (oha) is skipped here with `--rate 0`.

use std::process::Command;

/// Two distinct free loopback ports (both held until both are picked).
fn free_ports() -> (u16, u16) {
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

#[test]
fn a_small_c10k_run_writes_a_json_row() {
    assert!(
        Command::new("wrk").arg("--version").output().is_ok(),
        "wrk is missing: install it (`apt-get install -y wrk`; scripts/test does)"
    );
    let dir = std::env::temp_dir().join(format!("railyard-c10k-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("c10k.json");
    let (port, admin) = free_ports();
    let out = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "bench",
            "c10k",
            "--connections",
            "50",
            "--idle-connections",
            "200",
            "--duration",
            "1s",
            "--warmup",
            "0s",
            "--rate",
            "0",
            "--port",
            &port.to_string(),
            "--admin-port",
            &admin.to_string(),
            "--json",
        ])
        .arg(&json)
        .output()
        .expect("run railyard");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("KiB per idle conn"), "{stdout}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r["scenario"], "c10k");
    assert_eq!(r["system"], "railyard");
    assert_eq!(r["path"], "/static/4k");
    assert_eq!(r["connections"], 50);
    assert_eq!(r["idle_connections"], 200);
    assert_eq!(r["errors"], 0, "{r}");
    assert!(r["requests_per_s"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["rss_mb"].as_f64().unwrap() > 0.0, "{r}");
    for k in ["p50", "p99", "p999", "max"] {
        assert!(r["latency_ms"][k].is_number(), "{r}");
    }
    assert!(r["rss_per_conn_kb"].is_number(), "{r}");
    std::fs::remove_dir_all(&dir).unwrap();
}
