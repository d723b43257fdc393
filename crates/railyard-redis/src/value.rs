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

/// Decodes one complete reply from the front of `buf`, or `Ok(None)` when
/// more bytes are needed.
pub(crate) fn decode(buf: &mut BytesMut, proto: Protocol) -> Result<Option<Value>, String> {
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
        assert_eq!(decode(&mut b, Protocol::Resp2), Ok(None));
        b.extend_from_slice(b"lo\r\n:7\r\n");
        assert_eq!(
            decode(&mut b, Protocol::Resp2),
            Ok(Some(Value::Bulk(Bytes::from_static(b"hello"))))
        );
        assert_eq!(decode(&mut b, Protocol::Resp2), Ok(Some(Value::Int(7))));
        assert!(b.is_empty());
        let mut bad = BytesMut::from(&b"?garbage\r\n"[..]);
        assert!(decode(&mut bad, Protocol::Resp2).is_err());
        let mut m = BytesMut::from(&b"%1\r\n+a\r\n:1\r\n"[..]);
        assert_eq!(
            decode(&mut m, Protocol::Resp3),
            Ok(Some(Value::Map(vec![(
                Value::Status(Bytes::from_static(b"a")),
                Value::Int(1)
            )])))
        );
    }
}
