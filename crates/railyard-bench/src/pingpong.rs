//! Seed 000: 500k request/reply messages between two "verticles".
//!
//! A consumer at `ping-address` replies with the body; once its registration
//! has completed, a producer on another event loop sends every message as a
//! request and collects the replies, printing the seed's progress lines.

use std::time::Instant;

use railyard_bus::EventBus;
use serde::Serialize;
use std::collections::VecDeque;

use crate::cluster::{self, ClusterBenchError, ClusterTarget, ServeConfig, ServerProcess};
use crate::echo::{ConsumerKind, Method};
use crate::loops::{EventLoops, RuntimeKind};

/// Pingpong settings.
#[derive(Debug, Clone)]
pub struct PingpongConfig {
    /// Messages to send (the seed: 500,000).
    pub messages: u64,
    /// Print the seed's progress lines.
    pub verbose: bool,
    /// How the consumer and producer tasks are scheduled (two threads).
    pub runtime: RuntimeKind,
    /// `None`: a plain bus. `Some`: joined to etcd; with two nodes the
    /// consumer runs in a second process.
    pub cluster: Option<ClusterTarget>,
}

/// One pingpong run.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct PingpongResult {
    /// Always `pingpong`.
    pub scenario: String,
    /// `railyard` or a peer's name.
    pub system: String,
    /// Cluster manager (`none`).
    pub cluster: String,
    /// Messages sent.
    pub messages: u64,
    /// Milliseconds from the first send to the first reply the producer handled.
    pub first_reply_ms: f64,
    /// Milliseconds from the first send to the last reply.
    pub all_replies_ms: f64,
    /// Requests that failed.
    #[serde(default)]
    pub failures: u64,
    /// Processes (nodes) the run used.
    #[serde(default = "one")]
    pub nodes: usize,
    /// Railyard only: `loops` or `multi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
}

const ADDRESS: &str = "ping-address";

fn one() -> usize {
    1
}

/// Runs pingpong on Railyard's bus.
///
/// # Errors
/// [`ClusterBenchError`] when a clustered run cannot be set up.
///
/// # Panics
/// If a bench task panics.
pub async fn run(cfg: &PingpongConfig) -> Result<PingpongResult, ClusterBenchError> {
    let loops = EventLoops::new(2, cfg.runtime);
    let (bus, node) = match &cfg.cluster {
        None => (EventBus::new(), None),
        Some(t) => {
            let (bus, node) = cluster::join(&t.etcd, "bench").await?;
            (bus, Some(node))
        }
    };
    let two_nodes = cfg.cluster.as_ref().is_some_and(|t| t.nodes >= 2);
    let started = Instant::now();
    let server = match &cfg.cluster {
        Some(t) if two_nodes => {
            let serve = ServeConfig {
                address: ADDRESS.into(),
                instances: 1,
                consumer: ConsumerKind::Consumer,
                method: Method::SendReply,
                loops: 1,
            };
            let server = ServerProcess::start(t, &serve).await?;
            cluster::wait_routed(&bus, &[ADDRESS.to_owned()]).await?;
            Some(server)
        }
        _ => None,
    };
    let consumer_bus = bus.clone();
    loops
        .run_on(0, async move {
            if two_nodes {
                return None;
            }
            Some(
                consumer_bus
                    .consumer(ADDRESS)
                    .handler(|mut m| async move {
                        let v = m.body::<u64>().copied().unwrap_or_default();
                        // Only requests arrive here; an error would mean the
                        // producer gave up, which the producer reports.
                        let _ = m.reply(v);
                    })
                    .await
                    .expect("register the ping consumer"),
            )
        })
        .await;
    if cfg.verbose {
        println!(
            "Consumer registered after {} ms",
            started.elapsed().as_millis()
        );
    }
    let messages = cfg.messages;
    let verbose = cfg.verbose;
    let producer_bus = bus.clone();
    let (first, all, failures) = loops
        .run_on(1, async move {
            let bus = producer_bus;
            if verbose {
                println!("Starting to send messages.");
            }
            let t0 = Instant::now();
            // One consumer answers in arrival order, so replies complete in send
            // order: awaiting them in order observes each as soon as it exists.
            // (A `FuturesUnordered` of 500k futures degrades quadratically under
            // tokio's cooperative budget, and would measure that instead.)
            let mut pending = VecDeque::with_capacity(messages as usize);
            for i in 0..messages {
                let mut reply = bus.request(ADDRESS, i);
                if !reply.is_enqueued() {
                    // Back-pressure: the consumer's buffer is full.
                    reply.enqueued().await;
                }
                pending.push_back(reply);
                if verbose && (i + 1) % 20_000 == 0 {
                    println!(
                        "{} eventbus messages sent in {} ms.",
                        i + 1,
                        t0.elapsed().as_millis()
                    );
                }
            }
            let mut first = None;
            let mut count = 0u64;
            let mut failures = 0u64;
            // The n-th reply popped answers the n-th request (sent in order).
            let mut i = 0u64;
            while let Some(reply) = pending.pop_front() {
                let r = reply.await;
                first.get_or_insert_with(|| t0.elapsed());
                // A reply counts only if it answers its request (the
                // consumer echoes the number), as the peer checks.
                if !r.is_ok_and(|m| m.body::<u64>() == Some(&i)) {
                    failures += 1;
                }
                i += 1;
                count += 1;
                if verbose && count % 10_000 == 0 {
                    println!("replyCount: {count} after {} ms", t0.elapsed().as_millis());
                }
            }
            let all = t0.elapsed();
            if verbose {
                println!("all replies received in {} ms", all.as_millis());
            }
            (first.unwrap_or(all), all, failures)
        })
        .await;
    drop(loops);
    if let Some(n) = node {
        let _ = n.leave().await;
    }
    if let Some(s) = server {
        s.stop().await;
    }
    Ok(PingpongResult {
        scenario: "pingpong".into(),
        system: "railyard".into(),
        cluster: cfg.cluster.as_ref().map_or("none", |t| t.name()).into(),
        messages,
        first_reply_ms: first.as_secs_f64() * 1e3,
        all_replies_ms: all.as_secs_f64() * 1e3,
        failures,
        nodes: if two_nodes { 2 } else { 1 },
        runtime: Some(cfg.runtime.as_str().into()),
    })
}
