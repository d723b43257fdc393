//! Typed errors: configuration that cannot be used, and a server that cannot start.

/// The configuration cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A permission regex does not compile.
    #[error("[bridge] {list}: `{regex}` is not a valid regular expression: {reason}")]
    BadRegex {
        /// Which list (`inbound_permitted` or `outbound_permitted`).
        list: &'static str,
        /// The regex as written.
        regex: String,
        /// The compiler's message.
        reason: String,
    },
    /// A limit is zero where at least one is needed.
    #[error("[bridge] {field} must be at least 1")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// `frame_timeout` or `idle_timeout` is zero: it would close every
    /// connection at once.
    #[error(
        "[bridge] {field} must be at least 1 (milliseconds){}",
        zero_timeout_hint(field)
    )]
    ZeroTimeout {
        /// The field.
        field: &'static str,
    },
}

/// What to write instead of a zero timeout: `idle_timeout = 0` most likely
/// meant "no idle timeout", which is said by leaving the key out.
fn zero_timeout_hint(field: &str) -> &'static str {
    if field == "idle_timeout" {
        "; leave idle_timeout out for no idle timeout"
    } else {
        ""
    }
}

/// The bridge could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BridgeError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The listening socket could not be bound.
    #[error(
        "cannot listen on {addr}: {source}; pick another port with --bridge-port or [bridge] port"
    )]
    Bind {
        /// The address asked for.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
}
