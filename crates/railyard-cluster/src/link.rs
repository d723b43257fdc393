//! One long-lived connection per peer pair, owned by one task.
//!
//! A [`Link`] is the bus's [`RemoteNode`] for one peer. Senders never touch
//! the socket: `deliver` puts the message on the link's bounded queue and
//! returns. The link's task owns the connection: it dials (or waits for the
//! peer to dial, see [`Side`]), then writes queued messages in batches (one
//! `write_all` per batch, each body encoded with its codec on the way) and
//! reads the peer's frames: messages for local consumers, replies to our
//! requests, pings.
//!
//! Bounds: at most `queue` messages wait in a link's queue, and at most
//! `max_in_flight` requests are pending on it (queued or written, until the
//! peer's answer is read or the requester gives up: timeout or drop);
//! beyond the first `deliver` says `Full` to everything, beyond the second
//! to requests. The answers a node queues for its peer are bounded by the
//! reader: it stops taking requests from a connection while `max_in_flight`
//! plus [`PONG_SLACK`] answers for it wait to be written. Pausing readers
//! could deadlock two nodes flooding each other (both readers paused, both
//! writes blocked on full sockets); with the requester-side limit a peer's
//! unwritten answers stay under ours, so between Railyard nodes with the
//! same limit a pause needs more answers than requests in flight, which
//! only requests given up on (their late answers) can add.
//!
//! Failure rules:
//! - a malformed frame or a missed ping deadline closes this connection
//!   (the peer reconnects); every request waiting on it fails at once with
//!   `ERROR` instead of waiting for its timeout;
//! - the dialing side reconnects with exponential backoff (jittered) while the peer is
//!   a member (a connection the peer ends before sending anything, as when
//!   it refuses our HELLO, counts as a failed dial); messages queued
//!   meanwhile wait in the bounded queue;
//! - a link is *down* (not chosen: `deliver` refuses, so sends and requests
//!   go to the address's other targets) from a lost connection, a failed
//!   dial (dialing side) or `handshake_timeout` without the peer's
//!   connection (accepting side), until a connection is up; requests
//!   pending on it fail at once (`ERROR`). (Until 2026-11-28 a link that
//!   never connected was never down: a member whose address refused
//!   connections kept being chosen, and its requests waited for their
//!   timeout.)
//! - when the peer leaves the membership the link closes for good: queued
//!   and pending requests fail.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::BytesMut;
use parking_lot::Mutex;
use railyard_bus::{
    Body, BusError, CodecCache, DeliveryOptions, EventBus, Headers, RemoteKind, RemoteMessage,
    RemoteNode, ReplyHandle, ReplySink, RoomWaiters, Undelivered,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::frame::{self, FailKind, Frame, Mode, VERSION};
use crate::lane::Lane;
use crate::metrics::ClusterCounters;
use crate::outq::{OutQueue, Refused};

/// Settings shared by every link of a node.
#[derive(Debug, Clone)]
pub(crate) struct LinkConfig {
    pub(crate) node_id: String,
    pub(crate) cluster: String,
    pub(crate) queue: usize,
    pub(crate) max_in_flight: usize,
    pub(crate) max_frame: usize,
    pub(crate) ping_interval: Duration,
    pub(crate) ping_timeout: Duration,
    /// How long an acceptor may take over a HELLO (see the node's
    /// handshake); a dialer does not call the peer dead for its silence
    /// before that.
    pub(crate) handshake_timeout: Duration,
    pub(crate) backoff_max: Duration,
}

/// Pending requests beyond which work over all of them leaves the link's
/// task: failing them (each one a message and a wake-up) goes to the
/// blocking pool, and forgetting the given-up ones yields between maps.
const MANY_PENDING: usize = 512;

/// How many maps [`Pending`] splits its requests over.
const PENDING_SHARDS: usize = 16;

/// Consecutive request ids go to one map in runs of this many (see
/// [`Pending::map`]).
const PENDING_RUN: u64 = 64;

type PendingMap = HashMap<u64, ReplyHandle, RunHash>;

/// Hashes a pending request's id so that the ids of one map's runs sit in
/// consecutive buckets: the sender adding requests and the reader removing
/// answered ones each walk its table in order instead of touching a random
/// bucket per request. With a scattering hash the reader's look-up missed
/// the cache on nearly every answer (`HashMap::remove` was 6 % of `bench
/// pingpong --cluster etcd --nodes 2`, most of it on one load). The low
/// bits (the bucket) are the id's place among its map's ids; the top seven
/// (hashbrown's tag, compared before any key) are scattered. Ids are made
/// by this node, not by the peer, so a weak hash opens no attack: an
/// answer with a made-up id only misses.
#[derive(Debug, Default, Clone, Copy)]
struct RunHash;

impl std::hash::BuildHasher for RunHash {
    type Hasher = RunHasher;
    fn build_hasher(&self) -> RunHasher {
        RunHasher(0)
    }
}

#[derive(Debug)]
struct RunHasher(u64);

impl std::hash::Hasher for RunHasher {
    fn write_u64(&mut self, id: u64) {
        const TAG: u64 = 0x7f << 57;
        let stride = PENDING_RUN * PENDING_SHARDS as u64;
        let place = id / stride * PENDING_RUN + id % PENDING_RUN;
        self.0 = (place & !TAG) | (id.wrapping_mul(0x9e37_79b9_7f4a_7c15) & TAG);
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys use this hasher; anything else still hashes.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// One of [`Pending`]'s maps under its own lock, on cache lines of its own
/// (so two threads working on neighbouring maps do not share a line).
#[repr(align(128))]
#[derive(Default)]
struct PendingShard(Mutex<PendingMap>);

/// A link's requests in flight, by id, split over [`PENDING_SHARDS`] maps,
/// each under its own lock: the senders adding requests and the reader
/// taking them out as answers arrive mostly work on different maps at once
/// (ids are consecutive, the answered ones far behind the new ones).
/// `forget_abandoned` walks one map at a time; failing them all takes every
/// lock, in order, at once.
#[derive(Default)]
struct Pending {
    maps: [PendingShard; PENDING_SHARDS],
    /// Requests in the maps, plus the ones being added (counted before
    /// their map's lock is taken, so `max_in_flight` holds under races).
    len: AtomicUsize,
}

impl Pending {
    /// The map of request `id`. Ids are consecutive, and a run of
    /// [`PENDING_RUN`] of them shares a map: a sender adding requests on one
    /// thread keeps that map's lock in its cache for the whole run, while the
    /// reader taking answered ones out, far behind, works on another map.
    /// With fewer than a run in flight the two share a map (and its lock);
    /// then they mostly run on one event loop anyway (echo's 64 in flight).
    /// With runs of one (`id % 16`) each add and each removal found the
    /// lock's line last written by the other thread: in `bench pingpong
    /// --cluster etcd --nodes 2` the adding sender's unlock alone was 6 % of
    /// the samples.
    fn map(&self, id: u64) -> &Mutex<PendingMap> {
        &self.maps[((id / PENDING_RUN) % PENDING_SHARDS as u64) as usize].0
    }

    fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// Counts one more request, unless `max` are in flight already. (A
    /// compare-and-swap, not an add undone on refusal: a count briefly over
    /// the limit could make a removal that frees a slot miss waking the
    /// senders waiting for one.)
    fn reserve(&self, max: usize) -> bool {
        self.len
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// Adds request `id`, counted by [`reserve`](Self::reserve); returns
    /// what `read` reads while the request's map is locked (the link's
    /// failure epoch: see [`take_all`](Self::take_all)).
    fn insert<R>(&self, id: u64, handle: ReplyHandle, read: impl FnOnce() -> R) -> R {
        let mut map = self.map(id).lock();
        map.insert(id, handle);
        read()
    }

    /// Takes request `id` out, with the count before it went.
    fn remove(&self, id: u64) -> Option<(ReplyHandle, usize)> {
        let h = self.map(id).lock().remove(&id)?;
        Some((h, self.len.fetch_sub(1, Ordering::AcqRel)))
    }

    /// Keeps the requests of map `shard` for which `keep` holds; the count
    /// before and after.
    fn retain_in(
        &self,
        shard: usize,
        mut keep: impl FnMut(&ReplyHandle) -> bool,
    ) -> (usize, usize) {
        let mut map = self.maps[shard].0.lock();
        let before = map.len();
        map.retain(|_, h| keep(h));
        let gone = before - map.len();
        drop(map);
        let was = self.len.fetch_sub(gone, Ordering::AcqRel);
        (was, was - gone)
    }

    /// Takes every request out, running `with_all_locked` while all the maps
    /// are locked (a request added meanwhile is in them or reads what it
    /// changed); the requests, how many, and the count before.
    fn take_all(&self, with_all_locked: impl FnOnce()) -> (Vec<PendingMap>, usize, usize) {
        let mut guards: Vec<_> = self.maps.iter().map(|m| m.0.lock()).collect();
        with_all_locked();
        let taken: Vec<PendingMap> = guards
            .iter_mut()
            .map(|g| std::mem::take(&mut **g))
            .collect();
        drop(guards);
        let n = taken.iter().map(HashMap::len).sum();
        let was = self.len.fetch_sub(n, Ordering::AcqRel);
        (taken, n, was)
    }
}

/// How long a dial may take to connect.
const DIAL_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the accepting side of a link waits for the peer's connection
/// before it stops choosing the peer: the peer's own handshake allowance,
/// plus a full dial backoff and a dial timeout, so a peer still starting
/// (its links come after its advertisements) or between two dial attempts
/// is not taken for unreachable.
fn accept_grace(cfg: &LinkConfig) -> Duration {
    cfg.handshake_timeout + cfg.backoff_max + DIAL_TIMEOUT
}

/// Who opens the connection of a pair: the node with the smaller id dials,
/// so a pair has exactly one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Dial,
    Accept,
}

impl Side {
    /// The side `local` takes in its pair with `peer` (two distinct ids).
    pub(crate) fn towards(local: &str, peer: &str) -> Side {
        if local < peer {
            Side::Dial
        } else {
            Side::Accept
        }
    }
}

/// What the link's task writes.
enum Out {
    Msg {
        id: u64,
        /// `Link::fail_epoch` when a request was registered as pending.
        epoch: u64,
        msg: RemoteMessage,
    },
    Reply {
        id: u64,
        result: Result<railyard_bus::Message, BusError>,
    },
    Frame(Frame<'static>),
}

pub(crate) struct Link {
    peer: String,
    side: Side,
    /// Dial target; updated if the peer re-joins elsewhere.
    addr: Mutex<SocketAddr>,
    tx: OutQueue<Out>,
    /// Answers to the peer's requests, and pongs, each tagged with the
    /// number of the connection whose request it answers: an answer is written
    /// only on that connection. The peer fails its pending requests when a
    /// connection ends, and a peer that restarted numbers its requests from 1
    /// again, so an old answer on a new connection would complete the wrong
    /// request. Unbounded by the channel, bounded by the reader: it
    /// holds answers to requests read on the current connection and not
    /// written yet, and the reader stops taking requests once
    /// `max_in_flight` plus [`PONG_SLACK`] are queued
    /// (`ConnSink::room_for_answers`). Emptied when a connection ends.
    replies: mpsc::UnboundedSender<(u64, Out)>,
    /// Inbound messages waiting for room in full local consumer buffers,
    /// delivered in arrival order (see [`Lane`]).
    lane: Arc<Lane>,
    /// Requests queued or written on this link and not yet answered, failed
    /// or given up on by their requester (see `forget_abandoned`): at most
    /// `max_in_flight`.
    pending: Pending,
    max_in_flight: usize,
    /// Bumped (with every `pending` map locked) each time every pending
    /// request is failed: a queued request registered under an older value
    /// was failed and is not sent. Read by `deliver` under the request's map
    /// lock, and by the writer without a lock.
    fail_epoch: AtomicU64,
    next_id: AtomicU64,
    closed: AtomicBool,
    /// Set when a connection that was up is lost, when a dial fails
    /// (dialing side), or when `handshake_timeout` passes without the
    /// peer's connection (accepting side); cleared when a connection is up.
    /// Meanwhile `deliver` refuses, so sends and requests go to the
    /// address's other targets (or fail with NO_HANDLERS if it has none)
    /// instead of queueing for a peer that may be dead until its lease
    /// expires, or unreachable for as long as it lives (an address
    /// advertised that this node cannot reach). A link just made for a new
    /// member is not down: it queues until then, and what it queued goes
    /// with the HELLO.
    down: AtomicBool,
    close_signal: Notify,
    /// Senders waiting for room in a full queue or under `max_in_flight`
    /// (woken after each batch, and when the link goes down or closes).
    room_waiters: Mutex<RoomWaiters>,
    /// For `Side::Accept`: connections the acceptor hands over.
    /// Each comes with the bytes read after its HELLO.
    accepted: Mutex<Option<mpsc::Sender<(TcpStream, BytesMut)>>>,
    counters: Arc<ClusterCounters>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("peer", &self.peer)
            .field("side", &self.side)
            .finish_non_exhaustive()
    }
}

impl RemoteNode for Link {
    fn id(&self) -> &str {
        &self.peer
    }

    fn deliver(&self, mut msg: RemoteMessage) -> Result<(), Box<Undelivered>> {
        if self.closed.load(Ordering::Acquire) || self.down.load(Ordering::Acquire) {
            return Err(Box::new(Undelivered {
                error: self.gone(),
                message: msg,
            }));
        }
        let (id, epoch) = match msg.reply.take() {
            Some(handle) => {
                if !self.pending.reserve(self.max_in_flight) {
                    msg.reply = Some(handle);
                    self.counters.link_full.add(1);
                    return Err(Box::new(Undelivered {
                        error: BusError::Full {
                            address: msg.address.to_string(),
                        },
                        message: msg,
                    }));
                }
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                let epoch = self
                    .pending
                    .insert(id, handle, || self.fail_epoch.load(Ordering::Acquire));
                (id, epoch)
            }
            None => (0, 0),
        };
        match self.tx.try_push(Out::Msg { id, epoch, msg }) {
            Ok(()) => Ok(()),
            Err(e) => {
                let full = matches!(e, Refused::Full(_));
                let Out::Msg { mut msg, .. } = e.into_inner() else {
                    unreachable!("we sent a Msg")
                };
                if id != 0 {
                    // Not there if the link failed it meanwhile.
                    msg.reply = self.take_pending(id);
                }
                let error = if full {
                    self.counters.link_full.add(1);
                    BusError::Full {
                        address: msg.address.to_string(),
                    }
                } else {
                    self.gone()
                };
                Err(Box::new(Undelivered {
                    error,
                    message: msg,
                }))
            }
        }
    }

    fn poll_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.poll_until(cx, |l| l.has_room())
    }

    fn poll_request_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        // Only refused requests get here: the count's load is off the hot
        // path.
        self.poll_until(cx, |l| l.has_room() && l.pending.len() < l.max_in_flight)
    }
}

impl Link {
    /// Whether a refused send is worth retrying: the link closed (the retry
    /// fails at once) or its queue has room.
    fn has_room(&self) -> bool {
        self.closed.load(Ordering::Acquire)
            || self.down.load(Ordering::Acquire)
            || self.tx.has_room()
    }

    /// `Ready` once `ready` holds; otherwise registers the waker (woken after
    /// each written batch, and when requests stop being in flight at the
    /// limit) and checks again.
    fn poll_until(&self, cx: &mut Context<'_>, ready: impl Fn(&Self) -> bool) -> Poll<()> {
        if ready(self) {
            return Poll::Ready(());
        }
        // Woken after the lock is released.
        let stale = self.room_waiters.lock().register(cx.waker());
        stale.into_iter().for_each(Waker::wake);
        // Room may have come between the check and the registration.
        if ready(self) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Removes request `id` from `pending`, waking room waiters if that made
    /// room under the limit.
    fn take_pending(&self, id: u64) -> Option<ReplyHandle> {
        let (h, was) = self.pending.remove(id)?;
        self.wake_if_room(was, was - 1);
        Some(h)
    }

    fn wake_if_room(&self, was: usize, now: usize) {
        if was >= self.max_in_flight && now < self.max_in_flight {
            self.wake_room_waiters();
        }
    }

    fn wake_room_waiters(&self) {
        let waiters = self.room_waiters.lock().take_all();
        for w in waiters {
            w.wake();
        }
    }

    /// Creates the link and starts its task.
    pub(crate) fn start(
        peer: String,
        addr: SocketAddr,
        cfg: Arc<LinkConfig>,
        bus: EventBus,
        counters: Arc<ClusterCounters>,
    ) -> Arc<Link> {
        let side = Side::towards(&cfg.node_id, &peer);
        let (replies, replies_rx) = mpsc::unbounded_channel();
        let (acc_tx, acc_rx) = mpsc::channel(4);
        let link = Arc::new(Link {
            peer,
            side,
            addr: Mutex::new(addr),
            tx: OutQueue::new(cfg.queue),
            replies,
            lane: Arc::new(Lane::new(MAX_WAITING)),
            pending: Pending::default(),
            max_in_flight: cfg.max_in_flight.max(1),
            fail_epoch: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            down: AtomicBool::new(false),
            close_signal: Notify::new(),
            accepted: Mutex::new(Some(acc_tx)),
            room_waiters: Mutex::new(RoomWaiters::default()),
            counters,
        });
        tokio::spawn(run(link.clone(), cfg, bus, replies_rx, acc_rx));
        link
    }

    pub(crate) fn side(&self) -> Side {
        self.side
    }

    pub(crate) fn set_addr(&self, addr: SocketAddr) {
        *self.addr.lock() = addr;
    }

    /// Hands an accepted connection (after its HELLO) to this link, with
    /// whatever was read past the HELLO.
    pub(crate) fn hand_over(&self, stream: TcpStream, rest: BytesMut) {
        let tx = self.accepted.lock().clone();
        if let Some(tx) = tx {
            if tx.try_send((stream, rest)).is_err() {
                tracing::warn!(peer = %self.peer, "dropping a surplus connection from a peer");
            }
        }
    }

    /// Closes for good: the peer left. Pending requests fail now; queued
    /// messages are failed by the task as it drains.
    pub(crate) fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            self.accepted.lock().take();
            self.close_signal.notify_one();
            self.fail_pending("left the cluster");
            self.wake_room_waiters();
        }
    }

    /// Marks the link down (see `down`): the requests pending on it fail
    /// (`node <peer> <why> before answering`), and senders waiting for room
    /// here are woken to try the address's other targets. Called again
    /// while down (each failed dial, each further `handshake_timeout`), it
    /// fails a request that got in as the link went down. Returns whether
    /// the link was not down before.
    fn mark_down(&self, why: &str) -> bool {
        let was_down = self.down.swap(true, Ordering::AcqRel);
        self.fail_pending(why);
        self.wake_room_waiters();
        !was_down
    }

    fn gone(&self) -> BusError {
        BusError::Cluster {
            reason: format!("node {} is not reachable", self.peer),
        }
    }

    fn fail_pending(&self, why: &str) {
        // Taken whole with every map locked (no walk there), failed after.
        let (drained, taken, before) = self.pending.take_all(|| {
            self.fail_epoch.fetch_add(1, Ordering::AcqRel);
        });
        self.wake_if_room(before, before - taken);
        if taken == 0 {
            return;
        }
        self.counters.failed_on_loss.add(taken as u64);
        let reason = format!("node {} {why} before answering", self.peer);
        let fail_all = move || {
            for h in drained.into_iter().flat_map(HashMap::into_values) {
                h.fail(BusError::Cluster {
                    reason: reason.clone(),
                });
            }
        };
        // Up to `max_in_flight` (65,536 by default) requesters to wake: more
        // than a few hundred is too long for the link's async task. (Run
        // there once in every case, also if the runtime is shutting down.)
        if taken > MANY_PENDING {
            drop(crate::offload::run_blocking(fail_all));
        } else {
            fail_all();
        }
    }

    /// Drops requests whose requester stopped waiting (timed out or
    /// dropped); their slots under `max_in_flight` come back with them. The
    /// peer may still answer them: that answer finds nothing and is ignored.
    ///
    /// One of [`Pending`]'s maps at a time, under that map's lock only (and,
    /// when many are in flight, the task yielding in between): one walk over
    /// up to `max_in_flight` (65,536) requests under one lock held the
    /// link's task, and every sender waiting for the lock, for the whole of
    /// it.
    async fn forget_abandoned(&self) {
        for shard in 0..PENDING_SHARDS {
            let (was, now) = self.pending.retain_in(shard, |h| !h.is_abandoned());
            self.wake_if_room(was, now);
            if was > MANY_PENDING {
                tokio::task::yield_now().await;
            }
        }
    }

    fn complete(&self, id: u64, result: Result<(Headers, Body), BusError>) {
        let Some(h) = self.take_pending(id) else {
            return; // timed out and forgotten, or a duplicate
        };
        match result {
            Ok((headers, body)) => h.reply(headers, body),
            Err(e) => h.fail(e),
        }
    }
}

/// The link's task: obtain a connection, serve it until it fails, repeat
/// until closed.
async fn run(
    link: Arc<Link>,
    cfg: Arc<LinkConfig>,
    bus: EventBus,
    mut replies: mpsc::UnboundedReceiver<(u64, Out)>,
    mut accepted: mpsc::Receiver<(TcpStream, BytesMut)>,
) {
    let _ended = TaskEnded(link.clone());
    let mut backoff = Duration::from_millis(20);
    // Connections served so far; each one's number tags its answers.
    let mut conns = 0u64;
    loop {
        if link.closed.load(Ordering::Acquire) {
            break;
        }
        let (stream, rest) = match link.side {
            Side::Dial => {
                let addr = *link.addr.lock();
                let attempt = tokio::select! {
                    r = dial(addr, &cfg) => r,
                    () = link.close_signal.notified() => break,
                };
                match attempt {
                    // The backoff is reset once the peer answers on it (below).
                    Ok(s) => (s, BytesMut::new()),
                    Err(e) => {
                        // Not chosen until a dial gets through (a member
                        // whose address refuses us, or a partition, would
                        // otherwise take its share of the requests, each
                        // waiting for its timeout).
                        if link.mark_down("could not be reached") {
                            tracing::warn!(peer = %link.peer, %addr, error = %e, "cannot reach a cluster peer; not choosing it until a connection is up");
                        } else {
                            tracing::debug!(peer = %link.peer, %addr, error = %e, "dial failed; retrying");
                        }
                        if !back_off(&link, &mut backoff, cfg.backoff_max).await {
                            break;
                        }
                        continue;
                    }
                }
            }
            // The peer dials us. A peer that has not within
            // `handshake_timeout` (it cannot reach our address, or is cut
            // off) is not chosen until it does: down, and again after each
            // further wait.
            Side::Accept => tokio::select! {
                s = accepted.recv() => match s {
                    Some(s) => s,
                    None => break,
                },
                () = link.close_signal.notified() => break,
                () = tokio::time::sleep(accept_grace(&cfg)) => {
                    if link.mark_down("did not connect") {
                        tracing::warn!(peer = %link.peer, waited = ?cfg.handshake_timeout, "a cluster peer has not connected; not choosing it until it does");
                    }
                    continue;
                }
            },
        };
        tracing::info!(peer = %link.peer, side = ?link.side, "cluster link up");
        link.counters.connects.add(1);
        conns += 1;
        link.down.store(false, Ordering::Release);
        let sink = Arc::new(ConnSink::new(link.clone(), conns));
        let why = serve(&sink, &cfg, &bus, &mut replies, stream, rest).await;
        // Refused from now until the next connection is up; senders waiting
        // for room here try the address's other targets.
        link.mark_down("was disconnected");
        // Answers to that connection's requests: the peer has failed them.
        while replies.try_recv().is_ok() {}
        if link.closed.load(Ordering::Acquire) {
            break;
        }
        link.counters.disconnects.add(1);
        tracing::warn!(peer = %link.peer, reason = %why, "cluster link down; requests waiting on it failed");
        if link.side == Side::Dial {
            if sink.heard_anything.load(Ordering::Relaxed) {
                backoff = Duration::from_millis(20);
            } else if !back_off(&link, &mut backoff, cfg.backoff_max).await {
                // Closed (or silent) without a word: the peer refused the
                // connection (its view may not list us yet, see the node's
                // handshake). Retried as after a failed dial, not at once.
                break;
            }
        }
    }
    // `_ended`, held since the start, closes the queue and fails what is left.
}

/// Held by the link's task for its whole life: however the task ends
/// (closed, its runtime shut down, a panic in a handler), the outbound queue
/// closes, what is still queued fails, and senders waiting for room are
/// woken. Otherwise sends after the task's end would be taken and never
/// written, and requests would wait for their timeout.
struct TaskEnded(Arc<Link>);

impl Drop for TaskEnded {
    fn drop(&mut self) {
        let link = &self.0;
        // Queued messages carry no reply handle (`deliver` keeps it in
        // `pending`): failing `pending` answers the requests among them.
        drop(link.tx.close());
        link.fail_pending("left the cluster");
        // A closed queue has room for a refusal: `poll_room` returns.
        link.wake_room_waiters();
    }
}

async fn dial(addr: SocketAddr, cfg: &LinkConfig) -> std::io::Result<TcpStream> {
    let mut s = tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
    s.set_nodelay(true)?;
    let mut buf = BytesMut::new();
    Frame::Hello {
        version: VERSION,
        node: cfg.node_id.as_str().into(),
        cluster: cfg.cluster.as_str().into(),
    }
    .encode(&mut buf);
    s.write_all(&buf).await?;
    Ok(s)
}

/// Most queued items written per batch.
const BATCH: usize = 256;

/// Frames handled between two chances for the answers they produce to be
/// written (see `read_loop`). Measured with `bench echo --cluster etcd
/// --nodes 2` (64 requests in flight): handling whole reads, the two
/// processes took turns on one batch (about 0.4M round trips/s). Two rounds
/// of 8 / 16 / 32 / 64: send-reply 0.79-0.81M / 0.92-0.95M / 0.67-0.81M /
/// 0.40-0.45M, send-send 0.79-0.81M / 0.77-0.99M / 0.86-0.96M / 0.87-0.88M.
/// Re-measured on 2026-11-26 (another machine of the kind) together with the
/// dispatcher's `SENT_AWAY_EVERY`: 32 frames with 32 runs gave medians of 5
/// alternating runs of 718k (send-send) and 677k (send-reply) round trips/s,
/// against 618k and 559k with 16 and 16; 64 frames dropped send-reply to
/// about 0.39M again (docs/benchmarks.md).
const READ_CHUNK: usize = 32;

/// Bytes of answers added to one write once it holds its batch.
const MAX_WRITE: usize = 256 * 1024;

/// Serves one connection; returns why it ended.
///
/// Reading and writing run as two futures of this one task, so neither
/// waits for the other: a write blocked on a full socket (the peer busy)
/// never stops this side from reading. When both sides' only task wrote
/// while not reading, two nodes flooding each other (500,000 pipelined
/// requests) filled both sockets and each waited on the other for good.
async fn serve(
    sink: &Arc<ConnSink>,
    cfg: &LinkConfig,
    bus: &EventBus,
    replies: &mut mpsc::UnboundedReceiver<(u64, Out)>,
    stream: TcpStream,
    rest: BytesMut,
) -> String {
    let (mut rd, mut wr) = stream.into_split();
    let mut inbuf = BytesMut::with_capacity(64 * 1024);
    // Frames that came with the HELLO are handled by the reader before its
    // first read, with the writer already running (the reader may wait for
    // it, see `ConnSink::room_for_answers`).
    inbuf.extend_from_slice(&rest);
    tokio::select! {
        why = write_loop(sink, bus, replies, &mut wr, cfg.max_frame) => why,
        why = read_loop(sink, cfg, bus, &mut rd, &mut inbuf) => why,
        why = ping_loop(sink, cfg) => why,
    }
}

/// Writes what is queued for the peer, a batch per write: messages (up to
/// [`BATCH`]) with the answers ready by then, or answers alone.
async fn write_loop(
    sink: &ConnSink,
    bus: &EventBus,
    replies: &mut mpsc::UnboundedReceiver<(u64, Out)>,
    wr: &mut tokio::net::tcp::OwnedWriteHalf,
    max_frame: usize,
) -> String {
    let link = &sink.link;
    let mut outbuf = BytesMut::with_capacity(64 * 1024);
    let mut batch = std::collections::VecDeque::with_capacity(BATCH);
    let mut reply_batch = Vec::with_capacity(BATCH);
    // Messages and pings encoded since the last write (answers: `encoded`).
    let mut frames = 0u64;
    // Answers of this connection encoded since the last write, counted
    // off `ConnSink::queued` once per write. Only this future touches it
    // (an atomic because the task must be `Send`; a plain load and store).
    let encoded = AtomicUsize::new(0);
    // An answer to an earlier connection's request is dropped: the peer
    // failed that request when the connection ended.
    let mut codecs = bus.codec_cache();
    let answer = |(for_conn, out): (u64, Out), buf: &mut BytesMut, codecs: &mut CodecCache| {
        if for_conn == sink.conn {
            encode_out(link, codecs, out, buf, max_frame);
            encoded.store(encoded.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        } else {
            link.counters.stale_answers.add(1);
        }
    };
    loop {
        tokio::select! {
            n = link.tx.recv_many(&mut batch, BATCH) => {
                if n == 0 {
                    return "link queue closed".into();
                }
                for out in batch.drain(..) {
                    if encode_out(link, &mut codecs, out, &mut outbuf, max_frame) {
                        frames += 1;
                    }
                }
                link.wake_room_waiters();
            }
            n = replies.recv_many(&mut reply_batch, BATCH) => {
                if n == 0 {
                    return "link closed".into();
                }
                for item in reply_batch.drain(..) {
                    answer(item, &mut outbuf, &mut codecs);
                }
            }
        }
        // Answers that are ready go in the same write, up to a bound.
        fill_to(
            &mut outbuf,
            MAX_WRITE,
            || replies.try_recv().ok(),
            |item, buf| answer(item, buf, &mut codecs),
        );
        let answers = encoded.load(Ordering::Relaxed);
        sink.paid(answers);
        encoded.store(0, Ordering::Relaxed);
        // Counted once per write, not per frame (an atomic add each).
        link.counters.frames_out.add(frames + answers as u64);
        frames = 0;
        let r = wr.write_all(&outbuf).await;
        link.counters.bytes_out.add(outbuf.len() as u64);
        outbuf.clear();
        if let Err(e) = r {
            return format!("write failed: {e}");
        }
    }
}

/// Encodes items from `next` into `buf` while it holds at most `max` bytes.
///
/// The bound is checked before an item is taken: taken and then left out,
/// an answer was lost and its requester timed out (it happened once the
/// reader could run far ahead of a blocked write: `bench pingpong --nodes 2`
/// lost up to 190,000 of 500,000 answers).
fn fill_to<T>(
    buf: &mut BytesMut,
    max: usize,
    mut next: impl FnMut() -> Option<T>,
    mut encode: impl FnMut(T, &mut BytesMut),
) {
    while buf.len() <= max {
        let Some(item) = next() else {
            break;
        };
        encode(item, buf);
    }
}

/// Reads and handles the peer's frames.
async fn read_loop(
    sink: &Arc<ConnSink>,
    cfg: &LinkConfig,
    bus: &EventBus,
    rd: &mut tokio::net::tcp::OwnedReadHalf,
    inbuf: &mut BytesMut,
) -> String {
    let link = &sink.link;
    let mut codecs = bus.codec_cache();
    loop {
        // What is buffered (at first, what came with the HELLO) is handled
        // a chunk at a time: in between, this task yields, so the tasks and
        // consumers those frames woke run and queue their answers, and
        // `write_loop` sends them while this side handles the rest; the
        // peer works on the first answers meanwhile. Handling a whole read
        // before writing anything made two nodes take turns, each idle
        // while the other worked (see `READ_CHUNK`).
        loop {
            match handle_buffered(sink, bus, &mut codecs, inbuf, cfg.max_frame, READ_CHUNK).await {
                Err(why) => return why,
                Ok(false) => break,
                Ok(true) => {
                    // Still working through what the peer sent: not
                    // silence, whatever the socket holds meanwhile.
                    sink.heard();
                    tokio::task::yield_now().await;
                }
            }
        }
        tokio::select! {
            r = rd.read_buf(inbuf) => match r {
                Ok(0) => return "peer closed the connection".into(),
                Ok(n) => {
                    link.counters.bytes_in.add(n as u64);
                    // Traffic: an event loop that spins before parking keeps
                    // polling for the next read (railyard_bus::spin_before_park).
                    railyard_bus::note_loop_work();
                    sink.heard();
                    // Read after `serve` returns, on this same task.
                    if !sink.heard_anything.load(Ordering::Relaxed) {
                        sink.heard_anything.store(true, Ordering::Relaxed);
                    }
                }
                Err(e) => return format!("read failed: {e}"),
            },
            () = link.close_signal.notified() => return "closed".into(),
        }
    }
}

/// Waits about `backoff` ([`jittered`]) before the next dial, then doubles
/// it (up to `max`); false if the link was closed meanwhile.
async fn back_off(link: &Link, backoff: &mut Duration, max: Duration) -> bool {
    tokio::select! {
        () = tokio::time::sleep(jittered(*backoff)) => {}
        () = link.close_signal.notified() => return false,
    }
    *backoff = (*backoff * 2).min(max);
    true
}

/// A wait drawn evenly from `[backoff / 2, backoff]`.
///
/// Why: when a node restarts, every peer's link to it fails in the same
/// instant, and with a fixed schedule they would all dial again in the same
/// instants, each time, until `backoff_max`. Spread over half the wait,
/// their dials arrive apart, and no wait is shorter than half the one
/// asked for, so the backoff still bounds the dial rate.
pub(crate) fn jittered(backoff: Duration) -> Duration {
    let half = backoff / 2;
    let nanos = u64::try_from(backoff.as_nanos() - half.as_nanos()).unwrap_or(u64::MAX);
    half + Duration::from_nanos(fastrand::u64(0..=nanos))
}

/// Pings the peer and applies the deadline. A future of its own, beside the
/// reader: a reader waiting for room in full local buffers stopped the ping
/// with it, and after `ping_timeout` the live peer was declared dead.
async fn ping_loop(sink: &Arc<ConnSink>, cfg: &LinkConfig) -> String {
    let link = &sink.link;
    let mut ping = tokio::time::interval(cfg.ping_interval);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut nonce = 0u64;
    loop {
        ping.tick().await;
        if link.closed.load(Ordering::Acquire) {
            // The reader may be paused (see `ConnSink::room_for_answers`) and
            // not see it.
            return "closed".into();
        }
        if sink.stalled.load(Ordering::Acquire) {
            // Not reading by choice: the peer's silence proves nothing.
            sink.heard();
        } else {
            // Until the peer's first frame, the acceptor may still be in its
            // handshake (waiting for its view to list us), silent by rule.
            let deadline = if sink.heard_anything.load(Ordering::Relaxed) {
                cfg.ping_timeout
            } else {
                cfg.ping_timeout.max(cfg.handshake_timeout)
            };
            if sink.silent_for() > deadline {
                // Our own stall (the process not scheduled) can be what
                // passed the deadline: the reader gets a turn to read what
                // came meanwhile before the peer is called dead. (Polling
                // the reader first on every turn instead cost two-process
                // send-reply about 9 % in three alternating pairs.)
                tokio::task::yield_now().await;
                if sink.silent_for() > deadline {
                    return format!("no frame from the peer for {deadline:?}");
                }
            }
        }
        link.forget_abandoned().await;
        nonce += 1;
        // Through the queue, so a ping never overtakes a batch.
        let _ = link.tx.try_push(Out::Frame(Frame::Ping(nonce)));
    }
}

/// Handles up to `max` complete frames in `inbuf`; `Ok(true)` when it
/// stopped at `max` (more may be waiting). A malformed frame ends the
/// connection (the error says why).
async fn handle_buffered(
    sink: &Arc<ConnSink>,
    bus: &EventBus,
    codecs: &mut CodecCache,
    inbuf: &mut BytesMut,
    max_frame: usize,
    max: usize,
) -> Result<bool, String> {
    // Frames are counted once per chunk (or before a wait), not one atomic
    // add per frame.
    let frames_in = &sink.link.counters.frames_in;
    let mut uncounted = 0u64;
    let mut result = Ok(true);
    for _ in 0..max {
        // The frame borrows its strings from `inbuf` while it is handled.
        match Frame::decode_with(inbuf, max_frame, |f| handle(sink, bus, codecs, f)) {
            Ok(Some(later)) => {
                uncounted += 1;
                if let Some(later) = later {
                    frames_in.add(std::mem::take(&mut uncounted));
                    later.await;
                }
            }
            Ok(None) => {
                result = Ok(false);
                break;
            }
            Err(e) => {
                sink.link.counters.malformed.add(1);
                result = Err(format!("malformed frame from the peer: {e}"));
                break;
            }
        }
    }
    frames_in.add(uncounted);
    result
}

fn fail_frame(id: u64, e: &BusError) -> Frame<'static> {
    // TIMEOUT carries the timeout in ms as its code; NO_HANDLERS the address
    // as its message, so the requester's error reads as a local one.
    let (kind, code, message) = match e {
        BusError::Timeout { after } => (
            FailKind::Timeout,
            i32::try_from(after.as_millis()).unwrap_or(i32::MAX),
            String::new(),
        ),
        BusError::NoHandlers { address } => (FailKind::NoHandlers, 0, address.clone()),
        BusError::RecipientFailure { code, message } => {
            (FailKind::RecipientFailure, *code, message.clone())
        }
        other => (FailKind::Error, 0, other.to_string()),
    };
    Frame::Fail {
        id,
        kind,
        code,
        message: message.into(),
    }
}

/// If what was encoded into `buf` from `start` (a frame with its length
/// prefix) is over `max_frame`, removes it and returns its length.
fn take_back_if_over(buf: &mut BytesMut, start: usize, max_frame: usize) -> Option<usize> {
    let len = buf.len() - start - 4;
    (len > max_frame).then(|| {
        buf.truncate(start);
        len
    })
}

/// The error for a message or reply that does not fit one frame.
fn too_large(what: &str, len: usize, max_frame: usize) -> BusError {
    BusError::Cluster {
        reason: format!(
            "{what} of {len} bytes exceeds the {max_frame}-byte frame limit between nodes; \
             send a smaller body or raise the cluster's max frame size on every node"
        ),
    }
}

/// Ends the frame begun at `start` (its head written) with `body`'s codec
/// name and bytes, encoded straight into `buf`; on failure the frame is
/// taken back whole. A codec that took bytes out of the batch instead of
/// only appending (`MessageCodec::encode_into` must append) fails too: the
/// frame's lengths could not be filled in. (The frames before it may be
/// damaged then; the peer refuses them and the connection starts again.)
/// Inlined: it runs per message, and left to itself the compiler kept it
/// out of line, a call the code it replaced did not make.
#[inline(always)]
fn end_with_body(
    buf: &mut BytesMut,
    start: usize,
    codecs: &mut CodecCache,
    body: &Body,
    codec: Option<&str>,
) -> Result<(), railyard_bus::CodecError> {
    let mut body_start = 0;
    let encoded = codecs.encode_into(body, codec, buf, |out, name| {
        body_start = frame::begin_body(out, name);
    });
    match encoded {
        Ok(()) if buf.len() >= body_start => {
            frame::end_body(buf, start, body_start);
            Ok(())
        }
        Ok(()) => {
            buf.truncate(start);
            Err(railyard_bus::CodecError::Malformed {
                codec: "(the body's codec)".into(),
                reason: "it removed bytes it had not written".into(),
            })
        }
        Err(e) => {
            buf.truncate(start);
            Err(e)
        }
    }
}

/// Encodes one queued item into the batch buffer. A body no codec can
/// encode, or one that would make a frame over `max_frame` (which the peer
/// refuses, closing the link), fails its request (or its answer's request,
/// with a FAIL frame; a send is dropped and counted). A request whose
/// requester was already told it failed (the link dropped while it was
/// queued: its `fail_epoch` is old) is not sent: it would run with nobody
/// waiting for it. Checked by epoch, not by a look-up in `pending`: that
/// lock per request, taken by the writer against the senders, looked slower
/// in `bench pingpong --nodes 2` (two runs each, 0.89-0.93 s without it,
/// 1.07-1.20 s with it; both builds read an environment switch per message,
/// so the figures are indicative only), and the epoch costs one load.
/// Returns whether a frame went into `buf` (an answer's FAIL counts).
/// Counted by the writer once per write, not here per frame.
fn encode_out(
    link: &Link,
    codecs: &mut CodecCache,
    out: Out,
    buf: &mut BytesMut,
    max_frame: usize,
) -> bool {
    match out {
        Out::Frame(f) => {
            f.encode(buf);
            true
        }
        Out::Msg { id, epoch, mut msg } => {
            if id != 0 && epoch != link.fail_epoch.load(Ordering::Acquire) {
                link.counters.unsent_failed.add(1);
                return false;
            }
            if let Some(why) = frame::unfit(&msg.address, msg.headers.iter()) {
                link.counters.encode_failures.add(1);
                tracing::warn!(reason = %why, "a message for another node does not fit a frame; not sent");
                if id != 0 {
                    link.complete(id, Err(BusError::Cluster { reason: why }));
                }
                return false;
            }
            let (mode, timeout_ms) = match msg.kind {
                RemoteKind::Send => (Mode::Send, 0),
                RemoteKind::Publish => (Mode::Publish, 0),
                RemoteKind::Request { timeout } => (
                    Mode::Request,
                    u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
                ),
            };
            // The body is encoded straight into the batch, after the
            // frame's head (see `end_with_body`).
            let start =
                frame::begin_msg(buf, mode, id, timeout_ms, &msg.address, msg.headers.iter());
            match end_with_body(buf, start, codecs, &msg.body, msg.codec.as_deref()) {
                Ok(()) => {
                    if let Some(len) = take_back_if_over(buf, start, max_frame) {
                        link.counters.encode_failures.add(1);
                        tracing::warn!(address = %msg.address, len, max_frame, "a message for another node is over the frame limit; not sent");
                        if id != 0 {
                            link.complete(id, Err(too_large("the message", len, max_frame)));
                        }
                        return false;
                    }
                    true
                }
                Err(e) => {
                    link.counters.encode_failures.add(1);
                    tracing::warn!(address = %msg.address, error = %e, "cannot encode a body for another node");
                    if id != 0 {
                        link.complete(
                            id,
                            Err(BusError::Cluster {
                                reason: format!("body cannot cross nodes: {e}"),
                            }),
                        );
                    }
                    msg.reply = None;
                    false
                }
            }
        }
        Out::Reply { id, result } => {
            let frame = match result {
                Ok(mut m) => {
                    if let Some(why) = frame::unfit("", m.headers().iter()) {
                        link.counters.encode_failures.add(1);
                        let reason = format!("the reply: {why}");
                        fail_frame(id, &BusError::Cluster { reason }).encode(buf);
                        return true;
                    }
                    let body = m.take_body();
                    let start = frame::begin_reply(buf, id, m.headers().iter());
                    match end_with_body(buf, start, codecs, &body, None) {
                        Ok(()) => {
                            let Some(len) = take_back_if_over(buf, start, max_frame) else {
                                return true;
                            };
                            link.counters.encode_failures.add(1);
                            fail_frame(id, &too_large("the reply", len, max_frame))
                        }
                        Err(e) => fail_frame(
                            id,
                            &BusError::Cluster {
                                reason: format!("reply body cannot cross nodes: {e}"),
                            },
                        ),
                    }
                }
                Err(e) => fail_frame(id, &e),
            };
            frame.encode(buf);
            true
        }
    }
}

/// Most inbound messages per link that may wait in its [`Lane`] for room in
/// a full local buffer. Beyond it the reader itself waits, which stops
/// reading from the socket: TCP then slows the peer down.
const MAX_WAITING: usize = 1024;

/// Answers (pongs) a connection may queue beyond `max_in_flight` before
/// the reader pauses.
const PONG_SLACK: usize = 64;

/// The answering end of one connection: requests the peer sent on it are
/// answered through it, tagged with its number (see `Link::replies`).
struct ConnSink {
    link: Arc<Link>,
    conn: u64,
    /// Answers for this connection in `Link::replies`: produced (a reply,
    /// a FAIL, a pong) and not yet encoded by the writer.
    queued: AtomicUsize,
    /// `queued` at which the reader stops taking requests and pings: our
    /// `max_in_flight` plus [`PONG_SLACK`].
    queue_limit: usize,
    /// The reader is paused in `room_for_answers`; the writer then
    /// notifies `room`.
    paused: AtomicBool,
    room: Notify,
    /// The reader waits (for answers to be written, or for room in full
    /// local buffers) and reads nothing: silence from the peer then says
    /// nothing about it, so the ping deadline is not applied.
    stalled: AtomicBool,
    /// Whether anything at all was read from the peer on this connection:
    /// a dialer whose connection ends before that backs off before it
    /// dials again.
    heard_anything: AtomicBool,
    /// When the connection began; `heard_ms` counts from it.
    since: Instant,
    /// When the peer was last heard from (or the reader stalled), in ms
    /// after `since`.
    heard_ms: AtomicU64,
}

impl ConnSink {
    fn new(link: Arc<Link>, conn: u64) -> Self {
        let queue_limit = link.max_in_flight.saturating_add(PONG_SLACK);
        Self {
            link,
            conn,
            queued: AtomicUsize::new(0),
            queue_limit,
            paused: AtomicBool::new(false),
            room: Notify::new(),
            stalled: AtomicBool::new(false),
            heard_anything: AtomicBool::new(false),
            since: Instant::now(),
            heard_ms: AtomicU64::new(0),
        }
    }

    fn heard(&self) {
        let ms = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.heard_ms.store(ms, Ordering::Relaxed);
    }

    fn silent_for(&self) -> Duration {
        self.since
            .elapsed()
            .saturating_sub(Duration::from_millis(self.heard_ms.load(Ordering::Relaxed)))
    }

    /// Before the reader takes a request or a ping (each will queue one
    /// answer): waits, reading nothing, while `queue_limit` answers are
    /// queued for this connection. A peer within its own in-flight limit
    /// (ours or smaller) never gets there; the wait bounds what
    /// `Link::replies` holds for a peer that asks more without reading.
    /// Requests already taken may still add their answers meanwhile: at
    /// most the local consumers' buffers and `MAX_WAITING` more.
    async fn room_for_answers(&self) {
        if self.room_for_an_answer() {
            return;
        }
        let link = &self.link;
        link.counters.answer_pauses.add(1);
        tracing::warn!(peer = %link.peer, queued = self.queue_limit, "answers to a peer are not being read; pausing reads from it until they are");
        self.stalled.store(true, Ordering::Release);
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            self.paused.store(true, Ordering::SeqCst);
            if self.queued.load(Ordering::SeqCst) < self.queue_limit {
                break;
            }
            notified.await;
        }
        self.paused.store(false, Ordering::SeqCst);
        self.stalled.store(false, Ordering::Release);
    }

    /// Whether one more answer may be queued without waiting.
    fn room_for_an_answer(&self) -> bool {
        self.queued.load(Ordering::SeqCst) < self.queue_limit
    }

    /// `n` queued answers were encoded for the peer.
    fn paid(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.queued.fetch_sub(n, Ordering::SeqCst);
        if self.paused.load(Ordering::SeqCst) {
            self.room.notify_one();
        }
    }

    fn answer(&self, out: Out) {
        self.queued.fetch_add(1, Ordering::SeqCst);
        // Fails only once the link task is gone, and then so is the peer's
        // pending request (it was failed when the link closed).
        let _ = self.link.replies.send((self.conn, out));
    }
}

impl ReplySink for ConnSink {
    fn reply(&self, id: u64, result: Result<railyard_bus::Message, BusError>) {
        self.answer(Out::Reply { id, result });
    }
}

/// Delivers an inbound message for `address` whose every local buffer was
/// full, or that must go behind such messages: through the link's
/// [`Lane`], in arrival order, while the reader goes on; with the lane
/// full, the returned future waits for room in it and the reader awaits
/// that (reading nothing meanwhile).
fn wait_in_lane<F>(sink: &Arc<ConnSink>, address: &str, deliver: F) -> Option<Later>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let lane = &sink.link.lane;
    match lane.push(address, Box::pin(deliver)) {
        Ok(()) => None,
        Err(delivery) => {
            let (sink, lane, address) = (sink.clone(), lane.clone(), address.to_owned());
            Some(Box::pin(async move {
                sink.stalled.store(true, Ordering::Release);
                lane.push_waiting(&address, delivery).await;
                sink.stalled.store(false, Ordering::Release);
            }))
        }
    }
}

/// Delivers a request from the peer that found its consumers' buffers full
/// (or must go behind messages that did), waiting for room until
/// `deadline`, its timeout counted from its arrival here. Past it, its
/// requester has been told TIMEOUT (earlier, in fact: the timeout also ran
/// while the request waited on the sender's side and on the wire, which
/// the frame does not carry), so the request is withdrawn and answered
/// TIMEOUT: never delivered. A request whose requester gave up but which
/// got room before this deadline is still delivered. (Until 2026-11-28 the
/// wait was unbounded: the request was run whenever room came, with nobody
/// waiting for it, holding its address's place in the lane meanwhile.)
async fn request_in_lane(
    bus: &EventBus,
    address: &str,
    body: Body,
    opts: &DeliveryOptions,
    sink: Arc<ConnSink>,
    id: u64,
    deadline: Instant,
) {
    let timeout = BusError::Timeout {
        after: opts.timeout,
    };
    // Its turn may come after the deadline (behind other waiting messages).
    if Instant::now() >= deadline {
        tracing::debug!(%address, "a request from another node timed out waiting for room; withdrawn");
        sink.answer(Out::Frame(fail_frame(id, &timeout)));
        return;
    }
    let replies = Arc::new(Withdrawable {
        sink: sink.clone(),
        after: opts.timeout,
        withdrawn: AtomicBool::new(false),
    });
    let routed = {
        let wait = bus.request_remote_wait(address, body, opts, replies.clone(), id);
        tokio::pin!(wait);
        let routed = tokio::time::timeout_at(deadline, &mut wait).await;
        if routed.is_err() {
            replies.withdrawn.store(true, Ordering::Release);
        }
        routed
        // `wait` is dropped here, with the request if it still waits: its
        // reply handle answers `NoReply`, which `replies` turns into TIMEOUT.
    };
    match routed {
        Ok(Ok(())) => {}
        Ok(Err(e)) => sink.answer(Out::Frame(fail_frame(id, &e.error))),
        Err(_) => {
            tracing::debug!(%address, "a request from another node timed out waiting for room; withdrawn");
        }
    }
}

/// The reply sink of a request waiting in the lane (see
/// [`request_in_lane`]): once it is withdrawn for its timeout, the
/// `NoReply` its dropped reply handle answers becomes the TIMEOUT its
/// requester saw.
struct Withdrawable {
    sink: Arc<ConnSink>,
    after: Duration,
    withdrawn: AtomicBool,
}

impl ReplySink for Withdrawable {
    fn reply(&self, id: u64, result: Result<railyard_bus::Message, BusError>) {
        let result = match result {
            Err(BusError::NoReply) if self.withdrawn.load(Ordering::Acquire) => {
                Err(BusError::Timeout { after: self.after })
            }
            other => other,
        };
        self.sink.reply(id, result);
    }
}

/// What is left of handling a frame when it must wait (all local buffers
/// full, or the peer not reading its answers): the reader awaits it before
/// the next frame. Rare, so boxed; the common path is a plain call.
type Later = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Acts on one frame from the peer without waiting; what must wait comes
/// back as a [`Later`].
fn handle(
    sink: &Arc<ConnSink>,
    bus: &EventBus,
    codecs: &mut CodecCache,
    frame: Frame<'_>,
) -> Option<Later> {
    match frame {
        // A request or a ping queues one answer: with no room for it, wait
        // (reading nothing) before taking it (see `room_for_answers`).
        f @ (Frame::Msg {
            mode: Mode::Request,
            ..
        }
        | Frame::Ping(_))
            if !sink.room_for_an_answer() =>
        {
            let (sink, bus, f) = (sink.clone(), bus.clone(), f.into_owned());
            Some(Box::pin(async move {
                sink.room_for_answers().await;
                let mut codecs = bus.codec_cache();
                if let Some(later) = handle_ready(&sink, &bus, &mut codecs, f) {
                    later.await;
                }
            }))
        }
        f => handle_ready(sink, bus, codecs, f),
    }
}

/// [`handle`] once there is room for the frame's answer, if it has one.
fn handle_ready(
    sink: &Arc<ConnSink>,
    bus: &EventBus,
    codecs: &mut CodecCache,
    frame: Frame<'_>,
) -> Option<Later> {
    let link = &sink.link;
    match frame {
        Frame::Msg {
            mode,
            id,
            timeout_ms,
            address,
            headers,
            codec,
            body,
        } => {
            let body = match codecs.decode(&codec, body) {
                Ok(b) => b,
                Err(e) => {
                    link.counters.decode_failures.add(1);
                    if mode == Mode::Request {
                        let f = fail_frame(
                            id,
                            &BusError::Cluster {
                                reason: format!("cannot decode the body: {e}"),
                            },
                        );
                        sink.answer(Out::Frame(f));
                    }
                    return None;
                }
            };
            let mut opts = DeliveryOptions::new().local_only(true);
            opts.headers = headers;
            match mode {
                // The headers move into the message (given back on a refusal).
                // Behind messages for the same address that wait for room,
                // or waiting itself: in the lane, in order.
                Mode::Send => {
                    let body = if link.lane.holds(&address) {
                        body
                    } else {
                        match bus.send_moving_headers(&address, body, &mut opts) {
                            Ok(()) => return None,
                            Err(e) if matches!(e.error, BusError::Full { .. }) => e.into_body(),
                            Err(e) => {
                                link.counters.inbound_undelivered.add(1);
                                tracing::debug!(%address, error = %e, "a message from another node found no consumer");
                                return None;
                            }
                        }
                    };
                    let (l, bus, address) = (link.clone(), bus.clone(), address.into_owned());
                    let key = address.clone();
                    wait_in_lane(sink, &key, async move {
                        if bus.send_wait(&address, body, &opts).await.is_err() {
                            l.counters.inbound_undelivered.add(1);
                        }
                    })
                }
                Mode::Publish => {
                    let _ = bus.publish_with(&address, body, &opts);
                    None
                }
                Mode::Request => {
                    opts.timeout = Duration::from_millis(u64::from(timeout_ms.max(1)));
                    let body = if link.lane.holds(&address) {
                        body
                    } else {
                        match bus.request_remote(&address, body, &opts, sink.clone(), id) {
                            Ok(()) => return None,
                            Err(e) if matches!(e.error, BusError::Full { .. }) => e.into_body(),
                            Err(e) => {
                                sink.answer(Out::Frame(fail_frame(id, &e.error)));
                                return None;
                            }
                        }
                    };
                    // Its timeout counts from its arrival (a clock read on
                    // this rare path only).
                    let deadline = Instant::now() + opts.timeout;
                    let (bus, s, address) = (bus.clone(), sink.clone(), address.into_owned());
                    let key = address.clone();
                    wait_in_lane(sink, &key, async move {
                        request_in_lane(&bus, &address, body, &opts, s, id, deadline).await;
                    })
                }
            }
        }
        Frame::Reply {
            id,
            headers,
            codec,
            body,
        } => {
            let result = codecs
                .decode(&codec, body)
                .map(|b| (headers, b))
                .map_err(|e| BusError::Cluster {
                    reason: format!("cannot decode the reply body: {e}"),
                });
            link.complete(id, result);
            None
        }
        Frame::Fail {
            id,
            kind,
            code,
            message,
        } => {
            let message = message.into_owned();
            let e = match kind {
                FailKind::Timeout => BusError::Timeout {
                    after: Duration::from_millis(u64::try_from(code).unwrap_or(0)),
                },
                FailKind::NoHandlers => BusError::NoHandlers { address: message },
                FailKind::RecipientFailure => BusError::RecipientFailure { code, message },
                FailKind::Error => BusError::Cluster { reason: message },
            };
            link.complete(id, Err(e));
            None
        }
        Frame::Ping(n) => {
            sink.answer(Out::Frame(Frame::Pong(n)));
            None
        }
        Frame::Pong(_) => None,
        Frame::Hello { .. } => {
            // Only valid as the first frame, which the acceptor consumed.
            tracing::warn!(peer = %link.peer, "unexpected HELLO on an open link; ignored");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_waits_are_spread_over_the_second_half_of_the_backoff() {
        let backoff = Duration::from_millis(400);
        let waits: Vec<Duration> = (0..200).map(|_| jittered(backoff)).collect();
        for w in &waits {
            assert!(
                (backoff / 2..=backoff).contains(w),
                "{w:?} outside [200 ms, 400 ms]"
            );
        }
        // 200 draws from 200 ms of nanoseconds: a fixed wait would give one
        // value; spread, they cover most of the range.
        let (lo, hi) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
        assert!(
            *hi - *lo > Duration::from_millis(150),
            "waits span only {lo:?}..{hi:?}"
        );
        assert_eq!(jittered(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn a_maps_ids_hash_to_consecutive_buckets_with_scattered_tags() {
        use std::hash::BuildHasher;
        let stride = PENDING_RUN * PENDING_SHARDS as u64;
        // The ids of map 3, in order: two runs of it, a stride apart.
        let ids: Vec<u64> = (0..2 * PENDING_RUN)
            .map(|i| (i / PENDING_RUN) * stride + 3 * PENDING_RUN + i % PENDING_RUN)
            .collect();
        let hashes: Vec<u64> = ids.iter().map(|&id| RunHash.hash_one(id)).collect();
        let place = |h: u64| h & !(0x7f << 57);
        for w in hashes.windows(2) {
            assert_eq!(place(w[1]), place(w[0]) + 1, "consecutive buckets");
        }
        let tags: std::collections::HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
        assert!(tags.len() > 32, "tags scattered: {} distinct", tags.len());
        // And it is a working map: out of order, with holes, across growth.
        let mut m: HashMap<u64, u64, RunHash> = HashMap::default();
        for id in (0..50_000u64).rev() {
            m.insert(id, id * 2);
        }
        for id in (0..50_000u64).step_by(3) {
            assert_eq!(m.remove(&id), Some(id * 2));
        }
        assert_eq!(m.len(), 50_000 - 50_000usize.div_ceil(3));
        assert_eq!(m.get(&49_999), Some(&99_998));
        assert_eq!(m.get(&49_998), None);
    }

    fn send_to(address: &str) -> RemoteMessage {
        RemoteMessage {
            address: Arc::from(address),
            kind: RemoteKind::Send,
            headers: Headers::new(),
            body: Body::new(String::from("x")),
            codec: None,
            reply: None,
        }
    }

    /// Takes what the bus hands a remote node, to get real reply handles.
    #[derive(Debug, Default)]
    struct Capture(parking_lot::Mutex<Vec<RemoteMessage>>);

    impl RemoteNode for Capture {
        fn id(&self) -> &str {
            "capture"
        }
        fn deliver(&self, msg: RemoteMessage) -> Result<(), Box<Undelivered>> {
            self.0.lock().push(msg);
            Ok(())
        }
    }

    /// `Pending`'s count follows its maps through inserts, removals, the
    /// walk that forgets abandoned requests, and the take that fails all.
    #[tokio::test]
    async fn pending_counts_requests_across_its_maps() {
        let bus = EventBus::new();
        let capture = Arc::new(Capture::default());
        bus.set_remote_nodes("far", vec![capture.clone() as Arc<dyn RemoteNode>]);
        // 40 requests: the first 20 kept waiting, the other 20 given up.
        let mut waiting = Vec::new();
        for i in 0..40 {
            let mut call = Box::pin(bus.request("far", String::from("q")));
            assert!(futures_util::poll!(call.as_mut()).is_pending());
            if i < 20 {
                waiting.push(call);
            }
        }
        let handles: Vec<ReplyHandle> = capture
            .0
            .lock()
            .drain(..)
            .map(|m| m.reply.expect("a request carries its reply handle"))
            .collect();
        assert_eq!(handles.len(), 40);
        let p = Pending::default();
        // Ids half a run apart, so the 40 spread over every map.
        for (id, h) in (1u64..).step_by(PENDING_RUN as usize / 2).zip(handles) {
            assert!(p.reserve(40));
            p.insert(id, h, || ());
        }
        assert_eq!(p.len(), 40);
        assert!(!p.reserve(40), "at the limit, no more");
        assert_eq!(p.len(), 40);
        assert!(p.remove(99).is_none());
        assert_eq!(p.len(), 40);
        let mut last = (0, 0);
        for shard in 0..PENDING_SHARDS {
            last = p.retain_in(shard, |h| !h.is_abandoned());
        }
        assert_eq!(last.1, 20);
        assert_eq!(p.len(), 20, "the 20 given up are forgotten");
        assert_eq!(p.remove(1).map(|(_, was)| was), Some(20));
        assert!(p.remove(1).is_none());
        assert_eq!(p.len(), 19);
        let mut saw_locked = false;
        let (taken, n, before) = p.take_all(|| saw_locked = true);
        assert!(saw_locked);
        assert_eq!((n, before, p.len()), (19, 19, 0));
        assert!(
            taken.iter().filter(|m| !m.is_empty()).count() > 1,
            "requests in several maps"
        );
        assert_eq!(taken.into_iter().map(|m| m.len()).sum::<usize>(), 19);
        drop(waiting);
    }

    #[test]
    fn a_link_whose_task_was_dropped_refuses_sends_instead_of_taking_them() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let cfg = Arc::new(LinkConfig {
            node_id: "a".into(),
            cluster: "c".into(),
            // One message fills the queue: after it, only a closed queue
            // has room.
            queue: 1,
            max_in_flight: 4,
            max_frame: 1 << 20,
            ping_interval: Duration::from_secs(60),
            ping_timeout: Duration::from_secs(120),
            handshake_timeout: Duration::from_secs(600),
            backoff_max: Duration::from_secs(60),
        });
        // "0" < "a": this side waits for the peer to dial, which it never
        // does (not marked down within the handshake timeout). A side that
        // dials a refusing port would be down after its first dial.
        let link = rt.block_on(async {
            let link = Link::start(
                "0".into(),
                "127.0.0.1:1".parse().unwrap(),
                cfg,
                EventBus::new(),
                Arc::new(ClusterCounters::default()),
            );
            tokio::task::yield_now().await;
            link
        });
        assert!(
            link.deliver(send_to("q")).is_ok(),
            "queued while the task lives"
        );
        assert!(!link.has_room(), "full while the task lives");
        // The runtime goes, and the link's task with it, before `run`
        // returns: the end of `run` never runs.
        drop(rt);
        let refused = link.deliver(send_to("q")).expect_err("refused");
        assert!(
            refused.error.to_string().contains("not reachable"),
            "{}",
            refused.error
        );
        assert!(
            link.has_room(),
            "waiters for room get their refusal at once"
        );
    }

    /// Waiters for room in a link's queue that gave up (timed out or
    /// dropped while blocked) leave their wakers until the writer takes a
    /// batch; a writer that takes none (the peer stalled, or not connected)
    /// must not let them pile up, one per request, for good.
    #[tokio::test]
    async fn waiters_for_room_that_gave_up_stay_bounded() {
        const REQUESTS: usize = 5_000;
        let cfg = Arc::new(LinkConfig {
            node_id: "b".into(),
            cluster: "c".into(),
            queue: 1,
            max_in_flight: 65_536,
            max_frame: 1 << 20,
            ping_interval: Duration::from_secs(60),
            ping_timeout: Duration::from_secs(120),
            handshake_timeout: Duration::from_secs(600),
            backoff_max: Duration::from_secs(60),
        });
        // "a" < "b": the link waits for "a" to dial, which it never does, so
        // nothing drains its queue.
        let bus = EventBus::new();
        let link = Link::start(
            "a".into(),
            "127.0.0.1:9".parse().unwrap(),
            cfg,
            bus.clone(),
            Arc::new(ClusterCounters::default()),
        );
        bus.set_remote_nodes("far", vec![link.clone() as Arc<dyn RemoteNode>]);
        bus.send("far", 1u8).unwrap();
        assert!(!link.has_room(), "one message fills the queue");
        // Each request blocks on the full link (a waker of its own), then
        // is given up, as a timeout does.
        struct Nobody;
        impl std::task::Wake for Nobody {
            fn wake(self: Arc<Self>) {}
        }
        let opts = DeliveryOptions::new().timeout(Duration::from_secs(60));
        for _ in 0..REQUESTS {
            let waker = Waker::from(Arc::new(Nobody));
            let mut call = Box::pin(bus.request_with("far", 1u8, &opts));
            let polled = std::future::Future::poll(call.as_mut(), &mut Context::from_waker(&waker));
            assert!(polled.is_pending(), "blocked on the full link");
            drop(call);
        }
        let kept = link.room_waiters.lock().len();
        // The bound doubles at each wake-all (as in the bus's queue), so
        // 5,000 registrations fit in 1,024 + 2,048 + 4,096.
        assert!(
            kept <= 4 * RoomWaiters::BASE_BOUND,
            "{kept} wakers kept for {REQUESTS} requests that gave up"
        );
    }

    #[test]
    fn fill_to_stops_at_the_bound_without_losing_an_item() {
        let mut queue: std::collections::VecDeque<u8> = (0..10).collect();
        let mut buf = BytesMut::new();
        // Each item encodes as 4 bytes: after 3 items the buffer holds 12 > 10.
        fill_to(
            &mut buf,
            10,
            || queue.pop_front(),
            |x, b| b.extend_from_slice(&[x; 4]),
        );
        assert_eq!(buf.len(), 12);
        assert_eq!(&buf[..], &[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]);
        // Everything not encoded is still queued, in order.
        assert_eq!(queue, (3..10).collect::<Vec<_>>());
        // A buffer already past the bound takes nothing.
        fill_to(&mut buf, 10, || queue.pop_front(), |_, _| unreachable!());
        assert_eq!(queue.len(), 7);
    }
}
