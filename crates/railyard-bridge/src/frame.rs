//! The wire format: a 4-byte big-endian length, then that many bytes of UTF-8
//! JSON. Decoding inbound frames, encoding outbound ones straight into the
//! connection's outbound buffer, and turning bus bodies into JSON.
//!
//! The framing is hand-written (a dozen lines) rather than tokio-util's
//! `LengthDelimitedCodec` so that each way a frame can be wrong is its own
//! typed [`FrameError`], answered with its own `err` message, and so frames
//! are encoded in place (length patched after serializing) with no
//! intermediate buffer.

use std::collections::hash_map::{Entry, HashMap};

use bytes::{Buf, BufMut, BytesMut};
use railyard_bus::{Body, Headers};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Why a client's bytes could not be read as a frame. Each closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length prefix is larger than `max_frame_size` (a negative Java
    /// `int` shows up here too, as a huge unsigned length).
    #[error("frame of {len} bytes is larger than the limit of {max}")]
    TooLarge {
        /// The announced length.
        len: u64,
        /// The configured limit.
        max: usize,
    },
    /// The payload is not a JSON object.
    #[error("frame is not a JSON object: {0}")]
    Malformed(String),
    /// The connection ended inside a frame.
    #[error("connection closed {0} bytes into an incomplete frame")]
    Truncated(usize),
    /// A frame did not arrive whole within `frame_timeout`.
    #[error("frame still incomplete {received} bytes in after {timeout:?} (frame_timeout)")]
    TimedOut {
        /// Bytes of the frame received, its length prefix included.
        received: usize,
        /// The configured `frame_timeout`.
        timeout: std::time::Duration,
    },
}

impl FrameError {
    /// The `message` of the `err` frame the client gets.
    pub fn wire_message(&self) -> &'static str {
        match self {
            FrameError::TooLarge { .. } => "frame_too_large",
            FrameError::Malformed(_) => "invalid_json",
            FrameError::Truncated(_) => "truncated_frame",
            FrameError::TimedOut { .. } => "frame_timeout",
        }
    }
}

/// Most room [`next_frame`] reserves for a partial frame at a time.
const RESERVE_STEP: usize = 64 * 1024;

/// Takes the next complete frame's payload off the front of `buf`.
///
/// `Ok(None)` means more bytes are needed. Oversized lengths are refused as
/// soon as the prefix is read, before any payload is buffered.
///
/// Room for the rest of a partial frame is reserved [`RESERVE_STEP`] at a
/// time, not from the announced length: the length is the peer's word (and
/// may come before it has authenticated), so a prefix announcing
/// `max_frame_size` and no payload must not cost `max_frame_size` of
/// memory. The buffer grows with the bytes that actually arrive.
pub(crate) fn next_frame(buf: &mut BytesMut, max: usize) -> Result<Option<BytesMut>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > max {
        return Err(FrameError::TooLarge {
            len: len as u64,
            max,
        });
    }
    if buf.len() - 4 < len {
        buf.reserve((4 + len - buf.len()).min(RESERVE_STEP));
        return Ok(None);
    }
    buf.advance(4);
    Ok(Some(buf.split_to(len)))
}

/// A frame from a client, as Vert.x's bridge reads it. Unknown fields are ignored.
#[derive(Debug, Deserialize)]
pub(crate) struct Inbound {
    #[serde(rename = "type", default)]
    pub(crate) kind: Option<String>,
    #[serde(default)]
    pub(crate) address: Option<String>,
    #[serde(rename = "replyAddress", default)]
    pub(crate) reply_address: Option<String>,
    #[serde(default)]
    pub(crate) headers: Option<Map<String, Value>>,
    #[serde(default)]
    pub(crate) body: Option<Value>,
    #[serde(rename = "failureCode", default)]
    pub(crate) failure_code: Option<i64>,
    #[serde(default)]
    pub(crate) message: Option<String>,
}

pub(crate) fn parse(payload: &[u8]) -> Result<Inbound, FrameError> {
    serde_json::from_slice(payload).map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Reserves the length prefix, lets `f` serialize the JSON after it, then
/// patches the length in. Returns the frame's size on the wire.
fn framed(
    out: &mut BytesMut,
    f: impl FnOnce(&mut serde_json::Serializer<bytes::buf::Writer<&mut BytesMut>>),
) -> usize {
    let start = out.len();
    out.put_u32(0);
    {
        let mut ser = serde_json::Serializer::new(out.writer());
        f(&mut ser);
    }
    let len = out.len() - start - 4;
    // A frame larger than 4 GiB cannot be produced: bodies come from frames
    // or bus values, and the outbound queue is bounded far below that.
    out[start..start + 4].copy_from_slice(&(len as u32).to_be_bytes());
    out.len() - start
}

/// Headers as a JSON object of strings; a repeated name keeps its last value
/// at the position of its first (what Vert.x's `JsonObject.put` does).
struct HeadersJson<'a>(&'a Headers);

/// Up to this many headers, repeated names are found by scanning the names
/// already collected: no allocation besides the pairs, and faster than
/// hashing for the usual handful. Past it they are found through a hash
/// index, so the cost stays linear in the header count.
const SCAN_HEADERS: usize = 8;

/// Each distinct name once, in the order of its first occurrence, with its
/// last value.
fn last_value_per_name(headers: &Headers) -> Vec<(&str, &str)> {
    let mut pairs: Vec<(&str, &str)> = Vec::with_capacity(headers.len());
    if headers.len() <= SCAN_HEADERS {
        for (n, v) in headers.iter() {
            match pairs.iter_mut().find(|(m, _)| *m == n) {
                Some(slot) => slot.1 = v,
                None => pairs.push((n, v)),
            }
        }
        return pairs;
    }
    // Names can come from clients: std's randomly keyed hasher keeps them
    // from choosing colliding names.
    let mut index: HashMap<&str, usize> = HashMap::with_capacity(headers.len());
    for (n, v) in headers.iter() {
        match index.entry(n) {
            Entry::Occupied(at) => pairs[*at.get()].1 = v,
            Entry::Vacant(slot) => {
                slot.insert(pairs.len());
                pairs.push((n, v));
            }
        }
    }
    pairs
}

impl Serialize for HeadersJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let pairs = last_value_per_name(self.0);
        let mut map = s.serialize_map(Some(pairs.len()))?;
        for (n, v) in pairs {
            map.serialize_entry(n, v)?;
        }
        map.end()
    }
}

/// A bus body as JSON, without copying it: see [`body_json`].
pub(crate) enum BodyJson<'a> {
    Value(&'a Value),
    Str(&'a str),
    Bool(bool),
    I64(i64),
    U64(u64),
    F64(f64),
    /// Decoded from a codec's JSON output.
    Owned(Value),
}

impl Serialize for BodyJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            BodyJson::Value(v) => v.serialize(s),
            BodyJson::Str(v) => s.serialize_str(v),
            BodyJson::Bool(v) => s.serialize_bool(*v),
            BodyJson::I64(v) => s.serialize_i64(*v),
            BodyJson::U64(v) => s.serialize_u64(*v),
            BodyJson::F64(v) => s.serialize_f64(*v),
            BodyJson::Owned(v) => v.serialize(s),
        }
    }
}

/// Why a bus body cannot be sent to a client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a `{0}` body cannot be sent over the bridge: send a serde_json::Value, a String, a number or a bool, or register a codec that encodes it as JSON")]
pub struct UnsupportedBody(pub &'static str);

/// The JSON form of a bus body. `Ok(None)` is the empty body (the frame then
/// has no `body` field, like a Vert.x `null` body).
///
/// Bodies from bridge clients travel on the bus as [`serde_json::Value`]
/// (shared by reference, never re-serialized on a local hop); Rust consumers
/// may also answer with a `String`, `&'static str`, `bool` or a number. Any
/// other type is encoded with its default codec from `codecs` and must come
/// out as JSON text.
pub(crate) fn body_json<'a>(
    body: &'a Body,
    codecs: impl FnOnce() -> railyard_bus::CodecRegistry,
) -> Result<Option<BodyJson<'a>>, UnsupportedBody> {
    if body.is_empty() {
        return Ok(None);
    }
    if let Some(v) = body.downcast_ref::<Value>() {
        return Ok((!v.is_null()).then_some(BodyJson::Value(v)));
    }
    if let Some(v) = body.downcast_ref::<String>() {
        return Ok(Some(BodyJson::Str(v)));
    }
    if let Some(v) = body.downcast_ref::<&'static str>() {
        return Ok(Some(BodyJson::Str(v)));
    }
    if let Some(v) = body.downcast_ref::<bool>() {
        return Ok(Some(BodyJson::Bool(*v)));
    }
    macro_rules! int {
        ($($t:ty => $variant:ident),*) => {$(
            if let Some(v) = body.downcast_ref::<$t>() {
                return Ok(Some(BodyJson::$variant((*v).into())));
            }
        )*};
    }
    int!(i64 => I64, i32 => I64, u64 => U64, u32 => U64, f64 => F64, f32 => F64);
    let registry = codecs();
    let (_, bytes) = registry
        .encode(body, None)
        .map_err(|_| UnsupportedBody(body.type_name()))?;
    let value: Value =
        serde_json::from_slice(&bytes).map_err(|_| UnsupportedBody(body.type_name()))?;
    Ok(Some(BodyJson::Owned(value)))
}

#[derive(Serialize)]
struct MessageFrame<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    address: &'a str,
    #[serde(rename = "replyAddress", skip_serializing_if = "Option::is_none")]
    reply_address: Option<&'a str>,
    headers: HeadersJson<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<BodyJson<'a>>,
    send: bool,
}

/// Appends a `message` frame (field order as Vert.x writes it).
pub(crate) fn put_message(
    out: &mut BytesMut,
    address: &str,
    reply_address: Option<&str>,
    headers: &Headers,
    body: Option<BodyJson<'_>>,
    send: bool,
) -> usize {
    let frame = MessageFrame {
        kind: "message",
        address,
        reply_address,
        headers: HeadersJson(headers),
        body,
        send,
    };
    // Serializing into memory cannot fail: every value is valid JSON.
    framed(out, |ser| frame.serialize(ser).expect("in-memory JSON"))
}

#[derive(Serialize)]
struct FailureFrame<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    address: Option<&'a str>,
    #[serde(rename = "sourceAddress")]
    source_address: &'a str,
    #[serde(rename = "failureCode")]
    failure_code: i64,
    #[serde(rename = "failureType")]
    failure_type: &'a str,
    message: &'a str,
}

/// Appends an `err` frame for a failed request (`address` is the client's
/// reply address, `source_address` where the request went) or, without
/// `address`, for a refused `send` or `publish`.
pub(crate) fn put_failure(
    out: &mut BytesMut,
    address: Option<&str>,
    source_address: &str,
    failure_code: i64,
    failure_type: &str,
    message: &str,
) -> usize {
    let frame = FailureFrame {
        kind: "err",
        address,
        source_address,
        failure_code,
        failure_type,
        message,
    };
    framed(out, |ser| frame.serialize(ser).expect("in-memory JSON"))
}

#[derive(Serialize)]
struct ErrFrame<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    message: &'a str,
}

/// Appends `{"type":"err","message":...}`.
pub(crate) fn put_err(out: &mut BytesMut, message: &str) -> usize {
    framed(out, |ser| {
        ErrFrame {
            kind: "err",
            message,
        }
        .serialize(ser)
        .expect("in-memory JSON")
    })
}

/// Appends `{"type":"pong"}`.
pub(crate) fn put_pong(out: &mut BytesMut) -> usize {
    const PONG: &[u8] = br#"{"type":"pong"}"#;
    out.put_u32(PONG.len() as u32);
    out.put_slice(PONG);
    PONG.len() + 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_and_limits() {
        let mut b = BytesMut::new();
        b.put_u32(2);
        b.put_slice(b"{}");
        b.put_u32(5);
        b.put_slice(b"ab");
        assert_eq!(&next_frame(&mut b, 10).unwrap().unwrap()[..], b"{}");
        assert!(next_frame(&mut b, 10).unwrap().is_none());
        let mut big = BytesMut::new();
        big.put_u32(u32::MAX);
        assert!(matches!(
            next_frame(&mut big, 10),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn message_frame_matches_vertx_layout() {
        let mut out = BytesMut::new();
        let mut h = Headers::new();
        h.add("k", "1").add("k", "2").add("z", "x");
        let v = serde_json::json!({"a": 1});
        let n = put_message(
            &mut out,
            "addr",
            Some("r1"),
            &h,
            Some(BodyJson::Value(&v)),
            true,
        );
        assert_eq!(n, out.len());
        assert_eq!(
            std::str::from_utf8(&out[4..]).unwrap(),
            r#"{"type":"message","address":"addr","replyAddress":"r1","headers":{"k":"2","z":"x"},"body":{"a":1},"send":true}"#
        );
        let mut out = BytesMut::new();
        put_pong(&mut out);
        put_err(&mut out, "access_denied");
        assert_eq!(&out[4..19], br#"{"type":"pong"}"#);
        assert_eq!(&out[23..], br#"{"type":"err","message":"access_denied"}"#);
    }

    #[test]
    fn decoder_reserves_as_bytes_arrive_not_the_announced_length() {
        const MIB: usize = 1 << 20;
        let mut b = BytesMut::new();
        b.put_u32(MIB as u32);
        assert!(next_frame(&mut b, MIB).unwrap().is_none());
        assert!(
            b.capacity() <= 4 + RESERVE_STEP,
            "a bare prefix announcing 1 MiB reserved {} bytes",
            b.capacity()
        );
        // Fed as a socket would feed it: at most the spare room per read.
        let payload: Vec<u8> = std::iter::once(b'"')
            .chain(std::iter::repeat_n(b'x', MIB - 2))
            .chain(std::iter::once(b'"'))
            .collect();
        let mut sent = 0;
        let frame = loop {
            if let Some(f) = next_frame(&mut b, MIB).unwrap() {
                break f;
            }
            let spare = b.capacity() - b.len();
            assert!(spare > 0, "more bytes are needed, so room is reserved");
            let n = spare.min(payload.len() - sent);
            b.put_slice(&payload[sent..sent + n]);
            sent += n;
            // Vec-style doubling aside, room follows what arrived.
            assert!(
                b.capacity() <= 2 * b.len() + RESERVE_STEP,
                "{} bytes reserved for {} received",
                b.capacity(),
                b.len()
            );
        };
        assert_eq!(&frame[..], &payload[..]);
        assert!(b.is_empty());
    }

    /// The writer as it was before the hash index, kept as the reference
    /// the output must not drift from.
    fn quadratic_reference(h: &Headers) -> String {
        let mut pairs: Vec<(&str, &str)> = Vec::new();
        for (n, v) in h.iter() {
            match pairs.iter_mut().find(|(m, _)| *m == n) {
                Some(slot) => slot.1 = v,
                None => pairs.push((n, v)),
            }
        }
        let mut out = String::from("{");
        for (i, (n, v)) in pairs.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&serde_json::to_string(n).unwrap());
            out.push(':');
            out.push_str(&serde_json::to_string(v).unwrap());
        }
        out.push('}');
        out
    }

    fn headers_json(h: &Headers) -> String {
        serde_json::to_string(&HeadersJson(h)).unwrap()
    }

    #[test]
    fn header_writer_output_is_unchanged_for_many_and_repeated_names() {
        // Above the scan threshold, with repeats: first position, last value;
        // names are compared exactly (case matters on the wire, as before).
        let mut h = Headers::new();
        for i in 0..SCAN_HEADERS + 2 {
            h.add(format!("h{i}"), format!("v{i}"));
        }
        h.add("h3", "again").add("H3", "upper").add("h0", "last");
        assert_eq!(
            headers_json(&h),
            r#"{"h0":"last","h1":"v1","h2":"v2","h3":"again","h4":"v4","h5":"v5","h6":"v6","h7":"v7","h8":"v8","h9":"v9","H3":"upper"}"#
        );
        assert_eq!(headers_json(&h), quadratic_reference(&h));
        // Up to the threshold (the scan, which the reference copies, so
        // these are checked against literals): empty, one, and exactly
        // SCAN_HEADERS entries with repeats and a name differing in case.
        assert_eq!(headers_json(&Headers::new()), "{}");
        let mut one = Headers::new();
        one.add("a", "1");
        assert_eq!(headers_json(&one), r#"{"a":"1"}"#);
        let mut eight = Headers::new();
        eight
            .add("a", "1")
            .add("b", "2")
            .add("a", "3")
            .add("A", "4")
            .add("c", "5")
            .add("b", "6")
            .add("d", "7")
            .add("e", "8");
        assert_eq!(eight.len(), SCAN_HEADERS);
        assert_eq!(
            headers_json(&eight),
            r#"{"a":"3","b":"6","A":"4","c":"5","d":"7","e":"8"}"#
        );
        // Above it the hash index must agree with the scan: sizes around
        // the threshold once the repeats are added, and many distinct names.
        for n in [SCAN_HEADERS - 1, SCAN_HEADERS, SCAN_HEADERS + 1, 5000] {
            let mut h = Headers::new();
            for i in 0..n {
                h.add(format!("n{i}"), "a");
                if i % 3 == 0 {
                    h.add(format!("n{}", i / 2), format!("b{i}"));
                }
            }
            assert!(h.len() > SCAN_HEADERS, "{n} headers take the hash path");
            assert_eq!(headers_json(&h), quadratic_reference(&h), "{n} headers");
        }
    }

    #[test]
    fn parse_reads_vertx_fields() {
        let f = parse(br#"{"type":"send","address":"a","replyAddress":"r","headers":{"timeout":5},"body":[1],"extra":1}"#).unwrap();
        assert_eq!(f.kind.as_deref(), Some("send"));
        assert_eq!(f.reply_address.as_deref(), Some("r"));
        assert!(parse(b"[1]").is_err());
        assert!(parse(b"{").is_err());
    }
}
