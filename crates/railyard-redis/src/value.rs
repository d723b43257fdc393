//! Replies ([`Value`]), commands ([`Cmd`]) and the RESP codec glue:
//! [`ReplyDecoder`] frames the replies arriving on a connection and decodes
//! the cheap ones; [`Framed`] holds one it left for the caller to decode.
//!
//! Decoding uses the `redis-protocol` crate (RESP2 and RESP3, zero-copy
//! `Bytes` frames). Encoding a command is a flat array of bulk strings, which
//! is written straight into the connection's write buffer here: no frame tree
//! is built per command.

use bytes::{BufMut, Bytes, BytesMut};
use redis_protocol::resp2::types::BytesFrame as Frame2;
use redis_protocol::resp3::types::BytesFrame as Frame3;

/// One reply from Redis.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A null reply (`$-1`, `*-1`, RESP3 `_`).
    Nil,
    /// An integer.
    Int(i64),
    /// A bulk (binary) string.
    Bulk(Bytes),
    /// A simple status string such as `OK`.
    Status(Bytes),
    /// An array (also RESP3 pushes, and sets: the decoder keeps a set in a
    /// hash set, so its members come in no particular order, once each).
    Array(Vec<Value>),
    /// A RESP3 map. The decoder keeps it in a hash map: its entries come in
    /// no particular order (not the wire's), one per key.
    Map(Vec<(Value, Value)>),
    /// A RESP3 double.
    Double(f64),
    /// A RESP3 boolean.
    Bool(bool),
    /// An error reply, still undecided: the cluster layer turns MOVED/ASK into
    /// redirections and everything else into [`crate::RedisError::Server`].
    Error(String),
}

impl Value {
    /// The bytes of a bulk or status string.
    pub fn as_bytes(&self) -> Option<&Bytes> {
        match self {
            Value::Bulk(b) | Value::Status(b) => Some(b),
            _ => None,
        }
    }

    /// A short description for error messages (never the payload itself).
    pub(crate) fn describe(&self) -> String {
        match self {
            Value::Nil => "nil".into(),
            Value::Int(i) => format!("integer {i}"),
            Value::Bulk(b) => format!("bulk string of {} bytes", b.len()),
            Value::Status(_) => "status string".into(),
            Value::Array(a) => format!("array of {}", a.len()),
            Value::Map(m) => format!("map of {}", m.len()),
            Value::Double(_) => "double".into(),
            Value::Bool(_) => "boolean".into(),
            Value::Error(e) => format!("error {}", e.split(' ').next().unwrap_or("")),
        }
    }

    pub(crate) fn from_resp2(f: Frame2) -> Value {
        match f {
            Frame2::SimpleString(b) => Value::Status(b),
            Frame2::Error(s) => Value::Error(s.to_string()),
            Frame2::Integer(i) => Value::Int(i),
            Frame2::BulkString(b) => Value::Bulk(b),
            Frame2::Array(a) => Value::Array(a.into_iter().map(Value::from_resp2).collect()),
            Frame2::Null => Value::Nil,
        }
    }

    pub(crate) fn from_resp3(f: Frame3) -> Value {
        match f {
            Frame3::BlobString { data, .. } | Frame3::VerbatimString { data, .. } => {
                Value::Bulk(data)
            }
            Frame3::SimpleString { data, .. } | Frame3::BigNumber { data, .. } => {
                Value::Status(data)
            }
            Frame3::BlobError { data, .. } => {
                Value::Error(String::from_utf8_lossy(&data).into_owned())
            }
            Frame3::SimpleError { data, .. } => Value::Error(data.to_string()),
            Frame3::Boolean { data, .. } => Value::Bool(data),
            Frame3::Null => Value::Nil,
            Frame3::Number { data, .. } => Value::Int(data),
            Frame3::Double { data, .. } => Value::Double(data),
            Frame3::Array { data, .. } | Frame3::Push { data, .. } => {
                Value::Array(data.into_iter().map(Value::from_resp3).collect())
            }
            Frame3::Set { data, .. } => {
                Value::Array(data.into_iter().map(Value::from_resp3).collect())
            }
            Frame3::Map { data, .. } => Value::Map(
                data.into_iter()
                    .map(|(k, v)| (Value::from_resp3(k), Value::from_resp3(v)))
                    .collect(),
            ),
            // HELLO and chunked frames never arrive as complete replies.
            _ => Value::Error("ERR unsupported RESP3 frame".into()),
        }
    }
}

/// Which protocol a connection speaks after its handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// RESP2 (every Redis version).
    #[default]
    Resp2,
    /// RESP3, negotiated with `HELLO 3` (Redis 6+).
    Resp3,
}

/// Deepest nesting of aggregates (arrays, maps, sets, pushes, attributes) a
/// reply may have.
///
/// The `redis-protocol` decoder, the conversion to [`Value`] and dropping
/// either tree all recurse once per level, so without a limit a reply of
/// `*1\r\n` repeated 100,000 times (about 400 KB) overflows the stack and
/// aborts the whole process. Real replies nest a few levels (`CLUSTER SLOTS`
/// is 3, `XREAD` 4). The bound is the stack: the RESP3 decoder takes about
/// 19 KB per level of nested maps in a debug build (2.6 KB optimised), so a
/// 2 MiB tokio worker or blocking-pool thread (where large replies are
/// decoded, see [`DECODE_ON_TASK_MAX`]) overflows near 108 levels; 64 keeps
/// a debug build's decoding under 1.3 MB of that stack.
pub(crate) const MAX_DEPTH: usize = 64;

/// Default largest reply, in bytes (see `ClusterClientBuilder::max_reply_size`).
///
/// The decoder accepts declared lengths up to `isize::MAX` and waits for the
/// bytes, so without a limit one bad or hostile length grows a connection's
/// read buffer until memory runs out. 512 MiB matches Redis's own
/// `proto-max-bulk-len`, the largest bulk string a server stores.
pub(crate) const DEFAULT_MAX_REPLY_SIZE: usize = 512 << 20;

/// Most bytes the decoder may have to read in a reply for the reply to be
/// decoded where it was framed, on its connection's task; a larger one is
/// handed to its caller undecoded ([`Reply::Framed`]), and decoded on the
/// blocking pool.
///
/// The bytes counted are the reply's size less its bulk strings' payloads:
/// the decoder slices a payload out of the buffer without reading it, so a
/// `GET` of 4 MiB decodes in under 2 µs, like one of 4 bytes. What costs is
/// the values: each is a header line to parse and a place in three vectors
/// (the decoder's ranges, its frames, then [`Value`]s). Measured on an
/// optimised build, on a 2-core machine shared with other work, median of
/// many runs: 8 to 22 ns per byte counted with RESP2, 26 to 66 ns with RESP3,
/// whose arrays of one-element arrays, empty arrays and nulls are the worst
/// (4 KiB of them took 210 µs, 16 KiB 1.1 ms, 64 KiB 3.8 ms); a single simple
/// string, error line or RESP3 blob error costs under 1 ns per byte. 4 KiB
/// keeps the worst shape near 200 µs, under the project's 0.5 ms for a task
/// with room for a slower machine, and still decodes on the connection's
/// task any single value, an `MGET` of a few hundred keys, and every error
/// reply Redis sends (MOVED and ASK are under 100 bytes).
pub(crate) const DECODE_ON_TASK_MAX: usize = 4 << 10;

/// A complete reply taken off the front of a connection's read buffer.
#[derive(Debug)]
pub(crate) enum Reply {
    /// Decoded where it was framed: the decoder had at most
    /// [`DECODE_ON_TASK_MAX`] bytes to read.
    Value(Value),
    /// Framed only: decoding it could hold the connection's task past the
    /// project's 0.5 ms, so whoever waits for it decodes it.
    Framed(Framed),
}

impl Reply {
    /// A short description for error messages (never the payload itself).
    pub(crate) fn describe(&self) -> String {
        match self {
            Reply::Value(v) => v.describe(),
            Reply::Framed(f) => format!("undecoded reply of {} bytes", f.bytes.len()),
        }
    }
}

/// The bytes of one complete reply, its end found by the walk, not yet
/// decoded.
#[derive(Debug)]
pub(crate) struct Framed {
    /// Exactly one reply: the walk found its last byte.
    bytes: Bytes,
    proto: Protocol,
}

impl Framed {
    /// Runs the decoder over the reply: tens of nanoseconds per byte (see
    /// [`DECODE_ON_TASK_MAX`]), so not on an async task; see
    /// [`Framed::decode_on_blocking_pool`].
    ///
    /// # Errors
    /// What the decoder refused, in its words, as
    /// [`ReplyDecoder::next_reply`] would have reported it had the reply
    /// been decoded there: something wrong inside a header or payload that
    /// the walk does not check (an integer that is not a number, a set of
    /// arrays). Also, should the decoder not end the reply where the walk
    /// did, a message saying so; the walk is designed to agree with it.
    pub(crate) fn decode(self) -> Result<Value, String> {
        let len = self.bytes.len();
        let decoded = match self.proto {
            Protocol::Resp2 => redis_protocol::resp2::decode::decode_bytes(&self.bytes)
                .map(|r| r.map(|(f, n)| (Value::from_resp2(f), n))),
            Protocol::Resp3 => redis_protocol::resp3::decode::complete::decode_bytes(&self.bytes)
                .map(|r| r.map(|(f, n)| (Value::from_resp3(f), n))),
        }
        .map_err(|e| e.details().to_owned())?;
        match decoded {
            Some((v, n)) if n == len => Ok(v),
            Some((_, n)) => Err(format!(
                "the decoder ended a {len}-byte reply after {n} bytes"
            )),
            None => Err(format!("the decoder found a {len}-byte reply incomplete")),
        }
    }

    /// [`Framed::decode`] on the runtime's blocking pool, so that neither
    /// the connection's task nor the caller's holds an async worker for it.
    ///
    /// `None` when the runtime is shutting down and did not run it. A panic
    /// in the decoder is resumed here.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the decode to finish on its thread, which
    /// also drops the value.
    pub(crate) async fn decode_on_blocking_pool(self) -> Option<Result<Value, String>> {
        match tokio::task::spawn_blocking(move || self.decode()).await {
            Ok(r) => Some(r),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => None,
        }
    }
}

/// Frames the replies arriving on one connection, one at a time, from the
/// front of its read buffer, and decodes those that are cheap to decode.
///
/// A reply can take many reads to arrive (`LRANGE` of a million elements is
/// about 10 MB, some 150 reads of 64 KiB). The recursive decoder cannot pick
/// up where it stopped, so running it after every read would go over the
/// whole reply so far each time: work quadratic in the reply's size, on the
/// connection's I/O task. Instead a walk over the reply's type headers
/// ([`Walk`]) resumes after every read where the previous one left it, and
/// finds the reply's last byte. Then the decoder runs once, here, if it has
/// at most [`DECODE_ON_TASK_MAX`] bytes to read; otherwise the reply's bytes
/// are split off the buffer as they are ([`Reply::Framed`]) for the waiting
/// caller to decode off the connection's task.
///
/// The walk's position counts from the front of the buffer, so the caller
/// must pass the same buffer every time, only ever grown at its end; what
/// [`ReplyDecoder::next_reply`] takes off its front restarts the walk.
#[derive(Debug)]
pub(crate) struct ReplyDecoder {
    proto: Protocol,
    max_reply: usize,
    walk: Walk,
    /// Bytes the decoder read for the last reply decoded here (0 for a
    /// framed one): the connection's task sums them to yield after
    /// [`DECODE_ON_TASK_MAX`] of them in one turn.
    last_read: usize,
    /// How many times the recursive decoder ran here, for the tests that
    /// prove it runs once per reply however many reads the reply took.
    #[cfg(test)]
    decoder_runs: usize,
    /// How many replies were handed out framed, undecoded.
    #[cfg(test)]
    framed: usize,
}

impl ReplyDecoder {
    /// A decoder for a connection speaking `proto`, refusing replies over
    /// `max_reply` bytes (see `ClusterClientBuilder::max_reply_size`).
    pub(crate) fn new(proto: Protocol, max_reply: usize) -> Self {
        Self {
            proto,
            max_reply,
            walk: Walk::new(),
            last_read: 0,
            #[cfg(test)]
            decoder_runs: 0,
            #[cfg(test)]
            framed: 0,
        }
    }

    /// Takes one complete reply off the front of `buf`, decoded if that is
    /// cheap, or `Ok(None)` when more bytes are needed.
    ///
    /// # Errors
    /// What was wrong, for [`crate::RedisError::Protocol`]: bytes that are
    /// not RESP, a reply nested deeper than [`MAX_DEPTH`], a declared length
    /// above `max_reply`, an incomplete reply that already holds more than
    /// `max_reply` bytes, or (for a reply decoded here) anything else the
    /// decoder refuses. Callers close the connection the bytes came from.
    pub(crate) fn next_reply(&mut self, buf: &mut BytesMut) -> Result<Option<Reply>, String> {
        self.last_read = 0;
        let r = self.take_front(buf);
        // A reply was taken off the front (or the buffer is refused): the
        // next reply starts at byte 0.
        if !matches!(r, Ok(None)) {
            self.walk.reset();
        }
        r
    }

    /// Bytes the decoder read for the reply [`Self::next_reply`] last
    /// returned, if it decoded it here (0 otherwise).
    pub(crate) fn last_read(&self) -> usize {
        self.last_read
    }

    fn take_front(&mut self, buf: &mut BytesMut) -> Result<Option<Reply>, String> {
        let max_reply = self.max_reply;
        // Before the recursive decoder sees the bytes: it is what would
        // overflow. While the walk has not found the reply's end, the
        // decoder would only say "incomplete" after going over every byte
        // received so far, so it does not run.
        let r = match self.walk.advance(buf, self.proto, max_reply)? {
            Walked::Incomplete => None,
            // The walk found the reply's end (not a header it refuses),
            // and the decoder would have much to read: split the reply
            // off, without a copy, for the caller to decode.
            Walked::Ready if !self.walk.stopped && self.walk.read() > DECODE_ON_TASK_MAX => {
                Some(self.split_framed(buf))
            }
            // A header the decoder refuses, after much it would read first
            // only to refuse it: refused here from the walk's facts, so bad
            // input never holds the task for long.
            Walked::Ready if self.walk.stopped && self.walk.read() > DECODE_ON_TASK_MAX => {
                let at = self.walk.pos;
                let kind = buf.get(at).map_or(0, |b| *b);
                return Err(format!(
                    "a reply has a header the decoder refuses at byte {at} (type byte {:?})",
                    char::from(kind)
                ));
            }
            Walked::Ready => {
                #[cfg(test)]
                {
                    self.decoder_runs += 1;
                }
                self.last_read = self.walk.read();
                // Should it still find the reply incomplete (reading some
                // header differently from the walk), it runs again after
                // the next read, as it did after every read before.
                decode_first(buf, self.proto)?.map(Reply::Value)
            }
        };
        // Incomplete: `buf` holds only the start of this one reply, so its
        // length is the reply's size so far.
        if r.is_none() && buf.len() > max_reply {
            return Err(format!(
                "an incomplete reply already holds {} bytes, over the {max_reply}-byte reply limit (max_reply_size)",
                buf.len()
            ));
        }
        Ok(r)
    }

    /// Splits the reply the walk has found the end of off `buf`, without a
    /// copy. Out of line: it is the rare case.
    #[cold]
    #[inline(never)]
    fn split_framed(&mut self, buf: &mut BytesMut) -> Reply {
        #[cfg(test)]
        {
            self.framed += 1;
        }
        Reply::Framed(Framed {
            bytes: buf.split_to(self.walk.pos).freeze(),
            proto: self.proto,
        })
    }
}

/// The `redis-protocol` decoder: takes the first reply off the front of
/// `buf`, if it is all there.
#[inline]
fn decode_first(buf: &mut BytesMut, proto: Protocol) -> Result<Option<Value>, String> {
    match proto {
        Protocol::Resp2 => match redis_protocol::resp2::decode::decode_bytes_mut(buf) {
            Ok(Some((f, _, _))) => Ok(Some(Value::from_resp2(f))),
            Ok(None) => Ok(None),
            Err(e) => Err(e.details().to_owned()),
        },
        Protocol::Resp3 => match redis_protocol::resp3::decode::complete::decode_bytes_mut(buf) {
            Ok(Some((f, _, _))) => Ok(Some(Value::from_resp3(f))),
            Ok(None) => Ok(None),
            Err(e) => Err(e.details().to_owned()),
        },
    }
}

/// What the walk says about the reply at the front of the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Walked {
    /// More bytes are needed; the decoder need not run.
    Incomplete,
    /// The decoder should run: the reply's last byte is in the buffer, or
    /// the walk stopped at a header the decoder refuses, and the decoder's
    /// message says what is wrong with it.
    Ready,
}

/// A walk over the type headers of the first reply in a buffer, without
/// recursion, that refuses the reply if it nests deeper than [`MAX_DEPTH`]
/// or declares a length (bytes of a string, elements of an aggregate) above
/// the reply limit, and finds where it ends.
///
/// It runs before the recursive decoder, so it must never stop short of
/// where that decoder could recurse: it stops only at the end of the first
/// reply, at the end of the buffer (incomplete), or at a header the decoder
/// also refuses: a type byte that is not one of the connection's protocol,
/// a length that is not a number, a length the complete decoder refuses
/// (RESP3's `-1` and streamed `?`, any other negative one), a verbatim
/// string too short for its format. There the decoder runs at once and its
/// message reports the bytes, as it did when it ran after every read. What lies inside headers and payloads (an
/// integer that is not a number, a set of arrays, a verbatim string's
/// format) is the decoder's to check, once the walk has found the reply's
/// end: a reply wrong only there is refused when its last byte arrives.
///
/// It keeps its place between calls and examines each header byte once,
/// however many reads the reply takes: it resumes at the header it was
/// waiting for, skips string payloads by their declared length, and
/// remembers how far it searched an unterminated header line for its CRLF,
/// so a simple string of megabytes is not searched again from its start on
/// every read.
#[derive(Debug)]
struct Walk {
    /// `left[d]`: values still to come at nesting depth `d`; depth 0 is the
    /// reply itself. Fixed size: the walk allocates nothing.
    left: [u64; MAX_DEPTH + 1],
    depth: usize,
    /// Where the next header starts, counted from the reply's first byte
    /// (the buffer's front); past the buffer's end while a string's payload
    /// is still arriving.
    pos: usize,
    /// How far the search for the CRLF that ends the header at `pos` has
    /// looked; 0 before the first look.
    searched: usize,
    /// The walk stopped at a header the decoder refuses.
    stopped: bool,
    /// Bytes of bulk-string payloads (`$`) so far in this reply, which
    /// the decoder slices out without reading.
    payloads: usize,
    /// The depth of the values of the outermost set, map or attribute the
    /// walk is inside (0: none). The decoder hashes set members and map
    /// keys (they go into hash sets and maps), so a payload in one counts
    /// as read, not sliced; map values count too, which errs towards
    /// decoding off the task.
    hashed: usize,
    /// Type bytes and header bytes examined, over every reply so far, for
    /// the tests that prove the walk is linear in the replies' size.
    #[cfg(test)]
    examined: usize,
}

impl Walk {
    fn new() -> Self {
        let mut w = Self {
            left: [0; MAX_DEPTH + 1],
            depth: 0,
            pos: 0,
            searched: 0,
            stopped: false,
            payloads: 0,
            hashed: 0,
            #[cfg(test)]
            examined: 0,
        };
        w.reset();
        w
    }

    /// Back to the start, for the next reply at the buffer's front.
    fn reset(&mut self) {
        self.left[0] = 1;
        self.depth = 0;
        self.pos = 0;
        self.searched = 0;
        self.stopped = false;
        self.payloads = 0;
        self.hashed = 0;
    }

    /// Bytes the decoder has to read in the reply walked so far: all but
    /// its bulk strings' payloads (those in sets, maps and attributes are
    /// read: hashed). Once the walk has found the reply's
    /// end, what the decoding costs is about proportional to it (see
    /// [`DECODE_ON_TASK_MAX`]).
    fn read(&self) -> usize {
        self.pos.saturating_sub(self.payloads)
    }

    /// Walks on from where the last call stopped, to the reply's end or the
    /// end of `buf`.
    fn advance(&mut self, buf: &[u8], proto: Protocol, max_reply: usize) -> Result<Walked, String> {
        if self.stopped {
            return Ok(Walked::Ready);
        }
        let limit = max_reply as u64;
        loop {
            while self.left[self.depth] == 0 {
                if self.depth == 0 {
                    // The last value may be a string whose payload is
                    // still arriving.
                    return Ok(if self.pos <= buf.len() {
                        Walked::Ready
                    } else {
                        Walked::Incomplete
                    });
                }
                self.depth -= 1;
                if self.depth < self.hashed {
                    self.hashed = 0;
                }
            }
            let start = self.pos;
            let Some(&kind) = buf.get(start) else {
                return Ok(Walked::Incomplete);
            };
            #[cfg(test)]
            {
                self.examined += 1;
            }
            let known = match proto {
                Protocol::Resp2 => matches!(kind, b'+' | b'-' | b':' | b'$' | b'*'),
                Protocol::Resp3 => matches!(
                    kind,
                    b'+' | b'-'
                        | b':'
                        | b'_'
                        | b'#'
                        | b','
                        | b'('
                        | b'.'
                        | b'H'
                        | b'$'
                        | b'!'
                        | b'='
                        | b';'
                        | b'*'
                        | b'~'
                        | b'>'
                        | b'%'
                        | b'|'
                ),
            };
            if !known {
                // Refused by the decoder with its own message; no need to
                // wait for the line's end.
                return Ok(self.stop());
            }
            // RESP3's inline `HELLO` line starts at the `H`; every other
            // header starts after its type byte. All end at the first CRLF.
            let from = if kind == b'H' { start } else { start + 1 };
            // Resume the search where the last call gave up, one byte back
            // in case that call's last byte was the CR.
            let resume = self.searched.saturating_sub(1).clamp(from, buf.len());
            let Some(i) = memchr::memmem::find(&buf[resume..], b"\r\n") else {
                #[cfg(test)]
                {
                    self.examined += buf.len() - resume;
                }
                self.searched = buf.len();
                return Ok(Walked::Incomplete);
            };
            let eol = resume + i;
            #[cfg(test)]
            {
                self.examined += eol + 2 - resume;
            }
            self.searched = 0;
            let line = &buf[from..eol];
            self.pos = eol + 2;
            let depth = self.depth;
            match kind {
                // Line types: a simple string, error, integer, null, boolean,
                // double, big number, end of stream, inline HELLO.
                b'+' | b'-' | b':' | b'_' | b'#' | b',' | b'(' | b'.' | b'H' => {
                    self.left[depth] -= 1;
                }
                // Length-prefixed strings: bulk, blob error, verbatim, chunk.
                b'$' | b'!' | b'=' | b';' => {
                    self.left[depth] -= 1;
                    match declared(line, proto) {
                        Declared::Len(n) if n > limit => {
                            return Err(format!(
                                "a reply declares a {n}-byte string, over the {max_reply}-byte reply limit (max_reply_size)"
                            ));
                        }
                        // A verbatim string starts with its 4-byte format.
                        Declared::Len(n) if kind == b'=' && n < 4 => return Ok(self.stop()),
                        // `;0` ends a chunked string and has no payload.
                        Declared::Len(0) if kind == b';' => {}
                        // Payload and its CRLF; may point past the buffer's end.
                        Declared::Len(n) => {
                            // `n <= limit`, which came from a `usize`.
                            let n = usize::try_from(n).unwrap_or(usize::MAX);
                            self.pos = self.pos.saturating_add(n).saturating_add(2);
                            // A bulk string becomes a slice of the buffer,
                            // and so does a verbatim string after its
                            // 4-byte format, which is read; a blob error is
                            // copied into a `String`. Inside a set, map or
                            // attribute the decoder hashes it: read.
                            if kind == b'=' && self.hashed == 0 {
                                self.payloads = self.payloads.saturating_add(n - 4);
                            }
                            if kind == b'$' && self.hashed == 0 {
                                self.payloads = self.payloads.saturating_add(n);
                            }
                        }
                        Declared::Null => {}
                        Declared::Refused => return Ok(self.stop()),
                    }
                }
                // Aggregates: array, set, push; map and attribute hold 2 per
                // entry.
                b'*' | b'~' | b'>' | b'%' | b'|' => {
                    let n = match declared(line, proto) {
                        Declared::Len(n) => n,
                        Declared::Null => {
                            // RESP2's null array: no children.
                            self.left[depth] -= 1;
                            continue;
                        }
                        Declared::Refused => return Ok(self.stop()),
                    };
                    if n > limit {
                        return Err(format!(
                            "a reply declares an aggregate of {n} elements, over the {max_reply}-byte reply limit (max_reply_size)"
                        ));
                    }
                    let children = if matches!(kind, b'%' | b'|') {
                        n.saturating_mul(2)
                    } else {
                        n
                    };
                    // An attribute is not the value: the value follows its
                    // entries and takes the slot the attribute arrived in.
                    if kind != b'|' {
                        self.left[depth] -= 1;
                    }
                    if children > 0 {
                        if depth == MAX_DEPTH {
                            return Err(format!(
                                "a reply nests deeper than {MAX_DEPTH} levels (at byte {start})"
                            ));
                        }
                        self.depth += 1;
                        self.left[self.depth] = children;
                        if self.hashed == 0 && matches!(kind, b'~' | b'%' | b'|') {
                            self.hashed = self.depth;
                        }
                    }
                }
                // `known` above admits only the types matched here.
                _ => unreachable!("type byte {kind} passed the protocol check"),
            }
        }
    }

    /// Stops at a header the decoder refuses: every later call says
    /// [`Walked::Ready`] until [`Walk::reset`].
    fn stop(&mut self) -> Walked {
        self.stopped = true;
        Walked::Ready
    }
}

/// A length from a RESP header line, as the decoder reads it.
enum Declared {
    /// A length or count.
    Len(u64),
    /// RESP2's null string or array (`-1`): nothing follows the header.
    Null,
    /// Not a length the decoder accepts.
    Refused,
}

fn declared(line: &[u8], proto: Protocol) -> Declared {
    // The decoder parses with `str::parse` too, so both accept the same
    // spellings (a leading `+`, leading zeros).
    let Ok(s) = std::str::from_utf8(line) else {
        return Declared::Refused;
    };
    match s.parse::<i64>() {
        Ok(n) if n >= 0 => Declared::Len(n as u64),
        // RESP3 has its own null type (`_`); its complete decoder reads `-1`
        // as the start of a streamed value, which it refuses.
        Ok(-1) if proto == Protocol::Resp2 => Declared::Null,
        // Other negative lengths, streamed `?` lengths, and lengths past
        // `i64::MAX`, which some of the decoder's parsers take and wait
        // for: those are over any reply limit, so call them lengths.
        _ => match s.parse::<u64>() {
            Ok(n) => Declared::Len(n),
            Err(_) => Declared::Refused,
        },
    }
}

/// A command: a name and arguments, with the position of the key that routes it.
///
/// ```
/// use railyard_redis::Cmd;
/// let cmd = Cmd::new("SET").key("user:{42}:name").arg("Ada").arg("EX").arg(60);
/// assert_eq!(cmd.routing_key().map(|k| &k[..]), Some(&b"user:{42}:name"[..]));
/// ```
#[derive(Debug, Clone)]
pub struct Cmd {
    args: Vec<Bytes>,
    key: Option<usize>,
    /// A routing key that is not an argument (see [`Cmd::route_by`]).
    route: Option<Bytes>,
}

/// Anything that can be a command argument.
pub trait ToArg {
    /// The argument's bytes.
    fn to_arg(&self) -> Bytes;
}

impl ToArg for &str {
    fn to_arg(&self) -> Bytes {
        Bytes::copy_from_slice(self.as_bytes())
    }
}
impl ToArg for String {
    fn to_arg(&self) -> Bytes {
        Bytes::copy_from_slice(self.as_bytes())
    }
}
impl ToArg for &[u8] {
    fn to_arg(&self) -> Bytes {
        Bytes::copy_from_slice(self)
    }
}
impl ToArg for Bytes {
    fn to_arg(&self) -> Bytes {
        self.clone()
    }
}
impl ToArg for &Bytes {
    fn to_arg(&self) -> Bytes {
        (*self).clone()
    }
}
macro_rules! int_arg {
    ($($t:ty),*) => {$(
        impl ToArg for $t {
            fn to_arg(&self) -> Bytes {
                Bytes::from(self.to_string())
            }
        }
    )*};
}
int_arg!(i32, i64, u16, u32, u64, usize);

impl Cmd {
    /// A command named `name` (e.g. `"GET"`).
    pub fn new(name: &str) -> Self {
        Self {
            args: vec![Bytes::copy_from_slice(name.as_bytes())],
            key: None,
            route: None,
        }
    }

    /// Appends an argument.
    #[must_use]
    pub fn arg(mut self, a: impl ToArg) -> Self {
        self.args.push(a.to_arg());
        self
    }

    /// Appends a key; the first key added routes the command.
    #[must_use]
    pub fn key(mut self, k: impl ToArg) -> Self {
        if self.key.is_none() {
            self.key = Some(self.args.len());
        }
        self.args.push(k.to_arg());
        self
    }

    /// Routes the command to the node serving `key` without sending the key
    /// (e.g. `WAIT` or `SCRIPT LOAD` aimed at one shard).
    #[must_use]
    pub fn route_by(mut self, key: impl ToArg) -> Self {
        self.route = Some(key.to_arg());
        self
    }

    /// The key the command is routed by, if any.
    pub fn routing_key(&self) -> Option<&Bytes> {
        self.route
            .as_ref()
            .or_else(|| self.key.map(|i| &self.args[i]))
    }

    /// Argument `i` (0 is the command's name), if there is one.
    pub(crate) fn arg_at(&self, i: usize) -> Option<&Bytes> {
        self.args.get(i)
    }

    /// The command's name as sent.
    pub fn name(&self) -> String {
        String::from_utf8_lossy(&self.args[0]).into_owned()
    }

    /// Writes the command as a RESP array of bulk strings.
    pub(crate) fn encode_into(&self, out: &mut BytesMut) {
        let len: usize = self.args.iter().map(|a| a.len() + 16).sum::<usize>() + 16;
        out.reserve(len);
        put_header(out, b'*', self.args.len());
        for a in &self.args {
            put_header(out, b'$', a.len());
            out.put_slice(a);
            out.put_slice(b"\r\n");
        }
    }

    /// The encoded command.
    pub(crate) fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        self.encode_into(&mut b);
        b.freeze()
    }
}

fn put_header(out: &mut BytesMut, kind: u8, n: usize) {
    out.put_u8(kind);
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.put_slice(&digits[i..]);
    out.put_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_encode_as_arrays_of_bulk_strings() {
        let c = Cmd::new("SET").key("k").arg("value").arg(10u64);
        assert_eq!(
            &c.encode()[..],
            b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nvalue\r\n$2\r\n10\r\n"
        );
    }

    #[test]
    fn replies_decode_incrementally() {
        let mut r = ReplyDecoder::new(Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE);
        let mut b = BytesMut::from(&b"$5\r\nhel"[..]);
        assert_eq!(r.decode(&mut b), Ok(None));
        b.extend_from_slice(b"lo\r\n:7\r\n");
        assert_eq!(
            r.decode(&mut b),
            Ok(Some(Value::Bulk(Bytes::from_static(b"hello"))))
        );
        assert_eq!(r.decode(&mut b), Ok(Some(Value::Int(7))));
        assert!(b.is_empty());
        assert!(dec(b"?garbage\r\n", Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE).is_err());
        assert_eq!(
            dec(
                b"%1\r\n+a\r\n:1\r\n",
                Protocol::Resp3,
                DEFAULT_MAX_REPLY_SIZE
            ),
            Ok(Some(Value::Map(vec![(
                Value::Status(Bytes::from_static(b"a")),
                Value::Int(1)
            )])))
        );
    }

    const BOTH: [Protocol; 2] = [Protocol::Resp2, Protocol::Resp3];

    impl ReplyDecoder {
        /// The next reply, decoded: a framed one here, as its caller would.
        fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Value>, String> {
            match self.next_reply(buf)? {
                Some(Reply::Value(v)) => Ok(Some(v)),
                Some(Reply::Framed(f)) => f.decode().map(Some),
                None => Ok(None),
            }
        }
    }

    /// The first reply in `bytes`, decoded by a fresh decoder.
    fn dec(bytes: &[u8], proto: Protocol, max: usize) -> Result<Option<Value>, String> {
        ReplyDecoder::new(proto, max).decode(&mut BytesMut::from(bytes))
    }

    /// Feeds `bytes` to one decoder `piece` bytes at a time, as reads would
    /// deliver them, taking every complete reply off the buffer after each
    /// piece. Returns the decoder (for its counters) and the replies, or
    /// the first error.
    fn fed_in_pieces(
        bytes: &[u8],
        proto: Protocol,
        max: usize,
        piece: usize,
    ) -> (ReplyDecoder, Result<Vec<Value>, String>) {
        let mut r = ReplyDecoder::new(proto, max);
        let mut buf = BytesMut::new();
        let mut replies = Vec::new();
        for p in bytes.chunks(piece) {
            buf.extend_from_slice(p);
            loop {
                match r.decode(&mut buf) {
                    Ok(Some(v)) => replies.push(v),
                    Ok(None) => break,
                    Err(e) => return (r, Err(e)),
                }
            }
        }
        (r, Ok(replies))
    }

    /// `levels` copies of `open` followed by `leaf`.
    fn nested(open: &[u8], levels: usize, leaf: &[u8]) -> Vec<u8> {
        let mut b = open.repeat(levels);
        b.extend_from_slice(leaf);
        b
    }

    /// `depth` arrays of one element around `leaf`.
    fn arrays(depth: usize, leaf: Value) -> Value {
        (0..depth).fold(leaf, |v, _| Value::Array(vec![v]))
    }

    #[test]
    fn a_reply_nested_past_the_limit_is_refused_not_a_stack_overflow() {
        // Without the shape check the decoder recurses 100,000 times and the
        // test process dies of a stack overflow instead of failing here.
        let deep = nested(b"*1\r\n", 100_000, b":1\r\n");
        for proto in BOTH {
            let err = dec(&deep, proto, DEFAULT_MAX_REPLY_SIZE).unwrap_err();
            assert!(err.contains("deeper than 64 levels"), "{proto:?}: {err}");
        }
        // One level past the limit is enough.
        let err = dec(
            &nested(b"*1\r\n", MAX_DEPTH + 1, b":1\r\n"),
            Protocol::Resp2,
            DEFAULT_MAX_REPLY_SIZE,
        )
        .unwrap_err();
        assert!(err.contains("deeper than 64 levels"), "{err}");
        // RESP3 aggregates nest the same way: maps (a value per key),
        // sets, pushes and attributes (which recurse before their value).
        for open in [&b"%1\r\n+k\r\n"[..], b"~1\r\n", b">1\r\n", b"|1\r\n+k\r\n"] {
            let err = dec(
                &nested(open, 100_000, b":1\r\n"),
                Protocol::Resp3,
                DEFAULT_MAX_REPLY_SIZE,
            )
            .unwrap_err();
            assert!(
                err.contains("deeper than 64 levels"),
                "{}: {err}",
                String::from_utf8_lossy(open)
            );
        }
        // Depth hidden after bulk strings whose payload looks like headers
        // is still found: payloads are skipped by length, not parsed.
        let mut b = b"*2\r\n$4\r\n*1\r\n\r\n".to_vec();
        b.extend(nested(b"*1\r\n", 1_000, b":1\r\n"));
        let err = dec(&b, Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE).unwrap_err();
        assert!(err.contains("deeper than 64 levels"), "{err}");
    }

    #[test]
    fn replies_nested_within_the_limit_still_decode() {
        // Exactly the limit, on a thread with a tokio worker's 2 MiB stack:
        // the depth the check lets through must decode there, for every
        // aggregate (maps cost the decoder the most stack per level).
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| {
                let b = nested(b"*1\r\n", MAX_DEPTH, b":7\r\n");
                for proto in BOTH {
                    let got = dec(&b, proto, DEFAULT_MAX_REPLY_SIZE);
                    assert_eq!(got, Ok(Some(arrays(MAX_DEPTH, Value::Int(7)))));
                }
                // (Sets cannot nest: the decoder wants hashable members.)
                let got = dec(
                    &nested(b">1\r\n", MAX_DEPTH, b":7\r\n"),
                    Protocol::Resp3,
                    DEFAULT_MAX_REPLY_SIZE,
                );
                assert_eq!(got, Ok(Some(arrays(MAX_DEPTH, Value::Int(7)))));
                let k = || Value::Status(Bytes::from_static(b"k"));
                let maps = (0..MAX_DEPTH).fold(Value::Int(7), |v, _| Value::Map(vec![(k(), v)]));
                let got = dec(
                    &nested(b"%1\r\n+k\r\n", MAX_DEPTH, b":7\r\n"),
                    Protocol::Resp3,
                    DEFAULT_MAX_REPLY_SIZE,
                );
                assert_eq!(got, Ok(Some(maps)));
                // Each attribute's entry holds the next one, and each is
                // followed by its value; the decoder drops attributes.
                let mut b = b"|1\r\n+k\r\n".repeat(MAX_DEPTH);
                b.extend(b":7\r\n".repeat(MAX_DEPTH + 1));
                let got = dec(&b, Protocol::Resp3, DEFAULT_MAX_REPLY_SIZE);
                assert_eq!(got, Ok(Some(Value::Int(7))));
            })
            .unwrap()
            .join()
            .unwrap();
        // Arrays of arrays, with a null, an empty array and a bulk string
        // whose payload looks like a header; then the next reply.
        let mut b =
            BytesMut::from(&b"*3\r\n*2\r\n:1\r\n$-1\r\n*0\r\n*1\r\n$4\r\n*9\r\n\r\n:5\r\n"[..]);
        let want = Value::Array(vec![
            Value::Array(vec![Value::Int(1), Value::Nil]),
            Value::Array(vec![]),
            Value::Array(vec![Value::Bulk(Bytes::from_static(b"*9\r\n"))]),
        ]);
        let mut r = ReplyDecoder::new(Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE);
        assert_eq!(r.decode(&mut b), Ok(Some(want)));
        assert_eq!(r.decode(&mut b), Ok(Some(Value::Int(5))));
        // RESP3: a map holding a set and a nested map, then an attribute
        // (dropped by the decoder) in front of an array.
        let mut b = BytesMut::from(
            &b"%2\r\n+a\r\n~1\r\n:1\r\n+b\r\n%1\r\n+c\r\n*1\r\n#t\r\n|1\r\n+ttl\r\n:3\r\n*1\r\n,1.5\r\n"[..],
        );
        let s = |x: &'static [u8]| Value::Status(Bytes::from_static(x));
        let mut r = ReplyDecoder::new(Protocol::Resp3, DEFAULT_MAX_REPLY_SIZE);
        let Ok(Some(Value::Map(mut m))) = r.decode(&mut b) else {
            panic!("not a map");
        };
        m.sort_by_key(|(k, _)| format!("{k:?}"));
        assert_eq!(
            m,
            vec![
                (s(b"a"), Value::Array(vec![Value::Int(1)])),
                (
                    s(b"b"),
                    Value::Map(vec![(s(b"c"), Value::Array(vec![Value::Bool(true)]))])
                ),
            ]
        );
        assert_eq!(
            r.decode(&mut b),
            Ok(Some(Value::Array(vec![Value::Double(1.5)])))
        );
        assert!(b.is_empty());
    }

    #[test]
    fn an_incomplete_reply_is_incomplete_not_an_error() {
        // A prefix as deep as allowed, its innermost value still to come.
        let mut b = BytesMut::from(&b"*1\r\n".repeat(MAX_DEPTH)[..]);
        for proto in BOTH {
            assert_eq!(dec(&b, proto, DEFAULT_MAX_REPLY_SIZE), Ok(None));
        }
        // Cut inside a header line, then inside a bulk payload.
        let mut r = ReplyDecoder::new(Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE);
        assert_eq!(r.decode(&mut b), Ok(None));
        b.extend_from_slice(b"$1");
        assert_eq!(r.decode(&mut b), Ok(None));
        b.extend_from_slice(b"0\r\nhello");
        assert_eq!(r.decode(&mut b), Ok(None));
        b.extend_from_slice(b"world\r\n");
        assert_eq!(
            r.decode(&mut b),
            Ok(Some(arrays(
                MAX_DEPTH,
                Value::Bulk(Bytes::from_static(b"helloworld"))
            )))
        );
        assert!(b.is_empty());
        // A prefix already past the limit is refused without waiting for
        // the rest: no ending can make it acceptable.
        let err = dec(
            &b"*1\r\n".repeat(MAX_DEPTH + 1),
            Protocol::Resp2,
            DEFAULT_MAX_REPLY_SIZE,
        )
        .unwrap_err();
        assert!(err.contains("deeper than 64 levels"), "{err}");
    }

    #[test]
    fn a_length_over_the_reply_limit_is_refused() {
        // Declared lengths are refused as soon as their header arrives,
        // before any payload is buffered.
        for proto in BOTH {
            let err = dec(b"$536870913\r\n", proto, DEFAULT_MAX_REPLY_SIZE).unwrap_err();
            assert!(err.contains("536870913-byte string"), "{err}");
            let err = dec(b"*9223372036854775807\r\n", proto, DEFAULT_MAX_REPLY_SIZE).unwrap_err();
            assert!(err.contains("aggregate of 9223372036854775807"), "{err}");
            // Inside an aggregate too.
            let err = dec(b"*2\r\n:1\r\n$2000\r\n", proto, 1024).unwrap_err();
            assert!(err.contains("2000-byte string"), "{err}");
            // At the limit is fine (and incomplete here).
            assert_eq!(dec(b"$1024\r\nabc", proto, 1024), Ok(None));
        }
        let err = dec(b"%5000\r\n", Protocol::Resp3, 1024).unwrap_err();
        assert!(err.contains("aggregate of 5000"), "{err}");
        // Lengths that are each fine but add up: the buffered, still
        // incomplete reply passing the limit is refused.
        let mut b = b"*1000\r\n".to_vec();
        b.extend(b":1\r\n".repeat(300));
        let err = dec(&b, Protocol::Resp2, 1024).unwrap_err();
        assert!(
            err.contains("incomplete reply already holds 1207 bytes"),
            "{err}"
        );
        assert_eq!(dec(&b, Protocol::Resp2, 2048), Ok(None));
    }

    /// An array of `n` bulk strings, `value-0` up to `value-{n-1}`, and the
    /// value it decodes to.
    fn bulk_array(n: usize) -> (Vec<u8>, Value) {
        let mut b = format!("*{n}\r\n").into_bytes();
        let mut v = Vec::with_capacity(n);
        for i in 0..n {
            let s = format!("value-{i}");
            b.extend(format!("${}\r\n{s}\r\n", s.len()).bytes());
            v.push(Value::Bulk(Bytes::from(s)));
        }
        (b, Value::Array(v))
    }

    /// `levels` nested arrays, each holding an integer, a bulk string whose
    /// payload looks like a header, and the next level (the innermost holds
    /// an empty array).
    fn nested_arrays(levels: usize) -> (Vec<u8>, Value) {
        let mut b = Vec::new();
        for i in 0..levels {
            b.extend(format!("*3\r\n:{i}\r\n$4\r\n*9\r\n\r\n").bytes());
        }
        b.extend_from_slice(b"*0\r\n");
        let v = (0..levels).rev().fold(Value::Array(vec![]), |inner, i| {
            Value::Array(vec![
                Value::Int(i as i64),
                Value::Bulk(Bytes::from_static(b"*9\r\n")),
                inner,
            ])
        });
        (b, v)
    }

    /// A simple string of `len` bytes (rounded down to a multiple of 8),
    /// with a lone CR and a lone LF in every 8: only a CRLF ends the line.
    fn long_line(len: usize) -> (Vec<u8>, Value) {
        let text = b"abc\rdef\n".repeat(len / 8);
        let mut b = b"+".to_vec();
        b.extend_from_slice(&text);
        b.extend_from_slice(b"\r\n");
        (b, Value::Status(Bytes::from(text)))
    }

    #[test]
    fn a_reply_fed_in_pieces_decodes_as_when_fed_whole() {
        let (array, array_v) = bulk_array(10_000);
        let (nested, nested_v) = nested_arrays(5);
        let (line, line_v) = long_line(200_000);
        let replies = [(&array, &array_v), (&nested, &nested_v), (&line, &line_v)];
        for proto in BOTH {
            for (bytes, want) in replies {
                for piece in [1, 7, 1000, bytes.len()] {
                    let (_, got) = fed_in_pieces(bytes, proto, DEFAULT_MAX_REPLY_SIZE, piece);
                    assert_eq!(
                        got.as_deref(),
                        Ok(std::slice::from_ref(want)),
                        "{proto:?}, {} bytes in pieces of {piece}",
                        bytes.len()
                    );
                }
            }
            // The three back to back, each after a small reply: once a
            // reply is taken off the buffer, the next is walked from its own
            // first byte.
            let mut all = Vec::new();
            let mut want = Vec::new();
            for (i, (bytes, v)) in replies.into_iter().enumerate() {
                all.extend(format!(":{i}\r\n").bytes());
                all.extend_from_slice(bytes);
                want.extend([Value::Int(i as i64), v.clone()]);
            }
            for piece in [7, 4096, all.len()] {
                let (r, got) = fed_in_pieces(&all, proto, DEFAULT_MAX_REPLY_SIZE, piece);
                assert_eq!(got.as_ref(), Ok(&want), "{proto:?}, pieces of {piece}");
                assert_eq!(
                    (r.decoder_runs, r.framed),
                    (4, 2),
                    "{proto:?}, pieces of {piece}"
                );
            }
        }
        // RESP3's own types, a byte at a time: a map holding a set, a push,
        // a verbatim string, a blob error, a double, a boolean, a null and a
        // big number (one entry each: sets and maps come out in hash order);
        // then an attribute in front of an array.
        let b = b"%1\r\n+a\r\n*3\r\n~1\r\n:1\r\n+b\r\n>5\r\n=7\r\ntxt:abc\r\n!3\r\nERR\r\n,2.5\r\n#f\r\n*2\r\n_\r\n(12345678901234567890\r\n|1\r\n+ttl\r\n:3\r\n*1\r\n$2\r\nhi\r\n";
        let s = |x: &'static [u8]| Value::Status(Bytes::from_static(x));
        let want = vec![
            Value::Map(vec![(
                s(b"a"),
                Value::Array(vec![
                    Value::Array(vec![Value::Int(1)]),
                    s(b"b"),
                    Value::Array(vec![
                        Value::Bulk(Bytes::from_static(b"abc")),
                        Value::Error("ERR".into()),
                        Value::Double(2.5),
                        Value::Bool(false),
                        Value::Array(vec![Value::Nil, s(b"12345678901234567890")]),
                    ]),
                ]),
            )]),
            Value::Array(vec![Value::Bulk(Bytes::from_static(b"hi"))]),
        ];
        for piece in [1, 2, b.len()] {
            let (r, got) = fed_in_pieces(b, Protocol::Resp3, DEFAULT_MAX_REPLY_SIZE, piece);
            assert_eq!(got.as_ref(), Ok(&want), "pieces of {piece}");
            assert_eq!((r.decoder_runs, r.framed), (2, 0), "pieces of {piece}");
        }
    }

    #[test]
    fn a_reply_in_a_thousand_pieces_is_walked_once_and_decoded_once() {
        // Starting over on every piece would examine the headers received
        // so far each time, about 500 times the reply's size here, and run
        // the decoder 1,000 times. Both replies are too long to decode on
        // the connection's task: they are framed once, and decoded once by
        // `fed_in_pieces` as their caller would.
        let (array, _) = bulk_array(10_000);
        let (line, _) = long_line(200_000);
        for proto in BOTH {
            for bytes in [&array, &line] {
                let piece = bytes.len().div_ceil(1000);
                let (r, got) = fed_in_pieces(bytes, proto, DEFAULT_MAX_REPLY_SIZE, piece);
                assert_eq!(got.map(|v| v.len()), Ok(1));
                assert_eq!((r.decoder_runs, r.framed), (0, 1), "{proto:?}");
                // Each byte once, plus at most the type byte and one byte
                // back (a CR that may end the line) again per piece.
                assert!(
                    r.walk.examined <= bytes.len() + 2 * 1000,
                    "{proto:?}: {} bytes examined for a {}-byte reply in 1,000 pieces",
                    r.walk.examined,
                    bytes.len()
                );
            }
        }
    }

    #[test]
    fn refusals_are_the_same_when_bytes_arrive_in_pieces() {
        let deep = nested(b"*1\r\n", 100_000, b":1\r\n");
        let mut hidden = b"*2\r\n$4\r\n*1\r\n\r\n".to_vec();
        hidden.extend(nested(b"*1\r\n", 1_000, b":1\r\n"));
        let mut many = b"*1000\r\n".to_vec();
        many.extend(b":1\r\n".repeat(300));
        let deeper = "deeper than 64 levels";
        let max = DEFAULT_MAX_REPLY_SIZE;
        let mut cases: Vec<(&[u8], Protocol, usize, &str)> = Vec::new();
        for proto in BOTH {
            cases.extend([
                (&deep[..], proto, max, deeper),
                (&hidden[..], proto, max, deeper),
                (b"$536870913\r\n", proto, max, "536870913-byte string"),
                (
                    b"*9223372036854775807\r\n",
                    proto,
                    max,
                    "aggregate of 9223372036854775807",
                ),
                (b"*2\r\n:1\r\n$2000\r\n", proto, 1024, "2000-byte string"),
                (&many[..], proto, 1024, "incomplete reply already holds"),
                // Not RESP: the decoder's own message.
                (b"?garbage\r\n", proto, max, ""),
            ]);
        }
        let maps = nested(b"%1\r\n+k\r\n", 100_000, b":1\r\n");
        let attrs = nested(b"|1\r\n+k\r\n", 100_000, b":1\r\n");
        cases.extend([
            (&maps[..], Protocol::Resp3, max, deeper),
            (&attrs[..], Protocol::Resp3, max, deeper),
            (b"%5000\r\n", Protocol::Resp3, 1024, "aggregate of 5000"),
        ]);
        for (bytes, proto, max, want) in cases {
            let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(24)]).into_owned();
            let (_, whole) = fed_in_pieces(bytes, proto, max, bytes.len());
            let whole = whole.unwrap_err();
            assert!(whole.contains(want), "{proto:?} {shown:?}: {whole}");
            for piece in [1, 3, 7, 64] {
                let (_, got) = fed_in_pieces(bytes, proto, max, piece);
                let got = got.unwrap_err();
                if want.starts_with("incomplete") {
                    // How much is buffered when the limit is passed depends
                    // on where the pieces end.
                    assert!(got.contains(want), "{proto:?} {shown:?}, {piece}: {got}");
                } else {
                    assert_eq!(got, whole, "{proto:?} {shown:?}, pieces of {piece}");
                }
            }
        }
        // At the limit is fine, and incomplete, however it arrives.
        for proto in BOTH {
            for piece in [1, 7] {
                let (_, got) = fed_in_pieces(b"$1024\r\nabc", proto, 1024, piece);
                assert_eq!(got, Ok(vec![]));
            }
        }
    }

    #[test]
    fn a_header_the_decoder_refuses_is_refused_before_the_reply_ends() {
        // Each reply is incomplete at the bad header, yet the decoder runs
        // there and reports it, as it did when it ran after every read,
        // rather than the connection waiting for bytes that may never come.
        let cases: [(&[u8], Protocol); 6] = [
            // A RESP3 type on a RESP2 connection.
            (b"*3\r\n:1\r\n~1\r\n", Protocol::Resp2),
            (b"*3\r\n:1\r\n$-2\r\n", Protocol::Resp2),
            (b"*3\r\n:1\r\n$?\r\n", Protocol::Resp2),
            // RESP3's complete decoder refuses streamed values and RESP2 nulls.
            (b"*3\r\n:1\r\n*-1\r\n", Protocol::Resp3),
            (b"*3\r\n:1\r\n$?\r\n", Protocol::Resp3),
            // A verbatim string too short for its format.
            (b"*3\r\n:1\r\n=2\r\nab\r\n", Protocol::Resp3),
        ];
        for (bytes, proto) in cases {
            for piece in [1, bytes.len()] {
                let (_, got) = fed_in_pieces(bytes, proto, DEFAULT_MAX_REPLY_SIZE, piece);
                assert!(
                    got.is_err(),
                    "{proto:?} {:?}, pieces of {piece}: {got:?}",
                    String::from_utf8_lossy(bytes)
                );
            }
        }
        // RESP2's null string and array are values, not refusals.
        assert_eq!(
            dec(
                b"*2\r\n$-1\r\n*-1\r\n",
                Protocol::Resp2,
                DEFAULT_MAX_REPLY_SIZE
            ),
            Ok(Some(Value::Array(vec![Value::Nil, Value::Nil])))
        );
    }

    /// `n` values made by `one`, in an array (`*`) or another aggregate.
    fn aggregate(kind: u8, n: usize, one: impl Fn(usize) -> String) -> Vec<u8> {
        let mut b = format!("{}{n}\r\n", kind as char).into_bytes();
        for i in 0..n {
            b.extend(one(i).bytes());
        }
        b
    }

    /// `bytes` then `:7`, fed to a fresh decoder: its first reply, once
    /// `:7` has come out next as a value (so the first one's end was found
    /// exactly).
    fn first_then_seven(bytes: &[u8], proto: Protocol) -> Reply {
        let mut buf = BytesMut::from(bytes);
        buf.extend_from_slice(b":7\r\n");
        let mut r = ReplyDecoder::new(proto, DEFAULT_MAX_REPLY_SIZE);
        let first = r.next_reply(&mut buf).unwrap().expect("a complete reply");
        assert!(
            matches!(
                r.next_reply(&mut buf),
                Ok(Some(Reply::Value(Value::Int(7))))
            ),
            "{proto:?}: the reply after it"
        );
        assert!(buf.is_empty());
        first
    }

    #[test]
    fn a_reply_with_much_to_decode_is_framed_and_decodes_as_on_the_task() {
        let ints = aggregate(b'*', 2_000, |i| format!(":{i}\r\n"));
        let (array, _) = bulk_array(10_000);
        let (line, _) = long_line(200_000);
        let nested = aggregate(b'*', 1_000, |i| format!("*2\r\n:{i}\r\n$1\r\nx\r\n"));
        let map = aggregate(b'%', 1_000, |i| format!("+k{i}\r\n:{i}\r\n"));
        let set = aggregate(b'~', 1_000, |i| format!(":{i}\r\n"));
        let mut cases: Vec<(&[u8], Protocol)> = Vec::new();
        for proto in BOTH {
            cases.extend([
                (&ints[..], proto),
                (&array[..], proto),
                (&line[..], proto),
                (&nested[..], proto),
            ]);
        }
        cases.extend([(&map[..], Protocol::Resp3), (&set[..], Protocol::Resp3)]);
        for (bytes, proto) in cases {
            let shown = String::from_utf8_lossy(&bytes[..12]).into_owned();
            let Reply::Framed(f) = first_then_seven(bytes, proto) else {
                panic!("{proto:?} {shown:?}: decoded on the task");
            };
            assert_eq!(&f.bytes[..], bytes, "{proto:?} {shown:?}");
            // The decoder run directly over the same bytes, as the task
            // ran it before hand-offs.
            let direct = decode_first(&mut BytesMut::from(bytes), proto);
            let (Ok(Some(direct)), Ok(framed)) = (direct, f.decode()) else {
                panic!("{proto:?} {shown:?}: not decoded");
            };
            // (Sets and maps come out in hash order.)
            assert!(in_order(framed) == in_order(direct), "{proto:?} {shown:?}");
        }
    }

    /// `v` with the elements of its arrays and maps sorted.
    fn in_order(v: Value) -> Value {
        let key = |v: &Value| format!("{v:?}");
        match v {
            Value::Array(a) => {
                let mut a: Vec<Value> = a.into_iter().map(in_order).collect();
                a.sort_by_cached_key(key);
                Value::Array(a)
            }
            Value::Map(m) => {
                let mut m: Vec<(Value, Value)> = m
                    .into_iter()
                    .map(|(k, v)| (in_order(k), in_order(v)))
                    .collect();
                m.sort_by_cached_key(|(k, _)| key(k));
                Value::Map(m)
            }
            v => v,
        }
    }

    #[test]
    fn what_is_framed_is_what_the_decoder_would_read_not_the_reply_size() {
        for proto in BOTH {
            // A simple string's bytes all count: 3 of the header and CRLF.
            for (len, framed) in [
                (DECODE_ON_TASK_MAX - 3, false),
                (DECODE_ON_TASK_MAX - 2, true),
            ] {
                let mut b = b"+".to_vec();
                b.extend(b"a".repeat(len));
                b.extend(b"\r\n");
                let r = first_then_seven(&b, proto);
                assert_eq!(matches!(r, Reply::Framed(_)), framed, "{proto:?}, {len}");
            }
            // A bulk string's payload is sliced, not read: a value of 1 MiB
            // (a `GET` of it), or a hundred of 10 KiB, decode on the task.
            let mut one = b"$1048576\r\n".to_vec();
            one.extend(vec![b'v'; 1 << 20]);
            one.extend(b"\r\n");
            let hundred = aggregate(b'*', 100, |_| {
                format!("${0}\r\n{1}\r\n", 10 << 10, "v".repeat(10 << 10))
            });
            for b in [&one, &hundred] {
                let Reply::Value(v) = first_then_seven(b, proto) else {
                    panic!("{proto:?}: a reply of {} bytes was framed", b.len());
                };
                assert_eq!(
                    Ok(Some(v)),
                    decode_first(&mut BytesMut::from(&b[..]), proto)
                );
            }
            // Error replies are lines: MOVED and ASK decode on the task, for
            // the client's redirect handling. An error line too long to
            // decode there still reaches the caller as the same error.
            let moved = b"-MOVED 3999 127.0.0.1:6381\r\n";
            assert!(matches!(
                first_then_seven(moved, proto),
                Reply::Value(Value::Error(e)) if e == "MOVED 3999 127.0.0.1:6381"
            ));
            let mut long = b"-ERR ".to_vec();
            long.extend(b"x".repeat(DECODE_ON_TASK_MAX));
            long.extend(b"\r\n");
            let Reply::Framed(f) = first_then_seven(&long, proto) else {
                panic!("{proto:?}: a long error line decoded on the task");
            };
            assert!(matches!(f.decode(), Ok(Value::Error(e)) if e.len() == 4 + DECODE_ON_TASK_MAX));
        }
        // A RESP3 blob error is copied into a `String`: its payload counts.
        let mut blob = format!("!{}\r\n", DECODE_ON_TASK_MAX).into_bytes();
        blob.extend(b"e".repeat(DECODE_ON_TASK_MAX));
        blob.extend(b"\r\n");
        assert!(matches!(
            first_then_seven(&blob, Protocol::Resp3),
            Reply::Framed(_)
        ));
    }

    #[test]
    fn a_framed_reply_the_decoder_refuses_fails_alone_with_the_decoders_words() {
        // The walk checks headers, not what is inside them: this integer
        // is the decoder's to refuse, after the walk has found the end.
        let mut bad = aggregate(b'*', 2_000, |i| format!(":{i}\r\n"));
        bad.extend_from_slice(b"*1\r\n:x\r\n");
        bad[1..5].copy_from_slice(b"2001");
        for proto in BOTH {
            let direct = decode_first(&mut BytesMut::from(&bad[..]), proto).unwrap_err();
            // Framed, not refused: the reply after it still comes out.
            let Reply::Framed(f) = first_then_seven(&bad, proto) else {
                panic!("{proto:?}: decoded on the task");
            };
            assert_eq!(f.decode(), Err(direct.clone()), "{proto:?}");
            // The same fault in a short reply is refused on the task, with
            // the same words, as before.
            let mut r = ReplyDecoder::new(proto, DEFAULT_MAX_REPLY_SIZE);
            let short = r.next_reply(&mut BytesMut::from(&b"*2\r\n:1\r\n:x\r\n"[..]));
            assert_eq!(short.map(|_| ()), Err(direct), "{proto:?}");
        }
    }

    #[test]
    fn a_refused_header_after_much_to_read_is_refused_without_the_decoder() {
        // 2,000 integers, then an array length that is not a number: the
        // walk stops there, past DECODE_ON_TASK_MAX bytes to read.
        let mut bad = aggregate(b'*', 2_000, |i| format!(":{i}\r\n"));
        bad.extend_from_slice(b"*x\r\n");
        bad[1..5].copy_from_slice(b"2001");
        for proto in BOTH {
            let mut r = ReplyDecoder::new(proto, DEFAULT_MAX_REPLY_SIZE);
            let e = r
                .next_reply(&mut BytesMut::from(&bad[..]))
                .map(|_| ())
                .unwrap_err();
            assert!(e.contains("refuses at byte"), "{proto:?}: {e}");
            assert_eq!(r.decoder_runs, 0, "{proto:?}: the decoder did not run");
            // Short, the decoder still reports it in its own words.
            let mut r = ReplyDecoder::new(proto, DEFAULT_MAX_REPLY_SIZE);
            let short = r.next_reply(&mut BytesMut::from(&b"*2\r\n:1\r\n*x\r\n"[..]));
            assert!(short.is_err(), "{proto:?}");
            assert_eq!(r.decoder_runs, 1, "{proto:?}");
        }
    }

    #[test]
    fn last_read_counts_what_the_decoder_read_here() {
        let mut r = ReplyDecoder::new(Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE);
        let mut buf = BytesMut::from(&b"$2\r\nok\r\n"[..]);
        assert!(r.next_reply(&mut buf).unwrap().is_some());
        assert_eq!(
            r.last_read(),
            6,
            "the header and the CRLFs, not the payload"
        );
        let big = aggregate(b'*', 2_000, |i| format!(":{i}\r\n"));
        let mut buf = BytesMut::from(&big[..]);
        assert!(matches!(r.next_reply(&mut buf), Ok(Some(Reply::Framed(_)))));
        assert_eq!(r.last_read(), 0, "framed: nothing decoded here");
    }

    /// Set members and map keys are hashed by the decoder, so their payloads
    /// count as read: a RESP3 set or map of a few large strings goes to the
    /// caller, while the same strings in an array stay sliced here; the
    /// walk leaves a set before the strings that follow it.
    #[test]
    fn payloads_in_sets_and_maps_count_as_read() {
        let member = |i: usize| {
            format!(
                "${}\r\n{}{}\r\n",
                10_000,
                i,
                "x".repeat(10_000 - i.to_string().len())
            )
        };
        for kind in [b'~', b'%'] {
            // A set of 4 members, or a map of 2 entries (a key and a value each).
            let reply = if kind == b'%' {
                aggregate(kind, 2, |i| member(2 * i) + &member(2 * i + 1))
            } else {
                aggregate(kind, 4, member)
            };
            let mut r = ReplyDecoder::new(Protocol::Resp3, DEFAULT_MAX_REPLY_SIZE);
            let mut buf = BytesMut::from(&reply[..]);
            assert!(
                matches!(r.next_reply(&mut buf), Ok(Some(Reply::Framed(_)))),
                "{}: 40 KB to hash goes to the caller",
                char::from(kind)
            );
        }
        let mut r = ReplyDecoder::new(Protocol::Resp3, DEFAULT_MAX_REPLY_SIZE);
        let mut buf = BytesMut::from(&aggregate(b'*', 4, member)[..]);
        assert!(matches!(r.next_reply(&mut buf), Ok(Some(Reply::Value(_)))));
        assert!(
            r.last_read() < 100,
            "an array's strings are sliced: {}",
            r.last_read()
        );
        // An array holding a small set, then large strings: only the set's
        // member counts.
        let mut reply = b"*3\r\n~1\r\n$1\r\na\r\n".to_vec();
        reply.extend_from_slice(member(0).as_bytes());
        reply.extend_from_slice(member(1).as_bytes());
        let mut buf = BytesMut::from(&reply[..]);
        assert!(matches!(r.next_reply(&mut buf), Ok(Some(Reply::Value(_)))));
        assert!(
            r.last_read() < 100,
            "strings after the set are sliced: {}",
            r.last_read()
        );
    }

    /// A small deterministic generator (xorshift), so the test needs no
    /// extra crate and fails the same way every run.
    struct Gen(u64);

    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn text(&mut self, max: u64) -> String {
            (0..self.below(max + 1))
                .map(|_| char::from(b'a' + self.below(26) as u8))
                .collect()
        }
        /// A scalar the decoders accept as a map key or set member, all
        /// but surely unique (a map keeps one entry per key).
        fn key(&mut self, out: &mut Vec<u8>) {
            let unique: String = (0..12)
                .map(|_| char::from(b'a' + self.below(26) as u8))
                .collect();
            match self.below(3) {
                0 => out.extend(format!("+{unique}\r\n").bytes()),
                1 => out.extend(format!(":{}\r\n", self.next() as i64).bytes()),
                _ => out.extend(format!("${}\r\n{unique}\r\n", unique.len()).bytes()),
            }
        }
        /// One value, nested at most `depth` more levels; now and then a
        /// large aggregate or payload, so that some replies are handed off.
        fn value(&mut self, proto: Protocol, depth: u32, out: &mut Vec<u8>) {
            let kinds = if proto == Protocol::Resp2 { 7 } else { 17 };
            let kind = if depth == 0 {
                self.below(4)
            } else {
                self.below(kinds)
            };
            match kind {
                0 => self.key(out),
                1 => out.extend(format!("-ERR {}\r\n", self.text(10)).bytes()),
                2 => {
                    // A payload that looks like headers, or a large one.
                    let payload: Vec<u8> = if self.below(8) == 0 {
                        vec![b'x'; 6_000]
                    } else {
                        b"*3\r\n:1\r\n".repeat(self.below(3) as usize)
                    };
                    out.extend(format!("${}\r\n", payload.len()).bytes());
                    out.extend(&payload);
                    out.extend(b"\r\n");
                }
                3 => {
                    if proto == Protocol::Resp2 {
                        out.extend(b"$-1\r\n");
                    } else {
                        out.extend(b"_\r\n");
                    }
                }
                4 | 5 => {
                    // Arrays, sometimes of hundreds of values.
                    // Large ones hold scalars, so the stream stays small.
                    let (n, inner) = if self.below(10) == 0 {
                        (300 + self.below(400), 0)
                    } else {
                        (self.below(6), depth - 1)
                    };
                    out.extend(format!("*{n}\r\n").bytes());
                    for _ in 0..n {
                        self.value(proto, inner, out);
                    }
                }
                6 => {
                    if proto == Protocol::Resp2 {
                        out.extend(b"*-1\r\n");
                    } else {
                        out.extend(
                            format!("#{}\r\n", if self.below(2) == 0 { 't' } else { 'f' }).bytes(),
                        );
                    }
                }
                7 => out.extend(format!(",{}.5\r\n", self.below(1000)).bytes()),
                8 => out.extend(
                    format!("({}{}\r\n", 1 + self.below(9), self.below(u64::MAX / 10)).bytes(),
                ),
                9 => {
                    let t = self.text(20);
                    out.extend(format!("={}\r\ntxt:{t}\r\n", t.len() + 4).bytes());
                }
                10 => {
                    let t = self.text(20);
                    out.extend(format!("!{}\r\nERR {t}\r\n", t.len() + 4).bytes());
                }
                11 | 12 => {
                    let n = self.below(5);
                    out.extend(format!("%{n}\r\n").bytes());
                    for _ in 0..n {
                        self.key(out);
                        self.value(proto, depth - 1, out);
                    }
                }
                13 => {
                    // The decoder keeps a set in a hash set: its order is
                    // not the wire's, so at most one member here.
                    let n = self.below(2);
                    out.extend(format!("~{n}\r\n").bytes());
                    for _ in 0..n {
                        self.key(out);
                    }
                }
                14 => {
                    // An attribute, then the value it annotates (not a
                    // null, which the decoder refuses to annotate).
                    out.extend(b"|1\r\n+ttl\r\n:3\r\n");
                    self.key(out);
                }
                15 => out.extend(b"$0\r\n\r\n"),
                _ => out.extend(b"*0\r\n"),
            }
        }
    }

    /// `v` with every map's entries sorted by key: the decoder keeps a map
    /// in a hash map, so two decodes of the same bytes may list them in
    /// different orders.
    fn in_key_order(v: Value) -> Value {
        match v {
            Value::Array(a) => Value::Array(a.into_iter().map(in_key_order).collect()),
            Value::Map(m) => {
                let mut m: Vec<(Value, Value)> = m
                    .into_iter()
                    .map(|(k, v)| (in_key_order(k), in_key_order(v)))
                    .collect();
                m.sort_by_cached_key(|(k, _)| format!("{k:?}"));
                Value::Map(m)
            }
            other => other,
        }
    }

    /// The walk frames replies where the decoder does: thousands of random
    /// replies of every shape (some large enough to be handed off), fed in
    /// random pieces, come out as the decoder alone reads them from the
    /// same bytes, in order, none merged or split.
    #[test]
    fn the_walk_ends_every_reply_where_the_decoder_does() {
        for proto in BOTH {
            let mut g = Gen(0x9E37_79B9_7F4A_7C15 ^ proto as u64);
            let mut stream = Vec::new();
            let mut count = 0;
            while count < 1_500 {
                g.value(proto, 3, &mut stream);
                count += 1;
            }
            // The decoder alone, reply after reply.
            let mut direct = Vec::new();
            let mut buf = BytesMut::from(&stream[..]);
            while !buf.is_empty() {
                let v = decode_first(&mut buf, proto)
                    .unwrap_or_else(|e| {
                        panic!("{proto:?}: the generator made a reply the decoder refuses: {e}")
                    })
                    .expect("complete");
                direct.push(in_key_order(v));
            }
            assert_eq!(direct.len(), count, "{proto:?}");
            for piece in [3, 4096, 100_000] {
                let (r, framed) = fed_in_pieces(&stream, proto, DEFAULT_MAX_REPLY_SIZE, piece);
                let framed = framed.unwrap_or_else(|e| panic!("{proto:?}, pieces of {piece}: {e}"));
                let framed: Vec<Value> = framed.into_iter().map(in_key_order).collect();
                assert!(
                    framed == direct,
                    "{proto:?}, pieces of {piece}: replies differ"
                );
                assert!(r.framed > 0, "{proto:?}: some replies were handed off");
            }
        }
    }
}
