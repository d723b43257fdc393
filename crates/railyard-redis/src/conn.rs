//! One task per node owns that node's socket; handles talk to it over a
//! bounded channel and get their reply on a oneshot.
//!
//! The task pipelines: it writes every queued command as soon as it arrives
//! (batched into one buffer per wake-up) and matches replies to requests in
//! order. A request may carry several commands that must go out back to back
//! on one connection (`ASKING` + the command); its reply is the last one.
//!
//! # Back-pressure
//! The command queue holds `queue_capacity` requests; when it is full,
//! [`NodeConn::request`] fails at once with [`RedisError::QueueFull`] and the
//! command is not sent. At most `max_in_flight` requests are written and
//! awaiting replies; beyond that the task stops reading its queue.
//!
//! # Reply size
//! The read buffer holds the reply being received, which may not be larger
//! than `max_reply` (`ClusterClientBuilder::max_reply_size`, default 512 MiB):
//! after every read a walk over the new bytes' type headers checks it, and a
//! reply that declares a longer string or more elements, or that is still
//! incomplete at that size, is a malformed reply (below). A read adds at most
//! the buffer's spare capacity, and the buffer at most doubles to make room,
//! so one connection's read buffer stays under about twice the limit. A reply
//! nested deeper than 64 levels is malformed too: decoding it would overflow
//! the stack.
//!
//! The walk resumes where the previous read left it, and the recursive
//! decoder runs once per reply, when the walk has found its last byte: a
//! reply that takes many reads (`LRANGE` of a million elements, 10 MB in
//! 64 KiB reads) costs one pass over its headers and one decode, not one of
//! each per read.
//!
//! # Where replies are decoded
//! The task serves every caller of its node, so it must not block for long
//! (the project allows an async task about 0.5 ms). The walk is cheap and
//! incremental; decoding costs some 60 to 200 ns per value, so an `LRANGE`
//! of 100,000 elements would hold the task for 6 to 20 ms. The task
//! therefore decodes only replies whose decoder would read at most
//! [`DECODE_ON_TASK_MAX`](crate::value::DECODE_ON_TASK_MAX) (4 KiB) bytes,
//! bulk-string payloads excepted: the decoder slices those out without
//! reading them, so a `GET` of a 50 MB value is still decoded here, in
//! microseconds. That is nearly every reply: single values, error replies
//! (so MOVED/ASK arrive decoded), and small aggregates keep the path they
//! always had. A bigger reply is split off the read buffer as it is,
//! without a copy, and sent to the caller undecoded; [`NodeConn::request`]
//! decodes it on the runtime's blocking pool, within the command's timeout,
//! because the caller's task is an async worker too. The caller then sees
//! the same [`Value`] (and an error reply the same [`Value::Error`]) as when
//! the task decoded it.
//!
//! A handed-off reply that the decoder refuses (something wrong inside a
//! header the walk does not check, like an integer that is not a number)
//! fails only its own request with [`RedisError::Protocol`]: the walk
//! found where it ends, so the connection's framing is intact and the
//! connection stays open. The same fault in a reply decoded on the task
//! closes the connection, as before.
//!
//! # Failure
//! A malformed reply (but for a handed-off one, above) or an I/O error
//! closes the socket; every request in flight gets the error
//! ([`RedisError::Protocol`] / [`RedisError::Io`]).
//! The task then reconnects with exponential backoff, failing queued
//! requests fast with [`RedisError::Disconnected`] meanwhile, and fires the
//! adaptive refresh trigger after `reconnects_before_refresh` failed attempts.
//! The task ends when every handle is dropped.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::error::RedisError;
use crate::refresh::{Reason, Trigger};
use crate::value::{Cmd, Framed, Protocol, Reply, ReplyDecoder, Value, DECODE_ON_TASK_MAX};

/// Settings every node connection shares.
#[derive(Debug, Clone)]
pub(crate) struct ConnConfig {
    pub(crate) connect_timeout: Duration,
    pub(crate) queue_capacity: usize,
    pub(crate) max_in_flight: usize,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) reconnects_before_refresh: u32,
    pub(crate) protocol: Protocol,
    /// Send `READONLY` after connecting (replica reads).
    pub(crate) readonly: bool,
    /// Largest reply in bytes; see [`crate::ClusterClientBuilder::max_reply_size`].
    pub(crate) max_reply: usize,
}

/// What a request's oneshot carries: a reply, decoded or not, or why there
/// is none.
type ReplyTx = oneshot::Sender<Result<Reply, RedisError>>;

struct Request {
    bytes: Bytes,
    replies: usize,
    tx: ReplyTx,
}

struct Pending {
    remaining: usize,
    tx: ReplyTx,
}

#[derive(Debug, Default)]
pub(crate) struct ConnStats {
    connected: AtomicBool,
    /// Successful connects; more than one means reconnects happened.
    pub(crate) connects: AtomicU64,
}

/// A handle to a node's connection task. Cheap to clone.
#[derive(Clone)]
pub(crate) struct NodeConn {
    tx: mpsc::Sender<Request>,
    addr: Arc<str>,
    stats: Arc<ConnStats>,
    capacity: usize,
}

impl std::fmt::Debug for NodeConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeConn")
            .field("addr", &self.addr)
            .finish()
    }
}

impl NodeConn {
    /// Spawns the connection task for `addr` on `rt`.
    pub(crate) fn spawn(
        rt: &tokio::runtime::Handle,
        addr: Arc<str>,
        cfg: ConnConfig,
        trigger: Option<Trigger>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(cfg.queue_capacity);
        let stats = Arc::new(ConnStats::default());
        let capacity = cfg.queue_capacity;
        rt.spawn(run(addr.clone(), cfg, rx, stats.clone(), trigger));
        Self {
            tx,
            addr,
            stats,
            capacity,
        }
    }

    /// Whether the socket is up right now.
    pub(crate) fn is_connected(&self) -> bool {
        self.stats.connected.load(Ordering::Relaxed)
    }

    /// Whether the task has ended (it only does when every handle is gone or
    /// the runtime shut down).
    pub(crate) fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Sends `cmds` back to back and returns the last reply.
    ///
    /// A reply the connection's task left undecoded (too big to decode
    /// there) is decoded on the blocking pool before it is returned; the
    /// timeout covers that too.
    ///
    /// # Errors
    /// [`RedisError::QueueFull`], [`RedisError::Timeout`], whatever the
    /// connection reports, [`RedisError::Protocol`] for a handed-off reply
    /// the decoder refuses, and [`RedisError::Shutdown`] when the runtime
    /// shuts down before decoding it.
    ///
    /// # Cancel safety
    /// Dropping the future abandons the reply; the command may still run,
    /// and a decode already started finishes on its blocking thread.
    pub(crate) async fn request(
        &self,
        cmds: &[&Cmd],
        timeout: Duration,
    ) -> Result<Value, RedisError> {
        let mut buf = BytesMut::new();
        for c in cmds {
            c.encode_into(&mut buf);
        }
        self.request_raw(buf.freeze(), cmds.len(), timeout).await
    }

    pub(crate) async fn request_raw(
        &self,
        bytes: Bytes,
        replies: usize,
        timeout: Duration,
    ) -> Result<Value, RedisError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .try_send(Request { bytes, replies, tx })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => RedisError::QueueFull {
                    node: self.addr.clone(),
                    capacity: self.capacity,
                },
                mpsc::error::TrySendError::Closed(_) => RedisError::Shutdown,
            })?;
        let reply = async {
            match rx.await {
                Ok(Ok(Reply::Value(v))) => Ok(v),
                Ok(Ok(Reply::Framed(f))) => decode_framed(&self.addr, f).await,
                Ok(Err(e)) => Err(e),
                Err(_) => Err(RedisError::Disconnected {
                    node: self.addr.clone(),
                }),
            }
        };
        match tokio::time::timeout(timeout, reply).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::Timeout {
                node: self.addr.clone(),
                timeout,
            }),
        }
    }
}

/// Decodes a reply the connection's task handed off undecoded, on the
/// blocking pool (see "Where replies are decoded" above).
async fn decode_framed(node: &Arc<str>, f: Framed) -> Result<Value, RedisError> {
    match f.decode_on_blocking_pool().await {
        Some(Ok(v)) => Ok(v),
        Some(Err(detail)) => Err(RedisError::Protocol {
            node: node.clone(),
            detail,
        }),
        None => Err(RedisError::Shutdown),
    }
}

enum End {
    /// Every handle is gone: stop.
    Closed,
    /// The socket failed: reconnect.
    Failed(RedisError),
}

async fn run(
    addr: Arc<str>,
    cfg: ConnConfig,
    mut rx: mpsc::Receiver<Request>,
    stats: Arc<ConnStats>,
    trigger: Option<Trigger>,
) {
    let mut backoff = cfg.backoff_min;
    let mut failures: u32 = 0;
    loop {
        match connect(&addr, &cfg).await {
            Ok(stream) => {
                stats.connected.store(true, Ordering::Relaxed);
                stats.connects.fetch_add(1, Ordering::Relaxed);
                failures = 0;
                backoff = cfg.backoff_min;
                let end = serve(&addr, stream, &mut rx, &cfg).await;
                stats.connected.store(false, Ordering::Relaxed);
                match end {
                    End::Closed => return,
                    End::Failed(e) => {
                        tracing::warn!(node = %addr, error = %e, "redis connection lost; reconnecting");
                        if let Some(t) = &trigger {
                            t.fire(Reason::ConnectionLost);
                        }
                    }
                }
            }
            Err(e) => {
                failures += 1;
                tracing::debug!(node = %addr, error = %e, failures, "redis connect failed");
                if failures >= cfg.reconnects_before_refresh {
                    if let Some(t) = &trigger {
                        t.fire(Reason::Reconnects);
                    }
                }
            }
        }
        // Back off, answering queued requests at once rather than letting
        // them wait for a node that may be gone for good.
        let sleep = tokio::time::sleep(backoff);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                () = &mut sleep => break,
                req = rx.recv() => match req {
                    None => return,
                    Some(r) => {
                        let _ = r.tx.send(Err(RedisError::Disconnected { node: addr.clone() }));
                    }
                },
            }
        }
        backoff = (backoff * 2).min(cfg.backoff_max);
    }
}

async fn connect(addr: &Arc<str>, cfg: &ConnConfig) -> Result<TcpStream, RedisError> {
    let io = |e: std::io::Error| RedisError::Io {
        node: addr.clone(),
        source: Arc::new(e),
    };
    let fut = async {
        let mut s = TcpStream::connect(&**addr).await.map_err(io)?;
        s.set_nodelay(true).map_err(io)?;
        let mut hello = Vec::new();
        if cfg.protocol == Protocol::Resp3 {
            hello.push(Cmd::new("HELLO").arg("3"));
        }
        if cfg.readonly {
            hello.push(Cmd::new("READONLY"));
        }
        let mut rbuf = BytesMut::new();
        // HELLO's own reply is already in the negotiated protocol, so one
        // decoder serves the whole handshake.
        let mut replies = ReplyDecoder::new(cfg.protocol, cfg.max_reply);
        for c in &hello {
            s.write_all(&c.encode()).await.map_err(io)?;
            let reply = loop {
                if let Some(r) =
                    replies
                        .next_reply(&mut rbuf)
                        .map_err(|detail| RedisError::Protocol {
                            node: addr.clone(),
                            detail,
                        })?
                {
                    break r;
                }
                if s.read_buf(&mut rbuf).await.map_err(io)? == 0 {
                    return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
                }
            };
            let v = match reply {
                Reply::Value(v) => v,
                Reply::Framed(f) => decode_framed(addr, f).await?,
            };
            if let Value::Error(e) = v {
                return Err(RedisError::Server {
                    node: addr.clone(),
                    kind: e.split(' ').next().unwrap_or("ERR").to_owned(),
                    message: format!("during {} handshake: {e}", c.name()),
                });
            }
        }
        Ok(s)
    };
    match tokio::time::timeout(cfg.connect_timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(RedisError::Timeout {
            node: addr.clone(),
            timeout: cfg.connect_timeout,
        }),
    }
}

/// Initial read buffer per connection.
const READ_BUF: usize = 4096;

/// Largest write buffer before the task stops taking new requests until the
/// socket drains.
const MAX_WRITE_BUF: usize = 1 << 20;

async fn serve(
    addr: &Arc<str>,
    stream: TcpStream,
    rx: &mut mpsc::Receiver<Request>,
    cfg: &ConnConfig,
) -> End {
    let (mut rd, mut wr) = stream.into_split();
    // Small to start: a client of a 1000-node cluster holds 1000 of these.
    let mut rbuf = BytesMut::with_capacity(READ_BUF);
    // Where the walk over the reply arriving at `rbuf`'s front got to.
    let mut replies = ReplyDecoder::new(cfg.protocol, cfg.max_reply);
    let mut wbuf = BytesMut::new();
    let mut pending: VecDeque<Pending> = VecDeque::with_capacity(64);
    let io = |e: std::io::Error| RedisError::Io {
        node: addr.clone(),
        source: Arc::new(e),
    };
    let end = loop {
        let can_take = pending.len() < cfg.max_in_flight && wbuf.len() < MAX_WRITE_BUF;
        if rbuf.is_empty() && rbuf.capacity() > 16 * READ_BUF {
            // A big reply (CLUSTER NODES) grew the buffer: give the memory
            // back. Empty, it holds no part of a reply `replies` has walked.
            rbuf = BytesMut::with_capacity(READ_BUF);
        } else if rbuf.capacity() - rbuf.len() < READ_BUF / 2 {
            rbuf.reserve(READ_BUF.max(rbuf.len()));
        }
        if wbuf.is_empty() && wbuf.capacity() > MAX_WRITE_BUF {
            wbuf = BytesMut::new();
        }
        tokio::select! {
            biased;
            r = rd.read_buf(&mut rbuf) => {
                match r {
                    Ok(0) => break End::Failed(io(std::io::ErrorKind::UnexpectedEof.into())),
                    Ok(_) => {}
                    Err(e) => break End::Failed(io(e)),
                }
                // Many small replies in one read add up: the task yields
                // between turns of at most DECODE_ON_TASK_MAX decoded bytes.
                let mut failed = None;
                loop {
                    match dispatch(addr, &mut rbuf, &mut replies, &mut pending) {
                        Ok(Turn::Done) => break,
                        Ok(Turn::More) => tokio::task::yield_now().await,
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                if let Some(e) = failed {
                    break End::Failed(e);
                }
            }
            r = wr.write_buf(&mut wbuf), if !wbuf.is_empty() => {
                if let Err(e) = r {
                    break End::Failed(io(e));
                }
            }
            req = rx.recv(), if can_take => {
                let Some(req) = req else { break End::Closed };
                take(req, &mut wbuf, &mut pending);
                while pending.len() < cfg.max_in_flight && wbuf.len() < MAX_WRITE_BUF {
                    match rx.try_recv() {
                        Ok(req) => take(req, &mut wbuf, &mut pending),
                        Err(_) => break,
                    }
                }
            }
        }
    };
    if let End::Failed(e) = &end {
        for p in pending.drain(..) {
            let _ = p.tx.send(Err(e.clone()));
        }
    }
    end
}

fn take(req: Request, wbuf: &mut BytesMut, pending: &mut VecDeque<Pending>) {
    // A caller that already gave up (timeout, dropped future) still gets its
    // command written if it was queued: the reply slot keeps replies in order.
    wbuf.extend_from_slice(&req.bytes);
    pending.push_back(Pending {
        remaining: req.replies.max(1),
        tx: req.tx,
    });
}

/// Whether [`dispatch`] took every complete reply in the buffer.
enum Turn {
    Done,
    /// It stopped after decoding [`DECODE_ON_TASK_MAX`] bytes: yield, then
    /// call it again.
    More,
}

/// Hands the complete replies at the front of `rbuf` to their requests, in
/// order, until the buffer holds no complete reply or the replies decoded
/// here have cost [`DECODE_ON_TASK_MAX`] bytes of decoding in this turn.
fn dispatch(
    addr: &Arc<str>,
    rbuf: &mut BytesMut,
    replies: &mut ReplyDecoder,
    pending: &mut VecDeque<Pending>,
) -> Result<Turn, RedisError> {
    let mut decoded = 0usize;
    loop {
        if decoded >= DECODE_ON_TASK_MAX {
            return Ok(Turn::More);
        }
        // Decoded here if cheap, else framed for the caller to decode.
        let r = match replies.next_reply(rbuf) {
            Ok(Some(r)) => r,
            Ok(None) => return Ok(Turn::Done),
            Err(detail) => {
                return Err(RedisError::Protocol {
                    node: addr.clone(),
                    detail,
                })
            }
        };
        decoded += replies.last_read();
        let Some(front) = pending.front_mut() else {
            return Err(RedisError::Protocol {
                node: addr.clone(),
                detail: format!("a reply ({}) arrived with no request waiting", r.describe()),
            });
        };
        front.remaining -= 1;
        // An earlier reply of the request (`ASKING`'s) is dropped, even
        // one left undecoded: only the last is the caller's.
        if front.remaining == 0 {
            if let Some(p) = pending.pop_front() {
                let _ = p.tx.send(Ok(r));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many small replies in one read are handed out in turns of at most
    /// DECODE_ON_TASK_MAX decoded bytes, so the task yields between them.
    #[test]
    fn dispatch_stops_after_a_turns_worth_of_decoding() {
        let addr: Arc<str> = "node".into();
        let n = 2_000;
        let mut rbuf = BytesMut::new();
        let mut pending = VecDeque::new();
        let mut answers = Vec::new();
        for _ in 0..n {
            rbuf.extend_from_slice(b"+OK\r\n");
            let (tx, rx) = oneshot::channel();
            pending.push_back(Pending { remaining: 1, tx });
            answers.push(rx);
        }
        let mut replies = ReplyDecoder::new(Protocol::Resp2, 1 << 20);
        let mut turns = 0;
        while let Turn::More = dispatch(&addr, &mut rbuf, &mut replies, &mut pending).unwrap() {
            turns += 1;
            assert!(turns < 100, "dispatch never finished");
        }
        // 5 bytes read per reply: about 820 replies a turn, so two full
        // turns and a last one.
        assert_eq!(turns + 1, n * 5 / DECODE_ON_TASK_MAX + 1);
        assert!(pending.is_empty() && rbuf.is_empty());
        for mut rx in answers {
            assert!(matches!(rx.try_recv(), Ok(Ok(Reply::Value(_)))));
        }
    }
}
