//! A raw wire-protocol client for the tests: frames in, frames out, nothing hidden.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use railyard_bridge::{BridgeConfig, BridgeServer, PermittedOptions, RunningBridge};
use railyard_bus::EventBus;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Every wait in the tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(5);

/// A config on a free loopback port permitting everything under `test.` both ways.
pub fn open_config() -> BridgeConfig {
    BridgeConfig {
        port: 0,
        inbound_permitted: vec![PermittedOptions::regex("test\\..*")],
        outbound_permitted: vec![PermittedOptions::regex("test\\..*")],
        ..BridgeConfig::default()
    }
}

/// A frame's bytes on the wire: its length, then its JSON.
pub fn wire(frame: &Value) -> Vec<u8> {
    let text = serde_json::to_vec(frame).unwrap();
    let mut bytes = (text.len() as u32).to_be_bytes().to_vec();
    bytes.extend_from_slice(&text);
    bytes
}

pub async fn start(bus: &EventBus, config: BridgeConfig) -> RunningBridge {
    BridgeServer::new(bus.clone(), config)
        .expect("valid config")
        .start()
        .await
        .expect("bridge binds a loopback port")
}

pub struct Client {
    pub stream: TcpStream,
}

impl Client {
    pub async fn connect(addr: SocketAddr) -> Self {
        let stream = tokio::time::timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("connect in time")
            .expect("connect");
        stream.set_nodelay(true).unwrap();
        Self { stream }
    }

    pub async fn send(&mut self, frame: Value) {
        self.send_raw(&wire(&frame)).await;
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream
            .write_all(bytes)
            .await
            .expect("write to the bridge");
    }

    /// The next frame, or `None` at end of stream; panics after [`WAIT`].
    pub async fn recv_or_eof(&mut self) -> Option<Value> {
        tokio::time::timeout(WAIT, async {
            let mut len = [0u8; 4];
            match self.stream.read_exact(&mut len).await {
                Ok(_) => {}
                Err(_) => return None,
            }
            let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
            self.stream.read_exact(&mut payload).await.ok()?;
            Some(serde_json::from_slice(&payload).expect("the bridge sends JSON"))
        })
        .await
        .expect("a frame or end of stream within the wait")
    }

    pub async fn recv(&mut self) -> Value {
        self.recv_or_eof()
            .await
            .expect("a frame, not end of stream")
    }

    /// Nothing arrives within `d`.
    pub async fn quiet_for(&mut self, d: Duration) -> bool {
        let mut b = [0u8; 1];
        tokio::time::timeout(d, self.stream.peek(&mut b))
            .await
            .is_err()
    }

    /// Reads until the server closes; panics if it does not within [`WAIT`].
    pub async fn expect_closed(&mut self) {
        while self.recv_or_eof().await.is_some() {}
    }

    /// Registers at `address` and waits until `bus` has the consumer.
    pub async fn register(&mut self, bus: &EventBus, address: &str) {
        self.send(serde_json::json!({"type": "register", "address": address}))
            .await;
        eventually("registered", || bus.consumer_count(address) == 1).await;
    }

    pub async fn ping_pong(&mut self) {
        self.send(serde_json::json!({"type": "ping"})).await;
        assert_eq!(self.recv().await, serde_json::json!({"type": "pong"}));
    }
}

/// Polls `cond` every 10 ms until it holds; panics after [`WAIT`].
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The services the Vert.x peer (`peers/vertx-bridge`, mode `server`) runs, on
/// Railyard's bus, so the same client script can talk to either server:
/// `railyard.node.echo` and `test.echo` reply with the body, `test.fail`
/// fails with 42 "boom", `test.trigger {"to": A}` sends `{"n":1}` to A,
/// publishes `{"n":2}` to A, requests `{"n":3}` from A and sends A's answer
/// back to A as `{"reply": body}` or `{"failed": code, "message": m}`.
pub async fn peer_services(bus: &EventBus) -> Vec<railyard_bus::Consumer> {
    let mut out = Vec::new();
    for address in ["railyard.node.echo", "test.echo"] {
        out.push(
            bus.consumer(address)
                .handler(|mut m| async move {
                    let body = m.take_body();
                    let _ = m.reply(body);
                })
                .await
                .unwrap(),
        );
    }
    out.push(
        bus.consumer("test.fail")
            .handler(|mut m| async move {
                let _ = m.fail(42, "boom");
            })
            .await
            .unwrap(),
    );
    let b = bus.clone();
    out.push(
        bus.consumer("test.trigger")
            .handler(move |m| {
                let bus = b.clone();
                async move {
                    let Some(to) = m
                        .body::<Value>()
                        .and_then(|v| v["to"].as_str())
                        .map(str::to_owned)
                    else {
                        return;
                    };
                    let _ = bus.send(&to, serde_json::json!({"n": 1}));
                    let _ = bus.publish(&to, serde_json::json!({"n": 2}));
                    tokio::spawn(async move {
                        let answer = match bus.request(&to, serde_json::json!({"n": 3})).await {
                            Ok(r) => serde_json::json!({"reply": r.body::<Value>().cloned()}),
                            Err(e) => serde_json::json!({
                                "failed": e.failure_code().unwrap_or(-1),
                                "message": match e {
                                    railyard_bus::BusError::RecipientFailure { message, .. } => message,
                                    other => other.to_string(),
                                },
                            }),
                        };
                        let _ = bus.send(&to, answer);
                    });
                }
            })
            .await
            .unwrap(),
    );
    out
}

/// The permissions the Vert.x peer runs with.
pub fn peer_config() -> BridgeConfig {
    BridgeConfig {
        port: 0,
        inbound_permitted: vec![
            PermittedOptions::address("railyard.node.echo"),
            PermittedOptions::regex("test\\..*"),
        ],
        outbound_permitted: vec![PermittedOptions::regex("test\\..*")],
        ..BridgeConfig::default()
    }
}
