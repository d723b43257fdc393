//! Home loops: how a message crosses from one thread to a consumer on another.
//!
//! A consumer registered on a single-threaded tokio runtime (an event loop)
//! has that loop as its *home*. A sender running on the home loop pushes
//! straight into the consumer's buffer, as before. A sender on any other
//! thread does not: it appends `(consumer, message)` to the home loop's
//! [`Inbox`] and wakes the loop's *mailman* task only if it was idle. The
//! mailman, on the home loop, takes everything waiting with one lock and moves
//! each message into its consumer's buffer, where waking the consumer is a
//! same-thread schedule.
//!
//! Why: pushing into a buffer owned by another core costs that core's cache
//! lines (the buffer's lock, its slot, the consumer task's state, the
//! runtime's injection queue) on every message, and measured slower on two
//! loops than on one. Through the inbox a message costs the sender one
//! reservation on the consumer's counter and a push onto a vector the home
//! loop takes whole, so the other lines move once per batch, not per message
//! (Vert.x and Netty hand work between event loops the same way, through one
//! queue per loop).
//!
//! Bounds: a message is counted against its consumer's capacity when it is
//! posted, so an inbox never holds more than the sum of its consumers' free
//! room; it needs no bound of its own.
//!
//! Ordering: a sender is judged "home" by a thread-local set when its inbox
//! is created (nothing can be in flight to it yet) and at the start of each
//! mailman poll, which delivers everything posted before it. So one sender's messages to one consumer go either all
//! through the inbox or, once its thread is known as home, directly, and
//! never overtake each other. Consumers on multi-threaded runtimes have no
//! home: every sender pushes directly, as before.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;

use crate::queue::{ConsumerQueue, Envelope};

/// Messages posted to consumers of one event loop by other threads.
pub(crate) struct Inbox {
    state: Mutex<State>,
    /// The runtime whose loop this is: registrations on it share the inbox.
    runtime: tokio::runtime::Id,
}

struct State {
    items: Vec<(Arc<ConsumerQueue>, Envelope)>,
    /// The mailman, stored only while it waits for mail.
    mailman: Option<Waker>,
    /// `false` once the mailman is gone (its runtime shut down).
    open: bool,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("runtime", &self.runtime)
            .finish_non_exhaustive()
    }
}

thread_local! {
    /// The inbox whose mailman last ran on this thread (kept alive here so
    /// `CURRENT` never points at freed memory).
    static HOME: RefCell<Option<Arc<Inbox>>> = const { RefCell::new(None) };
    /// `Arc::as_ptr` of `HOME`, for the send path's one-compare check.
    static CURRENT: Cell<*const Inbox> = const { Cell::new(std::ptr::null()) };
}

impl Inbox {
    /// The home for a consumer registered now: this event loop's inbox
    /// (started on first use), or `None` outside a single-threaded runtime.
    pub(crate) fn for_registration() -> Option<Arc<Inbox>> {
        let handle = tokio::runtime::Handle::try_current().ok()?;
        if handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
            return None;
        }
        let runtime = handle.id();
        let known = HOME.with(|h| {
            h.borrow()
                .as_ref()
                .filter(|i| i.runtime == runtime && i.state.lock().open)
                .cloned()
        });
        if let Some(inbox) = known {
            return Some(inbox);
        }
        let inbox = Arc::new(Inbox {
            state: Mutex::new(State {
                items: Vec::new(),
                mailman: None,
                open: true,
            }),
            runtime,
        });
        // A new inbox may be made current at once: nothing was posted to it
        // yet, so no message can be overtaken (consumers of the inbox this
        // thread knew before only switch from direct pushes to posts).
        make_current(&inbox);
        drop(handle.spawn(mailman(inbox.clone())));
        Some(inbox)
    }

    /// Whether the calling thread is this inbox's loop, so a push may go
    /// straight into the consumer's buffer.
    #[inline]
    pub(crate) fn is_current(self: &Arc<Self>) -> bool {
        CURRENT.with(|c| std::ptr::eq(c.get(), Arc::as_ptr(self)))
    }

    /// Appends a message whose room its consumer already reserved. Hands it
    /// back if the loop is gone.
    pub(crate) fn post(
        &self,
        queue: Arc<ConsumerQueue>,
        env: Envelope,
    ) -> Result<(), (Arc<ConsumerQueue>, Envelope)> {
        let waker = {
            let mut s = self.state.lock();
            if !s.open {
                return Err((queue, env));
            }
            s.items.push((queue, env));
            s.mailman.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// Swaps everything posted into `out` (empty on entry), or parks the mailman.
    fn poll_take(
        &self,
        cx: &mut Context<'_>,
        out: &mut Vec<(Arc<ConsumerQueue>, Envelope)>,
    ) -> Poll<()> {
        let mut s = self.state.lock();
        if s.items.is_empty() {
            match &s.mailman {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => s.mailman = Some(cx.waker().clone()),
            }
            return Poll::Pending;
        }
        std::mem::swap(&mut s.items, out);
        Poll::Ready(())
    }

    /// Marks the inbox closed and answers what it still held.
    fn close(&self) {
        let left = {
            let mut s = self.state.lock();
            s.open = false;
            std::mem::take(&mut s.items)
        };
        for (queue, env) in left {
            queue.undeliverable(env);
        }
    }
}

/// Closes the inbox when the mailman task is dropped (runtime shutdown).
struct CloseOnDrop(Arc<Inbox>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// The mailman: on the home loop, moves posted messages into their buffers.
async fn mailman(inbox: Arc<Inbox>) {
    let inbox = CloseOnDrop(inbox);
    let mut batch = Vec::new();
    loop {
        std::future::poll_fn(|cx| {
            make_current(&inbox.0);
            inbox.0.poll_take(cx, &mut batch)
        })
        .await;
        for (queue, env) in batch.drain(..) {
            queue.deliver_posted(env);
        }
        // Let the consumers just woken (and everything else on this loop)
        // run before the next batch, however fast mail keeps coming.
        tokio::task::yield_now().await;
    }
}

/// Records that `inbox`'s loop runs on this thread.
fn make_current(inbox: &Arc<Inbox>) {
    let ptr = Arc::as_ptr(inbox);
    if CURRENT.with(Cell::get) != ptr {
        HOME.with(|h| *h.borrow_mut() = Some(inbox.clone()));
        CURRENT.with(|c| c.set(ptr));
    }
}
