//! Typed failures: what a sender, requester or registrant can get back.

use std::time::Duration;

use crate::Body;

/// The four failure kinds a reply can carry, as in Vert.x's `ReplyFailure`.
///
/// Every [`BusError`] maps to one of them through [`BusError::kind`], so code
/// that only cares about the broad class (and the metrics) can match on this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// No reply arrived before the request's timeout.
    Timeout,
    /// No consumer was registered at the address (or it went away before handling).
    NoHandlers,
    /// The consumer answered with [`crate::Message::fail`].
    RecipientFailure,
    /// Anything else: a full buffer, an interceptor's veto, a dropped request.
    Error,
}

impl FailureKind {
    /// Every kind, in a stable order (metrics exporters iterate this).
    pub const ALL: [FailureKind; 4] = [
        FailureKind::Timeout,
        FailureKind::NoHandlers,
        FailureKind::RecipientFailure,
        FailureKind::Error,
    ];

    /// The Vert.x spelling: `TIMEOUT`, `NO_HANDLERS`, `RECIPIENT_FAILURE`, `ERROR`.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureKind::Timeout => "TIMEOUT",
            FailureKind::NoHandlers => "NO_HANDLERS",
            FailureKind::RecipientFailure => "RECIPIENT_FAILURE",
            FailureKind::Error => "ERROR",
        }
    }

    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a send, publish, request or registration did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BusError {
    /// No reply within the request's timeout.
    #[error("no reply within {after:?}: the consumer is slow or never replied; raise DeliveryOptions::timeout if that is expected")]
    Timeout {
        /// The timeout that expired.
        after: Duration,
    },
    /// Nobody is registered at the address.
    #[error("no handlers for address `{address}`: register a consumer there first")]
    NoHandlers {
        /// The address that had no consumer.
        address: String,
    },
    /// The consumer failed the request with a code and a message.
    #[error("recipient failed with code {code}: {message}")]
    RecipientFailure {
        /// Application-defined failure code.
        code: i32,
        /// Application-defined message.
        message: String,
    },
    /// Every consumer's buffer at the address was full.
    #[error("every consumer buffer at `{address}` is full: the consumer is slower than its senders; retry later, use a waiting send, or raise its capacity")]
    Full {
        /// The address whose consumers are saturated.
        address: String,
    },
    /// An interceptor refused the message.
    #[error("rejected by an interceptor: {reason}")]
    Rejected {
        /// The interceptor's reason.
        reason: String,
    },
    /// The consumer dropped the request without replying or failing it.
    #[error("the consumer dropped the request without replying")]
    NoReply,
    /// The delivery options name a codec the registry does not know.
    #[error("unknown codec `{name}`: register it with EventBus::register_codec first")]
    UnknownCodec {
        /// The unknown codec name.
        name: String,
    },
    /// The address is not valid (empty).
    #[error("invalid address `{address}`: addresses must be non-empty")]
    InvalidAddress {
        /// The rejected address.
        address: String,
    },
    /// The cluster could not carry out the operation (advertising a
    /// registration, or reaching a node that was lost).
    #[error("cluster: {reason}")]
    Cluster {
        /// What went wrong and what to check.
        reason: String,
    },
    /// The message was a reply to something that expected none, or was answered twice.
    #[error("this message does not expect a reply (it was sent, published, or already answered)")]
    NotReplyable,
}

impl BusError {
    /// The broad failure class, as reported to requesters and metrics.
    pub fn kind(&self) -> FailureKind {
        match self {
            BusError::Timeout { .. } => FailureKind::Timeout,
            BusError::NoHandlers { .. } => FailureKind::NoHandlers,
            BusError::RecipientFailure { .. } => FailureKind::RecipientFailure,
            _ => FailureKind::Error,
        }
    }

    /// The recipient's failure code, for [`BusError::RecipientFailure`].
    pub fn failure_code(&self) -> Option<i32> {
        match self {
            BusError::RecipientFailure { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// A failed `send` or `publish`: the error plus the body, handed back so nothing is lost.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct SendError {
    /// Why the message was not accepted.
    pub error: BusError,
    body: Body,
}

impl SendError {
    pub(crate) fn new(error: BusError, body: Body) -> Self {
        Self { error, body }
    }

    /// The failure class.
    pub fn kind(&self) -> FailureKind {
        self.error.kind()
    }

    /// The body that was not delivered.
    pub fn into_body(self) -> Body {
        self.body
    }
}

/// A codec could not encode or decode a body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The codec name is not registered.
    #[error("unknown codec `{0}`")]
    Unknown(String),
    /// A codec with this name is already registered.
    #[error("a codec named `{0}` is already registered")]
    Duplicate(String),
    /// The body's type is not what the codec handles.
    #[error("codec `{codec}` cannot encode a `{type_name}`")]
    WrongType {
        /// The codec asked to encode.
        codec: String,
        /// The body's Rust type.
        type_name: &'static str,
    },
    /// No codec was named and none is the default for the body's type.
    #[error("no default codec for `{0}`: name one in DeliveryOptions or register a default")]
    NoDefault(&'static str),
    /// The bytes are not a valid encoding.
    #[error("codec `{codec}` could not decode the bytes: {reason}")]
    Malformed {
        /// The codec that failed.
        codec: String,
        /// What was wrong.
        reason: String,
    },
}
