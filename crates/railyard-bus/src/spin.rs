//! The lock of the consumer queues (and of `railyard-cluster`'s outbound
//! link queues): a test-and-set spin lock whose release is a plain store.
//!
//! Why not `parking_lot::Mutex`: its unlock is a compare-and-swap (it must
//! check for parked waiters), so every lock/unlock pair costs two locked
//! instructions. A message hand-off takes the queue lock twice (the sender's
//! push, the consumer's take), and on this project's 2-vCPU VM a locked
//! instruction costs as much as a few dozen plain ones: that unlock was a
//! measurable share of a send (see docs/benchmarks.md, "What moved the
//! numbers"). The sections this lock guards are a handful of instructions,
//! never span an `.await` and never wake anything, so waiting by spinning
//! (with `crossbeam_utils::Backoff`, which yields the thread after a few
//! rounds) is cheaper than parking. Do not use it for anything longer.
//!
//! Exported for `railyard-cluster`'s outbound queue, which every message to
//! another node goes through and whose sections are as short; it is not
//! meant as a general-purpose lock.

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_utils::Backoff;

/// A spin lock around `T`; see the module docs for when it fits.
///
/// `repr(C)`: the flag comes first, so it shares a cache line with the
/// first fields of `T` (the consumer queue puts its hottest ones there).
#[repr(C)]
pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// Safety: the lock hands out access to `value` to one thread at a time.
unsafe impl<T: Send> Sync for SpinLock<T> {}
// Safety: owning the lock owns the value.
unsafe impl<T: Send> Send for SpinLock<T> {}

impl<T> std::fmt::Debug for SpinLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The value is not shown: reading it would need the lock.
        f.debug_struct("SpinLock")
            .field("locked", &self.locked.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<T> SpinLock<T> {
    /// An unlocked lock around `value`.
    pub const fn new(value: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, spinning (then yielding) while another thread has it.
    #[inline]
    pub fn lock(&self) -> SpinGuard<'_, T> {
        if self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        SpinGuard {
            lock: self,
            _access: PhantomData,
        }
    }

    #[cold]
    fn lock_contended(&self) {
        let backoff = Backoff::new();
        loop {
            // Wait on a plain load, so the line is shared, not bounced.
            while self.locked.load(Ordering::Relaxed) {
                backoff.snooze();
            }
            if self
                .locked
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }
}

/// Access to the locked value; releases the lock when dropped.
pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
    /// The guard hands out `&mut T`: it may be shared between threads only
    /// when `T` may (`&SpinLock<T>` alone would make it `Sync` for any
    /// `T: Send`, and two threads could then use a `Cell` through it).
    _access: PhantomData<&'a mut T>,
}

impl<T> std::fmt::Debug for SpinGuard<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpinGuard").finish_non_exhaustive()
    }
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // Safety: the guard holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // Safety: the guard holds the lock, and `&mut self` makes this the
        // only reference through it.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::SpinLock;
    use std::sync::Arc;

    #[test]
    fn threads_incrementing_under_the_lock_lose_nothing() {
        let lock = Arc::new(SpinLock::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..100_000 {
                        *lock.lock() += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), 400_000);
    }
}
