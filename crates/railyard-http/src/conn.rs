//! One connection: hyper's HTTP/1.1 state machine over [`ConnIo`], the
//! per-connection service that routes, times out and meters requests, and
//! graceful shutdown.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use http::header::{HeaderValue, CONNECTION};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{watch, Notify, OwnedSemaphorePermit};

use crate::body::{Body, RequestBody};
use crate::config::HttpConfig;
use crate::metrics::{method_label, CoreStats, HttpMetrics, RequestLabels, Series};
use crate::router::{self, RouteFuture, Router};
use crate::sendfile::{self, Run, Runs};
use bytes::Bytes;

/// This core's metric series by (route id, method, status).
type SeriesCache = HashMap<(usize, &'static str, u16), Arc<Series>, foldhash::fast::RandomState>;

/// What one core's connections share. Lives on that core only.
pub(crate) struct Core {
    pub(crate) router: Arc<Router>,
    pub(crate) metrics: Arc<HttpMetrics>,
    /// This core's share of the per-request metrics (written by this core
    /// only, summed with the other cores' at scrape).
    pub(crate) stats: Arc<CoreStats>,
    pub(crate) config: Arc<HttpConfig>,
    pub(crate) http1: hyper::server::conn::http1::Builder,
    /// This core's series by (route id, method, status), so the hot path
    /// skips a lock and the label hash.
    series: RefCell<SeriesCache>,
    pub(crate) shutdown: watch::Receiver<bool>,
    /// Shutdown has begun (set by the core's accept loop, which watches
    /// `shutdown`). Active connections read this flag instead of polling
    /// the shared watch channel on every wake-up (that takes a lock shared
    /// by every connection of every core).
    pub(crate) stopping: Cell<bool>,
    /// Woken (all waiters) when `stopping` is set.
    pub(crate) stop: Notify,
    /// Connections open on this core.
    pub(crate) active: Cell<usize>,
    /// Woken when `active` drops to zero.
    pub(crate) idle: Notify,
    /// Park clock: advanced every `park_idle_after` by the core's ticker.
    pub(crate) park_epoch: Cell<u64>,
    /// Idle connections to re-check at the next tick (one entry per
    /// connection and tick at most).
    pub(crate) park_wakers: RefCell<Vec<std::task::Waker>>,
    /// File ranges this core found in the page cache lately (see `sendfile`).
    pub(crate) warmth: crate::sendfile::Warmth,
    /// The fixed lane's read buffer, shared by this core's connections
    /// (borrowed only between awaits).
    pub(crate) scratch: RefCell<Box<[u8]>>,
    /// The fixed lane's `date` line.
    pub(crate) date: RefCell<crate::lane::DateLine>,
}

impl Core {
    pub(crate) fn new(
        router: Arc<Router>,
        metrics: Arc<HttpMetrics>,
        config: Arc<HttpConfig>,
        shutdown: watch::Receiver<bool>,
    ) -> Self {
        let mut http1 = hyper::server::conn::http1::Builder::new();
        http1
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(config.header_read_timeout)
            .max_header_size(config.max_header_bytes)
            .max_headers(config.max_headers)
            .keep_alive(true)
            // Vectored writes keep body chunks out of hyper's own buffer,
            // which the sendfile placeholders rely on (see `sendfile`).
            .writev(true);
        Self {
            router,
            stats: metrics.core_stats(),
            metrics,
            config,
            http1,
            series: RefCell::new(HashMap::default()),
            shutdown,
            stopping: Cell::new(false),
            stop: Notify::new(),
            active: Cell::new(0),
            idle: Notify::new(),
            park_epoch: Cell::new(0),
            park_wakers: RefCell::new(Vec::new()),
            warmth: crate::sendfile::Warmth::default(),
            scratch: RefCell::new(vec![0; crate::lane::SCRATCH_BYTES].into_boxed_slice()),
            date: RefCell::new(crate::lane::DateLine::new()),
        }
    }

    /// Advances the park clock and wakes the connections that were idle,
    /// so they can park if they still are.
    pub(crate) fn park_tick(&self) {
        self.park_epoch.set(self.park_epoch.get() + 1);
        let wakers = std::mem::take(&mut *self.park_wakers.borrow_mut());
        for w in wakers {
            w.wake();
        }
    }

    /// Whether shutdown has begun, as seen from a connection task. `stop` is
    /// this core's `stop.notified()`, pinned in the task; the first call
    /// registers it (the task's waker stays the same, so a later
    /// `begin_stopping` wakes the task) and sets `*registered`; every call
    /// after that only reads the core's flag, so a wake-up never takes the
    /// notification's lock.
    pub(crate) fn stop_begun(
        &self,
        stop: Pin<&mut tokio::sync::futures::Notified<'_>>,
        registered: &mut bool,
        cx: &mut Context<'_>,
    ) -> bool {
        if !*registered {
            *registered = true;
            if stop.poll(cx).is_ready() {
                return true;
            }
        }
        self.stopping.get()
    }

    /// Tells this core's connections that shutdown has begun.
    pub(crate) fn begin_stopping(&self) {
        self.stopping.set(true);
        self.stop.notify_waiters();
    }

    pub(crate) fn record(&self, route: usize, method: &'static str, status: u16, secs: f64) {
        let mut series = self.series.borrow_mut();
        let s = series.entry((route, method, status)).or_insert_with(|| {
            self.stats.series(RequestLabels {
                route: self.router.route_names()[route].clone(),
                method,
                status,
            })
        });
        s.observe(secs);
    }
}

/// Resolves once shutdown is signalled (or its sender is gone).
pub(crate) async fn shutdown_signalled(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Keeps the core's connection count right however the task ends.
struct ActiveGuard {
    core: Rc<Core>,
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        let n = self.core.active.get() - 1;
        self.core.active.set(n);
        self.core.metrics.open_connections.dec();
        if n == 0 {
            self.core.idle.notify_waiters();
        }
    }
}

/// Per-connection state shared by the socket wrapper, the service and the
/// driver. Single-threaded (the connection never leaves its core).
#[derive(Default)]
pub(crate) struct ConnState {
    /// File runs for the sendfile placeholders, in response order.
    runs: Runs,
    /// Responses produced whose body hyper has not finished (dropped) yet.
    in_flight: Cell<usize>,
    /// hyper flushed everything it buffered (it calls `poll_flush` on the
    /// socket only once its own write buffer is empty).
    write_clean: Cell<bool>,
    /// hyper's last read found the socket empty: it holds no complete
    /// request head, only (at most) part of one.
    read_blocked: Cell<bool>,
    /// A request with a body was seen: never park this connection (hyper
    /// must finish or discard that body itself).
    had_body: Cell<bool>,
    /// A request with a body was answered early (400, 408, 413: its body
    /// possibly unread): the close lingers (see `linger`).
    answered_early: Cell<bool>,
    /// Requests received, to tell whether an idle connection was busy since.
    served: Cell<u64>,
    /// When the connection was last seen idle: (`served`, park epoch).
    idle_mark: Cell<Option<(u64, u64)>>,
}

impl ConnState {
    /// Between requests: nothing to write, nothing to parse.
    fn is_idle(&self) -> bool {
        self.in_flight.get() == 0
            && self.write_clean.get()
            && self.read_blocked.get()
            && !self.had_body.get()
    }
}

/// Whether an idle connection has stayed idle across a park tick. The first
/// time it is seen idle (or idle again after serving more requests) it is
/// marked and queued for the next tick; a busy connection is thus re-checked
/// at most once per tick, never per request.
fn idle_long_enough(core: &Core, state: &ConnState, cx: &Context<'_>) -> bool {
    if core.config.park_idle_after.is_zero() {
        return true;
    }
    let now = (state.served.get(), core.park_epoch.get());
    match state.idle_mark.get() {
        Some((served, epoch)) if served == now.0 => {
            if now.1 > epoch {
                return true;
            }
            false // queued already for this tick
        }
        Some((_, epoch)) if epoch == now.1 => {
            // Busy since, but already queued for this tick: re-mark only.
            state.idle_mark.set(Some(now));
            false
        }
        _ => {
            state.idle_mark.set(Some(now));
            core.park_wakers.borrow_mut().push(cx.waker().clone());
            false
        }
    }
}

/// How an active (hyper-driven) phase of a connection ended.
enum Phase {
    /// Idle between requests: hyper's state is dropped; the socket waits
    /// for its next request. `leftover` is a partial request head, if any.
    Parked { tcp: TcpStream, leftover: Bytes },
    /// The connection is finished.
    Closed,
}

/// Serves one accepted connection until the client leaves, an error closes
/// it, or shutdown drains it (the in-flight response is finished first).
///
/// # Parking
/// hyper keeps about 10 KiB per connection (8 KiB read buffer, write buffer,
/// state) for as long as it serves it. Most of a C10K server's connections
/// are idle keep-alive connections, so between requests the connection is
/// *parked*: hyper's connection is taken apart (`into_parts`, keeping any
/// bytes already read), and only the socket waits for readability. The next
/// request starts a fresh hyper connection over the same socket. A partial
/// head parks too, but its deadline keeps running (slowloris).
///
/// A connection parks once it has been idle across a tick of the core's park
/// clock (`park_idle_after`), so a busy connection is not taken apart
/// between every two requests.
///
/// # The fixed lane
/// With `fixed_lane` on, a parked connection waits in the lane (`lane`),
/// which answers plain `GET`s of fixed bodies itself and hands hyper the
/// first other request; a new connection starts there too.
pub(crate) async fn serve(core: Rc<Core>, tcp: TcpStream, permit: OwnedSemaphorePermit) {
    core.active.set(core.active.get() + 1);
    core.metrics.open_connections.inc();
    let _guard = ActiveGuard { core: core.clone() };
    let _permit = permit;
    let state = Rc::new(ConnState::default());
    let mut shutdown = core.shutdown.clone();
    let mut tcp = tcp;
    let mut leftover = Bytes::new();
    // Deadline of a request head that arrived in pieces across parks.
    let mut head_deadline: Option<tokio::time::Instant> = None;
    // Without the lane, hyper serves a new connection at once.
    let mut parked = false;
    loop {
        if core.config.fixed_lane {
            // The lane answers what it can and waits like a parked
            // connection; hyper serves the rest until it parks again.
            match crate::lane::run(&core, &mut tcp, &mut leftover, &mut head_deadline).await {
                crate::lane::LaneEnd::Hyper => {}
                crate::lane::LaneEnd::Close => return,
            }
        } else if parked {
            // The socket alone waits for the next request (or the rest of
            // a partial head), at most until the head deadline.
            let deadline = head_deadline
                .unwrap_or_else(|| tokio::time::Instant::now() + core.config.header_read_timeout);
            let woke = tokio::select! {
                biased;
                // Idle at shutdown: nothing in flight, just close.
                () = shutdown_signalled(&mut shutdown) => false,
                r = tokio::time::timeout_at(deadline, tcp.readable()) => matches!(r, Ok(Ok(()))),
            };
            if !woke {
                return;
            }
        }
        match serve_active(&core, tcp, leftover, &state).await {
            Phase::Parked {
                tcp: t,
                leftover: l,
            } => {
                if l.is_empty() {
                    head_deadline = None;
                } else if head_deadline.is_none() {
                    head_deadline =
                        Some(tokio::time::Instant::now() + core.config.header_read_timeout);
                }
                tcp = t;
                leftover = l;
                parked = true;
            }
            Phase::Closed => return,
        }
    }
}

/// Lets hyper serve the connection until it parks, closes or drains.
async fn serve_active(
    core: &Rc<Core>,
    tcp: TcpStream,
    leftover: Bytes,
    state: &Rc<ConnState>,
) -> Phase {
    state.write_clean.set(true);
    state.read_blocked.set(false);
    let io = TokioIo::new(ConnIo {
        tcp,
        prefix: leftover,
        state: state.clone(),
        core: core.clone(),
        stalled: None,
    });
    let svc = ConnService {
        core: core.clone(),
        state: state.clone(),
    };
    // Boxed, so a parked connection's task does not keep hyper's size.
    let mut conn = Box::new(core.http1.serve_connection(io, svc));
    let park = core.config.park_idle_connections;
    let mut parking = false;
    let mut stopping = false;
    // See `Core::stop_begun`.
    let stop = core.stop.notified();
    tokio::pin!(stop);
    let mut stop_registered = false;
    let res = std::future::poll_fn(|cx| loop {
        if !stopping && core.stop_begun(stop.as_mut(), &mut stop_registered, cx) {
            stopping = true;
            Pin::new(&mut *conn).graceful_shutdown();
        }
        if let Poll::Ready(r) = conn.poll_without_shutdown(cx) {
            return Poll::Ready(r);
        }
        if park && !parking && !stopping && state.is_idle() && idle_long_enough(core, state, cx) {
            // Idle: hyper closes at once, without touching the socket.
            parking = true;
            Pin::new(&mut *conn).graceful_shutdown();
            continue;
        }
        return Poll::Pending;
    })
    .await;
    if let Err(e) = res {
        tracing::debug!(error = %e, "connection closed with an error");
        return Phase::Closed;
    }
    state.idle_mark.set(None);
    let parts = conn.into_parts();
    let mut io = parts.io.into_inner();
    if parking && !stopping {
        core.metrics.parks.inc();
        // hyper's leftover shares its 8 KiB read buffer: keep a copy of the
        // few bytes (a partial head), never the buffer.
        let leftover = if parts.read_buf.is_empty() {
            Bytes::new()
        } else {
            Bytes::copy_from_slice(&parts.read_buf)
        };
        return Phase::Parked {
            tcp: io.tcp,
            leftover,
        };
    }
    // Finished (client closed, `Connection: close`, or drained): send FIN.
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(1),
        tokio::io::AsyncWriteExt::shutdown(&mut io.tcp),
    )
    .await;
    if state.answered_early.get() && !stopping {
        // Boxed: rare, and the connection future stays small (its test).
        Box::pin(linger(core, &mut io.tcp)).await;
    }
    Phase::Closed
}

/// After answering early (a 413 or 400 before the request body was read,
/// a 408) and sending FIN: reads and drops what the client still sends,
/// until it closes or pauses for 2 s, 10 s at most. Closing at once with
/// unread input makes the kernel reset the connection, and a client still
/// sending its body would then see a reset instead of the answer.
async fn linger(core: &Core, tcp: &mut TcpStream) {
    const IDLE: std::time::Duration = std::time::Duration::from_secs(2);
    const TOTAL: std::time::Duration = std::time::Duration::from_secs(10);
    let mut shutdown = core.shutdown.clone();
    let end = tokio::time::Instant::now() + TOTAL;
    // On the heap: the connection future stays small (see its test).
    let mut scratch = vec![0u8; 4096];
    while !*shutdown.borrow() {
        let until = (tokio::time::Instant::now() + IDLE).min(end);
        tokio::select! {
            r = tokio::time::timeout_at(until, tokio::io::AsyncReadExt::read(tcp, &mut scratch)) => match r {
                Ok(Ok(n)) if n > 0 => {}
                // EOF, an error, or the client paused: done.
                _ => return,
            },
            // A shutdown ends it at once.
            _ = shutdown.changed() => return,
        }
    }
}

/// hyper's view of a request: route it, bound it in time, meter it.
struct ConnService {
    core: Rc<Core>,
    state: Rc<ConnState>,
}

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<ConnBody>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn call(&self, req: Request<Incoming>) -> ResponseFuture {
        let start = Instant::now();
        let method = method_label(req.method());
        if !http_body::Body::is_end_stream(req.body()) {
            self.state.had_body.set(true);
        }
        self.state.in_flight.set(self.state.in_flight.get() + 1);
        self.state.served.set(self.state.served.get() + 1);
        let d = self.core.router.dispatch(req.map(RequestBody::incoming));
        let state = match d.response {
            RouteFuture::Ready(r) => State::Ready(Some(r)),
            RouteFuture::Pending(fut) => State::Pending {
                fut,
                deadline: Box::pin(tokio::time::sleep(self.core.config.request_timeout)),
            },
        };
        ResponseFuture {
            state,
            core: self.core.clone(),
            conn: Some(self.state.clone()),
            start,
            route: d.route,
            method,
        }
    }
}

enum State {
    Ready(Option<Response<Body>>),
    Pending {
        fut: router::HandlerFuture,
        deadline: Pin<Box<tokio::time::Sleep>>,
    },
}

pub(crate) struct ResponseFuture {
    state: State,
    core: Rc<Core>,
    /// Moved into the response body, which reports when hyper is done with it.
    conn: Option<Rc<ConnState>>,
    start: Instant,
    route: usize,
    method: &'static str,
}

impl Drop for ResponseFuture {
    fn drop(&mut self) {
        // Dropped before answering (the connection died): not in flight.
        if let Some(c) = self.conn.take() {
            c.in_flight.set(c.in_flight.get() - 1);
        }
    }
}

impl Future for ResponseFuture {
    type Output = Result<Response<ConnBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut resp = match &mut this.state {
            State::Ready(r) => r.take().expect("polled after completion"),
            State::Pending { fut, deadline } => match fut.as_mut().poll(cx) {
                Poll::Ready(r) => r,
                Poll::Pending => {
                    ready!(deadline.as_mut().poll(cx));
                    // The request body may be half read: do not reuse the connection.
                    let mut r = router::text(StatusCode::REQUEST_TIMEOUT, "request timed out\n");
                    r.headers_mut()
                        .insert(CONNECTION, HeaderValue::from_static("close"));
                    r
                }
            },
        };
        let conn = this.conn.take().expect("polled after completion");
        if conn.had_body.get()
            && matches!(
                resp.status(),
                StatusCode::BAD_REQUEST
                    | StatusCode::REQUEST_TIMEOUT
                    | StatusCode::PAYLOAD_TOO_LARGE
            )
        {
            conn.answered_early.set(true);
        }
        // Before the file run is taken: the run is the body's whole range,
        // and the header must announce exactly that.
        router::body_length_wins(&mut resp);
        // Not queued yet: see `ConnBody::run`.
        let run = resp
            .body_mut()
            .take_sendfile_run()
            .map(|(file, offset, remaining)| Run::new(file, offset, remaining));
        let secs = this.start.elapsed().as_secs_f64();
        this.core
            .record(this.route, this.method, resp.status().as_u16(), secs);
        Poll::Ready(Ok(resp.map(|inner| ConnBody { inner, run, conn })))
    }
}

/// A response body that tells its connection when hyper is done with it.
pub(crate) struct ConnBody {
    inner: Body,
    /// The file run behind a sendfile body's placeholders, queued on the
    /// connection at the body's first poll, not when the response is made.
    /// hyper polls only a body it will write: for a `HEAD` request or a
    /// status that cannot carry a body (1xx, 204, 304) it drops the body
    /// unpolled, and a run queued for it would never be consumed: it would
    /// stay in the queue for good and hand its bytes to the next file
    /// response on the connection.
    run: Option<Run>,
    conn: Rc<ConnState>,
}

impl Drop for ConnBody {
    fn drop(&mut self) {
        self.conn.in_flight.set(self.conn.in_flight.get() - 1);
    }
}

impl http_body::Body for ConnBody {
    type Data = Bytes;
    type Error = crate::body::BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        // hyper finishes one response body before it polls the next, so runs
        // are queued in the order their placeholders are written.
        if let Some(run) = self.run.take() {
            self.conn.runs.borrow_mut().push_back(run);
        }
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The socket as hyper sees it: counts bytes and turns sendfile placeholders
/// into `sendfile(2)` calls.
pub(crate) struct ConnIo {
    tcp: TcpStream,
    /// Bytes read before the connection last parked, replayed first.
    prefix: Bytes,
    state: Rc<ConnState>,
    core: Rc<Core>,
    /// Armed when a write finds the socket full, cleared by any progress:
    /// when it fires the write fails (`TimedOut`) and hyper drops the
    /// connection (see `HttpConfig::write_timeout`).
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl ConnIo {
    /// Sends up to `max` bytes of the front file run.
    /// Sends up to `max` bytes of the front file run; `on_disk` says
    /// whether it waits for the file's pages rather than for the client.
    fn poll_sendfile(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
        on_disk: &mut bool,
    ) -> Poll<io::Result<usize>> {
        let mut runs = self.state.runs.borrow_mut();
        let Some(run) = runs.front_mut() else {
            return Poll::Ready(Err(io::Error::other(
                "sendfile placeholder without a file run (a bug in railyard-http)",
            )));
        };
        let want = max.min(usize::try_from(run.remaining).unwrap_or(usize::MAX));
        // `sendfile` reads the file on this thread: the pages it is about to
        // read must be cached first (see `sendfile`).
        let cached = self.poll_cached(run, want as u64, cx);
        // Waiting for the disk is not the client's stall (see `stall`).
        *on_disk = cached.is_pending();
        ready!(cached)?;
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            let mut off = run.offset;
            let res = self.tcp.try_io(Interest::WRITABLE, || {
                rustix::fs::sendfile(&self.tcp, &*run.file, Some(&mut off), want)
                    .map_err(io::Error::from)
            });
            match res {
                Ok(0) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "file shorter than its announced length",
                    )))
                }
                Ok(n) => {
                    run.offset += n as u64;
                    run.remaining -= n as u64;
                    if run.remaining == 0 {
                        runs.pop_front();
                    }
                    self.core.stats.bytes_out.add(n as u64);
                    self.core.metrics.sendfile_bytes.inc_by(n as u64);
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Ready once the pages of `run`'s next `want` bytes are known to be in
    /// the page cache (or cannot be checked): a window found cold is read
    /// on the blocking pool first, and the write waits for it.
    fn poll_cached(&self, run: &mut Run, want: u64, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        use crate::sendfile::{residency, warm, Residency, WARM_SPAN};
        loop {
            if let Some(job) = run.warming.as_mut() {
                let done = ready!(Pin::new(job).poll(cx));
                // Cleared before any error returns: a finished handle must
                // never be polled again.
                run.warming = None;
                let end = done
                    .map_err(|e| io::Error::other(format!("warming a file range failed: {e}")))??;
                run.cached_to = end;
                self.core
                    .warmth
                    .remember(&run.file, run.offset, end, Instant::now());
            }
            if run.offset + want <= run.cached_to {
                return Poll::Ready(Ok(()));
            }
            let end = run.offset + WARM_SPAN.min(run.remaining);
            let now = Instant::now();
            if self.core.warmth.trusted(&run.file, run.offset, end, now) {
                run.cached_to = end;
                continue;
            }
            match residency(&run.file, run.offset, end - run.offset) {
                Residency::Cached => {
                    run.cached_to = end;
                    self.core.warmth.remember(&run.file, run.offset, end, now);
                }
                Residency::Unknown => run.cached_to = end,
                Residency::Cold => {
                    // One of this core's slots for such reads; woken when
                    // one frees.
                    let waiting = run.slot.get_or_insert_with(|| {
                        tokio_util::sync::PollSemaphore::new(self.core.warmth.slots.clone())
                    });
                    let Some(slot) = ready!(waiting.poll_acquire(cx)) else {
                        return Poll::Ready(Err(io::Error::other("the core is shutting down")));
                    };
                    run.slot = None;
                    self.core.metrics.cold_file_reads.inc();
                    run.warming = Some(warm(run.file.clone(), run.offset, end - run.offset, slot));
                }
            }
        }
    }

    fn count_out(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        if let Poll::Ready(Ok(n)) = r {
            self.core.stats.bytes_out.add(n as u64);
        }
        self.stall(cx, r, false)
    }

    /// Arms, clears or fires the write deadline (see `stalled`); `on_disk`:
    /// a pending write waits for a file's pages, not for the client.
    fn stall(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<usize>>,
        on_disk: bool,
    ) -> Poll<io::Result<usize>> {
        match r {
            Poll::Ready(Ok(_)) => self.stalled = None,
            Poll::Pending if on_disk => self.stalled = None,
            Poll::Pending => {
                let timeout = self.core.config.write_timeout;
                let stall = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if stall.as_mut().poll(cx).is_ready() {
                    self.stalled = None;
                    return Poll::Ready(Err(write_timed_out()));
                }
            }
            Poll::Ready(Err(_)) => {}
        }
        r
    }
}

/// The error that ends a connection whose client took nothing within
/// `write_timeout` (the fixed lane's and hyper's writes alike).
pub(crate) fn write_timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the client took nothing within write_timeout",
    )
}

impl AsyncRead for ConnIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix.split_to(n));
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.tcp).poll_read(cx, buf) {
            Poll::Pending => {
                this.state.read_blocked.set(true);
                Poll::Pending
            }
            Poll::Ready(r) => {
                this.state.read_blocked.set(false);
                r?;
                let n = buf.filled().len() - before;
                this.core.stats.bytes_in.add(n as u64);
                Poll::Ready(Ok(()))
            }
        }
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if sendfile::is_placeholder(buf) {
            let mut on_disk = false;
            let r = this.poll_sendfile(cx, buf.len(), &mut on_disk);
            return this.stall(cx, r, on_disk);
        }
        let r = Pin::new(&mut this.tcp).poll_write(cx, buf);
        this.count_out(cx, r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.state.write_clean.set(false);
        if bufs.is_empty() {
            return Poll::Ready(Ok(0));
        }
        // Write the ordinary slices before the first placeholder with one
        // writev; a placeholder at the front becomes one sendfile.
        let cut = bufs
            .iter()
            .position(|b| sendfile::is_placeholder(b))
            .unwrap_or(bufs.len());
        if cut == 0 {
            let mut on_disk = false;
            let r = this.poll_sendfile(cx, bufs[0].len(), &mut on_disk);
            return this.stall(cx, r, on_disk);
        }
        let r = Pin::new(&mut this.tcp).poll_write_vectored(cx, &bufs[..cut]);
        this.count_out(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // hyper flushes the socket only once its own buffer is empty.
        this.state.write_clean.set(true);
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parked connection costs its task (this future) plus the socket:
    /// hyper's state is boxed and dropped while parked. Keep the task small.
    #[tokio::test]
    async fn a_connection_task_stays_small() {
        let (_reg, metrics) = crate::HttpMetrics::standalone();
        let (_tx, rx) = watch::channel(false);
        let core = Rc::new(Core::new(
            Arc::new(crate::Router::new()),
            metrics,
            Arc::new(HttpConfig::default()),
            rx,
        ));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let permit = Arc::new(tokio::sync::Semaphore::new(1))
            .try_acquire_owned()
            .unwrap();
        let task = serve(core, c, permit);
        let size = std::mem::size_of_val(&task);
        assert!(size <= 1024, "the connection future grew to {size} bytes");
        assert!(std::mem::size_of::<ConnState>() <= 128);
    }
}
