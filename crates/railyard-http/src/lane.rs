//! The fixed lane: plain `GET`s of fixed bodies answered without hyper.
//!
//! # Why
//! At 10,000 connections a `GET /static/4k` costs this server about 13 µs of
//! CPU on the 2-core test machine, about 5 µs of it in user space, most of
//! that in hyper: request parsing into an `http::Request`, the dispatcher,
//! response encoding, buffer management, and a header-read timer armed and
//! cleared for every request (docs/benchmarks.md, "Where a request's CPU
//! goes"). The response of a fixed route is known bytes, so hyper's general
//! machinery buys nothing for it. This is the case DESIGN.md allows for
//! hand-written code: the crate measurably costs the goal (issue 4's
//! requests/s ratio), and the lane is small.
//!
//! # What the lane answers
//! A request whose head is complete in what has been read, and which is:
//! `GET`, `HTTP/1.1`, an origin-form target of plain characters whose path
//! (before any `?`) is a fixed route ([`Router::fixed`](crate::Router::fixed)),
//! with no `Content-Length`, `Transfer-Encoding`, `Expect` or `Upgrade`
//! header, `Connection` absent or `keep-alive`, at most [`LANE_HEADERS`]
//! headers and `max_header_bytes` of head. Such a request has no body and
//! keeps the connection open, so its answer is the route's head for the
//! negotiated encoding, a `date` line and the body.
//!
//! Everything else (other routes and methods, bodies, HTTP/1.0, bad
//! requests, oversize heads) is handed to hyper with every byte not yet
//! answered, after the lane's own answers are written: pipelined requests
//! are answered in order whoever answers them. The connection returns to
//! the lane when hyper parks it (see `conn::serve`).
//!
//! # Bytes on the wire
//! The same as hyper's for the same request: the heads are serialized once,
//! at start, the way hyper 1.x writes them (`compress::FixedBody`), and the
//! `fixed_lane` tests compare both servers' bytes for every route and
//! encoding.
//!
//! # Memory and deadlines
//! Reads land in one scratch buffer per core; between reads a connection
//! keeps only the bytes of a partial head, as a parked one does. A partial
//! head must be completed within `header_read_timeout` of its first bytes,
//! and an idle connection closes `header_read_timeout` after its last
//! request, as when parked. One timer per lane phase enforces both: it is
//! re-armed when it fires early, not for every request.

use std::future::{poll_fn, Future};
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{ready, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::compress::Encoding;
use crate::conn::Core;

/// Most headers the lane parses; a request with more goes to hyper.
pub(crate) const LANE_HEADERS: usize = 32;
/// Most responses gathered into one `writev` (three slices each).
const BATCH: usize = 16;
/// Most answers in one turn before the lane lets the core's other
/// connections run (a deep pipeline is answered over several turns).
const TURN: usize = 64;
/// Size of each core's read buffer.
pub(crate) const SCRATCH_BYTES: usize = 16 * 1024;
/// `date: ` + IMF-fixdate (29 bytes) + CRLF + the blank line's CRLF.
const DATE_LINE: usize = 39;

/// How a lane phase ended.
pub(crate) enum LaneEnd {
    /// A request for hyper: the bytes not answered are in the carry.
    Hyper,
    /// The client left, an error, the idle or head deadline, or shutdown.
    Close,
}

/// The `date` line, formatted once per second per core.
pub(crate) struct DateLine {
    secs: u64,
    line: [u8; DATE_LINE],
}

impl DateLine {
    pub(crate) fn new() -> Self {
        Self {
            secs: u64::MAX,
            line: [0; DATE_LINE],
        }
    }

    fn now(&mut self) -> [u8; DATE_LINE] {
        let now = SystemTime::now();
        let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if secs != self.secs {
            let text = httpdate::fmt_http_date(now);
            let mut line = [0u8; DATE_LINE];
            line[..6].copy_from_slice(b"date: ");
            line[6..35].copy_from_slice(&text.as_bytes()[..29]);
            line[35..].copy_from_slice(b"\r\n\r\n");
            self.line = line;
            self.secs = secs;
        }
        self.line
    }
}

/// Serves the connection's plain fixed `GET`s until a request needs hyper
/// ([`LaneEnd::Hyper`], with the unanswered bytes in `carry`) or the
/// connection ends. `carry` holds, on entry, bytes read earlier (a partial
/// head, from a park); `head_deadline` is that head's deadline, kept across
/// phases.
pub(crate) async fn run(
    core: &Core,
    tcp: &mut TcpStream,
    carry: &mut Bytes,
    head_deadline: &mut Option<Instant>,
) -> LaneEnd {
    let timeout = core.config.header_read_timeout;
    let limit = head_limit(core);
    let mut idle_since = Instant::now();
    // See `Core::stop_begun`.
    let stop = core.stop.notified();
    tokio::pin!(stop);
    let mut stop_registered = false;
    let sleep = tokio::time::sleep_until(head_deadline.unwrap_or(idle_since + timeout));
    tokio::pin!(sleep);
    // A carry from a park is a partial head: it waits for more bytes. A
    // carry left by a blocked write or a full turn holds whole requests:
    // it is parsed before anything more is read.
    let mut parse_carry = false;
    // When the carry's bytes were read (a partial head's deadline runs
    // from then, even if writing our answers took a while).
    let mut carry_at = idle_since;
    // Answers since the lane last let the core's other connections run.
    let mut this_turn = 0;
    loop {
        let (next, answered, at) = if parse_carry {
            parse_carry = false;
            if core.stopping.get() {
                return LaneEnd::Close;
            }
            let input = std::mem::take(carry);
            let (next, answered) = settle(core, tcp, &input, Some(&input), carry_at, carry);
            (next, answered, carry_at)
        } else {
            let due = head_deadline.unwrap_or(idle_since + timeout);
            if sleep.deadline() > due {
                sleep.as_mut().reset(due);
            }
            let mut waited = false;
            let read = poll_fn(|cx| {
                if core.stop_begun(stop.as_mut(), &mut stop_registered, cx) {
                    return Poll::Ready(None);
                }
                {
                    let mut scratch = core.scratch.borrow_mut();
                    let mut buf = ReadBuf::new(&mut scratch[..]);
                    // tokio clears the readiness after a short read, so a
                    // request costs one `recvfrom`, not a second one that
                    // finds the socket empty.
                    if let Poll::Ready(r) = Pin::new(&mut *tcp).poll_read(cx, &mut buf) {
                        return Poll::Ready(r.ok().map(|()| buf.filled().len()));
                    }
                }
                waited = true;
                loop {
                    ready!(sleep.as_mut().poll(cx));
                    if Instant::now() >= due {
                        return Poll::Ready(None);
                    }
                    // Fired for an earlier deadline that has moved on.
                    sleep.as_mut().reset(due);
                }
            })
            .await;
            let n = match read {
                Some(n) if n > 0 => n,
                _ => return LaneEnd::Close,
            };
            if waited {
                // Other connections ran while this one waited.
                this_turn = 0;
            }
            core.stats.bytes_in.add(n as u64);
            let now = Instant::now();
            carry_at = now;
            let scratch = core.scratch.borrow();
            let (next, answered) = if carry.is_empty() {
                settle(core, tcp, &scratch[..n], None, now, carry)
            } else {
                // The carry is a partial head. Append (the carry's buffer is
                // reused when it is the only reference), and parse again only
                // when the new bytes may end the head: a head trickling in
                // costs linear work, not a re-parse per byte. Empty lines
                // before a head (which httparse skips) are dropped here, so
                // that they can neither pass for its end nor pile up.
                let mut joined = Vec::from(std::mem::take(carry));
                let mut from = joined.len().saturating_sub(2);
                joined.extend_from_slice(&scratch[..n]);
                drop(scratch);
                let blank = blank_lines(&joined);
                joined.drain(..blank);
                from = from.saturating_sub(blank);
                if joined.len() < limit && !may_end_head(&joined[from..]) {
                    *carry = Bytes::from(joined);
                    (Next::Wait, 0)
                } else {
                    settle(core, tcp, &joined, None, now, carry)
                }
            };
            (next, answered, now)
        };
        this_turn += answered;
        if answered > 0 {
            // Idle time counts from the last request answered: bytes that
            // complete nothing (empty lines, a partial head) do not move it.
            idle_since = at;
            // The head the deadline was set for is complete.
            *head_deadline = None;
        }
        match next {
            Next::Wait => {
                if carry.is_empty() {
                    *head_deadline = None;
                } else if head_deadline.is_none() {
                    // A new partial head: its deadline runs from now on,
                    // whatever follows.
                    *head_deadline = Some(at + timeout);
                }
            }
            // A full turn: the yield below comes first.
            Next::More => parse_carry = true,
            Next::Hyper => {
                // hyper keeps its own head timer from here.
                *head_deadline = None;
                return LaneEnd::Hyper;
            }
            Next::Write(unsent) => {
                if write_unsent(core, tcp, unsent).await.is_err() {
                    return LaneEnd::Close;
                }
                idle_since = Instant::now();
                parse_carry = !carry.is_empty();
            }
            Next::Close => return LaneEnd::Close,
        }
        if this_turn >= TURN {
            // Answered a turn's worth without waiting for the socket (a
            // client that keeps the pipe full): let the others run.
            tokio::task::yield_now().await;
            this_turn = 0;
        }
    }
}

/// The lane parses heads shorter than this, and than `max_header_bytes`:
/// hyper refuses a longer target (414) and longer header names (431) than
/// such a head can hold, so below it the lane and hyper agree.
const LANE_HEAD_MAX: usize = 65_534;

/// The length from which a head is hyper's to take or refuse.
fn head_limit(core: &Core) -> usize {
    core.config.max_header_bytes.min(LANE_HEAD_MAX)
}

/// The length of the empty lines (`\r\n` or `\n`) at the front of `bytes`,
/// which httparse skips before a request line.
fn blank_lines(bytes: &[u8]) -> usize {
    let mut i = 0;
    loop {
        match bytes.get(i..i + 2) {
            Some(b"\r\n") => i += 2,
            _ if bytes.get(i) == Some(&b'\n') => i += 1,
            _ => return i,
        }
    }
}

/// Whether `bytes` (the new bytes of a head, with the two before them) may
/// hold the blank line that ends a head (`\r\n\r\n` or, as httparse also
/// takes, `\n\n`).
fn may_end_head(bytes: &[u8]) -> bool {
    bytes
        .windows(2)
        .enumerate()
        .any(|(i, w)| w == b"\n\n" || (w == b"\n\r" && bytes.get(i + 2) == Some(&b'\n')))
}

/// What to do after answering one read's bytes.
enum Next {
    /// All answered; `carry` holds a partial head, if any.
    Wait,
    /// The carry starts with a request for hyper.
    Hyper,
    /// The socket took only part of the answers: write these first, then
    /// parse the carry.
    Write(Vec<Bytes>),
    /// [`TURN`] answers are written; the carry holds requests not yet
    /// parsed: let the core's other connections run, then go on.
    More,
    /// Writing failed: the client is gone.
    Close,
}

/// Answers `input` (read at `start`) and leaves its unanswered bytes in
/// `carry`; returns how many requests it answered. `owner`, when `input`
/// is a `Bytes`, lets whole requests left over be kept without a copy; a
/// partial head is always copied, so that it never holds a larger buffer.
fn settle(
    core: &Core,
    tcp: &TcpStream,
    input: &[u8],
    owner: Option<&Bytes>,
    start: Instant,
    carry: &mut Bytes,
) -> (Next, usize) {
    let (next, rest, answered) = answer(core, tcp, input, start.into_std());
    *carry = match owner {
        _ if rest == input.len() || matches!(next, Next::Close) => Bytes::new(),
        Some(whole) if !matches!(next, Next::Wait) => whole.slice(rest..),
        _ => Bytes::copy_from_slice(&input[rest..]),
    };
    (next, answered)
}

/// A response the lane owes: the route's head and body for its encoding.
type Owed<'r> = Option<(&'r Bytes, &'r Bytes)>;

/// Parses and answers the requests at the front of `input`, writing the
/// answers in batches of [`BATCH`] with one `writev` each, at most [`TURN`]
/// of them. Returns what to do next, the offset of the first byte not
/// answered, and how many requests were answered.
fn answer(
    core: &Core,
    tcp: &TcpStream,
    input: &[u8],
    start: std::time::Instant,
) -> (Next, usize, usize) {
    let date = core.date.borrow_mut().now();
    let mut owed: [Owed<'_>; BATCH] = [None; BATCH];
    let mut k = 0;
    let mut pos = 0;
    let mut answered = 0;
    let mut to_hyper = false;
    while pos < input.len() && answered < TURN {
        match parse(core, &input[pos..]) {
            Parsed::Fixed {
                len,
                route,
                head,
                body,
            } => {
                core.record(route, "GET", 200, start.elapsed().as_secs_f64());
                core.stats.lane_requests.add(1);
                owed[k] = Some((head, body));
                k += 1;
                answered += 1;
                pos += len;
                if k == BATCH {
                    if let Some(stop) = flush(core, tcp, &owed[..k], &date) {
                        return (stop, pos, answered);
                    }
                    k = 0;
                }
            }
            Parsed::Partial => break,
            Parsed::Other => {
                to_hyper = true;
                break;
            }
        }
    }
    if k > 0 {
        if let Some(stop) = flush(core, tcp, &owed[..k], &date) {
            return (stop, pos, answered);
        }
    }
    let next = if to_hyper {
        Next::Hyper
    } else if answered == TURN && pos < input.len() {
        Next::More
    } else {
        Next::Wait
    };
    (next, pos, answered)
}

/// The request at the front of a buffer.
enum Parsed<'r> {
    /// One the lane answers: its head's length, route id and response.
    Fixed {
        len: usize,
        route: usize,
        head: &'r Bytes,
        body: &'r Bytes,
    },
    /// Its head is not all here yet.
    Partial,
    /// hyper's to answer (or to refuse).
    Other,
}

fn parse<'r>(core: &'r Core, buf: &[u8]) -> Parsed<'r> {
    let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; LANE_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let limit = head_limit(core);
    let len = match req.parse_with_uninit_headers(buf, &mut headers) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() < limit => return Parsed::Partial,
        // More headers than the lane parses, before the head is complete:
        // wait for its end, so that hyper never gets a head whose deadline
        // has already been running here.
        Err(httparse::Error::TooManyHeaders)
            if buf.len() < limit && !may_end_head(&buf[blank_lines(buf)..]) =>
        {
            return Parsed::Partial
        }
        // Too big, too many headers or malformed: hyper refuses it properly.
        Ok(httparse::Status::Partial) | Err(_) => return Parsed::Other,
    };
    if len >= limit
        || req.headers.len() > core.config.max_headers
        || req.method != Some("GET")
        || req.version != Some(1)
    {
        return Parsed::Other;
    }
    let Some(target) = req.path else {
        return Parsed::Other;
    };
    if !target.starts_with('/') || !target.bytes().all(plain) {
        return Parsed::Other;
    }
    let path = target.split_once('?').map_or(target, |(p, _)| p);
    let Some((route, fixed)) = core.router.fixed_get(path) else {
        return Parsed::Other;
    };
    for h in req.headers.iter() {
        let name = h.name;
        let bodied = ["content-length", "transfer-encoding", "expect", "upgrade"]
            .iter()
            .any(|n| name.eq_ignore_ascii_case(n));
        let closing =
            name.eq_ignore_ascii_case("connection") && !h.value.eq_ignore_ascii_case(b"keep-alive");
        if bodied || closing {
            return Parsed::Other;
        }
    }
    let enc = Encoding::negotiate_values(
        req.headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("accept-encoding"))
            .map(|h| h.value),
    );
    let (head, body) = fixed.encoded(enc);
    Parsed::Fixed {
        len,
        route,
        head,
        body,
    }
}

/// Target bytes the lane takes as they are; anything else (which hyper may
/// refuse or read differently) goes to hyper.
fn plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~/?=&%+:;,@!$'()*".contains(&b)
}

/// Writes the owed answers with one `writev`: `None` when the socket took
/// them all, else what the lane must do first ([`Next::Write`] the rest, in
/// order, or [`Next::Close`] after a failed write).
fn flush(core: &Core, tcp: &TcpStream, owed: &[Owed<'_>], date: &[u8; DATE_LINE]) -> Option<Next> {
    let mut iov = [IoSlice::new(&[]); BATCH * 3];
    let mut n = 0;
    for (head, body) in owed.iter().flatten() {
        iov[n] = IoSlice::new(head);
        iov[n + 1] = IoSlice::new(date);
        n += 2;
        if !body.is_empty() {
            iov[n] = IoSlice::new(body);
            n += 1;
        }
    }
    let total: usize = iov[..n].iter().map(|s| s.len()).sum();
    let written = match tcp.try_write_vectored(&iov[..n]) {
        Ok(w) => w,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(_) => return Some(Next::Close),
    };
    core.stats.bytes_out.add(written as u64);
    if written == total {
        return None;
    }
    let mut skip = written;
    let mut unsent = Vec::with_capacity(owed.len() * 3);
    for (head, body) in owed.iter().flatten() {
        for piece in [
            (*head).clone(),
            Bytes::copy_from_slice(date),
            (*body).clone(),
        ] {
            if skip >= piece.len() {
                skip -= piece.len();
                continue;
            }
            unsent.push(piece.slice(skip..));
            skip = 0;
        }
    }
    Some(Next::Write(unsent))
}

/// Writes what a full socket buffer left over, waiting for room.
async fn write_unsent(core: &Core, tcp: &TcpStream, mut unsent: Vec<Bytes>) -> io::Result<()> {
    let mut i = 0;
    while i < unsent.len() {
        // A client that takes nothing for `write_timeout` is dropped.
        tokio::time::timeout(core.config.write_timeout, tcp.writable())
            .await
            .map_err(|_| crate::conn::write_timed_out())??;
        let iov: Vec<IoSlice<'_>> = unsent[i..]
            .iter()
            .take(BATCH * 3)
            .map(|b| IoSlice::new(b))
            .collect();
        let mut n = match tcp.try_write_vectored(&iov) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        drop(iov);
        core.stats.bytes_out.add(n as u64);
        while n > 0 {
            let len = unsent[i].len();
            if n >= len {
                n -= len;
                i += 1;
            } else {
                unsent[i].advance(n);
                n = 0;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_date_line_is_a_head_ending_imf_fixdate() {
        let line = DateLine::new().now();
        let text = std::str::from_utf8(&line).unwrap();
        assert!(text.starts_with("date: "), "{text}");
        assert!(text.ends_with(" GMT\r\n\r\n"), "{text}");
        let date = &text[6..35];
        assert!(httpdate::parse_http_date(date).is_ok(), "{date}");
    }

    #[test]
    fn a_head_may_end_only_where_a_blank_line_can_be() {
        assert!(may_end_head(b"a\r\n\r\n"));
        assert!(may_end_head(b"\n\n"));
        assert!(may_end_head(b"\n\r\n"));
        assert!(!may_end_head(b"Host: t\r\n"));
        assert!(!may_end_head(b"\r\n\r"));
        assert!(!may_end_head(b""));
    }

    #[test]
    fn empty_lines_before_a_head_are_measured_whole() {
        assert_eq!(blank_lines(b"\r\n\n\r\nGET"), 5);
        assert_eq!(blank_lines(b"\r\n\r"), 2, "a lone CR stays");
        assert_eq!(blank_lines(b"GET / HTTP/1.1\r\n"), 0);
        assert_eq!(blank_lines(b""), 0);
    }

    #[test]
    fn plain_targets_exclude_what_a_uri_may_refuse() {
        assert!(b"/static/4k?a=1&b=%20".iter().all(|&b| plain(b)));
        for b in [b' ', b'"', b'<', b'{', b'#', b'\\', 0x7f, 0x80] {
            assert!(!plain(b), "{b:#x}");
        }
    }
}
