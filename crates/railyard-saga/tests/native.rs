//! The native `SagaCoordinator.Session` stream over real tonic on loopback.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::Server;
use railyard_saga::{CoordinatorConfig, SagaState, SagaStore};
use railyard_saga_proto::native::saga_coordinator_client::SagaCoordinatorClient;
use railyard_saga_proto::native::{
    client_frame, server_frame, Ack, ClientFrame, EventBatch, EventType, Hello, Participant,
    SagaEvent, ServerFrame,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

struct Session {
    tx: mpsc::Sender<ClientFrame>,
    rx: tonic::Streaming<ServerFrame>,
}

impl Session {
    async fn open(server: &Server, hello: Option<Hello>) -> Self {
        let mut client = SagaCoordinatorClient::connect(format!("http://{}", server.addr))
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel(64);
        if let Some(h) = hello {
            tx.send(ClientFrame {
                kind: Some(client_frame::Kind::Hello(h)),
            })
            .await
            .unwrap();
        }
        let rx = client
            .session(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Self { tx, rx }
    }

    async fn hello(server: &Server, service: &str) -> Self {
        let mut s = Self::open(
            server,
            Some(Hello {
                service_name: service.into(),
                instance_id: format!("{service}-1"),
                token: String::new(),
                others: Vec::new(),
            }),
        )
        .await;
        match s.next().await {
            server_frame::Kind::Welcome(w) => {
                assert_eq!(
                    w.meta.get("AkkaEnabled").map(String::as_str),
                    Some("true"),
                    "the default advertises AkkaEnabled"
                );
                // Says it takes several participants per session, and how many.
                assert_eq!(
                    w.meta
                        .get(railyard_saga_proto::PARTICIPANTS_META)
                        .map(String::as_str),
                    Some("64")
                );
            }
            other => panic!("expected Welcome, got {other:?}"),
        }
        s
    }

    async fn send(&self, seq: u64, events: Vec<SagaEvent>) {
        self.tx
            .send(ClientFrame {
                kind: Some(client_frame::Kind::Events(EventBatch { seq, events })),
            })
            .await
            .unwrap();
    }

    async fn next(&mut self) -> server_frame::Kind {
        tokio::time::timeout(Duration::from_secs(10), self.rx.next())
            .await
            .expect("a frame within 10 s")
            .expect("stream open")
            .expect("no error")
            .kind
            .expect("a kind")
    }

    async fn ack(&mut self) -> Ack {
        match self.next().await {
            server_frame::Kind::Ack(a) => a,
            other => panic!("expected Ack, got {other:?}"),
        }
    }
}

fn e(t: EventType, gid: &str, lid: &str) -> SagaEvent {
    SagaEvent {
        r#type: t as i32,
        global_tx_id: gid.into(),
        local_tx_id: lid.into(),
        timestamp_ms: 1_700_000_000_000,
        ..SagaEvent::default()
    }
}

fn lifecycle(gid: &str) -> Vec<SagaEvent> {
    let mut v = vec![e(EventType::SagaStarted, gid, gid)];
    for l in ["a", "b", "c"] {
        v.push(SagaEvent {
            compensation_method: "undo".into(),
            payloads: l.as_bytes().to_vec(),
            ..e(EventType::TxStarted, gid, l)
        });
        v.push(e(EventType::TxEnded, gid, l));
    }
    v.push(e(EventType::SagaEnded, gid, gid));
    v
}

#[tokio::test]
async fn a_batch_is_recorded_with_one_append_and_acked_per_event() {
    let (server, store) = Server::memory(CoordinatorConfig::default()).await;
    let mut s = Session::hello(&server, "svc").await;
    s.send(7, lifecycle("n-1")).await;
    let ack = s.ack().await;
    assert_eq!(ack.seq, 7);
    assert_eq!(ack.results.len(), 8);
    assert!(ack.results.iter().all(|r| !r.aborted && r.error.is_empty()));
    assert_eq!(server.coordinator.state("n-1"), Some(SagaState::Committed));
    assert_eq!(
        store.stats().await.unwrap().commits,
        1,
        "one append for the batch"
    );

    // A malformed event gets its own error; the others are recorded.
    s.send(
        8,
        vec![
            e(EventType::SagaStarted, "n-2", "n-2"),
            e(EventType::Unspecified, "n-2", "x"),
            e(EventType::TxStarted, "", "x"),
            e(EventType::SagaEnded, "n-2", "n-2"),
        ],
    )
    .await;
    let ack = s.ack().await;
    assert_eq!(ack.seq, 8);
    let errors: Vec<&str> = ack.results.iter().map(|r| r.error.as_str()).collect();
    assert!(errors[0].is_empty() && errors[3].is_empty(), "{errors:?}");
    assert!(errors[1].contains("unknown event type"), "{errors:?}");
    assert!(errors[2].contains("globalTxId is empty"), "{errors:?}");
    assert_eq!(server.coordinator.state("n-2"), Some(SagaState::Committed));
    server.stop().await;
}

#[tokio::test]
async fn compensation_goes_down_the_session_and_comes_back_as_events() {
    let (server, _store) = Server::memory(CoordinatorConfig::default()).await;
    let mut s = Session::hello(&server, "svc").await;
    let g = "n-abort";
    s.send(
        1,
        vec![
            e(EventType::SagaStarted, g, g),
            SagaEvent {
                compensation_method: "undo-a".into(),
                payloads: vec![1, 2, 3],
                ..e(EventType::TxStarted, g, "a")
            },
            e(EventType::TxEnded, g, "a"),
            SagaEvent {
                compensation_method: "undo-b".into(),
                payloads: vec![4, 5],
                ..e(EventType::TxStarted, g, "b")
            },
            e(EventType::TxEnded, g, "b"),
            e(EventType::TxAborted, g, "c"),
        ],
    )
    .await;
    // The ack and the first command may come in either order.
    let mut frames = vec![s.next().await, s.next().await];
    frames.sort_by_key(|f| matches!(f, server_frame::Kind::Compensate(_)));
    let server_frame::Kind::Ack(ack) = &frames[0] else {
        panic!("{frames:?}")
    };
    assert!(ack.results[5].aborted);
    let server_frame::Kind::Compensate(cmd) = &frames[1] else {
        panic!("{frames:?}")
    };
    assert_eq!(
        (
            cmd.local_tx_id.as_str(),
            cmd.compensation_method.as_str(),
            cmd.attempt
        ),
        ("b", "undo-b", 1)
    );
    assert_eq!(cmd.payloads, &[4u8, 5][..]);
    // The participant could not compensate: retried.
    s.send(2, vec![e(EventType::TxCompensateFailed, g, "b")])
        .await;
    let mut retried = None;
    for _ in 0..2 {
        match s.next().await {
            server_frame::Kind::Ack(a) => assert_eq!(a.seq, 2),
            server_frame::Kind::Compensate(c) => retried = Some(c),
            other => panic!("{other:?}"),
        }
    }
    let retried = retried.unwrap();
    assert_eq!((retried.local_tx_id.as_str(), retried.attempt), ("b", 2));
    s.send(3, vec![e(EventType::TxCompensated, g, "b")]).await;
    let mut next = None;
    for _ in 0..2 {
        match s.next().await {
            server_frame::Kind::Ack(a) => assert_eq!(a.seq, 3),
            server_frame::Kind::Compensate(c) => next = Some(c),
            other => panic!("{other:?}"),
        }
    }
    let next = next.unwrap();
    assert_eq!(
        (next.local_tx_id.as_str(), &next.payloads[..]),
        ("a", &[1u8, 2, 3][..])
    );
    s.send(4, vec![e(EventType::TxCompensated, g, "a")]).await;
    assert_eq!(s.ack().await.seq, 4);
    assert_eq!(server.coordinator.state(g), Some(SagaState::Compensated));
    server.stop().await;
}

#[tokio::test]
async fn many_batches_are_outstanding_on_one_session() {
    let (server, _store) = Server::memory(CoordinatorConfig::default()).await;
    let mut s = Session::hello(&server, "svc").await;
    for seq in 0..40u64 {
        s.send(seq, lifecycle(&format!("m-{seq}"))).await;
    }
    let mut seen = HashSet::new();
    for _ in 0..40 {
        let a = s.ack().await;
        assert_eq!(a.results.len(), 8);
        assert!(seen.insert(a.seq), "one ack per batch");
    }
    assert_eq!(seen.len(), 40);
    server.stop().await;
}

/// `native_batch_bytes` bounds the batches being appended across every
/// session: with room for one, another session's batch waits until the one
/// being appended is done (before, only the count per session was bounded:
/// 256 batches of up to 64 MiB each, per session).
#[tokio::test]
async fn batches_of_every_session_share_one_byte_budget() {
    use std::sync::atomic::Ordering;
    let (store, appends, open) = common::second_append_gated();
    let server = Server::start(
        store,
        CoordinatorConfig {
            native_batch_bytes: 1024,
            ..CoordinatorConfig::default()
        },
    )
    .await;
    let mut a = Session::hello(&server, "a").await;
    let mut b = Session::hello(&server, "b").await;
    a.send(1, vec![e(EventType::SagaStarted, "g1", "g1")]).await;
    assert_eq!(a.ack().await.seq, 1);
    // The second append waits at the gate, holding all the room.
    a.send(2, vec![e(EventType::SagaStarted, "g2", "g2")]).await;
    b.send(1, vec![e(EventType::SagaStarted, "g3", "g3")]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        appends.load(Ordering::SeqCst),
        2,
        "b's batch waited for room instead of being appended alongside"
    );
    open.send(true).unwrap();
    assert_eq!(a.ack().await.seq, 2);
    assert_eq!(b.ack().await.seq, 1);
    assert_eq!(appends.load(Ordering::SeqCst), 3);
    server.stop().await;
}

/// A batch whose handling panics on the coordinator (a bug, here a store
/// that panics) ends its session with `INTERNAL` instead of leaving the
/// client waiting for an ack that never comes; other sessions go on.
#[tokio::test]
async fn a_batch_that_panics_ends_its_session_instead_of_hanging_it() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let store = std::sync::Arc::new(common::GatedStore::new(move || {
        let n = c.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            assert!(n != 1, "the store breaks on its second append");
            Ok(())
        })
    }));
    let server = Server::start(store, CoordinatorConfig::default()).await;
    let mut s = Session::hello(&server, "svc").await;
    s.send(1, vec![e(EventType::SagaStarted, "g1", "g1")]).await;
    assert_eq!(s.ack().await.seq, 1);
    s.send(2, vec![e(EventType::SagaStarted, "g2", "g2")]).await;
    let end = tokio::time::timeout(Duration::from_secs(10), s.rx.next())
        .await
        .expect("the session ends instead of hanging");
    match end {
        Some(Err(status)) => assert_eq!(status.code(), tonic::Code::Internal, "{status:?}"),
        other => panic!("expected INTERNAL, got {other:?}"),
    }
    // Another session is served.
    let mut other = Session::hello(&server, "svc2").await;
    other
        .send(1, vec![e(EventType::SagaStarted, "g3", "g3")])
        .await;
    assert_eq!(other.ack().await.seq, 1);
    server.stop().await;
}

#[tokio::test]
async fn a_session_out_of_protocol_is_closed_and_others_go_on() {
    let (server, _store) = Server::memory(CoordinatorConfig {
        token: Some("secret".into()),
        ..CoordinatorConfig::default()
    })
    .await;
    // Events before Hello.
    let mut bad = Session::open(&server, None).await;
    bad.send(1, lifecycle("x")).await;
    let err = tokio::time::timeout(Duration::from_secs(10), bad.rx.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("first frame"), "{}", err.message());

    // A wrong token.
    let mut bad = Session::open(
        &server,
        Some(Hello {
            service_name: "svc".into(),
            instance_id: "i".into(),
            token: "guess".into(),
            others: Vec::new(),
        }),
    )
    .await;
    let err = tokio::time::timeout(Duration::from_secs(10), bad.rx.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);

    // The server still serves a good session.
    let mut good = Session::open(
        &server,
        Some(Hello {
            service_name: "svc".into(),
            instance_id: "i".into(),
            token: "secret".into(),
            others: Vec::new(),
        }),
    )
    .await;
    assert!(matches!(good.next().await, server_frame::Kind::Welcome(_)));
    good.send(1, lifecycle("ok")).await;
    assert_eq!(good.ack().await.results.len(), 8);
    server.stop().await;
}

fn participant(service: &str, instance: &str) -> Participant {
    Participant {
        service_name: service.into(),
        instance_id: instance.into(),
    }
}

fn by(p: u32, event: SagaEvent) -> SagaEvent {
    SagaEvent {
        participant: p,
        ..event
    }
}

/// `Hello` for participant `starter`/`p-1` and `others`.
fn hello_with(others: Vec<Participant>) -> Hello {
    Hello {
        service_name: "starter".into(),
        instance_id: "p-1".into(),
        token: String::new(),
        others,
    }
}

#[tokio::test]
async fn participants_share_one_session_and_each_gets_its_own_commands() {
    let (server, _store) = Server::memory(CoordinatorConfig::default()).await;
    let mut s = Session::open(
        &server,
        Some(hello_with(vec![
            participant("svc-a", "p-1"),
            participant("svc-b", "p-1"),
        ])),
    )
    .await;
    assert!(matches!(s.next().await, server_frame::Kind::Welcome(_)));
    let mut instances = server.coordinator.instances();
    instances.sort_by(|a, b| a.service_name.cmp(&b.service_name));
    let named: Vec<(&str, &str, &str)> = instances
        .iter()
        .map(|i| (i.service_name.as_str(), i.instance_id.as_str(), i.protocol))
        .collect();
    assert_eq!(
        named,
        [
            ("starter", "p-1", "native"),
            ("svc-a", "p-1", "native"),
            ("svc-b", "p-1", "native")
        ]
    );
    let g = "n-shared";
    s.send(
        1,
        vec![
            by(0, e(EventType::SagaStarted, g, g)),
            by(
                1,
                SagaEvent {
                    compensation_method: "undo-a".into(),
                    ..e(EventType::TxStarted, g, "a")
                },
            ),
            by(1, e(EventType::TxEnded, g, "a")),
            by(
                2,
                SagaEvent {
                    compensation_method: "undo-b".into(),
                    ..e(EventType::TxStarted, g, "b")
                },
            ),
            by(2, e(EventType::TxEnded, g, "b")),
        ],
    )
    .await;
    let ack = s.ack().await;
    assert!(ack.results.iter().all(|r| r.error.is_empty()), "{ack:?}");
    let view = server.coordinator.saga(g).expect("live");
    let services: Vec<(&str, &str)> = view
        .sub_transactions
        .iter()
        .map(|t| (t.local_tx_id.as_str(), t.service_name.as_str()))
        .collect();
    assert_eq!(services, [("a", "svc-a"), ("b", "svc-b")]);
    // Abort: b's command goes to participant 2, then a's to participant 1.
    s.send(2, vec![by(0, e(EventType::SagaAborted, g, g))])
        .await;
    let mut commands = Vec::new();
    while commands.len() < 2 {
        match s.next().await {
            server_frame::Kind::Ack(a) => assert!(a.results[0].error.is_empty(), "{a:?}"),
            server_frame::Kind::Compensate(c) => {
                let answer = by(
                    c.participant,
                    e(EventType::TxCompensated, g, &c.local_tx_id),
                );
                commands.push((c.local_tx_id, c.participant));
                s.send(10 + commands.len() as u64, vec![answer]).await;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(commands, [("b".to_owned(), 2), ("a".to_owned(), 1)]);
    for _ in 0..2 {
        assert!(s.ack().await.results[0].error.is_empty());
    }
    assert_eq!(server.coordinator.state(g), Some(SagaState::Compensated));
    // The session's end unregisters every participant.
    drop(s);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !server.coordinator.instances().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "participants still registered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.stop().await;
}

#[tokio::test]
async fn an_event_naming_a_participant_the_hello_did_not_is_refused_alone() {
    let (server, _store) = Server::memory(CoordinatorConfig::default()).await;
    let mut s = Session::open(&server, Some(hello_with(vec![participant("svc-a", "p-1")]))).await;
    assert!(matches!(s.next().await, server_frame::Kind::Welcome(_)));
    let g = "n-unknown";
    s.send(
        1,
        vec![
            by(0, e(EventType::SagaStarted, g, g)),
            by(2, e(EventType::TxStarted, g, "x")),
            by(1, e(EventType::TxStarted, g, "a")),
        ],
    )
    .await;
    let ack = s.ack().await;
    assert!(ack.results[0].error.is_empty());
    assert!(
        ack.results[1]
            .error
            .contains("participant 2 is not in this session, which has 2"),
        "{ack:?}"
    );
    assert!(ack.results[2].error.is_empty());
    let subs: Vec<String> = server
        .coordinator
        .saga(g)
        .expect("live")
        .sub_transactions
        .into_iter()
        .map(|t| t.local_tx_id)
        .collect();
    assert_eq!(subs, ["a"]);
    server.stop().await;
}

#[tokio::test]
async fn a_hello_with_too_many_duplicate_or_unnamed_participants_is_refused() {
    let (server, _store) = Server::memory(CoordinatorConfig::default()).await;
    let too_many: Vec<Participant> = (0..railyard_saga_proto::MAX_SESSION_PARTICIPANTS)
        .map(|k| participant("svc", &format!("i-{k}")))
        .collect();
    let cases = [
        (too_many, "at most 64"),
        (vec![participant("starter", "p-1")], "twice"),
        (
            vec![participant("svc-a", "p-1"), participant("", "p-1")],
            "Hello.others[1].service_name is empty",
        ),
    ];
    for (others, why) in cases {
        let mut s = Session::open(&server, Some(hello_with(others))).await;
        let err = tokio::time::timeout(Duration::from_secs(10), s.rx.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains(why), "{why}: {}", err.message());
    }
    assert!(server.coordinator.instances().is_empty());
    // The same service twice with different instances is fine.
    let mut ok = Session::open(
        &server,
        Some(Hello {
            service_name: "svc".into(),
            instance_id: "i-1".into(),
            token: String::new(),
            others: vec![participant("svc", "i-2")],
        }),
    )
    .await;
    assert!(matches!(ok.next().await, server_frame::Kind::Welcome(_)));
    assert_eq!(server.coordinator.instances().len(), 2);
    server.stop().await;
}

/// One native session spoken by hand: `Hello`, then `rest` (raw gRPC
/// bytes), then the end of the request; the answer's `grpc-status` and
/// `grpc-message`.
async fn raw_session(server: &Server, rest: &[u8]) -> (String, String) {
    let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let (mut send, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let hello = ClientFrame {
        kind: Some(client_frame::Kind::Hello(Hello {
            service_name: "svc".into(),
            instance_id: "svc-raw".into(),
            token: String::new(),
            others: Vec::new(),
        })),
    };
    let mut body = railyard_saga::grpc_frame::encode(&hello).to_vec();
    body.extend_from_slice(rest);
    common::raw_grpc_call(&mut send, "/railyard.saga.v1.SagaCoordinator/Session", body).await
}

#[tokio::test]
async fn a_frame_the_decoder_refuses_ends_the_session_with_its_status() {
    let (server, store) = Server::memory(CoordinatorConfig::default()).await;
    // Not protobuf (a field with wire type 7).
    let garbage = railyard_saga::grpc_frame::frame_bytes(false, &[0x0f, 0xff, 0xff]).to_vec();
    let (status, message) = raw_session(&server, &garbage).await;
    assert_eq!(
        status,
        (tonic::Code::Internal as i32).to_string(),
        "{message}"
    );
    // Over the 64 MiB frame limit: refused from its prefix.
    let mut big = vec![0];
    let over = u32::try_from(railyard_saga_proto::MAX_NATIVE_FRAME_BYTES + 1).unwrap();
    big.extend_from_slice(&over.to_be_bytes());
    let (status, message) = raw_session(&server, &big).await;
    assert_eq!(
        status,
        (tonic::Code::OutOfRange as i32).to_string(),
        "{message}"
    );
    assert!(store.unfinished().await.unwrap().is_empty());
    server.stop().await;
}
