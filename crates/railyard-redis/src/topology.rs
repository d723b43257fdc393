//! Cluster views (`CLUSTER NODES` text), their fingerprints, the consensus
//! rule, and the slot table commands route with.
//!
//! Everything here is plain synchronous code with no I/O: the refresher runs
//! it on a blocking thread, never on a connection task.
//!
//! # Cost
//! - [`fingerprint`]: one pass over the text, no allocation. `CLUSTER NODES`
//!   lists nodes in each node's own hash-table order and carries volatile
//!   fields (ping/pong times, link state, the `myself` flag, the node's own
//!   migrating/importing markers), so the fingerprint hashes each line's
//!   stable fields and adds the line hashes up: the same topology seen from
//!   any node gives the same number.
//! - [`parse_nodes`]: O(lines + slot ranges).
//! - [`build_table`]: O(views x 16384 + nodes), with views capped (a handful).
//!
//! # Consensus rule (when views disagree)
//! Redis Cluster's own rule: for every slot, the master claiming it with the
//! highest config epoch wins (a failover or a finished migration bumps the
//! epoch of the new owner). Ties go to the claim seen by more nodes (votes),
//! then to the smaller node id so every client picks the same. A master that
//! the view itself flags `fail` claims with the lowest priority: its slots
//! stay routed to it only while nothing else claims them. Replicas of the
//! chosen master come from the most-voted view that lists that master;
//! replicas flagged `fail` or without an address are left out.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use bytes::Bytes;

use crate::slot::SLOTS;

/// Marks a slot no node serves.
const UNCOVERED: u16 = u16::MAX;

/// One node as a view describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewNode {
    /// The node id (40 hex characters in Redis).
    pub id: Arc<str>,
    /// `ip:port` clients connect to; `None` for `noaddr` nodes.
    pub addr: Option<Arc<str>>,
    /// Master (else replica).
    pub master: bool,
    /// Flagged `fail` (by the cluster's agreement, not a local `fail?`).
    pub failed: bool,
    /// The master's id, for replicas.
    pub master_id: Option<Arc<str>>,
    /// Config epoch.
    pub epoch: u64,
    /// Slot ranges served, inclusive.
    pub slots: Vec<(u16, u16)>,
}

/// One node's view of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct View {
    /// Every node listed.
    pub nodes: Vec<ViewNode>,
}

fn line_fields(line: &[u8]) -> impl Iterator<Item = &[u8]> {
    line.split(|&b| b == b' ').filter(|f| !f.is_empty())
}

/// The order-independent fingerprint of a `CLUSTER NODES` reply.
///
/// Per line it hashes: id and address, the flags without `myself` and
/// `fail?`, the master id, the config epoch, and the slot ranges without the
/// node's own `[slot->-id]` markers; the line hashes are summed.
///
/// # Errors
/// A line with fewer than 8 fields.
pub fn fingerprint(text: &[u8]) -> Result<u64, String> {
    let state = foldhash::quality::FixedState::with_seed(0x5241_494c_5941_5244);
    let mut sum: u64 = 0;
    let mut lines: u64 = 0;
    let mut scratch: Vec<u8> = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let end_of_line = memchr::memchr(b'\n', &text[start..]).map_or(text.len(), |i| start + i);
        let line = &text[start..end_of_line];
        start = end_of_line + 1;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            continue;
        }
        // Start of each of the first 8 fields, and where the slots begin.
        let mut bounds = [0usize; 9];
        let mut field = 1;
        for i in memchr::memchr_iter(b' ', line) {
            bounds[field] = i + 1;
            field += 1;
            if field == 9 {
                break;
            }
        }
        if field < 8 {
            return Err(format!(
                "line {} has {field} fields, expected at least 8",
                lines + 1
            ));
        }
        let end = |k: usize| {
            if k + 1 < field {
                bounds[k + 1] - 1
            } else {
                line.len()
            }
        };
        let f = |k: usize| &line[bounds[k]..end(k)];
        let mut h = state.build_hasher();
        // id and address in one go
        h.write(&line[..end(1)]);
        h.write_u8(0xff);
        let flags = f(2);
        if flags.starts_with(b"myself") || flags.windows(5).any(|w| w == b"fail?") {
            scratch.clear();
            for flag in flags.split(|&b| b == b',') {
                if flag != b"myself" && flag != b"fail?" {
                    if !scratch.is_empty() {
                        scratch.push(b',');
                    }
                    scratch.extend_from_slice(flag);
                }
            }
            h.write(&scratch);
        } else {
            h.write(flags);
        }
        h.write_u8(0xff);
        h.write(f(3));
        h.write_u8(0xff);
        h.write(f(6));
        h.write_u8(0xff);
        if field == 9 {
            let tail = &line[bounds[8]..];
            if memchr::memchr(b'[', tail).is_some() {
                // Only the node itself lists its [slot->-id] migrations.
                scratch.clear();
                for t in tail
                    .split(|&b| b == b' ')
                    .filter(|t| !t.is_empty() && t[0] != b'[')
                {
                    if !scratch.is_empty() {
                        scratch.push(b' ');
                    }
                    scratch.extend_from_slice(t);
                }
                h.write(&scratch);
            } else {
                h.write(tail.trim_ascii_end());
            }
        }
        // Each line's hash is finished (mixed) before the order-independent sum.
        sum = sum.wrapping_add(h.finish());
        lines += 1;
    }
    if lines == 0 {
        return Err("empty reply".into());
    }
    Ok(sum ^ lines.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

fn parse_u16(f: &[u8]) -> Option<u16> {
    std::str::from_utf8(f).ok()?.parse().ok()
}

/// Normalizes `ip:port@cport[,hostname]` to a connectable `ip:port`.
fn parse_addr(f: &[u8]) -> Result<Option<Arc<str>>, String> {
    let s = std::str::from_utf8(f).map_err(|_| "address is not UTF-8".to_owned())?;
    let s = s.split(',').next().unwrap_or(s);
    let s = s.split('@').next().unwrap_or(s);
    let Some((ip, port)) = s.rsplit_once(':') else {
        return Err(format!("address `{s}` has no port"));
    };
    let port: u16 = port.parse().map_err(|_| format!("bad port in `{s}`"))?;
    if ip.is_empty() || port == 0 {
        return Ok(None);
    }
    Ok(Some(if ip.contains(':') && !ip.starts_with('[') {
        format!("[{ip}]:{port}").into()
    } else {
        s.into()
    }))
}

/// Parses a `CLUSTER NODES` reply.
///
/// # Errors
/// A description of the first malformed line.
pub fn parse_nodes(text: &[u8]) -> Result<View, String> {
    let mut nodes = Vec::with_capacity(text.len() / 100 + 1);
    for (no, line) in text.split(|&b| b == b'\n').enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            continue;
        }
        let err = |what: &str| format!("line {}: {what}", no + 1);
        let fields: Vec<&[u8]> = line_fields(line).collect();
        if fields.len() < 8 {
            return Err(err("fewer than 8 fields"));
        }
        let id: Arc<str> = std::str::from_utf8(fields[0])
            .map_err(|_| err("node id is not UTF-8"))?
            .into();
        let addr = parse_addr(fields[1]).map_err(|e| err(&e))?;
        let mut master = false;
        let mut failed = false;
        let mut noaddr = false;
        for flag in fields[2].split(|&b| b == b',') {
            match flag {
                b"master" => master = true,
                b"fail" => failed = true,
                b"noaddr" | b"handshake" => noaddr = true,
                _ => {}
            }
        }
        let master_id = match fields[3] {
            b"-" => None,
            m => Some(Arc::from(
                std::str::from_utf8(m).map_err(|_| err("master id is not UTF-8"))?,
            )),
        };
        let epoch = std::str::from_utf8(fields[6])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| err("config epoch is not a number"))?;
        let mut slots = Vec::new();
        for f in &fields[8..] {
            if f.first() == Some(&b'[') {
                continue;
            }
            let range = match f.iter().position(|&b| b == b'-') {
                Some(dash) => (parse_u16(&f[..dash]), parse_u16(&f[dash + 1..])),
                None => (parse_u16(f), parse_u16(f)),
            };
            match range {
                (Some(a), Some(b)) if a <= b && usize::from(b) < SLOTS => slots.push((a, b)),
                _ => return Err(err("bad slot range")),
            }
        }
        nodes.push(ViewNode {
            id,
            addr: if noaddr { None } else { addr },
            master,
            failed,
            master_id,
            epoch,
            slots,
        });
    }
    if nodes.is_empty() {
        return Err("empty reply".into());
    }
    Ok(View { nodes })
}

/// One distinct view and how many nodes reported it.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The parsed view.
    pub view: View,
    /// Nodes whose reply had this view's fingerprint.
    pub votes: usize,
    /// Its fingerprint.
    pub fingerprint: u64,
}

/// A master and the replicas that serve its slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The master's id.
    pub master_id: Arc<str>,
    /// The master's `ip:port`.
    pub master: Arc<str>,
    /// Healthy replicas' `ip:port`.
    pub replicas: Vec<Arc<str>>,
}

/// The routing table: slot -> shard, plus every known node.
///
/// Immutable once built; the client swaps a whole new one in atomically.
#[derive(Debug, Clone)]
pub struct SlotTable {
    slots: Box<[u16]>,
    shards: Vec<Shard>,
    nodes: Vec<Arc<str>>,
    fingerprints: Vec<u64>,
}

impl SlotTable {
    /// A table that routes nothing (before the first refresh).
    pub fn empty() -> Self {
        Self {
            slots: vec![UNCOVERED; SLOTS].into_boxed_slice(),
            shards: Vec::new(),
            nodes: Vec::new(),
            fingerprints: Vec::new(),
        }
    }

    /// The shard serving `slot`.
    pub fn shard(&self, slot: u16) -> Option<&Shard> {
        let i = *self.slots.get(usize::from(slot))?;
        self.shards.get(usize::from(i))
    }

    /// Every shard.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Every node with an address (masters and replicas), sorted.
    pub fn nodes(&self) -> &[Arc<str>] {
        &self.nodes
    }

    /// Whether `addr` is a node of this table.
    pub fn knows(&self, addr: &str) -> bool {
        self.nodes.binary_search_by(|n| (**n).cmp(addr)).is_ok()
    }

    /// Fingerprints of the views this table was built from: a view with one
    /// of these needs no new table.
    pub fn fingerprints(&self) -> &[u64] {
        &self.fingerprints
    }

    /// Slots with no owner.
    pub fn uncovered(&self) -> usize {
        self.slots.iter().filter(|&&s| s == UNCOVERED).count()
    }

    /// Heap bytes this table holds (for the retained-memory figure).
    pub fn heap_bytes(&self) -> usize {
        let strs: usize = self
            .shards
            .iter()
            .map(|s| {
                s.master_id.len()
                    + s.master.len()
                    + s.replicas.iter().map(|r| r.len() + 16).sum::<usize>()
                    + s.replicas.capacity() * 8
                    + 32
            })
            .sum();
        self.slots.len() * 2
            + self.shards.capacity() * std::mem::size_of::<Shard>()
            + strs
            + self.nodes.capacity() * 16
            + self.fingerprints.capacity() * 8
    }
}

/// Builds the slot table from one or more distinct views by the consensus
/// rule in the module docs.
pub fn build_table(candidates: &[Candidate]) -> SlotTable {
    // Per slot: (failed-last priority, epoch, votes, candidate, node index).
    #[derive(Clone, Copy)]
    struct Claim {
        key: (bool, u64, usize),
        cand: u32,
        node: u32,
    }
    let mut best: Vec<Option<Claim>> = vec![None; SLOTS];
    for (ci, c) in candidates.iter().enumerate() {
        for (ni, n) in c.view.nodes.iter().enumerate() {
            if !n.master || n.addr.is_none() {
                continue;
            }
            let key = (!n.failed, n.epoch, c.votes);
            for &(a, b) in &n.slots {
                for slot in &mut best[usize::from(a)..=usize::from(b)] {
                    let better = match slot {
                        None => true,
                        Some(cur) => {
                            let cur_id =
                                &candidates[cur.cand as usize].view.nodes[cur.node as usize].id;
                            key > cur.key || (key == cur.key && n.id < *cur_id)
                        }
                    };
                    if better {
                        *slot = Some(Claim {
                            key,
                            cand: ci as u32,
                            node: ni as u32,
                        });
                    }
                }
            }
        }
    }
    // Most-voted view first: replicas come from the first view listing a master.
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(candidates[i].votes));

    let mut shard_of: HashMap<Arc<str>, u16, foldhash::fast::RandomState> = HashMap::default();
    let mut shards: Vec<Shard> = Vec::new();
    let mut slots = vec![UNCOVERED; SLOTS].into_boxed_slice();
    for (s, claim) in best.iter().enumerate() {
        let Some(claim) = claim else { continue };
        let node = &candidates[claim.cand as usize].view.nodes[claim.node as usize];
        let idx = match shard_of.get(&node.id) {
            Some(&i) => i,
            None => {
                let i = shards.len() as u16;
                let replicas = order
                    .iter()
                    .map(|&ci| &candidates[ci].view)
                    .find(|v| v.nodes.iter().any(|m| m.master && m.id == node.id))
                    .map(|v| {
                        v.nodes
                            .iter()
                            .filter(|r| {
                                !r.master && !r.failed && r.master_id.as_deref() == Some(&*node.id)
                            })
                            .filter_map(|r| r.addr.clone())
                            .collect()
                    })
                    .unwrap_or_default();
                shards.push(Shard {
                    master_id: node.id.clone(),
                    master: node.addr.clone().unwrap_or_else(|| "".into()),
                    replicas,
                });
                shard_of.insert(node.id.clone(), i);
                i
            }
        };
        slots[s] = idx;
    }
    let mut nodes: Vec<Arc<str>> = candidates
        .iter()
        .flat_map(|c| c.view.nodes.iter())
        .filter(|n| !n.failed)
        .filter_map(|n| n.addr.clone())
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    let mut fingerprints: Vec<u64> = candidates.iter().map(|c| c.fingerprint).collect();
    fingerprints.sort_unstable();
    fingerprints.dedup();
    SlotTable {
        slots,
        shards,
        nodes,
        fingerprints,
    }
}

/// Votes for one fingerprint, and the first reply that had it.
type Group = (usize, Arc<str>, Bytes);

/// At most this many distinct views are parsed in one refresh (the most voted).
pub const MAX_VIEWS: usize = 8;

/// Collects the replies of one full refresh: fingerprints each as it arrives
/// (no allocation per reply beyond keeping the first of each fingerprint),
/// then parses the few distinct views and builds the table.
#[derive(Debug, Default)]
pub struct ViewTally {
    groups: HashMap<u64, Group, foldhash::fast::RandomState>,
    views: u64,
    error: Option<(Arc<str>, String)>,
}

/// What [`ViewTally::finish`] built.
#[derive(Debug)]
pub struct Tallied {
    /// The new table.
    pub table: SlotTable,
    /// Replies fingerprinted.
    pub views: u64,
    /// Distinct fingerprints among them.
    pub distinct: u64,
}

impl ViewTally {
    /// Adds `node`'s reply.
    pub fn add(&mut self, node: Arc<str>, text: Bytes) {
        match fingerprint(&text) {
            Ok(fp) => {
                self.views += 1;
                self.groups.entry(fp).or_insert((0, node, text)).0 += 1;
            }
            Err(e) => self.error = Some((node, e)),
        }
    }

    /// Builds the table from the most-voted distinct views.
    ///
    /// # Errors
    /// `(node, detail)` of the last unusable reply when no view was usable.
    pub fn finish(self) -> Result<Tallied, (Arc<str>, String)> {
        let distinct = self.groups.len() as u64;
        let mut last_err = self.error;
        let mut ranked: Vec<(u64, Group)> = self.groups.into_iter().collect();
        ranked.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(&b.0)));
        ranked.truncate(MAX_VIEWS);
        let mut candidates = Vec::with_capacity(ranked.len());
        for (fp, (votes, node, text)) in ranked {
            match parse_nodes(&text) {
                Ok(view) => candidates.push(Candidate {
                    view,
                    votes,
                    fingerprint: fp,
                }),
                Err(detail) => last_err = Some((node, detail)),
            }
        }
        if candidates.is_empty() {
            return Err(last_err.unwrap_or_else(|| ("-".into(), "no node answered".into())));
        }
        Ok(Tallied {
            table: build_table(&candidates),
            views: self.views,
            distinct,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004,host-a slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 127.0.0.1:30003@31003 master - 0 1426238318243 3 connected 10923-16383
6ec23923021cf3ffec47632106199cb7f496ce01 127.0.0.1:30005@31005 slave 67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 0 1426238316232 5 connected
824fe116063bc5fcf9f4ffd895bc17aee7731ac3 127.0.0.1:30006@31006 slave 292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 0 1426238317741 6 connected
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001 myself,master - 0 0 1 connected 0-5460 [5460->-67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1]
";

    fn reorder_as_other_node(text: &str) -> String {
        // Another node's reply: other order, other timestamps, `myself` elsewhere.
        let mut lines: Vec<String> = text
            .lines()
            .map(|l| {
                let mut f: Vec<String> = l.split(' ').map(str::to_owned).collect();
                f[2] = f[2].replace("myself,", "");
                f[4] = "1426238399999".into();
                f[5] = "1426238399000".into();
                f.retain(|x| !x.starts_with('['));
                f.join(" ")
            })
            .collect();
        lines.reverse();
        lines[0] = lines[0].replacen(" master ", " myself,master ", 1);
        lines.join("\n") + "\n"
    }

    #[test]
    fn fingerprint_ignores_order_and_volatile_fields() {
        let a = fingerprint(A.as_bytes()).unwrap();
        let b = fingerprint(reorder_as_other_node(A).as_bytes()).unwrap();
        assert_eq!(a, b);
        let moved = A
            .replace("0-5460", "0-5459")
            .replace("5461-10922", "5460-10922");
        assert_ne!(a, fingerprint(moved.as_bytes()).unwrap());
        assert!(fingerprint(b"short line\n").is_err());
        // A node's local suspicion (fail?) is not part of the agreed topology; fail is.
        let pfail = A.replace(" slave 67ed", " slave,fail? 67ed");
        assert_eq!(a, fingerprint(pfail.as_bytes()).unwrap());
        let failed = A.replace(" slave 67ed", " slave,fail 67ed");
        assert_ne!(a, fingerprint(failed.as_bytes()).unwrap());
    }

    #[test]
    fn a_single_view_builds_its_table() {
        let v = parse_nodes(A.as_bytes()).unwrap();
        assert_eq!(v.nodes.len(), 6);
        let t = build_table(&[Candidate {
            view: v,
            votes: 1,
            fingerprint: 1,
        }]);
        assert_eq!(t.uncovered(), 0);
        assert_eq!(&*t.shard(0).unwrap().master, "127.0.0.1:30001");
        assert_eq!(&*t.shard(5461).unwrap().master, "127.0.0.1:30002");
        assert_eq!(&*t.shard(16383).unwrap().master, "127.0.0.1:30003");
        assert_eq!(
            t.shard(0).unwrap().replicas,
            vec![Arc::<str>::from("127.0.0.1:30004")]
        );
        assert_eq!(t.nodes().len(), 6);
        assert!(t.knows("127.0.0.1:30006"));
    }

    #[test]
    fn the_highest_epoch_wins_a_disputed_slot() {
        let old = parse_nodes(A.as_bytes()).unwrap();
        // The new view: 30002's slots 5461-6000 went to 30003 at epoch 7.
        let newer = A.replace("5461-10922", "6001-10922").replace(
            "3 connected 10923-16383",
            "7 connected 5461-6000 10923-16383",
        );
        let new = parse_nodes(newer.as_bytes()).unwrap();
        let t = build_table(&[
            Candidate {
                view: old,
                votes: 5,
                fingerprint: 1,
            },
            Candidate {
                view: new,
                votes: 1,
                fingerprint: 2,
            },
        ]);
        assert_eq!(&*t.shard(5500).unwrap().master, "127.0.0.1:30003");
        assert_eq!(&*t.shard(7000).unwrap().master, "127.0.0.1:30002");
        assert_eq!(t.fingerprints(), &[1, 2]);
        assert_eq!(t.uncovered(), 0);
    }

    #[test]
    fn malformed_views_are_errors() {
        assert!(parse_nodes(b"").is_err());
        assert!(parse_nodes(b"id 127.0.0.1:1@2 master - 0 0 x connected 0-1\n").is_err());
        assert!(parse_nodes(b"id 127.0.0.1:1@2 master - 0 0 1 connected 9-2\n").is_err());
        assert!(parse_nodes(b"id 127.0.0.1:1@2 master - 0 0 1 connected 0-99999\n").is_err());
    }
}
