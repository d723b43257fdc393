//! Replies ([`Value`]), commands ([`Cmd`]) and the RESP codec glue.
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
    /// An array (also RESP3 sets and pushes).
    Array(Vec<Value>),
    /// A RESP3 map, in wire order.
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
/// 2 MiB tokio worker overflows near 108 levels; 64 keeps a debug build's
/// decoding under 1.3 MB of that stack.
pub(crate) const MAX_DEPTH: usize = 64;

/// Default largest reply, in bytes (see `ClusterClientBuilder::max_reply_size`).
///
/// The decoder accepts declared lengths up to `isize::MAX` and waits for the
/// bytes, so without a limit one bad or hostile length grows a connection's
/// read buffer until memory runs out. 512 MiB matches Redis's own
/// `proto-max-bulk-len`, the largest bulk string a server stores.
pub(crate) const DEFAULT_MAX_REPLY_SIZE: usize = 512 << 20;

/// Decodes one complete reply from the front of `buf`, or `Ok(None)` when
/// more bytes are needed.
///
/// # Errors
/// What was wrong, for [`crate::RedisError::Protocol`]: bytes that are not
/// RESP, a reply nested deeper than [`MAX_DEPTH`], a declared length above
/// `max_reply`, or an incomplete reply that already holds more than
/// `max_reply` bytes. Callers close the connection the bytes came from.
pub(crate) fn decode(
    buf: &mut BytesMut,
    proto: Protocol,
    max_reply: usize,
) -> Result<Option<Value>, String> {
    // Before the recursive decoder sees the bytes: it is what would overflow.
    check_shape(buf, max_reply)?;
    let v = match proto {
        Protocol::Resp2 => match redis_protocol::resp2::decode::decode_bytes_mut(buf) {
            Ok(Some((f, _, _))) => Some(Value::from_resp2(f)),
            Ok(None) => None,
            Err(e) => return Err(e.details().to_owned()),
        },
        Protocol::Resp3 => match redis_protocol::resp3::decode::complete::decode_bytes_mut(buf) {
            Ok(Some((f, _, _))) => Some(Value::from_resp3(f)),
            Ok(None) => None,
            Err(e) => return Err(e.details().to_owned()),
        },
    };
    // Incomplete: `buf` holds only the start of this one reply, so its length
    // is the reply's size so far.
    if v.is_none() && buf.len() > max_reply {
        return Err(format!(
            "an incomplete reply already holds {} bytes, over the {max_reply}-byte reply limit (max_reply_size)",
            buf.len()
        ));
    }
    Ok(v)
}

/// Walks the type headers of the first reply in `buf` without recursion and
/// refuses it if it nests deeper than [`MAX_DEPTH`] or declares a length
/// (bytes of a string, elements of an aggregate) above `max_reply`.
///
/// It runs before the recursive decoder, so it must never stop short of
/// where that decoder could recurse: it stops only at the end of the first
/// reply, at the end of the buffer (the decoder will say "incomplete"), or at
/// a header the decoder also rejects (an unknown type byte, a length that is
/// not a number), leaving the error message to the decoder. Bytes it walks
/// past that the decoder would refuse (RESP3 types on a RESP2 connection,
/// RESP3 streamed `?` lengths, which complete decoding refuses) cost nothing,
/// so one walk serves both protocols. Like the decoder, it starts over on
/// every call, skipping string payloads by their declared length, so it adds
/// one pass over the headers to each decode.
fn check_shape(buf: &[u8], max_reply: usize) -> Result<(), String> {
    // `left[d]`: values still to come at nesting depth `d`; depth 0 is the
    // reply itself. Fixed size: the walk allocates nothing.
    let mut left = [0u64; MAX_DEPTH + 1];
    left[0] = 1;
    let mut depth = 0usize;
    let mut pos = 0usize;
    let limit = max_reply as u64;
    loop {
        while left[depth] == 0 {
            if depth == 0 {
                return Ok(());
            }
            depth -= 1;
        }
        let start = pos;
        let Some(&kind) = buf.get(start) else {
            return Ok(());
        };
        // RESP3's inline `HELLO` line starts at the `H`; every other header
        // starts after its type byte. All end at the first CRLF.
        let from = if kind == b'H' { start } else { start + 1 };
        let Some(eol) = memchr::memmem::find(&buf[from..], b"\r\n") else {
            return Ok(());
        };
        let line = &buf[from..from + eol];
        pos = from + eol + 2;
        match kind {
            // Line types: a simple string, error, integer, null, boolean,
            // double, big number, end of stream, inline HELLO.
            b'+' | b'-' | b':' | b'_' | b'#' | b',' | b'(' | b'.' | b'H' => left[depth] -= 1,
            // Length-prefixed strings: bulk, blob error, verbatim, chunk.
            b'$' | b'!' | b'=' | b';' => {
                left[depth] -= 1;
                match declared(line) {
                    Declared::Len(n) if n > limit => {
                        return Err(format!(
                            "a reply declares a {n}-byte string, over the {max_reply}-byte reply limit (max_reply_size)"
                        ));
                    }
                    // `;0` ends a chunked string and has no payload.
                    Declared::Len(0) if kind == b';' => {}
                    // Payload and its CRLF; may point past the buffer's end.
                    Declared::Len(n) => {
                        // `n <= limit`, which came from a `usize`.
                        let n = usize::try_from(n).unwrap_or(usize::MAX);
                        pos = pos.saturating_add(n).saturating_add(2);
                    }
                    Declared::Absent => {}
                    Declared::Bad => return Ok(()),
                }
            }
            // Aggregates: array, set, push; map and attribute hold 2 per entry.
            b'*' | b'~' | b'>' | b'%' | b'|' => {
                let n = match declared(line) {
                    Declared::Len(n) => n,
                    Declared::Absent => {
                        // Null (`*-1`) or streamed (`*?`): no children here.
                        left[depth] -= 1;
                        continue;
                    }
                    Declared::Bad => return Ok(()),
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
                    left[depth] -= 1;
                }
                if children > 0 {
                    if depth == MAX_DEPTH {
                        return Err(format!(
                            "a reply nests deeper than {MAX_DEPTH} levels (at byte {start})"
                        ));
                    }
                    depth += 1;
                    left[depth] = children;
                }
            }
            // Not a RESP type: the decoder refuses it with its own message.
            _ => return Ok(()),
        }
    }
}

/// A length from a RESP header line.
enum Declared {
    /// A length or count.
    Len(u64),
    /// Null (negative) or streamed (`?`): nothing follows the header.
    Absent,
    /// Not a number: the decoder refuses the header.
    Bad,
}

fn declared(line: &[u8]) -> Declared {
    if line == b"?" {
        return Declared::Absent;
    }
    // The decoder parses with `str::parse` too, so both accept the same
    // spellings (a leading `+`, leading zeros).
    match std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
    {
        Some(n) if n >= 0 => Declared::Len(n as u64),
        Some(_) => Declared::Absent,
        None => Declared::Bad,
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
        let mut b = BytesMut::from(&b"$5\r\nhel"[..]);
        assert_eq!(
            decode(&mut b, Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE),
            Ok(None)
        );
        b.extend_from_slice(b"lo\r\n:7\r\n");
        assert_eq!(
            decode(&mut b, Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE),
            Ok(Some(Value::Bulk(Bytes::from_static(b"hello"))))
        );
        assert_eq!(
            decode(&mut b, Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE),
            Ok(Some(Value::Int(7)))
        );
        assert!(b.is_empty());
        let mut bad = BytesMut::from(&b"?garbage\r\n"[..]);
        assert!(decode(&mut bad, Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE).is_err());
        let mut m = BytesMut::from(&b"%1\r\n+a\r\n:1\r\n"[..]);
        assert_eq!(
            decode(&mut m, Protocol::Resp3, DEFAULT_MAX_REPLY_SIZE),
            Ok(Some(Value::Map(vec![(
                Value::Status(Bytes::from_static(b"a")),
                Value::Int(1)
            )])))
        );
    }

    const BOTH: [Protocol; 2] = [Protocol::Resp2, Protocol::Resp3];

    fn dec(bytes: &[u8], proto: Protocol, max: usize) -> Result<Option<Value>, String> {
        decode(&mut BytesMut::from(bytes), proto, max)
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
        assert_eq!(
            decode(&mut b, Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE),
            Ok(Some(want))
        );
        assert_eq!(
            decode(&mut b, Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE),
            Ok(Some(Value::Int(5)))
        );
        // RESP3: a map holding a set and a nested map, then an attribute
        // (dropped by the decoder) in front of an array.
        let mut b = BytesMut::from(
            &b"%2\r\n+a\r\n~1\r\n:1\r\n+b\r\n%1\r\n+c\r\n*1\r\n#t\r\n|1\r\n+ttl\r\n:3\r\n*1\r\n,1.5\r\n"[..],
        );
        let s = |x: &'static [u8]| Value::Status(Bytes::from_static(x));
        let Ok(Some(Value::Map(mut m))) = decode(&mut b, Protocol::Resp3, DEFAULT_MAX_REPLY_SIZE)
        else {
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
            decode(&mut b, Protocol::Resp3, DEFAULT_MAX_REPLY_SIZE),
            Ok(Some(Value::Array(vec![Value::Double(1.5)])))
        );
        assert!(b.is_empty());
    }

    #[test]
    fn an_incomplete_reply_is_incomplete_not_an_error() {
        // A prefix as deep as allowed, its innermost value still to come.
        let mut b = BytesMut::from(&b"*1\r\n".repeat(MAX_DEPTH)[..]);
        for proto in BOTH {
            assert_eq!(decode(&mut b, proto, DEFAULT_MAX_REPLY_SIZE), Ok(None));
        }
        // Cut inside a header line, then inside a bulk payload.
        b.extend_from_slice(b"$1");
        assert_eq!(
            decode(&mut b, Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE),
            Ok(None)
        );
        b.extend_from_slice(b"0\r\nhello");
        assert_eq!(
            decode(&mut b, Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE),
            Ok(None)
        );
        b.extend_from_slice(b"world\r\n");
        assert_eq!(
            decode(&mut b, Protocol::Resp2, DEFAULT_MAX_REPLY_SIZE),
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
}
