//! Railyard's HTTP/1.1 server, built for many connections (C10K and beyond)
//! on [hyper]: seed 004's server, faster and leaner than the Vert.x original.
//!
//! # Map
//! - [`config`]: [`HttpConfig`], every limit and timeout with its default.
//! - [`router`]: [`Router`], a plain path/method table you can call without a
//!   socket ([`Router::handle`]); fixed bodies are answered without a future.
//! - [`body`]: the response [`Body`] (empty, bytes, a file, a stream) and the
//!   request [`RequestBody`].
//! - [`compress`]: `Accept-Encoding` negotiation; [`FixedBody`] holds a body
//!   compressed once per encoding; other bodies compress on the fly.
//! - [`server`]: [`bind`] opens one `SO_REUSEPORT` listener per core;
//!   [`Server::run`] serves them, one single-threaded runtime per listener,
//!   until the shutdown future resolves, then drains in-flight requests.
//! - `conn` (private): one task per connection: hyper's HTTP/1.1 state
//!   machine over `ConnIo`, the socket wrapper that counts bytes and owns the
//!   zero-copy `sendfile(2)` path (`sendfile`).
//! - `lane` (private): the fixed lane, which answers plain `GET`s of fixed
//!   bodies without hyper and hands every other request to it.
//! - [`metrics`]: [`HttpMetrics`] in a shared Prometheus [`MetricsRegistry`],
//!   and [`admin_router`] serving `GET /metrics`.
//! - [`c10k`]: the seed's routes (`/0k`, `/static/*`, `/cached/*`,
//!   `/sendFile/test`, `POST /upload`) as [`c10k::app`].
//!
//! # How a request flows
//! A core's acceptor takes a permit from the connection semaphore, accepts,
//! sets `TCP_NODELAY`/`TCP_QUICKACK` and spawns the connection on the same
//! core. A plain `GET` of a fixed body is answered by the fixed lane: parsed
//! with `httparse` from a per-core buffer and answered with the head and
//! body serialized at start plus a `date` line, in one `writev`. Any other
//! request goes to hyper: hyper parses the head (bounded by `max_header_bytes` and
//! `header_read_timeout`), the router picks the route, the response goes back
//! through hyper. A file body is written by `sendfile(2)` straight from the
//! page cache to the socket: hyper writes the head and sees placeholder body
//! chunks, which `ConnIo` recognises by address and replaces with `sendfile`
//! calls, so keep-alive and pipelining stay hyper's business.
//!
//! # What is hand-written, and why
//! hyper does the HTTP; Railyard adds what hyper leaves to servers: per-core
//! acceptors, connection limits, graceful draining, pre-compressed bodies, the
//! sendfile path (hyper has none) and streamed uploads with a clean 413. The
//! one piece of HTTP written here is the fixed lane (`lane`): for fixed
//! bodies hyper's general machinery cost about three times the lane's user
//! CPU per request, which issue 4's throughput target could not afford
//! (docs/http.md, "The fixed lane").

pub mod body;
pub mod c10k;
pub mod compress;
pub mod config;
mod conn;
mod lane;
pub mod metrics;
pub mod router;
mod sendfile;
pub mod server;

pub use body::{Body, BodyError, RequestBody};
pub use compress::{Encoding, FixedBody};
pub use config::{ConfigError, HttpConfig, MAX_DURATION};
pub use metrics::{admin_router, HttpMetrics, MetricsRegistry};
pub use router::{Handler, Router};
pub use sendfile::cachestat_available;
pub use server::{bind, HttpError, Server, ShutdownReport};
