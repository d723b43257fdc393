//! The SDK against a real coordinator (`railyard-saga`, in-memory store) on
//! loopback: commit, compensation in reverse order with payloads handed back,
//! batching, back-pressure, refusal, reconnection across a coordinator
//! crash and restart, clients sharing one connection, and participants
//! sharing one session.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use railyard_saga::{serve, Coordinator, CoordinatorConfig, MemoryStore, SagaState, SagaStore};
use railyard_saga_client::{
    CompensationError, Connection, Participant, Saga, SagaClient, SagaError, Step, StepError,
};

/// A coordinator on its own runtime (so a test can crash it: dropping the
/// runtime closes every connection at once, as a killed process would).
struct Node {
    endpoint: String,
    port: u16,
    coordinator: Coordinator,
    /// `None` once crashed.
    rt: Option<tokio::runtime::Runtime>,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Node {
    async fn start(store: Arc<dyn SagaStore>, cfg: CoordinatorConfig, port: u16) -> Node {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("coordinator runtime");
        let (coordinator, port) = rt
            .spawn(async move {
                // The port may still be held for a moment after a crash.
                let mut listener = None;
                for _ in 0..100 {
                    match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
                        Ok(l) => {
                            listener = Some(l);
                            break;
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                }
                let listener = listener.expect("bind the coordinator's port");
                let port = listener.local_addr().expect("local addr").port();
                let coordinator = Coordinator::start(store, cfg).await.expect("start");
                tokio::spawn(serve(coordinator.clone(), listener, std::future::pending()));
                (coordinator, port)
            })
            .await
            .expect("coordinator start task");
        Node {
            endpoint: format!("http://127.0.0.1:{port}"),
            port,
            coordinator,
            rt: Some(rt),
        }
    }

    async fn memory() -> Node {
        Node::start(Arc::new(MemoryStore::new()), fast_config(), 0).await
    }

    /// Kills the coordinator: its runtime, tasks and sockets go at once.
    /// A client of service `orders`, connected with default settings.
    async fn orders_client(&self) -> SagaClient {
        SagaClient::builder(self.endpoint.clone(), "orders")
            .connect()
            .await
            .expect("connect")
    }

    fn crash(mut self) -> u16 {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        self.port
    }

    /// Polls the saga's state until `want` (bounded: 10 s).
    async fn wait_state(&self, id: &str, want: SagaState) {
        for _ in 0..1000 {
            if self.coordinator.state(id) == Some(want) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "saga {id} did not reach {want:?}; it is {:?}",
            self.coordinator.state(id)
        );
    }
}

/// Quick timers, and a reverse timeout no handler's answer misses on a
/// loaded machine (a resent command would add to the exact lists the tests
/// expect); the test of a command that comes again sets a short one.
fn fast_config() -> CoordinatorConfig {
    CoordinatorConfig {
        timer_tick: Duration::from_millis(10),
        default_retry_delay: Duration::from_millis(20),
        default_reverse_timeout: Duration::from_secs(10),
        ..CoordinatorConfig::default()
    }
}

#[derive(Debug, PartialEq)]
struct Boom;

/// A compensated step and the payload its handler got.
type Compensated = (String, Vec<u8>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saga_with_steps_commits() {
    let node = Node::memory().await;
    let client = node.orders_client().await;
    assert_eq!(
        client.server_meta().get("Server").map(String::as_str),
        Some("railyard"),
        "the Welcome's meta is kept"
    );
    let saga = client.start_saga(None).await.expect("start");
    let v = saga
        .step(Step::new("cancel").payload(&b"one"[..]), async {
            Ok::<_, Boom>(7)
        })
        .await
        .expect("step 1");
    assert_eq!(v, 7);
    // The second step through a handle joined by the shared id (as another
    // service of the same process would): the id is shared, not copied.
    let joined = client.join_saga_shared(saga.shared_id());
    assert!(Arc::ptr_eq(&joined.shared_id(), &saga.shared_id()));
    assert_eq!(joined.id(), saga.id());
    joined
        .step(Step::new("cancel"), async { Ok::<_, Boom>(()) })
        .await
        .expect("step 2");
    saga.end().await.expect("end");
    node.wait_state(saga.id(), SagaState::Committed).await;
    // A terminal saga leaves the live table; its state is remembered.
    assert!(
        node.coordinator.saga(saga.id()).is_none(),
        "a committed saga has no live view"
    );
    assert_eq!(
        node.coordinator.state(saga.id()),
        Some(SagaState::Committed)
    );
    let stats = client.stats();
    assert_eq!(
        stats.acked, 6,
        "SagaStarted, 2 x (TxStarted, TxEnded), SagaEnded"
    );
    assert_eq!(stats.in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_step_compensates_the_ended_ones_in_reverse_order() {
    let node = Node::memory().await;
    let seen: Arc<Mutex<Vec<Compensated>>> = Arc::default();
    let s = seen.clone();
    let client = SagaClient::builder(node.endpoint.clone(), "payments")
        .compensation("refund", move |c| {
            s.lock()
                .unwrap()
                .push((c.local_tx_id.clone(), c.payloads.to_vec()));
            async { Ok::<(), CompensationError>(()) }
        })
        .connect()
        .await
        .expect("connect");
    let saga = client.start_saga(None).await.expect("start");
    for (id, payload) in [("a", &b"first"[..]), ("b", &b"second"[..])] {
        saga.step(Step::new("refund").local_id(id).payload(payload), async {
            Ok::<_, Boom>(())
        })
        .await
        .expect("ended step");
    }
    let failed = saga
        .step(Step::new("refund").local_id("c"), async {
            Err::<(), _>(Boom)
        })
        .await;
    assert!(matches!(failed, Err(StepError::Failed(Boom))));
    node.wait_state(saga.id(), SagaState::Compensated).await;
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            ("b".to_owned(), b"second".to_vec()),
            ("a".to_owned(), b"first".to_vec())
        ],
        "reverse order, payloads byte for byte, the failed step not compensated"
    );
    // The saga is aborted now: a new step is skipped, end fails.
    let late = saga
        .step(Step::new("refund"), async { Ok::<_, Boom>(()) })
        .await;
    assert!(matches!(late, Err(StepError::SagaAborted(_))), "{late:?}");
    assert!(matches!(saga.end().await, Err(SagaError::Aborted(_))));
}

/// A compensation whose result cannot be reported (here the client closes
/// while its handler runs) is counted, so that a caller such as the bench
/// does not take the handler's run for a recorded compensation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compensation_result_that_cannot_be_reported_is_counted() {
    let node = Node::memory().await;
    let me: Arc<std::sync::OnceLock<SagaClient>> = Arc::default();
    let m = me.clone();
    let client = SagaClient::builder(node.endpoint.clone(), "payments")
        .compensation("refund", move |_c| {
            if let Some(c) = m.get() {
                c.close();
            }
            async { Ok::<(), CompensationError>(()) }
        })
        .connect()
        .await
        .expect("connect");
    me.set(client.clone()).unwrap();
    let saga = client.start_saga(None).await.expect("start");
    saga.step(Step::new("refund").local_id("a"), async {
        Ok::<_, Boom>(())
    })
    .await
    .expect("ended step");
    let failed = saga
        .step(Step::new("refund").local_id("b"), async {
            Err::<(), _>(Boom)
        })
        .await;
    assert!(matches!(failed, Err(StepError::Failed(Boom))));
    for _ in 0..1000 {
        if client.stats().compensation_reports_failed > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stats = client.stats();
    assert_eq!(stats.compensation_reports_failed, 1, "{stats:?}");
    assert_eq!(stats.compensations, 1, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compensation_commands_past_the_clients_room_are_dropped_and_come_again() {
    let config = CoordinatorConfig {
        default_reverse_timeout: Duration::from_secs(2),
        ..fast_config()
    };
    let node = Node::start(Arc::new(MemoryStore::new()), config, 0).await;
    // Handlers block until the gate opens.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    let client = SagaClient::builder(node.endpoint.clone(), "payments")
        .max_concurrent_compensations(1)
        .compensation("refund", move |_| {
            let g = g.clone();
            async move {
                let _open = g.acquire().await;
                Ok::<(), CompensationError>(())
            }
        })
        .connect()
        .await
        .expect("connect");
    // Three aborted sagas, one ended step each: three commands at once,
    // and room for two (one running, one waiting).
    let mut ids = Vec::new();
    for _ in 0..3 {
        let saga = client.start_saga(None).await.expect("start");
        saga.step(
            Step::new("refund")
                .reverse_retries(5)
                .retry_delay(Duration::from_millis(20)),
            async { Ok::<_, Boom>(()) },
        )
        .await
        .expect("ended step");
        let failed = saga
            .step(Step::new("refund"), async { Err::<(), _>(Boom) })
            .await;
        assert!(matches!(failed, Err(StepError::Failed(Boom))));
        ids.push(saga.id().to_owned());
    }
    for _ in 0..500 {
        if client.stats().compensations >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Two taken (one running, one waiting), one or more dropped (more if
    // the dropped one's reverse timeout passed meanwhile and it came again).
    let stats = client.stats();
    assert_eq!(
        stats.compensations - stats.compensations_dropped - stats.compensations_joined,
        2,
        "{stats:?}"
    );
    assert!(stats.compensations_dropped >= 1, "{stats:?}");
    // Open the gate: the two held run, the dropped one comes again after
    // its reverse timeout, and every saga ends compensated.
    gate.add_permits(1_000);
    for id in &ids {
        node.wait_state(id, SagaState::Compensated).await;
    }
    assert!(
        client.stats().compensations >= 4,
        "the dropped command came again"
    );
}

/// A handler that outlives its reverse timeout and then fails: the
/// coordinator's next attempt joins the run still going (the handler never
/// runs twice at once), gets a run of its own once that one fails, and its
/// success ends the saga compensated (attempt 1's late failure, if it were
/// reported as attempt 2's, would end it FAILED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compensation_outliving_its_timeout_is_not_run_twice_at_once() {
    let node = Node::memory().await;
    let runs = Arc::new(Mutex::new(Vec::new()));
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (r, n, m) = (runs.clone(), now.clone(), most.clone());
    let client = SagaClient::builder(node.endpoint.clone(), "payments")
        .compensation("refund", move |c| {
            let (r, n, m) = (r.clone(), n.clone(), m.clone());
            async move {
                m.fetch_max(n.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                r.lock().unwrap().push(c.attempt);
                let first = c.attempt == 1;
                if first {
                    // Past the 1 s reverse timeout.
                    tokio::time::sleep(Duration::from_millis(1800)).await;
                }
                n.fetch_sub(1, Ordering::SeqCst);
                if first {
                    Err(CompensationError::new("too late, and failed"))
                } else {
                    Ok(())
                }
            }
        })
        .connect()
        .await
        .expect("connect");
    let saga = client.start_saga(None).await.expect("start");
    saga.step(
        Step::new("refund")
            .reverse_retries(1) // two attempts
            .reverse_timeout(Duration::from_secs(1))
            .retry_delay(Duration::from_millis(20)),
        async { Ok::<_, Boom>(()) },
    )
    .await
    .expect("ended step");
    saga.abort().await.expect("abort");
    node.wait_state(saga.id(), SagaState::Compensated).await;
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "the handler ran twice at once"
    );
    assert_eq!(*runs.lock().unwrap(), vec![1, 2]);
    assert_eq!(
        client.stats().compensations_joined,
        1,
        "{:?}",
        client.stats()
    );
}

/// A store whose every append fails: the coordinator welcomes sessions and
/// then fails their batches (`UNAVAILABLE`), as when its database is down.
struct BrokenStore(MemoryStore);

type StoreFuture<'a, T> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<T, railyard_saga::StoreError>> + Send + 'a>,
>;

impl SagaStore for BrokenStore {
    fn name(&self) -> &'static str {
        "broken"
    }
    fn append(&self, _: Vec<railyard_saga::EventRecord>) -> StoreFuture<'_, ()> {
        Box::pin(async { Err(railyard_saga::StoreError::Unavailable("disk gone".into())) })
    }
    fn finish(&self, done: Vec<railyard_saga::SagaSummary>) -> StoreFuture<'_, ()> {
        self.0.finish(done)
    }
    fn unfinished(&self) -> StoreFuture<'_, Vec<railyard_saga::EventRecord>> {
        self.0.unfinished()
    }
    fn finished(
        &self,
        q: railyard_saga::SagaQuery,
    ) -> StoreFuture<'_, Vec<railyard_saga::SagaSummary>> {
        self.0.finished(q)
    }
    fn timeline(&self, g: String) -> StoreFuture<'_, Vec<railyard_saga::EventRecord>> {
        self.0.timeline(g)
    }
    fn stats(&self) -> StoreFuture<'_, railyard_saga::StoreStats> {
        self.0.stats()
    }
}

/// A coordinator that welcomes every session and fails every batch is
/// retried with a growing backoff: the backoff starts over only after a
/// session that acknowledged something (it started over at every Welcome,
/// so the client reconnected and resent its backlog every 50 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_that_fails_every_batch_is_retried_ever_more_slowly() {
    let node = Node::start(Arc::new(BrokenStore(MemoryStore::new())), fast_config(), 0).await;
    let client = SagaClient::builder(node.endpoint.clone(), "orders")
        .reconnect_backoff(Duration::from_millis(20), Duration::from_secs(5))
        .connect()
        .await
        .expect("connect");
    let start = tokio::spawn({
        let client = client.clone();
        async move { client.start_saga(None).await.map(|_| ()) }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // 20, 40, 80, ... ms (+ up to 25 % each): about 6 sessions in 1.5 s;
    // with the backoff reset at every Welcome, about 1500 / 20 = 75.
    let sessions = client.stats().sessions;
    assert!(
        (2..=10).contains(&sessions),
        "sessions in 1.5 s: {sessions}"
    );
    client.close();
    assert!(start.await.expect("task").is_err(), "never acknowledged");
}

/// A loopback proxy to `target` that counts the connections it accepted:
/// returns its endpoint and the count.
async fn counting_proxy(target: u16) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the proxy");
    let port = listener.local_addr().expect("local addr").port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                // Refused while the coordinator is down: the client retries.
                if let Ok(mut up) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
                }
            });
        }
    });
    (format!("http://127.0.0.1:{port}"), accepted)
}

/// Starts a saga on `front` and runs one step of it on `stock`, compensated
/// by `release`.
async fn start_with_stock_step(
    front: &SagaClient,
    stock: &SagaClient,
    local: &str,
) -> Result<Saga, String> {
    let saga = front.start_saga(None).await.map_err(|e| e.to_string())?;
    stock
        .join_saga(saga.id())
        .step(Step::new("release").local_id(local), async {
            Ok::<_, Boom>(())
        })
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(saga)
}

/// Crashes `node`, runs a saga across `front` and `stock` meanwhile (its
/// events cannot be acknowledged while the coordinator is down), restarts
/// the coordinator on the same port and store, and checks the saga commits
/// there; returns the new node.
async fn saga_across_a_crash(
    node: Node,
    store: Arc<dyn SagaStore>,
    front: &SagaClient,
    stock: &SagaClient,
) -> Node {
    let port = node.crash();
    let second = {
        let (front, stock) = (front.clone(), stock.clone());
        tokio::spawn(async move {
            let saga = start_with_stock_step(&front, &stock, "s2").await?;
            saga.end().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(saga.id().to_owned())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "nothing is acknowledged while the coordinator is down"
    );
    let node = Node::start(store, fast_config(), port).await;
    let id = tokio::time::timeout(Duration::from_secs(20), second)
        .await
        .expect("acknowledged after the restart")
        .expect("task")
        .expect("saga finished");
    node.wait_state(&id, SagaState::Committed).await;
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_of_other_services_join_the_saga_and_are_compensated_there() {
    let node = Node::memory().await;
    let compensated = Arc::new(Mutex::new(Vec::new()));
    let c = compensated.clone();
    let starter = SagaClient::builder(node.endpoint.clone(), "front")
        .connect()
        .await
        .expect("connect front");
    let stock = SagaClient::builder(node.endpoint.clone(), "stock")
        .compensation("release", move |cmd| {
            c.lock().unwrap().push(cmd.local_tx_id);
            async { Ok::<(), CompensationError>(()) }
        })
        .connect()
        .await
        .expect("connect stock");
    let saga = start_with_stock_step(&starter, &stock, "s1")
        .await
        .expect("a saga with a stock step");
    saga.abort().await.expect("abort");
    node.wait_state(saga.id(), SagaState::Compensated).await;
    assert_eq!(*compensated.lock().unwrap(), vec!["s1".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sagas_share_batches_under_a_tight_in_flight_budget() {
    let node = Node::memory().await;
    let client = SagaClient::builder(node.endpoint.clone(), "batcher")
        .max_in_flight_events(16)
        .max_batch_events(8)
        .connect()
        .await
        .expect("connect");
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let saga = client.start_saga(None).await?;
            saga.step(Step::new("undo"), async { Ok::<_, Boom>(()) })
                .await
                .map_err(|e| match e {
                    StepError::Saga(e) => e,
                    other => panic!("unexpected {other:?}"),
                })?;
            saga.end().await?;
            Ok::<_, SagaError>(saga.id().to_owned())
        }));
    }
    let mut ids = Vec::new();
    for t in tasks {
        ids.push(t.await.expect("task").expect("saga"));
    }
    for id in &ids {
        node.wait_state(id, SagaState::Committed).await;
    }
    let s = client.stats();
    assert_eq!(s.acked, 800);
    assert_eq!(s.in_flight, 0);
    assert!(
        s.batches < s.events,
        "200 concurrent sagas must share frames: {s:?}"
    );
}

/// A coordinator that takes smaller batches than the client would send says
/// so in its Welcome, and the client keeps to it: before, its first batch
/// over the coordinator's limit ended the session for good (and failed
/// events the coordinator may already have recorded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_keep_to_the_limit_the_coordinator_announces() {
    let config = CoordinatorConfig {
        max_batch_events: 8,
        ..fast_config()
    };
    let node = Node::start(Arc::new(MemoryStore::new()), config, 0).await;
    let client = SagaClient::builder(node.endpoint.clone(), "batcher")
        .max_in_flight_events(64)
        .connect()
        .await
        .expect("connect");
    assert_eq!(
        client
            .server_meta()
            .get(railyard_saga_proto::MAX_BATCH_EVENTS_META)
            .map(String::as_str),
        Some("8")
    );
    let starts: Vec<_> = (0..64)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { client.start_saga(None).await.map(|s| s.id().to_owned()) })
        })
        .collect();
    for t in starts {
        let id = t.await.expect("task").expect("every saga starts");
        node.wait_state(&id, SagaState::Running).await;
    }
    let s = client.stats();
    assert_eq!((s.acked, s.sessions), (64, 1), "{s:?}");
    assert!(s.batches >= 8, "at most 8 events a batch: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_the_size_limit_fails_alone_and_the_client_goes_on() {
    let node = Node::memory().await;
    let client = node.orders_client().await;
    let saga = client.start_saga(None).await.expect("start");
    let big = vec![7u8; railyard_saga_client::MAX_EVENT_BYTES];
    let mut ran = false;
    let err = saga
        .step(Step::new("cancel").payload(big), async {
            ran = true;
            Ok::<_, Boom>(())
        })
        .await
        .expect_err("a payload of the whole limit plus the event's fields is too large");
    assert!(
        matches!(
            err,
            StepError::Saga(SagaError::TooLarge { bytes, limit, .. })
                if bytes > limit && limit == railyard_saga_client::MAX_EVENT_BYTES
        ),
        "{err:?}"
    );
    assert!(
        !ran,
        "the step's work must not run when TX_STARTED was not sent"
    );
    assert_eq!(client.stats().events, 1, "only SagaStarted was sent");
    // The session is unharmed: the saga goes on with a smaller payload.
    saga.step(Step::new("cancel").payload(&b"small"[..]), async {
        Ok::<_, Boom>(())
    })
    .await
    .expect("a small step after the refused one");
    saga.end().await.expect("end");
    node.wait_state(saga.id(), SagaState::Committed).await;
}

/// Polls `f` once, in this task, without yielding to any other: a report
/// is queued by its first poll.
fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> std::task::Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    std::pin::Pin::new(f).poll(&mut cx)
}

/// `close` fails every event not yet acknowledged, including those queued
/// but not yet sent, and sends nothing after it. (A current-thread runtime:
/// the session task cannot run between the reports and the close.)
#[tokio::test]
async fn closing_fails_queued_events_and_sends_nothing_after() {
    let node = Node::memory().await;
    let client = node.orders_client().await;
    let saga = client.start_saga(None).await.expect("the session is up");
    let batches = client.stats().batches;
    let mut queued = Vec::new();
    for i in 0..50 {
        let event = railyard_saga_client::SagaEvent {
            r#type: railyard_saga_client::EventType::SagaStarted as i32,
            global_tx_id: format!("{}-{i}", saga.id()),
            local_tx_id: format!("{}-{i}", saga.id()),
            ..Default::default()
        };
        let mut call = Box::pin(client.report(event));
        assert!(poll_once(&mut call).is_pending(), "queued, not answered");
        queued.push(call);
    }
    client.close();
    for call in queued {
        let answer = tokio::time::timeout(Duration::from_secs(5), call)
            .await
            .expect("answered at once after the close");
        assert!(
            matches!(answer, Err(SagaError::Closed(_))),
            "an event queued before the close fails with Closed: {answer:?}"
        );
    }
    assert_eq!(
        client.stats().batches,
        batches,
        "no batch was sent after the close"
    );
    assert!(matches!(saga.end().await, Err(SagaError::Closed(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_and_closes_the_client() {
    let cfg = CoordinatorConfig {
        token: Some("secret".into()),
        ..fast_config()
    };
    let node = Node::start(Arc::new(MemoryStore::new()), cfg, 0).await;
    let err = SagaClient::builder(node.endpoint.clone(), "intruder")
        .token("guess")
        .connect()
        .await
        .expect_err("refused");
    assert!(
        matches!(
            err,
            SagaError::Refused {
                code: tonic::Code::Unauthenticated,
                ..
            }
        ),
        "{err:?}"
    );
    let ok = SagaClient::builder(node.endpoint.clone(), "member")
        .token("secret")
        .connect()
        .await
        .expect("the right token is accepted");
    ok.start_saga(None).await.expect("start with the token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_survive_a_coordinator_crash_and_are_resent_after_reconnecting() {
    let store: Arc<dyn SagaStore> = Arc::new(MemoryStore::new());
    let node = Node::start(store.clone(), fast_config(), 0).await;
    let client = SagaClient::builder(node.endpoint.clone(), "survivor")
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
        .connect()
        .await
        .expect("connect");
    let saga = client.start_saga(None).await.expect("start");
    saga.step(Step::new("undo").local_id("before"), async {
        Ok::<_, Boom>(())
    })
    .await
    .expect("step before the crash");
    let port = node.crash();
    // Reported while the coordinator is down: waits, then is resent.
    let pending = {
        let saga = saga.clone();
        tokio::spawn(async move {
            saga.step(Step::new("undo").local_id("after"), async {
                Ok::<_, Boom>(())
            })
            .await
            .map_err(|e| format!("{e:?}"))?;
            saga.end().await.map_err(|e| format!("{e}"))
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !pending.is_finished(),
        "nothing can be acknowledged while the coordinator is down"
    );
    let node = Node::start(store, fast_config(), port).await;
    tokio::time::timeout(Duration::from_secs(20), pending)
        .await
        .expect("acknowledged after the restart")
        .expect("task")
        .expect("saga finished");
    node.wait_state(saga.id(), SagaState::Committed).await;
    let s = client.stats();
    assert!(s.sessions >= 2, "{s:?}");
    assert_eq!(s.in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_sharing_a_connection_each_have_their_session_and_survive_a_crash() {
    let store: Arc<dyn SagaStore> = Arc::new(MemoryStore::new());
    let node = Node::start(store.clone(), fast_config(), 0).await;
    let (endpoint, accepted) = counting_proxy(node.port).await;
    let conn = Connection::open(endpoint.clone()).await.expect("open");
    let client = |service: &str| {
        SagaClient::builder(endpoint.clone(), service)
            .connection(&conn)
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
            .connect()
    };
    let front = client("front").await.expect("connect front");
    let stock = client("stock").await.expect("connect stock");
    // Both sessions work over the one connection: a saga across them commits.
    let saga = start_with_stock_step(&front, &stock, "s1")
        .await
        .expect("a saga with a stock step");
    saga.end().await.expect("end");
    node.wait_state(saga.id(), SagaState::Committed).await;
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "both sessions went over the one connection"
    );
    // The connection breaks: events reported meanwhile by both clients are
    // sent again once it is back.
    let _node = saga_across_a_crash(node, store, &front, &stock).await;
    for c in [&front, &stock] {
        let s = c.stats();
        assert!(s.sessions >= 2, "each client reopened its session: {s:?}");
        assert_eq!(s.in_flight, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn participants_of_one_session_share_its_frames_and_run_their_own_compensations() {
    let store: Arc<dyn SagaStore> = Arc::new(MemoryStore::new());
    let node = Node::start(store.clone(), fast_config(), 0).await;
    let (endpoint, accepted) = counting_proxy(node.port).await;
    // Both register a handler named `release`: only the step's own
    // participant may run it.
    let ran = Arc::new(Mutex::new(Vec::new()));
    let (front_ran, stock_ran) = (ran.clone(), ran.clone());
    let clients = SagaClient::builder(endpoint.clone(), "front")
        .instance_id("p-1")
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
        .compensation("release", move |cmd| {
            front_ran
                .lock()
                .unwrap()
                .push(format!("front {}", cmd.local_tx_id));
            async { Ok::<(), CompensationError>(()) }
        })
        .participant(Participant::new("stock").instance_id("p-1").compensation(
            "release",
            move |cmd| {
                stock_ran
                    .lock()
                    .unwrap()
                    .push(format!("stock {}", cmd.local_tx_id));
                async { Ok::<(), CompensationError>(()) }
            },
        ))
        .connect_all()
        .await
        .expect("connect both");
    let [front, stock] = &clients[..] else {
        panic!("one handle per participant: {clients:?}")
    };
    assert_eq!(
        (front.service_name(), stock.service_name()),
        ("front", "stock")
    );
    assert_eq!(stock.instance_id(), "p-1");
    let mut instances: Vec<String> = node
        .coordinator
        .instances()
        .into_iter()
        .map(|i| format!("{} {} {}", i.service_name, i.instance_id, i.protocol))
        .collect();
    instances.sort();
    assert_eq!(instances, ["front p-1 native", "stock p-1 native"]);
    let saga = start_with_stock_step(front, stock, "s1")
        .await
        .expect("a saga with a stock step");
    // Each event is recorded as its own participant's.
    let timeline: Vec<String> = node
        .coordinator
        .store()
        .timeline(saga.id().to_owned())
        .await
        .expect("timeline")
        .iter()
        .map(|e| format!("{:?} {}", e.kind.expect("a kind"), e.service_name))
        .collect();
    assert_eq!(
        timeline,
        ["SagaStarted front", "TxStarted stock", "TxEnded stock"]
    );
    saga.abort().await.expect("abort");
    node.wait_state(saga.id(), SagaState::Compensated).await;
    assert_eq!(*ran.lock().unwrap(), ["stock s1"]);
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection");
    // One session: the counters are the session's, the same for both.
    let s = front.stats();
    assert_eq!(s, stock.stats());
    assert_eq!(s.sessions, 1);
    // The connection breaks: events both report meanwhile go out again, on
    // a new session that names both participants again.
    let node = saga_across_a_crash(node, store, front, stock).await;
    let s = front.stats();
    assert!(s.sessions >= 2, "the session was opened again: {s:?}");
    assert_eq!(s.in_flight, 0);
    assert_eq!(node.coordinator.instances().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_every_handle_ends_the_session_and_unregisters_its_participants() {
    let node = Node::memory().await;
    let clients = SagaClient::builder(node.endpoint.clone(), "front")
        .participant(Participant::new("stock"))
        .connect_all()
        .await
        .expect("connect both");
    let saga = start_with_stock_step(&clients[0], &clients[1], "s1")
        .await
        .expect("a saga");
    saga.end().await.expect("end");
    assert_eq!(node.coordinator.instances().len(), 2);
    // Dropping one participant's handles keeps the session (and both).
    let front = clients[0].clone();
    drop(clients);
    drop(saga);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        node.coordinator.instances().len(),
        2,
        "front still holds it"
    );
    // The last handle gone, the session ends: nobody can report on it.
    drop(front);
    for _ in 0..1000 {
        if node.coordinator.instances().is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "still registered after every handle was dropped: {:?}",
        node.coordinator.instances()
    );
}

/// An event the coordinator refuses fails alone, with its kind, its saga
/// and the coordinator's reason (read back from the bytes that were sent),
/// and the client goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_event_names_its_kind_and_saga() {
    let node = Node::memory().await;
    let client = node.orders_client().await;
    let err = client
        .report(railyard_saga_client::SagaEvent {
            r#type: railyard_saga_client::EventType::TxStarted as i32,
            global_tx_id: "g-refused".into(),
            // A step event needs its local id.
            local_tx_id: String::new(),
            ..Default::default()
        })
        .await
        .expect_err("a TxStarted without a local id is refused");
    match err {
        SagaError::Rejected {
            kind,
            global_tx_id,
            message,
        } => {
            assert_eq!(kind.to_string(), "TX_STARTED");
            assert_eq!(global_tx_id, "g-refused");
            assert!(message.contains("localTxId"), "{message}");
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    let saga = client.start_saga(None).await.expect("the client goes on");
    saga.end().await.expect("end");
    node.wait_state(saga.id(), SagaState::Committed).await;
}
