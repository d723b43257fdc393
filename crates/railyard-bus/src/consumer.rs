//! Registering consumers: handler tasks and message streams.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_core::Stream;
use tokio::task::JoinHandle;

use crate::dispatch::{self, HandlerRunner};
use crate::metrics::ConsumerStats;
use crate::queue::{ConsumerQueue, Dispatched, Envelope, BATCH};
use crate::{BusError, EventBus, Message, DEFAULT_CAPACITY};

/// Builds a consumer registration; see [`EventBus::consumer`].
#[derive(Debug)]
#[must_use = "a consumer is registered only by `.handler(..)` or `.stream()`"]
pub struct ConsumerBuilder<'a> {
    bus: &'a EventBus,
    address: String,
    local: bool,
    capacity: usize,
    paused: bool,
}

impl<'a> ConsumerBuilder<'a> {
    pub(crate) fn new(bus: &'a EventBus, address: String, local: bool) -> Self {
        Self {
            bus,
            address,
            local,
            capacity: DEFAULT_CAPACITY,
            paused: false,
        }
    }

    /// The buffer's capacity in messages (at least 1; default
    /// [`DEFAULT_CAPACITY`]). What happens when it fills is described on
    /// [`EventBus`] (Back-pressure).
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity.max(1);
        self
    }

    /// Starts paused: messages are buffered but not delivered until
    /// [`Consumer::resume`] or [`Consumer::fetch`].
    pub fn paused(mut self) -> Self {
        self.paused = true;
        self
    }

    fn queue(&self, dispatch: Option<Dispatched>) -> Result<Arc<ConsumerQueue>, BusError> {
        if self.address.is_empty() {
            return Err(BusError::InvalidAddress {
                address: String::new(),
            });
        }
        Ok(Arc::new(ConsumerQueue::new(
            &self.address,
            self.bus.inner.shared.clone(),
            self.bus.next_id(),
            self.local,
            self.capacity,
            self.paused,
            dispatch,
        )))
    }

    /// Adds the queue to the registry and, when clustered, waits until the
    /// cluster knows of it; on failure the registration is undone, and so
    /// it is if this future is dropped before the cluster answered (a
    /// `timeout` or `select!` around the registration), so no queue stays
    /// registered without its `Consumer`.
    async fn advertise(&self, queue: &Arc<ConsumerQueue>) -> Result<(), BusError> {
        if let Some(advertisement) = self.bus.register(queue.clone()) {
            let guard = Unregisters {
                bus: self.bus,
                queue,
            };
            let result = advertisement.await;
            if result.is_ok() {
                std::mem::forget(guard);
            }
            result?;
        }
        Ok(())
    }

    /// Registers `handler`, run on a task of the current tokio runtime, one
    /// message at a time, in arrival order. Resolves once the registration is
    /// visible to senders.
    ///
    /// On a thread that called [`enable_loop_dispatch`](crate::enable_loop_dispatch)
    /// the handler is run by that event loop's dispatcher task instead of a
    /// task of its own; the guarantees are the same.
    ///
    /// A panicking handler is caught and logged; the consumer keeps running and
    /// the request it was handling fails with [`BusError::NoReply`].
    ///
    /// # Errors
    /// [`BusError::InvalidAddress`] for an empty address.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub async fn handler<F, Fut>(self, handler: F) -> Result<Consumer, BusError>
    where
        F: Fn(Message) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        if let Some(dispatcher) = dispatch::this_loop() {
            let runner = HandlerRunner::new(handler, self.address.as_str().into());
            let queue = self.queue(Some(Dispatched::new(dispatcher.clone(), Box::new(runner))))?;
            self.advertise(&queue).await?;
            // After the registration, so the dispatcher's end always finds
            // it registered: if the loop's runtime ended meanwhile, it is
            // unregistered here instead, as it would have been then.
            if !dispatcher.enlist(&queue, Arc::downgrade(&self.bus.inner)) {
                self.bus.unregister(&queue);
            }
            return Ok(Consumer {
                queue,
                bus: self.bus.clone(),
                task: None,
            });
        }
        let queue = self.queue(None)?;
        self.advertise(&queue).await?;
        let registry = std::sync::Arc::downgrade(&self.bus.inner);
        let task = tokio::spawn(run_handler(queue.clone(), registry, handler));
        Ok(Consumer {
            queue,
            bus: self.bus.clone(),
            task: Some(task),
        })
    }

    /// Registers a consumer read as a [`Stream`] of messages. Resolves once the
    /// registration is visible to senders. Dropping the stream unregisters it.
    ///
    /// # Errors
    /// [`BusError::InvalidAddress`] for an empty address.
    pub async fn stream(self) -> Result<MessageStream, BusError> {
        let queue = self.queue(None)?;
        self.advertise(&queue).await?;
        Ok(MessageStream {
            queue,
            bus: self.bus.clone(),
            batch: VecDeque::new(),
        })
    }
}

/// How many messages a handler task processes before yielding to its
/// runtime, so a busy consumer cannot starve the tasks beside it.
const YIELD_EVERY: usize = 256;

async fn run_handler<F, Fut>(
    queue: Arc<ConsumerQueue>,
    registry: std::sync::Weak<crate::bus::Inner>,
    handler: F,
) where
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut batch: VecDeque<Envelope> = VecDeque::with_capacity(BATCH);
    let mut since_yield = 0;
    let mut ends = EndsWithTask {
        queue: queue.clone(),
        registry,
        finished: false,
    };
    loop {
        let open = std::future::poll_fn(|cx| queue.poll_batch(cx, &mut batch, BATCH)).await;
        if !open {
            ends.finished = true;
            return;
        }
        crate::idle_spin::note_loop_work();
        since_yield += batch.len();
        while let Some(env) = batch.pop_front() {
            let Some(msg) = admit(&queue, env) else {
                continue;
            };
            if CatchUnwind(handler(msg)).await.is_err() {
                tracing::error!(address = %queue.address, "consumer handler panicked; message dropped");
            }
        }
        if since_yield >= YIELD_EVERY {
            since_yield = 0;
            tokio::task::yield_now().await;
        }
    }
}

/// A handler consumer, unregistered if its task is dropped before it ends
/// (its runtime shut down): it leaves the registry (and the cluster, which
/// stops routing its share here) and what it held fails at once, instead of
/// a consumer that stays registered, takes messages and never handles them
/// (requests waiting their whole timeout). If the bus itself is gone, the
/// queue is closed so nothing more enters it.
struct EndsWithTask {
    queue: Arc<ConsumerQueue>,
    registry: std::sync::Weak<crate::bus::Inner>,
    finished: bool,
}

impl Drop for EndsWithTask {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        unregister_or_close(&self.queue, &self.registry);
    }
}

/// Takes a consumer whose handler will never run again out of `registry`
/// (and so out of the cluster's routes), failing what it held; if the bus
/// itself is gone, closes the queue so nothing more enters it.
pub(crate) fn unregister_or_close(
    queue: &ConsumerQueue,
    registry: &std::sync::Weak<crate::bus::Inner>,
) {
    if let Some(inner) = registry.upgrade() {
        crate::EventBus { inner }.unregister(queue);
    } else {
        queue.close_and_fail();
    }
}

/// Turns an envelope into a message and runs inbound interceptors.
#[inline]
pub(crate) fn admit(queue: &Arc<ConsumerQueue>, env: Envelope) -> Option<Message> {
    let mut msg = Message::delivered(env, queue);
    if let Err(e) = queue.shared.inbound_check(&mut msg) {
        queue.count_discarded();
        // Tell a requester why instead of letting it time out (a send has
        // nobody to tell, so `NotReplyable` is expected and ignored).
        let _ = msg.fail_with(e);
        return None;
    }
    Some(msg)
}

/// Polls a handler future, turning a panic into `Err`.
struct CatchUnwind<F>(F);

impl<F: Future<Output = ()>> Future for CatchUnwind<F> {
    type Output = Result<(), ()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Safety: `CatchUnwind` is a structural pin projection of its only field;
        // the field is never moved out.
        let fut = unsafe { self.map_unchecked_mut(|s| &mut s.0) };
        match std::panic::catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(Poll::Ready(())) => Poll::Ready(Ok(())),
            Ok(Poll::Pending) => Poll::Pending,
            Err(_) => Poll::Ready(Err(())),
        }
    }
}

/// A registered handler consumer.
///
/// Dropping the handle detaches it: the consumer keeps running until
/// [`unregister`](Self::unregister) is called on a handle, like a Vert.x consumer.
#[derive(Debug)]
pub struct Consumer {
    queue: Arc<ConsumerQueue>,
    bus: EventBus,
    task: Option<JoinHandle<()>>,
}

impl Consumer {
    /// The address this consumer listens on.
    pub fn address(&self) -> &str {
        &self.queue.address
    }

    /// Whether it was registered with `local_consumer`.
    pub fn is_local(&self) -> bool {
        self.queue.local
    }

    /// Stops delivery; messages keep arriving into the buffer up to its
    /// capacity, then senders see [`BusError::Full`].
    pub fn pause(&self) {
        self.queue.pause();
    }

    /// Resumes delivery of everything.
    pub fn resume(&self) {
        self.queue.resume();
    }

    /// While paused, lets `n` more messages through.
    pub fn fetch(&self, n: u64) {
        self.queue.fetch(n);
    }

    /// This consumer's counters.
    pub fn stats(&self) -> ConsumerStats {
        self.queue.stats()
    }

    /// The buffer's capacity.
    pub fn capacity(&self) -> usize {
        self.queue.capacity()
    }

    /// Unregisters: no new message reaches this consumer; buffered requests
    /// fail with [`BusError::NoHandlers`]; the handler finishes the message it
    /// is on and the batch it already took, then the task ends. Resolves when
    /// it has ended.
    ///
    /// Called from the consumer's own handler (a one-shot consumer), it
    /// resolves at once: the handler's message is the one in progress, and
    /// the consumer ends when the handler returns.
    pub async fn unregister(mut self) {
        self.bus.unregister(&self.queue);
        if let Some(task) = self.task.take() {
            if tokio::task::try_id() == Some(task.id()) {
                return; // inside its own handler: waiting would never end
            }
            // A handler panic is caught inside the task, so join errors only
            // mean cancellation at runtime shutdown: nothing left to do.
            let _ = task.await;
        } else {
            // Dispatched: wait for the batch in progress, if any.
            self.queue.wait_idle().await;
        }
    }
}

/// Messages at an address, as a [`Stream`]. Dropping it unregisters.
///
/// Back-pressure is natural: messages stay buffered (up to the capacity) until
/// the stream is polled.
#[derive(Debug)]
pub struct MessageStream {
    queue: Arc<ConsumerQueue>,
    bus: EventBus,
    batch: VecDeque<Envelope>,
}

impl MessageStream {
    /// The address this stream listens on.
    pub fn address(&self) -> &str {
        &self.queue.address
    }

    /// This consumer's counters.
    pub fn stats(&self) -> ConsumerStats {
        self.queue.stats()
    }

    /// Unregisters now; messages already taken from the buffer are still yielded.
    pub async fn unregister(self) {
        drop(self);
    }
}

impl Stream for MessageStream {
    type Item = Message;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Message>> {
        let this = self.get_mut();
        loop {
            if let Some(env) = this.batch.pop_front() {
                if let Some(msg) = admit(&this.queue, env) {
                    return Poll::Ready(Some(msg));
                }
                continue;
            }
            match this.queue.poll_batch(cx, &mut this.batch, BATCH) {
                Poll::Ready(true) => {}
                Poll::Ready(false) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Drop for MessageStream {
    fn drop(&mut self) {
        self.bus.unregister(&self.queue);
        for env in self.batch.drain(..) {
            env.fail_unhandled(&self.queue.address);
        }
    }
}

/// Undoes a registration when dropped (see [`ConsumerBuilder::advertise`]'s
/// callers); forgotten once the registration is complete.
struct Unregisters<'a> {
    bus: &'a EventBus,
    queue: &'a Arc<ConsumerQueue>,
}

impl Drop for Unregisters<'_> {
    fn drop(&mut self) {
        self.bus.unregister(self.queue);
    }
}
