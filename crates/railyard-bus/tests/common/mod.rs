//! Behaviours checked in both consumer modes: a task per consumer
//! (`tests/bus.rs`) and event-loop dispatch (`tests/dispatch.rs`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use railyard_bus::EventBus;
use tokio::sync::mpsc;

/// Three consumers at one address get exactly a third of 300 sends each.
pub(crate) async fn send_round_robins_fairly(bus: &EventBus) {
    let counts: Arc<Vec<AtomicUsize>> = Arc::new((0..3).map(|_| AtomicUsize::new(0)).collect());
    let mut consumers = vec![];
    for i in 0..3 {
        let counts = counts.clone();
        consumers.push(
            bus.consumer("rr")
                .handler(move |_m| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                    async {}
                })
                .await
                .unwrap(),
        );
    }
    assert_eq!(bus.consumer_count("rr"), 3);
    for i in 0..300u64 {
        bus.send("rr", i).unwrap();
    }
    while bus.metrics().delivered() < 300 {
        tokio::task::yield_now().await;
    }
    for c in consumers {
        c.unregister().await;
    }
    let got: Vec<usize> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    assert_eq!(got, vec![100, 100, 100]);
}

/// A paused consumer gets nothing; `fetch(n)` lets exactly `n` through;
/// `resume` the rest; `pause` stops delivery again.
pub(crate) async fn pause_fetch_resume_control_delivery(bus: &EventBus) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let c = bus
        .consumer("gated")
        .paused()
        .handler(move |m| {
            let tx = tx.clone();
            async move { tx.send(*m.body::<u64>().unwrap()).unwrap() }
        })
        .await
        .unwrap();
    for i in 0..10u64 {
        bus.send("gated", i).unwrap();
    }
    tokio::task::yield_now().await;
    assert!(rx.try_recv().is_err(), "paused: nothing delivered");
    c.fetch(3);
    for want in 0..3u64 {
        assert_eq!(rx.recv().await, Some(want));
    }
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(
        rx.try_recv().is_err(),
        "fetch(3) lets exactly three through"
    );
    assert_eq!(c.stats().buffered, 7);
    c.resume();
    for want in 3..10u64 {
        assert_eq!(rx.recv().await, Some(want));
    }
    c.pause();
    bus.send("gated", 10u64).unwrap();
    tokio::task::yield_now().await;
    assert!(rx.try_recv().is_err());
}
