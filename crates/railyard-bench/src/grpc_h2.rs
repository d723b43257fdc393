//! A lean HTTP/2 client connection for the load generator's gRPC calls
//! (framing as in RFC 9113; response headers decoded with `loona-hpack`,
//! RFC 7541).
//!
//! # Why hand-written
//! The Omega load makes one unary call per saga event, 64,000 a second at
//! 8,000 transactions/s, on the same two cores as the coordinator it
//! measures. Through the `h2` crate each call went through its stream
//! store, prioritizer, send and receive queues, `http` header maps and a
//! task hand-off to the connection: a profile (`perf record -F 499
//! --call-graph dwarf` around `railyard bench saga --protocol omega
//! --transactions 30000`) put `h2` at 43 % of the load generator's samples
//! and the load generator at 33 % of all. A unary gRPC call needs much less:
//! a constant header block, one DATA frame, and at the end one message and
//! a `grpc-status`. This module does only that, so the cores go to the
//! coordinator. It is the bench's client, not a general one.
//!
//! # What it speaks
//! - requests: a HEADERS frame whose block uses only static-table indexes
//!   and literals without indexing (so the server's decoder table is never
//!   touched), then the gRPC-framed message in DATA frames within the
//!   server's flow-control windows and frame size, `END_STREAM` on the last
//!   (a server stream's request stays open until [`ServerStream`] is
//!   dropped, which resets it; a unary call dropped before its answer
//!   resets its stream too, so its slot comes back); a stream short of its
//!   own window does not hold up the ones behind it;
//! - answers: HEADERS (and CONTINUATION) blocks decoded in order, so the
//!   dynamic table stays in step; DATA gathered per stream; `:status` 200
//!   and `grpc-status` checked; RST_STREAM fails its call; GOAWAY fails the
//!   streams it did not process and every later call, while the streams it
//!   did run to their end (the connection closes after the last);
//! - the connection: SETTINGS acknowledged and applied (initial window,
//!   frame size, concurrent streams: calls beyond the server's limit wait),
//!   PING answered, receive windows (2 MiB per stream, 5 MiB per connection,
//!   as hyper's client) given back as data is taken (padding at once);
//!   window overflows and zero increments refused as RFC 9113 §6.9 says (a
//!   stream's: that stream is reset and its call fails);
//! - not: server push (disabled in SETTINGS), priorities (ignored),
//!   compression, request trailers, TLS.
//!
//! Writes of concurrent calls are gathered: callers append frames to one
//! buffer and a writer task, after yielding once to the other ready tasks,
//! sends whatever has gathered since its last write, as grpc-java (Omega's
//! transport) flushes once per batch.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use railyard_saga::grpc_frame::{self, PREFIX};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Notify, Semaphore};
use tokio::task::JoinHandle;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEAD: usize = 9;

// Frame types (RFC 9113 §6).
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PUSH_PROMISE: u8 = 0x5;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;

// Flags.
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

// Settings (RFC 9113 §6.5.2).
const SETTINGS_ENABLE_PUSH: u16 = 0x2;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;
const SETTINGS_MAX_FRAME_SIZE: u16 = 0x5;

// Error codes (RFC 9113 §7).
const PROTOCOL_ERROR: u32 = 0x1;
const FLOW_CONTROL_ERROR: u32 = 0x3;
const CANCEL: u32 = 0x8;

/// The protocol's initial flow-control window and frame size.
const DEFAULT_WINDOW: i64 = 65_535;
const DEFAULT_MAX_FRAME: usize = 16_384;
const MAX_WINDOW: i64 = (1 << 31) - 1;
/// The receive windows granted: hyper's client's (2 MiB per stream, 5 MiB
/// per connection), so the flow-control traffic is what it was.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONN_WINDOW: u32 = 5 * 1024 * 1024;
/// Concurrent streams when the server sets no limit.
const UNLIMITED_STREAMS: u32 = 10_000;
/// The largest answer message (a compensation command carries payloads).
pub(crate) const MAX_MESSAGE: usize = 16 * 1024 * 1024;
/// The largest header block accepted (HEADERS plus CONTINUATION).
const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// The dynamic table size this client decodes with (the protocol's default,
/// which it never changes in SETTINGS).
const HEADER_TABLE_SIZE: usize = 4096;

/// Why a call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum CallError {
    /// The connection failed or was closed; no later call on it succeeds.
    #[error("HTTP/2 connection: {0}")]
    Connection(Arc<str>),
    /// The server reset the stream.
    #[error("HTTP/2 stream reset by the server (error code {0:#x})")]
    Reset(u32),
    /// The server answered with a non-zero `grpc-status`.
    #[error("gRPC status {code}: {message}")]
    Status {
        /// The status code.
        code: String,
        /// `grpc-message`, if any.
        message: String,
    },
    /// The answer is not a well-formed gRPC answer.
    #[error("malformed answer: {0}")]
    Malformed(String),
}

fn broken(why: impl Into<String>) -> CallError {
    CallError::Connection(Arc::from(why.into()))
}

// ------------------------------------------------------------ encoding --

/// Appends an HPACK integer (RFC 7541 §5.1) with an `n`-bit prefix, the
/// prefix byte's other bits set from `flags`.
fn put_int(out: &mut Vec<u8>, value: usize, n: u8, flags: u8) {
    // Cannot fail: it writes into a `Vec`.
    let _ = loona_hpack::encoder::encode_integer_into(value, n, flags, out);
}

/// Appends a string literal without Huffman coding (RFC 7541 §5.2).
fn put_str(out: &mut Vec<u8>, s: &str) {
    put_int(out, s.len(), 7, 0);
    out.extend_from_slice(s.as_bytes());
}

/// A literal without indexing whose name is static-table entry `index`.
fn put_literal(out: &mut Vec<u8>, index: usize, value: &str) {
    put_int(out, index, 4, 0);
    put_str(out, value);
}

/// A literal without indexing with a literal name.
fn put_named(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(0);
    put_str(out, name);
    put_str(out, value);
}

/// The header block of a gRPC `POST` to `path` at `authority`, with
/// `extra` fields (lower-case names) after the required ones. It uses no
/// dynamic table, so the same bytes serve every call.
pub(crate) fn request_block(authority: &str, path: &str, extra: &[(&str, &str)]) -> Bytes {
    // Static-table indexes used (RFC 7541 Appendix A): 1 :authority,
    // 3 :method POST, 4 :path, 6 :scheme http, 31 content-type.
    let mut out = Vec::with_capacity(128);
    out.push(0x80 | 3);
    out.push(0x80 | 6);
    put_literal(&mut out, 4, path);
    put_literal(&mut out, 1, authority);
    put_literal(&mut out, 31, "application/grpc");
    put_named(&mut out, "te", "trailers");
    for (name, value) in extra {
        match *name {
            "user-agent" => put_literal(&mut out, 58, value),
            _ => put_named(&mut out, name, value),
        }
    }
    Bytes::from(out)
}

fn put_head(out: &mut BytesMut, len: usize, kind: u8, flags: u8, stream: u32) {
    out.put_uint(len as u64, 3);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream & 0x7fff_ffff);
}

fn put_window_update(out: &mut BytesMut, stream: u32, increment: u32) {
    put_head(out, 4, WINDOW_UPDATE, 0, stream);
    out.put_u32(increment);
}

fn put_reset(out: &mut BytesMut, stream: u32, code: u32) {
    put_head(out, 4, RST_STREAM, 0, stream);
    out.put_u32(code);
}

// ------------------------------------------------------------- framing --

struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Bytes,
}

/// Cuts the next whole frame off `buf`, if one is there.
fn next_frame(buf: &mut BytesMut) -> Result<Option<Frame>, CallError> {
    if buf.len() < FRAME_HEAD {
        return Ok(None);
    }
    let len = (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
    if len > DEFAULT_MAX_FRAME {
        // This client never raises SETTINGS_MAX_FRAME_SIZE.
        return Err(broken(format!(
            "the server sent a {len}-byte frame; the limit is {DEFAULT_MAX_FRAME}"
        )));
    }
    if buf.len() < FRAME_HEAD + len {
        return Ok(None);
    }
    let head = buf.split_to(FRAME_HEAD);
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    Ok(Some(Frame {
        kind: head[3],
        flags: head[4],
        stream,
        payload: buf.split_to(len).freeze(),
    }))
}

/// A DATA or HEADERS payload without its padding (and, for HEADERS, its
/// priority fields).
fn unpad(mut payload: Bytes, flags: u8, priority: bool) -> Result<Bytes, CallError> {
    let pad = if flags & PADDED != 0 {
        if payload.is_empty() {
            return Err(broken("a padded frame without its pad length"));
        }
        usize::from(payload.get_u8())
    } else {
        0
    };
    if priority && flags & PRIORITY != 0 {
        if payload.len() < 5 {
            return Err(broken("a HEADERS frame too short for its priority"));
        }
        payload.advance(5);
    }
    if pad > payload.len() {
        return Err(broken("padding longer than the frame"));
    }
    payload.truncate(payload.len() - pad);
    Ok(payload)
}

// --------------------------------------------------------------- state --

/// What a stream's answer goes to.
enum Sink {
    /// A unary call: the one message, or why not.
    Unary(oneshot::Sender<Result<Bytes, CallError>>),
    /// A server stream: messages queue until taken.
    Stream(StreamSink),
}

#[derive(Default)]
struct StreamSink {
    /// Told when the answer's head arrived (or the stream failed first).
    head: Option<oneshot::Sender<Result<(), CallError>>>,
    messages: VecDeque<Bytes>,
    /// How the stream ended, once it has.
    end: Option<Result<(), CallError>>,
    waker: Option<std::task::Waker>,
}

struct Stream {
    send_window: i64,
    /// Request bytes waiting for flow-control window.
    unsent: Bytes,
    /// Whether the request ends with `unsent`.
    end: bool,
    got_head: bool,
    /// A unary answer's bytes received and not yet given back to the
    /// stream's window (given back in halves of it, as `h2` does, so a
    /// small answer costs no WINDOW_UPDATE).
    recv_unreturned: u32,
    /// Answer bytes not yet split into messages.
    data: BytesMut,
    sink: Sink,
}

struct State {
    out: BytesMut,
    next_id: u32,
    streams: HashMap<u32, Stream, foldhash::fast::RandomState>,
    /// Connection-level send window.
    send_window: i64,
    /// The server's SETTINGS_INITIAL_WINDOW_SIZE.
    initial_window: i64,
    /// The server's SETTINGS_MAX_FRAME_SIZE.
    max_frame: usize,
    /// Stream slots handed to the semaphore so far.
    max_streams: u32,
    /// Slots to keep when streams end instead of handing them back: what a
    /// lowered limit could not take from the free slots at once.
    slots_owed: u32,
    /// Streams with request bytes waiting for window, oldest first.
    blocked: VecDeque<u32>,
    /// Connection-level bytes received and not yet given back.
    recv_unreturned: u32,
    decoder: loona_hpack::Decoder<'static>,
    /// A header block waiting for its CONTINUATION frames.
    continuation: Option<(u32, u8, BytesMut)>,
    /// Server streams that ended, kept until their reader has taken their
    /// last messages and how they ended.
    ended: HashMap<u32, StreamSink, foldhash::fast::RandomState>,
    /// The connection is dead: every stream failed, the writer stops.
    failed: Option<CallError>,
    /// The server sent GOAWAY: no new stream, but the streams it will
    /// still process run to their end, so reading and writing go on.
    goaway: Option<CallError>,
}

struct Shared {
    state: Mutex<State>,
    writer: Notify,
    slots: Semaphore,
}

impl Shared {
    /// A connection's state before any frame: the protocol's defaults,
    /// and no limit on concurrent streams until the server's SETTINGS set
    /// one (RFC 9113 §6.5.2).
    fn new() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        Self {
            state: Mutex::new(State {
                out: BytesMut::with_capacity(64 * 1024),
                next_id: 1,
                streams: HashMap::default(),
                send_window: DEFAULT_WINDOW,
                initial_window: DEFAULT_WINDOW,
                max_frame: DEFAULT_MAX_FRAME,
                max_streams: UNLIMITED_STREAMS,
                slots_owed: 0,
                blocked: VecDeque::new(),
                recv_unreturned: 0,
                decoder,
                continuation: None,
                ended: HashMap::default(),
                failed: None,
                goaway: None,
            }),
            writer: Notify::new(),
            slots: Semaphore::new(UNLIMITED_STREAMS as usize),
        }
    }
}

/// The head fields this client reads.
#[derive(Default)]
struct Head {
    status: Option<Vec<u8>>,
    grpc_status: Option<Vec<u8>>,
    grpc_message: Option<Vec<u8>>,
}

impl Head {
    /// `grpc-status` as the call's result: `Ok` for 0.
    fn grpc(&self) -> Result<(), CallError> {
        match self.grpc_status.as_deref() {
            Some(b"0") => Ok(()),
            Some(code) => Err(CallError::Status {
                code: String::from_utf8_lossy(code).into_owned(),
                message: self
                    .grpc_message
                    .as_deref()
                    .map(|m| String::from_utf8_lossy(m).into_owned())
                    .unwrap_or_default(),
            }),
            None => Err(CallError::Malformed(
                "the answer ended without a grpc-status".into(),
            )),
        }
    }
}

impl State {
    /// Why a new stream cannot be opened, if it cannot.
    fn refusal(&self) -> Option<CallError> {
        self.failed.as_ref().or(self.goaway.as_ref()).cloned()
    }

    /// Fails every stream, every call waiting for a slot and every later
    /// call with `e`.
    fn fail(&mut self, shared: &Shared, e: CallError) {
        if self.failed.is_none() {
            self.failed = Some(e.clone());
        }
        shared.slots.close();
        let streams: Vec<(u32, Stream)> = self.streams.drain().collect();
        for (id, s) in streams {
            self.finish(id, s.sink, Err(e.clone()));
        }
        self.blocked.clear();
    }

    /// Removes stream `id` and ends its call with `result` (for a unary
    /// call, its message).
    fn close(&mut self, shared: &Shared, id: u32, result: Result<Bytes, CallError>) {
        if let Some(s) = self.streams.remove(&id) {
            self.finish(id, s.sink, result);
            if self.slots_owed > 0 {
                self.slots_owed -= 1;
            } else {
                shared.slots.add_permits(1);
            }
        }
    }

    /// Resets stream `id` if it is still open (its caller gave up on it)
    /// and hands its slot back; whether the writer must be woken.
    fn cancel(&mut self, shared: &Shared, id: u32) -> bool {
        if !self.streams.contains_key(&id) {
            return false;
        }
        let wake = self.out.is_empty();
        put_reset(&mut self.out, id, CANCEL);
        self.close(shared, id, Err(broken("cancelled")));
        wake
    }

    /// Ends a call: a unary call gets `result`; a server stream records how
    /// it ended (its `Ok` value is unused), wakes its reader and waits in
    /// `ended` for it.
    fn finish(&mut self, id: u32, sink: Sink, result: Result<Bytes, CallError>) {
        match sink {
            Sink::Unary(tx) => {
                let _ = tx.send(result);
            }
            Sink::Stream(mut sink) => {
                let result = result.map(|_| ());
                if let Some(tx) = sink.head.take() {
                    let _ = tx.send(result.clone());
                }
                sink.end = Some(result);
                if let Some(w) = sink.waker.take() {
                    w.wake();
                }
                self.ended.insert(id, sink);
            }
        }
    }

    /// Sends as much of stream `id`'s request as the windows allow; `true`
    /// when all of it is out.
    fn send_data(&mut self, id: u32) -> bool {
        let Some(s) = self.streams.get_mut(&id) else {
            return true;
        };
        loop {
            if s.unsent.is_empty() && !s.end {
                return true;
            }
            let room = self.send_window.min(s.send_window).max(0) as usize;
            let n = s.unsent.len().min(room).min(self.max_frame);
            if n == 0 && !s.unsent.is_empty() {
                return false;
            }
            let chunk = s.unsent.split_to(n);
            let last = s.unsent.is_empty();
            let flags = if last && s.end { END_STREAM } else { 0 };
            put_head(&mut self.out, n, DATA, flags, id);
            self.out.extend_from_slice(&chunk);
            self.send_window -= n as i64;
            s.send_window -= n as i64;
            if last {
                s.end = false;
                return true;
            }
        }
    }

    /// Retries the streams waiting for window, oldest first. A stream short
    /// of its *own* window keeps its place without holding up the ones
    /// behind it; only an empty connection window stops the round.
    fn unblock(&mut self) {
        let mut i = 0;
        while i < self.blocked.len() && self.send_window > 0 {
            if self.send_data(self.blocked[i]) {
                self.blocked.remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Handles one frame from the server.
    fn on_frame(&mut self, shared: &Shared, f: Frame) -> Result<(), CallError> {
        if let Some((id, _, _)) = &self.continuation {
            if f.kind != CONTINUATION || f.stream != *id {
                return Err(broken("a header block interrupted before its end"));
            }
        }
        match f.kind {
            DATA => self.on_data(shared, f),
            HEADERS => {
                let block = unpad(f.payload, f.flags, true)?;
                self.on_block(shared, f.stream, f.flags, block)
            }
            CONTINUATION => {
                let Some((id, flags, mut block)) = self.continuation.take() else {
                    return Err(broken("CONTINUATION without HEADERS"));
                };
                block.extend_from_slice(&f.payload);
                if block.len() > MAX_HEADER_BLOCK {
                    return Err(broken("a header block over 64 KiB"));
                }
                if f.flags & END_HEADERS == 0 {
                    self.continuation = Some((id, flags, block));
                    return Ok(());
                }
                self.on_block(shared, id, flags | END_HEADERS, block.freeze())
            }
            RST_STREAM => {
                let code = payload_u32(&f.payload)?;
                self.close(shared, f.stream, Err(CallError::Reset(code)));
                Ok(())
            }
            SETTINGS => self.on_settings(shared, &f),
            PING if f.flags & ACK == 0 => {
                if f.payload.len() != 8 {
                    return Err(broken("a PING that is not 8 bytes"));
                }
                put_head(&mut self.out, 8, PING, ACK, 0);
                self.out.extend_from_slice(&f.payload);
                Ok(())
            }
            GOAWAY => {
                let last = payload_u32(&f.payload)? & 0x7fff_ffff;
                let e = broken(format!(
                    "the server sent GOAWAY (error code {:#x})",
                    f.payload
                        .get(4..8)
                        .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                ));
                let unprocessed: Vec<u32> = self
                    .streams
                    .keys()
                    .copied()
                    .filter(|&id| id > last)
                    .collect();
                for id in unprocessed {
                    self.close(shared, id, Err(e.clone()));
                }
                self.goaway.get_or_insert(e);
                // Calls waiting for a stream slot fail now.
                shared.slots.close();
                Ok(())
            }
            WINDOW_UPDATE => {
                let inc = i64::from(payload_u32(&f.payload)? & 0x7fff_ffff);
                if f.stream == 0 {
                    if inc == 0 {
                        return Err(broken("a connection WINDOW_UPDATE of 0"));
                    }
                    self.send_window += inc;
                    if self.send_window > MAX_WINDOW {
                        return Err(broken("the connection window overflowed"));
                    }
                } else if let Some(s) = self.streams.get_mut(&f.stream) {
                    s.send_window += inc;
                    // Errors of one stream (RFC 9113 §6.9, §6.9.1): that
                    // call fails, the connection goes on.
                    let refused = if inc == 0 {
                        Some((PROTOCOL_ERROR, "a stream WINDOW_UPDATE of 0"))
                    } else if s.send_window > MAX_WINDOW {
                        Some((FLOW_CONTROL_ERROR, "the stream's window overflowed"))
                    } else {
                        None
                    };
                    if let Some((code, why)) = refused {
                        let e = CallError::Malformed(why.into());
                        self.reset_with(shared, f.stream, code, e);
                        return Ok(());
                    }
                }
                self.unblock();
                Ok(())
            }
            PUSH_PROMISE => Err(broken("PUSH_PROMISE although push is disabled")),
            // PRIORITY, PING acks and unknown types carry nothing for us.
            _ => Ok(()),
        }
    }

    fn on_settings(&mut self, shared: &Shared, f: &Frame) -> Result<(), CallError> {
        if f.flags & ACK != 0 {
            return Ok(());
        }
        if f.payload.len() % 6 != 0 {
            return Err(broken(
                "a SETTINGS frame whose length is not a multiple of 6",
            ));
        }
        for entry in f.payload.chunks_exact(6) {
            let id = u16::from_be_bytes([entry[0], entry[1]]);
            let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
            match id {
                SETTINGS_INITIAL_WINDOW_SIZE => {
                    let value = i64::from(value);
                    if value > MAX_WINDOW {
                        return Err(broken("SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1"));
                    }
                    let delta = value - self.initial_window;
                    self.initial_window = value;
                    for s in self.streams.values_mut() {
                        s.send_window += delta;
                        if s.send_window > MAX_WINDOW {
                            // RFC 9113 §6.9.2: a connection error.
                            return Err(broken(
                                "SETTINGS_INITIAL_WINDOW_SIZE overflowed a stream's window",
                            ));
                        }
                    }
                }
                SETTINGS_MAX_FRAME_SIZE => {
                    if !(16_384..=16_777_215).contains(&value) {
                        return Err(broken("SETTINGS_MAX_FRAME_SIZE out of range"));
                    }
                    self.max_frame = value as usize;
                }
                SETTINGS_MAX_CONCURRENT_STREAMS => {
                    let want = value.min(UNLIMITED_STREAMS);
                    if want > self.max_streams {
                        let more = want - self.max_streams;
                        let cancelled = more.min(self.slots_owed);
                        self.slots_owed -= cancelled;
                        shared.slots.add_permits((more - cancelled) as usize);
                    } else {
                        // Free slots go now; the rest as streams end.
                        let fewer = (self.max_streams - want) as usize;
                        let taken = shared.slots.forget_permits(fewer);
                        self.slots_owed += (fewer - taken) as u32;
                    }
                    self.max_streams = want;
                }
                _ => {}
            }
        }
        put_head(&mut self.out, 0, SETTINGS, ACK, 0);
        self.unblock();
        Ok(())
    }

    fn on_data(&mut self, shared: &Shared, f: Frame) -> Result<(), CallError> {
        // Flow control counts the whole payload, padding included; the
        // connection's share is given back once half its window is used,
        // whatever the streams do with their data (each stream's window
        // bounds what it buffers).
        let len = f.payload.len() as u32;
        self.recv_unreturned += len;
        if self.recv_unreturned >= CONN_WINDOW / 2 {
            put_window_update(&mut self.out, 0, self.recv_unreturned);
            self.recv_unreturned = 0;
        }
        let data = unpad(f.payload, f.flags, false)?;
        let id = f.stream;
        let Some(s) = self.streams.get_mut(&id) else {
            // A stream already ended here (reset, failed): drop its data.
            return Ok(());
        };
        if !s.got_head {
            self.reset(
                shared,
                id,
                CallError::Malformed("DATA before the answer's head".into()),
            );
            return Ok(());
        }
        s.data.extend_from_slice(&data);
        match &mut s.sink {
            Sink::Unary(_) => {
                s.recv_unreturned += len;
                if s.recv_unreturned >= STREAM_WINDOW / 2 {
                    put_window_update(&mut self.out, id, s.recv_unreturned);
                    s.recv_unreturned = 0;
                }
                if s.data.len() > PREFIX + MAX_MESSAGE {
                    self.reset(
                        shared,
                        id,
                        CallError::Malformed("an answer over 16 MiB".into()),
                    );
                    return Ok(());
                }
            }
            Sink::Stream(sink) => {
                // The stream's window comes back as messages are taken;
                // padding carries none, so its share comes back now.
                let padding = len - data.len() as u32;
                if padding > 0 && f.flags & END_STREAM == 0 {
                    put_window_update(&mut self.out, id, padding);
                }
                loop {
                    match grpc_frame::message_len(&s.data, MAX_MESSAGE) {
                        Ok(Some(n)) if s.data.len() >= PREFIX + n => {
                            let mut m = s.data.split_to(PREFIX + n);
                            m.advance(PREFIX);
                            sink.messages.push_back(m.freeze());
                        }
                        Ok(_) => break,
                        Err(e) => {
                            self.reset(shared, id, CallError::Malformed(e.to_string()));
                            return Ok(());
                        }
                    }
                }
                if let Some(w) = sink.waker.take() {
                    w.wake();
                }
            }
        }
        if f.flags & END_STREAM != 0 {
            self.close(
                shared,
                id,
                Err(CallError::Malformed(
                    "the answer ended without trailers".into(),
                )),
            );
        }
        Ok(())
    }

    /// Ends stream `id` with `e` and tells the server to drop it.
    fn reset(&mut self, shared: &Shared, id: u32, e: CallError) {
        self.reset_with(shared, id, CANCEL, e);
    }

    /// [`reset`](Self::reset) with the error code `code`.
    fn reset_with(&mut self, shared: &Shared, id: u32, code: u32, e: CallError) {
        put_reset(&mut self.out, id, code);
        self.close(shared, id, Err(e));
    }

    fn on_block(
        &mut self,
        shared: &Shared,
        id: u32,
        flags: u8,
        block: Bytes,
    ) -> Result<(), CallError> {
        if flags & END_HEADERS == 0 {
            self.continuation = Some((id, flags, BytesMut::from(&block[..])));
            return Ok(());
        }
        // Every block is decoded, even for a stream gone here, to keep the
        // dynamic table in step with the server's encoder.
        let mut head = Head::default();
        self.decoder
            .decode_with_cb(&block, |name, value| match &*name {
                b":status" => head.status = Some(value.into_owned()),
                b"grpc-status" => head.grpc_status = Some(value.into_owned()),
                b"grpc-message" => head.grpc_message = Some(value.into_owned()),
                _ => {}
            })
            .map_err(|e| broken(format!("undecodable header block: {e:?}")))?;
        let end = flags & END_STREAM != 0;
        let Some(s) = self.streams.get_mut(&id) else {
            return Ok(());
        };
        if !s.got_head {
            s.got_head = true;
            if head.status.as_deref() != Some(b"200") {
                let status = head
                    .status
                    .map(|v| String::from_utf8_lossy(&v).into_owned())
                    .unwrap_or_default();
                let e = CallError::Malformed(format!("HTTP status {status}"));
                if end {
                    self.close(shared, id, Err(e));
                } else {
                    self.reset(shared, id, e);
                }
                return Ok(());
            }
            if !end {
                if let Sink::Stream(sink) = &mut s.sink {
                    if let Some(tx) = sink.head.take() {
                        let _ = tx.send(Ok(()));
                    }
                }
                return Ok(());
            }
            // Trailers-only: the head carries the status.
            let result = head.grpc().and_then(|()| match s.sink {
                Sink::Unary(_) => Err(CallError::Malformed(
                    "a unary answer without a message".into(),
                )),
                Sink::Stream(_) => Ok(Bytes::new()),
            });
            self.close(shared, id, result);
            return Ok(());
        }
        if !end {
            self.reset(
                shared,
                id,
                CallError::Malformed("trailers that do not end the stream".into()),
            );
            return Ok(());
        }
        let result = head.grpc().and_then(|()| match s.sink {
            Sink::Unary(_) => whole_message(&s.data),
            Sink::Stream(_) if s.data.is_empty() => Ok(Bytes::new()),
            Sink::Stream(_) => Err(CallError::Malformed(
                "the stream ended inside a message".into(),
            )),
        });
        self.close(shared, id, result);
        Ok(())
    }
}

/// A unary answer's body: exactly one gRPC message.
fn whole_message(data: &BytesMut) -> Result<Bytes, CallError> {
    match grpc_frame::message_len(data, MAX_MESSAGE) {
        Ok(Some(n)) if data.len() == PREFIX + n => Ok(Bytes::copy_from_slice(&data[PREFIX..])),
        Ok(Some(_)) => Err(CallError::Malformed(
            "a unary answer that is not exactly one message".into(),
        )),
        Ok(None) if data.is_empty() => Err(CallError::Malformed(
            "a unary answer without a message".into(),
        )),
        Ok(None) => Err(CallError::Malformed(
            "the answer ended inside a message".into(),
        )),
        Err(e) => Err(CallError::Malformed(e.to_string())),
    }
}

fn payload_u32(p: &Bytes) -> Result<u32, CallError> {
    match p.get(..4) {
        Some(b) => Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]])),
        None => Err(broken("a frame too short for its fields")),
    }
}

// ---------------------------------------------------------- connection --

/// Aborts the connection's tasks when the last handle goes.
struct Tasks(JoinHandle<()>, JoinHandle<()>);

impl Drop for Tasks {
    fn drop(&mut self) {
        self.0.abort();
        self.1.abort();
    }
}

/// One HTTP/2 connection; cheap to clone (clones share it). The
/// connection closes when the last clone (and [`ServerStream`]) is gone.
#[derive(Clone)]
pub(crate) struct Conn {
    shared: Arc<Shared>,
    _tasks: Arc<Tasks>,
}

impl Conn {
    /// Connects to `authority` (`host:port`), exchanges the preface and
    /// SETTINGS, and starts the connection's reader and writer tasks on the
    /// current runtime.
    pub(crate) async fn connect(authority: &str) -> Result<Self, String> {
        let mut tcp = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(authority))
            .await
            .map_err(|_| "connect timed out".to_owned())?
            .map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        let mut hello = BytesMut::from(PREFACE);
        put_head(&mut hello, 12, SETTINGS, 0, 0);
        hello.put_u16(SETTINGS_ENABLE_PUSH);
        hello.put_u32(0);
        hello.put_u16(SETTINGS_INITIAL_WINDOW_SIZE);
        hello.put_u32(STREAM_WINDOW);
        put_window_update(&mut hello, 0, CONN_WINDOW - DEFAULT_WINDOW as u32);
        tcp.write_all(&hello)
            .await
            .map_err(|e| format!("HTTP/2 preface: {e}"))?;
        let shared = Arc::new(Shared::new());
        // The server's preface is its SETTINGS frame; streams open once its
        // limits are known.
        let mut buf = BytesMut::with_capacity(64 * 1024);
        let first = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if let Some(f) = next_frame(&mut buf).map_err(|e| {
                    format!("the server's first bytes are not HTTP/2 (is it a gRPC port?): {e}")
                })? {
                    return Ok::<Frame, String>(f);
                }
                if tcp.read_buf(&mut buf).await.map_err(|e| e.to_string())? == 0 {
                    return Err("the server closed the connection during the handshake".into());
                }
            }
        })
        .await
        .map_err(|_| "HTTP/2 handshake timed out".to_owned())??;
        if first.kind != SETTINGS || first.flags & ACK != 0 {
            return Err("the server's first frame is not SETTINGS (is it a gRPC port?)".into());
        }
        shared
            .state
            .lock()
            .on_settings(&shared, &first)
            .map_err(|e| e.to_string())?;
        let (rd, wr) = tcp.into_split();
        let reader = tokio::spawn(read_loop(shared.clone(), rd, buf));
        let writer = tokio::spawn(write_loop(shared.clone(), wr));
        shared.writer.notify_one();
        Ok(Self {
            shared,
            _tasks: Arc::new(Tasks(reader, writer)),
        })
    }

    /// Opens a stream with header block `block` and sends `message` (already
    /// gRPC-framed) on it, ending the request if `end`.
    async fn open(
        &self,
        block: &Bytes,
        message: Bytes,
        end: bool,
        sink: Sink,
    ) -> Result<u32, CallError> {
        let permit = self.shared.slots.acquire().await.map_err(|_| {
            self.shared
                .state
                .lock()
                .refusal()
                .unwrap_or_else(|| broken("closed"))
        })?;
        // The permit goes back by itself on every early return; an opened
        // stream's slot is handed back by `State::close`.
        let mut st = self.shared.state.lock();
        if let Some(e) = st.refusal() {
            return Err(e);
        }
        let id = st.next_id;
        if id > 0x7fff_ffff {
            return Err(broken("stream ids used up; open a new connection"));
        }
        permit.forget();
        st.next_id += 2;
        let was_empty = st.out.is_empty();
        put_head(&mut st.out, block.len(), HEADERS, END_HEADERS, id);
        st.out.extend_from_slice(block);
        let send_window = st.initial_window;
        st.streams.insert(
            id,
            Stream {
                send_window,
                unsent: message,
                end,
                got_head: false,
                recv_unreturned: 0,
                data: BytesMut::new(),
                sink,
            },
        );
        if !st.send_data(id) {
            st.blocked.push_back(id);
        }
        drop(st);
        if was_empty {
            self.shared.writer.notify_one();
        }
        Ok(id)
    }

    /// One unary call: `message` (gRPC-framed) to the method in `block`;
    /// the answer's message, unframed.
    ///
    /// Dropped before its answer (the caller timed out or gave up), the call
    /// resets its stream, so the server can stop working on it and its
    /// stream slot comes back at once instead of when (if ever) the server
    /// answers.
    pub(crate) async fn unary(&self, block: &Bytes, message: Bytes) -> Result<Bytes, CallError> {
        let (tx, rx) = oneshot::channel();
        let id = self.open(block, message, true, Sink::Unary(tx)).await?;
        let mut pending = CancelOnDrop {
            shared: &self.shared,
            id,
            armed: true,
        };
        let answer = rx.await.unwrap_or_else(|_| Err(broken("closed")));
        // Answered: the reader has closed the stream already.
        pending.armed = false;
        answer
    }

    /// Opens a server stream with `message` (gRPC-framed) and waits for the
    /// answer's head; the request side stays open until the returned
    /// stream is dropped.
    pub(crate) async fn server_stream(
        &self,
        block: &Bytes,
        message: Bytes,
    ) -> Result<ServerStream, CallError> {
        let (tx, rx) = oneshot::channel();
        let sink = StreamSink {
            head: Some(tx),
            ..StreamSink::default()
        };
        let id = self.open(block, message, false, Sink::Stream(sink)).await?;
        let stream = ServerStream {
            conn: self.clone(),
            id,
        };
        rx.await.unwrap_or_else(|_| Err(broken("closed")))?;
        Ok(stream)
    }
}

async fn read_loop(shared: Arc<Shared>, mut rd: tokio::net::tcp::OwnedReadHalf, mut buf: BytesMut) {
    loop {
        let wake = {
            let mut st = shared.state.lock();
            let was_empty = st.out.is_empty();
            loop {
                match next_frame(&mut buf) {
                    Ok(Some(f)) => {
                        if let Err(e) = st.on_frame(&shared, f) {
                            st.fail(&shared, e);
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        st.fail(&shared, e);
                        break;
                    }
                }
            }
            if st.failed.is_none() && st.streams.is_empty() {
                // After a GOAWAY, the last stream's end ends the connection.
                if let Some(e) = st.goaway.clone() {
                    st.fail(&shared, e);
                }
            }
            if st.failed.is_some() && st.streams.is_empty() && st.out.is_empty() {
                drop(st);
                // The writer stops once it sees nothing left to write.
                shared.writer.notify_one();
                return;
            }
            was_empty && !st.out.is_empty()
        };
        if wake {
            shared.writer.notify_one();
        }
        if buf.capacity() - buf.len() < 16 * 1024 {
            buf.reserve(64 * 1024);
        }
        let read = rd.read_buf(&mut buf).await;
        let e = match read {
            Ok(0) => broken("the server closed the connection"),
            Ok(_) => continue,
            Err(e) => broken(e.to_string()),
        };
        shared.state.lock().fail(&shared, e);
        shared.writer.notify_one();
        return;
    }
}

async fn write_loop(shared: Arc<Shared>, mut wr: tokio::net::tcp::OwnedWriteHalf) {
    let mut spare = BytesMut::with_capacity(64 * 1024);
    loop {
        let (empty, failed) = {
            let st = shared.state.lock();
            (st.out.is_empty(), st.failed.is_some())
        };
        if empty {
            if failed {
                return;
            }
            shared.writer.notified().await;
            continue;
        }
        // Let the other ready tasks (callers woken by the same read) add
        // their frames first, so they share this write.
        tokio::task::yield_now().await;
        let mut chunk = std::mem::replace(&mut shared.state.lock().out, spare);
        if let Err(e) = wr.write_all(&chunk).await {
            shared.state.lock().fail(&shared, broken(e.to_string()));
            return;
        }
        chunk.clear();
        spare = chunk;
    }
}

/// The answer messages of a server stream; dropping it resets the stream.
pub(crate) struct ServerStream {
    conn: Conn,
    id: u32,
}

impl ServerStream {
    /// The next message; `Ok(None)` once the server ended the stream with
    /// `grpc-status` 0.
    pub(crate) async fn next(&mut self) -> Result<Option<Bytes>, CallError> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    fn poll_next(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<Option<Bytes>, CallError>> {
        use std::task::Poll;
        let shared = &self.conn.shared;
        let mut st = shared.state.lock();
        if let Some(s) = st.streams.get_mut(&self.id) {
            let Sink::Stream(sink) = &mut s.sink else {
                return Poll::Ready(Err(broken("not a server stream")));
            };
            let Some(m) = sink.messages.pop_front() else {
                sink.waker = Some(cx.waker().clone());
                return Poll::Pending;
            };
            // The stream's window comes back as its messages are taken.
            let was_empty = st.out.is_empty();
            put_window_update(&mut st.out, self.id, (PREFIX + m.len()) as u32);
            drop(st);
            if was_empty {
                shared.writer.notify_one();
            }
            return Poll::Ready(Ok(Some(m)));
        }
        let Some(sink) = st.ended.get_mut(&self.id) else {
            return Poll::Ready(Ok(None));
        };
        if let Some(m) = sink.messages.pop_front() {
            return Poll::Ready(Ok(Some(m)));
        }
        let end = st.ended.remove(&self.id).and_then(|s| s.end);
        Poll::Ready(match end {
            Some(Err(e)) => Err(e),
            Some(Ok(())) | None => Ok(None),
        })
    }
}

/// A unary call waiting for its answer; see [`Conn::unary`].
struct CancelOnDrop<'a> {
    shared: &'a Shared,
    id: u32,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let wake = self.shared.state.lock().cancel(self.shared, self.id);
            if wake {
                self.shared.writer.notify_one();
            }
        }
    }
}

impl Drop for ServerStream {
    fn drop(&mut self) {
        let shared = &self.conn.shared;
        let mut st = shared.state.lock();
        let wake = st.cancel(shared, self.id);
        // Where `close` (now or earlier) left it for this reader.
        st.ended.remove(&self.id);
        drop(st);
        if wake {
            shared.writer.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderValue, Response};

    fn framed(body: &[u8]) -> Bytes {
        railyard_saga::grpc_frame::frame_bytes(false, body)
    }

    #[test]
    fn the_request_block_decodes_to_the_grpc_headers_in_order() {
        // A path over 127 bytes makes its length a multi-byte integer.
        let path = format!("/{}/Call", "S".repeat(200));
        let block = request_block(
            "127.0.0.1:8090",
            &path,
            &[
                ("user-agent", "grpc-java-netty/1.44.1"),
                ("grpc-accept-encoding", "gzip"),
            ],
        );
        let mut d = loona_hpack::Decoder::new();
        let got: Vec<(String, String)> = d
            .decode(&block)
            .unwrap()
            .into_iter()
            .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
            .collect();
        let want = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path.as_str()),
            (":authority", "127.0.0.1:8090"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("user-agent", "grpc-java-netty/1.44.1"),
            ("grpc-accept-encoding", "gzip"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(n, v)| ((*n).into(), (*v).into()))
            .collect();
        assert_eq!(got, want);
        // Nothing entered the dynamic table: the same decoder has no entry
        // 62 (the first dynamic index) to look up.
        assert!(d.decode(&[0x80 | 62]).is_err());
    }

    #[test]
    fn frames_are_cut_whole_and_oversized_ones_refused() {
        let mut buf = BytesMut::new();
        put_head(&mut buf, 3, DATA, END_STREAM, 5);
        buf.extend_from_slice(b"abc");
        put_head(&mut buf, 2, PING, 0, 0);
        buf.extend_from_slice(b"x");
        let f = next_frame(&mut buf).unwrap().unwrap();
        assert_eq!(
            (f.kind, f.flags, f.stream, &f.payload[..]),
            (DATA, END_STREAM, 5, &b"abc"[..])
        );
        // The second frame is one byte short.
        assert!(next_frame(&mut buf).unwrap().is_none());
        let mut big = BytesMut::new();
        put_head(&mut big, DEFAULT_MAX_FRAME + 1, DATA, 0, 1);
        assert!(matches!(
            next_frame(&mut big),
            Err(CallError::Connection(_))
        ));
    }

    #[test]
    fn padding_and_priority_are_stripped() {
        let mut p = BytesMut::new();
        p.put_u8(2); // pad length
        p.extend_from_slice(&[0, 0, 0, 1, 16]); // priority
        p.extend_from_slice(b"block");
        p.extend_from_slice(&[0, 0]);
        let got = unpad(p.freeze(), PADDED | PRIORITY, true).unwrap();
        assert_eq!(&got[..], b"block");
        let bad = Bytes::from_static(&[9, 1, 2]);
        assert!(unpad(bad, PADDED, false).is_err());
    }

    fn max_streams(n: u32) -> Frame {
        let mut p = BytesMut::new();
        p.put_u16(SETTINGS_MAX_CONCURRENT_STREAMS);
        p.put_u32(n);
        Frame {
            kind: SETTINGS,
            flags: 0,
            stream: 0,
            payload: p.freeze(),
        }
    }

    #[test]
    fn a_lowered_stream_limit_holds_while_streams_are_open() {
        let shared = Shared::new();
        let mut st = shared.state.lock();
        st.on_settings(&shared, &max_streams(4)).unwrap();
        assert_eq!(shared.slots.available_permits(), 4);
        // Three streams open.
        for id in [1, 3, 5] {
            shared.slots.try_acquire().unwrap().forget();
            let (tx, _rx) = oneshot::channel();
            st.streams.insert(
                id,
                Stream {
                    send_window: DEFAULT_WINDOW,
                    unsent: Bytes::new(),
                    end: false,
                    got_head: true,
                    recv_unreturned: 0,
                    data: BytesMut::new(),
                    sink: Sink::Unary(tx),
                },
            );
        }
        // The server lowers its limit to 1: the free slot goes at once,
        // and no slot comes free until only one stream is left open.
        st.on_settings(&shared, &max_streams(1)).unwrap();
        assert_eq!(shared.slots.available_permits(), 0);
        st.close(&shared, 1, Ok(Bytes::new()));
        st.close(&shared, 3, Ok(Bytes::new()));
        assert_eq!(shared.slots.available_permits(), 0);
        st.close(&shared, 5, Ok(Bytes::new()));
        assert_eq!(shared.slots.available_permits(), 1);
        // Raised again to 3: the two slots come back.
        st.on_settings(&shared, &max_streams(3)).unwrap();
        assert_eq!(shared.slots.available_permits(), 3);
    }

    /// A listener on a free loopback port, and its address.
    async fn listen() -> (tokio::net::TcpListener, String) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        (listener, addr)
    }

    /// The next connection on `listener`, as an `h2` server built by `builder`.
    async fn accept(
        listener: &tokio::net::TcpListener,
        builder: &mut h2::server::Builder,
    ) -> h2::server::Connection<tokio::net::TcpStream, Bytes> {
        let (tcp, _) = listener.accept().await.unwrap();
        builder.handshake(tcp).await.unwrap()
    }

    /// What the test server answers a call with.
    #[derive(Clone, Copy)]
    enum Answer {
        /// The request's message back, in DATA frames of 3 bytes.
        Echo,
        /// A trailers-only answer with grpc-status 5.
        NotFound,
        /// Three messages in one DATA frame, then grpc-status 0.
        Stream,
        /// The same three messages, then nothing: the stream stays open
        /// until the client resets it.
        Open,
        /// HTTP 503 without gRPC headers.
        Http503,
    }

    /// An `h2` server on a free loopback port answering every call with
    /// `answer`, with a small initial window and two streams at most.
    async fn server(answer: Answer) -> String {
        let (listener, addr) = listen().await;
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut conn = h2::server::Builder::new()
                        .initial_window_size(1_000)
                        .max_concurrent_streams(2)
                        .handshake::<_, Bytes>(tcp)
                        .await
                        .unwrap();
                    while let Some(Ok((req, mut respond))) = conn.accept().await {
                        tokio::spawn(async move {
                            let mut body = req.into_body();
                            let mut got = BytesMut::new();
                            while let Some(Ok(chunk)) = body.data().await {
                                let _ = body.flow_control().release_capacity(chunk.len());
                                got.extend_from_slice(&chunk);
                                if matches!(answer, Answer::Stream | Answer::Open) {
                                    break;
                                }
                            }
                            let mut trailers = HeaderMap::new();
                            trailers.insert("grpc-status", HeaderValue::from_static("0"));
                            match answer {
                                Answer::Echo => {
                                    let head = Response::builder()
                                        .header("content-type", "application/grpc")
                                        .body(())
                                        .unwrap();
                                    let mut s = respond.send_response(head, false).unwrap();
                                    // Small answers in 3-byte pieces, large
                                    // ones in 16 KiB frames.
                                    let piece = if got.len() < 100 { 3 } else { 16_384 };
                                    for piece in got.chunks(piece) {
                                        s.send_data(Bytes::copy_from_slice(piece), false).unwrap();
                                    }
                                    s.send_trailers(trailers).unwrap();
                                }
                                Answer::Stream | Answer::Open => {
                                    let head = Response::builder().body(()).unwrap();
                                    let mut s = respond.send_response(head, false).unwrap();
                                    let mut all = BytesMut::new();
                                    for m in [&b"one"[..], b"two", b"three"] {
                                        all.extend_from_slice(&framed(m));
                                    }
                                    s.send_data(all.freeze(), false).unwrap();
                                    if matches!(answer, Answer::Open) {
                                        let _ = std::future::poll_fn(|cx| s.poll_reset(cx)).await;
                                    } else {
                                        s.send_trailers(trailers).unwrap();
                                    }
                                }
                                Answer::NotFound => {
                                    let head = Response::builder()
                                        .header("grpc-status", "5")
                                        .header("grpc-message", "no such saga")
                                        .body(())
                                        .unwrap();
                                    respond.send_response(head, true).unwrap();
                                }
                                Answer::Http503 => {
                                    let head = Response::builder().status(503).body(()).unwrap();
                                    respond.send_response(head, true).unwrap();
                                }
                            }
                        });
                    }
                });
            }
        });
        addr
    }

    /// Checks `f` on `conn`'s shared state every millisecond until it
    /// holds; fails with `what` after 5 s.
    async fn wait_until(conn: &Conn, what: &str, f: impl Fn(&Shared) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !f(&conn.shared) {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    fn block(addr: &str) -> Bytes {
        request_block(addr, "/Test/Call", &[])
    }

    #[tokio::test]
    async fn unary_calls_beyond_the_window_and_the_stream_limit_all_complete() {
        let addr = server(Answer::Echo).await;
        let conn = Conn::connect(&addr).await.unwrap();
        let b = block(&addr);
        // 2,500-byte messages against a 1,000-byte stream window, 20 calls
        // against a limit of 2 streams: calls wait for window and slots.
        let calls = (0..20u8).map(|i| {
            let (conn, b) = (conn.clone(), b.clone());
            async move {
                let body = vec![i; 2_500];
                let got = conn.unary(&b, framed(&body)).await.unwrap();
                assert_eq!(&got[..], &body[..]);
            }
        });
        futures::future::join_all(calls).await;
        // Small ones too (one frame each way).
        let got = conn.unary(&b, framed(b"hi")).await.unwrap();
        assert_eq!(&got[..], b"hi");
        // An answer larger than this client's 2 MiB stream window: the
        // server can only finish once the window is given back.
        let big: Vec<u8> = (0..3 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
        let got = conn.unary(&b, framed(&big)).await.unwrap();
        assert_eq!(got.len(), big.len());
        assert!(got[..] == big[..]);
    }

    #[tokio::test]
    async fn a_cancelled_unary_call_resets_its_stream_and_frees_its_slot() {
        let (listener, addr) = listen().await;
        let (reset_tx, reset_rx) = oneshot::channel();
        tokio::spawn(async move {
            let mut conn = accept(
                &listener,
                h2::server::Builder::new().max_concurrent_streams(1),
            )
            .await;
            // The first call is never answered; the server reports how its
            // stream ended. Later calls get "ok".
            let (req, mut held) = conn.accept().await.unwrap().unwrap();
            tokio::spawn(async move {
                let _req = req;
                let reason = std::future::poll_fn(|cx| held.poll_reset(cx)).await;
                let _ = reset_tx.send(reason.ok());
            });
            while let Some(Ok((_req, mut respond))) = conn.accept().await {
                let head = Response::builder().body(()).unwrap();
                let mut s = respond.send_response(head, false).unwrap();
                s.send_data(framed(b"ok"), false).unwrap();
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static("0"));
                s.send_trailers(trailers).unwrap();
            }
        });
        let conn = Conn::connect(&addr).await.unwrap();
        let b = block(&addr);
        let first =
            tokio::time::timeout(Duration::from_millis(200), conn.unary(&b, framed(b"1"))).await;
        assert!(first.is_err(), "the server never answers the first call");
        let reason = tokio::time::timeout(Duration::from_secs(5), reset_rx)
            .await
            .expect("the given-up call's stream must be reset")
            .unwrap();
        assert_eq!(reason, Some(h2::Reason::CANCEL));
        // The server allows one stream: the second call needs the first's slot.
        let second = tokio::time::timeout(Duration::from_secs(5), conn.unary(&b, framed(b"2")))
            .await
            .expect("the given-up call's slot must come back")
            .unwrap();
        assert_eq!(&second[..], b"ok");
    }

    #[tokio::test]
    async fn goaway_fails_new_calls_instead_of_leaving_them_waiting() {
        let (listener, addr) = listen().await;
        tokio::spawn(async move {
            let mut conn = accept(
                &listener,
                h2::server::Builder::new().max_concurrent_streams(1),
            )
            .await;
            // Takes one stream and never answers it, then says GOAWAY.
            let held = conn.accept().await;
            conn.graceful_shutdown();
            let _held = held;
            while conn.accept().await.is_some() {}
        });
        let conn = Conn::connect(&addr).await.unwrap();
        let b = block(&addr);
        // The first call takes the only slot (once the server's limit of 1
        // is known, no slot is free while it holds it); the second waits
        // for one.
        let first = tokio::spawn({
            let (conn, b) = (conn.clone(), b.clone());
            async move { conn.unary(&b, framed(b"1")).await }
        });
        wait_until(&conn, "the first call never took the slot", |s| {
            s.slots.available_permits() == 0
        })
        .await;
        let second = tokio::time::timeout(Duration::from_secs(5), conn.unary(&b, framed(b"2")))
            .await
            .expect("a call waiting for a slot must fail once the server says GOAWAY");
        assert!(
            matches!(second, Err(CallError::Connection(_))),
            "{second:?}"
        );
        first.abort();
    }

    #[tokio::test]
    async fn a_stream_the_server_still_processes_after_goaway_completes() {
        let (listener, addr) = listen().await;
        tokio::spawn(async move {
            let mut conn = accept(
                &listener,
                h2::server::Builder::new().initial_window_size(1_000),
            )
            .await;
            let (req, mut respond) = conn.accept().await.unwrap().unwrap();
            // GOAWAY before the request body is read: the rest of it
            // needs the window this side gives back afterwards, so the
            // client must keep writing after the GOAWAY.
            conn.graceful_shutdown();
            tokio::spawn(async move {
                let mut body = req.into_body();
                let mut got = BytesMut::new();
                while let Some(Ok(chunk)) = body.data().await {
                    let _ = body.flow_control().release_capacity(chunk.len());
                    got.extend_from_slice(&chunk);
                }
                let head = Response::builder().body(()).unwrap();
                let mut s = respond.send_response(head, false).unwrap();
                s.send_data(got.freeze(), false).unwrap();
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static("0"));
                s.send_trailers(trailers).unwrap();
            });
            while conn.accept().await.is_some() {}
        });
        let conn = Conn::connect(&addr).await.unwrap();
        let b = block(&addr);
        let body = vec![7u8; 3_000];
        let got = tokio::time::timeout(Duration::from_secs(5), conn.unary(&b, framed(&body)))
            .await
            .expect("a stream the server keeps after GOAWAY must finish")
            .unwrap();
        assert_eq!(&got[..], &body[..]);
        // No new stream after the GOAWAY.
        assert!(matches!(
            conn.unary(&b, framed(b"x")).await,
            Err(CallError::Connection(_))
        ));
    }

    #[tokio::test]
    async fn statuses_and_http_errors_fail_only_their_call() {
        let addr = server(Answer::NotFound).await;
        let conn = Conn::connect(&addr).await.unwrap();
        match conn.unary(&block(&addr), framed(b"x")).await {
            Err(CallError::Status { code, message }) => {
                assert_eq!((code.as_str(), message.as_str()), ("5", "no such saga"));
            }
            other => panic!("{other:?}"),
        }
        let addr = server(Answer::Http503).await;
        let conn = Conn::connect(&addr).await.unwrap();
        for _ in 0..3 {
            match conn.unary(&block(&addr), framed(b"x")).await {
                Err(CallError::Malformed(m)) => assert!(m.contains("503"), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_server_stream_yields_every_message_then_its_end() {
        let addr = server(Answer::Stream).await;
        let conn = Conn::connect(&addr).await.unwrap();
        let mut s = conn
            .server_stream(&block(&addr), framed(b"hello"))
            .await
            .unwrap();
        let mut got = Vec::new();
        while let Some(m) = s.next().await.unwrap() {
            got.push(m);
        }
        assert_eq!(got, [&b"one"[..], b"two", b"three"]);

        // Dropping a stream the server keeps open resets it and hands its
        // slot back: a third stream against the limit of 2 opens.
        let addr = server(Answer::Open).await;
        let conn = Conn::connect(&addr).await.unwrap();
        for i in 0..3 {
            let open = async {
                let mut s = conn
                    .server_stream(&block(&addr), framed(b"again"))
                    .await
                    .unwrap();
                assert_eq!(&s.next().await.unwrap().unwrap()[..], b"one");
            };
            tokio::time::timeout(Duration::from_secs(5), open)
                .await
                .unwrap_or_else(|_| panic!("stream {i} found no free slot"));
        }
    }

    #[tokio::test]
    async fn a_closed_connection_fails_pending_and_later_calls() {
        // A server that does the handshake, takes one request, and hangs up.
        let (listener, addr) = listen().await;
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut conn = h2::server::handshake(tcp).await.unwrap();
            let _first = conn.accept().await;
        });
        let conn = Conn::connect(&addr).await.unwrap();
        let b = block(&addr);
        assert!(matches!(
            conn.unary(&b, framed(b"x")).await,
            Err(CallError::Connection(_))
        ));
        assert!(matches!(
            conn.unary(&b, framed(b"y")).await,
            Err(CallError::Connection(_))
        ));
    }

    /// The next connection on `listener`, spoken to by hand: the server's
    /// SETTINGS (`settings`) sent, the client's preface read; what else the
    /// client sent is left in the buffer.
    async fn accept_raw(
        listener: &tokio::net::TcpListener,
        settings: &[(u16, u32)],
    ) -> (TcpStream, BytesMut) {
        let (mut tcp, _) = listener.accept().await.unwrap();
        let mut out = BytesMut::new();
        put_head(&mut out, 6 * settings.len(), SETTINGS, 0, 0);
        for &(id, value) in settings {
            out.put_u16(id);
            out.put_u32(value);
        }
        tcp.write_all(&out).await.unwrap();
        let mut buf = BytesMut::new();
        while buf.len() < 24 {
            assert!(tcp.read_buf(&mut buf).await.unwrap() > 0);
        }
        buf.advance(24); // the connection preface
        (tcp, buf)
    }

    /// Reads the client's frames until one of type `kind`: its stream and payload.
    async fn read_until(tcp: &mut TcpStream, buf: &mut BytesMut, kind: u8) -> (u32, Bytes) {
        loop {
            while let Some(f) = next_frame(buf).unwrap() {
                if f.kind == kind {
                    return (f.stream, f.payload);
                }
            }
            assert!(tcp.read_buf(buf).await.unwrap() > 0, "the client closed");
        }
    }

    /// Connects to `addr` and makes one call that the hand-spoken server
    /// there makes fail: the connection and what the call returned, within
    /// 5 s (a call left waiting for an answer fails the test).
    async fn failing_call(addr: &str) -> (Conn, Result<Bytes, CallError>) {
        let conn = Conn::connect(addr).await.unwrap();
        let call = tokio::time::timeout(
            Duration::from_secs(5),
            conn.unary(&block(addr), framed(b"x")),
        )
        .await
        .expect("the call must fail, not wait for an answer");
        (conn, call)
    }

    /// A call whose stream gets a WINDOW_UPDATE of `increment` from a
    /// hand-spoken server: what the call returned, the code of the
    /// RST_STREAM the client sent for it, and the connection.
    async fn stream_window_update(increment: u32) -> (Result<Bytes, CallError>, u32, Conn) {
        let (listener, addr) = listen().await;
        let (code_tx, code_rx) = oneshot::channel();
        tokio::spawn(async move {
            let (mut tcp, mut buf) = accept_raw(&listener, &[]).await;
            let mut out = BytesMut::new();
            let (id, _) = read_until(&mut tcp, &mut buf, HEADERS).await;
            put_window_update(&mut out, id, increment);
            tcp.write_all(&out).await.unwrap();
            let (reset, payload) = read_until(&mut tcp, &mut buf, RST_STREAM).await;
            assert_eq!(reset, id);
            let _ = code_tx.send(payload_u32(&payload).unwrap());
            // Hold the connection until the client is done.
            let _ = tcp.read_buf(&mut buf).await;
        });
        let (conn, call) = failing_call(&addr).await;
        (call, code_rx.await.unwrap(), conn)
    }

    #[tokio::test]
    async fn a_stream_window_overflow_fails_that_call_with_flow_control_error() {
        // 65,535 plus 2^31 - 1: past the largest window there is.
        let (call, code, _) = stream_window_update(0x7fff_ffff).await;
        assert!(matches!(call, Err(CallError::Malformed(_))), "{call:?}");
        assert_eq!(code, FLOW_CONTROL_ERROR);
    }

    #[tokio::test]
    async fn a_stream_window_update_of_zero_fails_that_call_with_protocol_error() {
        let (call, code, conn) = stream_window_update(0).await;
        assert!(matches!(call, Err(CallError::Malformed(_))), "{call:?}");
        assert_eq!(code, PROTOCOL_ERROR);
        // A stream error: the connection itself is still usable.
        assert!(conn.shared.state.lock().failed.is_none());
    }

    #[tokio::test]
    async fn a_connection_window_update_of_zero_fails_the_connection() {
        let (listener, addr) = listen().await;
        tokio::spawn(async move {
            let (mut tcp, mut buf) = accept_raw(&listener, &[]).await;
            let mut out = BytesMut::new();
            let _ = read_until(&mut tcp, &mut buf, HEADERS).await;
            put_window_update(&mut out, 0, 0);
            tcp.write_all(&out).await.unwrap();
            let _ = tcp.read_buf(&mut buf).await;
        });
        let (conn, call) = failing_call(&addr).await;
        match call {
            Err(CallError::Connection(why)) => assert!(why.contains("WINDOW_UPDATE of 0"), "{why}"),
            other => panic!("expected a connection error, got {other:?}"),
        }
        // Later calls fail at once.
        let again = conn.unary(&block(&addr), framed(b"y")).await;
        assert!(matches!(again, Err(CallError::Connection(_))), "{again:?}");
    }

    #[tokio::test]
    async fn a_server_streams_padding_is_given_back_to_its_window() {
        let (listener, addr) = listen().await;
        let (sum_tx, sum_rx) = oneshot::channel();
        tokio::spawn(async move {
            let (mut tcp, mut buf) = accept_raw(&listener, &[]).await;
            let mut out = BytesMut::new();
            let (id, _) = read_until(&mut tcp, &mut buf, HEADERS).await;
            // The head (":status: 200", static table entry 8), then one
            // message in a DATA frame with 100 bytes of padding.
            put_head(&mut out, 1, HEADERS, END_HEADERS, id);
            out.put_u8(0x88);
            let message = framed(b"one");
            put_head(&mut out, 1 + message.len() + 100, DATA, PADDED, id);
            out.put_u8(100);
            out.extend_from_slice(&message);
            out.put_bytes(0, 100);
            tcp.write_all(&out).await.unwrap();
            // The frame counted 109 bytes against the stream's window: the
            // message's 8 and the padding's 101 must both come back.
            let mut sum = 0;
            while sum < 109 {
                let (stream, payload) = read_until(&mut tcp, &mut buf, WINDOW_UPDATE).await;
                if stream == id {
                    sum += payload_u32(&payload).unwrap();
                }
            }
            let _ = sum_tx.send(sum);
            let _ = tcp.read_buf(&mut buf).await;
        });
        let conn = Conn::connect(&addr).await.unwrap();
        let mut s = conn
            .server_stream(&block(&addr), framed(b"hi"))
            .await
            .unwrap();
        assert_eq!(&s.next().await.unwrap().unwrap()[..], b"one");
        let sum = tokio::time::timeout(Duration::from_secs(5), sum_rx)
            .await
            .expect("the padding's window never came back")
            .unwrap();
        assert_eq!(sum, 109);
    }

    #[tokio::test]
    async fn a_stream_short_of_its_own_window_does_not_hold_up_the_next() {
        let (listener, addr) = listen().await;
        let (go_tx, go_rx) = oneshot::channel::<()>();
        let (done_tx, done_rx) = oneshot::channel();
        tokio::spawn(async move {
            // Streams get a 66,000-byte window; the connection keeps the
            // default 65,535.
            let (mut tcp, mut buf) =
                accept_raw(&listener, &[(SETTINGS_INITIAL_WINDOW_SIZE, 66_000)]).await;
            let mut out = BytesMut::new();
            let mut go = Some(go_rx);
            loop {
                while let Some(f) = next_frame(&mut buf).unwrap() {
                    if f.kind == DATA && f.stream == 3 && f.flags & END_STREAM != 0 {
                        let _ = done_tx.send(());
                        let _ = tcp.read_buf(&mut buf).await;
                        return;
                    }
                }
                if let Some(rx) = go.take() {
                    // Both calls wait for window: give the connection 50,000.
                    rx.await.unwrap();
                    out.clear();
                    put_window_update(&mut out, 0, 50_000);
                    tcp.write_all(&out).await.unwrap();
                    continue;
                }
                assert!(tcp.read_buf(&mut buf).await.unwrap() > 0);
            }
        });
        let conn = Conn::connect(&addr).await.unwrap();
        let b = block(&addr);
        // The first call (stream 1) takes the whole connection window with
        // 65,535 of its 70,000 bytes; the second (stream 3) then waits too.
        let first = tokio::spawn({
            let (conn, b) = (conn.clone(), b.clone());
            async move { conn.unary(&b, framed(&[1; 70_000 - PREFIX])).await }
        });
        wait_until(&conn, "the first call never used the window", |s| {
            s.state.lock().send_window == 0
        })
        .await;
        let second = tokio::spawn({
            let (conn, b) = (conn.clone(), b.clone());
            async move { conn.unary(&b, framed(b"2")).await }
        });
        wait_until(&conn, "the second call never queued", |s| {
            s.state.lock().blocked.len() == 2
        })
        .await;
        go_tx.send(()).unwrap();
        // Stream 1 can send only 465 more bytes (its own window); stream 3's
        // request must still go out.
        tokio::time::timeout(Duration::from_secs(5), done_rx)
            .await
            .expect("the second call's request stayed behind the first's")
            .unwrap();
        first.abort();
        second.abort();
    }

    #[tokio::test]
    async fn a_server_that_is_not_http2_is_refused_at_connect() {
        let (listener, addr) = listen().await;
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let _ = tcp.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        });
        let e = Conn::connect(&addr).await.err().unwrap();
        assert!(e.contains("not HTTP/2"), "{e}");
    }
}
