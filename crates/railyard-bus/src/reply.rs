//! Reply slots and the future a requester awaits.
//!
//! A request carries the sending half of a one-shot slot; nothing is
//! registered at an address and no reply address is generated. The reply (or
//! the failure) is written into the slot by whoever answers, on whatever
//! thread, and wakes the requester.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::bus::Room;
use crate::bus::Shared;
use crate::queue::{Envelope, Refused};
use crate::remote::ReplySink;
use crate::timeouts::TimerKey;
use crate::DeliveryOptions;
use crate::{BusError, EventBus, Message};

pub(crate) type ReplyResult = Result<Message, BusError>;
pub(crate) type ReplyReceiver = oneshot::Receiver<ReplyResult>;

/// Where an answer goes: a requester's one-shot slot on this node, or a
/// transport that carries it back to a requester on another node.
pub(crate) enum ReplySender {
    Local(oneshot::Sender<ReplyResult>),
    Remote(RemoteReply),
}

/// An answer owed to a requester on another node. Dropped unanswered, it
/// answers `NoReply`, as a dropped local request does.
pub(crate) struct RemoteReply {
    sink: Arc<dyn ReplySink>,
    id: u64,
    done: bool,
}

impl Drop for RemoteReply {
    fn drop(&mut self) {
        if !self.done {
            self.sink.reply(self.id, Err(BusError::NoReply));
        }
    }
}

impl RemoteReply {
    /// Forgets the request without answering it (its refusal is reported
    /// another way).
    pub(crate) fn disarm(&mut self) {
        self.done = true;
    }
}

impl ReplySender {
    pub(crate) fn remote(sink: Arc<dyn ReplySink>, id: u64) -> Self {
        ReplySender::Remote(RemoteReply {
            sink,
            id,
            done: false,
        })
    }

    /// Delivers the answer; `Err` gives it back if the requester is gone.
    pub(crate) fn send(self, result: ReplyResult) -> Result<(), ReplyResult> {
        match self {
            ReplySender::Local(tx) => tx.send(result),
            ReplySender::Remote(mut r) => {
                r.done = true;
                crate::dispatch::note_sent_away();
                r.sink.reply(r.id, result);
                Ok(())
            }
        }
    }

    /// Whether nobody waits for the answer any more.
    pub(crate) fn is_closed(&self) -> bool {
        match self {
            ReplySender::Local(tx) => tx.is_closed(),
            ReplySender::Remote(_) => false,
        }
    }
}

impl std::fmt::Debug for ReplySender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplySender::Local(_) => f.write_str("ReplySender::Local"),
            ReplySender::Remote(r) => write!(f, "ReplySender::Remote({})", r.id),
        }
    }
}

/// A request waiting for room. Boxed: rare, and it would otherwise make
/// every `PendingReply` several times larger.
struct Blocked {
    room: Room,
    envelope: Option<Envelope>,
    address: String,
    /// The request's options, to route it again with (its headers are in
    /// the envelope, not here): `local_only`, the codec and the timeout
    /// told to another node must hold on a second routing too.
    options: DeliveryOptions,
    rx: ReplyReceiver,
}

enum State {
    /// Every buffer was full: waiting for room in `queue`.
    Blocked(Box<Blocked>),
    /// In a consumer's buffer or being handled: waiting for the answer.
    Waiting(ReplyReceiver),
    /// Failed before it was delivered.
    Failed(Option<BusError>),
    Done,
}

/// The reply to a request: resolves to the reply [`Message`] or a [`BusError`].
///
/// The message is already in a consumer's buffer when this is created, unless
/// every buffer was full; then the first polls wait for room (see
/// [`PendingReply::enqueued`]). The timeout counts from the request call and
/// covers both waits.
///
/// # Cancel safety
/// Dropping it abandons the reply: the consumer still gets the message and its
/// answer is discarded. A request still waiting for room is withdrawn.
#[must_use = "a request does nothing useful unless its reply is awaited"]
pub struct PendingReply<'a> {
    shared: &'a Shared,
    /// Routes a blocked request again if its consumer went away; `None` for
    /// a chained reply's request, which never blocks.
    router: Option<&'a EventBus>,
    state: State,
    deadline: Instant,
    timeout: Duration,
    /// Armed on the first poll that has to wait, so replies that are already
    /// there never touch the timer (see `timeouts`).
    timer: Option<TimerKey>,
}

impl<'a> PendingReply<'a> {
    pub(crate) fn waiting(
        shared: &'a Shared,
        router: Option<&'a EventBus>,
        rx: ReplyReceiver,
        timeout: Duration,
        start: Instant,
    ) -> Self {
        Self::with_state(shared, router, State::Waiting(rx), timeout, start)
    }

    pub(crate) fn blocked(
        bus: &'a EventBus,
        room: Room,
        envelope: Envelope,
        address: &str,
        rx: ReplyReceiver,
        options: &DeliveryOptions,
        start: Instant,
    ) -> Self {
        let state = State::Blocked(Box::new(Blocked {
            room,
            envelope: Some(envelope),
            address: address.to_owned(),
            options: DeliveryOptions {
                timeout: options.timeout,
                headers: crate::Headers::new(),
                local_only: options.local_only,
                codec: options.codec.clone(),
            },
            rx,
        }));
        Self::with_state(&bus.inner.shared, Some(bus), state, options.timeout, start)
    }

    pub(crate) fn failed(bus: &'a EventBus, error: BusError) -> Self {
        Self::with_state(
            &bus.inner.shared,
            Some(bus),
            State::Failed(Some(error)),
            Duration::ZERO,
            Instant::now(),
        )
    }

    fn with_state(
        shared: &'a Shared,
        router: Option<&'a EventBus>,
        state: State,
        timeout: Duration,
        start: Instant,
    ) -> Self {
        Self {
            shared,
            router,
            state,
            // `Duration::MAX` ("no timeout") would overflow `Instant`: a
            // century stands in for it.
            deadline: start
                .checked_add(timeout)
                .unwrap_or_else(|| start + Duration::from_secs(100 * 365 * 24 * 3600)),
            timeout,
            timer: None,
        }
    }

    /// Whether the request is in a consumer's buffer (or already answered).
    pub fn is_enqueued(&self) -> bool {
        !matches!(self.state, State::Blocked(_))
    }

    /// Waits until the request is in a consumer's buffer (or has failed, which
    /// the reply will then report). Lets a producer pace itself on consumer
    /// back-pressure while collecting replies later.
    pub async fn enqueued(&mut self) {
        std::future::poll_fn(|cx| self.poll_enqueued(cx)).await
    }

    /// `Ready` once the request is no longer blocked: in a buffer, or failed
    /// (a timeout while blocked leaves it `Failed`).
    fn poll_enqueued(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.poll_enqueue(cx).is_ready() {
            return Poll::Ready(());
        }
        if self.poll_deadline(cx).is_ready() {
            self.finish_failed(BusError::Timeout {
                after: self.timeout,
            });
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Drives a blocked request into a buffer; `Ready` once it is no longer blocked.
    fn poll_enqueue(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let State::Blocked(b) = &mut self.state else {
            return Poll::Ready(());
        };
        let retry = match &b.room {
            Room::Local(q) => match q.poll_push(&mut b.envelope, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) => {
                    self.unblock();
                    return Poll::Ready(());
                }
                // The consumer went away or filled again: route again.
                Poll::Ready(Err(Refused::Closed | Refused::Full)) => true,
            },
            Room::Remote(node) => node.poll_request_room(cx).is_ready(),
        };
        if !retry {
            return Poll::Pending;
        }
        let env = b
            .envelope
            .take()
            .expect("envelope is present while blocked");
        let Some(router) = self.router else {
            let address = std::mem::take(&mut b.address);
            self.finish_failed(BusError::NoHandlers { address });
            return Poll::Ready(());
        };
        match router.route(&b.address, env, &b.options) {
            Ok(()) => {
                self.unblock();
                Poll::Ready(())
            }
            Err((BusError::Full { .. }, env, Some(room))) => {
                b.room = room;
                b.envelope = Some(env);
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Err((e, _, _)) => {
                self.finish_failed(e);
                Poll::Ready(())
            }
        }
    }

    /// Blocked -> Waiting, once the envelope is in a buffer.
    fn unblock(&mut self) {
        if let State::Blocked(b) = std::mem::replace(&mut self.state, State::Done) {
            self.state = State::Waiting(b.rx);
        }
    }

    fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let timeouts = &self.shared.timeouts;
        match self.timer {
            None => {
                // No clock read here (with the one in `request`, the clock
                // was 5-7.5 % of a send-reply run's CPU): a deadline that has
                // already passed fires at the next sweep, at most one tick
                // late, like any other.
                self.timer = Some(timeouts.arm(self.deadline, cx.waker()));
                Poll::Pending
            }
            Some(key) => {
                if timeouts.poll_fired(key, cx.waker()) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            }
        }
    }

    fn release_timer(&mut self) {
        if let Some(key) = self.timer.take() {
            self.shared.timeouts.cancel(key);
        }
    }

    fn finish_failed(&mut self, e: BusError) {
        self.state = State::Failed(Some(e));
    }

    fn complete(&mut self, result: ReplyResult) -> Poll<ReplyResult> {
        self.state = State::Done;
        self.release_timer();
        let c = &self.shared.counters;
        c.replies_done.add(1);
        if let Err(e) = &result {
            c.failure(e.kind());
        }
        Poll::Ready(result)
    }
}

impl Future for PendingReply<'_> {
    type Output = Result<Message, BusError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.poll_enqueued(cx).is_pending() {
            return Poll::Pending;
        }
        match &mut this.state {
            State::Waiting(rx) => {
                // On a loop that relays wake-ups, the reply wakes the task
                // through the loop's dispatcher (see `dispatch`).
                let polled = crate::dispatch::with_reply_waker(cx.waker(), |w| {
                    Pin::new(rx).poll(&mut Context::from_waker(w))
                });
                match polled {
                    Poll::Ready(Ok(result)) => this.complete(result),
                    Poll::Ready(Err(_)) => this.complete(Err(BusError::NoReply)),
                    Poll::Pending => {
                        if this.poll_deadline(cx).is_ready() {
                            return this.complete(Err(BusError::Timeout {
                                after: this.timeout,
                            }));
                        }
                        Poll::Pending
                    }
                }
            }
            State::Failed(e) => {
                let e = e.take().unwrap_or(BusError::NoReply);
                this.complete(Err(e))
            }
            State::Blocked(_) => Poll::Pending,
            State::Done => panic!("PendingReply polled after completion"),
        }
    }
}

impl Drop for PendingReply<'_> {
    fn drop(&mut self) {
        self.release_timer();
        if !matches!(self.state, State::Done) {
            // Abandoned: no longer pending, not a failure anyone observed.
            self.shared.counters.replies_done.add(1);
        }
    }
}

impl std::fmt::Debug for PendingReply<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            State::Blocked(_) => "blocked",
            State::Waiting(_) => "waiting",
            State::Failed(_) => "failed",
            State::Done => "done",
        };
        f.debug_struct("PendingReply")
            .field("state", &state)
            .finish()
    }
}
