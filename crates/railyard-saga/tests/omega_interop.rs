//! Interop with the real Omega client: `peers/omega-interop`, a Spring Boot
//! service on Apache ServiceComb Pack's Omega 0.7.1 from Maven Central
//! (unmodified), runs successful and failing sagas against Railyard's
//! coordinator served over real gRPC on a loopback port, on its durable
//! embedded store (SQLite in a temporary directory).
//!
//! Checked: a successful saga ends COMMITTED; a saga whose third step throws
//! gets its two completed steps compensated in reverse order (charge, then
//! reserve), one whose second step throws gets the first compensated, each
//! by Omega really invoking the compensation method (the peer records the
//! invocations and the global transaction id Omega set for each) and the
//! coordinator records the saga COMPENSATED; nothing else is compensated.
//! Both of Omega's modes run: without `AkkaEnabled` in the server meta
//! (TxAbortedEvent / TxCompensatedEvent) and with it (SagaAbortedEvent /
//! TxCompensateAckSucceedEvent).
//!
//! `scripts/test` builds the peer with Maven and sets
//! `RAILYARD_REQUIRE_INTEROP=1`, so in CI a missing Java or jar fails these
//! tests; on a dev box without them they skip, loudly.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use railyard_saga::{Coordinator, CoordinatorConfig, SagaState, SqliteConfig, SqliteStore};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::oneshot;

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

/// Java present and the peer jar built (built here with Maven if missing
/// and Maven is present).
fn peer_ready() -> bool {
    if !need(
        "Java 17",
        have("java", "-version"),
        "install a JDK (apt-get install -y openjdk-17-jdk-headless)",
    ) {
        return false;
    }
    if !peer_jar().is_file() && have("mvn", "-v") {
        eprintln!("building peers/omega-interop with Maven (first run only)...");
        let _ = std::process::Command::new("mvn")
            .args(["-q", "-B", "package", "-DskipTests"])
            .current_dir(peer_dir())
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
struct Served {
    coordinator: Coordinator,
    _data: tempfile::TempDir,
    port: u16,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

async fn serve(advertise_akka: bool) -> Served {
    let config = CoordinatorConfig {
        advertise_akka,
        ..CoordinatorConfig::default()
    };
    let data = tempfile::tempdir().expect("a data directory");
    let store = SqliteStore::open(data.path(), SqliteConfig::default())
        .await
        .expect("the embedded store opens");
    let coordinator = Coordinator::start(Arc::new(store), config)
        .await
        .expect("the coordinator starts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let port = listener.local_addr().expect("local addr").port();
    let (stop, stopped) = oneshot::channel::<()>();
    let c = coordinator.clone();
    let task = tokio::spawn(async move {
        railyard_saga::serve(c, listener, async {
            let _ = stopped.await;
        })
        .await
        .expect("the coordinator serves");
    });
    Served {
        coordinator,
        _data: data,
        port,
        stop: Some(stop),
        task,
    }
}

impl Served {
    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
    }

    /// Waits (bounded) until the coordinator reports `gid` in `state`.
    async fn wait_state(&self, gid: &str, state: SagaState) {
        for _ in 0..500 {
            if self.coordinator.state(gid) == Some(state) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "saga {gid} never reached {state:?} on the coordinator; it is {:?}",
            self.coordinator.state(gid)
        );
    }
}

/// Runs the peer against `port` and returns its RESULT object.
async fn run_peer(port: u16, ok: u32, failing: u32, fail_at: &str) -> Value {
    let mut child = Command::new("java")
        .args(jvm_flags())
        .arg("-jar")
        .arg(peer_jar())
        .arg(format!("--alpha.cluster.address=127.0.0.1:{port}"))
        .arg(format!("--interop.ok={ok}"))
        .arg(format!("--interop.failing={failing}"))
        .arg(format!("--interop.fail-at={fail_at}"))
        .arg("--interop.wait-seconds=30")
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

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|s| s.as_str().expect("a string"))
        .collect()
}

async fn sagas_against_real_omega(advertise_akka: bool) {
    if !peer_ready() {
        return;
    }
    let served = serve(advertise_akka).await;
    let r = run_peer(served.port, 2, 2, "3,2").await;

    assert_eq!(
        r["akka_enabled"], advertise_akka,
        "Omega read the server meta"
    );
    assert_eq!(r["sagas_ok"], 2, "both successful sagas returned normally");
    assert_eq!(r["sagas_failed"], 2, "both failing sagas threw");
    assert_eq!(r["compensations_expected"], 3);
    assert_eq!(
        r["compensations_invoked"], 3,
        "every expected compensation was invoked"
    );
    assert_eq!(r["complete"], true);
    assert_eq!(
        r["unexpected_compensations"], 0,
        "nothing else was compensated"
    );

    let sagas = r["sagas"].as_array().expect("sagas");
    assert_eq!(sagas.len(), 4);
    for s in sagas {
        let gid = s["global_tx_id"].as_str().expect("global_tx_id");
        assert!(!gid.is_empty(), "Omega gave every saga a global id: {s}");
        match s["fail_at"].as_u64().expect("fail_at") {
            0 => {
                assert_eq!(s["outcome"], "committed", "{s}");
                assert_eq!(strings(&s["ran"]), ["reserve", "charge", "ship"]);
                assert!(strings(&s["compensations"]).is_empty(), "{s}");
                served.wait_state(gid, SagaState::Committed).await;
            }
            3 => {
                assert_eq!(s["outcome"], "aborted", "{s}");
                assert_eq!(strings(&s["ran"]), ["reserve", "charge"]);
                // Reverse order of completion; the failed step is not compensated.
                assert_eq!(strings(&s["compensations"]), ["charge", "reserve"], "{s}");
                assert_eq!(strings(&s["compensation_global_tx_ids"]), [gid, gid]);
                served.wait_state(gid, SagaState::Compensated).await;
            }
            2 => {
                assert_eq!(s["outcome"], "aborted", "{s}");
                assert_eq!(strings(&s["ran"]), ["reserve"]);
                assert_eq!(strings(&s["compensations"]), ["reserve"], "{s}");
                assert_eq!(strings(&s["compensation_global_tx_ids"]), [gid]);
                served.wait_state(gid, SagaState::Compensated).await;
            }
            other => panic!("unexpected fail_at {other}: {s}"),
        }
    }
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_omega_commits_and_compensates_in_reverse_order() {
    sagas_against_real_omega(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_omega_with_akka_meta_acks_its_compensations() {
    sagas_against_real_omega(true).await;
}
