//! Membership and the subscription registry, behind one trait.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::watch;

/// What a node tells the cluster about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// Unique node id (no `/`).
    pub id: String,
    /// Where its transport listens.
    pub addr: SocketAddr,
}

/// The cluster as one node currently sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterView {
    /// Live members: node id -> transport address.
    pub members: BTreeMap<String, SocketAddr>,
    /// Subscriptions: address -> the nodes with public consumers there,
    /// each with how many (at least 1). A sender weights each node by its
    /// count, so every consumer in the cluster gets its share of sends.
    pub subscriptions: BTreeMap<String, BTreeMap<String, u32>>,
    /// Whether the manager currently reaches its backing store. While it does
    /// not, the view is the last one known and routes keep working.
    pub connected: bool,
}

/// Why a cluster manager operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ManagerError {
    /// The backing store (etcd) could not be reached or refused the call.
    #[error("cluster store unavailable: {0}; check that etcd is running and reachable at the configured endpoints")]
    Unavailable(String),
    /// A node id or address the store cannot hold.
    #[error("invalid {what}: {value}")]
    Invalid {
        /// What was invalid.
        what: &'static str,
        /// The offending value.
        value: String,
    },
    /// The manager was shut down.
    #[error("cluster manager stopped")]
    Stopped,
}

/// A boxed future, as the trait's methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Membership and subscriptions for one node.
///
/// Writes (`join`, `subscribe`...) resolve once the store has them, so a
/// subscription is visible cluster-wide when its future resolves. Reads go
/// through [`view`](ClusterManager::view), a watch the manager keeps current
/// from the store's own change feed; nothing on a send path ever calls the
/// manager.
pub trait ClusterManager: Send + Sync + 'static {
    /// Joins the cluster as `node`.
    fn join(&self, node: NodeInfo) -> BoxFuture<'_, Result<(), ManagerError>>;
    /// Leaves: the node and all its subscriptions disappear.
    fn leave(&self) -> BoxFuture<'_, Result<(), ManagerError>>;
    /// Adds this node to the subscribers of `address`, with `consumers`
    /// public consumers there (at least 1; a later call replaces the count).
    fn subscribe(&self, address: &str, consumers: u32) -> BoxFuture<'_, Result<(), ManagerError>>;
    /// Removes this node from the subscribers of `address`.
    fn unsubscribe(&self, address: &str) -> BoxFuture<'_, Result<(), ManagerError>>;
    /// The current view, kept up to date.
    fn view(&self) -> watch::Receiver<Arc<ClusterView>>;
}

pub(crate) fn check_node_id(id: &str) -> Result<(), ManagerError> {
    if id.is_empty() || id.contains('/') || id.len() > 200 {
        return Err(ManagerError::Invalid {
            what: "node id (non-empty, at most 200 bytes, no '/')",
            value: id.to_owned(),
        });
    }
    Ok(())
}
