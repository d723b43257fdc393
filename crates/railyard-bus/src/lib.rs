//! Railyard's in-process event bus.
//!
//! Addresses name destinations; consumers register at addresses; senders
//! `send` (one consumer, round-robin), `publish` (every consumer) or
//! `request` (one consumer, which answers with `reply` or `fail`). Bodies are
//! any `Send + Sync` Rust value and travel by reference: nothing is serialized
//! on a local hop. There is no network code here; the cluster and the bridge
//! build on [`CodecRegistry`] to put bodies on the wire.
//!
//! # Example
//! ```
//! use railyard_bus::{BusError, EventBus};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BusError> {
//! let bus = EventBus::new();
//! let _greeter = bus
//!     .consumer("greet")
//!     .handler(|mut msg| async move {
//!         let name = msg.body::<String>().cloned().unwrap_or_default();
//!         let _ = msg.reply(format!("hello, {name}"));
//!     })
//!     .await?;
//!
//! let reply = bus.request("greet", String::from("yard")).await?;
//! assert_eq!(reply.body::<String>().map(String::as_str), Some("hello, yard"));
//!
//! let err = bus.request("nobody", ()).await.unwrap_err();
//! assert_eq!(err.kind().as_str(), "NO_HANDLERS");
//! # Ok(())
//! # }
//! ```
//!
//! # Map
//! - [`EventBus`] (`bus`): the registry (an atomically swapped snapshot, read
//!   without locks on every send), routing, send / publish / request,
//!   interceptors, codecs, metrics.
//! - `queue`: the bounded buffer in front of each consumer, the one hand-off
//!   point between a sender and a consumer.
//! - [`ConsumerBuilder`], [`Consumer`], [`MessageStream`] (`consumer`): handler
//!   tasks and streams that drain a queue in batches.
//! - [`enable_loop_dispatch`] (`dispatch`): on an event loop, handler
//!   consumers run by one dispatcher task per loop instead of a task each;
//!   [`enable_loop_dispatch_relaying_wakes`] also routes other threads'
//!   wake-ups of the loop's requesters through it (for loops with an I/O
//!   driver, whose own cross-thread wake-up is a system call).
//! - [`Message`] (`message`): what a consumer gets, and `reply` / `fail` /
//!   `reply_and_request`.
//! - [`PendingReply`] (`reply`): a request's future; the reply travels
//!   through a one-shot slot, not a registered reply address.
//! - [`RemoteNode`], [`ClusterHook`] (`remote`): the interface a cluster
//!   transport implements to add other nodes' consumers to the registry.
//! - `timeouts`: request deadlines, swept by one task per bus instead of a
//!   timer per request.
//! - [`Interceptor`], [`Headers`], [`DeliveryOptions`], [`Body`],
//!   [`MessageCodec`] / [`CodecRegistry`], [`MetricsSnapshot`].
//!
//! # How a message moves
//! `send(addr, v)`: wrap `v` in a [`Body`] (one `Arc`) → outbound
//! interceptors (skipped by one flag check when none) → look `addr` up in the
//! registry snapshot → pick a consumer round-robin → push onto its queue
//! under a short lock → wake its task only if it was idle (on an event loop
//! with dispatch enabled: put it on the loop's ready list). The consumer task
//! (or the loop's dispatcher) takes up to 64 messages per lock, runs inbound
//! interceptors and awaits the handler for each, in order.
//!
//! # What is hand-written and why
//! The hot path (registry snapshot, queue, round-robin cursors, sharded
//! counters, the event-loop dispatcher) is Railyard's own: it is the product. Everything else uses crates
//! (`tokio` for tasks, timers and the reply slot, `arc-swap`, `parking_lot`,
//! `serde_json`, `smallvec` and `compact_str` for headers). Spinning before
//! an event loop parks (`spin_before_park`) is built on tokio's public park
//! hook.

mod body;
mod bus;
mod codec;
mod consumer;
mod dispatch;
mod error;
mod headers;
mod idle_spin;
mod interceptor;
mod message;
mod metrics;
mod options;
mod queue;
mod remote;
mod reply;
mod spin;
mod timeouts;
mod waiters;

pub use body::Body;
pub use bus::{
    Advertisement, CodecCache, EventBus, PublishReport, WeightedNodes, MAX_REMOTE_WEIGHT,
};
pub use codec::{
    str_from_utf8, string_from_utf8, BytesCodec, CodecRegistry, IntCodec, JsonCodec, MessageCodec,
    StringCodec,
};
pub use consumer::{Consumer, ConsumerBuilder, MessageStream};
pub use dispatch::{enable_loop_dispatch, enable_loop_dispatch_relaying_wakes};
pub use error::{BusError, CodecError, FailureKind, SendError};
pub use headers::Headers;
pub use idle_spin::{note_loop_work, spin_before_park};
pub use interceptor::{Interceptor, InterceptorId, MessageKind, Outbound, Verdict};
pub use message::Message;
pub use metrics::{ConsumerStats, MetricsSnapshot};
pub use options::{DeliveryOptions, DEFAULT_CAPACITY, DEFAULT_TIMEOUT};
pub use remote::{
    ClusterHook, RemoteKind, RemoteMessage, RemoteNode, ReplyHandle, ReplySink, Undelivered,
};
pub use reply::PendingReply;
pub use spin::{SpinGuard, SpinLock};
pub use waiters::RoomWaiters;
