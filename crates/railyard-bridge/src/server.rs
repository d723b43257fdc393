//! The listener: accepts connections up to `max_connections`, spawns one
//! task per connection, and shuts down on request.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use railyard_bus::EventBus;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::metrics::BridgeCounters;
use crate::permissions::Permissions;
use crate::{frame, BridgeConfig, BridgeError, BridgeMetricsSnapshot, ConfigError};

/// How long shutdown waits for connection tasks to finish their last flush.
const DRAIN: Duration = Duration::from_secs(5);

/// What every connection task reads.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) bus: EventBus,
    pub(crate) config: BridgeConfig,
    pub(crate) inbound: Permissions,
    pub(crate) outbound: Permissions,
    pub(crate) counters: BridgeCounters,
}

/// A bridge between TCP clients and an [`EventBus`]. Cheap to clone.
///
/// Build it with [`BridgeServer::new`], then either [`start`](Self::start)
/// it (bind from the config and run in the background) or drive
/// [`run`](Self::run) on a listener you bound.
#[derive(Debug, Clone)]
pub struct BridgeServer {
    shared: Arc<Shared>,
}

impl BridgeServer {
    /// Validates `config` (regexes compile, limits and timeouts are at least 1).
    ///
    /// # Errors
    /// [`ConfigError`] naming the bad field.
    pub fn new(bus: EventBus, config: BridgeConfig) -> Result<Self, ConfigError> {
        for (field, v) in [
            ("max_frame_size", config.max_frame_size),
            ("max_headers", config.max_headers),
            ("max_registrations", config.max_registrations),
            ("registration_capacity", config.registration_capacity),
            ("max_pending_requests", config.max_pending_requests),
            ("max_pending_replies", config.max_pending_replies),
            ("outbound_queue_bytes", config.outbound_queue_bytes),
            ("max_connections", config.max_connections),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        for (field, d) in [
            ("frame_timeout", Some(config.frame_timeout)),
            ("idle_timeout", config.idle_timeout),
            ("reply_timeout", Some(config.reply_timeout)),
        ] {
            if d.is_some_and(|d| d.is_zero()) {
                return Err(ConfigError::ZeroTimeout { field });
            }
        }
        let inbound = Permissions::compile(&config.inbound_permitted, "inbound_permitted")?;
        let outbound = Permissions::compile(&config.outbound_permitted, "outbound_permitted")?;
        Ok(Self {
            shared: Arc::new(Shared {
                bus,
                config,
                inbound,
                outbound,
                counters: BridgeCounters::default(),
            }),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &BridgeConfig {
        &self.shared.config
    }

    /// The counters now.
    pub fn metrics(&self) -> BridgeMetricsSnapshot {
        self.shared.counters.snapshot()
    }

    /// Binds `host:port` from the config and runs in a background task.
    ///
    /// # Errors
    /// [`BridgeError::Bind`] if the address cannot be bound.
    pub async fn start(self) -> Result<RunningBridge, BridgeError> {
        let addr = format!("{}:{}", self.shared.config.host, self.shared.config.port);
        let listener = TcpListener::bind(&addr)
            .await
            .map_err(|source| BridgeError::Bind {
                addr: addr.clone(),
                source,
            })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| BridgeError::Bind { addr, source })?;
        let stop = CancellationToken::new();
        let server = self.clone();
        let token = stop.clone();
        let task = tokio::spawn(async move { server.run(listener, token.cancelled_owned()).await });
        Ok(RunningBridge {
            server: self,
            local_addr,
            stop,
            task,
        })
    }

    /// Accepts and serves connections until `shutdown` resolves, then closes
    /// every connection (each flushes what it has queued, within 1 s) and
    /// returns once they are gone (at most ~5 s).
    pub async fn run(&self, listener: TcpListener, shutdown: impl Future<Output = ()>) {
        let max = self.shared.config.max_connections;
        let slots = Arc::new(Semaphore::new(max));
        let stop = CancellationToken::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => self.admit(stream, peer, &slots, &stop),
                    Err(e) => {
                        // Usually EMFILE/ENFILE: back off instead of spinning.
                        tracing::warn!(error = %e, "bridge accept failed; retrying in 100 ms");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
        stop.cancel();
        drop(listener);
        let all = u32::try_from(max).unwrap_or(u32::MAX);
        if tokio::time::timeout(DRAIN, slots.acquire_many(all))
            .await
            .is_err()
        {
            tracing::warn!("bridge connections still closing after 5 s; leaving them");
        }
    }

    fn admit(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        slots: &Arc<Semaphore>,
        stop: &CancellationToken,
    ) {
        self.shared
            .counters
            .connections_accepted
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            self.shared
                .counters
                .connections_refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut out = bytes::BytesMut::new();
            frame::put_err(&mut out, "too_many_connections");
            // Best effort: a fresh socket's send buffer takes a few bytes.
            let _ = stream.try_write(&out);
            tracing::warn!(%peer, max = self.shared.config.max_connections, "bridge connection refused: too many connections");
            return;
        };
        // Small frames, request/reply: do not wait to coalesce (Vert.x's default too).
        let _ = stream.set_nodelay(true);
        let shared = self.shared.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            crate::connection::serve(stream, &shared, &stop).await;
            drop(permit);
        });
    }
}

/// A bridge running in the background; see [`BridgeServer::start`].
#[derive(Debug)]
pub struct RunningBridge {
    server: BridgeServer,
    local_addr: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl RunningBridge {
    /// The address it listens on (with the real port when `port = 0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The counters now.
    pub fn metrics(&self) -> BridgeMetricsSnapshot {
        self.server.metrics()
    }

    /// The server, e.g. for its config.
    pub fn server(&self) -> &BridgeServer {
        &self.server
    }

    /// Stops accepting, closes every connection and waits for them.
    pub async fn shutdown(self) {
        self.stop.cancel();
        // Join errors only mean the runtime is shutting down.
        let _ = self.task.await;
    }
}
