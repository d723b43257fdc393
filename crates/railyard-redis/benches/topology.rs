//! The cost of topology work at 96 and 1000 nodes: fingerprinting one
//! `CLUSTER NODES` reply, parsing one, building the slot table, and a whole
//! full refresh's blocking work (every node's reply tallied, the distinct
//! views parsed, the table built).
//!
//! Before the timed benches it prints, per size, the bytes allocated during
//! one full refresh and the bytes still held afterwards (the table), counted
//! by a wrapping global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use criterion::{black_box, criterion_main, Criterion};
use railyard_redis::double::synthetic_cluster_nodes;
use railyard_redis::thread_cpu_ns;
use railyard_redis::topology::{build_table, fingerprint, parse_nodes, Candidate, ViewTally};

struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);
static LIVE: AtomicUsize = AtomicUsize::new(0);

// Safety: forwards to the system allocator unchanged and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(l.size(), Ordering::Relaxed);
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        // Safety: the caller upholds GlobalAlloc::alloc's contract.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // Safety: `p` came from `alloc` with this layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Every node's reply, as a full refresh receives them.
fn replies(masters: usize) -> Vec<(Arc<str>, Bytes)> {
    let n = masters * 2;
    (0..n)
        .map(|i| {
            (
                Arc::from(format!("127.0.0.1:{}", 30000 + i)),
                synthetic_cluster_nodes(masters, 1, i),
            )
        })
        .collect()
}

fn full_refresh(replies: &[(Arc<str>, Bytes)]) -> railyard_redis::topology::Tallied {
    let mut t = ViewTally::default();
    for (node, text) in replies {
        t.add(node.clone(), text.clone());
    }
    t.finish().expect("valid views")
}

fn report_memory_and_cpu() {
    for masters in [48, 500] {
        let r = replies(masters);
        let live0 = LIVE.load(Ordering::Relaxed);
        let alloc0 = ALLOCATED.load(Ordering::Relaxed);
        let cpu0 = thread_cpu_ns();
        let built = full_refresh(&r);
        let cpu = thread_cpu_ns() - cpu0;
        let allocated = ALLOCATED.load(Ordering::Relaxed) - alloc0;
        let retained = LIVE.load(Ordering::Relaxed) - live0;
        eprintln!(
            "full refresh, {} nodes ({} bytes per reply): cpu {:.2} ms, allocated {} KiB, retained {} KiB (table heap estimate {} KiB), {} views, {} distinct",
            masters * 2,
            r[0].1.len(),
            cpu as f64 / 1e6,
            allocated / 1024,
            retained / 1024,
            built.table.heap_bytes() / 1024,
            built.views,
            built.distinct
        );
        black_box(built);
    }
}

fn bench(c: &mut Criterion) {
    report_memory_and_cpu();
    for masters in [48usize, 500] {
        let n = masters * 2;
        let text = synthetic_cluster_nodes(masters, 1, 0);
        let view = parse_nodes(&text).expect("valid");
        let r = replies(masters);
        let mut g = c.benchmark_group(format!("topology/{n}-nodes"));
        g.bench_function("fingerprint one reply", |b| {
            b.iter(|| fingerprint(black_box(&text)))
        });
        g.bench_function("parse one reply", |b| {
            b.iter(|| parse_nodes(black_box(&text)))
        });
        let cand = [Candidate {
            view: view.clone(),
            votes: n,
            fingerprint: 1,
        }];
        g.bench_function("build table", |b| b.iter(|| build_table(black_box(&cand))));
        g.sample_size(10);
        g.bench_function("full refresh (all replies)", |b| {
            b.iter(|| full_refresh(black_box(&r)))
        });
        g.finish();
    }
}

mod group {
    #![allow(missing_docs)]
    criterion::criterion_group!(benches, super::bench);
}
use group::benches;
criterion_main!(benches);
