//! The participant registry: which instances of which services are
//! connected, and the bounded outbound queue of each.
//!
//! Omega's `OnConnected` stream and the native `Session` each register one
//! [`Link`]. A compensation command goes to the instance that ran the
//! sub-transaction if it is connected, else to another live instance of the
//! same service (round-robin). Commands are queued with `try_send`, never
//! awaited: if an instance's queue is full the next instance is tried, and if
//! none can take it the saga polls again later (see `saga.rs`), so a slow
//! participant never blocks the engine. Many commands may be outstanding per
//! instance (up to its queue capacity plus what it is running).
//!
//! Lock order: an engine shard lock may be held while this registry's lock
//! is taken, never the other way round.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use railyard_saga_proto::native::{server_frame, Compensate, ServerFrame};
use railyard_saga_proto::omega::GrpcCompensateCommand;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tonic::Status;

use crate::saga::{Command, Route, RouteResult};

/// The outbound queue of one participant connection.
#[derive(Debug, Clone)]
pub(crate) enum Outbound {
    /// An Omega `OnConnected` response stream.
    Omega(mpsc::Sender<Result<GrpcCompensateCommand, Status>>),
    /// A native session's response stream (shared with its acks and with
    /// the session's other participants), and which participant of the
    /// session this link is.
    Native(mpsc::Sender<Result<ServerFrame, Status>>, u32),
}

enum Sent {
    Ok,
    Full,
    Closed,
}

impl Outbound {
    fn try_send(&self, cmd: Command) -> Sent {
        let r = match self {
            Outbound::Omega(tx) => tx
                .try_send(Ok(GrpcCompensateCommand {
                    global_tx_id: cmd.global_tx_id,
                    local_tx_id: cmd.local_tx_id,
                    parent_tx_id: cmd.parent_tx_id,
                    compensation_method: cmd.compensation_method,
                    payloads: cmd.payloads,
                }))
                .map_err(|e| matches!(e, TrySendError::Full(_))),
            Outbound::Native(tx, participant) => tx
                .try_send(Ok(ServerFrame {
                    kind: Some(server_frame::Kind::Compensate(Compensate {
                        global_tx_id: cmd.global_tx_id,
                        local_tx_id: cmd.local_tx_id,
                        parent_tx_id: cmd.parent_tx_id,
                        compensation_method: cmd.compensation_method,
                        payloads: cmd.payloads,
                        attempt: cmd.attempt,
                        participant: *participant,
                    })),
                }))
                .map_err(|e| matches!(e, TrySendError::Full(_))),
        };
        match r {
            Ok(()) => Sent::Ok,
            Err(true) => Sent::Full,
            Err(false) => Sent::Closed,
        }
    }

    fn is_closed(&self) -> bool {
        match self {
            Outbound::Omega(tx) => tx.is_closed(),
            Outbound::Native(tx, _) => tx.is_closed(),
        }
    }
}

/// One registered participant connection.
#[derive(Debug, Clone)]
struct Link {
    id: u64,
    instance: String,
    /// The client's socket address (Omega's links), to tell which link an
    /// `OnDisconnected` is about: instance ids are not unique (Omega's
    /// default is `service-IP`, shared by every JVM on a host).
    peer: Option<SocketAddr>,
    out: Outbound,
    /// Whether a command was ever queued on it: only such a link's end
    /// needs the walk that sends unanswered commands again.
    carried: Arc<AtomicBool>,
}

/// A connected instance, for the query API.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InstanceInfo {
    /// Its service.
    pub service_name: String,
    /// Its instance id.
    pub instance_id: String,
    /// `omega` or `native`.
    pub protocol: &'static str,
}

/// Every connected participant, by service.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    /// Links in registration order; the newest link of an instance wins.
    services: RwLock<HashMap<String, Vec<Link>>>,
    next_id: AtomicU64,
    /// Round-robin cursor for "another instance of the service".
    rr: AtomicUsize,
}

/// A registered link: its id and whether a command was ever queued on it.
pub(crate) type Registered = (u64, Arc<AtomicBool>);

impl Registry {
    /// Registers a connection; returns its id for [`unregister`](Self::unregister)
    /// and the flag that says whether a command was ever queued on it (kept
    /// by the connection's task: the link may leave the registry before the
    /// task sees its stream end, e.g. when a send finds it closed).
    pub(crate) fn register(
        &self,
        service: &str,
        instance: &str,
        peer: Option<SocketAddr>,
        out: Outbound,
    ) -> Registered {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let carried = Arc::<AtomicBool>::default();
        let mut g = self.services.write();
        let links = g.entry(service.to_owned()).or_default();
        links.retain(|l| !l.out.is_closed());
        links.push(Link {
            id,
            instance: instance.to_owned(),
            peer,
            out,
            carried: carried.clone(),
        });
        (id, carried)
    }

    /// Removes one connection (its stream ended).
    pub(crate) fn unregister(&self, id: u64) {
        self.unregister_all(&[id]);
    }

    /// Removes several connections (a native session's participants) in
    /// one pass over the registry.
    pub(crate) fn unregister_all(&self, ids: &[u64]) {
        let mut g = self.services.write();
        g.retain(|_, links| {
            links.retain(|l| !ids.contains(&l.id));
            !links.is_empty()
        });
    }

    /// Removes the connections of one instance that come from `peer`, the
    /// address `OnDisconnected` came from (Omega sends it on the channel
    /// that carries its `OnConnected` stream). Another process with the same
    /// instance id keeps its link. Without an address nothing is removed:
    /// the link goes when its stream ends. Returns the links removed.
    pub(crate) fn unregister_instance(
        &self,
        service: &str,
        instance: &str,
        peer: Option<SocketAddr>,
    ) -> Vec<Registered> {
        let mut removed = Vec::new();
        let Some(peer) = peer else { return removed };
        let mut g = self.services.write();
        if let Some(links) = g.get_mut(service) {
            links.retain(|l| {
                let gone = l.instance == instance && l.peer == Some(peer);
                if gone {
                    removed.push((l.id, l.carried.clone()));
                }
                !gone
            });
            if links.is_empty() {
                g.remove(service);
            }
        }
        removed
    }

    /// Drops every link (server shutdown).
    pub(crate) fn clear(&self) {
        self.services.write().clear();
    }

    /// Connected instances, for the query API.
    pub(crate) fn instances(&self) -> Vec<InstanceInfo> {
        let g = self.services.read();
        let mut out: Vec<InstanceInfo> = g
            .iter()
            .flat_map(|(svc, links)| {
                links.iter().map(move |l| InstanceInfo {
                    service_name: svc.clone(),
                    instance_id: l.instance.clone(),
                    protocol: match l.out {
                        Outbound::Omega(_) => "omega",
                        Outbound::Native(..) => "native",
                    },
                })
            })
            .collect();
        out.sort_by(|a, b| {
            (&a.service_name, &a.instance_id).cmp(&(&b.service_name, &b.instance_id))
        });
        out
    }

    /// Number of registered connections.
    pub(crate) fn len(&self) -> usize {
        self.services.read().values().map(Vec::len).sum()
    }
}

impl Route for Registry {
    fn send(&self, service: &str, preferred: &str, cmd: Command) -> RouteResult {
        let mut closed = Vec::new();
        let result = {
            let g = self.services.read();
            let Some(links) = g.get(service).filter(|l| !l.is_empty()) else {
                return RouteResult::NoInstance;
            };
            // The instance that ran it first (its newest link), then the
            // others starting at the round-robin cursor.
            let start = self.rr.fetch_add(1, Ordering::Relaxed);
            let n = links.len();
            let preferred_idx = links.iter().rposition(|l| l.instance == preferred);
            let order = preferred_idx.into_iter().chain(
                (0..n)
                    .map(|k| (start + k) % n)
                    .filter(|i| Some(*i) != preferred_idx),
            );
            let mut result = RouteResult::NoInstance;
            for i in order {
                match links[i].out.try_send(cmd.clone()) {
                    Sent::Ok => {
                        links[i].carried.store(true, Ordering::Relaxed);
                        result = RouteResult::Sent(links[i].id);
                        break;
                    }
                    Sent::Full => {}
                    Sent::Closed => closed.push(links[i].id),
                }
            }
            result
        };
        for id in closed {
            self.unregister(id);
        }
        result
    }
}
