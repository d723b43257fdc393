//! The bridge's configuration: a plain serde struct, read from the `[bridge]`
//! section of a node's config file, with a `Default` for every field.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The default TCP port, the one Vert.x bridge clients connect to by default.
pub const DEFAULT_PORT: u16 = 7000;

/// How the bridge listens, whom it lets through and how much it lets each
/// connection hold.
///
/// Every field has a default, so an empty `[bridge]` section is valid: it
/// listens on `127.0.0.1:7000` and, with both permission lists empty, denies
/// every address (clients can still `ping`).
///
/// ```toml
/// [bridge]
/// port = 7000
/// inbound_permitted = [{ address = "railyard.node.echo" }, { address_regex = "orders\\..+" }]
/// outbound_permitted = [{ address_regex = "news\\..+" }]
/// max_frame_size = 1048576
/// max_headers = 1024
/// frame_timeout = 30000   # milliseconds
/// idle_timeout = 120000   # milliseconds; leave out for none
/// auth_token = "change-me"
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BridgeConfig {
    /// Whether the node serves the bridge at all. Default `true`.
    pub enabled: bool,
    /// Interface to listen on. Default `127.0.0.1`; use `0.0.0.0` to accept
    /// other machines (then also set `auth_token`).
    pub host: String,
    /// TCP port. Default [`DEFAULT_PORT`] (7000); `0` picks a free port.
    pub port: u16,
    /// Addresses clients may `send` and `publish` to. Empty denies everything.
    /// Replies to a message the client received are always allowed.
    pub inbound_permitted: Vec<PermittedOptions>,
    /// Addresses clients may `register` at (and so receive from). Empty
    /// denies everything.
    pub outbound_permitted: Vec<PermittedOptions>,
    /// Largest frame accepted from a client, in bytes of JSON (the 4-byte
    /// length prefix excluded). A larger length prefix gets an
    /// `frame_too_large` err frame and the connection is closed. Default 1 MiB.
    pub max_frame_size: usize,
    /// Most headers one inbound frame may carry: the keys of its `headers`
    /// object, `authToken` and the delivery options (`timeout`, ...)
    /// included. Every header is kept on the message and written again for
    /// each client it is delivered to, so this bounds that work per message
    /// (`max_frame_size` alone lets a frame carry over 100,000 short ones).
    /// A frame (other than `ping`) with more gets a `too_many_headers` err
    /// frame and is not acted on; the connection stays open. Default 1024.
    pub max_headers: usize,
    /// Most addresses one connection may be registered at. Default 1024.
    pub max_registrations: usize,
    /// Messages each registration buffers for its client while the
    /// connection cannot take them (a client that does not read): past it
    /// the bus refuses new ones to their senders (see Back-pressure). With
    /// `max_registrations` and `max_frame_size` it bounds what a client that
    /// never reads can hold: registrations x capacity x the largest message.
    /// Default 1024, the bus's own default.
    pub registration_capacity: usize,
    /// Most requests (`send` with `replyAddress`) one connection may have
    /// waiting for a reply from the bus. Default 1024.
    pub max_pending_requests: usize,
    /// Most bus requests one connection may have received and not answered
    /// yet. Past it, new requests for that client are failed at once
    /// (`RECIPIENT_FAILURE`, code -1) so their senders need not wait for a
    /// timeout. Default 1024. Requests held longer than `reply_timeout`, or
    /// whose requester is gone, are let go first to make room.
    pub max_pending_replies: usize,
    /// How long a bus request delivered to a client may wait for its answer
    /// before it may be let go to make room (see `max_pending_replies`): a
    /// client that never answers then does not refuse every later request
    /// for as long as it stays connected. The requester itself gives up at
    /// its own timeout. In files: milliseconds. Default 30 s, the bus's
    /// default request timeout.
    #[serde(with = "millis")]
    pub reply_timeout: Duration,
    /// Outbound queue per connection, in bytes of encoded frames. When it is
    /// this full the connection stops taking work (see the crate docs,
    /// Back-pressure) until the client has read some. Default 1 MiB.
    pub outbound_queue_bytes: usize,
    /// Most connections open at once. Past it a new connection gets a
    /// `too_many_connections` err frame and is closed. Default 16384.
    pub max_connections: usize,
    /// How long a client may take to send one frame, from the first byte of
    /// its length prefix to its last byte. Past it the client gets a
    /// `frame_timeout` err frame and is closed: without it, a client that
    /// sends part of a frame and then nothing would hold its connection slot
    /// and its partly filled read buffer forever. Only a partly received
    /// frame is timed, so idle connections cost no timer; time the bridge
    /// spends not reading (paused because the client does not read its
    /// replies) does not count. In files: milliseconds. Default 30 s.
    #[serde(with = "millis")]
    pub frame_timeout: Duration,
    /// When set, a connection that delivers no complete frame for this long
    /// gets an `idle_timeout` err frame and is closed; a `ping` counts (the
    /// Vert.x clients ping to stay connected). In files: milliseconds; leave
    /// it out for none. Default: none, as in Vert.x's bridge, so idle clients
    /// stay connected.
    #[serde(with = "millis_or_none")]
    pub idle_timeout: Option<Duration>,
    /// When set, a client must send this value in the `authToken` header of
    /// its first frame other than `ping`; otherwise it gets an
    /// `authentication_failed` err frame and is closed. It must do so within
    /// `frame_timeout` of connecting (pings need no token, so they would
    /// otherwise hold a slot forever), or it gets `authentication_timeout`.
    /// Default: unset.
    pub auth_token: Option<String>,
}

impl Default for BridgeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            host: "127.0.0.1".into(),
            port: DEFAULT_PORT,
            inbound_permitted: Vec::new(),
            outbound_permitted: Vec::new(),
            max_frame_size: 1 << 20,
            max_headers: 1024,
            max_registrations: 1024,
            registration_capacity: railyard_bus::DEFAULT_CAPACITY,
            max_pending_requests: 1024,
            max_pending_replies: 1024,
            reply_timeout: railyard_bus::DEFAULT_TIMEOUT,
            outbound_queue_bytes: 1 << 20,
            max_connections: 16_384,
            frame_timeout: Duration::from_secs(30),
            idle_timeout: None,
            auth_token: None,
        }
    }
}

/// One permitted address, as in Vert.x's `PermittedOptions`: an exact
/// `address`, or an `address_regex` the whole address must match. An entry
/// with neither permits every address (as in Vert.x). Vert.x's `match`
/// (permission by body content) is not supported.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PermittedOptions {
    /// The exact address. Wins over `address_regex` when both are set.
    pub address: Option<String>,
    /// A regular expression (Rust `regex` syntax) matched against the whole address.
    #[serde(alias = "addressRegex")]
    pub address_regex: Option<String>,
}

impl PermittedOptions {
    /// Permits exactly `address`.
    pub fn address(address: impl Into<String>) -> Self {
        Self {
            address: Some(address.into()),
            address_regex: None,
        }
    }

    /// Permits every address the whole of which matches `regex`.
    pub fn regex(regex: impl Into<String>) -> Self {
        Self {
            address: None,
            address_regex: Some(regex.into()),
        }
    }
}

/// Durations as whole milliseconds in files, as the node's `[saga]` section
/// writes them: `frame_timeout = 30000`.
mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

/// An optional duration in whole milliseconds: a missing key is none.
mod millis_or_none {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::millis::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}
