//! Micro-benchmarks of the bus's hot paths: `send` into a consumer buffer,
//! `publish`, and a full request/reply round trip on one thread.

use std::hint::black_box;

use criterion::{criterion_main, BatchSize, Criterion, Throughput};
use futures::StreamExt;
use railyard_bus::{EventBus, Message};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn send(c: &mut Criterion) {
    let rt = runtime();
    let bus = EventBus::new();
    let mut stream = rt
        .block_on(bus.consumer("bench.send").capacity(1 << 16).stream())
        .expect("register");
    let mut g = c.benchmark_group("send");
    g.throughput(Throughput::Elements(1024));
    g.bench_function("send 1024 then drain", |b| {
        b.iter(|| {
            for i in 0..1024u64 {
                bus.send("bench.send", i).expect("room");
            }
            rt.block_on(async {
                for _ in 0..1024 {
                    black_box(stream.next().await);
                }
            });
        });
    });
    g.finish();
}

fn publish(c: &mut Criterion) {
    let rt = runtime();
    let bus = EventBus::new();
    let mut streams: Vec<_> = (0..4)
        .map(|_| {
            rt.block_on(bus.consumer("bench.pub").capacity(1 << 12).stream())
                .expect("register")
        })
        .collect();
    let mut g = c.benchmark_group("publish");
    g.throughput(Throughput::Elements(256));
    g.bench_function("publish 256 to 4 consumers then drain", |b| {
        b.iter(|| {
            for i in 0..256u64 {
                bus.publish("bench.pub", i).expect("no veto");
            }
            rt.block_on(async {
                for s in &mut streams {
                    for _ in 0..256 {
                        black_box(s.next().await);
                    }
                }
            });
        });
    });
    g.finish();
}

fn request(c: &mut Criterion) {
    let rt = runtime();
    let bus = EventBus::new();
    let _c = rt
        .block_on(
            bus.consumer("bench.req")
                .handler(|mut m: Message| async move {
                    let v = m.take_body();
                    let _ = m.reply(v);
                }),
        )
        .expect("register");
    let mut g = c.benchmark_group("request");
    g.throughput(Throughput::Elements(1));
    g.bench_function("request-reply round trip, one thread", |b| {
        b.iter_batched(
            || (),
            |()| {
                rt.block_on(async {
                    black_box(bus.request("bench.req", 1u64).await.expect("reply"))
                })
            },
            BatchSize::SmallInput,
        );
    });
    g.throughput(Throughput::Elements(64));
    g.bench_function("64 requests in flight, one thread", |b| {
        b.iter(|| {
            rt.block_on(async {
                let pending: Vec<_> = (0..64u64).map(|i| bus.request("bench.req", i)).collect();
                for p in pending {
                    black_box(p.await.expect("reply"));
                }
            });
        });
    });
    g.finish();
}

mod group {
    #![allow(missing_docs)]
    criterion::criterion_group!(benches, super::send, super::publish, super::request);
}
use group::benches;
criterion_main!(benches);
