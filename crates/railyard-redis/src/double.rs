//! A test double for big clusters: one process listening on many loopback
//! ports, answering like an `M`-master, `M x R`-replica Redis Cluster.
//!
//! Each port is a node with its own view of the topology (normally all share
//! one), so tests can make views disagree ([`ClusterDouble::apply`] to a
//! subset of nodes) or move slots. It serves `PING`, `CLUSTER
//! NODES|SLOTS|SHARDS|INFO|MYID`, `INFO`, `GET`, `SET`, `DEL`, `INCR`,
//! `READONLY`/`READWRITE`/`ASKING`, `CLIENT ...` and answers `MOVED` for keys
//! whose slot the node does not serve in its own view. Unknown commands get
//! `-ERR unknown command` (so clients fall back from `HELLO 3` to RESP2).
//!
//! It is not Redis: one shared key space, no expiry, no persistence. It
//! exists because a real 1000-node cluster does not fit on one small machine.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::{Mutex, RwLock};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::slot::{key_slot, SLOTS};
use crate::value::{Protocol, Reply, ReplyDecoder, Value, DEFAULT_MAX_REPLY_SIZE};

/// One node of the double's topology.
#[derive(Debug, Clone)]
pub struct DoubleNode {
    /// 40-hex-digit id.
    pub id: String,
    /// Its port.
    pub port: u16,
    /// For a replica, the index of its master.
    pub master_of: Option<usize>,
    /// Config epoch.
    pub epoch: u64,
}

/// One topology: who is master, who serves which slot.
#[derive(Debug, Clone)]
pub struct Topology {
    /// Every node.
    pub nodes: Vec<DoubleNode>,
    /// Slot -> index of the serving master.
    pub owner: Vec<u16>,
}

impl Topology {
    /// `masters` masters on the first ports, the rest replicas spread over
    /// them; slots split evenly; epochs 1..=n.
    pub fn generate(masters: usize, ports: &[u16]) -> Self {
        let masters = masters.max(1);
        let nodes = ports
            .iter()
            .enumerate()
            .map(|(i, &port)| DoubleNode {
                id: format!("{:040x}", 0xd0_0b1e_0000_u64 + i as u64),
                port,
                master_of: (i >= masters).then(|| (i - masters) % masters),
                epoch: i as u64 + 1,
            })
            .collect();
        let owner = (0..SLOTS).map(|s| (s * masters / SLOTS) as u16).collect();
        Self { nodes, owner }
    }

    /// Moves `slots` (inclusive range) to master `to`, bumping its epoch
    /// above every other (as a finished migration does).
    pub fn move_slots(&mut self, from: u16, to_slot: u16, to: usize) {
        let max = self.nodes.iter().map(|n| n.epoch).max().unwrap_or(0);
        self.nodes[to].epoch = max + 1;
        for s in from..=to_slot {
            self.owner[usize::from(s)] = to as u16;
        }
    }

    /// Makes replica `r` the master of its master's slots (a failover).
    pub fn promote(&mut self, r: usize) {
        let Some(m) = self.nodes[r].master_of else {
            return;
        };
        let max = self.nodes.iter().map(|n| n.epoch).max().unwrap_or(0);
        self.nodes[r].master_of = None;
        self.nodes[r].epoch = max + 1;
        self.nodes[m].master_of = Some(r);
        for o in &mut self.owner {
            if usize::from(*o) == m {
                *o = r as u16;
            }
        }
        for n in &mut self.nodes {
            if n.master_of == Some(m) {
                n.master_of = Some(r);
            }
        }
        self.nodes[r].master_of = None;
    }

    /// Every node's slot ranges, in one pass over the slots.
    fn all_slot_ranges(&self) -> Vec<Vec<(u16, u16)>> {
        let mut out: Vec<Vec<(u16, u16)>> = vec![Vec::new(); self.nodes.len()];
        for (s, &o) in self.owner.iter().enumerate() {
            let s = s as u16;
            let r = &mut out[usize::from(o)];
            match r.last_mut() {
                Some((_, b)) if *b + 1 == s => *b = s,
                _ => r.push((s, s)),
            }
        }
        out
    }
}

struct Rendered {
    topo: Topology,
    /// `CLUSTER NODES` line of each node, without and with `myself`.
    lines: Vec<(Bytes, Bytes)>,
}

impl Rendered {
    fn new(topo: Topology) -> Arc<Self> {
        let ranges = topo.all_slot_ranges();
        let lines = (0..topo.nodes.len())
            .map(|i| {
                let n = &topo.nodes[i];
                let role = if n.master_of.is_some() {
                    "slave"
                } else {
                    "master"
                };
                let master = n
                    .master_of
                    .map_or_else(|| "-".to_owned(), |m| topo.nodes[m].id.clone());
                let mut slots = String::new();
                if n.master_of.is_none() {
                    for &(a, b) in &ranges[i] {
                        if a == b {
                            let _ = write!(slots, " {a}");
                        } else {
                            let _ = write!(slots, " {a}-{b}");
                        }
                    }
                }
                let line = |flags: &str| {
                    Bytes::from(format!(
                        "{} 127.0.0.1:{}@{} {flags} {master} 0 1700000000000 {} connected{slots}\n",
                        n.id,
                        n.port,
                        u32::from(n.port) + 10000,
                        n.epoch
                    ))
                };
                (line(role), line(&format!("myself,{role}")))
            })
            .collect();
        Arc::new(Self { topo, lines })
    }

    fn cluster_nodes(&self, me: usize) -> Bytes {
        let n = self.lines.len();
        let mut out = BytesMut::with_capacity(self.lines.iter().map(|l| l.1.len()).sum());
        // Each node lists the others in its own order, as real nodes do.
        for k in 0..n {
            let j = (me + k) % n;
            out.put_slice(if j == me {
                &self.lines[j].1
            } else {
                &self.lines[j].0
            });
        }
        out.freeze()
    }
}

struct State {
    /// Each node's current view (usually one shared `Arc`).
    views: RwLock<Vec<Arc<Rendered>>>,
    /// Key commands (GET/SET/DEL/INCR) each node served (not redirected).
    served: Vec<std::sync::atomic::AtomicU64>,
    store: Mutex<HashMap<Bytes, Bytes>>,
}

/// A running double. Dropping it closes every port.
pub struct ClusterDouble {
    state: Arc<State>,
    ports: Vec<u16>,
    _tasks: JoinSet<()>,
}

impl std::fmt::Debug for ClusterDouble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterDouble")
            .field("nodes", &self.ports.len())
            .finish()
    }
}

impl ClusterDouble {
    /// Starts `masters * (1 + replicas)` nodes on loopback: on `base_port..`
    /// if given, else on ports the OS picks.
    ///
    /// # Errors
    /// When a port cannot be bound.
    pub async fn start(
        masters: usize,
        replicas: usize,
        base_port: Option<u16>,
    ) -> std::io::Result<Self> {
        let n = masters * (1 + replicas);
        let mut listeners = Vec::with_capacity(n);
        for i in 0..n {
            let port = base_port.map_or(0, |b| b + i as u16);
            listeners.push(TcpListener::bind(("127.0.0.1", port)).await?);
        }
        let ports: Vec<u16> = listeners
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect::<Result<_, _>>()?;
        let r = Rendered::new(Topology::generate(masters, &ports));
        let state = Arc::new(State {
            views: RwLock::new(vec![r; n]),
            served: (0..n)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
            store: Mutex::new(HashMap::new()),
        });
        let mut tasks = JoinSet::new();
        for (i, l) in listeners.into_iter().enumerate() {
            let state = state.clone();
            tasks.spawn(async move {
                loop {
                    let Ok((sock, _)) = l.accept().await else {
                        continue;
                    };
                    let _ = sock.set_nodelay(true);
                    tokio::spawn(serve(sock, i, state.clone()));
                }
            });
        }
        Ok(Self {
            state,
            ports,
            _tasks: tasks,
        })
    }

    /// `127.0.0.1:port` of every node (masters first).
    pub fn addrs(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect()
    }

    /// The topology node `i` currently reports.
    pub fn topology(&self, i: usize) -> Topology {
        self.state.views.read()[i].topo.clone()
    }

    /// Gives the nodes in `to` (all when `None`) the topology `t`.
    pub fn apply(&self, t: Topology, to: Option<&[usize]>) {
        let r = Rendered::new(t);
        let mut v = self.state.views.write();
        match to {
            None => v.iter_mut().for_each(|x| *x = r.clone()),
            Some(ix) => ix.iter().for_each(|&i| v[i] = r.clone()),
        }
    }

    /// Key commands node `i` served itself (not redirected).
    pub fn served(&self, i: usize) -> u64 {
        self.state.served[i].load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The rendered `CLUSTER NODES` reply of node `i` (for benches).
    pub fn cluster_nodes_text(&self, i: usize) -> Bytes {
        self.state.views.read()[i].cluster_nodes(i)
    }
}

/// The `CLUSTER NODES` reply node `me` of a generated topology would give,
/// without opening any port (for benches): `masters * (1 + replicas)` nodes
/// on ports 30000...
pub fn synthetic_cluster_nodes(masters: usize, replicas: usize, me: usize) -> Bytes {
    let ports: Vec<u16> = (0..masters * (1 + replicas))
        .map(|i| 30000 + i as u16)
        .collect();
    Rendered::new(Topology::generate(masters, &ports)).cluster_nodes(me)
}

fn bulk(out: &mut BytesMut, b: &[u8]) {
    out.put_slice(format!("${}\r\n", b.len()).as_bytes());
    out.put_slice(b);
    out.put_slice(b"\r\n");
}

async fn serve(mut sock: TcpStream, me: usize, state: Arc<State>) {
    let mut rbuf = BytesMut::with_capacity(4096);
    let mut requests = ReplyDecoder::new(Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE);
    let mut out = BytesMut::with_capacity(4096);
    let mut readonly = false;
    loop {
        match sock.read_buf(&mut rbuf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        loop {
            let request = match requests.next_reply(&mut rbuf) {
                Ok(Some(Reply::Value(v))) => Ok(v),
                // A command of hundreds of arguments, too long to decode
                // on this task.
                Ok(Some(Reply::Framed(f))) => f
                    .decode_on_blocking_pool()
                    .await
                    .unwrap_or_else(|| Err("shutting down".to_owned())),
                Ok(None) => break,
                Err(e) => Err(e),
            };
            let args = match request {
                Ok(Value::Array(a)) => a,
                _ => {
                    let _ = sock.write_all(b"-ERR protocol error\r\n").await;
                    return;
                }
            };
            let args: Vec<Bytes> = args
                .into_iter()
                .filter_map(|v| v.as_bytes().cloned())
                .collect();
            answer(&args, me, &state, &mut readonly, &mut out);
        }
        if !out.is_empty() && sock.write_all(&out.split()).await.is_err() {
            return;
        }
    }
}

fn answer(args: &[Bytes], me: usize, state: &State, readonly: &mut bool, out: &mut BytesMut) {
    let Some(name) = args.first() else {
        out.put_slice(b"-ERR empty command\r\n");
        return;
    };
    let name = String::from_utf8_lossy(name).to_ascii_uppercase();
    let sub = args
        .get(1)
        .map(|s| String::from_utf8_lossy(s).to_ascii_uppercase())
        .unwrap_or_default();
    let view = state.views.read()[me].clone();
    let topo = &view.topo;
    match (name.as_str(), sub.as_str()) {
        ("PING", _) => out.put_slice(b"+PONG\r\n"),
        ("READONLY", _) => {
            *readonly = true;
            out.put_slice(b"+OK\r\n");
        }
        ("READWRITE", _) => {
            *readonly = false;
            out.put_slice(b"+OK\r\n");
        }
        ("ASKING", _) | ("SELECT", _) | ("CLIENT", _) => out.put_slice(b"+OK\r\n"),
        ("COMMAND", _) => out.put_slice(b"*0\r\n"),
        ("CLUSTER", "NODES") => bulk(out, &view.cluster_nodes(me)),
        ("CLUSTER", "MYID") => bulk(out, topo.nodes[me].id.as_bytes()),
        ("CLUSTER", "INFO") => {
            let masters = topo.nodes.iter().filter(|n| n.master_of.is_none()).count();
            bulk(
                out,
                format!(
                    "cluster_state:ok\r\ncluster_slots_assigned:16384\r\ncluster_slots_ok:16384\r\ncluster_slots_pfail:0\r\ncluster_slots_fail:0\r\ncluster_known_nodes:{}\r\ncluster_size:{masters}\r\ncluster_current_epoch:{}\r\ncluster_my_epoch:{}\r\n",
                    topo.nodes.len(),
                    topo.nodes.iter().map(|n| n.epoch).max().unwrap_or(0),
                    topo.nodes[me].epoch
                )
                .as_bytes(),
            );
        }
        ("CLUSTER", "SLOTS") | ("CLUSTER", "SHARDS") => {
            let shards = sub == "SHARDS";
            let masters: Vec<usize> = (0..topo.nodes.len())
                .filter(|&i| topo.nodes[i].master_of.is_none())
                .collect();
            let all_ranges = topo.all_slot_ranges();
            let mut entries = Vec::new();
            for &m in &masters {
                let reps: Vec<usize> = (0..topo.nodes.len())
                    .filter(|&r| topo.nodes[r].master_of == Some(m))
                    .collect();
                let ranges = all_ranges[m].clone();
                if shards {
                    entries.push((ranges, m, reps));
                } else {
                    for r in ranges {
                        entries.push((vec![r], m, reps.clone()));
                    }
                }
            }
            out.put_slice(format!("*{}\r\n", entries.len()).as_bytes());
            for (ranges, m, reps) in entries {
                let node = |out: &mut BytesMut, i: usize| {
                    let n = &topo.nodes[i];
                    if shards {
                        out.put_slice(b"*12\r\n");
                        bulk(out, b"id");
                        bulk(out, n.id.as_bytes());
                        bulk(out, b"port");
                        out.put_slice(format!(":{}\r\n", n.port).as_bytes());
                        bulk(out, b"ip");
                        bulk(out, b"127.0.0.1");
                        bulk(out, b"endpoint");
                        bulk(out, b"127.0.0.1");
                        bulk(out, b"role");
                        bulk(out, if n.master_of.is_some() { b"replica" } else { b"master" });
                        bulk(out, b"health");
                        bulk(out, b"online");
                    } else {
                        out.put_slice(b"*3\r\n");
                        bulk(out, b"127.0.0.1");
                        out.put_slice(format!(":{}\r\n", n.port).as_bytes());
                        bulk(out, n.id.as_bytes());
                    }
                };
                if shards {
                    out.put_slice(b"*4\r\n");
                    bulk(out, b"slots");
                    out.put_slice(format!("*{}\r\n", ranges.len() * 2).as_bytes());
                    for (a, b) in &ranges {
                        out.put_slice(format!(":{a}\r\n:{b}\r\n").as_bytes());
                    }
                    bulk(out, b"nodes");
                    out.put_slice(format!("*{}\r\n", 1 + reps.len()).as_bytes());
                } else {
                    let (a, b) = ranges[0];
                    out.put_slice(format!("*{}\r\n:{a}\r\n:{b}\r\n", 3 + reps.len()).as_bytes());
                }
                node(out, m);
                for r in reps {
                    node(out, r);
                }
            }
        }
        ("INFO", _) => bulk(
            out,
            b"# Server\r\nredis_version:7.0.15\r\nredis_mode:cluster\r\n# Clients\r\nconnected_clients:1\r\n# Replication\r\nrole:master\r\n",
        ),
        ("GET" | "SET" | "DEL" | "INCR", _) if args.len() >= 2 => {
            let slot = key_slot(&args[1]);
            let owner = usize::from(topo.owner[usize::from(slot)]);
            let read = name == "GET";
            let serves = owner == me || (read && *readonly && topo.nodes[me].master_of == Some(owner));
            if !serves {
                out.put_slice(format!("-MOVED {slot} 127.0.0.1:{}\r\n", topo.nodes[owner].port).as_bytes());
                return;
            }
            state.served[me].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut store = state.store.lock();
            match name.as_str() {
                "GET" => match store.get(&args[1]) {
                    Some(v) => bulk(out, v),
                    None => out.put_slice(b"$-1\r\n"),
                },
                "SET" if args.len() >= 3 => {
                    store.insert(args[1].clone(), args[2].clone());
                    out.put_slice(b"+OK\r\n");
                }
                "DEL" => {
                    let n = args[1..].iter().filter(|k| store.remove(*k).is_some()).count();
                    out.put_slice(format!(":{n}\r\n").as_bytes());
                }
                "INCR" => {
                    let cur: i64 = store
                        .get(&args[1])
                        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
                        .unwrap_or(0);
                    store.insert(args[1].clone(), Bytes::from((cur + 1).to_string()));
                    out.put_slice(format!(":{}\r\n", cur + 1).as_bytes());
                }
                _ => out.put_slice(b"-ERR wrong number of arguments\r\n"),
            }
        }
        _ => out.put_slice(format!("-ERR unknown command '{name}'\r\n").as_bytes()),
    }
}
