//! Polling for a while before an event loop sleeps.
//!
//! A current-thread loop with nothing to run blocks in its driver
//! (`epoll_wait`) until the kernel wakes it. Both sides pay for that sleep:
//! the thread whose write makes a socket readable wakes a sleeping thread
//! (on a virtual machine an inter-processor interrupt, a VM exit), and the
//! sleeper leaves the idle state and is scheduled again. Two nodes trading
//! messages over one connection slept and were woken about 25,000 times a
//! second each (`bench echo --cluster etcd --nodes 2`: 50,000 context
//! switches a second between them, with both cores busy).
//!
//! [`spin_before_park`] installs a hook on a current-thread runtime's
//! builder. Whenever the loop has had work within the last `window`, it
//! does not sleep when it runs out of tasks: it polls its driver without
//! blocking (`epoll_wait` with a zero timeout) and checks again, until
//! something arrives or `window` has passed without work. A loop idle for
//! longer sleeps as before.
//!
//! *Work* is what the bus's hot paths note with [`note_loop_work`]: the
//! loop's dispatcher running handlers, a consumer's handler task taking a
//! batch, a cluster link reading from its socket. `MessageStream`
//! consumers and tasks awaiting replies do not note it, nor do timers or
//! the application's own sockets. It is noted, not guessed from how long a
//! turn took: on this project's VM an empty turn takes about 150 ns, but
//! one in a few thousand takes over 2 µs (an interrupt, the hypervisor),
//! and a timing rule made an idle loop spin for good.
//!
//! How it works, with tokio's public hooks only: the park hook (run just
//! before the loop would block) wakes a task of its own that does nothing;
//! tokio then finds work pending and polls its driver with a zero timeout
//! instead of blocking.
//!
//! The cost is the CPU burnt while spinning: up to `window` after each
//! piece of work, on a core nobody else may need. It is meant for loops
//! that own a core each; on a machine with more busy threads than cores it
//! takes time from them, so the window stays short, and zero turns it off.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

thread_local! {
    /// Whether work was noted on this thread ([`note_loop_work`]) since the
    /// park hook last looked (one hook per thread: the runtime it runs).
    static WORKED: Cell<bool> = const { Cell::new(false) };
    /// Until when the loop polls instead of sleeping.
    static SPIN_UNTIL: Cell<Option<Instant>> = const { Cell::new(None) };
    /// The no-op task of the runtime this thread runs (see [`Spinning`]).
    static SPINNER: RefCell<Option<Spinning>> = const { RefCell::new(None) };
}

/// The no-op task of one runtime on this thread.
struct Spinning {
    /// Which runtime's hook spawned it: the address of that hook's key,
    /// unique while the runtime lives.
    runtime: usize,
    /// A token the task holds a clone of: once its runtime has dropped it,
    /// this is the token's only owner left.
    token: Arc<()>,
    /// Its waker, once it has been polled.
    waker: Option<Waker>,
}

/// Makes the current-thread runtime built by `builder` poll its driver
/// instead of sleeping while it had work within the last `window` (see the
/// module docs). A zero `window` installs nothing.
///
/// It installs the builder's park hook (`on_thread_park`), replacing one set
/// before (tokio keeps one); set no other after it. For current-thread
/// runtimes: on a multi-thread runtime the hook does nothing (a spinning
/// worker would hold a core its siblings' stolen work could use). Needs
/// tokio 1.52.4 or later, which polls the driver without blocking when the
/// park hook has scheduled work (the workspace asks for 1.54).
pub fn spin_before_park(
    builder: &mut tokio::runtime::Builder,
    window: Duration,
) -> &mut tokio::runtime::Builder {
    if window.is_zero() {
        return builder;
    }
    let hook = Hook {
        window,
        key: Arc::new(()),
    };
    builder.on_thread_park(move || hook.before_park())
}

/// Tells this thread's loop that it did work (see the module docs): if it
/// spins before parking, its window starts again. A thread-local store; on
/// a thread whose runtime does not spin it has no effect.
#[inline]
pub fn note_loop_work() {
    WORKED.set(true);
}

/// One runtime's park hook.
struct Hook {
    window: Duration,
    /// Tells this runtime's no-op task from another's (see [`Spinning`]).
    key: Arc<()>,
}

impl Hook {
    fn before_park(&self) {
        let worked = WORKED.replace(false);
        let until = if worked {
            let until = Instant::now() + self.window;
            SPIN_UNTIL.set(Some(until));
            Some(until)
        } else {
            SPIN_UNTIL.get()
        };
        // No clock read while idle: the window is checked only while it is
        // open.
        match until {
            Some(until) if worked || Instant::now() < until => self.keep_polling(),
            Some(_) => SPIN_UNTIL.set(None),
            None => {}
        }
    }

    /// Gives the loop a task to run, so that it polls its driver without
    /// blocking. The hook runs inside the runtime's context, so the wake puts
    /// the task on this loop's own queue.
    fn keep_polling(&self) {
        let runtime = Arc::as_ptr(&self.key) as usize;
        SPINNER.with_borrow_mut(|slot| {
            match slot {
                // This runtime's, alive: wake it. Not polled yet: it is
                // queued, which is work enough.
                Some(s) if s.runtime == runtime && Arc::strong_count(&s.token) > 1 => {
                    if let Some(w) = &s.waker {
                        w.wake_by_ref();
                    }
                }
                // None yet, or one of a runtime this thread ran before (its
                // waker goes now).
                _ => {
                    let Ok(handle) = tokio::runtime::Handle::try_current() else {
                        return;
                    };
                    if handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
                        return;
                    }
                    let token = Arc::new(());
                    drop(handle.spawn(Spinner(token.clone())));
                    *slot = Some(Spinning {
                        runtime,
                        token,
                        waker: None,
                    });
                }
            }
        });
    }
}

/// The task the park hook wakes; it only keeps its waker.
struct Spinner(Arc<()>);

impl Future for Spinner {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        #[cfg(test)]
        tests::POLLS.set(tests::POLLS.get() + 1);
        SPINNER.with_borrow_mut(|slot| {
            if let Some(s) = slot {
                if Arc::ptr_eq(&s.token, &self.0)
                    && !s.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker()))
                {
                    s.waker = Some(cx.waker().clone());
                }
            }
        });
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    thread_local! {
        /// Polls of this thread's no-op tasks.
        pub(super) static POLLS: Cell<u64> = const { Cell::new(0) };
    }

    /// How many times the loop parks (tokio runs the park hook before every
    /// park, blocking or not) while it sleeps `run` after noting work or
    /// not. The hook counts, then does what `spin_before_park` installs
    /// (tokio keeps one hook).
    fn parks_during(window: Duration, run: Duration, work: bool) -> u64 {
        let parks = Arc::new(AtomicU64::new(0));
        let p = parks.clone();
        let hook = Hook {
            window,
            key: Arc::new(()),
        };
        let mut b = tokio::runtime::Builder::new_current_thread();
        b.enable_all();
        b.on_thread_park(move || {
            p.fetch_add(1, Ordering::Relaxed);
            hook.before_park();
        });
        let rt = b.build().unwrap();
        rt.block_on(async {
            if work {
                note_loop_work();
            }
            tokio::time::sleep(run).await;
        });
        parks.load(Ordering::Relaxed)
    }

    #[test]
    fn a_loop_polls_for_the_window_after_work_then_sleeps() {
        let ms = Duration::from_millis;
        // Each turn of a spinning loop parks without blocking: many turns.
        let spinning = parks_during(ms(20), ms(50), true);
        assert!(spinning > 1_000, "only {spinning} turns in a 20 ms window");
        // Once the window has passed without work it sleeps: over 200 ms
        // the turns stay near those of one window, not ten times more.
        let long = parks_during(ms(20), ms(200), true);
        assert!(
            long < spinning * 3,
            "{long} turns over 200 ms against {spinning} over 50 ms: the loop kept spinning"
        );
        // No work noted: it sleeps at once.
        let idle = parks_during(ms(20), ms(50), false);
        assert!(idle < 20, "{idle} turns of a loop that did no work");
    }

    #[test]
    fn without_a_window_nothing_is_installed() {
        // A counting hook first; a zero window must leave it in place.
        let parks = Arc::new(AtomicU64::new(0));
        let p = parks.clone();
        let mut b = tokio::runtime::Builder::new_current_thread();
        b.enable_all();
        b.on_thread_park(move || {
            p.fetch_add(1, Ordering::Relaxed);
        });
        spin_before_park(&mut b, Duration::ZERO);
        let rt = b.build().unwrap();
        rt.block_on(async {
            note_loop_work();
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
        let n = parks.load(Ordering::Relaxed);
        assert!((1..20).contains(&n), "{n} parks while sleeping 50 ms");
        assert!(SPINNER.with_borrow(Option::is_none), "no task spawned");
    }

    #[test]
    fn the_installed_hook_spins_after_work_and_timers_still_fire() {
        let mut b = tokio::runtime::Builder::new_current_thread();
        b.enable_all();
        spin_before_park(&mut b, Duration::from_millis(500));
        let rt = b.build().unwrap();
        let before = POLLS.get();
        let slept = rt.block_on(async {
            note_loop_work();
            // The driver is polled while the loop spins: a 1 ms timer fires
            // on time, not when a 500 ms window ends.
            let start = Instant::now();
            tokio::time::sleep(Duration::from_millis(1)).await;
            let slept = start.elapsed();
            tokio::time::sleep(Duration::from_millis(30)).await;
            slept
        });
        assert!(
            slept < Duration::from_millis(100),
            "a 1 ms sleep took {slept:?}"
        );
        let polls = POLLS.get() - before;
        assert!(
            polls > 100,
            "the no-op task ran {polls} times in 30 ms of spinning"
        );
        SPINNER.with_borrow(|s| {
            let s = s.as_ref().expect("the hook spawned its task");
            // The runtime is still alive here: it holds the task's clone.
            assert!(Arc::strong_count(&s.token) > 1);
        });
        drop(rt);
        SPINNER.with_borrow(|s| {
            let s = s.as_ref().unwrap();
            assert_eq!(
                Arc::strong_count(&s.token),
                1,
                "the task went with its runtime"
            );
        });
        // A second runtime on this thread gets a task of its own.
        let mut b = tokio::runtime::Builder::new_current_thread();
        b.enable_all();
        spin_before_park(&mut b, Duration::from_millis(50));
        let rt = b.build().unwrap();
        let before = POLLS.get();
        rt.block_on(async {
            note_loop_work();
            tokio::time::sleep(Duration::from_millis(20)).await;
        });
        assert!(
            POLLS.get() - before > 100,
            "the second runtime did not spin"
        );
    }
}
