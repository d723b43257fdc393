//! The client handle, its builder, and the path an event takes to the
//! session task.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prost::Message;
use railyard_saga_proto::native::{EventType, SagaEvent};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore, TryAcquireError};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use crate::compensation::{Compensation, Registry};
use crate::error::{EventKindName, SagaError};
use crate::session::Session;
use crate::MAX_EVENT_BYTES;

/// The transport settings of every connection to the coordinator.
fn endpoint(text: &str, connect_timeout: Duration) -> Result<Endpoint, SagaError> {
    Ok(Endpoint::from_shared(text.to_owned())
        .map_err(|e| SagaError::InvalidConfig(format!("endpoint `{text}`: {e}")))?
        .tcp_nodelay(true)
        .connect_timeout(connect_timeout)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20)))
}

/// One HTTP/2 connection to the coordinator for several clients of a
/// process (see [`ClientBuilder::connection`]); cheap to clone.
///
/// ```no_run
/// # async fn f() -> Result<(), railyard_saga_client::SagaError> {
/// use railyard_saga_client::{Connection, SagaClient};
/// let conn = Connection::open("http://127.0.0.1:8090").await?;
/// let orders = SagaClient::builder("http://127.0.0.1:8090", "orders")
///     .connection(&conn)
///     .connect()
///     .await?;
/// let payments = SagaClient::builder("http://127.0.0.1:8090", "payments")
///     .connection(&conn)
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Connection {
    channel: Channel,
}

impl Connection {
    /// Connects to the coordinator at `endpoint` (e.g. `http://127.0.0.1:8090`).
    ///
    /// # Errors
    /// [`SagaError::InvalidConfig`] for a malformed endpoint,
    /// [`SagaError::Connect`] if it cannot be reached within 5 s.
    pub async fn open(endpoint_text: impl Into<String>) -> Result<Self, SagaError> {
        let text = endpoint_text.into();
        let channel = endpoint(&text, Duration::from_secs(5))?
            .connect()
            .await
            .map_err(|e| SagaError::Connect {
                endpoint: text.clone(),
                reason: crate::session::error_chain(&e),
            })?;
        Ok(Self { channel })
    }
}

/// Tuning and identity of a client; see [`ClientBuilder`].
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) endpoint: Endpoint,
    /// A connection shared with other clients ([`ClientBuilder::connection`]);
    /// `None`: the session makes its own from `endpoint`.
    pub(crate) shared: Option<Channel>,
    pub(crate) endpoint_text: String,
    /// The session's participant instances, `(service, instance)`, by
    /// number: 0 is the builder's own, then each [`ClientBuilder::participant`].
    pub(crate) participants: Vec<(String, String)>,
    pub(crate) token: String,
    pub(crate) max_batch_events: usize,
    pub(crate) max_in_flight_events: usize,
    pub(crate) max_batches_in_flight: usize,
    pub(crate) max_concurrent_compensations: usize,
    pub(crate) backoff_initial: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) connect_timeout: Duration,
}

/// Builds a [`SagaClient`]: who the participant is, where the coordinator
/// is, how much may be in flight, and the compensation handlers.
///
/// ```no_run
/// # async fn f() -> Result<(), railyard_saga_client::SagaError> {
/// use railyard_saga_client::{ClientBuilder, CompensationError};
/// let client = ClientBuilder::new("http://127.0.0.1:8090", "orders")
///     .compensation("cancel-order", |c| async move {
///         println!("cancelling {}", c.local_tx_id);
///         Ok::<(), CompensationError>(())
///     })
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
pub struct ClientBuilder {
    endpoint: String,
    service_name: String,
    instance_id: Option<String>,
    token: String,
    max_batch_events: usize,
    max_in_flight_events: usize,
    max_batches_in_flight: usize,
    max_concurrent_compensations: usize,
    backoff_initial: Duration,
    backoff_max: Duration,
    connect_timeout: Duration,
    shared: Option<Channel>,
    registry: Registry,
    others: Vec<Participant>,
}

/// Another participant instance sharing a client's session: a service this
/// process also hosts (see [`ClientBuilder::participant`]).
///
/// ```no_run
/// # async fn f() -> Result<(), railyard_saga_client::SagaError> {
/// use railyard_saga_client::{CompensationError, Participant, SagaClient};
/// let clients = SagaClient::builder("http://127.0.0.1:8090", "orders")
///     .participant(Participant::new("payments").compensation("refund", |c| async move {
///         println!("refunding {}", c.local_tx_id);
///         Ok::<(), CompensationError>(())
///     }))
///     .connect_all()
///     .await?;
/// let (orders, payments) = (&clients[0], &clients[1]);
/// # Ok(()) }
/// ```
pub struct Participant {
    service_name: String,
    instance_id: Option<String>,
    registry: Registry,
}

impl fmt::Debug for Participant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Participant")
            .field("service_name", &self.service_name)
            .field("instance_id", &self.instance_id)
            .field("handlers", &self.registry)
            .finish()
    }
}

impl Participant {
    /// A participant instance of the service `service_name`.
    pub fn new(service_name: impl Into<String>) -> Self {
        Self {
            service_name: service_name.into(),
            instance_id: None,
            registry: Registry::default(),
        }
    }

    /// Its instance id (default: `<service>-<random hex>`); as
    /// [`ClientBuilder::instance_id`].
    pub fn instance_id(mut self, id: impl Into<String>) -> Self {
        self.instance_id = Some(id.into());
        self
    }

    /// Registers a compensation handler for this participant; as
    /// [`ClientBuilder::compensation`]. Commands for a participant run only
    /// its own handlers.
    pub fn compensation<F, Fut, E>(
        mut self,
        compensation_method: impl Into<String>,
        handler: F,
    ) -> Self
    where
        F: Fn(Compensation) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: fmt::Display,
    {
        self.registry.insert(compensation_method.into(), handler);
        self
    }
}

impl fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientBuilder")
            .field("endpoint", &self.endpoint)
            .field("service_name", &self.service_name)
            .field("instance_id", &self.instance_id)
            .field("max_batch_events", &self.max_batch_events)
            .field("max_in_flight_events", &self.max_in_flight_events)
            .field("handlers", &self.registry)
            .field("others", &self.others)
            .finish_non_exhaustive()
    }
}

impl ClientBuilder {
    /// A client of the coordinator at `endpoint` (e.g.
    /// `http://127.0.0.1:8090`) for the service `service_name`.
    pub fn new(endpoint: impl Into<String>, service_name: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            service_name: service_name.into(),
            instance_id: None,
            token: String::new(),
            max_batch_events: 1024,
            max_in_flight_events: 16_384,
            max_batches_in_flight: usize::MAX,
            max_concurrent_compensations: 256,
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            shared: None,
            registry: Registry::default(),
            others: Vec::new(),
        }
    }

    /// This instance's id (default: `<service>-<random hex>`). A new id is a
    /// new instance to the coordinator: reuse the old one after a restart to
    /// take over its pending compensations at once.
    pub fn instance_id(mut self, id: impl Into<String>) -> Self {
        self.instance_id = Some(id.into());
        self
    }

    /// The shared token, when the coordinator is configured with one.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = token.into();
        self
    }

    /// Most events in one batch frame (default 1024). A batch goes out as
    /// soon as the previous one was handed to the transport, with whatever
    /// has been queued meanwhile, up to this many.
    pub fn max_batch_events(mut self, n: usize) -> Self {
        self.max_batch_events = n;
        self
    }

    /// Most events reported and not yet acknowledged (default 16384). When
    /// reached, reporting an event waits (back-pressure) until acks free room.
    pub fn max_in_flight_events(mut self, n: usize) -> Self {
        self.max_in_flight_events = n;
        self
    }

    /// Most batches sent and not yet acknowledged (default: no limit beyond
    /// [`max_in_flight_events`](Self::max_in_flight_events)). A small number
    /// (1 or 2) makes events wait for an ack before the next batch leaves:
    /// larger batches, fewer appends at the coordinator, one round trip more
    /// of latency.
    pub fn max_batches_in_flight(mut self, n: usize) -> Self {
        self.max_batches_in_flight = n;
        self
    }

    /// Most compensation handlers running at once (default 256); as many
    /// more commands wait for a free slot, and commands beyond those are
    /// dropped unanswered (counted in [`ClientStats::compensations_dropped`]):
    /// the coordinator counts the unanswered attempt as failed once the
    /// step's reverse timeout passes and sends it again (within the step's
    /// `reverse_retries`), so a burst costs time and attempts, not memory: a
    /// step whose attempts all go unanswered ends its saga `FAILED`.
    pub fn max_concurrent_compensations(mut self, n: usize) -> Self {
        self.max_concurrent_compensations = n;
        self
    }

    /// Reconnection backoff: the first delay, doubled after each failed
    /// attempt (with jitter) up to `max` (defaults 50 ms and 5 s).
    pub fn reconnect_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.backoff_initial = initial;
        self.backoff_max = max;
        self
    }

    /// How long one connection attempt may take (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Opens this client's session over `connection`, shared with the other
    /// clients of this process (each session is one HTTP/2 stream on it),
    /// instead of over a connection of its own. Their frames then share
    /// socket reads and writes: the native saga bench, 4 clients per
    /// simulated process, went from 16 connections to 4 (docs/saga-client.md).
    /// The connection reconnects by itself; the sessions on it resend as
    /// after any disconnection. The builder's endpoint is still the one
    /// named in errors.
    pub fn connection(mut self, connection: &Connection) -> Self {
        self.shared = Some(connection.channel.clone());
        self
    }

    /// Adds another participant instance to this client's session: a
    /// process hosting several services reports for all of them on one
    /// stream, so the events of all their concurrent sagas share frames and
    /// acknowledgements (what that saves is measured in docs/benchmarks.md,
    /// "One session per process"). Connect with
    /// [`connect_all`](Self::connect_all), which returns one handle per
    /// participant. They share everything this builder sets: the session
    /// and its connection, the token, the batch and in-flight limits (one
    /// budget for all), the compensation slots and the outbound queue (a
    /// burst of one participant's commands can crowd out another's), the
    /// counters ([`SagaClient::stats`]) and [`SagaClient::close`]. The
    /// session lasts until `close` or until every handle of every
    /// participant is dropped: dropping one participant's handles does not
    /// unregister it. At most 64 participants per session, each
    /// `(service, instance)` once, and the coordinator must say it takes
    /// them (its `Welcome`): one that does not is refused
    /// ([`SagaError::Refused`], `UNIMPLEMENTED`) rather than let it record
    /// every event as the first participant's.
    pub fn participant(mut self, participant: Participant) -> Self {
        self.others.push(participant);
        self
    }

    /// Registers the handler run for compensation commands naming
    /// `compensation_method`. It gets the step's payload back byte for byte;
    /// `Ok` reports `TX_COMPENSATED`, `Err` reports `TX_COMPENSATE_FAILED`
    /// (the coordinator retries). Handlers must be idempotent: a command can
    /// come again after a reconnection or a retry.
    pub fn compensation<F, Fut, E>(
        mut self,
        compensation_method: impl Into<String>,
        handler: F,
    ) -> Self
    where
        F: Fn(Compensation) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: fmt::Display,
    {
        self.registry.insert(compensation_method.into(), handler);
        self
    }

    /// Validates the settings, opens the session (waiting for the first
    /// connection) and starts the client's session task on the current tokio
    /// runtime. Later disconnections are repaired by the task, with backoff.
    ///
    /// # Errors
    /// [`SagaError::InvalidConfig`] for bad settings, [`SagaError::Connect`]
    /// if the first connection fails, [`SagaError::Refused`] if the
    /// coordinator refuses the session.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub async fn connect(self) -> Result<SagaClient, SagaError> {
        if !self.others.is_empty() {
            return Err(SagaError::InvalidConfig(format!(
                "{} more participants were added to this session; connect with connect_all to get a handle for each",
                self.others.len()
            )));
        }
        let mut clients = self.connect_all().await?;
        Ok(clients.swap_remove(0))
    }

    /// As [`connect`](Self::connect), for a session with more participants
    /// ([`participant`](Self::participant)): one handle per participant,
    /// this builder's own first, then the others in the order added.
    ///
    /// # Errors
    /// As [`connect`](Self::connect); [`SagaError::InvalidConfig`] also for
    /// more than 64 participants, an empty service name, or the same
    /// service and instance id twice.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub async fn connect_all(self) -> Result<Vec<SagaClient>, SagaError> {
        let count = 1 + self.others.len();
        if count > railyard_saga_proto::MAX_SESSION_PARTICIPANTS {
            return Err(SagaError::InvalidConfig(format!(
                "{count} participants in one session; at most {}: open another client for the rest",
                railyard_saga_proto::MAX_SESSION_PARTICIPANTS
            )));
        }
        if self.service_name.is_empty() {
            return Err(SagaError::InvalidConfig(
                "the service name must not be empty".into(),
            ));
        }
        if let Some(k) = self.others.iter().position(|p| p.service_name.is_empty()) {
            return Err(SagaError::InvalidConfig(format!(
                "the service name of participant {} (the builder's own is 0, those added with ClientBuilder::participant 1 and up) must not be empty",
                k + 1
            )));
        }
        if self.max_batch_events == 0
            || self.max_in_flight_events == 0
            || self.max_batches_in_flight == 0
            || self.max_concurrent_compensations == 0
        {
            return Err(SagaError::InvalidConfig(
                "max_batch_events, max_in_flight_events, max_batches_in_flight and max_concurrent_compensations must be at least 1"
                    .into(),
            ));
        }
        if self.backoff_initial.is_zero() || self.backoff_max < self.backoff_initial {
            return Err(SagaError::InvalidConfig(
                "the reconnect backoff must be positive, and its maximum at least its initial delay"
                    .into(),
            ));
        }
        let endpoint = endpoint(&self.endpoint, self.connect_timeout)?;
        let own = Participant {
            service_name: self.service_name,
            instance_id: self.instance_id,
            registry: self.registry,
        };
        let mut participants = Vec::with_capacity(count);
        let mut registries = Vec::with_capacity(count);
        for p in std::iter::once(own).chain(self.others) {
            let instance_id = p
                .instance_id
                .unwrap_or_else(|| format!("{}-{:08x}", p.service_name, random_u64() as u32));
            if participants
                .iter()
                .any(|(s, i)| *s == p.service_name && *i == instance_id)
            {
                return Err(SagaError::InvalidConfig(format!(
                    "service `{}` instance `{instance_id}` is in this session twice; give each participant its own instance id",
                    p.service_name
                )));
            }
            participants.push((p.service_name, instance_id));
            registries.push(p.registry);
        }
        let settings = Arc::new(Settings {
            endpoint,
            shared: self.shared,
            endpoint_text: self.endpoint,
            participants,
            token: self.token,
            max_batch_events: self.max_batch_events,
            max_in_flight_events: self.max_in_flight_events,
            max_batches_in_flight: self.max_batches_in_flight,
            max_concurrent_compensations: self.max_concurrent_compensations,
            backoff_initial: self.backoff_initial,
            backoff_max: self.backoff_max,
            connect_timeout: self.connect_timeout,
        });
        // The channel never holds more than the semaphore lets in, so a
        // `send` on it never waits long; the semaphore is the back-pressure.
        let (submit_tx, submit_rx) = mpsc::channel(settings.max_in_flight_events);
        let stop = CancellationToken::new();
        let reporter = Reporter {
            tx: submit_tx.clone(),
            in_flight: Arc::new(Semaphore::new(settings.max_in_flight_events)),
            closed: Arc::new(OnceLock::new()),
            participant: 0,
        };
        let stats = Arc::new(StatsCounters::default());
        let meta = Arc::new(RwLock::new(HashMap::new()));
        let clients = (0..count as u32)
            .map(|participant| SagaClient {
                shared: Arc::new(Shared {
                    reporter: Reporter {
                        participant,
                        ..reporter.clone()
                    },
                    stats: stats.clone(),
                    meta: meta.clone(),
                    id_prefix: format!("{:016x}", random_u64()),
                    next_id: AtomicU64::new(1),
                    settings: settings.clone(),
                    stop: stop.clone(),
                }),
            })
            .collect();
        let (first_tx, first_rx) = oneshot::channel();
        // The session holds no sender of its own: once every handle is
        // gone, its queue ends and so does the session.
        let session = Session::new(
            settings,
            submit_rx,
            submit_tx.downgrade(),
            reporter.in_flight.clone(),
            reporter.closed.clone(),
            registries,
            stats,
            meta,
            stop,
        );
        drop((submit_tx, reporter));
        tokio::spawn(session.run(first_tx));
        match first_rx.await {
            Ok(Ok(())) => Ok(clients),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(SagaError::Closed(Some(
                "the session task ended before connecting".into(),
            ))),
        }
    }
}

/// 64 bits from the standard library's per-process random keys, mixed with
/// the clock: enough to keep ids of concurrent processes apart.
fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    h.finish()
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Counters the session task keeps; read with [`SagaClient::stats`].
#[derive(Debug, Default)]
pub(crate) struct StatsCounters {
    pub(crate) batches: AtomicU64,
    pub(crate) events: AtomicU64,
    pub(crate) acked: AtomicU64,
    pub(crate) resent: AtomicU64,
    pub(crate) sessions: AtomicU64,
    pub(crate) compensations: AtomicU64,
    pub(crate) compensations_dropped: AtomicU64,
    pub(crate) compensations_joined: AtomicU64,
    pub(crate) compensation_reports_failed: AtomicU64,
}

/// A snapshot of a client's counters: those of its session, which the
/// participants of one session ([`ClientBuilder::participant`]) share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClientStats {
    /// Batch frames sent (resends included).
    pub batches: u64,
    /// Events sent (resends included).
    pub events: u64,
    /// Events acknowledged.
    pub acked: u64,
    /// Events sent again after a reconnection.
    pub resent: u64,
    /// Sessions opened (1 + reconnections).
    pub sessions: u64,
    /// Compensation commands received.
    pub compensations: u64,
    /// Compensation commands dropped unanswered because the client already
    /// held twice [`ClientBuilder::max_concurrent_compensations`] (running
    /// or waiting); the coordinator sends each again after its reverse
    /// timeout.
    pub compensations_dropped: u64,
    /// Compensation commands that found the same compensation still held
    /// (the coordinator's next attempt, sent when the first outlived its
    /// reverse timeout): they join it instead of running the handler a
    /// second time alongside, and its result answers the latest attempt.
    pub compensations_joined: u64,
    /// Events reported and not yet answered (queued, sent or being resent).
    pub in_flight: u64,
    /// Compensation results (`TX_COMPENSATED` or `TX_COMPENSATE_FAILED`,
    /// reported after a handler ran) that the coordinator refused or that
    /// could not be sent (the client closed): the coordinator did not record
    /// them, and sends the command again after its reverse timeout while the
    /// client lives.
    pub compensation_reports_failed: u64,
}

/// One event on its way: the event, its encoded size, and who waits for
/// its ack.
pub(crate) struct Submit {
    pub(crate) event: SagaEvent,
    pub(crate) size: usize,
    pub(crate) waiter: Waiter,
}

impl Submit {
    /// The event with its waiter, and the receiver of its answer.
    fn new(
        event: SagaEvent,
        size: usize,
        permit: OwnedSemaphorePermit,
    ) -> (Self, oneshot::Receiver<Result<Outcome, SagaError>>) {
        let (reply, rx) = oneshot::channel();
        let submit = Self {
            event,
            size,
            waiter: Waiter { reply, permit },
        };
        (submit, rx)
    }
}

/// Who waits for one event's answer, and its share of the in-flight budget
/// (returned when this is dropped, or merged with the rest of its batch's
/// when the ack comes). Kept apart from the event once it is sent, the
/// events being shared with the frame.
pub(crate) struct Waiter {
    pub(crate) reply: oneshot::Sender<Result<Outcome, SagaError>>,
    pub(crate) permit: OwnedSemaphorePermit,
}

/// What the coordinator answered for an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Outcome {
    /// The saga is aborted.
    pub(crate) aborted: bool,
}

/// The path into the session task: the in-flight budget, then the queue.
#[derive(Clone)]
pub(crate) struct Reporter {
    pub(crate) tx: mpsc::Sender<Submit>,
    pub(crate) in_flight: Arc<Semaphore>,
    /// Set once, when the client closes for good: the reason.
    pub(crate) closed: Arc<OnceLock<String>>,
    /// Which participant of the session reports through this path.
    pub(crate) participant: u32,
}

impl Reporter {
    fn closed_error(&self) -> SagaError {
        SagaError::Closed(self.closed.get().cloned())
    }

    /// Queues `event` and returns the future of its acknowledgement.
    ///
    /// When the in-flight budget and the session's queue have room (the
    /// usual case) the event is queued by this call and the future only
    /// holds the answer's receiver: a few words, so the saga futures that
    /// await it stay small and cheap to move. Otherwise the future waits
    /// for room first (boxed: off the common path).
    ///
    /// # Cancel safety
    /// Dropping the future before the event was queued reports nothing;
    /// after, the event is still delivered (and acknowledged) but nobody
    /// hears about it.
    pub(crate) fn report(&self, mut event: SagaEvent) -> Reply<'_> {
        event.participant = self.participant;
        let size = event.encoded_len();
        if size > MAX_EVENT_BYTES {
            return Reply::failed(SagaError::TooLarge {
                kind: kind_name(event.r#type),
                global_tx_id: event.global_tx_id,
                bytes: size,
                limit: MAX_EVENT_BYTES,
            });
        }
        let permit = match self.in_flight.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(TryAcquireError::NoPermits) => {
                return Reply::waiting(Box::pin(self.report_when_room(event, size)));
            }
            Err(TryAcquireError::Closed) => return Reply::failed(self.closed_error()),
        };
        let (submit, rx) = Submit::new(event, size, permit);
        match self.tx.try_send(submit) {
            Ok(()) => Reply::queued(self, rx),
            Err(TrySendError::Full(submit)) => {
                Reply::waiting(Box::pin(self.queue_when_room(submit, rx)))
            }
            Err(TrySendError::Closed(_)) => Reply::failed(self.closed_error()),
        }
    }

    /// [`report`](Self::report) when the in-flight budget is spent.
    async fn report_when_room(&self, event: SagaEvent, size: usize) -> Result<Outcome, SagaError> {
        let permit = self
            .in_flight
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| self.closed_error())?;
        let (submit, rx) = Submit::new(event, size, permit);
        self.queue_when_room(submit, rx).await
    }

    /// [`report`](Self::report) when the session's queue is full.
    async fn queue_when_room(
        &self,
        submit: Submit,
        rx: oneshot::Receiver<Result<Outcome, SagaError>>,
    ) -> Result<Outcome, SagaError> {
        self.tx
            .send(submit)
            .await
            .map_err(|_| self.closed_error())?;
        rx.await.map_err(|_| self.closed_error())?
    }
}

/// The acknowledgement of one reported event: see [`Reporter::report`].
#[must_use = "the event may be queued, but its answer is only known by awaiting this"]
pub(crate) struct Reply<'a>(ReplyState<'a>);

enum ReplyState<'a> {
    /// Queued: the session answers through `rx`.
    Queued {
        reporter: &'a Reporter,
        rx: oneshot::Receiver<Result<Outcome, SagaError>>,
    },
    /// Waiting for room before it can be queued.
    Waiting(Pin<Box<dyn Future<Output = Result<Outcome, SagaError>> + Send + Sync + 'a>>),
    /// Refused before being queued; taken by the first poll.
    Failed(Option<SagaError>),
}

impl<'a> Reply<'a> {
    fn queued(reporter: &'a Reporter, rx: oneshot::Receiver<Result<Outcome, SagaError>>) -> Self {
        Self(ReplyState::Queued { reporter, rx })
    }

    fn waiting(
        f: Pin<Box<dyn Future<Output = Result<Outcome, SagaError>> + Send + Sync + 'a>>,
    ) -> Self {
        Self(ReplyState::Waiting(f))
    }

    fn failed(e: SagaError) -> Self {
        Self(ReplyState::Failed(Some(e)))
    }
}

impl Future for Reply<'_> {
    type Output = Result<Outcome, SagaError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Every field is `Unpin`.
        match &mut self.get_mut().0 {
            ReplyState::Queued { reporter, rx } => Pin::new(rx)
                .poll(cx)
                .map(|r| r.unwrap_or_else(|_| Err(reporter.closed_error()))),
            ReplyState::Waiting(f) => f.as_mut().poll(cx),
            ReplyState::Failed(e) => Poll::Ready(Err(e
                .take()
                .unwrap_or_else(|| SagaError::Protocol("a reply polled after it ended".into())))),
        }
    }
}

pub(crate) fn kind_name(t: i32) -> EventKindName {
    EventKindName(
        EventType::try_from(t)
            .map(|t| t.as_str_name())
            .unwrap_or("UNKNOWN_EVENT"),
    )
}

pub(crate) struct Shared {
    pub(crate) reporter: Reporter,
    stats: Arc<StatsCounters>,
    meta: Arc<RwLock<HashMap<String, String>>>,
    /// Random per client, so ids of different clients never collide.
    id_prefix: String,
    next_id: AtomicU64,
    pub(crate) settings: Arc<Settings>,
    stop: CancellationToken,
}

impl Shared {
    /// A fresh id: `<client prefix>-<counter>`.
    pub(crate) fn new_id(&self) -> String {
        format!(
            "{}-{}",
            self.id_prefix,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }
}

/// A participant's session with the coordinator; cheap to clone (all clones
/// share the one session).
///
/// Every event reported through any clone, by any number of concurrent
/// sagas, is coalesced into the session's batches; see the crate docs.
#[derive(Clone)]
pub struct SagaClient {
    pub(crate) shared: Arc<Shared>,
}

impl fmt::Debug for SagaClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SagaClient")
            .field("endpoint", &self.shared.settings.endpoint_text)
            .field("service_name", &self.service_name())
            .field("instance_id", &self.instance_id())
            .finish_non_exhaustive()
    }
}

impl SagaClient {
    /// A builder; see [`ClientBuilder::new`].
    pub fn builder(endpoint: impl Into<String>, service_name: impl Into<String>) -> ClientBuilder {
        ClientBuilder::new(endpoint, service_name)
    }

    /// The service this client reports for.
    pub fn service_name(&self) -> &str {
        &self.shared.settings.participants[self.shared.reporter.participant as usize].0
    }

    /// This instance's id.
    pub fn instance_id(&self) -> &str {
        &self.shared.settings.participants[self.shared.reporter.participant as usize].1
    }

    /// The coordinator's features from its last `Welcome` (empty until one
    /// arrived).
    pub fn server_meta(&self) -> HashMap<String, String> {
        // A poisoned lock only means a panic elsewhere mid-write of a plain
        // map: its contents are still usable.
        self.shared
            .meta
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The client's counters so far.
    pub fn stats(&self) -> ClientStats {
        let s = &self.shared.stats;
        ClientStats {
            batches: s.batches.load(Ordering::Relaxed),
            events: s.events.load(Ordering::Relaxed),
            acked: s.acked.load(Ordering::Relaxed),
            resent: s.resent.load(Ordering::Relaxed),
            sessions: s.sessions.load(Ordering::Relaxed),
            compensations: s.compensations.load(Ordering::Relaxed),
            compensations_dropped: s.compensations_dropped.load(Ordering::Relaxed),
            compensations_joined: s.compensations_joined.load(Ordering::Relaxed),
            compensation_reports_failed: s.compensation_reports_failed.load(Ordering::Relaxed),
            in_flight: self
                .shared
                .settings
                .max_in_flight_events
                .saturating_sub(self.shared.reporter.in_flight.available_permits())
                as u64,
        }
    }

    /// Reports one raw event and waits for its acknowledgement: the building
    /// block of [`Saga`](crate::Saga); use it for events the saga API does
    /// not cover. Returns whether the coordinator considers the saga aborted.
    ///
    /// # Errors
    /// [`SagaError::Rejected`], [`SagaError::Closed`], [`SagaError::Protocol`].
    pub async fn report(&self, event: SagaEvent) -> Result<bool, SagaError> {
        self.shared.reporter.report(event).await.map(|o| o.aborted)
    }

    /// Closes the session (for every participant on it): events not yet
    /// acknowledged fail with [`SagaError::Closed`], and every later call too. Dropping every clone
    /// of the client (and its sagas) also ends the session, once what was
    /// reported has been acknowledged.
    pub fn close(&self) {
        let _ = self
            .shared
            .reporter
            .closed
            .set("closed by the application".into());
        self.shared.reporter.in_flight.close();
        self.shared.stop.cancel();
    }
}
