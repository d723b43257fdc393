//! `/metrics` on the admin router parses as Prometheus text and counts what
//! the server answered.

mod common;

use common::{Client, TestServer};
use railyard_http::c10k::{self, C10kOptions};
use railyard_http::{admin_router, HttpConfig};

fn sample<'a>(
    scrape: &'a prometheus_parse::Scrape,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'a prometheus_parse::Sample> {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
}

fn value(s: &prometheus_parse::Sample) -> f64 {
    match &s.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => *v,
        other => panic!("not a scalar: {other:?}"),
    }
}

#[tokio::test]
async fn metrics_count_what_was_served() {
    let dir = common::temp_dir("metrics");
    let app = c10k::app(&C10kOptions::in_dir(&dir)).unwrap();
    let server = TestServer::start(app, HttpConfig::default()).await;
    let admin =
        TestServer::start(admin_router(server.registry.clone()), HttpConfig::default()).await;

    let mut c = Client::connect(server.addr).await;
    for _ in 0..7 {
        assert_eq!(c.get("/static/4k", "").await.status, 200);
    }
    for _ in 0..3 {
        assert_eq!(c.get("/nowhere", "").await.status, 404);
    }
    assert_eq!(c.get("/sendFile/test", "").await.status, 200);

    let mut a = Client::connect(admin.addr).await;
    let r = a.get("/metrics", "").await;
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .contains("openmetrics-text"));
    let text = String::from_utf8(r.body).unwrap();
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .expect("Prometheus text");

    let ok = sample(
        &scrape,
        "railyard_http_requests_total",
        &[
            ("route", "/static/4k"),
            ("method", "GET"),
            ("status", "200"),
        ],
    )
    .unwrap_or_else(|| panic!("no /static/4k series in\n{text}"));
    assert_eq!(value(ok), 7.0);
    let missing = sample(
        &scrape,
        "railyard_http_requests_total",
        &[("route", "unmatched"), ("status", "404")],
    )
    .expect("the 404 series");
    assert_eq!(value(missing), 3.0);
    let file = sample(
        &scrape,
        "railyard_http_requests_total",
        &[("route", "/sendFile/test")],
    )
    .expect("the sendfile series");
    assert_eq!(value(file), 1.0);
    let count = sample(
        &scrape,
        "railyard_http_request_duration_seconds_count",
        &[("route", "/static/4k")],
    );
    let hist = scrape.samples.iter().find(|s| {
        s.metric == "railyard_http_request_duration_seconds"
            && s.labels.get("route") == Some("/static/4k")
    });
    match (count, hist) {
        (Some(s), _) => assert_eq!(value(s), 7.0),
        (None, Some(h)) => match &h.value {
            prometheus_parse::Value::Histogram(buckets) => {
                assert!(
                    buckets
                        .iter()
                        .any(|b| (b.less_than - 0.00005).abs() < 1e-12),
                    "a 50 us bucket"
                );
                assert_eq!(buckets.last().unwrap().count, 7.0);
            }
            other => panic!("not a histogram: {other:?}"),
        },
        _ => panic!("no duration series in\n{text}"),
    }
    let open = sample(&scrape, "railyard_http_open_connections", &[]).expect("open connections");
    assert_eq!(value(open), 1.0);
    let sent = sample(&scrape, "railyard_http_sent_bytes_total", &[]).expect("bytes out");
    assert!(value(sent) > 7.0 * 4096.0);
    // The sendfile counter is bumped right after the syscall returns, which
    // can be just after the client has the bytes: re-scrape until it shows
    // (bounded), then check the exact figure.
    let mut by_sendfile = 0.0;
    for _ in 0..200 {
        let r = a.get("/metrics", "").await;
        let text = String::from_utf8(r.body).unwrap();
        let s = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
        by_sendfile =
            value(sample(&s, "railyard_http_sendfile_bytes_total", &[]).expect("sendfile bytes"));
        if by_sendfile >= c10k::DEFAULT_SEND_FILE_LEN as f64 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        by_sendfile,
        c10k::DEFAULT_SEND_FILE_LEN as f64,
        "the file went by sendfile"
    );
    let received = sample(&scrape, "railyard_http_received_bytes_total", &[]).expect("bytes in");
    assert!(value(received) > 0.0);
    admin.stop().await;
    server.stop().await;
}

/// Scrapes `/metrics` on `admin` and returns `name`'s value.
async fn scraped(admin: &TestServer, name: &str) -> f64 {
    let mut a = Client::connect(admin.addr).await;
    let r = a.get("/metrics", "").await;
    let text = String::from_utf8(r.body).unwrap();
    let s = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
    value(sample(&s, name, &[]).unwrap_or_else(|| panic!("{name} in\n{text}")))
}

/// A file whose pages were evicted from the page cache is read on the
/// blocking pool before `sendfile` reads it on the core's thread; a file
/// found cached is not read again.
#[tokio::test]
async fn a_file_evicted_from_the_page_cache_is_read_off_the_event_loop_first() {
    use std::os::fd::AsRawFd;
    use std::sync::Arc;
    // On a disk, not a tmpfs (whose pages cannot be evicted).
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("cold-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cold");
    let data: Vec<u8> = (0..3 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    file.sync_all().unwrap();
    // SAFETY: a plain advisory call on an open descriptor.
    let r = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0, "posix_fadvise");
    let file = Arc::new(file);
    let len = data.len() as u64;
    let router = railyard_http::Router::new().get("/cold", move |_req| {
        std::future::ready(http::Response::new(railyard_http::Body::file(
            file.clone(),
            0,
            len,
        )))
    });
    let server = TestServer::start(router, HttpConfig::default()).await;
    let admin =
        TestServer::start(admin_router(server.registry.clone()), HttpConfig::default()).await;
    let mut c = Client::connect(server.addr).await;

    let r = c.get("/cold", "").await;
    assert_eq!(r.status, 200);
    assert!(r.body == data, "the file's own bytes");
    let cold = scraped(&admin, "railyard_http_cold_file_reads_total").await;
    if !railyard_http::cachestat_available() {
        // A kernel before 6.5 (or a seccomp filter) has no cachestat: the
        // server cannot tell, sends every file as it is and counts nothing.
        assert_eq!(cold, 0.0, "no cold reads without cachestat");
    } else {
        // Three windows of 1 MiB, each found not cached (unless the kernel
        // read some ahead on its own while the first was warmed).
        assert!(
            (1.0..=3.0).contains(&cold),
            "cold windows read first: {cold}"
        );
    }

    // Now cached: sent as it is, without another read.
    let r = c.get("/cold", "").await;
    assert!(r.body == data);
    assert_eq!(
        scraped(&admin, "railyard_http_cold_file_reads_total").await,
        cold
    );
    admin.stop().await;
    server.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
