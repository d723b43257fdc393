//! Handler consumers run by an event loop's dispatcher
//! (`enable_loop_dispatch`): the same guarantees as a task per consumer.
//! Every test enables dispatch on its (current-thread) runtime first. No
//! timing assertions.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use railyard_bus::*;
use tokio::sync::mpsc;

mod common;

/// A current-thread runtime with timers: one event loop of a test.
fn timed_loop() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

#[test]
fn dispatch_is_enabled_only_on_a_current_thread_runtime() {
    let on_current = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert!(on_current.block_on(async { enable_loop_dispatch() }));
    let on_multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    assert!(!on_multi.block_on(async { enable_loop_dispatch() }));
    assert!(!std::thread::spawn(enable_loop_dispatch).join().unwrap());
}

#[tokio::test]
async fn requests_get_replies_and_failures() {
    assert!(enable_loop_dispatch());
    let bus = EventBus::new();
    let _c = bus
        .consumer("calc")
        .handler(|mut m| async move {
            let v = *m.body::<u64>().unwrap();
            if v == 0 {
                m.fail(400, "zero").unwrap();
            } else {
                m.reply(v + 1).unwrap();
            }
        })
        .await
        .unwrap();
    let reply = bus.request("calc", 41u64).await.unwrap();
    assert_eq!(reply.body::<u64>(), Some(&42));
    let err = bus.request("calc", 0u64).await.unwrap_err();
    assert_eq!(
        err,
        BusError::RecipientFailure {
            code: 400,
            message: "zero".into()
        }
    );
}

#[tokio::test]
async fn send_round_robins_fairly() {
    assert!(enable_loop_dispatch());
    common::send_round_robins_fairly(&EventBus::new()).await;
}

/// A handler that awaits (so its consumer moves onto a task of its own for
/// the rest of the batch) still sees one sender's messages in order, one at
/// a time, while a synchronous consumer on the same loop keeps running.
#[tokio::test]
async fn awaiting_handlers_keep_order_and_do_not_block_the_loop() {
    assert!(enable_loop_dispatch());
    let bus = EventBus::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let inside = Arc::new(AtomicUsize::new(0));
    let (s, busy) = (seen.clone(), inside.clone());
    let _slow = bus
        .consumer("slow")
        .capacity(16)
        .handler(move |m| {
            let (s, busy) = (s.clone(), busy.clone());
            async move {
                assert_eq!(busy.fetch_add(1, Ordering::SeqCst), 0, "one at a time");
                let v = *m.body::<u64>().unwrap();
                if v % 3 == 0 {
                    tokio::task::yield_now().await;
                }
                if v % 7 == 0 {
                    tokio::time::sleep(Duration::from_micros(50)).await;
                }
                s.lock().unwrap().push(v);
                busy.fetch_sub(1, Ordering::SeqCst);
            }
        })
        .await
        .unwrap();
    let fast_count = Arc::new(AtomicUsize::new(0));
    let f = fast_count.clone();
    let _fast = bus
        .consumer("fast")
        .handler(move |_m| {
            f.fetch_add(1, Ordering::Relaxed);
            std::future::ready(())
        })
        .await
        .unwrap();
    const N: u64 = 2_000;
    let opts = DeliveryOptions::new();
    for i in 0..N {
        bus.send_wait("slow", i, &opts).await.unwrap();
        bus.send("fast", i).unwrap();
    }
    for _ in 0..100_000 {
        if seen.lock().unwrap().len() as u64 == N {
            break;
        }
        tokio::task::yield_now().await;
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len() as u64, N);
    assert!(seen.windows(2).all(|w| w[0] + 1 == w[1]), "in send order");
    assert_eq!(fast_count.load(Ordering::Relaxed) as u64, N);
}

/// A handler that sends to another consumer of its own loop schedules it on
/// the loop's local list: a long chain of hand-offs completes.
#[tokio::test]
async fn chains_of_sends_within_the_loop_complete() {
    assert!(enable_loop_dispatch());
    let bus = EventBus::new();
    let (tx, mut rx) = mpsc::unbounded_channel();
    for hop in 0..4u64 {
        let (b, tx) = (bus.clone(), tx.clone());
        bus.consumer(format!("hop.{hop}"))
            .handler(move |mut m| {
                let v = *m.body::<u64>().unwrap();
                if v == 0 {
                    tx.send(hop).unwrap();
                } else {
                    let _ = m.take_body();
                    b.send(&format!("hop.{}", (hop + 1) % 4), v - 1).unwrap();
                }
                std::future::ready(())
            })
            .await
            .unwrap();
    }
    bus.send("hop.0", 10_001u64).unwrap();
    // 10,001 hops after hop.0: the last one lands on hop (10,001 % 4).
    assert_eq!(rx.recv().await, Some(1));
}

#[tokio::test]
async fn pause_fetch_resume_control_delivery() {
    assert!(enable_loop_dispatch());
    common::pause_fetch_resume_control_delivery(&EventBus::new()).await;
}

#[tokio::test]
async fn a_full_buffer_refuses_and_send_wait_waits_for_room() {
    assert!(enable_loop_dispatch());
    let bus = EventBus::new();
    let c = bus
        .consumer("narrow")
        .capacity(2)
        .paused()
        .handler(|_m| async {})
        .await
        .unwrap();
    bus.send("narrow", 0u8).unwrap();
    bus.send("narrow", 1u8).unwrap();
    let e = bus.send("narrow", 2u8).unwrap_err();
    assert_eq!(
        e.error,
        BusError::Full {
            address: "narrow".into()
        }
    );
    assert_eq!(e.into_body().downcast_ref::<u8>(), Some(&2));
    let waiting = {
        let bus = bus.clone();
        tokio::spawn(async move { bus.send_wait("narrow", 3u8, &DeliveryOptions::new()).await })
    };
    c.resume();
    waiting.await.unwrap().unwrap();
    while c.stats().delivered < 3 {
        tokio::task::yield_now().await;
    }
    assert_eq!(c.stats().refused_full, 1);
}

#[tokio::test]
async fn a_panicking_handler_fails_that_request_and_keeps_consuming() {
    assert!(enable_loop_dispatch());
    let bus = EventBus::new();
    let _c = bus
        .consumer("fragile")
        .handler(|mut m| async move {
            let v = *m.body::<u64>().unwrap();
            assert!(v != 13, "unlucky");
            m.reply(v).unwrap();
        })
        .await
        .unwrap();
    let err = bus.request("fragile", 13u64).await.unwrap_err();
    assert_eq!(err.kind(), FailureKind::Error);
    assert_eq!(
        bus.request("fragile", 7u64).await.unwrap().body(),
        Some(&7u64)
    );
}

#[tokio::test]
async fn unregister_waits_for_the_batch_and_fails_what_was_buffered() {
    assert!(enable_loop_dispatch());
    let bus = EventBus::new();
    let started = Arc::new(tokio::sync::Notify::new());
    let s = started.clone();
    let c = bus
        .consumer("leaving")
        .handler(move |mut m| {
            let s = s.clone();
            async move {
                s.notify_one();
                // Awaits: the batch continues on the consumer's own task.
                tokio::task::yield_now().await;
                tokio::task::yield_now().await;
                let _ = m.reply(());
            }
        })
        .await
        .unwrap();
    let first = {
        let bus = bus.clone();
        tokio::spawn(async move { bus.request("leaving", ()).await })
    };
    started.notified().await;
    c.unregister().await;
    first
        .await
        .unwrap()
        .expect("the request in progress was answered");
    let err = bus.request("leaving", ()).await.unwrap_err();
    assert_eq!(err.kind(), FailureKind::NoHandlers);
}

#[tokio::test]
async fn streams_are_unaffected_by_dispatch() {
    assert!(enable_loop_dispatch());
    let bus = EventBus::new();
    let mut stream = bus.consumer("s").stream().await.unwrap();
    bus.send("s", 5u32).unwrap();
    let m = stream.next().await.unwrap();
    assert_eq!(m.body::<u32>(), Some(&5));
}

/// A dispatched handler mid-await when its loop's runtime shuts down:
/// `unregister`, awaited elsewhere, still finishes (it waited for that
/// batch's end forever, while a consumer with its own task returned).
#[test]
fn unregister_finishes_when_the_loop_died_mid_handler() {
    let bus = EventBus::new();
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let bus2 = bus.clone();
    let consumer = std::thread::spawn(move || {
        let rt = timed_loop();
        let consumer = rt.block_on(async {
            assert!(enable_loop_dispatch());
            let c = bus2
                .consumer("stuck")
                .handler(move |_m| {
                    let started = started_tx.clone();
                    async move {
                        let _ = started.send(());
                        std::future::pending::<()>().await;
                    }
                })
                .await
                .unwrap();
            bus2.send("stuck", 1u32).unwrap();
            // Run the loop until the handler is mid-await on its task.
            for _ in 0..1000 {
                tokio::task::yield_now().await;
            }
            c
        });
        drop(rt);
        consumer
    })
    .join()
    .unwrap();
    started_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the handler started before the loop stopped");
    let other = timed_loop();
    other.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), consumer.unregister())
            .await
            .expect("unregister must not wait for a batch whose loop is gone");
    });
}

/// `unregister` of a dispatched consumer whose handler is mid-await, awaited
/// on a runtime without a timer: it waits for the handler and returns (it
/// panicked with "timers are disabled").
#[test]
fn unregister_waits_without_a_timer_on_the_awaiting_runtime() {
    let bus = EventBus::new();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<tokio::sync::oneshot::Sender<()>>();
    let (consumer_tx, consumer_rx) = std::sync::mpsc::channel();
    let bus2 = bus.clone();
    // The consumer's loop runs for the whole test.
    std::thread::spawn(move || {
        let rt = timed_loop();
        rt.block_on(async {
            assert!(enable_loop_dispatch());
            let c = bus2
                .consumer("slow")
                .handler(move |_m| {
                    let release = release_tx.clone();
                    async move {
                        let (tx, rx) = tokio::sync::oneshot::channel();
                        let _ = release.send(tx);
                        let _ = rx.await;
                    }
                })
                .await
                .unwrap();
            bus2.send("slow", 1u32).unwrap();
            let _ = consumer_tx.send(c);
            // Keep the loop alive until the test ends.
            std::future::pending::<()>().await;
        });
    });
    let consumer = consumer_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    let release = release_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the handler is mid-await");
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let no_timer = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        no_timer.block_on(consumer.unregister());
        let _ = done_tx.send(());
    });
    // Still waiting for the handler while it awaits.
    assert!(done_rx.recv_timeout(Duration::from_millis(100)).is_err());
    release.send(()).unwrap();
    done_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("unregister returns once the handler finished");
}

/// A one-shot consumer: its handler unregisters it. On a dispatched loop
/// and on a plain task, `unregister` called from the handler resolves at
/// once (it waited for the batch the handler itself was in, for ever), and
/// no later message reaches the consumer.
#[tokio::test]
async fn a_consumer_can_unregister_itself_from_its_handler() {
    for dispatched in [true, false] {
        let bus = EventBus::new();
        let rt = timed_loop();
        let seen = Arc::new(AtomicUsize::new(0));
        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        let (bus2, seen2) = (bus.clone(), seen.clone());
        std::thread::spawn(move || {
            rt.block_on(async move {
                if dispatched {
                    assert!(enable_loop_dispatch());
                }
                let slot: Arc<Mutex<Option<Consumer>>> = Arc::default();
                let s = slot.clone();
                let c = bus2
                    .consumer("once")
                    .handler(move |_m| {
                        let (s, seen, done) = (s.clone(), seen2.clone(), done_tx.clone());
                        async move {
                            seen.fetch_add(1, Ordering::SeqCst);
                            let me = s.lock().unwrap().take();
                            if let Some(me) = me {
                                me.unregister().await;
                                let _ = done.send(());
                            }
                        }
                    })
                    .await
                    .unwrap();
                *slot.lock().unwrap() = Some(c);
                bus2.send("once", 1u8).unwrap();
                // Keep the loop running for the handler.
                tokio::time::sleep(Duration::from_secs(3)).await;
            });
        });
        tokio::time::timeout(Duration::from_secs(2), done_rx.recv())
            .await
            .unwrap_or_else(|_| {
                panic!("unregister from the handler hung (dispatched: {dispatched})")
            })
            .expect("done");
        assert!(bus.send("once", 2u8).is_err(), "unregistered");
        assert_eq!(seen.load(Ordering::SeqCst), 1);
    }
}
