//! The session task: the one owner of the stream to the coordinator.
//!
//! It takes submitted events off the client's queue, coalesces them into
//! `EventBatch` frames, remembers each batch until its `Ack` (matched by
//! `seq`) resolves the per-event waiters, runs compensation commands through
//! the registry, and on a lost connection reconnects with backoff and sends
//! every unacknowledged batch again, in its original order.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use bytes::Bytes;
use prost::Message;
use railyard_saga_proto::native::saga_coordinator_server;
use railyard_saga_proto::native::{
    client_frame, server_frame, Ack, ClientFrame, Compensate, EventType, Hello, Participant,
    SagaEvent, ServerFrame,
};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::Streaming;

use crate::client::{
    kind_name, now_ms, Outcome, Reporter, Settings, StatsCounters, Submit, Waiter,
};
use crate::compensation::{Compensation, Registry};
use crate::error::{CompensationError, SagaError};
use crate::frame::{OutCodec, OutFrame};

/// A batch sent and not yet acknowledged: its events (shared with the
/// frame, so sending costs no copy) and, in the same order, their waiters.
struct Sent {
    events: Arc<Vec<SagaEvent>>,
    waiters: Vec<Waiter>,
}

/// Passes of the scheduler a session on a multi-thread runtime gives its
/// sagas before building a batch, at most: it stops at the first that
/// brings no event. (On a current-thread runtime one pass runs them all.)
/// Measured with the bench's load on a two-worker runtime: batches of 87
/// events instead of 26, 17 % less CPU per transaction.
const BATCH_YIELDS: usize = 8;

/// Compensations held by a session: see `Session::running`.
type Running = std::sync::Mutex<HashMap<(u32, String, String), u32>>;

/// A held compensation's entry in [`Running`]: removed when the command's
/// task ends, however it ends.
struct Held {
    running: Arc<Running>,
    key: Option<(u32, String, String)>,
}

/// What a held compensation does after a run: see [`Held::settle`].
enum Settled {
    /// Report the result as the answer to this attempt (the entry is gone).
    Report(u32),
    /// Run the handler again for this later attempt (the entry stays).
    RunAgain(u32),
}

impl Held {
    /// After a run for `attempt`: a success, or a failure with no other
    /// attempt sent meanwhile, is reported (for the latest attempt) and the
    /// entry removed; a failure with another attempt pending runs again.
    fn settle(&mut self, attempt: u32, ok: bool) -> Settled {
        let Some(key) = self.key.as_ref() else {
            return Settled::Report(attempt);
        };
        let mut running = lock(&self.running);
        let latest = running.get(key).copied().unwrap_or(attempt);
        if !ok && latest != attempt {
            return Settled::RunAgain(latest);
        }
        running.remove(key);
        drop(running);
        self.key = None;
        Settled::Report(latest)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            lock(&self.running).remove(&key);
        }
    }
}

fn lock(running: &Running) -> std::sync::MutexGuard<'_, HashMap<(u32, String, String), u32>> {
    // A panic while held leaves only a map of plain values behind.
    running
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How a session ended.
enum End {
    /// Every client handle is gone and everything reported was acknowledged,
    /// or the application closed the client.
    Done,
    /// The connection broke: reconnect and resend.
    Lost(String),
    /// The coordinator refused us: retrying cannot help.
    Fatal(SagaError),
}

pub(crate) struct Session {
    settings: Arc<Settings>,
    submit_rx: mpsc::Receiver<Submit>,
    /// For compensation tasks to report their result; weak so that the
    /// session ends when the application drops its handles.
    self_tx: mpsc::WeakSender<Submit>,
    /// The in-flight budget the handles report through.
    in_flight: Arc<Semaphore>,
    /// Why the client closed for good, once it has.
    closed: Arc<OnceLock<String>>,
    /// Each participant's compensation handlers, by participant number.
    registries: Vec<Registry>,
    stats: Arc<StatsCounters>,
    meta: Arc<RwLock<HashMap<String, String>>>,
    stop: CancellationToken,
    compensation_slots: Arc<Semaphore>,
    /// Commands held (running or waiting for a slot): twice the slots. A
    /// command that finds no room is dropped unanswered (counted, logged);
    /// the coordinator sends it again once its reverse timeout passes.
    compensation_room: Arc<Semaphore>,
    /// Commands held, by `(participant, global id, local id)`, with the
    /// latest attempt the coordinator sent for each. A command for one
    /// already held (the coordinator's next attempt, sent when the first
    /// outlived its reverse timeout) joins it instead of running the
    /// handler a second time alongside; the result answers the latest
    /// attempt. Bounded by `compensation_room`.
    running: Arc<Running>,
    /// Events queued, not yet sent on the current session (a reconnection
    /// puts unacknowledged batches back at the front).
    pending: VecDeque<Submit>,
    /// Sent batches by seq, waiting for their Ack.
    unacked: BTreeMap<u64, Sent>,
    /// Increases across sessions, so an ack can never match the wrong batch.
    next_seq: u64,
    /// False once every sender is gone: finish what is queued, then end.
    accepting: bool,
    /// Events per batch the coordinator takes (its `Welcome` says; a
    /// larger batch would end the session for good). Unlimited until told.
    server_max_batch: usize,
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        settings: Arc<Settings>,
        submit_rx: mpsc::Receiver<Submit>,
        self_tx: mpsc::WeakSender<Submit>,
        in_flight: Arc<Semaphore>,
        closed: Arc<OnceLock<String>>,
        registries: Vec<Registry>,
        stats: Arc<StatsCounters>,
        meta: Arc<RwLock<HashMap<String, String>>>,
        stop: CancellationToken,
    ) -> Self {
        let slots = settings.max_concurrent_compensations;
        Self {
            settings,
            submit_rx,
            self_tx,
            in_flight,
            closed,
            registries,
            stats,
            meta,
            stop,
            compensation_slots: Arc::new(Semaphore::new(slots)),
            compensation_room: Arc::new(Semaphore::new(slots.saturating_mul(2))),
            running: Arc::default(),
            pending: VecDeque::new(),
            unacked: BTreeMap::new(),
            next_seq: 1,
            accepting: true,
            server_max_batch: usize::MAX,
        }
    }

    /// Runs until the client is closed or dropped; tells `first` how the
    /// first connection went (a failing first connection ends the task).
    pub(crate) async fn run(mut self, first: oneshot::Sender<Result<(), SagaError>>) {
        let mut first = Some(first);
        let mut backoff = self.settings.backoff_initial;
        loop {
            let lost = match self.open().await {
                Ok((out, inbound)) => {
                    self.stats.sessions.fetch_add(1, Ordering::Relaxed);
                    if let Some(f) = first.take() {
                        let _ = f.send(Ok(()));
                    } else {
                        tracing::info!(
                            endpoint = %self.settings.endpoint_text,
                            resending = self.unacked.values().map(|b| b.waiters.len()).sum::<usize>() + self.pending.len(),
                            "saga session re-established"
                        );
                    }
                    let (acked, since) = (
                        self.stats.acked.load(Ordering::Relaxed),
                        tokio::time::Instant::now(),
                    );
                    let end = self.serve(out, inbound).await;
                    // The backoff starts over only after a session that
                    // worked: it acknowledged something, or it lasted. A
                    // coordinator that welcomes sessions and then fails
                    // every batch (its store down) is retried ever more
                    // slowly, not every initial backoff with the whole
                    // backlog each time.
                    if self.stats.acked.load(Ordering::Relaxed) > acked
                        || since.elapsed() >= self.settings.backoff_max
                    {
                        backoff = self.settings.backoff_initial;
                    }
                    match end {
                        End::Done => return self.fail_all(None),
                        End::Fatal(e) => return self.close_with(first, e),
                        End::Lost(reason) => reason,
                    }
                }
                Err(End::Fatal(e)) => return self.close_with(first, e),
                Err(End::Done) => return self.fail_all(None),
                Err(End::Lost(reason)) => {
                    if let Some(f) = first.take() {
                        let _ = f.send(Err(SagaError::Connect {
                            endpoint: self.settings.endpoint_text.clone(),
                            reason,
                        }));
                        return;
                    }
                    reason
                }
            };
            self.requeue_unacked();
            tracing::warn!(
                endpoint = %self.settings.endpoint_text,
                reason = %lost,
                retry_in_ms = backoff.as_millis() as u64,
                "saga session lost, reconnecting"
            );
            if !self.wait(backoff).await {
                return self.fail_all(None);
            }
            // Double, with up to 25% jitter so many clients do not retry in step.
            let jitter = 1.0 + f64::from(now_ms().rem_euclid(256) as u32) / 1024.0;
            backoff = backoff.mul_f64(2.0 * jitter).min(self.settings.backoff_max);
        }
    }

    fn close_with(&mut self, first: Option<oneshot::Sender<Result<(), SagaError>>>, e: SagaError) {
        tracing::error!(error = %e, "saga session refused; the client is closed");
        let _ = self.closed.set(e.to_string());
        self.in_flight.close();
        if let Some(f) = first {
            let _ = f.send(Err(e.clone()));
        }
        self.fail_all(Some(e));
    }

    /// Fails every waiter (with `e`, or "closed") and stops taking events.
    fn fail_all(&mut self, e: Option<SagaError>) {
        self.in_flight.close();
        self.submit_rx.close();
        let err = e.unwrap_or_else(|| SagaError::Closed(self.closed.get().cloned()));
        let unacked = std::mem::take(&mut self.unacked);
        let queued = std::iter::from_fn(|| self.submit_rx.try_recv().ok()).collect::<Vec<_>>();
        let replies = unacked
            .into_values()
            .flat_map(|b| b.waiters)
            .map(|w| w.reply)
            .chain(self.pending.drain(..).chain(queued).map(|s| s.waiter.reply));
        for reply in replies {
            let _ = reply.send(Err(err.clone()));
        }
    }

    /// Connects and opens the stream, with the Hello already queued.
    async fn open(&mut self) -> Result<(mpsc::Sender<OutFrame>, Streaming<ServerFrame>), End> {
        let attempt = async {
            let channel = match &self.settings.shared {
                Some(shared) => shared.clone(),
                None => self
                    .settings
                    .endpoint
                    .connect()
                    .await
                    .map_err(|e| End::Lost(format!("connect: {}", error_chain(&e))))?,
            };
            let mut grpc = tonic::client::Grpc::new(channel)
                .max_decoding_message_size(railyard_saga_proto::MAX_NATIVE_FRAME_BYTES)
                .max_encoding_message_size(railyard_saga_proto::MAX_NATIVE_FRAME_BYTES);
            // Capacity 1: the next batch is built only once the previous one
            // has been taken by the transport, from everything queued by then.
            let (out, rx) = mpsc::channel(1);
            let (own, others) = self
                .settings
                .participants
                .split_first()
                .expect("a session has at least its own participant");
            let hello = ClientFrame {
                kind: Some(client_frame::Kind::Hello(Hello {
                    service_name: own.0.clone(),
                    instance_id: own.1.clone(),
                    token: self.settings.token.clone(),
                    others: others
                        .iter()
                        .map(|(service, instance)| Participant {
                            service_name: service.clone(),
                            instance_id: instance.clone(),
                        })
                        .collect(),
                })),
            };
            // Cannot fail: the receiver is alive and the channel is empty.
            let _ = out.try_send(OutFrame::Whole(hello));
            // The generated client's `session`, with a codec that encodes
            // batches from the events kept for resending (`frame`).
            grpc.ready()
                .await
                .map_err(|e| End::Lost(format!("connect: {}", error_chain(&e))))?;
            let mut request = tonic::Request::new(ReceiverStream::new(rx));
            request.extensions_mut().insert(tonic::GrpcMethod::new(
                saga_coordinator_server::SERVICE_NAME,
                "Session",
            ));
            let mut inbound = grpc
                .streaming(request, PathAndQuery::from_static(SESSION_PATH), OutCodec)
                .await
                .map_err(classify)?
                .into_inner();
            // The coordinator answers Hello with Welcome, or ends the stream
            // with the reason it refuses the session.
            match inbound.message().await {
                Ok(Some(ServerFrame {
                    kind: Some(server_frame::Kind::Welcome(w)),
                })) => {
                    participants_taken(self.settings.participants.len(), &w.meta)
                        .map_err(End::Fatal)?;
                    welcome(&mut self.server_max_batch, &self.meta, w.meta);
                }
                Ok(Some(other)) => {
                    return Err(End::Fatal(SagaError::Protocol(format!(
                        "expected Welcome as the first frame, got {:?}",
                        other.kind
                    ))))
                }
                Ok(None) => return Err(End::Lost("the coordinator ended the stream".into())),
                Err(status) => return Err(classify(status)),
            }
            Ok((out, inbound))
        };
        tokio::select! {
            r = tokio::time::timeout(self.settings.connect_timeout, attempt) => match r {
                Ok(r) => r,
                Err(_) => Err(End::Lost(format!(
                    "no session within {:?}",
                    self.settings.connect_timeout
                ))),
            },
            _ = self.stop.cancelled() => Err(End::Done),
        }
    }

    /// Moves every unacknowledged batch back to the front of the queue, in
    /// seq order, to be sent again on the next session.
    fn requeue_unacked(&mut self) {
        let unacked = std::mem::take(&mut self.unacked);
        let n: usize = unacked.values().map(|b| b.waiters.len()).sum();
        self.stats.resent.fetch_add(n as u64, Ordering::Relaxed);
        for batch in unacked.into_values().rev() {
            // The old session's frames are gone by now, so this is a move.
            let events = Arc::unwrap_or_clone(batch.events);
            for (event, w) in events.into_iter().zip(batch.waiters).rev() {
                let size = event.encoded_len();
                self.pending.push_front(Submit {
                    event,
                    size,
                    waiter: w,
                });
            }
        }
    }

    /// Sleeps `delay` while still queueing submissions; false if the client
    /// was closed or dropped meanwhile.
    async fn wait(&mut self, delay: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + delay;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return true,
                _ = self.stop.cancelled() => return false,
                sub = self.submit_rx.recv(), if self.accepting => match sub {
                    Some(s) => self.pending.push_back(s),
                    None => {
                        self.accepting = false;
                        // Nobody is left to hear about what is queued.
                        if self.pending.iter().all(|s| s.waiter.reply.is_closed()) {
                            return false;
                        }
                    }
                },
            }
        }
    }

    /// Runs one open session until it ends.
    async fn serve(
        &mut self,
        out: mpsc::Sender<OutFrame>,
        mut inbound: Streaming<ServerFrame>,
    ) -> End {
        let max_batch = self.settings.max_batch_events;
        // One wait for the stop for the whole session, polled last, only to
        // wake the task: a fresh `cancelled()` polled first on every turn of
        // the loop (a turn per event when events trickle in) took the token's
        // lock and its waiter list's twice a turn. Whether the client was
        // closed is read at the top of every turn instead (`close` sets
        // `closed` before it cancels), so nothing queued before a close is
        // sent after it.
        let stopped = self.stop.clone().cancelled_owned();
        tokio::pin!(stopped);
        let yields = match tokio::runtime::Handle::current().runtime_flavor() {
            tokio::runtime::RuntimeFlavor::CurrentThread => 1,
            _ => BATCH_YIELDS,
        };
        loop {
            let drained = !self.accepting && self.pending.is_empty() && self.unacked.is_empty();
            if self.closed.get().is_some() || drained {
                return End::Done;
            }
            tokio::select! {
                // Acks first: they free in-flight room and wake the sagas
                // whose next events make the next batch.
                biased;
                frame = inbound.message() => match frame {
                    Ok(Some(frame)) => self.on_frame(frame),
                    Ok(None) => return End::Lost("the coordinator ended the stream".into()),
                    Err(status) => return classify(status),
                },
                // Then take everything already queued, up to a full batch...
                sub = self.submit_rx.recv(), if self.accepting && self.pending.len() < max_batch => match sub {
                    Some(s) => {
                        self.pending.push_back(s);
                        self.take_queued(max_batch);
                    }
                    None => self.accepting = false,
                },
                // ...and send it once the transport took the previous batch.
                permit = out.reserve(), if !self.pending.is_empty()
                    && self.unacked.len() < self.settings.max_batches_in_flight => match permit {
                    Ok(permit) => {
                        // Let every task that is already runnable (typically
                        // the sagas the last ack woke) queue its next event
                        // first: passes of the scheduler, not a timer. One
                        // pass does it on a current-thread runtime; on a
                        // multi-thread one the first saga's event can wake
                        // this task before the others have run, so it yields
                        // again while a pass brings events, a few times.
                        for _ in 0..yields {
                            tokio::task::yield_now().await;
                            let before = self.pending.len();
                            self.take_queued(max_batch);
                            if self.pending.len() == before || self.pending.len() >= max_batch {
                                break;
                            }
                        }
                        permit.send(self.next_batch());
                    }
                    Err(_) => return End::Lost("the request stream closed".into()),
                },
                () = &mut stopped => return End::Done,
            }
        }
    }

    /// Moves what is already queued into `pending`, up to `max_batch`
    /// events, without waiting.
    fn take_queued(&mut self, max_batch: usize) {
        while self.accepting && self.pending.len() < max_batch {
            match self.submit_rx.try_recv() {
                Ok(s) => self.pending.push_back(s),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.accepting = false;
                }
            }
        }
    }

    fn next_batch(&mut self) -> OutFrame {
        let n = batch_len(
            self.pending.iter().map(|s| s.size),
            self.settings.max_batch_events.min(self.server_max_batch),
            crate::MAX_BATCH_BYTES,
        );
        let mut events = Vec::with_capacity(n);
        let mut sizes = Vec::with_capacity(n);
        let mut waiters = Vec::with_capacity(n);
        for s in self.pending.drain(..n) {
            events.push(s.event);
            sizes.push(s.size);
            waiters.push(s.waiter);
        }
        let events = Arc::new(events);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.unacked.insert(
            seq,
            Sent {
                events: events.clone(),
                waiters,
            },
        );
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.events.fetch_add(n as u64, Ordering::Relaxed);
        OutFrame::Batch { seq, events, sizes }
    }

    fn on_frame(&mut self, frame: ServerFrame) {
        match frame.kind {
            Some(server_frame::Kind::Welcome(w)) => {
                welcome(&mut self.server_max_batch, &self.meta, w.meta);
            }
            Some(server_frame::Kind::Ack(ack)) => self.on_ack(ack),
            Some(server_frame::Kind::Compensate(c)) => self.on_compensate(c),
            None => tracing::warn!("empty frame from the saga coordinator, ignored"),
        }
    }

    fn on_ack(&mut self, ack: Ack) {
        let Some(Sent { events, waiters }) = self.unacked.remove(&ack.seq) else {
            tracing::warn!(seq = ack.seq, "ack for no outstanding batch, ignored");
            return;
        };
        self.stats
            .acked
            .fetch_add(waiters.len() as u64, Ordering::Relaxed);
        if ack.results.len() != waiters.len() {
            let e = SagaError::Protocol(format!(
                "ack {} has {} results for {} events",
                ack.seq,
                ack.results.len(),
                waiters.len()
            ));
            tracing::error!(error = %e, "bad ack");
            for w in waiters {
                let _ = w.reply.send(Err(e.clone()));
            }
            return;
        }
        // Room first, so a caller woken by an answer sees it; released in
        // one piece (each permit dropped alone took the semaphore's lock).
        let mut replies = Vec::with_capacity(waiters.len());
        let mut room: Option<OwnedSemaphorePermit> = None;
        for Waiter { reply, permit } in waiters {
            match &mut room {
                Some(r) => r.merge(permit),
                None => room = Some(permit),
            }
            replies.push(reply);
        }
        drop(room);
        for ((reply, r), event) in replies.into_iter().zip(ack.results).zip(events.iter()) {
            let answer = if r.error.is_empty() {
                Ok(Outcome { aborted: r.aborted })
            } else {
                Err(SagaError::Rejected {
                    kind: kind_name(event.r#type),
                    global_tx_id: event.global_tx_id.clone(),
                    message: r.error,
                })
            };
            let _ = reply.send(answer);
        }
    }

    fn on_compensate(&mut self, c: Compensate) {
        self.stats.compensations.fetch_add(1, Ordering::Relaxed);
        let Some(registry) = self.registries.get(c.participant as usize) else {
            self.stats
                .compensations_dropped
                .fetch_add(1, Ordering::Relaxed);
            // Nobody here could answer it; the coordinator sends it again
            // (to whoever runs that participant) after its reverse timeout.
            tracing::warn!(
                participant = c.participant,
                participants = self.registries.len(),
                global_tx_id = %c.global_tx_id,
                "compensation command for a participant this session does not have, ignored"
            );
            return;
        };
        let key = (c.participant, c.global_tx_id.clone(), c.local_tx_id.clone());
        {
            let mut held = lock(&self.running);
            if let Some(attempt) = held.get_mut(&key) {
                // Already running (or waiting for a slot): the coordinator
                // sent its next attempt meanwhile. One run answers both.
                // The latest command's number, not the highest: after a
                // coordinator restart its numbers start again at 1.
                *attempt = c.attempt;
                self.stats
                    .compensations_joined
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let handler = registry.get(&c.compensation_method);
        let Ok(room) = self.compensation_room.clone().try_acquire_owned() else {
            self.stats
                .compensations_dropped
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                global_tx_id = %c.global_tx_id,
                local_tx_id = %c.local_tx_id,
                held = self.settings.max_concurrent_compensations.saturating_mul(2),
                "compensation command dropped: the client already holds as many as it may; \
                 the coordinator sends it again after the step's reverse timeout \
                 (raise max_concurrent_compensations if handlers are slow)"
            );
            return;
        };
        let Some(tx) = self.self_tx.upgrade() else {
            return;
        };
        let reporter = Reporter {
            tx,
            in_flight: self.in_flight.clone(),
            closed: self.closed.clone(),
            participant: c.participant,
        };
        let slots = self.compensation_slots.clone();
        let stats = self.stats.clone();
        lock(&self.running).insert(key.clone(), c.attempt);
        let mut held = Held {
            running: self.running.clone(),
            key: Some(key),
        };
        tokio::spawn(async move {
            let _room = room;
            let Ok(_slot) = slots.acquire_owned().await else {
                return;
            };
            let mut command = Compensation {
                global_tx_id: c.global_tx_id,
                local_tx_id: c.local_tx_id,
                parent_tx_id: c.parent_tx_id,
                compensation_method: c.compensation_method,
                // Copied out: a decoded `Bytes` may share the whole
                // received frame, which the handler could keep alive.
                payloads: Bytes::copy_from_slice(&c.payloads),
                attempt: c.attempt,
            };
            let (result, attempt) = loop {
                let attempt = command.attempt;
                let result = match &handler {
                    Some(h) => h(command.clone()).await,
                    None => Err(CompensationError::new(format!(
                        "no compensation handler registered for `{}`",
                        command.compensation_method
                    ))),
                };
                // A later attempt that came while this one ran gets a run
                // of its own if this one failed (its answer is the one the
                // coordinator awaits); a success answers every attempt.
                match held.settle(attempt, result.is_ok()) {
                    Settled::Report(latest) => break (result, latest),
                    Settled::RunAgain(latest) => {
                        if let Err(e) = &result {
                            tracing::warn!(global_tx_id = %command.global_tx_id, local_tx_id = %command.local_tx_id, attempt, error = %e, "compensation failed; running it again for the attempt that came meanwhile");
                        }
                        command.attempt = latest;
                    }
                }
            };
            let Compensation {
                global_tx_id: global,
                local_tx_id: local,
                parent_tx_id: parent,
                compensation_method: method,
                ..
            } = command;
            let kind = match &result {
                Ok(()) => EventType::TxCompensated,
                Err(e) => {
                    tracing::warn!(global_tx_id = %global, local_tx_id = %local, attempt, error = %e, "compensation failed");
                    EventType::TxCompensateFailed
                }
            };
            let event = SagaEvent {
                r#type: kind as i32,
                global_tx_id: global,
                local_tx_id: local,
                parent_tx_id: parent,
                compensation_method: method,
                timestamp_ms: now_ms(),
                // The attempt this answers: the coordinator ignores a
                // failure of any other (stale) attempt.
                attempt,
                ..SagaEvent::default()
            };
            if let Err(e) = reporter.report(event).await {
                stats
                    .compensation_reports_failed
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "reporting a compensation result failed");
            }
        });
    }
}

/// Keeps what a `Welcome` says: its batch limit and its meta. (Fields, not
/// `&mut Session`: the connect path borrows the session's fields apart.)
fn welcome(
    max_batch: &mut usize,
    kept: &RwLock<HashMap<String, String>>,
    meta: HashMap<String, String>,
) {
    *max_batch = server_max_batch(&meta);
    *kept
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = meta;
}

/// The events per batch a coordinator whose `Welcome` carried `meta` takes:
/// unlimited if it does not say (an older coordinator, whose limit the
/// client's own default does not exceed), at least 1.
fn server_max_batch(meta: &HashMap<String, String>) -> usize {
    meta.get(railyard_saga_proto::MAX_BATCH_EVENTS_META)
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(usize::MAX, |n| n.max(1))
}

/// Whether a coordinator whose `Welcome` carried `meta` takes a session of
/// `count` participants. One with more than one needs a coordinator that
/// says so: one that does not ignores the fields that name them and would
/// record every event as participant 0's.
fn participants_taken(count: usize, meta: &HashMap<String, String>) -> Result<(), SagaError> {
    if count == 1 {
        return Ok(());
    }
    let takes = meta
        .get(railyard_saga_proto::PARTICIPANTS_META)
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1);
    if takes >= count {
        return Ok(());
    }
    Err(SagaError::Refused {
        code: tonic::Code::Unimplemented,
        message: format!(
            "this session has {count} participants, and the coordinator takes at most {takes} per session (Welcome.meta {:?}); upgrade the coordinator, or connect each participant with a client of its own",
            railyard_saga_proto::PARTICIPANTS_META
        ),
    })
}

/// How many of the queued events (their encoded `sizes`, in order) the
/// next batch takes: at most `max_events`, and no more than fit in
/// `max_bytes`, but always the first.
fn batch_len(sizes: impl Iterator<Item = usize>, max_events: usize, max_bytes: usize) -> usize {
    let mut n = 0;
    let mut bytes = 0usize;
    for size in sizes.take(max_events) {
        if n > 0 && bytes.saturating_add(size) > max_bytes {
            break;
        }
        bytes = bytes.saturating_add(size);
        n += 1;
    }
    n
}

/// `SagaCoordinator.Session`'s path.
const SESSION_PATH: &str = "/railyard.saga.v1.SagaCoordinator/Session";

/// Whether a failed call is worth retrying.
fn classify(status: tonic::Status) -> End {
    use tonic::Code;
    match status.code() {
        // Our frames broke the protocol (e.g. a batch above the
        // coordinator's limit: `OUT_OF_RANGE` from its decoder): sending
        // them again would fail again.
        Code::InvalidArgument
        | Code::OutOfRange
        | Code::Unauthenticated
        | Code::PermissionDenied
        | Code::Unimplemented => End::Fatal(SagaError::Refused {
            code: status.code(),
            message: status.message().to_owned(),
        }),
        _ => End::Lost(format!("{}: {}", status.code(), status.message())),
    }
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_path_names_the_generated_service() {
        let generated = format!(
            "/{}/Session",
            railyard_saga_proto::native::saga_coordinator_server::SERVICE_NAME
        );
        assert_eq!(SESSION_PATH, generated);
    }

    #[test]
    fn several_participants_need_a_coordinator_that_says_it_takes_them() {
        let meta = |v: Option<&str>| -> HashMap<String, String> {
            v.map(|v| {
                HashMap::from([(
                    railyard_saga_proto::PARTICIPANTS_META.to_owned(),
                    v.to_owned(),
                )])
            })
            .unwrap_or_default()
        };
        // One participant: any coordinator, old ones included.
        assert!(participants_taken(1, &meta(None)).is_ok());
        assert!(participants_taken(4, &meta(Some("64"))).is_ok());
        assert!(participants_taken(64, &meta(Some("64"))).is_ok());
        for (count, m) in [
            (2, meta(None)),
            (65, meta(Some("64"))),
            (2, meta(Some("x"))),
        ] {
            match participants_taken(count, &m) {
                Err(SagaError::Refused { code, message }) => {
                    assert_eq!(code, tonic::Code::Unimplemented);
                    assert!(message.contains("upgrade the coordinator"), "{message}");
                }
                other => panic!("{count} participants, {m:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_batch_closes_at_its_event_count_or_byte_budget() {
        assert_eq!(batch_len([10, 10, 10].into_iter(), 2, 100), 2);
        assert_eq!(batch_len([40, 40, 40].into_iter(), 10, 100), 2);
        assert_eq!(batch_len([40, 60, 1].into_iter(), 10, 100), 2);
        // The first event goes even alone over the budget.
        assert_eq!(batch_len([150, 1].into_iter(), 10, 100), 1);
        assert_eq!(batch_len(std::iter::empty(), 10, 100), 0);
    }

    #[test]
    fn refusals_are_fatal_and_outages_are_retried() {
        assert!(matches!(
            classify(tonic::Status::unauthenticated("bad token")),
            End::Fatal(SagaError::Refused { .. })
        ));
        assert!(matches!(
            classify(tonic::Status::invalid_argument("batch too large")),
            End::Fatal(SagaError::Refused { .. })
        ));
        assert!(matches!(
            classify(tonic::Status::out_of_range("frame too large")),
            End::Fatal(SagaError::Refused { .. })
        ));
        assert!(matches!(
            classify(tonic::Status::unavailable("restarting")),
            End::Lost(_)
        ));
        assert!(matches!(
            classify(tonic::Status::internal("oops")),
            End::Lost(_)
        ));
    }
}
