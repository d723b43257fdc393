//! The fixed lane answers plain `GET`s of fixed bodies without hyper. These
//! tests hold it to hyper's behaviour: the same bytes for every route and
//! encoding, requests it does not take handed over in order, heads split
//! across reads, a full socket buffer, the idle and head deadlines, and
//! shutdown.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Client, TestServer, PATIENCE};
use http::Response;
use railyard_http::{Body, FixedBody, HttpConfig, Router};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BIG: usize = 64 * 1024;

fn text_body() -> String {
    "railyard fixed lane ".repeat(205)
}

/// Bytes that do not compress well, the same in every router built here.
fn big_body() -> Bytes {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..BIG)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"[(x % 62) as usize]
        })
        .collect::<Vec<u8>>()
        .into()
}

/// The same routes every time: fixed bodies (text, empty, large) and a
/// dynamic route the lane leaves to hyper.
fn app() -> Router {
    Router::new()
        .fixed(
            "/t",
            FixedBody::new(text_body(), "text/plain; charset=utf-8", 1024),
        )
        .fixed("/e", FixedBody::new(Bytes::new(), "text/plain", 1024))
        .fixed(
            "/big",
            FixedBody::new(big_body(), "application/octet-stream", 1024),
        )
        .get("/dyn", |_req| async {
            Response::new(Body::from("dynamic"))
        })
}

fn config(lane: bool) -> HttpConfig {
    HttpConfig {
        fixed_lane: lane,
        // hyper parks after every response, so a connection comes back to
        // the lane right after hyper's request.
        park_idle_after: Duration::ZERO,
        ..HttpConfig::default()
    }
}

/// `registry` in Prometheus text, as `/metrics` serves it.
fn scraped(registry: &railyard_http::MetricsRegistry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry.lock().unwrap()).unwrap();
    text
}

/// `railyard_http_fixed_lane_requests_total` in `registry`.
fn lane_count(registry: &railyard_http::MetricsRegistry) -> f64 {
    let text = scraped(registry);
    let line = text
        .lines()
        .find(|l| l.starts_with("railyard_http_fixed_lane_requests_total"))
        .expect("the lane's counter");
    line.split_whitespace().last().unwrap().parse().unwrap()
}

/// The short head and idle timeout of [`timed_lane`]: far above a loaded
/// machine's stalls (at 300 ms, one 200 ms stall between the tests' 100 ms gaps
/// would cut a busy connection), far below the trickles' length.
const TIMEOUT: Duration = Duration::from_secs(1);

/// A server with the lane and a [`TIMEOUT`] head and idle timeout, and a
/// client connected to it.
async fn timed_lane() -> (TestServer, Client) {
    let config = HttpConfig {
        header_read_timeout: TIMEOUT,
        ..config(true)
    };
    let lane = TestServer::start(app(), config).await;
    let c = Client::connect(lane.addr).await;
    (lane, c)
}

/// Sends `pieces` a tenth of [`TIMEOUT`] apart (a timeout's worth of bytes
/// in far more time) and checks that the server closes the connection
/// within four timeouts without answering.
async fn assert_cut_while_trickling(c: &mut Client, pieces: &[&[u8]]) {
    let started = Instant::now();
    let mut cut = false;
    for piece in pieces {
        if c.stream.write_all(piece).await.is_err() {
            cut = true;
            break;
        }
        tokio::time::sleep(TIMEOUT / 10).await;
    }
    let rest = if cut { vec![] } else { c.read_to_close().await };
    assert!(rest.is_empty(), "nothing may be answered: {rest:?}");
    let lasted = started.elapsed();
    assert!(lasted < TIMEOUT * 4, "cut after {lasted:?}");
}

/// Reads one whole response off `s`, with the date's value blanked.
async fn raw_response(s: &mut TcpStream, buf: &mut Vec<u8>, head_only: bool) -> Vec<u8> {
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut r = httparse::Response::new(&mut headers);
        if let httparse::Status::Complete(head) = r.parse(buf).expect("a valid response") {
            let len: usize = r
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .map_or(0, |h| {
                    std::str::from_utf8(h.value).unwrap().parse().unwrap()
                });
            let total = head + if head_only { 0 } else { len };
            if buf.len() >= total {
                let mut out: Vec<u8> = buf.drain(..total).collect();
                assert_eq!(blank_dates(&mut out[..head]), 1, "one date header");
                return out;
            }
        }
        let mut chunk = [0u8; 64 * 1024];
        let n = tokio::time::timeout(PATIENCE, s.read(&mut chunk))
            .await
            .expect("an answer in time")
            .expect("read");
        assert!(n > 0, "closed before a whole response: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Sends `raw` on a new connection and reads one response per entry of
/// `heads` (true: a response without a body, as for `HEAD`).
async fn exchange(addr: SocketAddr, raw: &[u8], heads: &[bool]) -> Vec<Vec<u8>> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw).await.unwrap();
    let mut buf = Vec::new();
    let mut out = Vec::new();
    for &h in heads {
        out.push(raw_response(&mut s, &mut buf, h).await);
    }
    out
}

#[tokio::test]
async fn the_lane_writes_the_bytes_hyper_writes() {
    let lane = TestServer::start(app(), config(true)).await;
    let hyper = TestServer::start(app(), config(false)).await;
    let accepts = [
        "",
        "Accept-Encoding: gzip\r\n",
        "Accept-Encoding: deflate\r\n",
        "Accept-Encoding: gzip;q=0, deflate\r\n",
        "Accept-Encoding: br\r\n",
        "Accept-Encoding: *\r\n",
        "Accept-Encoding: identity\r\nAccept-Encoding: GZIP\r\n",
        "Accept-Encoding: gzip\u{e9}\r\n",
    ];
    for path in ["/t", "/e", "/big", "/t?x=1&y=%20"] {
        for accept in accepts {
            let req = format!("GET {path} HTTP/1.1\r\nHost: t\r\n{accept}\r\n");
            let a = exchange(lane.addr, req.as_bytes(), &[false]).await;
            let b = exchange(hyper.addr, req.as_bytes(), &[false]).await;
            assert_eq!(a, b, "{req:?}");
        }
    }
    // Every request above was the lane's on one server, hyper's on the other.
    assert_eq!(lane_count(&lane.registry), 32.0);
    assert_eq!(lane_count(&hyper.registry), 0.0);
    lane.stop().await;
    hyper.stop().await;
}

#[tokio::test]
async fn requests_the_lane_does_not_take_are_answered_in_order_by_hyper() {
    let lane = TestServer::start(app(), config(true)).await;
    let hyper = TestServer::start(app(), config(false)).await;
    // Lane, hyper and lane again, pipelined in one write.
    let pipeline: &[(&str, bool)] = &[
        (
            "GET /t HTTP/1.1\r\nHost: t\r\nAccept-Encoding: gzip\r\n\r\n",
            false,
        ),
        ("GET /dyn HTTP/1.1\r\nHost: t\r\n\r\n", false),
        ("GET /e HTTP/1.1\r\nHost: t\r\n\r\n", false),
        ("HEAD /t HTTP/1.1\r\nHost: t\r\n\r\n", true),
        (
            "GET /t HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n",
            false,
        ),
        ("GET /missing HTTP/1.1\r\nHost: t\r\n\r\n", false),
        (
            "POST /t HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi",
            false,
        ),
        (
            "GET /big HTTP/1.1\r\nHost: t\r\nConnection: keep-alive\r\n\r\n",
            false,
        ),
        ("GET http://t/t HTTP/1.1\r\nHost: t\r\n\r\n", false),
        ("GET /t HTTP/1.1\r\nHost: t\r\n\r\n", false),
    ];
    let raw: Vec<u8> = pipeline.iter().flat_map(|(r, _)| r.bytes()).collect();
    let heads: Vec<bool> = pipeline.iter().map(|(_, h)| *h).collect();
    let a = exchange(lane.addr, &raw, &heads).await;
    let b = exchange(hyper.addr, &raw, &heads).await;
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x, y, "response {i} to {:?}", pipeline[i].0);
    }
    let expected = [200, 200, 200, 200, 200, 404, 405, 200, 200, 200];
    let statuses: Vec<u16> = a
        .iter()
        .map(|r| std::str::from_utf8(&r[9..12]).unwrap().parse().unwrap())
        .collect();
    assert_eq!(statuses, expected);
    // The lane answered the first; hyper, given the rest, answered the rest.
    assert_eq!(lane_count(&lane.registry), 1.0);
    // The same requests one by one on one connection, each waiting for
    // its answer, so the connection moves between the lane and hyper.
    let mut c = Client::connect(lane.addr).await;
    for ((req, head), want) in pipeline.iter().zip(expected) {
        c.send(req.as_bytes()).await;
        let method = if *head { "HEAD" } else { "GET" };
        let r = c.read_response_for(method).await.expect("an answer");
        assert_eq!(r.status, want, "{req:?}");
    }
    // At least the first came back to the lane.
    assert!(lane_count(&lane.registry) >= 2.0);
    lane.stop().await;
    hyper.stop().await;
}

#[tokio::test]
async fn requests_that_close_or_are_refused_behave_as_with_hyper() {
    let lane = TestServer::start(app(), config(true)).await;
    let hyper = TestServer::start(app(), config(false)).await;
    let huge = format!("GET /t HTTP/1.1\r\nX-Big: {}\r\n\r\n", "a".repeat(20_000));
    let cases: Vec<Vec<u8>> = vec![
        b"GET /t HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".to_vec(),
        b"GET /t HTTP/1.0\r\n\r\n".to_vec(),
        b"GET /t HTTP/1.1\r\nHost: t\r\n\r\nGARBAGE\r\n\r\n".to_vec(),
        b"GET /t\xff HTTP/1.1\r\n\r\n".to_vec(),
        huge.into_bytes(),
    ];
    for raw in &cases {
        let a = until_close(lane.addr, raw).await;
        let b = until_close(hyper.addr, raw).await;
        assert_eq!(a, b, "{:?}", String::from_utf8_lossy(raw));
        assert!(
            !a.is_empty(),
            "an answer to {:?}",
            String::from_utf8_lossy(raw)
        );
    }
    lane.stop().await;
    hyper.stop().await;
}

/// Sends `raw` and reads until the server closes (the request says
/// `Connection: close`, or the server refuses it), dates blanked.
async fn until_close(addr: SocketAddr, raw: &[u8]) -> Vec<u8> {
    let mut c = Client::connect(addr).await;
    c.send(raw).await;
    let mut out = c.read_to_close().await;
    blank_dates(&mut out);
    out
}

/// Overwrites the value of every `date: ` header in `bytes` (the one part
/// of a response that differs between two servers); returns how many.
fn blank_dates(bytes: &mut [u8]) -> usize {
    let mut at = 0;
    let mut n = 0;
    while let Some(i) = bytes[at..].windows(6).position(|w| w == b"date: ") {
        let start = at + i + 6;
        bytes[start..start + 29].copy_from_slice(&[b'D'; 29]);
        at = start + 29;
        n += 1;
    }
    n
}

#[tokio::test]
async fn heads_split_across_reads_are_answered_and_counted() {
    let lane = TestServer::start(app(), config(true)).await;
    let mut c = Client::connect(lane.addr).await;
    for piece in [
        &b"GET /t HT"[..],
        b"TP/1.1\r\nHost",
        b": t\r\n",
        b"\r\nGET /e HTTP/1.1\r",
    ] {
        c.send(piece).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = c.read_response().await.unwrap();
    assert_eq!(r.body, text_body().as_bytes());
    c.send(b"\n\r\n").await;
    assert_eq!(c.read_response().await.unwrap().status, 200);
    let text = scraped(&lane.registry);
    for route in ["/t", "/e"] {
        let line = format!(
            "railyard_http_requests_total{{route=\"{route}\",method=\"GET\",status=\"200\"}} 1"
        );
        assert!(text.contains(&line), "{line} in\n{text}");
    }
    assert_eq!(lane_count(&lane.registry), 2.0);
    lane.stop().await;
}

#[tokio::test]
async fn a_pipeline_larger_than_the_socket_buffers_is_answered_whole() {
    let lane = TestServer::start(app(), config(true)).await;
    // A small receive window, and nothing read for a while: the server's
    // writes stop part-way and wait for room.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(lane.addr).await.unwrap();
    // 300 requests for 64 KiB each (about 19 MiB), interleaved with hyper's
    // route, all sent before reading anything.
    let mut raw = Vec::new();
    for i in 0..300 {
        let path = if i % 50 == 49 { "/dyn" } else { "/big" };
        raw.extend_from_slice(format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes());
    }
    let (mut rd, mut wr) = s.split();
    let send = async {
        wr.write_all(&raw).await.unwrap();
    };
    let big = big_body();
    let receive = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (mut bodies, mut dynamic) = (0, 0);
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 256 * 1024];
        while bodies + dynamic < 300 {
            let n = tokio::time::timeout(PATIENCE, rd.read(&mut chunk))
                .await
                .expect("answers keep coming")
                .unwrap();
            assert!(n > 0, "closed after {} answers", bodies + dynamic);
            got.extend_from_slice(&chunk[..n]);
            // Take every whole response off the front.
            loop {
                let mut headers = [httparse::EMPTY_HEADER; 16];
                let mut r = httparse::Response::new(&mut headers);
                let httparse::Status::Complete(head) = r.parse(&got).unwrap() else {
                    break;
                };
                let len: usize = r
                    .headers
                    .iter()
                    .find(|h| h.name == "content-length")
                    .map(|h| std::str::from_utf8(h.value).unwrap().parse().unwrap())
                    .unwrap();
                if got.len() < head + len {
                    break;
                }
                let body = &got[head..head + len];
                if len == BIG {
                    assert_eq!(body, &big[..]);
                    bodies += 1;
                } else {
                    assert_eq!(body, b"dynamic");
                    dynamic += 1;
                }
                got.drain(..head + len);
            }
        }
        assert!(got.is_empty(), "nothing after the last answer");
        (bodies, dynamic)
    };
    let ((), (bodies, dynamic)) = tokio::join!(send, receive);
    drop(s);
    assert_eq!((bodies, dynamic), (294, 6));
    lane.stop().await;
}

#[tokio::test]
async fn idle_connections_close_at_the_header_timeout_and_busy_ones_stay() {
    let (lane, mut busy) = timed_lane().await;
    // Busy for three timeouts: one request every 100 ms is never cut off.
    let started = Instant::now();
    while started.elapsed() < TIMEOUT * 3 {
        assert_eq!(busy.get("/e", "").await.status, 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Idle: closed about one timeout after its last request, not before
    // (the server's clock starts when it reads the request, after this).
    let idle_from = Instant::now();
    assert_eq!(busy.get("/e", "").await.status, 200);
    assert!(busy.read_to_close().await.is_empty());
    let idle_for = idle_from.elapsed();
    assert!(idle_for >= TIMEOUT, "{idle_for:?}");
    assert!(idle_for < TIMEOUT * 5, "{idle_for:?}");
    lane.stop().await;
}

#[tokio::test]
async fn a_trickling_head_is_cut_at_its_deadline() {
    let (lane, mut c) = timed_lane().await;
    // One byte every 100 ms: the head would take 7.5 s; each byte wakes the
    // lane, but the head's deadline does not move.
    let head =
        b"GET /t HTTP/1.1\r\nHost: t\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let pieces: Vec<&[u8]> = head.chunks(1).collect();
    assert_cut_while_trickling(&mut c, &pieces).await;
    lane.stop().await;
}

#[tokio::test]
async fn a_pipeline_whose_reads_end_mid_request_is_never_cut() {
    let (lane, mut c) = timed_lane().await;
    // Every write ends one request and starts the next: there is always a
    // partial head, but each is completed well within the timeout.
    c.send(b"GET /e HTTP/1.1\r\nHost: t\r\n\r\nG").await;
    for _ in 0..8 {
        assert_eq!(c.read_response().await.expect("an answer").status, 200);
        tokio::time::sleep(Duration::from_millis(120)).await;
        c.send(b"ET /e HTTP/1.1\r\nHost: t\r\n\r\nG").await;
    }
    assert_eq!(c.read_response().await.expect("an answer").status, 200);
    assert_eq!(lane_count(&lane.registry), 9.0);
    lane.stop().await;
}

#[tokio::test]
async fn shutdown_closes_idle_lane_connections_at_once() {
    let lane = TestServer::start(app(), config(true)).await;
    let mut c = Client::connect(lane.addr).await;
    assert_eq!(c.get("/t", "").await.status, 200);
    let report = lane.stop().await;
    assert_eq!(report.aborted_connections, 0);
    assert!(c.read_to_close().await.is_empty());
}

#[tokio::test]
async fn heads_with_more_headers_than_the_lane_parses_match_hyper() {
    let lane = TestServer::start(app(), config(true)).await;
    let hyper = TestServer::start(app(), config(false)).await;
    let many: String = (0..40).map(|i| format!("X-H{i}: v\r\n")).collect();
    let req = format!("GET /t HTTP/1.1\r\nHost: t\r\n{many}\r\n");
    let a = exchange(lane.addr, req.as_bytes(), &[false]).await;
    let b = exchange(hyper.addr, req.as_bytes(), &[false]).await;
    assert_eq!(a, b);
    // The same head in two pieces, the first past the lane's 32 headers but
    // without the head's end: answered once the end arrives.
    let (first, second) = req.split_at(req.len() - 40);
    let mut c = Client::connect(lane.addr).await;
    c.send(first.as_bytes()).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    c.send(second.as_bytes()).await;
    assert_eq!(
        c.read_response().await.unwrap().body,
        text_body().as_bytes()
    );
    lane.stop().await;
    hyper.stop().await;
}

#[tokio::test]
async fn a_head_split_anywhere_is_answered_as_by_hyper() {
    let lane = TestServer::start(app(), config(true)).await;
    let hyper = TestServer::start(app(), config(false)).await;
    for head in [
        &b"\r\n\r\nGET /e HTTP/1.1\r\nHost: t\r\n\r\n"[..],
        b"GET /e HTTP/1.1\nHost: t\n\n",
    ] {
        let whole = exchange(hyper.addr, head, &[false]).await;
        for cut in 1..head.len() {
            let mut s = TcpStream::connect(lane.addr).await.unwrap();
            s.write_all(&head[..cut]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
            s.write_all(&head[cut..]).await.unwrap();
            let mut buf = Vec::new();
            let got = raw_response(&mut s, &mut buf, false).await;
            assert_eq!(
                vec![got],
                whole,
                "{:?} cut at {cut}",
                String::from_utf8_lossy(head)
            );
        }
    }
    lane.stop().await;
    hyper.stop().await;
}

#[tokio::test]
async fn a_smaller_head_limit_holds_in_the_lane_as_in_hyper() {
    let small = |lane| HttpConfig {
        max_header_bytes: 8192,
        ..config(lane)
    };
    let lane = TestServer::start(app(), small(true)).await;
    let hyper = TestServer::start(app(), small(false)).await;
    for size in [7_000, 8_150, 8_300, 12_000] {
        // `Connection: close` ends both connections after the answer. (A
        // half-close would race in hyper, which without `half_close` may
        // close on reading the EOF before it answers.)
        let req = format!(
            "GET /t HTTP/1.1\r\nConnection: close\r\nX-Pad: {}\r\n\r\n",
            "p".repeat(size)
        );
        let a = until_close(lane.addr, req.as_bytes()).await;
        let b = until_close(hyper.addr, req.as_bytes()).await;
        assert_eq!(a, b, "a head of about {size} bytes");
        assert!(!a.is_empty(), "an answer to a head of about {size} bytes");
    }
    lane.stop().await;
    hyper.stop().await;
}

#[tokio::test]
async fn empty_lines_alone_do_not_keep_a_connection_open() {
    let (lane, mut c) = timed_lane().await;
    assert_eq!(c.get("/e", "").await.status, 200);
    // Empty lines every 100 ms for up to 10 s: cut about one timeout after
    // the last answer, as hyper's head timer would.
    assert_cut_while_trickling(&mut c, &[&b"\r\n"[..]; 100]).await;
    // Empty lines before a request are skipped, as by hyper.
    let mut d = Client::connect(lane.addr).await;
    d.send(b"\r\n\r\n").await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    d.send(b"\r\nGET /e HTTP/1.1\r\nHost: t\r\n\r\n").await;
    assert_eq!(d.read_response().await.unwrap().status, 200);
    lane.stop().await;
}
