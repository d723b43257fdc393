//! An in-process cluster manager: several nodes in one process share a
//! registry. For tests and for trying the cluster without etcd; it has the
//! same semantics as the etcd manager minus durability and leases.

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::manager::{
    check_node_id, BoxFuture, ClusterManager, ClusterView, ManagerError, NodeInfo,
};

/// The shared registry; clone it into every node's [`InProcessManager`].
#[derive(Clone, Default)]
pub struct InProcessRegistry {
    inner: Arc<Mutex<Registry>>,
}

#[derive(Default)]
struct Registry {
    view: ClusterView,
    /// One watch per manager, all fed the same view.
    watchers: Vec<watch::Sender<Arc<ClusterView>>>,
}

impl Registry {
    fn publish(&mut self) {
        let view = Arc::new(self.view.clone());
        self.watchers
            .retain(|w| w.send(view.clone()).is_ok() || w.receiver_count() > 0);
    }
}

impl InProcessRegistry {
    /// A new, empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A manager for one node of this registry.
    pub fn manager(&self) -> InProcessManager {
        let mut r = self.inner.lock();
        let mut view = r.view.clone();
        view.connected = true;
        let (tx, rx) = watch::channel(Arc::new(view));
        r.watchers.push(tx);
        InProcessManager {
            registry: self.clone(),
            rx,
            node: Mutex::new(None),
        }
    }
}

/// One node's handle on an [`InProcessRegistry`].
pub struct InProcessManager {
    registry: InProcessRegistry,
    rx: watch::Receiver<Arc<ClusterView>>,
    node: Mutex<Option<String>>,
}

impl InProcessManager {
    fn with_node<T>(&self, f: impl FnOnce(&mut ClusterView, &str) -> T) -> Result<T, ManagerError> {
        let node = self.node.lock().clone().ok_or(ManagerError::Stopped)?;
        let mut r = self.registry.inner.lock();
        let out = f(&mut r.view, &node);
        r.publish();
        Ok(out)
    }
}

impl ClusterManager for InProcessManager {
    fn join(&self, node: NodeInfo) -> BoxFuture<'_, Result<(), ManagerError>> {
        Box::pin(async move {
            check_node_id(&node.id)?;
            *self.node.lock() = Some(node.id.clone());
            let mut r = self.registry.inner.lock();
            r.view.connected = true;
            r.view.members.insert(node.id, node.addr);
            r.publish();
            Ok(())
        })
    }

    fn leave(&self) -> BoxFuture<'_, Result<(), ManagerError>> {
        Box::pin(async move {
            let r = self.with_node(|v, node| {
                v.members.remove(node);
                for subs in v.subscriptions.values_mut() {
                    subs.remove(node);
                }
                v.subscriptions.retain(|_, s| !s.is_empty());
            });
            *self.node.lock() = None;
            r
        })
    }

    fn subscribe(&self, address: &str, consumers: u32) -> BoxFuture<'_, Result<(), ManagerError>> {
        let address = address.to_owned();
        Box::pin(async move {
            self.with_node(|v, node| {
                v.subscriptions
                    .entry(address)
                    .or_default()
                    .insert(node.to_owned(), consumers.max(1));
            })
        })
    }

    fn unsubscribe(&self, address: &str) -> BoxFuture<'_, Result<(), ManagerError>> {
        let address = address.to_owned();
        Box::pin(async move {
            self.with_node(|v, node| {
                if let Some(s) = v.subscriptions.get_mut(&address) {
                    s.remove(node);
                    if s.is_empty() {
                        v.subscriptions.remove(&address);
                    }
                }
            })
        })
    }

    fn view(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.rx.clone()
    }
}

impl InProcessRegistry {
    /// Drops a node from the registry as if its lease had expired (for tests
    /// of node loss).
    pub fn expire(&self, node: &str) {
        let mut r = self.inner.lock();
        r.view.members.remove(node);
        for subs in r.view.subscriptions.values_mut() {
            subs.remove(node);
        }
        r.view.subscriptions.retain(|_, s| !s.is_empty());
        r.publish();
    }

    /// A snapshot of the shared view.
    pub fn snapshot(&self) -> ClusterView {
        self.inner.lock().view.clone()
    }
}
