//! `railyard bench saga` end to end on a tiny scale: the in-process
//! coordinator on each store (the embedded SQLite one, a throwaway
//! PostgreSQL from Debian's package, which scripts/test installs, and the
//! in-memory one), both protocols, with aborts compensated, and the JSON
//! row's fields.

use std::process::Command;

fn run(protocol: &str, store: &str, json: &std::path::Path) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args([
            "bench",
            "saga",
            "--store",
            store,
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

fn check(protocol: &str, store: &str) {
    let dir = std::env::temp_dir().join(format!(
        "railyard-saga-cli-{}-{protocol}-{store}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let row = run(protocol, store, &dir.join("row.json"));
    let _ = std::fs::remove_dir_all(&dir);
    let what = format!("{protocol} on {store}: {row}");
    assert_eq!(row["scenario"], "saga");
    assert_eq!(row["system"], "railyard");
    assert_eq!(row["protocol"], protocol);
    assert_eq!(row["store"], store);
    assert_eq!(row["transactions"], 300);
    assert_eq!(row["concurrency"], 20);
    assert_eq!(row["committed"], 270, "{what}");
    assert_eq!(row["aborted"], 30, "{what}");
    assert_eq!(row["compensated"], 30, "{what}");
    assert_eq!(row["lost"], 0, "{what}");
    assert_eq!(row["errors"], 0, "{what}");
    assert_eq!(row["events"], 300 * 8, "{what}");
    for key in ["p50", "p99", "p999", "max"] {
        assert!(
            row["latency_ms"][key].as_f64().is_some_and(|v| v > 0.0),
            "latency_ms.{key}: {what}"
        );
    }
    assert!(row["tx_per_s"].as_f64().is_some_and(|v| v > 0.0), "{what}");
}

#[test]
fn both_protocols_commit_and_compensate_every_transaction_on_the_embedded_store() {
    check("omega", "embedded");
    check("native", "embedded");
}

#[test]
fn both_protocols_work_on_postgres_and_in_memory() {
    check("omega", "postgres");
    check("native", "postgres");
    check("native", "memory");
}

#[test]
fn vs_dtm_needs_a_durable_store() {
    let out = Command::new(env!("CARGO_BIN_EXE_railyard"))
        .args(["bench", "saga", "--store", "memory", "--vs", "dtm"])
        .output()
        .expect("run railyard bench saga");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--store embedded"), "{err}");
}
