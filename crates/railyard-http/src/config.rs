//! Server limits and timeouts, as a plain serde struct with documented defaults.

use std::time::Duration;

/// Every tunable of the server. `Default` gives production-minded values.
///
/// Limits answer with a status instead of failing the process: a head larger
/// than `max_header_bytes` gets 431, a body over `max_body_bytes` 413, a
/// handler slower than `request_timeout` 408; a client that does not finish
/// its head within `header_read_timeout` is disconnected (slowloris).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct HttpConfig {
    /// Event-loop threads, each with its own `SO_REUSEPORT` listener;
    /// 0 means one per core.
    pub threads: usize,
    /// Connections served at once, over all cores. When reached, each core
    /// holds at most one more accepted connection until a permit frees, and
    /// the rest wait in the kernel's backlog.
    pub max_connections: usize,
    /// Listen backlog per listener.
    pub backlog: i32,
    /// Largest request head (request line plus headers) in bytes; larger gets 431.
    pub max_header_bytes: usize,
    /// Most headers in one request; more gets 431.
    pub max_headers: usize,
    /// Largest request body accepted by bounded routes (uploads); larger gets 413.
    pub max_body_bytes: u64,
    /// Time a client has to send a complete request head, counted from the
    /// connection's start or the end of its previous response; it is also how
    /// long an idle keep-alive connection stays open.
    #[serde(with = "secs")]
    pub header_read_timeout: Duration,
    /// Time a handler has to produce a response head; slower gets 408.
    #[serde(with = "secs")]
    pub request_timeout: Duration,
    /// Longest time a response may wait for the client to take any of it (a
    /// client that stops reading): past it the connection is closed. Without
    /// it such a client would hold its connection, its buffers and its
    /// kernel send buffer for as long as it answers TCP's window probes.
    #[serde(with = "secs")]
    pub write_timeout: Duration,
    /// On shutdown, how long in-flight requests get to finish before their
    /// connections are dropped.
    #[serde(with = "secs")]
    pub shutdown_deadline: Duration,
    /// Smallest dynamic body compressed on the fly (fixed bodies are
    /// compressed once, at start, when at least this big).
    pub compress_min_bytes: usize,
    /// Enable TCP fast open on the listeners with this queue length (0: off).
    pub tcp_fastopen_queue: u32,
    /// Drop hyper's per-connection state (about 10 KiB) while a keep-alive
    /// connection is idle between requests, keeping only the socket.
    pub park_idle_connections: bool,
    /// How long a connection stays idle before it parks (roughly: between
    /// one and two of these); 0 parks at once after every response.
    #[serde(with = "secs")]
    pub park_idle_after: Duration,
    /// Answer plain `GET`s of fixed bodies (the `FixedBody` routes) on a
    /// lane of Railyard's own, without hyper: same bytes on the wire, about
    /// a third of the CPU per request. Anything else on the connection is
    /// still served by hyper. Off: hyper serves every request.
    pub fixed_lane: bool,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            threads: 0,
            max_connections: 100_000,
            backlog: 8192,
            max_header_bytes: 16 * 1024,
            max_headers: 100,
            max_body_bytes: 64 * 1024 * 1024,
            header_read_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            shutdown_deadline: Duration::from_secs(10),
            compress_min_bytes: 1024,
            tcp_fastopen_queue: 256,
            park_idle_connections: true,
            park_idle_after: Duration::from_secs(2),
            fixed_lane: true,
        }
    }
}

/// A configuration value that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A field that must be positive is zero.
    #[error("`{0}` must be greater than zero")]
    Zero(&'static str),
    /// `max_header_bytes` is below hyper's smallest read buffer.
    #[error("`max_header_bytes` must be at least 8192 (hyper's smallest read buffer), got {0}")]
    HeaderBytes(usize),
    /// A duration beyond [`MAX_DURATION`] (deadlines are `Instant + d`,
    /// which must not overflow).
    #[error("`{0}` must be at most a year (365 days)")]
    TooLong(&'static str),
}

/// The longest timeout or interval a configuration may give.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

impl HttpConfig {
    /// Checks the values that cannot work.
    ///
    /// # Errors
    /// The first [`ConfigError`] found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_connections == 0 {
            return Err(ConfigError::Zero("max_connections"));
        }
        if self.backlog <= 0 {
            return Err(ConfigError::Zero("backlog"));
        }
        if self.max_headers == 0 {
            return Err(ConfigError::Zero("max_headers"));
        }
        if self.max_header_bytes < 8192 {
            return Err(ConfigError::HeaderBytes(self.max_header_bytes));
        }
        for (name, d) in [
            ("header_read_timeout", self.header_read_timeout),
            ("request_timeout", self.request_timeout),
            ("write_timeout", self.write_timeout),
        ] {
            if d.is_zero() {
                return Err(ConfigError::Zero(name));
            }
        }
        for (name, d) in [
            ("header_read_timeout", self.header_read_timeout),
            ("request_timeout", self.request_timeout),
            ("write_timeout", self.write_timeout),
            ("shutdown_deadline", self.shutdown_deadline),
            ("park_idle_after", self.park_idle_after),
        ] {
            if d > MAX_DURATION {
                return Err(ConfigError::TooLong(name));
            }
        }
        Ok(())
    }

    /// The thread count, resolving 0 to the number of cores.
    pub fn effective_threads(&self) -> usize {
        if self.threads > 0 {
            self.threads
        } else {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        }
    }
}

/// Durations as (fractional) seconds in files: `header_read_timeout = 2.5`.
mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_do_not() {
        assert_eq!(HttpConfig::default().validate(), Ok(()));
        let c = HttpConfig {
            max_connections: 0,
            ..HttpConfig::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::Zero("max_connections")));
        let c = HttpConfig {
            max_header_bytes: 100,
            ..HttpConfig::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::HeaderBytes(100)));
        // Deadlines are `Instant + timeout`: a timeout near `u64::MAX`
        // seconds would overflow (panic) on every connection.
        let c = HttpConfig {
            header_read_timeout: Duration::from_secs(10_000_000_000_000_000_000),
            ..HttpConfig::default()
        };
        assert_eq!(
            c.validate(),
            Err(ConfigError::TooLong("header_read_timeout"))
        );
        let c = HttpConfig {
            request_timeout: MAX_DURATION,
            ..HttpConfig::default()
        };
        assert_eq!(c.validate(), Ok(()));
        assert!(HttpConfig::default().effective_threads() >= 1);
    }
}
