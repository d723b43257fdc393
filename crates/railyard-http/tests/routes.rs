//! Every seed route over a real socket: status, headers, body, compressed
//! variants, the sendfile path under keep-alive (beside `HEAD` and bodiless
//! statuses); the router without a socket; and the app's removal of stale
//! upload parts at start.

mod common;

use std::fs::File;
use std::io::Read as _;
use std::sync::Arc;

use common::{Client, TestServer};
use http::{Request, Response, StatusCode};
use railyard_http::c10k::{self, C10kOptions};
use railyard_http::{Body, HttpConfig, RequestBody, Router};

fn is_alnum(b: &[u8]) -> bool {
    b.iter().all(u8::is_ascii_alphanumeric)
}

fn gunzip(b: &[u8]) -> Vec<u8> {
    let mut out = vec![];
    flate2::read::GzDecoder::new(b)
        .read_to_end(&mut out)
        .unwrap();
    out
}

fn inflate(b: &[u8]) -> Vec<u8> {
    let mut out = vec![];
    flate2::read::ZlibDecoder::new(b)
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// The app with a send file of `len` known bytes.
fn app_with_file(tag: &str, len: usize) -> (C10kOptions, Vec<u8>) {
    let dir = common::temp_dir(tag);
    let opts = C10kOptions::in_dir(&dir);
    let content: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&opts.send_file, &content).unwrap();
    (opts, content)
}

#[tokio::test]
async fn seed_routes_answer_with_the_right_bodies() {
    let (opts, _) = app_with_file("routes", 1000);
    let server = TestServer::start(c10k::app(&opts).unwrap(), HttpConfig::default()).await;
    let mut c = Client::connect(server.addr).await;

    let r = c.get("/0k", "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-length"), Some("0"));
    assert!(r.body.is_empty());

    for (path, len) in [
        ("/static/4k", 4096),
        ("/static/8k", 8192),
        ("/static/64k", 65536),
        ("/cached/4k", 4096),
        ("/cached/8k", 8192),
        ("/cached/64k", 65536),
    ] {
        let r = c.get(path, "").await;
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(
            r.header("content-length"),
            Some(len.to_string().as_str()),
            "{path}"
        );
        assert_eq!(r.header("content-type"), Some("text/plain; charset=utf-8"));
        assert!(r.header("content-encoding").is_none(), "{path}");
        assert_eq!(r.body.len(), len, "{path}");
        assert!(is_alnum(&r.body), "{path}");
    }
    // Static bodies are fixed: the same bytes every time.
    let a = c.get("/static/4k", "").await.body;
    let b = c.get("/static/4k", "").await.body;
    assert_eq!(a, b);

    let head = {
        c.send(b"HEAD /static/8k HTTP/1.1\r\nHost: t\r\n\r\n").await;
        c.read_response_for("HEAD").await.unwrap()
    };
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), Some("8192"));

    let r = c.get("/nope", "").await;
    assert_eq!(r.status, 404);
    c.send(b"DELETE /static/4k HTTP/1.1\r\nHost: t\r\n\r\n")
        .await;
    let r = c.read_response().await.unwrap();
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("GET"));
    server.stop().await;
}

#[tokio::test]
async fn compressed_variants_decode_to_the_identity_body() {
    let (opts, _) = app_with_file("gzip", 10);
    let server = TestServer::start(c10k::app(&opts).unwrap(), HttpConfig::default()).await;
    let mut c = Client::connect(server.addr).await;
    for path in ["/static/4k", "/static/64k"] {
        let plain = c.get(path, "").await.body;
        let gz = c.get(path, "Accept-Encoding: gzip, deflate\r\n").await;
        assert_eq!(gz.header("content-encoding"), Some("gzip"), "{path}");
        assert_eq!(gz.header("vary"), Some("accept-encoding"));
        assert!(gz.body.len() < plain.len());
        assert_eq!(gunzip(&gz.body), plain, "{path}");
        let df = c.get(path, "Accept-Encoding: deflate\r\n").await;
        assert_eq!(df.header("content-encoding"), Some("deflate"));
        assert_eq!(inflate(&df.body), plain, "{path}");
        let refused = c.get(path, "Accept-Encoding: gzip;q=0\r\n").await;
        assert!(refused.header("content-encoding").is_none());
        assert_eq!(refused.body, plain);
    }
    for (path, len) in [("/cached/4k", 4096), ("/cached/64k", 65536)] {
        let gz = c.get(path, "Accept-Encoding: gzip\r\n").await;
        assert_eq!(gz.status, 200);
        assert_eq!(gz.header("content-encoding"), Some("gzip"));
        let body = gunzip(&gz.body);
        assert_eq!(body.len(), len);
        assert!(is_alnum(&body));
    }
    server.stop().await;
}

#[tokio::test]
async fn sendfile_sends_the_file_and_keeps_the_connection() {
    // 300 KB: several placeholder chunks and, on loopback, partial writes.
    let (opts, content) = app_with_file("sendfile", 300_000);
    // Parking after every response puts each request on a fresh hyper connection.
    let config = HttpConfig {
        park_idle_after: std::time::Duration::ZERO,
        ..HttpConfig::default()
    };
    let server = TestServer::start(c10k::app(&opts).unwrap(), config).await;
    let mut c = Client::connect(server.addr).await;
    for _ in 0..3 {
        let r = c.get("/sendFile/test", "").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-length"), Some("300000"));
        assert_eq!(r.header("content-type"), Some("application/octet-stream"));
        assert!(r.body == content, "the file's bytes, in order");
        // An ordinary response on the same connection right after.
        let s = c.get("/static/4k", "").await;
        assert_eq!(s.body.len(), 4096);
    }
    // Pipelined: two file responses and a fixed one written back to back.
    c.send(
        b"GET /sendFile/test HTTP/1.1\r\nHost: t\r\n\r\nGET /0k HTTP/1.1\r\nHost: t\r\n\r\nGET /sendFile/test HTTP/1.1\r\nHost: t\r\n\r\n",
    )
    .await;
    assert!(c.read_response().await.unwrap().body == content);
    assert_eq!(c.read_response().await.unwrap().status, 200);
    assert!(c.read_response().await.unwrap().body == content);
    server.stop().await;
}

#[tokio::test]
async fn the_router_answers_without_a_socket() {
    let (opts, content) = app_with_file("nosocket", 200_000);
    let app = c10k::app(&opts).unwrap();
    let req = |path: &str| {
        Request::builder()
            .uri(path)
            .body(RequestBody::empty())
            .unwrap()
    };
    let r = app.handle(req("/static/8k")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.body().as_bytes().unwrap().len(), 8192);
    // Without a socket the file body is read in chunks instead of sendfile.
    let r = app.handle(req("/sendFile/test")).await;
    assert!(r.body().is_file());
    use http_body_util::BodyExt as _;
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    assert!(bytes == content);
    let up = Request::post("/upload")
        .body(RequestBody::from("hello upload"))
        .unwrap();
    assert_eq!(app.handle(up).await.status(), 200);
    let files = common::entries(&opts.upload_dir);
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(
        std::fs::read(opts.upload_dir.join(&files[0])).unwrap(),
        b"hello upload"
    );
}

/// At start the app removes the hidden `.part` files that exited processes
/// left in the upload directory, and keeps a live process's parts, stored
/// uploads and names it does not make; uploads then store as before.
#[tokio::test]
async fn the_app_removes_stale_upload_parts_at_start() {
    let opts = C10kOptions::in_dir(&common::temp_dir("staleparts"));
    std::fs::create_dir_all(&opts.upload_dir).unwrap();
    // A process that has exited (and been reaped), and one still running.
    let mut exited = std::process::Command::new("true").spawn().unwrap();
    let exited_pid = exited.id();
    exited.wait().unwrap();
    let mut live = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let live_pid = live.id();
    let part = |pid: u32, n: u32| format!(".upload-{pid}-0123456789abcdef-{n}.part");
    let stale = [part(exited_pid, 0), part(exited_pid, 1)];
    let mut kept = vec![
        part(live_pid, 0),
        format!("upload-{exited_pid}-0123456789abcdef-0"),
        format!(".upload-{exited_pid}-not-a-run-0.part"),
        format!(".upload-{exited_pid}-0123456789ABCDEF-0.part"),
        format!(".upload-0{exited_pid}-0123456789abcdef-0.part"),
        "notes.txt".to_owned(),
    ];
    // Every file last written an hour ago (the sweep leaves younger parts),
    // but one more part of the exited process written just now.
    let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    for name in stale.iter().chain(&kept) {
        let path = opts.upload_dir.join(name);
        std::fs::write(&path, name).unwrap();
        let f = std::fs::File::options().write(true).open(&path).unwrap();
        f.set_modified(an_hour_ago).unwrap();
    }
    let young = part(exited_pid, 2);
    std::fs::write(opts.upload_dir.join(&young), "young").unwrap();
    kept.push(young);
    let app = c10k::app(&opts);
    let _ = live.kill();
    let _ = live.wait();
    let app = app.unwrap();
    kept.sort();
    assert_eq!(common::entries(&opts.upload_dir), kept);

    let up = Request::post("/upload")
        .body(RequestBody::from("after the sweep"))
        .unwrap();
    assert_eq!(app.handle(up).await.status(), 200);
    let new: Vec<String> = common::entries(&opts.upload_dir)
        .into_iter()
        .filter(|f| !kept.contains(f))
        .collect();
    assert_eq!(new.len(), 1, "{new:?}");
    assert!(new[0].starts_with("upload-"), "{new:?}");
    assert_eq!(
        std::fs::read(opts.upload_dir.join(&new[0])).unwrap(),
        b"after the sweep"
    );
}

#[tokio::test]
async fn bodiless_file_responses_leave_no_run_for_the_next_one() {
    // Two files with different bytes; `/b` serves a range from an offset, so
    // a stale run of `/a` (or the wrong offset) gives different bytes.
    let dir = common::temp_dir("headrun");
    let a: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let b: Vec<u8> = (0..150_000u32).map(|i| (i * 13 % 241) as u8).collect();
    std::fs::write(dir.join("a"), &a).unwrap();
    std::fs::write(dir.join("b"), &b).unwrap();
    let fa = Arc::new(File::open(dir.join("a")).unwrap());
    let fb = Arc::new(File::open(dir.join("b")).unwrap());
    let (b_off, b_len) = (10_000u64, 120_000u64);
    let want_b = &b[10_000..130_000];
    let (fa2, fa3) = (fa.clone(), fa.clone());
    let router = Router::new()
        .get("/a", move |_req| {
            std::future::ready(Response::new(Body::file(fa.clone(), 0, 100_000)))
        })
        .get("/b", move |_req| {
            std::future::ready(Response::new(Body::file(fb.clone(), b_off, b_len)))
        })
        // Statuses that cannot carry a body, with a file body all the same:
        // hyper drops the body unwritten.
        .get("/unchanged", move |_req| {
            let mut r = Response::new(Body::file(fa2.clone(), 0, 100_000));
            *r.status_mut() = StatusCode::NOT_MODIFIED;
            std::future::ready(r)
        })
        .get("/nothing", move |_req| {
            let mut r = Response::new(Body::file(fa3.clone(), 0, 100_000));
            *r.status_mut() = StatusCode::NO_CONTENT;
            std::future::ready(r)
        });
    let server = TestServer::start(router, HttpConfig::default()).await;
    let mut c = Client::connect(server.addr).await;

    // One at a time on the keep-alive connection...
    for _ in 0..3 {
        c.send(b"HEAD /a HTTP/1.1\r\nHost: t\r\n\r\n").await;
        let h = c.read_response_for("HEAD").await.unwrap();
        assert_eq!(h.status, 200);
        assert_eq!(h.header("content-length"), Some("100000"));
    }
    assert_eq!(c.get("/unchanged", "").await.status, 304);
    assert_eq!(c.get("/nothing", "").await.status, 204);
    let r = c.get("/b", "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-length"), Some("120000"));
    assert!(r.body == want_b, "`/b`'s own bytes, not another response's");

    // ...and pipelined: bodiless responses back to back, then two file bodies.
    c.send(
        b"HEAD /a HTTP/1.1\r\nHost: t\r\n\r\nHEAD /b HTTP/1.1\r\nHost: t\r\n\r\nGET /unchanged HTTP/1.1\r\nHost: t\r\n\r\nHEAD /a HTTP/1.1\r\nHost: t\r\n\r\nGET /b HTTP/1.1\r\nHost: t\r\n\r\nGET /a HTTP/1.1\r\nHost: t\r\n\r\n",
    )
    .await;
    for (method, status) in [("HEAD", 200), ("HEAD", 200), ("GET", 304), ("HEAD", 200)] {
        let r = c.read_response_for(method).await.unwrap();
        assert_eq!(r.status, status);
        assert!(r.body.is_empty());
    }
    assert!(c.read_response().await.unwrap().body == want_b);
    assert!(c.read_response().await.unwrap().body == a);
    server.stop().await;
}

#[tokio::test]
async fn a_handler_content_length_that_disagrees_with_its_body_is_replaced() {
    use http::header::{HeaderValue, CONTENT_LENGTH};
    let dir = common::temp_dir("declared");
    let a: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(dir.join("a"), &a).unwrap();
    let fa = Arc::new(File::open(dir.join("a")).unwrap());
    let fa2 = fa.clone();
    // `/file?N` and `/bytes?N` answer `a` (by sendfile, from memory) with a
    // `Content-Length: N` of the handler's own.
    let declared = |req: &Request<RequestBody>| {
        HeaderValue::from_str(req.uri().query().expect("a declared length")).unwrap()
    };
    let bytes = bytes::Bytes::from(a.clone());
    let router = Router::new()
        .get("/file", move |req: Request<RequestBody>| {
            let mut r = Response::new(Body::file(fa.clone(), 0, 100_000));
            r.headers_mut().insert(CONTENT_LENGTH, declared(&req));
            std::future::ready(r)
        })
        .get("/bytes", move |req: Request<RequestBody>| {
            let mut r = Response::new(Body::full(bytes.clone()));
            r.headers_mut().insert(CONTENT_LENGTH, declared(&req));
            std::future::ready(r)
        })
        .get("/a", move |_req| {
            std::future::ready(Response::new(Body::file(fa2.clone(), 0, 100_000)))
        });
    let server = TestServer::start(router, HttpConfig::default()).await;
    let mut c = Client::connect(server.addr).await;
    for path in [
        "/file?99000",
        "/file?101000",
        "/file?100000",
        "/bytes?10",
        "/bytes?200000",
    ] {
        let r = c.get(path, "").await;
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.header("content-length"), Some("100000"), "{path}");
        assert!(r.body == a, "{path}: the body's own bytes");
        // The next response on the keep-alive connection is intact.
        let next = c.get("/a", "").await;
        assert_eq!(next.status, 200, "after {path}");
        assert!(next.body == a, "after {path}: `/a`'s own bytes");
    }
    // Pipelined, back to back.
    c.send(
        b"GET /file?99000 HTTP/1.1\r\nHost: t\r\n\r\nGET /a HTTP/1.1\r\nHost: t\r\n\r\nGET /file?101000 HTTP/1.1\r\nHost: t\r\n\r\nGET /a HTTP/1.1\r\nHost: t\r\n\r\n",
    )
    .await;
    for _ in 0..4 {
        let r = c.read_response().await.unwrap();
        assert_eq!(r.header("content-length"), Some("100000"));
        assert!(r.body == a);
    }
    // `HEAD` announces the same length.
    c.send(b"HEAD /file?5 HTTP/1.1\r\nHost: t\r\n\r\n").await;
    let h = c.read_response_for("HEAD").await.unwrap();
    assert_eq!(h.header("content-length"), Some("100000"));
    assert!(c.get("/a", "").await.body == a);
    server.stop().await;
}
