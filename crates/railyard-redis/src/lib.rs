//! `railyard-redis`: a Redis Cluster client whose tail latency does not care
//! what the topology work costs.
//!
//! # Map
//! - [`client`](ClusterClient): configuration ([`ClusterClientBuilder`]),
//!   routing by key slot, MOVED/ASK, retries, the typed commands and [`Cmd`].
//! - `conn`: one task per node owns its socket; handles send it commands over
//!   a bounded channel and get replies on a oneshot; pipelining, reconnects
//!   with backoff; big replies decoded by the caller, off the task.
//! - [`slot`]: CRC16 key slots and hash tags.
//! - [`topology`]: `CLUSTER NODES` views, their fingerprints, the consensus
//!   rule and the [`SlotTable`].
//! - `refresh`: the refresher task (periodic sampled checks, full refreshes
//!   on change or adaptive triggers, all parsing on a blocking thread, the
//!   table swapped in atomically); [`RefreshStats`]. It runs on a dedicated
//!   topology thread with its own node connections.
//! - [`double`]: an in-process many-port fake cluster (up to 1000 nodes) for
//!   tests and benches.
//! - [`local_cluster`]: start/stop a real local cluster from `redis-server`.
//! - [`service`]: the seed-002 HTTP service (`GET /test`) on hyper.
//!
//! # How data moves
//! A command hashes its key to a slot, reads the current [`SlotTable`] (an
//! `ArcSwap` load: no lock), picks the node, and hands the encoded command to
//! that node's connection task, which pipelines it and sends the reply back.
//! The refresher, on its own thread, fetches views over its own connections,
//! hashes, parses and builds on a blocking thread, then stores the new table
//! with one atomic pointer swap. Command tasks only ever read the table.
//!
//! A node's connection task frames every reply (a resumable walk over its
//! headers finds where it ends) and decodes it only when that is cheap:
//! when the decoder has at most 4 KiB to read, bulk-string payloads not
//! counted since they are sliced, not read. So bulk strings of any size,
//! short error replies (MOVED/ASK included) and small aggregates are decoded
//! there, in turns of at most 4 KiB decoded between yields. A bigger reply
//! (an `LRANGE` of thousands of elements, which takes milliseconds to
//! decode) reaches its caller as bytes and is decoded on the runtime's
//! blocking pool before the call returns, so that the connection's task,
//! which serves every caller of that node, never holds an async worker for
//! it and the caller's task does not either while decoding (what the caller
//! then does with a big value, iterating or dropping it, is its own work).
//!
//! The RESP decoder is the `redis-protocol` crate; the command encoder, the
//! CRC16 and the topology code are Railyard's own, because they are either
//! trivial or the point of this crate.

mod client;
mod conn;
pub mod double;
mod error;
pub mod local_cluster;
mod refresh;
pub mod service;
pub mod slot;
pub mod topology;
mod value;

pub use client::{ClusterClient, ClusterClientBuilder, ReadFrom, SetOptions};
pub use error::RedisError;
pub use refresh::{thread_cpu_ns, Reason, RefreshStats};
pub use topology::SlotTable;
pub use value::{Cmd, Protocol, ToArg, Value};
