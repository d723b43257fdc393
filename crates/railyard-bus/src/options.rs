//! Delivery and consumer options.

use std::sync::Arc;
use std::time::Duration;

use crate::Headers;

/// The default request timeout: 30 s, as in Vert.x.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The default capacity of a consumer's buffer, in messages.
pub const DEFAULT_CAPACITY: usize = 1024;

/// How one message is delivered.
#[derive(Debug, Clone)]
pub struct DeliveryOptions {
    /// How long a request waits for its reply (including any wait for buffer room).
    pub timeout: Duration,
    /// Headers carried with the message.
    pub headers: Headers,
    /// Deliver only to consumers on this node, even when clustered.
    pub local_only: bool,
    /// The codec used if the message leaves the process; `None` picks the
    /// default codec for the body's type. Never used on a local hop.
    pub codec: Option<Arc<str>>,
}

impl Default for DeliveryOptions {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl DeliveryOptions {
    /// The defaults: 30 s timeout, no headers, not local-only, default codec.
    pub const DEFAULT: DeliveryOptions = DeliveryOptions {
        timeout: DEFAULT_TIMEOUT,
        headers: Headers::new(),
        local_only: false,
        codec: None,
    };

    /// Default options.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the request timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.add(name, value);
        self
    }

    /// Sets `local_only`.
    pub fn local_only(mut self, local_only: bool) -> Self {
        self.local_only = local_only;
        self
    }

    /// Names the codec used on the wire.
    pub fn codec(mut self, name: impl Into<Arc<str>>) -> Self {
        self.codec = Some(name.into());
        self
    }
}
