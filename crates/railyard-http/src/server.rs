//! Listeners, per-core event loops, the accept loop and graceful shutdown.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::sync::{oneshot, watch, Semaphore};

use crate::config::{ConfigError, HttpConfig};
use crate::conn::{self, Core};
use crate::metrics::HttpMetrics;
use crate::router::Router;

/// Why the server could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The configuration cannot work.
    #[error("invalid HTTP configuration: {0}")]
    Config(#[from] ConfigError),
    /// A listener could not be opened.
    #[error(
        "cannot listen on {addr}: {source}; is the port in use? choose another (railyard node: --http-port for HTTP, --admin-port for metrics)"
    )]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
    /// No listener was given to [`Server::run`].
    #[error("no listeners to serve; open them with railyard_http::bind")]
    NoListeners,
    /// An event-loop thread or its runtime could not start.
    #[error("cannot start an HTTP event loop: {0}")]
    Runtime(io::Error),
}

/// Opens `count` listeners on `addr` sharing the port with `SO_REUSEPORT`, so
/// the kernel spreads connections over the cores. Port 0 picks a free port
/// (the same for all of them).
///
/// # Errors
/// [`HttpError::Bind`].
pub fn bind(
    addr: SocketAddr,
    count: usize,
    config: &HttpConfig,
) -> Result<Vec<std::net::TcpListener>, HttpError> {
    // SO_REUSEPORT lets a second server of the same user share a port
    // silently. A probe bound without it fails if anything listens there.
    if addr.port() != 0 {
        probe(addr).map_err(|source| HttpError::Bind { addr, source })?;
    }
    let mut out: Vec<std::net::TcpListener> = Vec::with_capacity(count.max(1));
    let mut at = addr;
    for _ in 0..count.max(1) {
        let l = listener(at, config).map_err(|source| HttpError::Bind { addr: at, source })?;
        if let Ok(local) = l.local_addr() {
            at = local;
        }
        out.push(l);
    }
    Ok(out)
}

/// Binds (without `SO_REUSEPORT`) and closes: fails when the port is taken.
fn probe(addr: SocketAddr) -> io::Result<()> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    s.bind(&addr.into())
}

fn listener(addr: SocketAddr, config: &HttpConfig) -> io::Result<std::net::TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_nonblocking(true)?;
    s.set_tcp_nodelay(true)?;
    if config.tcp_fastopen_queue > 0 {
        if let Err(e) = set_tcp_fastopen(&s, config.tcp_fastopen_queue) {
            tracing::debug!(error = %e, "tcp fast open unavailable");
        }
    }
    s.bind(&addr.into())?;
    s.listen(config.backlog)?;
    Ok(s.into())
}

fn set_tcp_fastopen(s: &Socket, qlen: u32) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let v = libc::c_int::try_from(qlen).unwrap_or(libc::c_int::MAX);
    // Safety: the fd is open for the lifetime of `s`; the pointer and length
    // describe `v`, a live c_int, as TCP_FASTOPEN expects.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_FASTOPEN,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// How shutdown went.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Event loops that ran.
    pub cores: usize,
    /// Connections still open at the deadline, dropped mid-request.
    pub aborted_connections: usize,
}

/// An HTTP server: a router, limits and metrics. See [`Server::run`].
pub struct Server {
    router: Arc<Router>,
    config: Arc<HttpConfig>,
    metrics: Arc<HttpMetrics>,
}

impl Server {
    /// A server for `router`.
    ///
    /// # Errors
    /// [`HttpError::Config`] when `config` cannot work.
    pub fn new(
        router: Router,
        config: HttpConfig,
        metrics: Arc<HttpMetrics>,
    ) -> Result<Self, HttpError> {
        config.validate()?;
        Ok(Self {
            router: Arc::new(router),
            config: Arc::new(config),
            metrics,
        })
    }

    /// Serves `listeners`, one event-loop thread each, until `shutdown`
    /// resolves; then stops accepting, lets in-flight requests finish (idle
    /// keep-alive connections close at once) and returns when every
    /// connection is closed or `shutdown_deadline` has passed.
    ///
    /// The listeners are open before this is called, so clients may connect
    /// as soon as [`bind`] returns.
    ///
    /// # Errors
    /// [`HttpError::NoListeners`], [`HttpError::Runtime`].
    pub async fn run(
        self,
        listeners: Vec<std::net::TcpListener>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ShutdownReport, HttpError> {
        if listeners.is_empty() {
            return Err(HttpError::NoListeners);
        }
        let (stop_tx, stop_rx) = watch::channel(false);
        let permits = Arc::new(Semaphore::new(self.config.max_connections));
        let mut done = Vec::with_capacity(listeners.len());
        let mut started = Vec::with_capacity(listeners.len());
        for (i, l) in listeners.into_iter().enumerate() {
            let (start_tx, start_rx) = oneshot::channel::<io::Result<()>>();
            let (done_tx, done_rx) = oneshot::channel::<usize>();
            let router = self.router.clone();
            let metrics = self.metrics.clone();
            let config = self.config.clone();
            let stop = stop_rx.clone();
            let permits = permits.clone();
            std::thread::Builder::new()
                .name(format!("railyard-http-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = start_tx.send(Err(e));
                            return;
                        }
                    };
                    let local = tokio::task::LocalSet::new();
                    let aborted = local.block_on(&rt, async move {
                        let listener = match tokio::net::TcpListener::from_std(l) {
                            Ok(l) => l,
                            Err(e) => {
                                let _ = start_tx.send(Err(e));
                                return 0;
                            }
                        };
                        let _ = start_tx.send(Ok(()));
                        let core = Rc::new(Core::new(router, metrics, config, stop));
                        accept_loop(core, listener, permits).await
                    });
                    // Dropping the LocalSet drops connections past the deadline.
                    drop(local);
                    drop(rt);
                    let _ = done_tx.send(aborted);
                })
                .map_err(HttpError::Runtime)?;
            started.push(start_rx);
            done.push(done_rx);
        }
        for s in started {
            match s.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    let _ = stop_tx.send(true);
                    return Err(HttpError::Runtime(e));
                }
                Err(_) => {
                    let _ = stop_tx.send(true);
                    return Err(HttpError::Runtime(io::Error::other(
                        "an event-loop thread ended while starting",
                    )));
                }
            }
        }
        shutdown.await;
        tracing::info!("http server draining");
        let _ = stop_tx.send(true);
        let mut report = ShutdownReport::default();
        for d in done {
            report.cores += 1;
            report.aborted_connections += d.await.unwrap_or(0);
        }
        Ok(report)
    }
}

/// Accepts until shutdown, then waits for this core's connections to close
/// (bounded by the deadline). Returns how many were still open then.
async fn accept_loop(
    core: Rc<Core>,
    listener: tokio::net::TcpListener,
    permits: Arc<Semaphore>,
) -> usize {
    let mut stop = core.shutdown.clone();
    let ticker = (core.config.park_idle_connections && !core.config.park_idle_after.is_zero())
        .then(|| {
            let core = core.clone();
            tokio::task::spawn_local(async move {
                let mut every = tokio::time::interval(core.config.park_idle_after);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut stop = core.shutdown.clone();
                loop {
                    tokio::select! {
                        () = conn::shutdown_signalled(&mut stop) => break,
                        _ = every.tick() => core.park_tick(),
                    }
                }
            })
        });
    loop {
        // Accept first, then wait for a permit: a core never holds a permit
        // while its own listener is empty, so a connection on any core gets
        // the next free permit. At most one accepted connection per core
        // waits for a permit; the rest wait in the kernel's backlog.
        let accepted = tokio::select! {
            biased;
            () = conn::shutdown_signalled(&mut stop) => break,
            r = listener.accept() => r,
        };
        let tcp = match accepted {
            Ok((tcp, _peer)) => tcp,
            Err(e) => {
                // Out of descriptors or memory: back off instead of spinning;
                // anything else concerns one connection only.
                let exhausted = matches!(
                    e.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                );
                tracing::warn!(error = %e, "accept failed");
                if exhausted {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                continue;
            }
        };
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => tokio::select! {
                biased;
                () = conn::shutdown_signalled(&mut stop) => break,
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break, // never closed
                },
            },
        };
        core.metrics.accepted.inc();
        let _ = tcp.set_nodelay(true);
        let _ = SockRef::from(&tcp).set_tcp_quickack(true);
        tokio::task::spawn_local(conn::serve(core.clone(), tcp, permit));
    }
    drop(listener);
    core.begin_stopping();
    if let Some(t) = ticker {
        t.abort();
    }
    let deadline = tokio::time::sleep(core.config.shutdown_deadline);
    tokio::pin!(deadline);
    loop {
        let idle = core.idle.notified();
        if core.active.get() == 0 {
            return 0;
        }
        tokio::select! {
            () = idle => {}
            () = &mut deadline => {
                let left = core.active.get();
                tracing::warn!(connections = left, "shutdown deadline passed; dropping connections");
                return left;
            }
        }
    }
}
