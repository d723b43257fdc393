//! How far apart the machine's cores are right now: the time a cache line
//! takes to go from one thread to another and back.
//!
//! Why: on the virtual machines the bench lab runs on, the host moves the
//! vCPUs between close and distant cores, and a line round trip switches
//! between about 60 and 320 ns within seconds (docs/benchmarks.md, "What
//! the slow mode is"). Everything that hands messages between two event
//! loops follows it (an echo on two loops: 6.3M round trips/s against
//! 2.3M), Railyard and the peers alike, while computation does not. A run's
//! figure means little without knowing which mode it had, so the echo
//! bench measures this before and after every run of either system and
//! reports it with the run.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

/// Round trips per probe, in [`CHUNKS`] chunks: about 1 ms in the fast
/// mode, 6 ms in the slow one.
const ROUND_TRIPS: u32 = 20_000;

/// A probe's chunks; the fastest one's mean is the answer, so a thread
/// preempted during one chunk (by a process exiting, a timer) does not
/// pass for the slow mode.
const CHUNKS: u32 = 5;

/// Longest a probe runs, whatever the machine does (a descheduled thread).
const BOUND: Duration = Duration::from_millis(200);

/// Above this many nanoseconds per line round trip, a run is counted in the
/// slow mode: between the two modes measured here (52-65 ns, 315-340 ns).
pub const SLOW_LINE_NS: f64 = 150.0;

/// Nanoseconds for one cache-line round trip between this thread and
/// another one (unpinned: wherever the scheduler puts them, as a bench's
/// threads are): the mean of the fastest of five chunks. Blocks for at
/// most 200 ms and a thread spawn; call it off async workers
/// ([`line_round_trip_ns_async`]).
#[must_use]
pub fn line_round_trip_ns() -> f64 {
    let flag = Arc::new(CachePadded::new(AtomicU32::new(0)));
    let other = flag.clone();
    let deadline = Instant::now() + BOUND;
    // The other side answers each odd value with the next even one.
    let pong = std::thread::spawn(move || {
        for k in 0..ROUND_TRIPS {
            if !wait_for(&other, 2 * k + 1, deadline) {
                return;
            }
            other.store(2 * k + 2, Ordering::Release);
        }
    });
    let per_chunk = ROUND_TRIPS / CHUNKS;
    let mut best = f64::INFINITY;
    let mut i = 0u32;
    'chunks: for _ in 0..CHUNKS {
        let t0 = Instant::now();
        for _ in 0..per_chunk {
            flag.store(2 * i + 1, Ordering::Release);
            if !wait_for(&flag, 2 * i + 2, deadline) {
                break 'chunks;
            }
            i += 1;
        }
        best = best.min(t0.elapsed().as_nanos() as f64 / f64::from(per_chunk));
    }
    let _ = pong.join();
    if best.is_finite() {
        best
    } else {
        // Not one chunk within the bound: the threads hardly ran.
        BOUND.as_nanos() as f64 / f64::from(i.max(1))
    }
}

/// Spins until `flag` holds `value`; `false` if `deadline` passed first
/// (the clock is read once every 4,096 spins, not per round trip).
fn wait_for(flag: &AtomicU32, value: u32, deadline: Instant) -> bool {
    let mut spins = 0u32;
    while flag.load(Ordering::Acquire) != value {
        spins = spins.wrapping_add(1);
        if spins % 4096 == 0 && Instant::now() >= deadline {
            return false;
        }
        std::hint::spin_loop();
    }
    true
}

/// [`line_round_trip_ns`] on the blocking pool, rounded to whole ns.
pub async fn line_round_trip_ns_async() -> f64 {
    tokio::task::spawn_blocking(line_round_trip_ns)
        .await
        .map_or(f64::NAN, f64::round)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_round_trip_takes_some_time_and_the_probe_ends() {
        let t0 = Instant::now();
        let ns = line_round_trip_ns();
        // Any machine: a round trip through another core's cache (or a
        // switch between two threads on one core) costs more than a
        // nanosecond, and the mean is a finite number.
        assert!(ns.is_finite() && ns > 1.0, "{ns} ns");
        assert!(t0.elapsed() < BOUND + Duration::from_secs(2), "bounded");
    }
}
