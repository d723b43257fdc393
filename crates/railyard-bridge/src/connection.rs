//! One task per client connection. It owns the socket, reads and handles
//! frames, polls the connection's bus registrations and in-flight requests,
//! and writes everything through one bounded outbound buffer.
//!
//! Nothing here blocks: socket I/O is readiness-based (`try_read` /
//! `try_write` on the one `TcpStream`), so reading and writing never wait on
//! each other, and a full outbound buffer simply disables the branches that
//! would add to it (see Back-pressure in the crate docs).
//!
//! One timer per connection enforces `frame_timeout` and `idle_timeout`; it
//! runs only while a frame is partly received or an idle timeout is set (see
//! [`Conn::update_timer`]).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use railyard_bus::{BusError, DeliveryOptions, EventBus, Message, MessageStream, PendingReply};
use serde_json::{Map, Value};
use tokio::io::AsyncReadExt;
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_stream::StreamMap;
use tokio_util::sync::CancellationToken;

use crate::frame::{self, FrameError, Inbound};
use crate::metrics::LocalCounters;
use crate::server::Shared;

/// The header that carries the shared token (see `BridgeConfig::auth_token`).
pub const AUTH_HEADER: &str = "authToken";

/// How long a closing connection may take to flush its last frames.
const CLOSE_FLUSH: Duration = Duration::from_secs(1);

/// The sooner of two optional deadlines.
fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// How far ahead the timer is moved when nothing is left to time: far
/// enough never to fire in practice, within the range of tokio's timer wheel.
const PARKED: Duration = Duration::from_secs(365 * 24 * 3600);

/// Read buffer growth step: an idle connection holds one such buffer, and
/// one grown for a large frame is given back once drained.
const READ_CHUNK: usize = 4 * 1024;

/// Turns in a row that may drain answers and deliveries before a turn
/// looks at the client's input (its frames, then the timer) first. Under
/// a constant stream of deliveries, each such turn queues up to
/// `outbound_queue_bytes`; with one request in flight, output and input
/// alternate on their own and no extra turn is taken.
const OUTPUT_TURNS: u32 = 4;

/// A registration on its way: the address, the `register`'s number and
/// what the bus answered.
type Registering<'a> =
    Pin<Box<dyn Future<Output = (String, u64, Result<MessageStream, BusError>)> + Send + 'a>>;

/// A request from the client, waiting for the bus's answer.
struct InFlight<'a> {
    /// The client's `replyAddress`: the answer is addressed to it.
    reply_address: String,
    /// Where the request went, for `err` frames' `sourceAddress`.
    source: String,
    reply: PendingReply<'a>,
}

type Answered = (String, String, Result<Message, BusError>);

impl Future for InFlight<'_> {
    type Output = Answered;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answered> {
        let this = self.get_mut();
        let result = ready!(Pin::new(&mut this.reply).poll(cx));
        Poll::Ready((
            std::mem::take(&mut this.reply_address),
            std::mem::take(&mut this.source),
            result,
        ))
    }
}

/// What the caller should do after handling something.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Continue,
    /// Flush what is queued (bounded in time), then close.
    Close,
}

struct Conn<'a> {
    bus: &'a EventBus,
    shared: &'a Shared,
    /// Registrations by address; dropping one unregisters it.
    regs: StreamMap<String, MessageStream>,
    /// Bus requests delivered to the client and not answered yet, by the
    /// reply address the client was given, with when each was delivered.
    /// Their bodies were taken out once written (only the answer path is
    /// kept). Bounded by `max_pending_replies` (see [`Conn::reply_room`]).
    replies: HashMap<String, (Instant, Message)>,
    inflight: FuturesUnordered<InFlight<'a>>,
    /// Registrations still being advertised to the cluster (their consumer
    /// is registered on this node already): the connection goes on serving
    /// meanwhile. Counted toward `max_registrations`.
    registering: FuturesUnordered<Registering<'a>>,
    /// Their addresses, so a second `register` of one is not a second
    /// registration, with the number of the `register` each answers: an
    /// `unregister` meanwhile removes the address, and the registration,
    /// once advertised, is then dropped instead of kept.
    registering_addresses: HashMap<String, u64>,
    /// Numbers `register`s (see `registering_addresses`).
    next_registration: u64,
    /// Encoded frames not yet written: the bounded outbound queue.
    out: BytesMut,
    /// Bytes read and not yet handled (at most one partial frame once handled).
    inbuf: BytesMut,
    authed: bool,
    next_reply: u64,
    paused: bool,
    /// When the partly received frame at the end of `inbuf` began (less any
    /// time paused); `None` when there is none, and while paused (the bridge
    /// is not reading, so the frame's time does not run; it goes on from
    /// `frame_waited` on resuming).
    frame_started: Option<Instant>,
    /// Time the partly received frame was already given before a pause:
    /// on resuming, its clock goes on from there instead of restarting, so
    /// a client cannot trickle one frame forever by making the bridge pause
    /// (reading its replies in bursts).
    frame_waited: Duration,
    /// When the last complete frame arrived (or the connection opened);
    /// kept up to date only when `idle_timeout` is set.
    last_frame: Instant,
    /// When the connection opened: with `auth_token` set, it must have
    /// authenticated `frame_timeout` after this.
    opened: Instant,
    /// The deadline the connection's timer is set to; `None` when it is
    /// parked or has fired, and then it is not polled.
    timer_at: Option<Instant>,
    local: LocalCounters,
}

/// Serves one client until it leaves, breaks the protocol, or `shutdown`.
/// Registrations end with the connection; bus requests the client did not
/// answer fail at once ([`BusError::NoReply`]); the client's own pending
/// requests are abandoned.
pub(crate) async fn serve(mut stream: TcpStream, shared: &Shared, shutdown: &CancellationToken) {
    let bus = shared.bus.clone();
    let mut conn = Conn {
        bus: &bus,
        shared,
        regs: StreamMap::new(),
        replies: HashMap::new(),
        inflight: FuturesUnordered::new(),
        registering: FuturesUnordered::new(),
        registering_addresses: HashMap::new(),
        next_registration: 0,
        out: BytesMut::new(),
        inbuf: BytesMut::new(),
        authed: shared.config.auth_token.is_none(),
        next_reply: 0,
        paused: false,
        frame_started: None,
        frame_waited: Duration::ZERO,
        last_frame: Instant::now(),
        opened: Instant::now(),
        timer_at: None,
        local: LocalCounters::default(),
    };
    let (rd, wr) = stream.split();
    let flow = conn.run(rd, &wr, shutdown).await;
    if flow == Flow::Close && !conn.out.is_empty() {
        let _ = tokio::time::timeout(CLOSE_FLUSH, conn.flush_all(&wr)).await;
    }
    conn.local.0.connections_closed += 1;
    conn.local.flush(&shared.counters);
    tracing::debug!(
        registrations = conn.regs.len(),
        unanswered = conn.replies.len(),
        "bridge connection closed"
    );
}

impl<'a> Conn<'a> {
    async fn run(
        &mut self,
        mut rd: ReadHalf<'_>,
        wr: &WriteHalf<'_>,
        shutdown: &CancellationToken,
    ) -> Flow {
        let high = self.shared.config.outbound_queue_bytes;
        // Registered once, not on every turn of the loop.
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        // Created once and moved with `reset`, never re-created per frame.
        // Until it is first set it is not polled, so it is not in tokio's
        // timer wheel.
        self.timer_at = earliest(
            self.shared
                .config
                .idle_timeout
                .map(|d| after(self.last_frame, d)),
            self.auth_due(),
        );
        let timer = tokio::time::sleep_until(self.timer_at.unwrap_or(self.last_frame));
        tokio::pin!(timer);
        let mut output_turns = 0u32;
        loop {
            // Frames already buffered are handled first, as room allows.
            let frames_before = self.local.0.frames_in;
            if self.handle_buffered().await == Flow::Close {
                return Flow::Close;
            }
            let got_frames = self.local.0.frames_in != frames_before;
            let room = self.out.len() < high;
            if !room && !self.paused {
                self.local.0.outbound_pauses += 1;
            }
            self.paused = !room;
            self.update_timer(timer.as_mut(), room, got_frames);
            // Counters reach the shared ones before the task may sleep.
            self.local.flush(&self.shared.counters);
            if room && self.inbuf.capacity() - self.inbuf.len() < READ_CHUNK / 4 {
                self.inbuf.reserve(READ_CHUNK);
            }
            // Answers and deliveries are drained before more is read, so a
            // client that floods requests still gets its replies; but after
            // OUTPUT_TURNS turns that drained them since the last read, the
            // next turn with room is input's (reads and the timer first), so
            // a constant stream of deliveries cannot keep the client's own
            // frames unread or its timeouts from firing.
            // Only with room: without it the read is off, and the turn would
            // be spent on nothing (a client reading slowly would then never
            // be read).
            let input_turn = room && output_turns >= OUTPUT_TURNS;
            if input_turn {
                output_turns = 0;
            }
            tokio::select! {
                biased;
                () = &mut cancelled => return Flow::Close,
                Some(done) = self.inflight.next(), if room && !input_turn && !self.inflight.is_empty() => {
                    output_turns += 1;
                    self.on_answer(done);
                    while self.out.len() < high {
                        match self.inflight.next().now_or_never() {
                            Some(Some(done)) => self.on_answer(done),
                            _ => break,
                        }
                    }
                }
                Some((_, msg)) = self.regs.next(), if room && !input_turn && !self.regs.is_empty() => {
                    output_turns += 1;
                    self.deliver(msg);
                    while self.out.len() < high {
                        match self.regs.next().now_or_never() {
                            Some(Some((_, msg))) => self.deliver(msg),
                            _ => break,
                        }
                    }
                }
                // `read_buf` (not readiness + `try_read`): tokio then clears the
                // readiness after a short read, saving a `read` that would
                // only say "would block" on every round trip.
                r = rd.read_buf(&mut self.inbuf), if room => {
                    output_turns = 0;
                    match r {
                        Ok(0) => {
                            if !self.inbuf.is_empty() {
                                let e = FrameError::Truncated(self.inbuf.len());
                                tracing::debug!(error = %e, "bridge client left mid-frame");
                                self.err(e.wire_message());
                            }
                            return Flow::Close;
                        }
                        Ok(n) => self.local.0.bytes_in += n as u64,
                        Err(_) => return Flow::Close,
                    }
                }
                // After the read: bytes that are already here complete a
                // frame before its deadline is looked at.
                () = &mut timer, if self.timer_at.is_some() => {
                    if self.on_timer(timer.as_mut()) == Flow::Close {
                        return Flow::Close;
                    }
                }
                r = wr.writable(), if !self.out.is_empty() => {
                    if r.is_err() {
                        return Flow::Close;
                    }
                }
                Some((address, number, r)) = self.registering.next(), if !self.registering.is_empty() => {
                    self.on_registered(address, number, r);
                }
                // Input's turn found nothing ready: back to the output.
                () = std::future::ready(()), if input_turn => {}
            }
            if !self.out.is_empty() && self.flush(wr).is_err() {
                // The client is gone: nothing left to tell it.
                self.out.clear();
                return Flow::Close;
            }
        }
    }

    /// Keeps the timeouts' state after each turn of the loop. On the hot
    /// path (whole frames, no `idle_timeout`) this is a few compares; the
    /// clock is read only when a read leaves a new frame partly received,
    /// or, with `idle_timeout`, once per batch of frames read.
    ///
    /// One `Sleep` serves both timeouts. It is moved only when it must fire
    /// sooner (a frame starts) or must not fire at all (nothing left to
    /// time): a deadline that moves later, as the idle deadline does with
    /// every frame, is left where the timer is and dealt with when the timer
    /// fires early ([`Self::on_timer`]), at most once per timeout. With
    /// nothing left to time the timer is parked [`PARKED`] ahead and not
    /// polled, so an idle connection without `idle_timeout` never wakes up.
    /// Parking moves a registered timer later, one atomic in tokio; setting
    /// it sooner for a frame takes the timer wheel's lock. Both happen once
    /// per partly received frame at most, never for a frame that arrives
    /// whole in one read, and no `Sleep` is ever created after the first.
    fn update_timer(&mut self, mut timer: Pin<&mut Sleep>, room: bool, got_frames: bool) {
        let config = &self.shared.config;
        // With room, `handle_buffered` left at most one partial frame.
        let partial = room && !self.inbuf.is_empty();
        // A new frame began if frames completed and bytes are left over, or
        // if bytes are left and no frame was being timed.
        let starts = partial && (got_frames || self.frame_started.is_none());
        let active = got_frames && config.idle_timeout.is_some();
        if starts || active {
            let now = Instant::now();
            if active {
                self.last_frame = now;
            }
            if starts {
                if got_frames {
                    // A new frame: the one paused on (if any) is complete.
                    self.frame_waited = Duration::ZERO;
                }
                let started = now.checked_sub(self.frame_waited).unwrap_or(now);
                self.frame_started = Some(started);
                let due = after(started, config.frame_timeout);
                if self.timer_at.is_none_or(|at| due < at) {
                    self.set_timer(timer.as_mut(), due);
                }
            }
        }
        if !partial {
            if let Some(started) = self.frame_started.take() {
                // Paused on the same partial frame: keep what it was given.
                self.frame_waited = if !room && !got_frames && !self.inbuf.is_empty() {
                    started.elapsed()
                } else {
                    Duration::ZERO
                };
                if config.idle_timeout.is_none() && self.authed {
                    if let Some(at) = self.timer_at.take() {
                        timer.reset(after(at, PARKED));
                    }
                }
            }
        }
    }

    /// With `auth_token` set, when a connection that has not authenticated
    /// yet is closed: `frame_timeout` after it opened. Without it, a client
    /// could hold a connection slot forever with pings alone, which need no
    /// token.
    fn auth_due(&self) -> Option<Instant> {
        (!self.authed).then(|| after(self.opened, self.shared.config.frame_timeout))
    }

    fn set_timer(&mut self, timer: Pin<&mut Sleep>, at: Instant) {
        timer.reset(at);
        self.timer_at = Some(at);
    }

    /// The timer fired: closes the connection with an `err` frame if a
    /// timeout has passed, or sets the timer for the deadline that comes
    /// next (one that moved later since the timer was set).
    fn on_timer(&mut self, timer: Pin<&mut Sleep>) -> Flow {
        self.timer_at = None;
        let config = &self.shared.config;
        let now = Instant::now();
        let frame_due = self.frame_started.map(|t| after(t, config.frame_timeout));
        let idle_due = config.idle_timeout.map(|d| after(self.last_frame, d));
        if frame_due.is_some_and(|d| d <= now) {
            let e = FrameError::TimedOut {
                received: self.inbuf.len(),
                timeout: config.frame_timeout,
            };
            self.local.0.frame_timeouts += 1;
            tracing::debug!(error = %e, "bridge frame timed out");
            self.err(e.wire_message());
            return Flow::Close;
        }
        let auth_due = self.auth_due();
        if auth_due.is_some_and(|d| d <= now) {
            self.local.0.auth_failures += 1;
            tracing::debug!(
                frame_timeout_ms = config.frame_timeout.as_millis(),
                "bridge connection closed: not authenticated within frame_timeout"
            );
            self.err("authentication_timeout");
            return Flow::Close;
        }
        if idle_due.is_some_and(|d| d <= now) {
            self.local.0.idle_timeouts += 1;
            tracing::debug!(
                idle_timeout_ms = config.idle_timeout.map_or(0, |d| d.as_millis()),
                "bridge connection closed: no frame within idle_timeout"
            );
            self.err("idle_timeout");
            return Flow::Close;
        }
        if let Some(at) = earliest(earliest(frame_due, idle_due), auth_due) {
            self.set_timer(timer, at);
        }
        Flow::Continue
    }

    /// Handles complete frames in the read buffer while the outbound queue has room.
    async fn handle_buffered(&mut self) -> Flow {
        let high = self.shared.config.outbound_queue_bytes;
        while self.out.len() < high {
            let payload =
                match frame::next_frame(&mut self.inbuf, self.shared.config.max_frame_size) {
                    Ok(Some(p)) => p,
                    Ok(None) => break,
                    Err(e) => {
                        self.local.0.oversized_frames += 1;
                        tracing::debug!(error = %e, "bridge frame refused");
                        self.err(e.wire_message());
                        return Flow::Close;
                    }
                };
            self.local.0.frames_in += 1;
            if self.handle(&payload).await == Flow::Close {
                return Flow::Close;
            }
        }
        if self.inbuf.is_empty() && self.inbuf.capacity() > 4 * READ_CHUNK {
            // Give back the room a large frame needed.
            self.inbuf = BytesMut::new();
        }
        Flow::Continue
    }

    async fn handle(&mut self, payload: &[u8]) -> Flow {
        let f = match frame::parse(payload) {
            Ok(f) => f,
            Err(e) => {
                self.local.0.malformed_frames += 1;
                tracing::debug!(error = %e, "malformed bridge frame");
                self.err(e.wire_message());
                return Flow::Close;
            }
        };
        // Vert.x reads a missing type as "message", which no client may send.
        let kind = f.kind.as_deref().unwrap_or("message");
        if kind == "ping" {
            self.local.0.pings += 1;
            self.local.0.frames_out += 1;
            frame::put_pong(&mut self.out);
            return Flow::Continue;
        }
        if !self.authed {
            if !self.token_ok(&f) {
                self.local.0.auth_failures += 1;
                self.err("authentication_failed");
                return Flow::Close;
            }
            self.authed = true;
        }
        // Refused before anything copies the headers: they would be kept on
        // the bus message and written again for every client it reaches.
        let headers = f.headers.as_ref().map_or(0, Map::len);
        if headers > self.shared.config.max_headers {
            self.local.0.limit_rejections += 1;
            tracing::debug!(
                headers,
                max_headers = self.shared.config.max_headers,
                "bridge frame refused: too many headers"
            );
            self.err("too_many_headers");
            return Flow::Continue;
        }
        let Some(address) = f.address.clone() else {
            self.err("missing_address");
            return Flow::Continue;
        };
        match kind {
            "send" => self.on_send(address, f),
            "publish" => self.on_publish(address, f),
            "register" => self.on_register(address).await,
            "unregister" => self.on_unregister(&address),
            _ => self.err("unknown_type"),
        }
        Flow::Continue
    }

    fn token_ok(&self, f: &Inbound) -> bool {
        let Some(expected) = self.shared.config.auth_token.as_deref() else {
            return true;
        };
        let given = f
            .headers
            .as_ref()
            .and_then(|h| h.get(AUTH_HEADER))
            .and_then(Value::as_str)
            .unwrap_or("");
        constant_time_eq(given.as_bytes(), expected.as_bytes())
    }

    fn on_send(&mut self, address: String, f: Inbound) {
        let options = match self.options(f.headers) {
            Ok(o) => o,
            Err(m) => return self.err(m),
        };
        let body = f.body.unwrap_or(Value::Null);
        // A send to a reply address this client was given answers that request.
        if let Some((_, mut msg)) = self.replies.remove(&address) {
            self.local.0.client_answers += 1;
            // The requester may have timed out and gone: nothing to tell.
            let _ = match f.failure_code {
                Some(code) => msg.fail(
                    code.clamp(i32::MIN.into(), i32::MAX.into()) as i32,
                    f.message.unwrap_or_default(),
                ),
                None => msg.reply_with(body, &options),
            };
            if let Some(ra) = f.reply_address {
                self.failure(
                    Some(&ra),
                    &address,
                    -1,
                    "ERROR",
                    "reply chains are not supported by this bridge: the reply was delivered, no answer to it will come",
                );
            }
            return;
        }
        if !self.shared.inbound.allows(&address) {
            return self.denied();
        }
        match f.reply_address {
            Some(reply_address) => {
                if self.inflight.len() >= self.shared.config.max_pending_requests {
                    self.local.0.limit_rejections += 1;
                    return self.failure(
                        Some(&reply_address),
                        &address,
                        -1,
                        "ERROR",
                        "too_many_pending_requests",
                    );
                }
                self.local.0.requests += 1;
                let reply = self.bus.request_with(&address, body, &options);
                self.inflight.push(InFlight {
                    reply_address,
                    source: address,
                    reply,
                });
            }
            None => match self.bus.send_with(&address, body, &options) {
                Ok(()) => self.local.0.sends += 1,
                Err(e) => {
                    self.local.0.bus_refusals += 1;
                    let (code, kind, message) = describe(&e.error, &address, None, options.timeout);
                    self.failure(None, &address, code, kind, &message);
                }
            },
        }
    }

    fn on_publish(&mut self, address: String, f: Inbound) {
        if !self.shared.inbound.allows(&address) {
            return self.denied();
        }
        let options = match self.options(f.headers) {
            Ok(o) => o,
            Err(m) => return self.err(m),
        };
        match self
            .bus
            .publish_with(&address, f.body.unwrap_or(Value::Null), &options)
        {
            Ok(report) => {
                self.local.0.publishes += 1;
                if report.skipped_full > 0 {
                    // Publish is at-most-once per consumer; the client learns
                    // which consumers it did not reach, as a count.
                    self.local.0.bus_refusals += 1;
                    let message = format!(
                        "published to {} consumers; {} had full buffers and did not get it",
                        report.delivered, report.skipped_full
                    );
                    self.failure(None, &address, -1, "ERROR", &message);
                }
            }
            Err(e) => {
                self.local.0.bus_refusals += 1;
                let (code, kind, message) = describe(&e.error, &address, None, options.timeout);
                self.failure(None, &address, code, kind, &message);
            }
        }
    }

    async fn on_register(&mut self, address: String) {
        if !self.shared.outbound.allows(&address) {
            return self.denied();
        }
        if self.regs.contains_key(&address) || self.registering_addresses.contains_key(&address) {
            // Already registered: one registration per address and
            // connection, so messages are never delivered twice.
            return;
        }
        if self.regs.len() + self.registering.len() >= self.shared.config.max_registrations {
            self.local.0.limit_rejections += 1;
            return self.err("too_many_registrations");
        }
        let bus = self.bus;
        let capacity = self.shared.config.registration_capacity;
        let key = address.clone();
        self.next_registration += 1;
        let number = self.next_registration;
        let mut registering: Registering<'a> = Box::pin(async move {
            let r = bus
                .consumer(address.clone())
                .capacity(capacity)
                .stream()
                .await;
            (address, number, r)
        });
        // The first poll registers the consumer on this node, so frames
        // after this one (a publish to the same address) already reach it;
        // only the cluster's advertisement may have to be waited for, and
        // the loop serves the connection meanwhile (an etcd outage can make
        // that take seconds).
        self.registering_addresses.insert(key, number);
        match registering.as_mut().now_or_never() {
            Some((address, number, r)) => self.on_registered(address, number, r),
            None => self.registering.push(registering),
        }
    }

    /// A registration was advertised, or failed. One whose address was
    /// unregistered meanwhile (or registered again since) is dropped.
    fn on_registered(&mut self, address: String, number: u64, r: Result<MessageStream, BusError>) {
        if self.registering_addresses.get(&address) != Some(&number) {
            return; // dropping the stream unregisters it
        }
        self.registering_addresses.remove(&address);
        match r {
            Ok(stream) => {
                self.local.0.registrations += 1;
                self.regs.insert(address, stream);
            }
            Err(BusError::InvalidAddress { .. }) => self.err("invalid_address"),
            Err(e) => {
                tracing::warn!(address, error = %e, "bridge registration failed");
                self.err("registration_failed");
            }
        }
    }

    fn on_unregister(&mut self, address: &str) {
        if !self.shared.outbound.allows(address) {
            return self.denied();
        }
        // A registration still being advertised is cancelled: dropped
        // when its advertisement completes.
        if self.regs.remove(address).is_none()
            && self.registering_addresses.remove(address).is_none()
        {
            self.err("unknown_address");
        }
    }

    /// Whether one more bus request may wait for this client's answer. At
    /// `max_pending_replies`, requests held past `reply_timeout` or whose
    /// requester is gone are let go first (dropping one fails it with
    /// `NoReply`, which a requester still waiting on another node then
    /// gets). A walk over at most `max_pending_replies` entries, only when
    /// the map is full.
    fn reply_room(&mut self) -> bool {
        let max = self.shared.config.max_pending_replies;
        if self.replies.len() < max {
            return true;
        }
        let timeout = self.shared.config.reply_timeout;
        let now = Instant::now();
        let before = self.replies.len();
        self.replies
            .retain(|_, (since, m)| !m.requester_gone() && now.duration_since(*since) < timeout);
        self.local.0.replies_expired += (before - self.replies.len()) as u64;
        self.replies.len() < max
    }

    /// A bus message for one of this client's registrations.
    fn deliver(&mut self, mut msg: Message) {
        let reply_address = if msg.expects_reply() {
            if !self.reply_room() {
                self.local.0.replies_refused += 1;
                let _ = msg.fail(
                    -1,
                    "the bridge client has too many unanswered requests (max_pending_replies)",
                );
                return;
            }
            Some(self.reply_address())
        } else {
            None
        };
        let sent = {
            let codecs = || self.bus.codecs();
            match frame::body_json(msg.raw_body(), codecs) {
                Ok(body) => Ok(frame::put_message(
                    &mut self.out,
                    msg.address(),
                    reply_address.as_deref(),
                    msg.headers(),
                    body,
                    msg.is_send(),
                )),
                Err(e) => Err(e),
            }
        };
        match sent {
            Ok(_) => {
                self.local.0.frames_out += 1;
                self.local.0.deliveries += 1;
                if let Some(ra) = reply_address {
                    // Written: only the way to answer is kept.
                    drop(msg.take_body());
                    self.replies.insert(ra, (Instant::now(), msg));
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, address = msg.address(), "bus body not sendable to a bridge client");
                let _ = msg.fail(-1, e.to_string());
                let address = msg.address().to_owned();
                self.failure(None, &address, -1, "ERROR", &e.to_string());
            }
        }
    }

    /// The bus answered one of this client's requests.
    fn on_answer(&mut self, (reply_address, source, result): Answered) {
        match result {
            Ok(mut reply) => {
                // A reply that itself expects an answer (a chain) gets a reply
                // address the client can send its answer to.
                let next = if reply.expects_reply() {
                    if !self.reply_room() {
                        self.local.0.replies_refused += 1;
                        let _ =
                            reply.fail(-1, "the bridge client has too many unanswered requests");
                        None
                    } else {
                        Some(self.reply_address())
                    }
                } else {
                    None
                };
                let codecs = || self.bus.codecs();
                match frame::body_json(reply.raw_body(), codecs) {
                    Ok(body) => {
                        frame::put_message(
                            &mut self.out,
                            &reply_address,
                            next.as_deref(),
                            reply.headers(),
                            body,
                            true,
                        );
                        self.local.0.frames_out += 1;
                        self.local.0.request_replies += 1;
                        if let Some(ra) = next {
                            drop(reply.take_body());
                            self.replies.insert(ra, (Instant::now(), reply));
                        }
                    }
                    Err(e) => {
                        self.local.0.request_failures += 1;
                        self.failure(Some(&reply_address), &source, -1, "ERROR", &e.to_string());
                    }
                }
            }
            Err(e) => {
                self.local.0.request_failures += 1;
                let (code, kind, message) =
                    describe(&e, &source, Some(&reply_address), request_timeout(&e));
                self.failure(Some(&reply_address), &source, code, kind, &message);
            }
        }
    }

    fn reply_address(&mut self) -> String {
        self.next_reply += 1;
        format!("__railyard.reply.{}", self.next_reply)
    }

    /// Delivery options from a frame's headers, as Vert.x's bridge maps them.
    fn options(
        &self,
        headers: Option<Map<String, Value>>,
    ) -> Result<DeliveryOptions, &'static str> {
        let mut o = DeliveryOptions::new();
        let Some(headers) = headers else {
            return Ok(o);
        };
        let strip_token = self.shared.config.auth_token.is_some();
        for (name, value) in headers {
            match name.as_str() {
                "timeout" => {
                    let ms = value
                        .as_u64()
                        .ok_or("invalid_header: timeout must be a number of milliseconds")?;
                    o.timeout = Duration::from_millis(ms);
                }
                "localOnly" => {
                    o.local_only = value
                        .as_bool()
                        .ok_or("invalid_header: localOnly must be a boolean")?;
                }
                "codecName" => {
                    let c = value
                        .as_str()
                        .ok_or("invalid_header: codecName must be a string")?;
                    o.codec = Some(c.into());
                }
                AUTH_HEADER if strip_token => {}
                _ => match value {
                    Value::Null => {}
                    Value::String(s) => {
                        o.headers.add(name, s);
                    }
                    other => {
                        o.headers.add(name, other.to_string());
                    }
                },
            }
        }
        Ok(o)
    }

    fn err(&mut self, message: &str) {
        self.local.0.err_frames += 1;
        self.local.0.frames_out += 1;
        frame::put_err(&mut self.out, message);
    }

    fn denied(&mut self) {
        self.local.0.access_denied += 1;
        self.err("access_denied");
    }

    fn failure(
        &mut self,
        address: Option<&str>,
        source: &str,
        code: i64,
        kind: &str,
        message: &str,
    ) {
        self.local.0.err_frames += 1;
        self.local.0.frames_out += 1;
        frame::put_failure(&mut self.out, address, source, code, kind, message);
    }

    /// Writes as much as the socket takes now.
    fn flush(&mut self, stream: &WriteHalf<'_>) -> io::Result<()> {
        while !self.out.is_empty() {
            match stream.try_write(&self.out) {
                Ok(n) => {
                    self.local.0.bytes_out += n as u64;
                    self.out.advance(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn flush_all(&mut self, stream: &WriteHalf<'_>) -> io::Result<()> {
        while !self.out.is_empty() {
            stream.writable().await?;
            self.flush(stream)?;
        }
        Ok(())
    }
}

/// `t + d`, or a year ([`PARKED`]) after `t` when `d` is too long to add to
/// an `Instant` (a timeout set through the API, e.g. `Duration::MAX`), so
/// such a setting cannot make a connection task panic.
fn after(t: Instant, d: Duration) -> Instant {
    t.checked_add(d).unwrap_or_else(|| t + PARKED)
}

/// The timeout a failed request had, for the Vert.x-style timeout message.
fn request_timeout(e: &BusError) -> Duration {
    match e {
        BusError::Timeout { after } => *after,
        _ => Duration::ZERO,
    }
}

/// `failureCode`, `failureType` and `message` for a bus error, worded as
/// Vert.x words them where Vert.x has the same failure.
fn describe(
    e: &BusError,
    address: &str,
    reply_address: Option<&str>,
    timeout: Duration,
) -> (i64, &'static str, String) {
    let kind = e.kind().as_str();
    match e {
        BusError::RecipientFailure { code, message } => (i64::from(*code), kind, message.clone()),
        BusError::NoHandlers { .. } => (-1, kind, format!("No handlers for address {address}")),
        BusError::Timeout { .. } => (
            -1,
            kind,
            format!(
                "Timed out after waiting {}(ms) for a reply. address: {}, repliedAddress: {address}",
                timeout.as_millis(),
                reply_address.unwrap_or(""),
            ),
        ),
        other => (-1, kind, other.to_string()),
    }
}

/// Compares without an early exit, so the time taken says nothing about
/// how much of a guessed token was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= usize::from(x ^ y);
    }
    diff == 0
}
