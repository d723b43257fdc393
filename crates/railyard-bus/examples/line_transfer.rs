//! How long one cache line takes to move between two cores, measured: two
//! threads hand a counter back and forth through one atomic.
//!
//! ```sh
//! cargo run --release -p railyard-bus --example line_transfer
//! ```
//!
//! On this project's 2-vCPU VM the answer is either about 45 ns or about
//! 210 ns, and it changes from minute to minute (the host moves the vCPUs
//! between nearby and distant cores). Every cross-thread hand-off in the bus
//! pays a few of these, which is why echo send-send between two loops has
//! two modes (docs/benchmarks.md, "Noise").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

fn main() {
    const HAND_OFFS: u64 = 2_000_000;
    let turn = Arc::new(AtomicU64::new(0));
    let other = turn.clone();
    let peer = std::thread::spawn(move || {
        let mut i = 1;
        while i < 2 * HAND_OFFS {
            while other.load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
            other.store(i + 1, Ordering::Release);
            i += 2;
        }
    });
    let start = Instant::now();
    let mut i = 0;
    while i < 2 * HAND_OFFS {
        while turn.load(Ordering::Acquire) != i {
            std::hint::spin_loop();
        }
        turn.store(i + 1, Ordering::Release);
        i += 2;
    }
    peer.join().expect("the peer thread finished");
    let ns = start.elapsed().as_nanos() as f64 / (2 * HAND_OFFS) as f64;
    println!("one-way cache-line transfer: {ns:.0} ns");
}
