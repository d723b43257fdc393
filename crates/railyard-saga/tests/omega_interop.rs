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

mod omega_peer;

use std::sync::Arc;
use std::time::Duration;

use omega_peer::{peer_ready, run_peer, run_peer_with, strings};
use railyard_saga::{Coordinator, CoordinatorConfig, SagaState, SqliteConfig, SqliteStore};
use tokio::sync::oneshot;

struct Served {
    coordinator: Coordinator,
    _data: tempfile::TempDir,
    port: u16,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

async fn serve(advertise_akka: bool) -> Served {
    serve_with(CoordinatorConfig {
        advertise_akka,
        ..CoordinatorConfig::default()
    })
    .await
}

async fn serve_with(config: CoordinatorConfig) -> Served {
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
async fn sagas_against_real_omega(advertise_akka: bool) {
    if !peer_ready() {
        return;
    }
    let served = serve(advertise_akka).await;
    let r = run_peer(&format!("127.0.0.1:{}", served.port), 2, 2, "3,2").await;

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

/// A compensation that throws is retried: with the default configuration
/// (which advertises `AkkaEnabled`), Omega 0.7.1 reports the throw as
/// `TxCompensateAckFailedEvent` and the coordinator invokes it again after
/// the retry delay. (Without `AkkaEnabled`, Omega logs the throw and reports
/// `TxCompensatedEvent`: the undo never happened and nothing could retry it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_omega_compensation_that_throws_is_retried_by_default() {
    if !peer_ready() {
        return;
    }
    let served = serve_with(CoordinatorConfig {
        default_retry_delay: Duration::from_millis(200),
        ..CoordinatorConfig::default()
    })
    .await;
    let r = run_peer_with(
        &format!("127.0.0.1:{}", served.port),
        0,
        1,
        "3",
        &["--interop.flaky-compensation=charge"],
    )
    .await;
    assert_eq!(
        r["akka_enabled"], true,
        "the default advertises AkkaEnabled"
    );
    assert_eq!(
        r["compensation_failures"], 1,
        "charge's undo threw once: {r}"
    );
    assert_eq!(r["complete"], true, "every compensation really ran: {r}");
    assert_eq!(r["unexpected_compensations"], 0);
    let s = &r["sagas"][0];
    assert_eq!(strings(&s["compensations"]), ["charge", "reserve"], "{s}");
    let gid = s["global_tx_id"].as_str().expect("global_tx_id");
    served.wait_state(gid, SagaState::Compensated).await;
    served.stop().await;
}
