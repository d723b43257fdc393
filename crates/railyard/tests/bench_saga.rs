//! `railyard bench saga` end to end on a tiny scale: the in-process
//! coordinator (in-memory store), both protocols, with aborts compensated,
//! and the JSON row's fields.

use std::process::Command;

fn run(protocol: &str, json: &std::path::Path) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "bench",
            "saga",
            "--store",
            "memory",
            "--protocol",
            protocol,
            "--transactions",
            "300",
            "--concurrency",
            "20",
            "--channels",
            "2",
            "--abort-ratio",
            "0.1",
            "--drain",
            "20s",
            "--json",
        ])
        .arg(json)
        .env("RAILYARD_LOG", "warn")
        .output()
        .expect("run railyard bench saga");
    assert!(
        out.status.success(),
        "bench saga failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("tx/s"), "a table is printed: {stdout}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(json).expect("json written"))
            .expect("valid JSON");
    assert_eq!(rows.len(), 1);
    rows.into_iter().next().expect("one row")
}

#[test]
fn both_protocols_commit_and_compensate_every_transaction() {
    let dir = std::env::temp_dir().join(format!("railyard-saga-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for protocol in ["omega", "native"] {
        let row = run(protocol, &dir.join(format!("{protocol}.json")));
        assert_eq!(row["scenario"], "saga");
        assert_eq!(row["system"], "railyard");
        assert_eq!(row["protocol"], protocol);
        assert_eq!(row["store"], "memory");
        assert_eq!(row["transactions"], 300);
        assert_eq!(row["concurrency"], 20);
        assert_eq!(row["committed"], 270, "{protocol}: {row}");
        assert_eq!(row["aborted"], 30, "{protocol}: {row}");
        assert_eq!(row["compensated"], 30, "{protocol}: {row}");
        assert_eq!(row["lost"], 0, "{protocol}: {row}");
        assert_eq!(row["errors"], 0, "{protocol}: {row}");
        assert_eq!(row["events"], 300 * 8, "{protocol}: {row}");
        for key in ["p50", "p99", "p999", "max"] {
            assert!(
                row["latency_ms"][key].as_f64().is_some_and(|v| v > 0.0),
                "{protocol}: latency_ms.{key} in {row}"
            );
        }
        assert!(row["tx_per_s"].as_f64().is_some_and(|v| v > 0.0));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn vs_dtm_says_the_peer_is_not_available() {
    let out = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["bench", "saga", "--store", "memory", "--vs", "dtm"])
        .output()
        .expect("run railyard bench saga");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("DTM peer"), "{err}");
}
