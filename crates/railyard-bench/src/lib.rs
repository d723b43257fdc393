//! The bench lab: one scenario per seed, run against Railyard and, with
//! `--vs`, against the original system from `peers/` in the same run.
//!
//! # Map
//! - [`pingpong`]: seed 000, 500k request/reply messages.
//! - [`echo`]: seed 001, echo round trips in a window, and its matrix.
//! - [`bridge`]: request/reply round trips through a TCP event-bus bridge
//!   server (a `railyard node` or the Vert.x peer) run as its own process.
//! - [`cluster`]: clustered runs: a bus joined to etcd, the second node process.
//! - [`c10k`]: seed 004, an HTTP server under 10k connections (wrk, oha, RSS).
//! - [`loops`]: thread-per-core event loops the scenarios run on.
//! - [`redis_refresh`]: seed 002, a Redis-backed `GET /test` under vegeta
//!   with topology refresh on and off, against Lettuce.
//! - [`saga`]: seed 003, the alpha-benchmark profile against a saga
//!   coordinator, over Omega's unary gRPC or the native batched stream.
//! - [`saga_server`]: the coordinator under test, in-process on its own
//!   runtime, with the store a run asks for.
//! - [`peer`]: builds and runs a Java peer and reads its `RESULT` line.
//! - [`probe`]: how far apart the cores are right now (a cache line's round
//!   trip between two threads), recorded around every echo run.
//! - [`dtm`]: runs DTM (`peers/dtm/run`), the saga scenario's peer.
//! - [`report`]: tables, medians, the JSON results file.
//! - [`plot`]: SVG charts of a results file (`railyard bench plot`).
//!
//! Every scenario returns a serializable result row carrying `scenario`,
//! `system` and its full configuration, so rows from different runs join.

pub mod bridge;
pub mod c10k;
pub mod cluster;
pub mod dtm;
pub mod echo;
mod grpc_h2;
pub mod loops;
mod omega_wire;
pub mod peer;
pub mod pingpong;
pub mod plot;
pub mod probe;
pub mod redis_refresh;
pub mod report;
pub mod saga;
pub mod saga_server;
