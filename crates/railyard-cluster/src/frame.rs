//! The node-to-node wire format: length-prefixed binary frames.
//!
//! ```text
//! frame   = len:u32be kind:u8 payload          (len counts kind + payload)
//! str     = len:u16be utf8
//! blob    = len:u32be bytes
//! headers = count:u16be (name:str value:str)*
//!
//! HELLO  1  version:u16 node:str cluster:str
//! MSG    2  mode:u8 (0 send, 1 publish, 2 request) id:u64 timeout_ms:u32
//!           address:str headers codec:str body:blob
//! REPLY  3  id:u64 headers codec:str body:blob
//! FAIL   4  id:u64 kind:u8 (0 TIMEOUT, 1 NO_HANDLERS, 2 RECIPIENT_FAILURE, 3 ERROR)
//!           code:i32 message:str
//! PING   5  nonce:u64
//! PONG   6  nonce:u64
//! ```
//!
//! Anything else (an unknown kind, a field running past the frame, invalid
//! UTF-8, a frame over the size limit, bytes left over) is a [`FrameError`],
//! and the connection that sent it is closed. Nothing else is affected.
//!
//! A decoded frame borrows its strings (address, codec name, reasons) from
//! the read buffer ([`Frame::decode_with`]): a link hands them to the bus as
//! `&str` and allocates none of them per message. Headers are built straight
//! into the bus's [`Headers`], which keeps them.

use std::borrow::Cow;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use railyard_bus::Headers;
use smallvec::SmallVec;

/// Protocol version sent in HELLO.
pub const VERSION: u16 = 1;

/// Largest frame accepted by default (16 MiB).
pub const DEFAULT_MAX_FRAME: usize = 16 << 20;

/// Most room [`Frame::decode`] asks a buffer for at once while a frame is
/// incomplete. The buffer grows with the bytes that actually arrive, not
/// with the length a peer announces: a 4-byte header alone no longer makes
/// the node allocate up to `max` bytes.
const MAX_RESERVE: usize = 64 * 1024;

const HELLO: u8 = 1;
const MSG: u8 = 2;
const REPLY: u8 = 3;
const FAIL: u8 = 4;
const PING: u8 = 5;
const PONG: u8 = 6;

/// How a message is delivered on the receiving node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One consumer.
    Send,
    /// Every consumer.
    Publish,
    /// One consumer, answer expected under `id`.
    Request,
}

/// Failure classes carried by FAIL, as in the bus's `FailureKind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailKind {
    /// TIMEOUT
    Timeout,
    /// NO_HANDLERS
    NoHandlers,
    /// RECIPIENT_FAILURE
    RecipientFailure,
    /// ERROR
    Error,
}

/// One frame. Its strings are borrowed from the bytes it was decoded from
/// ([`Frame::decode_with`]) or owned ([`Frame::decode`], or a frame built to
/// be sent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame<'a> {
    /// First frame on a connection, from the dialing node.
    Hello {
        /// Protocol version.
        version: u16,
        /// The sender's node id.
        node: Cow<'a, str>,
        /// Cluster name; nodes of different clusters refuse each other.
        cluster: Cow<'a, str>,
    },
    /// A message for consumers on the receiving node.
    Msg {
        /// Send, publish or request.
        mode: Mode,
        /// Request id (0 unless a request).
        id: u64,
        /// The requester's timeout in milliseconds (0 unless a request).
        timeout_ms: u32,
        /// Destination address.
        address: Cow<'a, str>,
        /// Message headers.
        headers: Headers,
        /// Codec name (`""` for an empty body).
        codec: Cow<'a, str>,
        /// Encoded body.
        body: Bytes,
    },
    /// The answer to request `id`.
    Reply {
        /// Request id.
        id: u64,
        /// Reply headers.
        headers: Headers,
        /// Codec name.
        codec: Cow<'a, str>,
        /// Encoded body.
        body: Bytes,
    },
    /// Request `id` failed.
    Fail {
        /// Request id.
        id: u64,
        /// Failure class.
        kind: FailKind,
        /// The recipient's code (RECIPIENT_FAILURE), else 0.
        code: i32,
        /// Human-readable reason.
        message: Cow<'a, str>,
    },
    /// Liveness probe.
    Ping(u64),
    /// Answer to a probe.
    Pong(u64),
}

/// Why bytes could not be read as a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length prefix exceeds the limit.
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A zero-length frame (no kind byte).
    #[error("empty frame")]
    Empty,
    /// Unknown kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A field runs past the end of the frame.
    #[error("truncated {0} frame")]
    Truncated(&'static str),
    /// Bytes left after the last field.
    #[error("{0} trailing bytes after a frame")]
    Trailing(usize),
    /// A string field is not UTF-8.
    #[error("a string field is not valid UTF-8")]
    Utf8,
    /// An out-of-range enum value.
    #[error("invalid {0}")]
    Invalid(&'static str),
}

impl Frame<'_> {
    /// Appends this frame, length prefix included, to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        let start = begin_frame(out);
        match self {
            Frame::Hello {
                version,
                node,
                cluster,
            } => {
                out.put_u8(HELLO);
                out.put_u16(*version);
                put_str(out, node);
                put_str(out, cluster);
            }
            Frame::Msg {
                mode,
                id,
                timeout_ms,
                address,
                headers,
                codec,
                body,
            } => {
                put_msg_head(out, *mode, *id, *timeout_ms, address, headers.iter());
                put_str(out, codec);
                put_blob(out, body);
            }
            Frame::Reply {
                id,
                headers,
                codec,
                body,
            } => {
                put_reply_head(out, *id, headers.iter());
                put_str(out, codec);
                put_blob(out, body);
            }
            Frame::Fail {
                id,
                kind,
                code,
                message,
            } => {
                out.put_u8(FAIL);
                out.put_u64(*id);
                out.put_u8(match kind {
                    FailKind::Timeout => 0,
                    FailKind::NoHandlers => 1,
                    FailKind::RecipientFailure => 2,
                    FailKind::Error => 3,
                });
                out.put_i32(*code);
                put_str(out, message);
            }
            Frame::Ping(n) => {
                out.put_u8(PING);
                out.put_u64(*n);
            }
            Frame::Pong(n) => {
                out.put_u8(PONG);
                out.put_u64(*n);
            }
        }
        end_frame(out, start);
    }

    /// This frame with every string it borrows copied, to keep past the
    /// bytes it was decoded from.
    pub fn into_owned(self) -> Frame<'static> {
        let own = |s: Cow<'_, str>| Cow::Owned(s.into_owned());
        match self {
            Frame::Hello {
                version,
                node,
                cluster,
            } => Frame::Hello {
                version,
                node: own(node),
                cluster: own(cluster),
            },
            Frame::Msg {
                mode,
                id,
                timeout_ms,
                address,
                headers,
                codec,
                body,
            } => Frame::Msg {
                mode,
                id,
                timeout_ms,
                address: own(address),
                headers,
                codec: own(codec),
                body,
            },
            Frame::Reply {
                id,
                headers,
                codec,
                body,
            } => Frame::Reply {
                id,
                headers,
                codec: own(codec),
                body,
            },
            Frame::Fail {
                id,
                kind,
                code,
                message,
            } => Frame::Fail {
                id,
                kind,
                code,
                message: own(message),
            },
            Frame::Ping(n) => Frame::Ping(n),
            Frame::Pong(n) => Frame::Pong(n),
        }
    }
}

impl Frame<'static> {
    /// Takes one frame off the front of `buf` if it is complete, its strings
    /// copied (see [`Frame::decode_with`] to borrow them instead).
    ///
    /// # Errors
    /// [`FrameError`] when the bytes are not a valid frame.
    pub fn decode(buf: &mut BytesMut, max: usize) -> Result<Option<Frame<'static>>, FrameError> {
        Frame::decode_with(buf, max, |f| f.into_owned())
    }
}

impl<'a> Frame<'a> {
    /// Takes one frame off the front of `buf` if it is complete, and hands it
    /// to `f` with its strings borrowed from `buf`; returns what `f` returns.
    /// A complete frame's bytes are consumed whether or not they parse; a
    /// length over `max` or of zero is refused before anything is consumed
    /// (the connection is closed either way).
    ///
    /// # Errors
    /// [`FrameError`] when the bytes are not a valid frame (`f` is not
    /// called).
    pub fn decode_with<R>(
        buf: &mut BytesMut,
        max: usize,
        f: impl FnOnce(Frame<'_>) -> R,
    ) -> Result<Option<R>, FrameError> {
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len > max {
            return Err(FrameError::TooLarge { len, max });
        }
        if len == 0 {
            return Err(FrameError::Empty);
        }
        if buf.len() < 4 + len {
            buf.reserve((4 + len - buf.len()).min(MAX_RESERVE));
            return Ok(None);
        }
        if len <= SMALL_FRAME {
            // Parsed in place, the body copied: the read buffer is never
            // shared, so no reference count is taken or dropped per frame.
            let done = Frame::parse_whole(&buf[4..4 + len], Bytes::copy_from_slice).map(f);
            // Consumed either way, as a large frame is.
            buf.advance(4 + len);
            return done.map(Some);
        }
        buf.advance(4);
        let whole = buf.split_to(len).freeze();
        Frame::parse_whole(&whole, |body| whole.slice_ref(body))
            .map(f)
            .map(Some)
    }

    /// Parses a frame that must use up all of `b`; `body` turns the body's
    /// bytes into the frame's `Bytes` (a copy, or a share of the frame).
    fn parse_whole(
        mut b: &'a [u8],
        body: impl Fn(&'a [u8]) -> Bytes,
    ) -> Result<Frame<'a>, FrameError> {
        let frame = Frame::parse(&mut b, body)?;
        match b.remaining() {
            0 => Ok(frame),
            n => Err(FrameError::Trailing(n)),
        }
    }

    fn parse(b: &mut &'a [u8], body: impl Fn(&'a [u8]) -> Bytes) -> Result<Frame<'a>, FrameError> {
        let kind = b.get_u8();
        Ok(match kind {
            HELLO => Frame::Hello {
                version: get_u16(b, "HELLO")?,
                node: get_str(b, "HELLO")?,
                cluster: get_str(b, "HELLO")?,
            },
            MSG => {
                let mode = match get_u8(b, "MSG")? {
                    0 => Mode::Send,
                    1 => Mode::Publish,
                    2 => Mode::Request,
                    _ => return Err(FrameError::Invalid("message mode")),
                };
                Frame::Msg {
                    mode,
                    id: get_u64(b, "MSG")?,
                    timeout_ms: get_u32(b, "MSG")?,
                    address: get_str(b, "MSG")?,
                    headers: get_headers(b, "MSG")?,
                    codec: get_str(b, "MSG")?,
                    body: body(get_blob(b, "MSG")?),
                }
            }
            REPLY => Frame::Reply {
                id: get_u64(b, "REPLY")?,
                headers: get_headers(b, "REPLY")?,
                codec: get_str(b, "REPLY")?,
                body: body(get_blob(b, "REPLY")?),
            },
            FAIL => {
                let id = get_u64(b, "FAIL")?;
                let kind = match get_u8(b, "FAIL")? {
                    0 => FailKind::Timeout,
                    1 => FailKind::NoHandlers,
                    2 => FailKind::RecipientFailure,
                    3 => FailKind::Error,
                    _ => return Err(FrameError::Invalid("failure kind")),
                };
                Frame::Fail {
                    id,
                    kind,
                    code: get_u32(b, "FAIL")? as i32,
                    message: get_str(b, "FAIL")?,
                }
            }
            PING => Frame::Ping(get_u64(b, "PING")?),
            PONG => Frame::Pong(get_u64(b, "PONG")?),
            other => return Err(FrameError::UnknownKind(other)),
        })
    }
}

/// Why a message's address or headers cannot be carried by a frame (a
/// string over 65,535 bytes, more than 65,535 headers), or `None`. The link
/// checks this before encoding a message or a reply and fails it instead:
/// [`put_str`] would otherwise cut the string and deliver another address
/// or header value than the one sent.
pub(crate) fn unfit<'a>(
    address: &str,
    mut headers: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
) -> Option<String> {
    const MAX: usize = u16::MAX as usize;
    if address.len() > MAX {
        return Some(format!(
            "an address of {} bytes cannot cross nodes (at most {MAX})",
            address.len()
        ));
    }
    if headers.len() > MAX {
        return Some(format!(
            "{} headers cannot cross nodes (at most {MAX})",
            headers.len()
        ));
    }
    headers
        .find(|(k, v)| k.len() > MAX || v.len() > MAX)
        .map(|(k, v)| {
            format!(
                "header {:?} of {} bytes (name and value) cannot cross nodes (each at most {MAX} bytes)",
                k.chars().take(64).collect::<String>(),
                k.len() + v.len()
            )
        })
}

fn put_str(out: &mut BytesMut, s: &str) {
    // Strings are addresses, header names/values, codec names and reasons.
    // Addresses and headers are checked by `unfit` before a message is
    // encoded; what is left to cut here is a very long failure message or
    // codec name: cut rather than corrupt the frame, and at a character
    // boundary, so the peer still reads valid UTF-8 (cut mid-character, it
    // closed the link).
    let mut end = s.len().min(u16::MAX as usize);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.put_u16(end as u16);
    out.put_slice(&s.as_bytes()[..end]);
}

fn put_blob(out: &mut BytesMut, b: &[u8]) {
    out.put_u32(b.len() as u32);
    out.put_slice(b);
}

fn put_headers<'a>(out: &mut BytesMut, h: impl ExactSizeIterator<Item = (&'a str, &'a str)>) {
    let n = h.len().min(u16::MAX as usize);
    out.put_u16(n as u16);
    for (k, v) in h.take(n) {
        put_str(out, k);
        put_str(out, v);
    }
}

/// Appends a length prefix's place (a frame's or a body's); [`end_frame`]
/// fills it in.
fn begin_frame(out: &mut BytesMut) -> usize {
    let start = out.len();
    out.put_u32(0);
    start
}

fn end_frame(out: &mut BytesMut, start: usize) {
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
}

/// Appends a [`Frame::Msg`]'s length prefix and its fields up to the codec
/// name, from borrowed parts: what a link writes for every message, without
/// an owned `Frame` (an address, codec name and header copy per message)
/// first. The codec name and body follow ([`begin_body`], the body's bytes,
/// [`end_body`]), so a codec can write the body straight into the frame.
/// Returns where the frame starts.
pub(crate) fn begin_msg<'a>(
    out: &mut BytesMut,
    mode: Mode,
    id: u64,
    timeout_ms: u32,
    address: &str,
    headers: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
) -> usize {
    let start = begin_frame(out);
    put_msg_head(out, mode, id, timeout_ms, address, headers);
    start
}

/// As [`begin_msg`], for a [`Frame::Reply`].
pub(crate) fn begin_reply<'a>(
    out: &mut BytesMut,
    id: u64,
    headers: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
) -> usize {
    let start = begin_frame(out);
    put_reply_head(out, id, headers);
    start
}

/// Appends the codec name and the place of the body's length; returns where
/// the body starts.
pub(crate) fn begin_body(out: &mut BytesMut, codec: &str) -> usize {
    put_str(out, codec);
    begin_frame(out) + 4
}

/// Fills in the length of the body that starts at `body_start` (everything
/// appended since) and of the frame that starts at `frame_start`.
pub(crate) fn end_body(out: &mut BytesMut, frame_start: usize, body_start: usize) {
    end_frame(out, body_start - 4);
    end_frame(out, frame_start);
}

/// A `Msg` frame's kind and fields before the codec name.
fn put_msg_head<'a>(
    out: &mut BytesMut,
    mode: Mode,
    id: u64,
    timeout_ms: u32,
    address: &str,
    headers: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
) {
    out.put_u8(MSG);
    out.put_u8(match mode {
        Mode::Send => 0,
        Mode::Publish => 1,
        Mode::Request => 2,
    });
    out.put_u64(id);
    out.put_u32(timeout_ms);
    put_str(out, address);
    put_headers(out, headers);
}

/// A `Reply` frame's kind and fields before the codec name.
fn put_reply_head<'a>(
    out: &mut BytesMut,
    id: u64,
    headers: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
) {
    out.put_u8(REPLY);
    out.put_u64(id);
    put_headers(out, headers);
}

/// Frames up to this many bytes are parsed in place and their bodies
/// copied (see [`Frame::decode_with`]); larger ones share the read buffer, so a
/// large body is not copied. The in-place path was measured with `bench
/// echo --cluster etcd --nodes 2 --method send-send`, whose frames are about
/// 100 bytes; the bound itself (a copy of up to 4 KiB against two reference
/// counts) was chosen, not swept.
const SMALL_FRAME: usize = 4096;

fn need(b: &[u8], n: usize, what: &'static str) -> Result<(), FrameError> {
    if b.remaining() < n {
        Err(FrameError::Truncated(what))
    } else {
        Ok(())
    }
}

fn get_u8(b: &mut &[u8], what: &'static str) -> Result<u8, FrameError> {
    need(b, 1, what)?;
    Ok(b.get_u8())
}

fn get_u16(b: &mut &[u8], what: &'static str) -> Result<u16, FrameError> {
    need(b, 2, what)?;
    Ok(b.get_u16())
}

fn get_u32(b: &mut &[u8], what: &'static str) -> Result<u32, FrameError> {
    need(b, 4, what)?;
    Ok(b.get_u32())
}

fn get_u64(b: &mut &[u8], what: &'static str) -> Result<u64, FrameError> {
    need(b, 8, what)?;
    Ok(b.get_u64())
}

/// Borrows the string from the frame. Before, strings were split out of a
/// shared buffer (a reference count taken and dropped per string), then
/// copied out (cheaper than the split); borrowing allocates nothing.
fn get_str<'a>(b: &mut &'a [u8], what: &'static str) -> Result<Cow<'a, str>, FrameError> {
    get_str_ref(b, what).map(Cow::Borrowed)
}

/// A string, borrowed from the frame.
fn get_str_ref<'a>(b: &mut &'a [u8], what: &'static str) -> Result<&'a str, FrameError> {
    let n = get_u16(b, what)? as usize;
    railyard_bus::str_from_utf8(take(b, n, what)?).map_err(|_| FrameError::Utf8)
}

/// The body's bytes, still in the frame.
fn get_blob<'a>(b: &mut &'a [u8], what: &'static str) -> Result<&'a [u8], FrameError> {
    let n = get_u32(b, what)? as usize;
    take(b, n, what)
}

/// The next `n` bytes of the frame, borrowed.
fn take<'a>(b: &mut &'a [u8], n: usize, what: &'static str) -> Result<&'a [u8], FrameError> {
    need(b, n, what)?;
    let (taken, rest) = b.split_at(n);
    *b = rest;
    Ok(taken)
}

/// Headers, built straight into the bus's [`Headers`] (which owns them).
fn get_headers(b: &mut &[u8], what: &'static str) -> Result<Headers, FrameError> {
    let n = get_u16(b, what)? as usize;
    // Each header needs at least 4 bytes: refuse counts the frame cannot hold
    // before allocating for them.
    need(b, n * 4, what)?;
    if n == 0 {
        return Ok(Headers::new());
    }
    // Borrowed from the frame first (on the stack for a few), then copied
    // into the headers' one block.
    let mut h: SmallVec<[(&str, &str); 4]> = SmallVec::with_capacity(n);
    for _ in 0..n {
        let name = get_str_ref(b, what)?;
        h.push((name, get_str_ref(b, what)?));
    }
    Ok(Headers::from(&h[..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(f: Frame) {
        let mut buf = BytesMut::new();
        f.encode(&mut buf);
        f.encode(&mut buf);
        let a = Frame::decode(&mut buf, DEFAULT_MAX_FRAME).unwrap().unwrap();
        let b = Frame::decode(&mut buf, DEFAULT_MAX_FRAME).unwrap().unwrap();
        assert_eq!(a, f);
        assert_eq!(b, f);
        assert!(buf.is_empty());
    }

    #[test]
    fn an_overlong_string_is_cut_at_a_character_boundary() {
        // 40,000 two-byte characters: 80,000 bytes, cut to fit 65,535. A cut
        // at byte 65,535 splits a character and the peer's decode failed
        // (closing the link and every request pending on it).
        let message = "é".repeat(40_000);
        let mut buf = BytesMut::new();
        Frame::Fail {
            id: 7,
            kind: FailKind::RecipientFailure,
            code: 3,
            message: message.as_str().into(),
        }
        .encode(&mut buf);
        let Some(Frame::Fail { message: got, .. }) =
            Frame::decode(&mut buf, DEFAULT_MAX_FRAME).unwrap()
        else {
            panic!("a FAIL frame");
        };
        assert_eq!(got.len(), 65_534, "the largest whole-character prefix");
        assert!(message.starts_with(&*got));
    }

    /// A message or reply written in parts (head, codec and body's place,
    /// the body appended, lengths filled in) is byte for byte the frame
    /// `encode` writes, after whatever the buffer held.
    #[test]
    fn frames_written_in_parts_equal_encoded_frames() {
        let headers: Headers = [("replyTo", "x"), ("é", "")].into_iter().collect();
        for body in [&b""[..], b":)", &[7u8; 300][..]] {
            let whole = Frame::Msg {
                mode: Mode::Send,
                id: 9,
                timeout_ms: 0,
                address: "echo".into(),
                headers: headers.clone(),
                codec: "string".into(),
                body: Bytes::copy_from_slice(body),
            };
            let mut want = BytesMut::from(&b"before"[..]);
            whole.encode(&mut want);
            let mut got = BytesMut::from(&b"before"[..]);
            let start = begin_msg(&mut got, Mode::Send, 9, 0, "echo", headers.iter());
            assert_eq!(start, 6);
            let body_start = begin_body(&mut got, "string");
            got.extend_from_slice(body);
            end_body(&mut got, start, body_start);
            assert_eq!(got, want);

            let whole = Frame::Reply {
                id: 3,
                headers: headers.clone(),
                codec: "".into(),
                body: Bytes::copy_from_slice(body),
            };
            let mut want = BytesMut::new();
            whole.encode(&mut want);
            let mut got = BytesMut::new();
            let start = begin_reply(&mut got, 3, headers.iter());
            let body_start = begin_body(&mut got, "");
            got.extend_from_slice(body);
            end_body(&mut got, start, body_start);
            assert_eq!(got, want);
        }
    }

    #[test]
    fn every_frame_roundtrips() {
        roundtrip(Frame::Hello {
            version: VERSION,
            node: "n1".into(),
            cluster: "c".into(),
        });
        roundtrip(Frame::Msg {
            mode: Mode::Request,
            id: 7,
            timeout_ms: 30_000,
            address: "echo".into(),
            headers: [("replyTo", "x"), ("a", "")].into_iter().collect(),
            codec: "string".into(),
            body: Bytes::from_static(b":)"),
        });
        roundtrip(Frame::Reply {
            id: u64::MAX,
            headers: Headers::new(),
            codec: "".into(),
            body: Bytes::new(),
        });
        roundtrip(Frame::Fail {
            id: 1,
            kind: FailKind::RecipientFailure,
            code: -42,
            message: "nope".into(),
        });
        roundtrip(Frame::Ping(3));
        roundtrip(Frame::Pong(3));
    }

    #[test]
    fn partial_frames_wait_for_more() {
        let mut full = BytesMut::new();
        Frame::Ping(9).encode(&mut full);
        for cut in 0..full.len() {
            let mut part = BytesMut::from(&full[..cut]);
            assert_eq!(
                Frame::decode(&mut part, 1024).unwrap(),
                None,
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn an_announced_length_is_not_reserved_up_front() {
        // A header announcing 10 MiB (under the limit), and nothing else.
        let mut buf = BytesMut::new();
        buf.put_u32(10 << 20);
        buf.put_u8(MSG);
        assert_eq!(Frame::decode(&mut buf, DEFAULT_MAX_FRAME), Ok(None));
        assert!(
            buf.capacity() <= 2 * MAX_RESERVE,
            "reserved {} bytes for a frame of which 5 arrived",
            buf.capacity()
        );
    }

    #[test]
    fn a_large_frame_arriving_in_pieces_decodes_and_the_buffer_tracks_what_arrived() {
        let body = Bytes::from((0..3_000_000u32).map(|i| i as u8).collect::<Vec<u8>>());
        let f = Frame::Reply {
            id: 9,
            headers: Headers::new(),
            codec: "bytes".into(),
            body,
        };
        let mut full = BytesMut::new();
        f.encode(&mut full);
        let mut buf = BytesMut::new();
        for piece in full.chunks(10_000) {
            assert_eq!(Frame::decode(&mut buf, DEFAULT_MAX_FRAME), Ok(None));
            // At most the room asked for on top of what arrived, doubled by
            // the buffer's own growth.
            assert!(
                buf.capacity() <= 2 * (buf.len() + MAX_RESERVE),
                "capacity {} with {} bytes buffered",
                buf.capacity(),
                buf.len()
            );
            buf.extend_from_slice(piece);
        }
        assert_eq!(Frame::decode(&mut buf, DEFAULT_MAX_FRAME), Ok(Some(f)));
        assert!(buf.is_empty());
    }

    #[test]
    fn frames_either_side_of_the_small_frame_bound_decode_alike_and_in_order() {
        // Up to SMALL_FRAME parsed in place and copied; above it, shared.
        let msg = |n: usize| Frame::Msg {
            mode: Mode::Send,
            id: n as u64,
            timeout_ms: 0,
            address: "a".into(),
            headers: [("k", "v".repeat(n.min(100)))].into_iter().collect(),
            codec: "bytes".into(),
            body: Bytes::from(vec![n as u8; n]),
        };
        // The length prefix (which excludes itself) of `msg(n)`.
        let len_of = |n: usize| {
            let mut b = BytesMut::new();
            msg(n).encode(&mut b);
            u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize
        };
        // Past 100 bytes a body adds only itself: these two sit on the bound.
        let at = 100 + SMALL_FRAME - len_of(100);
        assert_eq!(len_of(at), SMALL_FRAME);
        assert_eq!(len_of(at + 1), SMALL_FRAME + 1);
        let frames: Vec<Frame> = [1usize, at, at + 1, 100_000, 3]
            .into_iter()
            .map(msg)
            .collect();
        let mut buf = BytesMut::new();
        for f in &frames {
            f.encode(&mut buf);
        }
        for f in &frames {
            assert_eq!(
                Frame::decode(&mut buf, DEFAULT_MAX_FRAME).unwrap().as_ref(),
                Some(f)
            );
        }
        assert!(buf.is_empty());
    }

    #[test]
    fn a_frame_with_a_byte_too_many_or_too_few_is_refused_small_or_large() {
        for n in [16, SMALL_FRAME * 2] {
            let f = Frame::Fail {
                id: 1,
                kind: FailKind::Error,
                code: 0,
                message: "m".repeat(n).into(),
            };
            let mut enc = BytesMut::new();
            f.encode(&mut enc);
            let len = u32::from_be_bytes([enc[0], enc[1], enc[2], enc[3]]);
            let mut trailing = BytesMut::new();
            trailing.put_u32(len + 1);
            trailing.extend_from_slice(&enc[4..]);
            trailing.put_u8(0);
            assert_eq!(
                Frame::decode(&mut trailing, DEFAULT_MAX_FRAME),
                Err(FrameError::Trailing(1)),
                "{n}"
            );
            assert!(trailing.is_empty(), "a refused frame is consumed ({n})");
            let mut short = BytesMut::new();
            short.put_u32(len - 1);
            short.extend_from_slice(&enc[4..enc.len() - 1]);
            assert_eq!(
                Frame::decode(&mut short, DEFAULT_MAX_FRAME),
                Err(FrameError::Truncated("FAIL")),
                "{n}"
            );
            assert!(short.is_empty(), "a refused frame is consumed ({n})");
        }
    }

    #[test]
    fn malformed_frames_are_typed_errors() {
        let mut big = BytesMut::from(&[0xff, 0xff, 0xff, 0xff][..]);
        assert!(matches!(
            Frame::decode(&mut big, 1024),
            Err(FrameError::TooLarge { .. })
        ));
        let mut empty = BytesMut::from(&[0, 0, 0, 0][..]);
        assert_eq!(Frame::decode(&mut empty, 1024), Err(FrameError::Empty));
        let mut unknown = BytesMut::from(&[0, 0, 0, 1, 99][..]);
        assert_eq!(
            Frame::decode(&mut unknown, 1024),
            Err(FrameError::UnknownKind(99))
        );
        let mut short = BytesMut::from(&[0, 0, 0, 3, PING, 0, 0][..]);
        assert_eq!(
            Frame::decode(&mut short, 1024),
            Err(FrameError::Truncated("PING"))
        );
        let mut trailing = BytesMut::from(&[0, 0, 0, 10, PING, 0, 0, 0, 0, 0, 0, 0, 1, 5][..]);
        assert_eq!(
            Frame::decode(&mut trailing, 1024),
            Err(FrameError::Trailing(1))
        );
        // HELLO, version 1, node "\xff\xfe" (not UTF-8), cluster "".
        let mut bad_utf8 = BytesMut::from(&[0, 0, 0, 9, HELLO, 0, 1, 0, 2, 0xff, 0xfe, 0, 0][..]);
        assert_eq!(Frame::decode(&mut bad_utf8, 1024), Err(FrameError::Utf8));
        // Valid multi-byte UTF-8 after ASCII passes the check.
        let mut good = BytesMut::new();
        Frame::Hello {
            version: 1,
            node: "nœud-é".into(),
            cluster: "c".into(),
        }
        .encode(&mut good);
        assert!(matches!(
            Frame::decode(&mut good, 1024),
            Ok(Some(Frame::Hello { node, .. })) if node == "nœud-é"
        ));
        let mut huge_count = BytesMut::new();
        huge_count.put_u32(13);
        huge_count.put_u8(REPLY);
        huge_count.put_u64(1);
        huge_count.put_u16(u16::MAX);
        huge_count.put_u16(0);
        assert_eq!(
            Frame::decode(&mut huge_count, 1024),
            Err(FrameError::Truncated("REPLY"))
        );
    }
}
