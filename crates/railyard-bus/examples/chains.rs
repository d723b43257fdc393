//! A fixed amount of echo traffic on one thread, for instruction counting.
//!
//! `cargo run --release -p railyard-bus --example chains -- send-send 200000`
//! runs seed 001's echo shape (two echo consumers, 64 chains) until that many
//! round trips completed, then exits. Under `valgrind --tool=callgrind`, the
//! difference between two counts divided by the difference in round trips is
//! the bus's instructions per round trip: a figure that, unlike a time, does
//! not move when the machine is busy.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use railyard_bus::{DeliveryOptions, EventBus};

const ECHO: &str = "echo";
const REPLY_TO: &str = "replyTo";
const CHAINS: usize = 64;

fn main() {
    let mut args = std::env::args().skip(1);
    let method = args.next().unwrap_or_else(|| "send-send".into());
    let target: u64 = args.next().and_then(|n| n.parse().ok()).unwrap_or(200_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    let local = tokio::task::LocalSet::new();
    let done = local.block_on(&rt, run(&method, target));
    println!("{method}: {done} round trips");
}

async fn run(method: &str, target: u64) -> u64 {
    let bus = EventBus::new();
    let count = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let finished = Rc::new(tokio::sync::Notify::new());
    let mut echoes = Vec::new();
    for _ in 0..2 {
        let b = bus.clone();
        let c = if method == "send-send" {
            bus.consumer(ECHO)
                .handler(move |mut m| {
                    let body = m.take_body();
                    if let Some(to) = m.headers().get(REPLY_TO) {
                        let _ = b.send(to, body);
                    }
                    std::future::ready(())
                })
                .await
        } else {
            bus.consumer(ECHO)
                .handler(|mut m| {
                    let body = m.take_body();
                    let _ = m.reply(body);
                    std::future::ready(())
                })
                .await
        };
        echoes.push(c.expect("register"));
    }
    let counted = Rc::new(Cell::new(0u64));
    if method == "send-send" {
        let all_done = Arc::new(tokio::sync::Notify::new());
        let mut chains = Vec::new();
        for c in 0..CHAINS {
            let address = format!("echo.reply.{c}");
            let opts = DeliveryOptions::new().header(REPLY_TO, address.clone());
            let (b, o, n, s) = (bus.clone(), opts.clone(), count.clone(), stop.clone());
            let all_done = all_done.clone();
            let consumer = bus
                .consumer(address)
                .handler(move |mut m| {
                    if !s.load(Ordering::Relaxed) {
                        let v = n.load(Ordering::Relaxed) + 1;
                        n.store(v, Ordering::Relaxed);
                        if v >= target {
                            s.store(true, Ordering::Relaxed);
                            all_done.notify_one();
                        } else {
                            let _ = b.send_with(ECHO, m.take_body(), &o);
                        }
                    }
                    std::future::ready(())
                })
                .await
                .expect("register");
            chains.push(consumer);
            bus.send_with(ECHO, c as u64, &opts)
                .expect("an echo consumer");
        }
        all_done.notified().await;
        count.load(Ordering::Relaxed)
    } else {
        for c in 0..CHAINS {
            let (b, counted, finished) = (bus.clone(), counted.clone(), finished.clone());
            tokio::task::spawn_local(async move {
                let mut body = railyard_bus::Body::new(c as u64);
                while counted.get() < target {
                    let mut m = b.request(ECHO, body).await.expect("an echo");
                    body = m.take_body();
                    counted.set(counted.get() + 1);
                }
                finished.notify_one();
            });
        }
        finished.notified().await;
        counted.get()
    }
}
