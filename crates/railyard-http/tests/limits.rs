//! Limits and bad input: 100-continue, 413 with no partial file, slowloris,
//! 400 and 431 without harming other connections, request timeout, the
//! connection cap.

mod common;

use std::time::Duration;

use common::{Client, TestServer};
use http::{Response, StatusCode};
use railyard_http::c10k::{self, C10kOptions};
use railyard_http::{Body, HttpConfig, Router};

fn upload_app(tag: &str, max: u64) -> (Router, C10kOptions) {
    let dir = common::temp_dir(tag);
    let mut opts = C10kOptions::in_dir(&dir);
    opts.max_upload_bytes = max;
    (c10k::app(&opts).unwrap(), opts)
}

#[tokio::test]
async fn expect_100_continue_then_upload() {
    let (app, opts) = upload_app("continue", 1 << 20);
    let server = TestServer::start(app, HttpConfig::default()).await;
    let mut c = Client::connect(server.addr).await;
    c.send(
        b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n",
    )
    .await;
    let cont = c.read_response().await.unwrap();
    assert_eq!(cont.status, 100);
    c.send(b"hello world").await;
    let r = c.read_response().await.unwrap();
    assert_eq!(r.status, 200);
    let files = common::entries(&opts.upload_dir);
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(
        std::fs::read(opts.upload_dir.join(&files[0])).unwrap(),
        b"hello world"
    );
    server.stop().await;
}

#[tokio::test]
async fn multipart_upload_stores_the_file_part() {
    let (app, opts) = upload_app("multipart", 1 << 20);
    let server = TestServer::start(app, HttpConfig::default()).await;
    let mut c = Client::connect(server.addr).await;
    let body = "--XyZ\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n\r\nfile content here\r\n--XyZ--\r\n";
    let req = format!(
        "POST /upload HTTP/1.1\r\nHost: t\r\nContent-Type: multipart/form-data; boundary=XyZ\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    c.send(req.as_bytes()).await;
    assert_eq!(c.read_response().await.unwrap().status, 200);
    let files = common::entries(&opts.upload_dir);
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(
        std::fs::read(opts.upload_dir.join(&files[0])).unwrap(),
        b"file content here"
    );
    // No file part at all: a clear 400.
    let mut c = Client::connect(server.addr).await;
    let body = "--XyZ\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi\r\n--XyZ--\r\n";
    let req = format!(
        "POST /upload HTTP/1.1\r\nHost: t\r\nContent-Type: multipart/form-data; boundary=XyZ\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    c.send(req.as_bytes()).await;
    assert_eq!(c.read_response().await.unwrap().status, 400);
    server.stop().await;
}

#[tokio::test]
async fn uploads_over_the_limit_get_413_and_leave_no_file() {
    let (app, opts) = upload_app("toolarge", 1000);
    let server = TestServer::start(app, HttpConfig::default()).await;

    // Declared too large, with Expect: refused before the body is sent.
    let mut c = Client::connect(server.addr).await;
    c.send(
        b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n",
    )
    .await;
    let r = c.read_response().await.unwrap();
    assert_eq!(r.status, 413);
    assert_eq!(r.header("connection"), Some("close"));

    // Chunked, discovered mid-stream: the partial file is removed before the answer.
    let mut c = Client::connect(server.addr).await;
    c.send(b"POST /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        .await;
    let chunk = format!("{:x}\r\n{}\r\n", 600, "a".repeat(600));
    c.send(chunk.as_bytes()).await;
    c.send(chunk.as_bytes()).await;
    c.send(b"0\r\n\r\n").await;
    assert_eq!(c.read_response().await.unwrap().status, 413);
    assert_eq!(common::entries(&opts.upload_dir), Vec::<String>::new());

    // Multipart over the limit.
    let mut c = Client::connect(server.addr).await;
    let body = format!(
        "--B\r\nContent-Disposition: form-data; name=\"f\"; filename=\"x\"\r\n\r\n{}\r\n--B--\r\n",
        "z".repeat(3000)
    );
    c.send(b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Type: multipart/form-data; boundary=B\r\nTransfer-Encoding: chunked\r\n\r\n").await;
    c.send(format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len()).as_bytes())
        .await;
    assert_eq!(c.read_response().await.unwrap().status, 413);
    assert_eq!(common::entries(&opts.upload_dir), Vec::<String>::new());

    // The server still serves uploads within the limit.
    let mut c = Client::connect(server.addr).await;
    c.send(b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc")
        .await;
    assert_eq!(c.read_response().await.unwrap().status, 200);
    assert_eq!(common::entries(&opts.upload_dir).len(), 1);
    server.stop().await;
}

#[tokio::test]
async fn slow_heads_are_dropped_after_the_header_timeout() {
    let (app, _) = upload_app("slowloris", 1000);
    let config = HttpConfig {
        header_read_timeout: Duration::from_millis(300),
        ..HttpConfig::default()
    };
    let server = TestServer::start(app, config).await;
    let mut slow = Client::connect(server.addr).await;
    slow.send(b"GET /static/4k HTTP/1.1\r\nHost: t\r\n").await; // never finished
    let sent = slow.read_to_close().await;
    assert!(
        sent.is_empty() || sent.starts_with(b"HTTP/1.1 408"),
        "{}",
        String::from_utf8_lossy(&sent)
    );
    // Others are served.
    let mut ok = Client::connect(server.addr).await;
    assert_eq!(ok.get("/static/4k", "").await.status, 200);
    server.stop().await;
}

#[tokio::test]
async fn bad_request_lines_and_huge_heads_close_only_their_connection() {
    let (app, _) = upload_app("badinput", 1000);
    let server = TestServer::start(app, HttpConfig::default()).await;
    let mut bystander = Client::connect(server.addr).await;
    assert_eq!(bystander.get("/0k", "").await.status, 200);

    let mut bad = Client::connect(server.addr).await;
    bad.send(b"GARBAGE\x01 / HTTP/9.9 what\r\n\r\n").await;
    let r = bad.read_response().await.expect("an answer before closing");
    assert_eq!(r.status, 400);
    assert!(bad.read_to_close().await.is_empty());

    let mut huge = Client::connect(server.addr).await;
    let big = format!(
        "GET /0k HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
        "h".repeat(40 * 1024)
    );
    huge.send(big.as_bytes()).await;
    let r = huge
        .read_response()
        .await
        .expect("an answer before closing");
    assert_eq!(r.status, 431);

    // The bystander's keep-alive connection is unharmed.
    assert_eq!(bystander.get("/static/4k", "").await.body.len(), 4096);
    server.stop().await;
}

#[tokio::test]
async fn slow_handlers_get_408() {
    let router = Router::new().get("/slow", |_req| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        Response::new(Body::from("late"))
    });
    let config = HttpConfig {
        request_timeout: Duration::from_millis(100),
        ..HttpConfig::default()
    };
    let server = TestServer::start(router, config).await;
    let mut c = Client::connect(server.addr).await;
    let r = c.get("/slow", "").await;
    assert_eq!(r.status, StatusCode::REQUEST_TIMEOUT.as_u16());
    server.stop().await;
}

#[tokio::test]
async fn the_connection_cap_holds_new_connections_until_one_closes() {
    let (app, _) = upload_app("cap", 1000);
    let config = HttpConfig {
        max_connections: 1,
        ..HttpConfig::default()
    };
    let server = TestServer::start(app, config).await;
    let mut first = Client::connect(server.addr).await;
    assert_eq!(first.get("/0k", "").await.status, 200);
    // The second connection is accepted by the kernel but not served yet.
    let mut second = Client::connect(server.addr).await;
    second.send(b"GET /0k HTTP/1.1\r\nHost: t\r\n\r\n").await;
    // Held back while `first` is open (without the cap: answered at once).
    let mut byte = [0u8; 1];
    let early =
        tokio::time::timeout(Duration::from_millis(200), second.stream.peek(&mut byte)).await;
    assert!(
        early.is_err(),
        "the second connection got an answer (or was closed) while the first held the only slot: {early:?}"
    );
    drop(first);
    assert_eq!(second.read_response().await.unwrap().status, 200);
    server.stop().await;
}

#[tokio::test]
async fn a_port_already_served_is_a_clear_error() {
    let (app, _) = upload_app("portbusy", 1000);
    let server = TestServer::start(app, HttpConfig::default()).await;
    // SO_REUSEPORT would let a second server share the port silently.
    let err = railyard_http::bind(server.addr, 2, &HttpConfig::default()).unwrap_err();
    assert!(
        matches!(err, railyard_http::HttpError::Bind { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("is the port in use?"), "{err}");
    server.stop().await;
}

/// Sends a multipart upload (boundary `B`) whose head declares `declared`
/// body bytes, then `body` in 4 KiB writes, and reads the answer without ever
/// sending the rest: only a server that refuses from what it has read answers.
async fn multipart_answer(server: &TestServer, body: &[u8], declared: usize) -> common::Resp {
    use tokio::io::AsyncWriteExt as _;
    let mut c = Client::connect(server.addr).await;
    c.send(format!("POST /upload HTTP/1.1\r\nHost: t\r\nContent-Type: multipart/form-data; boundary=B\r\nContent-Length: {declared}\r\n\r\n").as_bytes())
        .await;
    for piece in body.chunks(4096) {
        // A server that has refused closes the connection: stop writing.
        if c.stream.write_all(piece).await.is_err() {
            break;
        }
    }
    c.read_response()
        .await
        .expect("an answer before the body ends")
}

fn assert_head_refusal(r: &common::Resp) {
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("connection"), Some("close"));
    assert!(
        String::from_utf8_lossy(&r.body).contains("preamble or part headers"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
}

#[tokio::test]
async fn a_multipart_preamble_over_the_head_limit_gets_400_and_leaves_no_file() {
    let (app, opts) = upload_app("preamble", 4 << 20);
    let server = TestServer::start(app, HttpConfig::default()).await;
    // 200 KiB without the boundary, of a body declared at 1 MiB (within the
    // upload limit): without the cap, multer would keep reading and buffering.
    let body = vec![b'p'; 200 * 1024];
    assert!(body.len() > c10k::MAX_MULTIPART_HEAD_BYTES);
    let r = multipart_answer(&server, &body, 1 << 20).await;
    assert_head_refusal(&r);
    assert_eq!(common::entries(&opts.upload_dir), Vec::<String>::new());
    server.stop().await;
}

#[tokio::test]
async fn multipart_part_headers_over_the_head_limit_get_400_and_leave_no_file() {
    let (app, opts) = upload_app("partheads", 4 << 20);
    let server = TestServer::start(app, HttpConfig::default()).await;
    // The first part's header block never ends (no CRLFCRLF).
    let mut body =
        b"--B\r\nContent-Disposition: form-data; name=\"f\"; filename=\"x\"\r\nX-Pad: ".to_vec();
    body.resize(body.len() + 200 * 1024, b'h');
    let r = multipart_answer(&server, &body, 1 << 20).await;
    assert_head_refusal(&r);
    assert_eq!(common::entries(&opts.upload_dir), Vec::<String>::new());

    // The limit applies afresh to every part: a complete form field, then a
    // file part whose header block never ends.
    let mut body = b"--B\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi\r\n--B\r\nContent-Disposition: form-data; name=\"f\"; filename=\"x\"\r\nX-Pad: ".to_vec();
    body.resize(body.len() + 200 * 1024, b'h');
    let r = multipart_answer(&server, &body, 1 << 20).await;
    assert_head_refusal(&r);
    assert_eq!(common::entries(&opts.upload_dir), Vec::<String>::new());
    server.stop().await;
}

/// A multipart body with a preamble and, per part, a header block that fit
/// the limit on their own (together they would not: the limit is per part).
fn big_headed_multipart(files: &[&[u8]]) -> Vec<u8> {
    let pad = "h".repeat(c10k::MAX_MULTIPART_HEAD_BYTES / 2);
    let mut body = format!("{}\r\n", "preamble ".repeat(200)).into_bytes();
    for (i, data) in files.iter().enumerate() {
        body.extend_from_slice(format!("--B\r\nContent-Disposition: form-data; name=\"f{i}\"; filename=\"f{i}\"\r\nX-Pad: {pad}\r\n\r\n").as_bytes());
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(b"--B--\r\n");
    body
}

#[tokio::test]
async fn multipart_uploads_with_large_headers_within_the_limit_are_stored() {
    let (app, opts) = upload_app("bigheads", 4 << 20);
    let server = TestServer::start(app, HttpConfig::default()).await;
    // The second file is larger than the pieces the parser is fed.
    let first = c10k::random_alnum(3000);
    let second = c10k::random_alnum(300 * 1024);
    let body = big_headed_multipart(&[&first, &second]);
    let r = multipart_answer(&server, &body, body.len()).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let mut stored: Vec<Vec<u8>> = common::entries(&opts.upload_dir)
        .iter()
        .map(|f| std::fs::read(opts.upload_dir.join(f)).unwrap())
        .collect();
    stored.sort_by_key(Vec::len);
    assert_eq!(stored, vec![first.to_vec(), second.to_vec()]);
    server.stop().await;
}

#[tokio::test]
async fn an_upload_with_more_file_parts_than_the_limit_gets_400_and_leaves_no_file() {
    let (app, opts) = upload_app("manyfiles", 4 << 20);
    let server = TestServer::start(app, HttpConfig::default()).await;
    let part = |i: usize| {
        format!(
            "--B\r\nContent-Disposition: form-data; name=\"f{i}\"; filename=\"f{i}\"\r\n\r\nx\r\n"
        )
    };
    // Exactly the limit is stored.
    let mut body: String = (0..c10k::MAX_UPLOAD_FILES).map(part).collect();
    body.push_str("--B--\r\n");
    let r = multipart_answer(&server, body.as_bytes(), body.len()).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        common::entries(&opts.upload_dir).len(),
        c10k::MAX_UPLOAD_FILES
    );
    for f in common::entries(&opts.upload_dir) {
        std::fs::remove_file(opts.upload_dir.join(f)).unwrap();
    }
    // One more is refused, and none of the upload's files stays.
    let mut body: String = (0..=c10k::MAX_UPLOAD_FILES).map(part).collect();
    body.push_str("--B--\r\n");
    let r = multipart_answer(&server, body.as_bytes(), body.len()).await;
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("connection"), Some("close"));
    assert!(
        String::from_utf8_lossy(&r.body).contains("more file parts"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(common::entries(&opts.upload_dir), Vec::<String>::new());
    server.stop().await;
}

#[tokio::test]
async fn the_head_limit_holds_for_bodies_given_in_one_piece() {
    use http_body_util::BodyExt as _;
    // Called without a socket, the whole body is one chunk.
    let (app, opts) = upload_app("onepiece", 4 << 20);
    let post = |body: Vec<u8>| {
        http::Request::post("/upload")
            .header("content-type", "multipart/form-data; boundary=B")
            .body(railyard_http::RequestBody::from(body))
            .unwrap()
    };
    let data = c10k::random_alnum(1 << 20);
    let r = app.handle(post(big_headed_multipart(&[&data]))).await;
    assert_eq!(r.status(), StatusCode::OK);
    let files = common::entries(&opts.upload_dir);
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(
        std::fs::read(opts.upload_dir.join(&files[0])).unwrap(),
        data
    );

    let mut body =
        b"--B\r\nContent-Disposition: form-data; name=\"f\"; filename=\"x\"\r\nX-Pad: ".to_vec();
    body.resize(body.len() + 200 * 1024, b'h');
    body.extend_from_slice(b"\r\n\r\ndata\r\n--B--\r\n");
    let r = app.handle(post(body)).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let text = r.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&text).contains("preamble or part headers"),
        "{}",
        String::from_utf8_lossy(&text)
    );
    assert_eq!(common::entries(&opts.upload_dir), files);
}

/// A multipart body (boundary `B`) with one small file part, then the head of
/// a second file part followed by `second`.
fn two_file_parts(second: &[u8]) -> Vec<u8> {
    let mut body = b"--B\r\nContent-Disposition: form-data; name=\"a\"; filename=\"a\"\r\n\r\nfirst file\r\n--B\r\nContent-Disposition: form-data; name=\"b\"; filename=\"b\"\r\n\r\n".to_vec();
    body.extend_from_slice(second);
    body
}

#[tokio::test]
async fn a_failing_later_part_removes_the_files_of_earlier_parts() {
    let (app, opts) = upload_app("laterpart", 2000);
    let server = TestServer::start(app, HttpConfig::default()).await;

    // The second part passes the limit: 413, and the first file is gone too.
    let mut body = two_file_parts(&vec![b'z'; 3000]);
    body.extend_from_slice(b"\r\n--B--\r\n");
    let mut c = Client::connect(server.addr).await;
    c.send(b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Type: multipart/form-data; boundary=B\r\nTransfer-Encoding: chunked\r\n\r\n").await;
    c.send(format!("{:x}\r\n", body.len()).as_bytes()).await;
    c.send(&body).await;
    c.send(b"\r\n0\r\n\r\n").await;
    let r = c.read_response().await.unwrap();
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(common::entries(&opts.upload_dir), Vec::<String>::new());

    // The second part is malformed (the body ends inside it, without a
    // closing boundary): 400, and no file of the request is left.
    let body = two_file_parts(b"cut short");
    let mut c = Client::connect(server.addr).await;
    let head = format!("POST /upload HTTP/1.1\r\nHost: t\r\nContent-Type: multipart/form-data; boundary=B\r\nContent-Length: {}\r\n\r\n", body.len());
    c.send(head.as_bytes()).await;
    c.send(&body).await;
    let r = c.read_response().await.unwrap();
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(common::entries(&opts.upload_dir), Vec::<String>::new());

    // Both parts complete: both files are stored.
    let mut body = two_file_parts(b"second file");
    body.extend_from_slice(b"\r\n--B--\r\n");
    let mut c = Client::connect(server.addr).await;
    let head = format!("POST /upload HTTP/1.1\r\nHost: t\r\nContent-Type: multipart/form-data; boundary=B\r\nContent-Length: {}\r\n\r\n", body.len());
    c.send(head.as_bytes()).await;
    c.send(&body).await;
    assert_eq!(c.read_response().await.unwrap().status, 200);
    let mut stored: Vec<Vec<u8>> = common::entries(&opts.upload_dir)
        .iter()
        .map(|f| std::fs::read(opts.upload_dir.join(f)).unwrap())
        .collect();
    stored.sort();
    assert_eq!(
        stored,
        vec![b"first file".to_vec(), b"second file".to_vec()]
    );
    server.stop().await;
}

#[tokio::test]
async fn a_client_leaving_mid_upload_leaves_no_file() {
    let (app, opts) = upload_app("leaves", 1 << 20);
    let server = TestServer::start(app, HttpConfig::default()).await;
    let body = two_file_parts(&[b'x'; 1000]);
    let mut c = Client::connect(server.addr).await;
    c.send(b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Type: multipart/form-data; boundary=B\r\nContent-Length: 100000\r\n\r\n").await;
    c.send(&body).await;
    // Both files exist (the first complete, the second being written)
    // before the client goes away in the middle of the second part.
    let started = std::time::Instant::now();
    while common::entries(&opts.upload_dir).len() < 2 {
        assert!(
            started.elapsed() < common::PATIENCE,
            "the server never wrote both parts: {:?}",
            common::entries(&opts.upload_dir)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(c);
    let started = std::time::Instant::now();
    while !common::entries(&opts.upload_dir).is_empty() {
        assert!(
            started.elapsed() < common::PATIENCE,
            "files left behind: {:?}",
            common::entries(&opts.upload_dir)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.stop().await;
}

/// A client that sends requests and never reads the answers holds its
/// connection only until `write_timeout` passes without progress: here it
/// holds the only slot, and a second client is served once the first is
/// dropped (on the fixed lane and through hyper).
#[tokio::test]
async fn a_client_that_never_reads_is_dropped_after_the_write_timeout() {
    for fixed_lane in [true, false] {
        let (app, _) = upload_app("stalled", 1000);
        let config = HttpConfig {
            max_connections: 1,
            write_timeout: Duration::from_secs(1),
            fixed_lane,
            ..HttpConfig::default()
        };
        let server = TestServer::start(app, config).await;
        // A small receive buffer, so the answers fill it quickly.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut deaf = socket.connect(server.addr).await.unwrap();
        let mut pipelined = Vec::new();
        // 300 heads (under the lane's 16 KiB), 19 MiB of answers.
        for _ in 0..300 {
            pipelined.extend_from_slice(b"GET /static/64k HTTP/1.1\r\nHost: t\r\n\r\n");
        }
        tokio::io::AsyncWriteExt::write_all(&mut deaf, &pipelined)
            .await
            .unwrap();
        // Never read: the server's writes stall, and its only slot is taken.
        let mut second = Client::connect(server.addr).await;
        second.send(b"GET /0k HTTP/1.1\r\nHost: t\r\n\r\n").await;
        let served = tokio::time::timeout(Duration::from_secs(10), second.read_response())
            .await
            .unwrap_or_else(|_| panic!("still held after 10 s (fixed lane: {fixed_lane})"));
        assert_eq!(served.unwrap().status, 200);
        drop(deaf);
        server.stop().await;
    }
}

/// A client still sending a body the server refused early (413 on the
/// declared length) gets to finish sending and read the answer: the server
/// reads and drops the rest before it closes, instead of closing with
/// input unread, which makes the kernel reset the connection under the
/// client's next write.
#[tokio::test]
async fn a_refused_upload_is_answered_without_a_reset() {
    let (app, _) = upload_app("linger", 1000);
    let server = TestServer::start(app, HttpConfig::default()).await;
    let mut c = Client::connect(server.addr).await;
    c.send(b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 4000000\r\n\r\n")
        .await;
    let chunk = vec![b'x'; 64 * 1024];
    c.send(&chunk).await;
    assert_eq!(c.read_response().await.unwrap().status, 413);
    // The client goes on sending, as a streaming client does.
    for _ in 0..16 {
        tokio::io::AsyncWriteExt::write_all(&mut c.stream, &chunk)
            .await
            .expect("no reset while the client finishes sending");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.stop().await;
}
