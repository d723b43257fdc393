//! Railyard's clustered event bus.
//!
//! Several processes ("nodes") share one logical bus. Each node keeps its own
//! [`railyard_bus::EventBus`]; this crate adds the other nodes' consumers to
//! it and carries messages between nodes.
//!
//! # Map
//! - [`ClusterManager`] (`manager`): membership and the subscription
//!   registry (address -> nodes), published as a watched [`ClusterView`].
//!   Implementations: [`EtcdManager`] (`etcd`: leases, keep-alive, prefix
//!   watches) and [`InProcessRegistry`] / [`InProcessManager`] (`inproc`:
//!   several nodes in one process, for tests).
//! - [`EtcdServer`] (`etcd_server`): a throwaway etcd on loopback for tests,
//!   the bench and `railyard dev etcd`.
//! - [`ClusterNode`] (`node`): joins a bus to a cluster. It listens for
//!   peers, keeps one `Link` per peer, installs the bus's cluster hook (a
//!   public consumer's registration resolves once the manager has stored the
//!   subscription) and follows the view, handing each address's remote nodes
//!   to the bus: one batch per view change, applied on a blocking thread.
//! - `link`: one long-lived TCP connection per peer pair, owned by one task:
//!   bounded queue in, batched writes out, pings, reconnect with backoff,
//!   requests failed at once when the peer is lost.
//! - [`Frame`] (`frame`): the length-prefixed binary frame format.
//!
//! # How a message moves
//! `send(addr)` on node A reads A's registry snapshot, which lists A's local
//! consumers and the links of nodes with consumers at `addr`; it picks one
//! round-robin. A remote pick queues the message on that node's link and
//! returns: nothing on the send path awaits the cluster manager. The link's
//! task encodes the body with its codec and writes frames in batches. On B,
//! the link's reader hands the message to B's bus as `local_only`; a reply
//! travels back on the same connection to the waiting request on A.
//!
//! # What is hand-written and why
//! The frame format and link task are Railyard's own: they are small, and
//! their failure rules (which requests fail when, what a bad frame closes)
//! are the product. etcd access uses `etcd-client`.

mod etcd;
mod etcd_server;
mod frame;
mod inproc;
mod lane;
mod link;
mod manager;
mod metrics;
mod node;
mod offload;
mod outq;

pub use etcd::{EtcdConfig, EtcdManager};
pub use etcd_server::{EtcdServer, EtcdServerError};
pub use frame::{FailKind, Frame, FrameError, Mode, DEFAULT_MAX_FRAME, VERSION};
pub use inproc::{InProcessManager, InProcessRegistry};
pub use manager::{BoxFuture, ClusterManager, ClusterView, ManagerError, NodeInfo};
pub use metrics::{ClusterCounters, Counter};
pub use node::{ClusterConfig, ClusterError, ClusterNode, ClusterObserver};
