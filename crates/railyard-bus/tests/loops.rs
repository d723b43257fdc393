//! Consumers on event loops (one single-threaded runtime per thread) fed by
//! senders on other loops: the cross-thread hand-off. Each test runs twice:
//! with a task per consumer, and with the loops' dispatchers
//! (`enable_loop_dispatch`).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use railyard_bus::{
    enable_loop_dispatch, enable_loop_dispatch_relaying_wakes, BusError, Consumer, DeliveryOptions,
    EventBus,
};

/// One event loop: a thread driving a current-thread runtime.
struct Loop {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How a loop runs its consumers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// A task per consumer.
    Tasks,
    /// `enable_loop_dispatch`.
    Dispatch,
    /// An I/O driver, and `enable_loop_dispatch_relaying_wakes`.
    Relay,
}

impl Loop {
    fn start(name: &str, dispatch: bool) -> Self {
        Self::start_mode(
            name,
            if dispatch {
                Mode::Dispatch
            } else {
                Mode::Tasks
            },
        )
    }

    fn start_mode(name: &str, mode: Mode) -> Self {
        let mut b = tokio::runtime::Builder::new_current_thread();
        if mode == Mode::Relay {
            b.enable_all();
        } else {
            b.enable_time();
        }
        let rt = b.build().unwrap();
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let _ = rt.block_on(async move {
                    match mode {
                        Mode::Tasks => {}
                        Mode::Dispatch => assert!(enable_loop_dispatch()),
                        Mode::Relay => assert!(enable_loop_dispatch_relaying_wakes()),
                    }
                    stopped.await
                });
            })
            .unwrap();
        Self {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Runs `fut` on this loop and waits for its output (at most 30 s).
    fn run<F>(&self, fut: F) -> F::Output
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::channel();
        self.handle.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv_timeout(Duration::from_secs(120))
            .expect("the loop answered within 120 s")
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn one_senders_messages_cross_loops_in_order_and_all_arrive() {
    one_senders_messages_cross_loops_in_order_and_all_arrive_with(false);
    one_senders_messages_cross_loops_in_order_and_all_arrive_with(true);
}

fn one_senders_messages_cross_loops_in_order_and_all_arrive_with(dispatch: bool) {
    let (a, b) = (
        Loop::start("loop-a", dispatch),
        Loop::start("loop-b", dispatch),
    );
    let bus = EventBus::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (bb, s) = (bus.clone(), seen.clone());
    // A small buffer, so the sender keeps finding it full and waiting.
    let consumer: Consumer = b.run(async move {
        bb.consumer("ordered")
            .capacity(8)
            .handler(move |m| {
                let s = s.clone();
                async move {
                    s.lock().unwrap().push(*m.body::<u64>().unwrap());
                    tokio::task::yield_now().await;
                }
            })
            .await
            .unwrap()
    });
    const N: u64 = 20_000;
    let ba = bus.clone();
    a.run(async move {
        for i in 0..N {
            ba.send_wait("ordered", i, &DeliveryOptions::new())
                .await
                .unwrap();
        }
    });
    // Everything was accepted; wait (bounded) for the last to be handled.
    for _ in 0..3000 {
        if seen.lock().unwrap().len() as u64 == N {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len() as u64, N);
    assert!(
        seen.windows(2).all(|w| w[0] + 1 == w[1]),
        "messages from one sender arrive in send order"
    );
    let stats = consumer.stats();
    assert_eq!((stats.received, stats.delivered), (N, N));
    assert_eq!(stats.buffered, 0);
}

#[test]
fn a_full_consumer_on_another_loop_refuses_at_its_capacity() {
    a_full_consumer_on_another_loop_refuses_at_its_capacity_with(false);
    a_full_consumer_on_another_loop_refuses_at_its_capacity_with(true);
}

fn a_full_consumer_on_another_loop_refuses_at_its_capacity_with(dispatch: bool) {
    let (a, b) = (
        Loop::start("loop-a", dispatch),
        Loop::start("loop-b", dispatch),
    );
    let bus = EventBus::new();
    let bb = bus.clone();
    let consumer = b.run(async move {
        bb.consumer("tiny")
            .capacity(5)
            .paused()
            .handler(|_m| async {})
            .await
            .unwrap()
    });
    let ba = bus.clone();
    let (accepted, refused) = a.run(async move {
        let mut accepted = 0;
        let mut refused = 0;
        for i in 0..12u64 {
            match ba.send("tiny", i) {
                Ok(()) => accepted += 1,
                Err(e) => {
                    assert_eq!(
                        e.error,
                        BusError::Full {
                            address: "tiny".into()
                        }
                    );
                    assert_eq!(e.into_body().downcast_ref::<u64>(), Some(&i));
                    refused += 1;
                }
            }
        }
        (accepted, refused)
    });
    assert_eq!((accepted, refused), (5, 7));
    let stats = consumer.stats();
    assert_eq!(
        (stats.received, stats.buffered, stats.refused_full),
        (5, 5, 7)
    );
    // Let three through: the rest stay buffered, room for three more.
    consumer.fetch(3);
    for _ in 0..3000 {
        if consumer.stats().delivered == 3 {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(consumer.stats().delivered, 3);
    let ba = bus.clone();
    let more = a.run(async move { (0..5u64).filter(|i| ba.send("tiny", *i).is_ok()).count() });
    assert_eq!(more, 3);
}

#[test]
fn requests_across_loops_each_get_their_own_reply() {
    requests_across_loops_each_get_their_own_reply_with(Mode::Tasks, Mode::Tasks, 0);
    requests_across_loops_each_get_their_own_reply_with(Mode::Dispatch, Mode::Dispatch, 0);
}

/// The requesting loop relays replies' wake-ups through its dispatcher; with
/// pauses, so that its dispatcher (which has no consumer of its own) keeps
/// parking and every relayed wake-up must wake it; and with the answering
/// loop relaying too, where a reply wakes its requester on the same loop.
#[test]
fn replies_relayed_through_the_requesting_loops_dispatcher_all_arrive() {
    requests_across_loops_each_get_their_own_reply_with(Mode::Relay, Mode::Dispatch, 0);
    requests_across_loops_each_get_their_own_reply_with(Mode::Relay, Mode::Dispatch, 500);
    requests_across_loops_each_get_their_own_reply_with(Mode::Relay, Mode::Relay, 0);
}

/// `pause_us`: how long each requester sleeps after every 20th reply.
fn requests_across_loops_each_get_their_own_reply_with(a: Mode, b: Mode, pause_us: u64) {
    let (a, b) = (Loop::start_mode("loop-a", a), Loop::start_mode("loop-b", b));
    let bus = EventBus::new();
    let bb = bus.clone();
    let _doubler = b.run(async move {
        bb.consumer("double")
            .handler(|mut m| async move {
                let v = *m.body::<u64>().unwrap();
                let _ = m.reply(v * 2);
            })
            .await
            .unwrap()
    });
    let ba = bus.clone();
    let wrong = a.run(async move {
        let mut tasks = tokio::task::JoinSet::new();
        for t in 0..50u64 {
            let ba = ba.clone();
            tasks.spawn(async move {
                let mut wrong = 0;
                for i in 0..200u64 {
                    let v = t * 1000 + i;
                    let reply = ba.request("double", v).await.unwrap();
                    if *reply.body::<u64>().unwrap() != v * 2 {
                        wrong += 1;
                    }
                    if pause_us > 0 && i % 20 == 19 {
                        tokio::time::sleep(Duration::from_micros(pause_us)).await;
                    }
                }
                wrong
            });
        }
        let mut wrong = 0;
        while let Some(w) = tasks.join_next().await {
            wrong += w.unwrap();
        }
        wrong
    });
    assert_eq!(wrong, 0);
}

#[test]
fn unregistering_while_other_loops_post_answers_every_request() {
    unregistering_while_other_loops_post_answers_every_request_with(false);
    unregistering_while_other_loops_post_answers_every_request_with(true);
}

fn unregistering_while_other_loops_post_answers_every_request_with(dispatch: bool) {
    let (a, b) = (
        Loop::start("loop-a", dispatch),
        Loop::start("loop-b", dispatch),
    );
    let bus = EventBus::new();
    let bb = bus.clone();
    let echo = b.run(async move {
        bb.consumer("going")
            .handler(|mut m| async move {
                let body = m.take_body();
                let _ = m.reply(body);
            })
            .await
            .unwrap()
    });
    let ba = bus.clone();
    let answered = Arc::new(AtomicU64::new(0));
    let counted = answered.clone();
    let load = std::thread::spawn(move || {
        a.run(async move {
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..20 {
                let (ba, counted) = (ba.clone(), counted.clone());
                tasks.spawn(async move {
                    let opts = DeliveryOptions::new().timeout(Duration::from_secs(20));
                    for i in 0..500u64 {
                        match ba.request_with("going", i, &opts).await {
                            Ok(_) | Err(BusError::NoHandlers { .. }) => {
                                counted.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("unexpected failure: {e}"),
                        }
                    }
                });
            }
            while let Some(r) = tasks.join_next().await {
                r.unwrap();
            }
        });
    });
    std::thread::sleep(Duration::from_millis(20));
    b.run(echo.unregister());
    load.join().unwrap();
    assert_eq!(answered.load(Ordering::Relaxed), 20 * 500);
}

/// The dispatcher's hand-over protocol under stress: three consumers on two
/// dispatching loops, whose handlers sometimes finish at once and sometimes
/// await (moving to a task of their own and back), fed by handlers on both
/// loops and by a plain thread. Every message arrives exactly once, and each
/// sender's messages reach each consumer in order.
#[test]
fn dispatched_consumers_switching_to_tasks_lose_and_reorder_nothing() {
    const SENDERS: u64 = 3;
    const PER_SENDER: u64 = 20_000;
    let (a, b) = (Loop::start("loop-a", true), Loop::start("loop-b", true));
    let bus = EventBus::new();
    // seen[c]: (sender, sequence) pairs in the order consumer c handled them.
    type Handled = Mutex<Vec<(u64, u64)>>;
    let seen: Arc<Vec<Handled>> = Arc::new((0..3).map(|_| Mutex::new(Vec::new())).collect());
    let mut consumers = Vec::new();
    for c in 0..3usize {
        let (bus, seen) = (bus.clone(), seen.clone());
        let register = async move {
            bus.consumer("stress")
                .capacity(64)
                .handler(move |m| {
                    let seen = seen.clone();
                    async move {
                        let (sender, seq) = *m.body::<(u64, u64)>().unwrap();
                        if (seq + c as u64) % 5 == 0 {
                            tokio::task::yield_now().await;
                        }
                        seen[c].lock().unwrap().push((sender, seq));
                    }
                })
                .await
                .unwrap()
        };
        consumers.push(if c % 2 == 0 {
            a.run(register)
        } else {
            b.run(register)
        });
    }
    // Two senders are handlers on the loops (a relay consumer per loop that
    // forwards what a plain thread gives it), the third is the plain thread.
    for (name, lp) in [("relay.a", &a), ("relay.b", &b)] {
        let bus2 = bus.clone();
        let relay = lp.run(async move {
            let inner = bus2.clone();
            bus2.consumer(name)
                .capacity(PER_SENDER as usize + 1)
                .handler(move |m| {
                    let v = *m.body::<(u64, u64)>().unwrap();
                    // Waits for room like a well-behaved producer; never fails.
                    let bus = inner.clone();
                    async move {
                        bus.send_wait("stress", v, &DeliveryOptions::new())
                            .await
                            .unwrap();
                    }
                })
                .await
                .unwrap()
        });
        drop(relay); // detached: keeps running (see `Consumer`)
    }
    let feeder = {
        let bus = bus.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            rt.block_on(async move {
                let opts = DeliveryOptions::new();
                for seq in 0..PER_SENDER {
                    bus.send_wait("relay.a", (0u64, seq), &opts).await.unwrap();
                    bus.send_wait("relay.b", (1u64, seq), &opts).await.unwrap();
                    bus.send_wait("stress", (2u64, seq), &opts).await.unwrap();
                }
            });
        })
    };
    feeder.join().unwrap();
    let total = SENDERS * PER_SENDER;
    for _ in 0..3000 {
        let n: usize = seen.iter().map(|s| s.lock().unwrap().len()).sum();
        if n as u64 >= total {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_each_senders_order(&seen, SENDERS);
    let mut all = Vec::new();
    for s in seen.iter() {
        all.extend(s.lock().unwrap().iter().copied());
    }
    all.sort_unstable();
    let expected: Vec<(u64, u64)> = (0..SENDERS)
        .flat_map(|s| (0..PER_SENDER).map(move |q| (s, q)))
        .collect();
    assert_eq!(all.len(), expected.len(), "every message handled once");
    assert_eq!(all, expected);
    for c in consumers {
        let stats = c.stats();
        assert_eq!(stats.received, stats.delivered);
    }
}

/// Plain threads (not loops) schedule one loop's consumers at once, with
/// pauses so that the loop keeps parking and being woken: the dispatcher's
/// list of consumers scheduled from other threads loses no consumer and no
/// wake-up, and keeps each sender's order.
#[test]
fn many_threads_scheduling_one_loops_consumers_lose_no_wake_up() {
    const THREADS: u64 = 4;
    const CONSUMERS: u64 = 32;
    const PER_THREAD: u64 = 5_000;
    let l = Loop::start("loop-target", true);
    let bus = EventBus::new();
    /// (thread, seq) of every message one consumer handled.
    type Seen = Mutex<Vec<(u64, u64)>>;
    let seen: Arc<Vec<Seen>> = Arc::new((0..CONSUMERS).map(|_| Mutex::new(Vec::new())).collect());
    let mut consumers = Vec::new();
    for c in 0..CONSUMERS {
        let (b, s) = (bus.clone(), seen.clone());
        consumers.push(l.run(async move {
            b.consumer(format!("wake.{c}"))
                .capacity(PER_THREAD as usize * THREADS as usize)
                .handler(move |m| {
                    s[c as usize]
                        .lock()
                        .unwrap()
                        .push(*m.body::<(u64, u64)>().unwrap());
                    std::future::ready(())
                })
                .await
                .unwrap()
        }));
    }
    let senders: Vec<_> = (0..THREADS)
        .map(|t| {
            let b = bus.clone();
            std::thread::spawn(move || {
                for i in 0..PER_THREAD {
                    let c = (i + t) % CONSUMERS;
                    b.send(&format!("wake.{c}"), (t, i)).unwrap();
                    if i % 64 == 63 {
                        // Long enough for the loop to run dry and park.
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            })
        })
        .collect();
    for s in senders {
        s.join().unwrap();
    }
    let total = || {
        seen.iter()
            .map(|v| v.lock().unwrap().len() as u64)
            .sum::<u64>()
    };
    for _ in 0..3000 {
        if total() == THREADS * PER_THREAD {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(total(), THREADS * PER_THREAD, "every message was handled");
    assert_each_senders_order(&seen, THREADS);
    for c in &consumers {
        let s = c.stats();
        assert_eq!(s.received, s.delivered);
        assert_eq!(s.buffered, 0);
    }
}

/// Each consumer's log of (sender, sequence) pairs holds every sender's
/// messages in the order that sender sent them.
fn assert_each_senders_order(seen: &[Mutex<Vec<(u64, u64)>>], senders: u64) {
    for (c, log) in seen.iter().enumerate() {
        let log = log.lock().unwrap();
        for sender in 0..senders {
            let seqs: Vec<u64> = log.iter().filter(|p| p.0 == sender).map(|p| p.1).collect();
            assert!(
                seqs.windows(2).all(|w| w[0] < w[1]),
                "sender {sender}'s messages reach consumer {c} in order"
            );
        }
    }
}
