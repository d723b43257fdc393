//! The client's typed errors.

use std::fmt;

/// Why a saga call failed.
///
/// Transport failures are not errors of a call: the client reconnects and
/// resends by itself (see the crate docs). A call fails only when the
/// coordinator answered "no", the client is closed, or the caller asked for
/// something invalid.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum SagaError {
    /// A builder setting is invalid.
    #[error("invalid client setting: {0}")]
    InvalidConfig(String),
    /// The first connection could not be made (later ones are retried
    /// forever with backoff).
    #[error("could not reach the saga coordinator at {endpoint}: {reason}; is `railyard node` running with its saga port there?")]
    Connect {
        /// The endpoint tried.
        endpoint: String,
        /// What went wrong.
        reason: String,
    },
    /// The coordinator refused the session itself (wrong token, unknown
    /// service, no native API): retrying would not help, so the client closed.
    #[error("the saga coordinator refused the session ({code}): {message}; check the token and the coordinator's version")]
    Refused {
        /// The gRPC status code.
        code: tonic::Code,
        /// The coordinator's message.
        message: String,
    },
    /// The coordinator recorded nothing for this event and said why
    /// (malformed, unknown saga, ...).
    #[error("the coordinator rejected {kind} of saga {global_tx_id}: {message}")]
    Rejected {
        /// The event's kind.
        kind: EventKindName,
        /// Its saga.
        global_tx_id: String,
        /// The coordinator's reason.
        message: String,
    },
    /// The saga was already aborted (by a failed step elsewhere, or its
    /// timeout): `end` cannot commit it; its completed steps are being
    /// compensated.
    #[error("saga {0} was aborted by the coordinator; its completed steps are compensated")]
    Aborted(String),
    /// The coordinator broke the protocol (an acknowledgement that does not
    /// match its batch).
    #[error("protocol violation by the saga coordinator: {0}")]
    Protocol(String),
    /// The event is larger, encoded, than one event may be
    /// ([`MAX_EVENT_BYTES`](crate::MAX_EVENT_BYTES)); it was not sent.
    #[error("{kind} of saga {global_tx_id} is {bytes} bytes encoded, more than the {limit} bytes one event may be; send a smaller payload (keep large data elsewhere and pass a reference to it)")]
    TooLarge {
        /// The event's kind.
        kind: EventKindName,
        /// Its saga.
        global_tx_id: String,
        /// Its encoded size.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// The client was closed (by [`SagaClient::close`](crate::SagaClient::close)
    /// or a refused session) before the event was acknowledged.
    #[error("the saga client is closed{}", .0.as_deref().map(|r| format!(": {r}")).unwrap_or_default())]
    Closed(Option<String>),
}

/// An event kind's name, for error messages (e.g. `TX_STARTED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventKindName(pub(crate) &'static str);

impl fmt::Display for EventKindName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

/// Why [`Saga::step`](crate::Saga::step) failed.
#[derive(Debug, thiserror::Error)]
pub enum StepError<E> {
    /// The saga was already aborted when the step was about to start: its
    /// work did not run.
    #[error("saga {0} is aborted: the step's work was skipped")]
    SagaAborted(String),
    /// The step's work failed; the step was reported as aborted, so the
    /// coordinator compensates the saga's completed steps.
    #[error("the step's work failed: {0}")]
    Failed(E),
    /// Reporting the step failed.
    #[error(transparent)]
    Saga(#[from] SagaError),
}

/// A compensation handler's failure; the client reports
/// `TX_COMPENSATE_FAILED` and the coordinator retries as the step's policy
/// says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CompensationError(pub String);

impl CompensationError {
    /// An error with this message.
    pub fn new(message: impl fmt::Display) -> Self {
        Self(message.to_string())
    }
}
