//! Settings and first-connection errors, without a coordinator.

use std::time::Duration;

use railyard_saga_client::{Participant, SagaClient, SagaError, MAX_SESSION_PARTICIPANTS};

/// A loopback port nobody listens on (bound, then released).
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    l.local_addr().expect("local addr").port()
}

#[tokio::test]
async fn first_connection_failure_is_a_connect_error() {
    let endpoint = format!("http://127.0.0.1:{}", closed_port());
    let err = SagaClient::builder(endpoint.clone(), "orders")
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect_err("nobody listens there");
    match err {
        SagaError::Connect { endpoint: e, .. } => assert_eq!(e, endpoint),
        other => panic!("expected Connect, got {other:?}"),
    }
}

#[tokio::test]
async fn bad_settings_are_rejected_before_connecting() {
    let cases = [
        SagaClient::builder("http://127.0.0.1:1", ""),
        SagaClient::builder("http://127.0.0.1:1", "orders").max_batch_events(0),
        SagaClient::builder("http://127.0.0.1:1", "orders").max_in_flight_events(0),
        SagaClient::builder("http://127.0.0.1:1", "orders")
            .reconnect_backoff(Duration::from_secs(2), Duration::from_secs(1)),
        SagaClient::builder("not a url \u{0}", "orders"),
        // A session's further participants: `connect` cannot hand them out.
        SagaClient::builder("http://127.0.0.1:1", "orders").participant(Participant::new("stock")),
    ];
    for b in cases {
        let err = b.connect().await.expect_err("invalid settings");
        assert!(
            matches!(err, SagaError::InvalidConfig(_)),
            "expected InvalidConfig, got {err:?}"
        );
    }
}

#[tokio::test]
async fn bad_participants_are_rejected_before_connecting() {
    let endpoint = "http://127.0.0.1:1";
    let too_many = (1..=MAX_SESSION_PARTICIPANTS)
        .fold(SagaClient::builder(endpoint, "orders"), |b, k| {
            b.participant(Participant::new("stock").instance_id(format!("stock-{k}")))
        });
    let cases = [
        (
            SagaClient::builder(endpoint, "orders").participant(Participant::new("")),
            "service name",
        ),
        (
            SagaClient::builder(endpoint, "orders")
                .instance_id("p-1")
                .participant(Participant::new("orders").instance_id("p-1")),
            "twice",
        ),
        (too_many, "at most 64"),
    ];
    for (b, why) in cases {
        let err = b.connect_all().await.expect_err("invalid participants");
        match err {
            SagaError::InvalidConfig(m) => assert!(m.contains(why), "{why}: {m}"),
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }
    let err = SagaClient::builder(endpoint, "orders")
        .participant(Participant::new("stock"))
        .connect()
        .await
        .expect_err("connect with participants");
    assert!(err.to_string().contains("connect_all"), "{err}");
}
