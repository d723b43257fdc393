//! The engine without gRPC, on paused tokio time: saga timeouts, stragglers,
//! recovery after a restart on the same store.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use railyard_saga::{
    Coordinator, CoordinatorConfig, EventKind, EventRecord, MemoryStore, Outcome, SagaQuery,
    SagaState, SagaStore,
};
use railyard_saga_proto::native::{server_frame, Compensate, ServerFrame};
use tokio::sync::mpsc::Receiver;

type Commands = Receiver<Result<ServerFrame, tonic::Status>>;

fn now_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

fn rec(kind: EventKind, gid: &str, lid: &str) -> EventRecord {
    EventRecord {
        global_tx_id: gid.into(),
        local_tx_id: lid.into(),
        kind: Some(kind),
        service_name: "svc".into(),
        instance_id: "svc-1".into(),
        timestamp_ms: now_ms(),
        ..EventRecord::default()
    }
}

fn start(gid: &str, timeout_s: i32) -> EventRecord {
    EventRecord {
        timeout_s,
        ..rec(EventKind::SagaStarted, gid, gid)
    }
}

fn tx_started(gid: &str, lid: &str, payload: &'static [u8]) -> EventRecord {
    EventRecord {
        compensation_method: format!("undo-{lid}").into(),
        payloads: Bytes::from_static(payload),
        ..rec(EventKind::TxStarted, gid, lid)
    }
}

/// Saga `g`: started, step `l1` (payload `p`) ended, then aborted: its one
/// compensation is due.
fn aborted_after_one_step(g: &str) -> Vec<EventRecord> {
    vec![
        start(g, 0),
        tx_started(g, "l1", b"p"),
        rec(EventKind::TxEnded, g, "l1"),
        rec(EventKind::TxAborted, g, g),
    ]
}

/// Saga `g`: step `l1` ended with `retries` reverse retries, a 2 s reverse
/// timeout and 300 ms between attempts, then the saga aborted: its
/// compensation's first attempt is due.
async fn abort_one_step_with_retries(c: &Coordinator, g: &str, retries: i32) {
    let mut s = tx_started(g, "l1", b"p");
    s.reverse_retries = retries;
    s.reverse_timeout_s = 2;
    s.retry_delay_ms = 300;
    submit(
        c,
        vec![
            start(g, 0),
            s,
            rec(EventKind::TxEnded, g, "l1"),
            rec(EventKind::TxAborted, g, g),
        ],
    )
    .await;
}

async fn submit(c: &Coordinator, events: Vec<EventRecord>) -> Vec<bool> {
    c.submit(events)
        .await
        .unwrap()
        .into_iter()
        .map(|o| match o {
            Outcome::Done { aborted } => aborted,
            Outcome::Invalid(e) => panic!("rejected: {e}"),
        })
        .collect()
}

fn try_command(rx: &mut Commands) -> Option<Compensate> {
    match rx.try_recv() {
        Ok(Ok(ServerFrame {
            kind: Some(server_frame::Kind::Compensate(c)),
        })) => Some(c),
        Ok(other) => panic!("unexpected frame {other:?}"),
        Err(_) => None,
    }
}

async fn command(rx: &mut Commands) -> Compensate {
    match tokio::time::timeout(Duration::from_secs(600), rx.recv()).await {
        Ok(Some(Ok(ServerFrame {
            kind: Some(server_frame::Kind::Compensate(c)),
        }))) => c,
        other => panic!("expected a command, got {other:?}"),
    }
}

fn config() -> CoordinatorConfig {
    CoordinatorConfig {
        timer_tick: Duration::from_millis(100),
        default_reverse_timeout: Duration::from_secs(5),
        default_retry_delay: Duration::from_millis(500),
        instance_wait: Duration::from_secs(60),
        straggler_wait: Duration::from_secs(30),
        ..CoordinatorConfig::default()
    }
}

/// [`config`], except that a command waiting for an instance is tried again
/// only once a minute: within a test, only an arrival moves it.
fn polls_once_a_minute() -> CoordinatorConfig {
    CoordinatorConfig {
        default_retry_delay: Duration::from_secs(60),
        ..config()
    }
}

/// A coordinator on the in-memory store.
async fn on_memory(cfg: CoordinatorConfig) -> Coordinator {
    Coordinator::start(Arc::new(MemoryStore::new()), cfg)
        .await
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_saga_timeout_compensates_every_ended_step_in_reverse() {
    let store = Arc::new(MemoryStore::new());
    let c = Coordinator::start(store.clone(), config()).await.unwrap();
    let mut rx = c.connect_local("svc", "svc-1", 16);
    let g = "g-timeout";
    let answers = submit(
        &c,
        vec![
            start(g, 5),
            tx_started(g, "l1", b"one"),
            rec(EventKind::TxEnded, g, "l1"),
            tx_started(g, "l2", b"two"),
            rec(EventKind::TxEnded, g, "l2"),
        ],
    )
    .await;
    assert!(answers.iter().all(|a| !a));
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(try_command(&mut rx).is_none(), "not before the timeout");
    assert_eq!(c.state(g), Some(SagaState::Running));

    let cmd = command(&mut rx).await;
    assert_eq!((cmd.local_tx_id.as_str(), cmd.attempt), ("l2", 1));
    assert_eq!(cmd.payloads, &b"two"[..]);
    assert_eq!(cmd.compensation_method, "undo-l2");
    assert_eq!(c.state(g), Some(SagaState::Compensating));
    // The timeout was recorded durably before compensation began.
    let log = store.unfinished().await.unwrap();
    assert!(log.iter().any(|e| e.kind == Some(EventKind::SagaTimeout)));
    // A late SagaEnded is answered aborted=true.
    assert_eq!(
        submit(&c, vec![rec(EventKind::SagaEnded, g, g)]).await,
        [true]
    );

    submit(&c, vec![rec(EventKind::TxCompensated, g, "l2")]).await;
    let cmd = command(&mut rx).await;
    assert_eq!(cmd.local_tx_id, "l1");
    assert_eq!(cmd.payloads, &b"one"[..]);
    submit(&c, vec![rec(EventKind::TxCompensated, g, "l1")]).await;
    assert_eq!(c.state(g), Some(SagaState::Compensated));
    c.flush().await.unwrap();
    assert!(store.unfinished().await.unwrap().is_empty());
}

/// A `flush` the store refuses gives the finished sagas back to the queue:
/// they are compacted once the store works again (they used to be dropped
/// and stay in the log until the next restart).
#[tokio::test(start_paused = true)]
async fn a_refused_flush_keeps_its_sagas_for_the_next_try() {
    let store = Arc::new(common::GatedStore::new(|| Box::pin(async { Ok(()) })));
    let c = Coordinator::start(store.clone(), config()).await.unwrap();
    let g = "flush-1";
    submit(
        &c,
        vec![
            start(g, 0),
            tx_started(g, "l1", b"one"),
            rec(EventKind::TxEnded, g, "l1"),
            rec(EventKind::SagaEnded, g, g),
        ],
    )
    .await;
    assert_eq!(c.state(g), Some(SagaState::Committed));
    store.finish_failures.store(1, Ordering::SeqCst);
    // On this one-thread runtime the background finisher has not run yet:
    // the flush takes the batch, and the store refuses it.
    assert!(c.flush().await.is_err());
    for _ in 0..100 {
        if store.inner.unfinished().await.unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        store.inner.unfinished().await.unwrap().is_empty(),
        "the refused batch was retried"
    );
    let done = common::finished_in(&*store, SagaState::Committed).await;
    assert_eq!(done.len(), 1);
    c.flush().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_unanswered_command_is_resent_after_reverse_timeout_then_fails() {
    let store = Arc::new(MemoryStore::new());
    let c = Coordinator::start(store.clone(), config()).await.unwrap();
    let mut rx = c.connect_local("svc", "svc-1", 16);
    let g = "g-retry";
    abort_one_step_with_retries(&c, g, 1).await;
    assert_eq!(command(&mut rx).await.attempt, 1);
    let t0 = tokio::time::Instant::now();
    let again = command(&mut rx).await;
    assert_eq!((again.local_tx_id.as_str(), again.attempt), ("l1", 2));
    // Resent only after reverseTimeout + retryDelay.
    assert!(t0.elapsed() >= Duration::from_millis(2300));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(c.state(g), Some(SagaState::Failed));
    assert!(try_command(&mut rx).is_none());
}

/// A failure report of attempt 1 that arrives while attempt 2 is awaited
/// (the handler outlived its reverse timeout, then failed) is stale: it
/// does not count as attempt 2's failure, which would end the saga FAILED
/// with attempt 2 still running. A report that does not say (Omega: 0)
/// still answers the awaited attempt.
#[tokio::test(start_paused = true)]
async fn a_late_failure_of_an_earlier_attempt_is_not_the_awaited_ones() {
    let c = on_memory(config()).await;
    let mut rx = c.connect_local("svc", "svc-1", 16);
    let g = "g-stale";
    abort_one_step_with_retries(&c, g, 2).await; // three attempts
    assert_eq!(command(&mut rx).await.attempt, 1);
    assert_eq!(command(&mut rx).await.attempt, 2);
    let failed = |attempt| EventRecord {
        attempt,
        ..rec(EventKind::TxCompensateAckFailed, g, "l1")
    };
    submit(&c, vec![failed(1)]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        try_command(&mut rx).is_none(),
        "attempt 1's late failure was charged to attempt 2"
    );
    submit(&c, vec![failed(2)]).await;
    assert_eq!(command(&mut rx).await.attempt, 3, "attempt 2's own failure");
    submit(&c, vec![failed(0)]).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        c.state(g),
        Some(SagaState::Failed),
        "an unnumbered failure answers the awaited attempt (the last)"
    );
}

#[tokio::test(start_paused = true)]
async fn a_step_still_running_at_timeout_is_compensated_when_it_ends() {
    let c = on_memory(config()).await;
    let mut rx = c.connect_local("svc", "svc-1", 16);
    let g = "g-straggler";
    submit(
        &c,
        vec![
            start(g, 1),
            tx_started(g, "l1", b"one"),
            rec(EventKind::TxEnded, g, "l1"),
            tx_started(g, "l2", b"two"),
        ],
    )
    .await;
    let cmd = command(&mut rx).await;
    assert_eq!(cmd.local_tx_id, "l1");
    submit(&c, vec![rec(EventKind::TxCompensated, g, "l1")]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // l2 is still running: the saga waits for it.
    assert_eq!(c.state(g), Some(SagaState::Compensating));
    assert_eq!(
        submit(&c, vec![rec(EventKind::TxEnded, g, "l2")]).await,
        [true]
    );
    let cmd = command(&mut rx).await;
    assert_eq!(
        (cmd.local_tx_id.as_str(), &cmd.payloads[..]),
        ("l2", &b"two"[..])
    );
    submit(&c, vec![rec(EventKind::TxCompensated, g, "l2")]).await;
    assert_eq!(c.state(g), Some(SagaState::Compensated));

    // A step that never ends: the wait is bounded.
    let g = "g-straggler-2";
    submit(&c, vec![start(g, 1), tx_started(g, "l1", b"x")]).await;
    tokio::time::sleep(Duration::from_secs(40)).await;
    assert_eq!(c.state(g), Some(SagaState::Compensated));
}

#[tokio::test(start_paused = true)]
async fn a_restart_recovers_sagas_and_resumes_compensation_and_timeouts() {
    let store = Arc::new(MemoryStore::new());
    let first = Coordinator::start(store.clone(), config()).await.unwrap();
    // Aborted, one compensation done, one pending; no instance connected.
    let a = "g-aborted";
    submit(
        &first,
        vec![
            start(a, 0),
            tx_started(a, "l1", b"one"),
            rec(EventKind::TxEnded, a, "l1"),
            tx_started(a, "l2", b"two"),
            rec(EventKind::TxEnded, a, "l2"),
            tx_started(a, "l3", b"three"),
            rec(EventKind::TxEnded, a, "l3"),
            rec(EventKind::TxAborted, a, a),
            rec(EventKind::TxCompensated, a, "l3"),
        ],
    )
    .await;
    // Running with a 10 s timeout.
    let t = "g-running";
    submit(
        &first,
        vec![
            start(t, 10),
            tx_started(t, "x1", b"x"),
            rec(EventKind::TxEnded, t, "x1"),
        ],
    )
    .await;
    // Committed, but its finish not flushed before the crash.
    let d = "g-done";
    submit(&first, vec![start(d, 0), rec(EventKind::SagaEnded, d, d)]).await;
    drop(first);

    let second = Coordinator::start(store.clone(), config()).await.unwrap();
    assert_eq!(second.state(a), Some(SagaState::Compensating));
    assert_eq!(second.state(t), Some(SagaState::Running));
    assert_eq!(second.state(d), Some(SagaState::Committed));
    let mut rx = second.connect_local("svc", "svc-2", 16);
    // The pending compensation resumes with l2 (l3 was compensated).
    let cmd = command(&mut rx).await;
    assert_eq!(
        (cmd.global_tx_id.as_str(), cmd.local_tx_id.as_str()),
        (a, "l2")
    );
    assert_eq!(cmd.payloads, &b"two"[..]);
    submit(&second, vec![rec(EventKind::TxCompensated, a, "l2")]).await;
    let cmd = command(&mut rx).await;
    assert_eq!(cmd.local_tx_id, "l1");
    submit(&second, vec![rec(EventKind::TxCompensated, a, "l1")]).await;
    assert_eq!(second.state(a), Some(SagaState::Compensated));
    // The recovered timeout still fires.
    let cmd = command(&mut rx).await;
    assert_eq!(
        (cmd.global_tx_id.as_str(), cmd.local_tx_id.as_str()),
        (t, "x1")
    );
    submit(&second, vec![rec(EventKind::TxCompensated, t, "x1")]).await;
    second.flush().await.unwrap();
    assert!(store.unfinished().await.unwrap().is_empty());
    let finished = store.finished(SagaQuery::default()).await.unwrap();
    let mut states: Vec<(String, SagaState)> = finished
        .into_iter()
        .map(|s| (s.global_tx_id, s.state))
        .collect();
    states.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        states,
        [
            (a.to_owned(), SagaState::Compensated),
            (d.to_owned(), SagaState::Committed),
            (t.to_owned(), SagaState::Compensated),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_command_with_no_instance_waits_then_counts_as_a_failed_attempt() {
    let cfg = CoordinatorConfig {
        instance_wait: Duration::from_secs(2),
        default_reverse_retries: 1,
        ..config()
    };
    let c = on_memory(cfg).await;
    let g = "g-nobody";
    submit(&c, aborted_after_one_step(g)).await;
    // Two attempts of at most 2 s wait each, plus the retry delay.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(c.state(g), Some(SagaState::Compensating));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(c.state(g), Some(SagaState::Failed));
}

/// Real time, and the waiting saga polls for an instance only once a
/// minute: only the registration itself can send the waiting command
/// within the test's few seconds. The `waiting_for_instance` gauge, which
/// counts the engine's index of waiting sagas, shows the index holds
/// exactly that saga while it waits and nothing after.
#[tokio::test]
async fn a_command_waiting_for_an_instance_goes_when_one_registers() {
    let c = on_memory(polls_once_a_minute()).await;
    let registry = railyard_saga::MetricsRegistry::default();
    c.register_metrics(&registry);
    // The gauge counts the engine's index of waiting sagas.
    let waiting = || {
        let text = railyard_saga::encode_metrics(&registry);
        let line = text
            .lines()
            .find(|l| l.starts_with("railyard_saga_waiting_for_instance "))
            .unwrap_or_else(|| panic!("no waiting gauge in {text}"))
            .to_owned();
        line.rsplit(' ').next().unwrap().parse::<i64>().unwrap()
    };
    // Live sagas that wait for nothing, beside the one that waits.
    for i in 0..50 {
        submit(&c, vec![start(&format!("g-busy-{i}"), 0)]).await;
    }
    assert_eq!(waiting(), 0);
    let g = "g-waiting";
    submit(&c, aborted_after_one_step(g)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(c.state(g), Some(SagaState::Compensating));
    assert_eq!(waiting(), 1, "only the saga without an instance waits");
    let mut rx = c.connect_local("svc", "svc-late", 16);
    let cmd = tokio::time::timeout(Duration::from_secs(5), command(&mut rx))
        .await
        .expect("the command goes when the instance registers, not a minute later");
    assert_eq!(
        (cmd.global_tx_id.as_str(), cmd.local_tx_id.as_str()),
        (g, "l1")
    );
    // Its command went: it waits for the answer, not for an instance. (The
    // walk that sent it, on the blocking pool, updates the index under the
    // saga's shard lock, which reading its state waits for.)
    assert_eq!(c.state(g), Some(SagaState::Compensating));
    assert_eq!(waiting(), 0);
    submit(&c, vec![rec(EventKind::TxCompensated, g, "l1")]).await;
    assert_eq!(c.state(g), Some(SagaState::Compensated));
    assert_eq!(waiting(), 0);
    // Nothing else was waiting: no other command.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(try_command(&mut rx).is_none());
}

/// An instance arriving while the walk for an earlier arrival is under way
/// still gets every command that waited for it: the coalesced walks lose no
/// arrival. (The first service has many waiting sagas, so its walk is
/// still going when the second arrives.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_arriving_during_another_arrivals_walk_gets_its_commands() {
    const MANY: usize = 20_000;
    const FEW: usize = 200;
    // Nothing polls again before the arrivals: only they move the sagas.
    let c = on_memory(polls_once_a_minute()).await;
    let of = |service: &str, e: EventRecord| EventRecord {
        service_name: service.into(),
        instance_id: format!("{service}-1").into(),
        ..e
    };
    let mut events = Vec::new();
    for (service, n) in [("svc-a", MANY), ("svc-b", FEW)] {
        for i in 0..n {
            let g = format!("g-{service}-{i}");
            events.extend([
                start(&g, 0),
                of(service, tx_started(&g, "l1", b"p")),
                of(service, rec(EventKind::TxEnded, &g, "l1")),
                rec(EventKind::TxAborted, &g, &g),
            ]);
        }
    }
    submit(&c, events).await;
    let mut a = c.connect_local("svc-a", "svc-a-1", MANY);
    // a's walk is under way once its first command is out.
    let first = command(&mut a).await;
    assert!(first.global_tx_id.starts_with("g-svc-a-"));
    let mut b = c.connect_local("svc-b", "svc-b-1", FEW);
    let mut got = std::collections::HashSet::new();
    while got.len() < FEW {
        let cmd = tokio::time::timeout(Duration::from_secs(20), command(&mut b))
            .await
            .unwrap_or_else(|_| panic!("svc-b got {} of {FEW}", got.len()));
        assert!(cmd.global_tx_id.starts_with("g-svc-b-"));
        got.insert(cmd.global_tx_id);
    }
    let mut got_a = 1;
    while got_a < MANY {
        tokio::time::timeout(Duration::from_secs(20), command(&mut a))
            .await
            .unwrap_or_else(|_| panic!("svc-a got {got_a} of {MANY}"));
        got_a += 1;
    }
}

#[tokio::test(start_paused = true)]
async fn many_commands_are_in_flight_to_one_instance_at_once() {
    let c = on_memory(config()).await;
    let mut rx = c.connect_local("svc", "svc-1", 256);
    let mut events = Vec::new();
    for i in 0..100 {
        let g = format!("g-{i}");
        events.extend([
            start(&g, 0),
            tx_started(&g, "l1", b"p"),
            rec(EventKind::TxEnded, &g, "l1"),
            rec(EventKind::TxAborted, &g, &g),
        ]);
    }
    submit(&c, events).await;
    // All 100 commands are outstanding before any is answered.
    let mut got = 0;
    while try_command(&mut rx).is_some() {
        got += 1;
    }
    assert_eq!(got, 100);
}

#[tokio::test(start_paused = true)]
async fn a_step_whose_tx_started_never_came_cannot_be_compensated_and_fails_the_saga() {
    let c = on_memory(config()).await;
    let mut rx = c.connect_local("svc", "svc-1", 16);
    let g = "g-no-start";
    let answers = submit(
        &c,
        vec![
            start(g, 0),
            rec(EventKind::TxEnded, g, "l1"),
            rec(EventKind::TxAborted, g, g),
        ],
    )
    .await;
    assert_eq!(answers, [false, false, true]);
    // No method or payloads to send: nothing is sent, the saga needs an operator.
    assert_eq!(c.state(g), Some(SagaState::Failed));
    assert!(try_command(&mut rx).is_none());
}

#[tokio::test(start_paused = true)]
async fn malformed_events_in_a_batch_are_refused_alone() {
    let store = Arc::new(MemoryStore::new());
    let c = Coordinator::start(store.clone(), config()).await.unwrap();
    let outcomes = c
        .submit(vec![
            start("g", 0),
            rec(EventKind::TxStarted, "g", ""),
            rec(EventKind::SagaEnded, "", ""),
            rec(EventKind::SagaTimeout, "g", "g"),
            rec(EventKind::TxStarted, "g\0x", "l"),
            EventRecord {
                compensation_method: "undo\0".into(),
                ..rec(EventKind::TxStarted, "g", "l")
            },
            rec(EventKind::SagaEnded, "g", "g"),
        ])
        .await
        .unwrap();
    assert_eq!(outcomes[0], Outcome::Done { aborted: false });
    assert!(matches!(
        outcomes[1],
        Outcome::Invalid(railyard_saga::InvalidEvent::NoLocalId(_))
    ));
    assert_eq!(
        outcomes[2],
        Outcome::Invalid(railyard_saga::InvalidEvent::NoGlobalId)
    );
    assert!(matches!(
        outcomes[3],
        Outcome::Invalid(railyard_saga::InvalidEvent::Reserved(_))
    ));
    // PostgreSQL's text cannot hold NUL, so no store is offered one.
    assert_eq!(
        outcomes[4],
        Outcome::Invalid(railyard_saga::InvalidEvent::Nul("globalTxId"))
    );
    assert_eq!(
        outcomes[5],
        Outcome::Invalid(railyard_saga::InvalidEvent::Nul("compensationMethod"))
    );
    assert_eq!(outcomes[6], Outcome::Done { aborted: false });
    assert_eq!(c.state("g"), Some(SagaState::Committed));
    // Only the two valid events were recorded.
    c.flush().await.unwrap();
    let summary = store.finished(SagaQuery::default()).await.unwrap();
    assert_eq!(summary[0].events, 2);
}

/// A compensation report is recorded when an earlier event of the same
/// batch creates its saga, and answered without being recorded when its
/// saga is unknown.
#[tokio::test(start_paused = true)]
async fn a_batch_may_create_a_saga_that_its_later_events_report_on() {
    let store = Arc::new(MemoryStore::new());
    let c = Coordinator::start(store.clone(), config()).await.unwrap();
    let answers = submit(
        &c,
        vec![
            start("g", 0),
            tx_started("g", "l1", b"p"),
            rec(EventKind::TxEnded, "g", "l1"),
            rec(EventKind::TxCompensated, "g", "l1"),
            rec(EventKind::TxCompensated, "unknown", "x"),
        ],
    )
    .await;
    assert_eq!(answers.len(), 5);
    assert_eq!(c.state("unknown"), None);
    c.flush().await.unwrap();
    let held: Vec<(String, Option<EventKind>)> = store
        .unfinished()
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.global_tx_id, e.kind))
        .collect();
    assert!(
        held.iter().all(|(g, _)| g == "g"),
        "the unknown saga's report was recorded: {held:?}"
    );
    // The saga runs on (a stray report changes nothing) with all four of
    // its events in the log, the report among them.
    assert_eq!(c.state("g"), Some(SagaState::Running));
    assert_eq!(
        held.iter().map(|(_, k)| *k).collect::<Vec<_>>(),
        [
            Some(EventKind::SagaStarted),
            Some(EventKind::TxStarted),
            Some(EventKind::TxEnded),
            Some(EventKind::TxCompensated)
        ]
    );
}

/// Row "orphan wait expires": a saga created by a lone later event (here a
/// `TxEnded` whose saga the coordinator no longer remembers) ends `FAILED`
/// after `orphan_wait` and is compacted, instead of staying live; the same
/// holds after a restart, which arms the wait again. A saga whose start
/// merely arrives late is no orphan.
#[tokio::test(start_paused = true)]
async fn a_saga_whose_start_never_arrives_fails_after_the_orphan_wait() {
    let cfg = CoordinatorConfig {
        orphan_wait: Duration::from_secs(10),
        ..config()
    };
    let store = Arc::new(MemoryStore::new());
    let c = Coordinator::start(store.clone(), cfg.clone())
        .await
        .unwrap();
    let mut rx = c.connect_local("svc", "svc-1", 16);
    submit(&c, vec![rec(EventKind::TxEnded, "g-orphan", "l1")]).await;
    submit(&c, vec![rec(EventKind::TxStarted, "g-late", "l1")]).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    submit(&c, vec![start("g-late", 0)]).await;
    assert_eq!(c.state("g-orphan"), Some(SagaState::Running));
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(c.state("g-orphan"), Some(SagaState::Failed));
    assert_eq!(
        c.state("g-late"),
        Some(SagaState::Running),
        "its start came"
    );
    // Nothing is compensated: whether its step stands is not known.
    assert!(try_command(&mut rx).is_none());
    c.flush().await.unwrap();
    let failed = common::finished_in(&*store, SagaState::Failed).await;
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].global_tx_id, "g-orphan");
    let left: Vec<String> = store
        .unfinished()
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.global_tx_id)
        .collect();
    assert_eq!(
        left,
        ["g-late", "g-late"],
        "the orphan's events are compacted"
    );

    // A restart re-arms the wait of an orphan it recovers.
    submit(&c, vec![rec(EventKind::TxEnded, "g-orphan-2", "l1")]).await;
    drop(c);
    let c = Coordinator::start(store.clone(), cfg).await.unwrap();
    assert_eq!(c.state("g-orphan-2"), Some(SagaState::Running));
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(c.state("g-orphan-2"), Some(SagaState::Failed));
    assert_eq!(c.state("g-late"), Some(SagaState::Running));
}

/// The transition table's "saga unknown" column for every event that
/// creates a saga, and its "saga terminal" column: late events are answered
/// from the finished saga and not recorded.
#[tokio::test(start_paused = true)]
async fn events_for_unknown_and_finished_sagas_follow_the_table() {
    let store = Arc::new(MemoryStore::new());
    let c = Coordinator::start(store.clone(), config()).await.unwrap();
    // SagaEnded: creates and commits.
    assert_eq!(
        submit(&c, vec![rec(EventKind::SagaEnded, "g-ended", "g-ended")]).await,
        [false]
    );
    assert_eq!(c.state("g-ended"), Some(SagaState::Committed));
    // TxAborted: creates, then aborts (nothing ended, so nothing to undo).
    assert_eq!(
        submit(&c, vec![rec(EventKind::TxAborted, "g-txab", "l1")]).await,
        [true]
    );
    assert_eq!(c.state("g-txab"), Some(SagaState::Compensated));
    // SagaAborted: creates and aborts.
    assert_eq!(
        submit(&c, vec![rec(EventKind::SagaAborted, "g-sab", "g-sab")]).await,
        [true]
    );
    assert_eq!(c.state("g-sab"), Some(SagaState::Compensated));
    // TxStarted: creates the saga implicitly, running.
    assert_eq!(
        submit(&c, vec![tx_started("g-txs", "l1", b"p")]).await,
        [false]
    );
    assert_eq!(c.state("g-txs"), Some(SagaState::Running));
    let view = c.saga("g-txs").expect("live");
    assert_eq!(view.summary.sub_transactions, 1);

    // Terminal: answered from the finished saga (`aborted` = not
    // COMMITTED), and not recorded.
    c.flush().await.unwrap();
    let before = store.unfinished().await.unwrap().len();
    assert_eq!(
        submit(&c, vec![tx_started("g-ended", "l9", b"p")]).await,
        [false]
    );
    assert_eq!(
        submit(&c, vec![tx_started("g-sab", "l9", b"p")]).await,
        [true]
    );
    assert_eq!(
        submit(&c, vec![rec(EventKind::SagaEnded, "g-txab", "g-txab")]).await,
        [true]
    );
    assert_eq!(c.state("g-ended"), Some(SagaState::Committed));
    assert_eq!(c.state("g-sab"), Some(SagaState::Compensated));
    c.flush().await.unwrap();
    assert_eq!(
        store.unfinished().await.unwrap().len(),
        before,
        "nothing recorded"
    );
}

/// Two calls with events of one saga are logged and applied in the same
/// order: the second call's append waits until the first's events are
/// applied, so a restart (which replays the log) rebuilds the state the
/// participants were answered from. Calls about other sagas do not wait.
#[tokio::test]
async fn calls_about_one_saga_are_applied_in_the_order_they_are_logged() {
    // The second append (the first after the saga started) waits for the
    // gate; every append is counted as it reaches the store.
    let (store, appends, open_tx) = common::second_append_gated();
    let c = Arc::new(Coordinator::start(store.clone(), config()).await.unwrap());
    let g = "g-order";
    // A completed step, so that the abort leaves the saga compensating (no
    // instance is connected) and its log in the store.
    submit(
        &c,
        vec![
            start(g, 0),
            tx_started(g, "l0", b"p"),
            rec(EventKind::TxEnded, g, "l0"),
            tx_started(g, "l1", b"p"),
        ],
    )
    .await;
    // First call: the step fails (held at the gate).
    let c1 = c.clone();
    let first =
        tokio::spawn(async move { submit(&c1, vec![rec(EventKind::TxAborted, g, "l1")]).await });
    while appends.load(Ordering::SeqCst) < 2 {
        tokio::task::yield_now().await;
    }
    // Second call, same saga: the starter ends it.
    let c2 = c.clone();
    let second =
        tokio::spawn(async move { submit(&c2, vec![rec(EventKind::SagaEnded, g, g)]).await });
    // A call about another saga is not held up.
    submit(&c, vec![start("g-other", 0)]).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        appends.load(Ordering::SeqCst),
        3,
        "the second call reached the store before the first was applied"
    );
    open_tx.send_replace(true);
    assert_eq!(first.await.unwrap(), [true]);
    // Applied after the abort: Omega's starter hears `aborted`.
    assert_eq!(second.await.unwrap(), [true]);
    assert_eq!(c.state(g), Some(SagaState::Compensating));
    let logged: Vec<Option<EventKind>> = store
        .inner
        .timeline(g.to_owned())
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        logged,
        [
            Some(EventKind::SagaStarted),
            Some(EventKind::TxStarted),
            Some(EventKind::TxEnded),
            Some(EventKind::TxStarted),
            Some(EventKind::TxAborted),
            Some(EventKind::SagaEnded)
        ]
    );
}

/// More timeouts expiring at once than one timer tick handles (2,048): the
/// rest are handled on the next ticks, none lost.
#[tokio::test(start_paused = true)]
async fn many_timeouts_at_once_are_all_handled_over_a_few_ticks() {
    let c = on_memory(config()).await;
    let ids: Vec<String> = (0..5000).map(|i| format!("g-many-{i}")).collect();
    submit(&c, ids.iter().map(|g| start(g, 1)).collect()).await;
    tokio::time::sleep(Duration::from_millis(1050)).await;
    let compensated = || {
        ids.iter()
            .filter(|g| c.state(g) == Some(SagaState::Compensated))
            .count()
    };
    assert!(compensated() < ids.len(), "not all in one tick");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(compensated(), ids.len());
}

/// A call that meets another call's mark after marking a saga of its own in
/// the same shard gives that mark back and waits without waking itself: on
/// a single-threaded runtime a spinning waiter would never let the holder
/// apply (the test then fails by its deadline instead of finishing).
#[test]
fn a_call_meeting_another_calls_mark_waits_without_spinning() {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (store, appends, open_tx) = common::second_append_gated();
            // One shard: every saga shares it.
            let cfg = CoordinatorConfig {
                shards: 1,
                ..config()
            };
            let c = Arc::new(Coordinator::start(store, cfg).await.unwrap());
            let x = "g-held";
            submit(&c, vec![start(x, 0), tx_started(x, "l1", b"p")]).await;
            let c1 = c.clone();
            let first =
                tokio::spawn(
                    async move { submit(&c1, vec![rec(EventKind::TxAborted, x, "l1")]).await },
                );
            while appends.load(Ordering::SeqCst) < 2 {
                tokio::task::yield_now().await;
            }
            // Marks a new saga, then meets the held one.
            let c2 = c.clone();
            let second = tokio::spawn(async move {
                submit(
                    &c2,
                    vec![start("g-new", 0), rec(EventKind::SagaEnded, x, x)],
                )
                .await
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
            open_tx.send_replace(true);
            assert_eq!(first.await.unwrap(), [true]);
            assert_eq!(second.await.unwrap(), [false, true]);
        });
        let _ = done_tx.send(());
    });
    done_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("both calls finish: the waiting one must yield");
}
