//! The saga coordinator killed with SIGKILL while Omega-protocol clients
//! report sagas, then restarted on the same store (embedded SQLite, then a
//! real PostgreSQL): every saga whose events were acknowledged comes back in
//! the state those events put it in, and every aborted saga still gets its
//! compensation.

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use railyard_saga_proto::omega::tx_event_service_client::TxEventServiceClient;
use railyard_saga_proto::omega::{GrpcServiceConfig, GrpcTxEvent};
use support::saga_node::SagaNode;

fn event(kind: &str, g: &str, l: &str, service: &str) -> GrpcTxEvent {
    GrpcTxEvent {
        timestamp: 1_700_000_000_000,
        global_tx_id: g.into(),
        local_tx_id: l.into(),
        parent_tx_id: if l == g { String::new() } else { g.into() },
        r#type: kind.into(),
        service_name: service.into(),
        instance_id: format!("{service}-1"),
        compensation_method: if kind == "TxStartedEvent" {
            format!("public void com.example.{service}.undo(java.lang.String)")
        } else {
            String::new()
        },
        payloads: if kind == "TxStartedEvent" {
            format!("payload of {g}/{l}").into_bytes()
        } else {
            Vec::new()
        },
        ..GrpcTxEvent::default()
    }
}

/// What the clients know was acknowledged for one saga.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Acked {
    /// SagaStarted (and perhaps its sub-transaction) acknowledged, no end.
    Running,
    /// SagaEnded acknowledged.
    Committed,
    /// TxAborted acknowledged after `car`'s sub-transaction ended.
    Aborted,
}

/// Runs sagas until the first error (the kill): two in three commit, one in
/// three aborts on `hotel` after `car` ended.
async fn client_loop(
    addr: String,
    task: usize,
    acked: Arc<Mutex<HashMap<String, Acked>>>,
) -> Result<(), tonic::Status> {
    let mut c = TxEventServiceClient::connect(format!("http://{addr}"))
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    for i in 0..100_000usize {
        let g = format!("g-{task}-{i}");
        c.on_tx_event(event("SagaStartedEvent", &g, &g, "booking"))
            .await?;
        acked.lock().unwrap().insert(g.clone(), Acked::Running);
        c.on_tx_event(event("TxStartedEvent", &g, "car-1", "car"))
            .await?;
        c.on_tx_event(event("TxEndedEvent", &g, "car-1", "car"))
            .await?;
        if i % 3 == 0 {
            c.on_tx_event(event("TxStartedEvent", &g, "hotel-1", "hotel"))
                .await?;
            let ack = c
                .on_tx_event(event("TxAbortedEvent", &g, "hotel-1", "hotel"))
                .await?;
            assert!(ack.into_inner().aborted, "an abort is answered aborted");
            acked.lock().unwrap().insert(g, Acked::Aborted);
        } else {
            c.on_tx_event(event("SagaEndedEvent", &g, &g, "booking"))
                .await?;
            acked.lock().unwrap().insert(g, Acked::Committed);
        }
    }
    Ok(())
}

/// Every saga the coordinator knows, by id, with its state.
fn states(node: &SagaNode) -> HashMap<String, String> {
    let (code, v) = node.get("/api/sagas?limit=10000");
    assert_eq!(code, 200, "{v}");
    v["sagas"]
        .as_array()
        .expect("a list of sagas")
        .iter()
        .map(|s| {
            (
                s["global_tx_id"].as_str().unwrap().to_owned(),
                s["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

async fn kill_under_load_then_recover(store_args: Vec<String>) {
    let node = SagaNode::start(&store_args);
    // `car` is connected but does not answer compensations before the kill,
    // so every abort acknowledged then is still owed a compensation.
    let mut c = TxEventServiceClient::connect(format!("http://{}", node.addr))
        .await
        .unwrap();
    let car = GrpcServiceConfig {
        service_name: "car".into(),
        instance_id: "car-1".into(),
    };
    let (cfg_tx, cfg_rx) = tokio::sync::mpsc::channel(1);
    cfg_tx.send(car.clone()).await.unwrap();
    let _before = c
        .on_connected(tokio_stream::wrappers::ReceiverStream::new(cfg_rx))
        .await
        .unwrap();

    let acked: Arc<Mutex<HashMap<String, Acked>>> = Arc::default();
    let clients: Vec<_> = (0..16)
        .map(|t| tokio::spawn(client_loop(node.addr.clone(), t, acked.clone())))
        .collect();
    // Load until enough of each outcome was acknowledged (bounded).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (commits, aborts) = {
            let a = acked.lock().unwrap();
            (
                a.values().filter(|x| **x == Acked::Committed).count(),
                a.values().filter(|x| **x == Acked::Aborted).count(),
            )
        };
        if (commits >= 200 && aborts >= 100) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.kill();
    for c in clients {
        let r = c.await.expect("client task");
        assert!(r.is_err(), "a client kept going after the kill");
    }
    let acked = acked.lock().unwrap().clone();
    let aborted: Vec<&String> = acked
        .iter()
        .filter(|(_, a)| **a == Acked::Aborted)
        .map(|(g, _)| g)
        .collect();
    assert!(
        aborted.len() >= 50,
        "too little load before the kill: {acked:?}"
    );
    eprintln!(
        "killed with {} sagas acknowledged: {} committed, {} aborted, the rest running",
        acked.len(),
        acked.values().filter(|a| **a == Acked::Committed).count(),
        aborted.len()
    );

    // Restart on the same store; `car` reconnects and answers every command.
    let node = SagaNode::start(&store_args);
    let mut c = TxEventServiceClient::connect(format!("http://{}", node.addr))
        .await
        .unwrap();
    let (cfg_tx, cfg_rx) = tokio::sync::mpsc::channel(1);
    cfg_tx.send(car).await.unwrap();
    let mut commands = c
        .on_connected(tokio_stream::wrappers::ReceiverStream::new(cfg_rx))
        .await
        .unwrap()
        .into_inner();
    let mut compensated: HashMap<String, Vec<u8>> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while aborted.iter().any(|g| !compensated.contains_key(*g)) {
        let left = deadline.saturating_duration_since(Instant::now());
        let cmd = tokio::time::timeout(left, commands.message())
            .await
            .unwrap_or_else(|_| {
                let missing: Vec<_> = aborted
                    .iter()
                    .filter(|g| !compensated.contains_key(**g))
                    .take(5)
                    .collect();
                panic!(
                    "{} aborted sagas got no compensation after the restart, e.g. {missing:?}",
                    aborted
                        .iter()
                        .filter(|g| !compensated.contains_key(**g))
                        .count()
                )
            })
            .expect("the command stream")
            .expect("the coordinator keeps the stream open");
        assert_eq!(cmd.local_tx_id, "car-1");
        let g = cmd.global_tx_id.clone();
        c.on_tx_event(event("TxCompensatedEvent", &g, "car-1", "car"))
            .await
            .expect("compensation acknowledged");
        compensated.insert(g, cmd.payloads.to_vec());
    }
    for g in &aborted {
        assert_eq!(
            compensated[*g],
            format!("payload of {g}/car-1").into_bytes(),
            "the command carries the TxStarted payloads"
        );
    }

    // Every acknowledged outcome is what the coordinator reports.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = states(&node);
        let wrong: Vec<(&String, &Acked, Option<&String>)> = acked
            .iter()
            .filter(|(g, a)| {
                let want = match a {
                    Acked::Running => "RUNNING",
                    Acked::Committed => "COMMITTED",
                    Acked::Aborted => "COMPENSATED",
                };
                // A saga whose last events were in flight at the kill may
                // have moved on (they may have been made durable without
                // the answer arriving): only "at least as far" is required.
                let st = now.get(*g).map(String::as_str);
                !(st == Some(want) || (**a == Acked::Running && st.is_some()))
            })
            .map(|(g, a)| (g, a, now.get(g)))
            .collect();
        if wrong.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} sagas are not in their acknowledged state after the restart, e.g. {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A saga finished (and compacted) before the kill is still found by id:
    // the store's summary answers.
    for g in acked
        .iter()
        .filter(|(_, a)| **a == Acked::Committed)
        .map(|(g, _)| g)
        .take(20)
    {
        let (code, body) = node.get(&format!("/api/sagas/{g}"));
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["saga"]["state"], "COMMITTED", "{body}");
    }
    drop(node);
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("railyard-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_loses_nothing_acknowledged_embedded() {
    let dir = temp_dir("saga-crash");
    kill_under_load_then_recover(vec![
        "--saga-store".into(),
        "embedded".into(),
        "--saga-data-dir".into(),
        dir.display().to_string(),
    ])
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_loses_nothing_acknowledged_postgres() {
    let pg = railyard_saga::PgServer::start()
        .expect("PostgreSQL (apt-get install postgresql; scripts/test does)");
    kill_under_load_then_recover(vec![
        "--saga-store".into(),
        "postgres".into(),
        "--saga-postgres-url".into(),
        pg.url(),
    ])
    .await;
}
