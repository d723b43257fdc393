//! Omega's `TxEventService` over real tonic on loopback, on a `MemoryStore`.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{ev, send, started, GatedStore, OmegaInstance, Server};
use railyard_saga::{CoordinatorConfig, EventKind, SagaQuery, SagaState, SagaStore, StoreError};
use railyard_saga_proto::omega::{GrpcServiceConfig, GrpcTxEvent};

/// Quick timers, and a reverse timeout no test's answer can miss on a
/// loaded machine (a resent command would show up as an unexpected one);
/// the test of unanswered commands sets a short one itself.
fn fast() -> CoordinatorConfig {
    CoordinatorConfig {
        timer_tick: Duration::from_millis(10),
        default_reverse_timeout: Duration::from_secs(30),
        default_retry_delay: Duration::from_millis(20),
        instance_wait: Duration::from_secs(20),
        ..CoordinatorConfig::default()
    }
}

#[tokio::test]
async fn a_saga_that_ends_is_committed_and_compacted() {
    let (server, store) = Server::memory(fast()).await;
    let mut c = server.omega().await;
    let g = "g-commit";
    assert!(!send(&mut c, ev("SagaStartedEvent", g, g, "booking")).await);
    for (lid, svc) in [("l1", "car"), ("l2", "hotel"), ("l3", "flight")] {
        assert!(!send(&mut c, started(g, lid, svc, b"x")).await);
        assert!(!send(&mut c, ev("TxEndedEvent", g, lid, svc)).await);
    }
    assert_eq!(server.coordinator.state(g), Some(SagaState::Running));
    assert!(!send(&mut c, ev("SagaEndedEvent", g, g, "booking")).await);
    assert_eq!(server.coordinator.state(g), Some(SagaState::Committed));
    server.coordinator.flush().await.unwrap();
    // Compacted: no events left, a summary kept.
    assert!(store.unfinished().await.unwrap().is_empty());
    let done = common::finished_in(&*store, SagaState::Committed).await;
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].global_tx_id, g);
    assert_eq!(done[0].sub_transactions, 3);
    assert_eq!(done[0].events, 8);
    // A duplicate SagaEnded after the end is answered, not aborted.
    assert!(!send(&mut c, ev("SagaEndedEvent", g, g, "booking")).await);
    server.stop().await;
}

#[tokio::test]
async fn an_abort_compensates_in_reverse_order_with_payloads_verbatim() {
    let (server, _store) = Server::memory(fast()).await;
    let mut c = server.omega().await;
    let mut car = OmegaInstance::connect(&mut c, "car", "car-1").await;
    let mut hotel = OmegaInstance::connect(&mut c, "hotel", "hotel-1").await;
    server.wait_instances(2).await;

    let g = "g-abort";
    send(&mut c, ev("SagaStartedEvent", g, g, "booking")).await;
    // Payloads with every byte value, to catch any re-encoding.
    let p1: Vec<u8> = (0..=255u8).collect();
    let p2: Vec<u8> = (0..=255u8).rev().collect();
    let p3 = vec![0u8, 0xff, 0x00, 0x7f];
    for (lid, svc, p) in [("a1", "car", &p1), ("b1", "hotel", &p2), ("a2", "car", &p3)] {
        assert!(!send(&mut c, started(g, lid, svc, p)).await);
        assert!(!send(&mut c, ev("TxEndedEvent", g, lid, svc)).await);
    }
    send(&mut c, started(g, "b2", "hotel", b"never-ended")).await;
    // b2 fails: the saga aborts; the answer says so.
    assert!(send(&mut c, ev("TxAbortedEvent", g, "b2", "hotel")).await);
    assert_eq!(server.coordinator.state(g), Some(SagaState::Compensating));

    // Last started first: a2 on car.
    let cmd = car.next().await;
    assert_eq!(
        (cmd.global_tx_id.as_str(), cmd.local_tx_id.as_str()),
        (g, "a2")
    );
    assert_eq!(cmd.payloads, p3);
    assert_eq!(
        cmd.compensation_method,
        "public void com.example.car.undo(java.lang.String)"
    );
    assert_eq!(cmd.parent_tx_id, g);
    // Sequential: nothing else until a2 is compensated.
    hotel.none_within(Duration::from_millis(100)).await;
    send(&mut c, ev("TxCompensatedEvent", g, "a2", "car")).await;

    let cmd = hotel.next().await;
    assert_eq!(cmd.local_tx_id, "b1");
    assert_eq!(cmd.payloads, p2);
    // The Akka flavour of the answer is accepted too.
    send(&mut c, ev("TxCompensateAckSucceedEvent", g, "b1", "hotel")).await;

    let cmd = car.next().await;
    assert_eq!(cmd.local_tx_id, "a1");
    assert_eq!(cmd.payloads, p1);
    send(&mut c, ev("TxCompensatedEvent", g, "a1", "car")).await;

    server.wait_state(g, SagaState::Compensated).await;
    // The never-ended, aborted b2 got no command.
    hotel.none_within(Duration::from_millis(100)).await;
    // Late events after the terminal state are answered aborted=true.
    assert!(send(&mut c, started(g, "late", "car", b"z")).await);
    assert!(send(&mut c, ev("SagaEndedEvent", g, g, "booking")).await);
    car.none_within(Duration::from_millis(100)).await;
    server.stop().await;
}

#[tokio::test]
async fn out_of_order_and_duplicate_events_are_idempotent() {
    let (server, store) = Server::memory(fast()).await;
    let mut c = server.omega().await;
    let mut svc = OmegaInstance::connect(&mut c, "svc", "svc-1").await;
    server.wait_instances(1).await;

    // Events for a saga never started: it is created implicitly.
    let g = "g-ooo";
    assert!(!send(&mut c, ev("TxEndedEvent", g, "l1", "svc")).await);
    assert_eq!(server.coordinator.state(g), Some(SagaState::Running));
    // TxEnded before TxStarted: the later TxStarted supplies the payloads.
    assert!(!send(&mut c, started(g, "l1", "svc", b"first")).await);
    // A duplicate TxStarted with other payloads changes nothing.
    assert!(!send(&mut c, started(g, "l1", "svc", b"second")).await);
    // SagaStarted arriving late is accepted.
    assert!(!send(&mut c, ev("SagaStartedEvent", g, g, "svc")).await);
    assert!(!send(&mut c, ev("SagaStartedEvent", g, g, "svc")).await);
    // Duplicate TxEnded.
    assert!(!send(&mut c, ev("TxEndedEvent", g, "l1", "svc")).await);
    // A compensation report while running changes nothing.
    assert!(!send(&mut c, ev("TxCompensatedEvent", g, "l1", "svc")).await);
    let view = server.coordinator.saga(g).unwrap();
    assert_eq!(view.sub_transactions.len(), 1);
    assert_eq!(
        view.sub_transactions[0].state,
        railyard_saga::SubState::Ended
    );

    // SagaAborted (the Akka flavour of a failed @SagaStart) aborts.
    assert!(send(&mut c, ev("SagaAbortedEvent", g, g, "svc")).await);
    // Duplicate aborts: same answer, no second command.
    assert!(send(&mut c, ev("TxAbortedEvent", g, g, "svc")).await);
    let cmd = svc.next().await;
    assert_eq!(cmd.local_tx_id, "l1");
    assert_eq!(cmd.payloads, &b"first"[..]);
    // TxStarted for an aborted saga: aborted=true, recorded as aborted.
    assert!(send(&mut c, started(g, "l2", "svc", b"p")).await);
    // SagaEnded after the abort: aborted=true, the saga keeps compensating.
    assert!(send(&mut c, ev("SagaEndedEvent", g, g, "svc")).await);
    assert_eq!(server.coordinator.state(g), Some(SagaState::Compensating));
    // A duplicate report of the compensation: counted once.
    send(&mut c, ev("TxCompensatedEvent", g, "l1", "svc")).await;
    send(&mut c, ev("TxCompensatedEvent", g, "l1", "svc")).await;
    server.wait_state(g, SagaState::Compensated).await;
    svc.none_within(Duration::from_millis(100)).await;

    // A compensation report for a saga never seen: answered, not recorded.
    let before = store.unfinished().await.unwrap().len();
    assert!(!send(&mut c, ev("TxCompensatedEvent", "g-unknown", "x", "svc")).await);
    assert_eq!(store.unfinished().await.unwrap().len(), before);
    assert_eq!(server.coordinator.state("g-unknown"), None);
    server.stop().await;
}

#[tokio::test]
async fn malformed_events_get_invalid_argument_and_the_server_keeps_serving() {
    let (server, store) = Server::memory(fast()).await;
    let mut c = server.omega().await;
    let err = c
        .on_tx_event(ev("NoSuchEvent", "g", "g", "svc"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("unknown event type \"NoSuchEvent\""),
        "{}",
        err.message()
    );

    let err = c
        .on_tx_event(ev("SagaStartedEvent", "", "", "svc"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("globalTxId is empty"),
        "{}",
        err.message()
    );

    let err = c
        .on_tx_event(ev("TxStartedEvent", "g", "", "svc"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // The coordinator's own records are not accepted from participants.
    let err = c
        .on_tx_event(ev("SagaTimeoutEvent", "g", "g", "svc"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    assert!(
        store.unfinished().await.unwrap().is_empty(),
        "nothing malformed recorded"
    );
    // Same connection, still serving.
    assert!(!send(&mut c, ev("SagaStartedEvent", "g", "g", "svc")).await);
    let meta = c
        .on_get_server_meta(GrpcServiceConfig {
            service_name: "svc".into(),
            instance_id: "svc-1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        meta.meta.get("AkkaEnabled").map(String::as_str),
        Some("true"),
        "the default advertises AkkaEnabled"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_compensation_waits_for_an_instance_that_registers_late() {
    let (server, _store) = Server::memory(fast()).await;
    let mut c = server.omega().await;
    let g = "g-race";
    // The instance reports before its OnConnected registration arrives.
    send(&mut c, ev("SagaStartedEvent", g, g, "svc")).await;
    send(&mut c, started(g, "l1", "svc", b"payload")).await;
    send(&mut c, ev("TxEndedEvent", g, "l1", "svc")).await;
    assert!(send(&mut c, ev("TxAbortedEvent", g, g, "svc")).await);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut svc = OmegaInstance::connect(&mut c, "svc", "svc-1").await;
    let cmd = svc.next().await;
    assert_eq!(cmd.local_tx_id, "l1");
    assert_eq!(cmd.payloads, &b"payload"[..]);
    send(&mut c, ev("TxCompensatedEvent", g, "l1", "svc")).await;
    server.wait_state(g, SagaState::Compensated).await;
    server.stop().await;
}

#[tokio::test]
async fn a_participant_reconnecting_as_a_new_instance_gets_the_pending_compensation() {
    let (server, _store) = Server::memory(fast()).await;
    let mut c = server.omega().await;
    let first = OmegaInstance::connect(&mut c, "svc", "svc-old").await;
    server.wait_instances(1).await;
    let g = "g-reconnect";
    send(&mut c, ev("SagaStartedEvent", g, g, "svc")).await;
    let mut e = started(g, "l1", "svc", b"keep-me");
    e.instance_id = "svc-old".into();
    send(&mut c, e).await;
    send(&mut c, ev("TxEndedEvent", g, "l1", "svc")).await;
    // The old instance vanishes before the abort.
    drop(first);
    for _ in 0..500 {
        if server.coordinator.instances().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(send(&mut c, ev("TxAbortedEvent", g, g, "svc")).await);
    let mut second = OmegaInstance::connect(&mut c, "svc", "svc-new").await;
    let cmd = second.next().await;
    assert_eq!(cmd.local_tx_id, "l1");
    assert_eq!(cmd.payloads, &b"keep-me"[..]);
    send(&mut c, ev("TxCompensatedEvent", g, "l1", "svc")).await;
    server.wait_state(g, SagaState::Compensated).await;
    server.stop().await;
}

/// A command an instance took and did not answer goes to another instance
/// as soon as its connection ends, without counting an attempt (before, it
/// waited out the 30 s reverse timeout and cost one of the attempts).
#[tokio::test]
async fn a_command_held_by_an_instance_that_goes_away_goes_to_another_at_once() {
    let (server, _store) = Server::memory(fast()).await;
    let registry = railyard_saga::MetricsRegistry::default();
    server.coordinator.register_metrics(&registry);
    let mut c = server.omega().await;
    let mut first = OmegaInstance::connect(&mut c, "svc", "svc-1").await;
    let mut second = OmegaInstance::connect(&mut c, "svc", "svc-2").await;
    server.wait_instances(2).await;
    let g = "g-vanished";
    send(&mut c, ev("SagaStartedEvent", g, g, "booking")).await;
    let mut e = started(g, "l1", "svc", b"p");
    e.instance_id = "svc-1".into();
    e.reverse_retries = 1; // two attempts: a lost one must not use one up
    send(&mut c, e).await;
    send(&mut c, ev("TxEndedEvent", g, "l1", "svc")).await;
    assert!(send(&mut c, ev("TxAbortedEvent", g, g, "booking")).await);
    // The instance that ran the step gets it, and goes away unanswered.
    assert_eq!(first.next().await.local_tx_id, "l1");
    drop(first);
    let t0 = std::time::Instant::now();
    let again = second.next().await;
    assert_eq!(again.local_tx_id, "l1");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "sent again when the connection ended, not after the 30 s reverse timeout"
    );
    let text = railyard_saga::encode_metrics(&registry);
    assert!(
        text.contains("railyard_saga_compensations_rerouted_total 1"),
        "{text}"
    );
    // The lost attempt was not counted: a failure now still leaves one.
    send(&mut c, ev("TxCompensateAckFailedEvent", g, "l1", "svc")).await;
    assert_eq!(second.next().await.local_tx_id, "l1", "the second attempt");
    // Only the first loss is free: losing the last attempt too counts as
    // its failure, which uses up the step's attempts.
    drop(second);
    server.wait_state(g, SagaState::Failed).await;
    let text = railyard_saga::encode_metrics(&registry);
    assert!(
        text.contains("railyard_saga_compensations_rerouted_total 1"),
        "{text}"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_unanswered_compensation_is_resent_and_exhausted_retries_fail_the_saga() {
    let config = CoordinatorConfig {
        default_reverse_timeout: Duration::from_millis(1500),
        ..fast()
    };
    let (server, store) = Server::memory(config).await;
    let registry = railyard_saga::MetricsRegistry::default();
    server.coordinator.register_metrics(&registry);
    let mut c = server.omega().await;
    let mut svc = OmegaInstance::connect(&mut c, "svc", "svc-1").await;
    server.wait_instances(1).await;
    let g = "g-fail";
    send(&mut c, ev("SagaStartedEvent", g, g, "svc")).await;
    send(&mut c, started(g, "l0", "svc", b"zero")).await;
    send(&mut c, ev("TxEndedEvent", g, "l0", "svc")).await;
    let mut e = started(g, "l1", "svc", b"one");
    e.reverse_retries = 2; // three attempts
    e.retry_delay_in_milliseconds = 10;
    send(&mut c, e).await;
    send(&mut c, ev("TxEndedEvent", g, "l1", "svc")).await;
    assert!(send(&mut c, ev("TxAbortedEvent", g, g, "svc")).await);

    // Attempt 1: answered with a failure.
    let cmd = svc.next().await;
    assert_eq!(cmd.local_tx_id, "l1");
    send(&mut c, ev("TxCompensateAckFailedEvent", g, "l1", "svc")).await;
    // Attempt 2: no answer (reverse timeout 1.5 s).
    let cmd = svc.next().await;
    assert_eq!(
        (cmd.local_tx_id.as_str(), &cmd.payloads[..]),
        ("l1", &b"one"[..])
    );
    // Attempt 3: failed again.
    let cmd = svc.next().await;
    assert_eq!(cmd.local_tx_id, "l1");
    send(&mut c, ev("TxCompensateAckFailedEvent", g, "l1", "svc")).await;
    server.wait_state(g, SagaState::Failed).await;
    // l0 (started earlier) is not compensated once l1 could not be.
    svc.none_within(Duration::from_millis(200)).await;
    server.coordinator.flush().await.unwrap();
    let failed = common::finished_in(&*store, SagaState::Failed).await;
    assert_eq!(failed.len(), 1);
    // The last attempt was given up by its failure report (not a timeout):
    // the metric counts it all the same.
    let text = railyard_saga::encode_metrics(&registry);
    assert!(
        text.lines()
            .any(|l| l == "railyard_saga_compensations_failed_total 1"),
        "{text}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_store_failure_is_an_error_not_an_ack() {
    let fail = Arc::new(AtomicBool::new(false));
    let f = fail.clone();
    let store = Arc::new(GatedStore::new(move || {
        let broken = f.load(Ordering::SeqCst);
        Box::pin(async move {
            if broken {
                Err(StoreError::Unavailable("disk unplugged".into()))
            } else {
                Ok(())
            }
        })
    }));
    let server = Server::start(store.clone(), fast()).await;
    let mut c = server.omega().await;
    fail.store(true, Ordering::SeqCst);
    let err = c
        .on_tx_event(ev("SagaStartedEvent", "g", "g", "svc"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert!(err.message().contains("disk unplugged"));
    // Not applied either.
    assert_eq!(server.coordinator.state("g"), None);
    fail.store(false, Ordering::SeqCst);
    assert!(!send(&mut c, ev("SagaStartedEvent", "g", "g", "svc")).await);
    let events = store.unfinished().await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].kind, Some(EventKind::SagaStarted));
    server.stop().await;
}

#[tokio::test]
async fn a_stop_closes_streams_refuses_connections_and_waits_for_calls_in_flight() {
    let gating = Arc::new(AtomicBool::new(false));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let entered = Arc::new(tokio::sync::Notify::new());
    let (g, r, e) = (gating.clone(), release.clone(), entered.clone());
    let store = Arc::new(GatedStore::new(move || {
        let (gate, release, entered) = (g.load(Ordering::SeqCst), r.clone(), e.clone());
        Box::pin(async move {
            if gate {
                entered.notify_one();
                let _permit = release
                    .acquire()
                    .await
                    .map_err(|_| StoreError::Unavailable("gate closed".into()))?;
            }
            Ok(())
        })
    }));
    let mut server = Server::start(store, fast()).await;
    let mut c = server.omega().await;
    let mut instance = OmegaInstance::connect(&mut c, "svc", "svc-1").await;
    server.wait_instances(1).await;
    gating.store(true, Ordering::SeqCst);
    let mut c2 = c.clone();
    let call = tokio::spawn(async move {
        c2.on_tx_event(ev("SagaStartedEvent", "g", "g", "svc"))
            .await
    });
    tokio::time::timeout(Duration::from_secs(10), entered.notified())
        .await
        .expect("the call's append started within 10 s");
    let serving = server.signal_stop();
    // The participant's stream ends (streams never end on their own) ...
    let end = tokio::time::timeout(Duration::from_secs(10), instance.commands.message())
        .await
        .expect("the stream ends within 10 s");
    assert!(
        !matches!(end, Ok(Some(_))),
        "a command instead of the end: {end:?}"
    );
    // ... the port no longer accepts ...
    let refused = tokio::net::TcpStream::connect(server.addr).await;
    assert!(
        refused.is_err(),
        "a new connection was accepted after the stop"
    );
    // ... and the server waits for the call still in the store.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !serving.is_finished(),
        "serve returned with a call in flight"
    );
    release.add_permits(1);
    let answer = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the call is answered within 10 s")
        .expect("the call's task")
        .expect("an acknowledgement, not an error");
    assert!(!answer.into_inner().aborted);
    tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .expect("serve returns within 10 s of the last answer")
        .expect("the serving task");
}

#[tokio::test]
async fn many_concurrent_clients_are_all_acknowledged() {
    let (server, store) = Server::memory(fast()).await;
    let mut tasks = Vec::new();
    for i in 0..50 {
        let mut c = server.omega().await;
        tasks.push(tokio::spawn(async move {
            for j in 0..4 {
                let g = format!("g-{i}-{j}");
                let events: Vec<GrpcTxEvent> = vec![
                    ev("SagaStartedEvent", &g, &g, "bench"),
                    started(&g, "a", "a", b""),
                    ev("TxEndedEvent", &g, "a", "a"),
                    ev("SagaEndedEvent", &g, &g, "bench"),
                ];
                for e in events {
                    assert!(!send(&mut c, e).await);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    server.coordinator.flush().await.unwrap();
    let stats = store.stats().await.unwrap();
    let committed: u64 = stats
        .finished
        .iter()
        .filter(|(s, _)| s == "COMMITTED")
        .map(|(_, n)| *n)
        .sum();
    assert!(committed >= 1, "some finished");
    // Whatever was not flushed yet is still unfinished, none lost.
    let left = store.unfinished().await.unwrap();
    let mut ids: std::collections::HashSet<String> =
        left.into_iter().map(|e| e.global_tx_id).collect();
    for s in store
        .finished(SagaQuery {
            limit: 1000,
            ..SagaQuery::default()
        })
        .await
        .unwrap()
    {
        ids.insert(s.global_tx_id);
    }
    assert_eq!(ids.len(), 200);
    server.stop().await;
}

#[tokio::test]
async fn appends_of_concurrent_events_are_outstanding_together() {
    const N: usize = 16;
    // Appends complete only once N of them are outstanding together: an
    // engine that serialized appends would deadlock here.
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let store = Arc::new(GatedStore::new(move || {
        let b = barrier.clone();
        Box::pin(async move {
            b.wait().await;
            Ok(())
        })
    }));
    let server = Server::start(store.clone(), fast()).await;
    let c = server.omega().await;
    let calls: Vec<_> = (0..N)
        .map(|i| {
            let mut c = c.clone();
            tokio::spawn(async move {
                let g = format!("g-{i}");
                send(&mut c, ev("SagaStartedEvent", &g, &g, "svc")).await
            })
        })
        .collect();
    for call in calls {
        let aborted = tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .expect("all appends in flight at once complete")
            .unwrap();
        assert!(!aborted);
    }
    assert_eq!(store.inner.unfinished().await.unwrap().len(), N);
    server.stop().await;
}

#[tokio::test]
async fn finished_sagas_are_compacted_in_the_background() {
    let (server, store) = Server::memory(fast()).await;
    let mut c = server.omega().await;
    for i in 0..20 {
        let g = format!("g-bg-{i}");
        send(&mut c, ev("SagaStartedEvent", &g, &g, "svc")).await;
        send(&mut c, ev("SagaEndedEvent", &g, &g, "svc")).await;
    }
    // No flush: the finisher task hands them to the store by itself.
    for _ in 0..500 {
        if store.unfinished().await.unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(store.unfinished().await.unwrap().is_empty());
    let s = store.stats().await.unwrap();
    assert_eq!(s.finished, [("COMMITTED".to_owned(), 20)]);
    // OnDisconnected unregisters the instance.
    let _inst = OmegaInstance::connect(&mut c, "svc", "svc-1").await;
    server.wait_instances(1).await;
    c.on_disconnected(GrpcServiceConfig {
        service_name: "svc".into(),
        instance_id: "svc-1".into(),
    })
    .await
    .unwrap();
    assert!(server.coordinator.instances().is_empty());
    server.stop().await;
}

/// Two processes with the same instance id (Omega's default id is
/// `service-IP`, so two JVMs on one host share it): one says
/// `OnDisconnected`, and only its own link goes; the other still gets its
/// commands.
#[tokio::test]
async fn on_disconnected_drops_only_the_link_of_the_caller() {
    let (server, _store) = Server::memory(fast()).await;
    let mut leaving = server.omega().await;
    let mut staying = server.omega().await;
    let _gone = OmegaInstance::connect(&mut leaving, "car", "car-10.0.0.1").await;
    let mut live = OmegaInstance::connect(&mut staying, "car", "car-10.0.0.1").await;
    server.wait_instances(2).await;
    leaving
        .on_disconnected(GrpcServiceConfig {
            service_name: "car".into(),
            instance_id: "car-10.0.0.1".into(),
        })
        .await
        .unwrap();
    assert_eq!(
        server.coordinator.instances().len(),
        1,
        "the other process's link stays"
    );
    let g = "g-shared-id";
    send(&mut staying, ev("SagaStartedEvent", g, g, "booking")).await;
    send(&mut staying, started(g, "l1", "car", b"p")).await;
    send(&mut staying, ev("TxEndedEvent", g, "l1", "car")).await;
    assert!(send(&mut staying, ev("TxAbortedEvent", g, g, "booking")).await);
    let cmd = live.next().await;
    assert_eq!(
        (cmd.global_tx_id.as_str(), cmd.local_tx_id.as_str()),
        (g, "l1")
    );
    server.stop().await;
}

/// One `OnTxEvent` call written by hand on an HTTP/2 connection: the gRPC
/// status it got and its message.
async fn raw_call(
    send: &mut h2::client::SendRequest<bytes::Bytes>,
    body: Vec<u8>,
) -> (String, String) {
    common::raw_grpc_call(send, "/TxEventService/OnTxEvent", body).await
}

fn grpc_frame(flag: u8, message: &[u8]) -> Vec<u8> {
    railyard_saga::grpc_frame::frame_bytes(flag != 0, message).to_vec()
}

#[tokio::test]
async fn malformed_grpc_bytes_fail_their_own_call_and_the_connection_keeps_serving() {
    use prost::Message;
    let (server, store) = Server::memory(fast()).await;
    let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let (mut send, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let internal = (tonic::Code::Internal as i32).to_string();

    // Not protobuf (a field with wire type 7).
    let (status, message) = raw_call(&mut send, grpc_frame(0, &[0x0f, 0xff, 0xff])).await;
    assert_eq!(status, internal, "{message}");
    assert!(message.contains("decode"), "{message}");
    // The compressed flag without a grpc-encoding.
    let (status, message) = raw_call(&mut send, grpc_frame(1, b"abc")).await;
    assert_eq!(status, internal, "{message}");
    assert!(message.contains("compressed"), "{message}");
    // A body that ends inside its message, and one with no message at all.
    let mut cut = grpc_frame(0, &ev("SagaStartedEvent", "g", "g", "svc").encode_to_vec());
    cut.truncate(cut.len() - 3);
    let (status, message) = raw_call(&mut send, cut).await;
    assert_eq!(status, internal, "{message}");
    let (status, message) = raw_call(&mut send, Vec::new()).await;
    assert_eq!(status, internal, "{message}");
    // Over the 16 MiB limit: refused from its prefix.
    let mut big = vec![0];
    big.extend_from_slice(&(16 * 1024 * 1024 + 1u32).to_be_bytes());
    let (status, message) = raw_call(&mut send, big).await;
    assert_eq!(
        status,
        (tonic::Code::OutOfRange as i32).to_string(),
        "{message}"
    );

    assert!(
        store.unfinished().await.unwrap().is_empty(),
        "nothing recorded"
    );
    // The same connection still takes a well-formed event, answered with
    // an ack frame and grpc-status 0.
    let good = grpc_frame(0, &ev("SagaStartedEvent", "g", "g", "svc").encode_to_vec());
    let (status, message) = raw_call(&mut send, good).await;
    assert_eq!((status.as_str(), message.as_str()), ("0", ""));
    assert_eq!(server.coordinator.state("g"), Some(SagaState::Running));
    server.stop().await;
}
