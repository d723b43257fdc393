//! Diagnoses command latency while full refreshes run: GETs every 10 ms for
//! `SECS` seconds while a full refresh is forced every second.
//!
//! `cargo run --release -p railyard-redis --example refresh_stall -- SEEDS [SECS]`
//! (SEEDS: `host:port,...` of a cluster or of `railyard dev redis-double`).

use std::time::{Duration, Instant};

use railyard_redis::ClusterClient;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let seeds: Vec<String> = args
        .next()
        .ok_or("usage: refresh_stall SEEDS [SECS]")?
        .split(',')
        .map(str::to_owned)
        .collect();
    let secs: u64 = args.next().map_or(Ok(10), |s| s.parse())?;
    let c = ClusterClient::builder(&seeds).build().await?;
    c.set("test", "ok").await?;
    let refresher = c.clone();
    let forcing = tokio::spawn(async move {
        let mut walls = Vec::new();
        for _ in 0..secs {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let t = Instant::now();
            if refresher.refresh_now().await.is_ok() {
                walls.push(t.elapsed());
            }
        }
        walls
    });
    let mut lat = Vec::new();
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        let t = Instant::now();
        c.get("test").await?;
        lat.push(t.elapsed());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let walls = forcing.await?;
    lat.sort();
    let q = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    let s = c.refresh_stats();
    println!(
        "GETs {}: p50 {:?} p99 {:?} max {:?}; full refreshes {} (wall {:?}), last cpu {:.1} ms",
        lat.len(),
        q(0.5),
        q(0.99),
        lat[lat.len() - 1],
        walls.len(),
        walls,
        s.last_full_cpu_ms
    );
    Ok(())
}
