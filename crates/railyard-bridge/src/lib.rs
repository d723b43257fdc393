//! Railyard's TCP event-bus bridge: programs in any language reach the bus
//! with the clients written for Vert.x's TCP event-bus bridge, unchanged.
//!
//! # Map
//! - [`BridgeConfig`], [`PermittedOptions`] (`config`): the `[bridge]`
//!   section of a node's config file.
//! - `permissions`: the permission lists, compiled once.
//! - [`BridgeServer`], [`RunningBridge`] (`server`): the listener, the
//!   connection limit, shutdown.
//! - `connection`: one task per client; it owns the socket, handles frames,
//!   holds the client's registrations and pending requests, and writes
//!   through one bounded outbound buffer.
//! - `frame`: the wire format (4-byte big-endian length + UTF-8 JSON), and
//!   bus bodies as JSON.
//! - [`BridgeMetricsSnapshot`] (`metrics`): counters for exporters.
//! - [`ConfigError`], [`BridgeError`], [`FrameError`]: what can go wrong.
//!
//! # How a frame moves
//! Client `send` with `replyAddress` → the connection task parses the frame,
//! checks `inbound_permitted`, maps headers to [`railyard_bus::DeliveryOptions`]
//! and calls [`railyard_bus::EventBus::request_with`] with the body as a
//! [`serde_json::Value`]. The pending reply waits in the task's set of
//! in-flight requests; the reply is encoded straight into the outbound
//! buffer as a `message` frame addressed to the client's `replyAddress` (a
//! failure as an `err` frame with `failureCode`, `failureType`, `message`).
//! A `register` opens a [`railyard_bus::MessageStream`] that the same task
//! polls; a request delivered that way gets a generated reply address, and
//! the client's `send` to it is the reply (or, with `failureCode`, a failure).
//!
//! # JSON bodies on the bus
//! A client's body travels on the bus as a [`serde_json::Value`] (`Null` when
//! the frame has none), shared by reference. Rust consumers read it with
//! `msg.body::<serde_json::Value>()` and may answer with a `Value`, a
//! `String`, a number or a `bool`; other types go through their default codec
//! (see [`railyard_bus::CodecRegistry`]), which must produce JSON.
//!
//! # Back-pressure
//! Each connection's outbound buffer is bounded by `outbound_queue_bytes`
//! (it may exceed it by the frames one handled event produces). While it is
//! full, the connection **pauses**: it stops reading the socket, stops
//! taking messages from its registrations and stops collecting replies.
//! Nothing is dropped: the client's unread frames wait in the kernel (and
//! so the client's writes slow down), and bus messages wait in each
//! registration's bounded consumer buffer; once that is full the bus
//! refuses new ones to their senders (`send` gets [`railyard_bus::BusError::Full`],
//! `request` waits for room within its timeout, `publish` reports the
//! consumer as skipped). Every pause is counted (`outbound_pauses`).
//!
//! # Bad input
//! A frame that is not a JSON object, a length above `max_frame_size`, a
//! frame not received whole within `frame_timeout`, or a connection ending
//! mid-frame gets an `err` frame (`invalid_json`, `frame_too_large`,
//! `frame_timeout`, `truncated_frame`) and that connection is closed;
//! others are unaffected. With `idle_timeout` set, a connection that sends
//! no complete frame (a `ping` counts) for that long is closed the same way
//! (`idle_timeout`). Protocol errors that leave the stream in sync
//! (`access_denied`, `unknown_type`, `missing_address`, `unknown_address`,
//! limits) get an `err` frame and the connection stays open.
//!
//! # What is hand-written and why
//! The framing, the connection loop and the permission check: they are
//! small, and owning them lets each failure be typed and the outbound
//! buffer be bounded in bytes. Sockets, timers and tasks are tokio's;
//! JSON is serde_json's; regexes are `regex`'s.

mod config;
mod connection;
mod error;
mod frame;
mod metrics;
mod permissions;
mod server;

pub use config::{BridgeConfig, PermittedOptions, DEFAULT_PORT};
pub use connection::AUTH_HEADER;
pub use error::{BridgeError, ConfigError};
pub use frame::{FrameError, UnsupportedBody};
pub use metrics::BridgeMetricsSnapshot;
pub use server::{BridgeServer, RunningBridge};
