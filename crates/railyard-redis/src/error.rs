//! Typed errors: what went wrong and what the caller can do about it.

use std::sync::Arc;
use std::time::Duration;

/// Everything a Redis Cluster call can fail with.
///
/// The enum is `Clone` (I/O errors are shared behind an `Arc`) because one
/// connection failure is reported to every request that was in flight on it.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// The server answered with an error reply that is not a redirection
    /// (e.g. `WRONGTYPE`, `NOSCRIPT`, `CROSSSLOT`).
    #[error("redis error reply from {node}: {kind} {message}")]
    Server {
        /// The node that answered.
        node: Arc<str>,
        /// The first word of the reply (`ERR`, `WRONGTYPE`, `NOSCRIPT`, ...).
        kind: String,
        /// The rest of the reply.
        message: String,
    },
    /// A reply could not be decoded. Usually not Redis on the other end, or a
    /// proxy in the way.
    ///
    /// When the bytes could not be framed (not RESP, nested too deep, over
    /// `max_reply_size`), or a reply decoded on the connection's task was
    /// refused, the connection was closed and will be reopened, and every
    /// request in flight on it gets this error. A large reply decoded off
    /// that task (see "How data moves" in the crate documentation) whose end
    /// was found but whose contents the decoder refuses fails only its own
    /// request: the connection stays open.
    #[error("malformed reply from {node}: {detail}")]
    Protocol {
        /// The node the bytes came from.
        node: Arc<str>,
        /// What the decoder said.
        detail: String,
    },
    /// Connecting, reading or writing failed.
    #[error("i/o with {node} failed: {source}")]
    Io {
        /// The node.
        node: Arc<str>,
        /// The OS error.
        source: Arc<std::io::Error>,
    },
    /// The node's connection is down and being re-established (with backoff);
    /// the command was not sent. The cluster client retries after a refresh.
    #[error("not connected to {node} (reconnecting); retry, or check that the node is up")]
    Disconnected {
        /// The node.
        node: Arc<str>,
    },
    /// No reply within the command timeout. The command may still execute.
    #[error("no reply from {node} within {timeout:?}; the command may still have executed")]
    Timeout {
        /// The node.
        node: Arc<str>,
        /// The configured timeout.
        timeout: Duration,
    },
    /// The node's command queue is full (see `ClusterConfig::queue_capacity`);
    /// the command was not sent. Shed load or raise the capacity.
    #[error("command queue to {node} is full ({capacity} waiting); the command was not sent")]
    QueueFull {
        /// The node.
        node: Arc<str>,
        /// The queue's capacity.
        capacity: usize,
    },
    /// Redirections (MOVED/ASK) exceeded `ClusterConfig::max_redirects`.
    #[error(
        "slot {slot} redirected more than {max} times; the cluster is resharding or misconfigured"
    )]
    TooManyRedirects {
        /// The slot.
        slot: u16,
        /// The limit.
        max: u32,
    },
    /// No node is known to serve this slot (the cluster is not fully covered).
    #[error(
        "no node serves slot {slot}; the cluster does not cover every slot (check `CLUSTER INFO`)"
    )]
    SlotUncovered {
        /// The slot.
        slot: u16,
    },
    /// A multi-key command whose keys hash to different slots, where Redis
    /// requires one slot (EVALSHA, a single MSET call to one node...).
    #[error("keys of `{command}` hash to different slots; use a hash tag such as {{user1}}.a, {{user1}}.b")]
    CrossSlot {
        /// The command.
        command: String,
    },
    /// A reply had an unexpected shape for the typed helper that sent it.
    #[error("unexpected reply to {command}: {detail}")]
    UnexpectedReply {
        /// The command.
        command: String,
        /// What arrived instead.
        detail: String,
    },
    /// A topology reply (CLUSTER NODES) could not be parsed.
    #[error("cannot parse the cluster topology from {node}: {detail}")]
    Topology {
        /// The node.
        node: Arc<str>,
        /// What was wrong.
        detail: String,
    },
    /// None of the seed nodes answered, so there is no topology to route with.
    #[error("no seed node answered CLUSTER NODES ({detail}); check the addresses and that cluster mode is on")]
    NoSeed {
        /// The errors, one per seed.
        detail: String,
    },
    /// A configuration value was rejected.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A command that changes its connection's state (a transaction, a
    /// subscription, a blocking pop, ...), refused: every caller shares the
    /// pipelined connection to a node.
    #[error("{0} is refused: it would change the state of the connection every caller shares (transactions, subscriptions, client tracking and blocking commands need a connection of their own)")]
    StatefulCommand(String),
    /// The client was shut down.
    #[error("the cluster client was shut down")]
    Shutdown,
}

impl RedisError {
    /// Whether a retry on a fresh topology may succeed (connection trouble,
    /// cluster state errors such as `CLUSTERDOWN` or `TRYAGAIN`).
    pub fn is_retryable(&self) -> bool {
        match self {
            RedisError::Disconnected { .. } | RedisError::Io { .. } => true,
            RedisError::Server { kind, .. } => {
                matches!(
                    kind.as_str(),
                    "CLUSTERDOWN" | "TRYAGAIN" | "LOADING" | "MASTERDOWN"
                )
            }
            _ => false,
        }
    }
}
