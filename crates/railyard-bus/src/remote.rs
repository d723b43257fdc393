//! The cluster's side door: how a transport plugs remote consumers into the
//! bus, and how registrations are advertised.
//!
//! The bus itself has no network code. A cluster layer (`railyard-cluster`):
//! - installs a [`ClusterHook`], which the bus calls with the count each
//!   time an address gains a public (non-local) consumer on this node (and
//!   awaits, so a registration resolves only once it is visible
//!   cluster-wide) or loses one;
//! - keeps, per address, the list of [`RemoteNode`]s that have consumers
//!   there, each weighted by how many
//!   ([`EventBus::set_weighted_remote_nodes_many`], one registry copy for a
//!   whole batch of addresses); the send path reads that list from the same
//!   snapshot as the local consumers and never waits on the cluster;
//! - hands messages that arrive from peers to [`EventBus::deliver_inbound`],
//!   which reaches local consumers only.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::reply::ReplySender;
use crate::{Body, BusError, Headers, Message};

/// What kind of delivery a remote message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteKind {
    /// Point to point, no answer expected.
    Send,
    /// To every consumer at the address on that node.
    Publish,
    /// Point to point; the answer goes back through the [`ReplyHandle`].
    Request {
        /// The requester's timeout: the remote side gives up after it too.
        timeout: Duration,
    },
}

/// A message on its way to another node.
#[derive(Debug)]
pub struct RemoteMessage {
    /// Destination address.
    pub address: Arc<str>,
    /// Send, publish or request.
    pub kind: RemoteKind,
    /// Headers (after outbound interceptors).
    pub headers: Headers,
    /// The body, still a typed value: the transport encodes it.
    pub body: Body,
    /// Codec named in the delivery options, if any.
    pub codec: Option<Arc<str>>,
    /// For requests: where the answer goes.
    pub reply: Option<ReplyHandle>,
}

/// A node that has consumers at some addresses, reached through a transport.
pub trait RemoteNode: Send + Sync + fmt::Debug + 'static {
    /// The node's id, unique in the cluster.
    fn id(&self) -> &str;

    /// Queues `msg` for the node without waiting.
    ///
    /// # Errors
    /// The message comes back with [`BusError::Full`] when the link's queue is
    /// full, or another error when the link is gone; `send` then tries the
    /// next consumer, as for a full local buffer.
    fn deliver(&self, msg: RemoteMessage) -> Result<(), Box<Undelivered>>;

    /// `Ready` when a refused [`deliver`](Self::deliver) is worth retrying
    /// (the link's queue has room again); otherwise registers `cx`'s waker.
    /// Waiting sends and requests use it, as they wait for a full local buffer.
    /// The default is always ready.
    fn poll_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        let _ = cx;
        Poll::Ready(())
    }

    /// As [`poll_room`](Self::poll_room), for a refused *request*: a
    /// transport may also limit the requests it has unanswered, which a
    /// waiting send must not wait for. The default is `poll_room`.
    fn poll_request_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.poll_room(cx)
    }
}

/// A message a node's link would not take, and why. Boxed: refusals are rare
/// and the message is large.
#[derive(Debug)]
pub struct Undelivered {
    /// [`BusError::Full`] when the link's queue is full; another error when
    /// the link is gone.
    pub error: BusError,
    /// The message, handed back.
    pub message: RemoteMessage,
}

/// Carries answers back to requesters on other nodes: a transport gives the
/// bus a sink and a request id with each request it delivers
/// ([`EventBus::request_remote`](crate::EventBus::request_remote)), and the
/// consumer's `reply` / `fail` (or dropping the request: `NoReply`) calls
/// `reply` once, on the consumer's thread. No task waits per request.
pub trait ReplySink: Send + Sync + 'static {
    /// The answer to request `id`.
    fn reply(&self, id: u64, result: Result<Message, BusError>);
}

/// Told about registrations that other nodes must learn of.
pub trait ClusterHook: Send + Sync + 'static {
    /// `address` got a non-local consumer on this node (its first, or
    /// another): it now has `consumers` of them. The returned future
    /// resolves once the cluster knows this node subscribes to `address`
    /// (other nodes weight this node by `consumers` when they send).
    ///
    /// Called, like [`withdraw`](Self::withdraw), while the bus holds its
    /// registry's write lock: both must return at once (start work, never
    /// wait for it), and the calls come in the order the registry changed,
    /// so the last one says what the cluster should end up with.
    fn advertise(&self, address: &str, consumers: usize) -> crate::Advertisement;

    /// `address` lost a non-local consumer on this node: `consumers` are
    /// left (0: it was the last).
    fn withdraw(&self, address: &str, consumers: usize);
}

/// The answering end of a request that came from this node and went to
/// another: the transport completes it when the reply frame arrives, or fails
/// it when the peer is lost.
pub struct ReplyHandle {
    pub(crate) tx: ReplySender,
}

impl fmt::Debug for ReplyHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplyHandle")
            .field("abandoned", &self.is_abandoned())
            .finish()
    }
}

impl ReplyHandle {
    /// Completes the request with a reply message.
    /// (The requester's future counts it, as for a local reply. A reply from
    /// another node cannot itself be answered: request chains stay on one node.)
    pub fn reply(self, headers: Headers, body: Body) {
        let _ = self.tx.send(Ok(Message::remote_reply(headers, body)));
    }

    /// Fails the request.
    pub fn fail(self, error: BusError) {
        let _ = self.tx.send(Err(error));
    }

    /// Whether the requester gave up (timed out or dropped its future): the
    /// transport may forget the request.
    pub fn is_abandoned(&self) -> bool {
        self.tx.is_closed()
    }
}
