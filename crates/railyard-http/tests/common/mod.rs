//! A real server on a free loopback port, and a tiny raw HTTP/1.1 client
//! that lets tests send exactly the bytes they mean (bad request lines,
//! slow heads, `Expect: 100-continue`).

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use railyard_http::{
    bind, HttpConfig, HttpMetrics, MetricsRegistry, Router, Server, ShutdownReport,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Bound on every wait in these tests (not a timing assertion: a hang guard).
pub const PATIENCE: Duration = Duration::from_secs(20);

pub struct TestServer {
    pub addr: SocketAddr,
    pub registry: MetricsRegistry,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<ShutdownReport>>,
}

impl TestServer {
    pub async fn start(router: Router, config: HttpConfig) -> Self {
        let (registry, metrics) = HttpMetrics::standalone();
        Self::start_with(router, config, registry, metrics).await
    }

    pub async fn start_with(
        router: Router,
        config: HttpConfig,
        registry: MetricsRegistry,
        metrics: std::sync::Arc<HttpMetrics>,
    ) -> Self {
        let listeners = bind("127.0.0.1:0".parse().unwrap(), 2, &config).expect("bind");
        let addr = listeners[0].local_addr().unwrap();
        let server = Server::new(router, config, metrics).expect("valid config");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            server
                .run(listeners, async {
                    let _ = rx.await;
                })
                .await
                .expect("server runs")
        });
        Self {
            addr,
            registry,
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// Signals shutdown and waits for the drain.
    pub async fn stop(mut self) -> ShutdownReport {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(PATIENCE, self.task.take().unwrap())
            .await
            .expect("shutdown finishes")
            .expect("server task")
    }

    pub fn signal_stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    pub async fn wait(mut self) -> ShutdownReport {
        tokio::time::timeout(PATIENCE, self.task.take().unwrap())
            .await
            .expect("shutdown finishes")
            .expect("server task")
    }
}

/// A parsed response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One client connection with a read buffer (keep-alive aware).
pub struct Client {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    pub async fn connect(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).unwrap();
        Self {
            stream,
            buf: Vec::new(),
        }
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    /// `GET path` with optional extra header lines, keep-alive.
    pub async fn get(&mut self, path: &str, extra: &str) -> Resp {
        let req = format!("GET {path} HTTP/1.1\r\nHost: test\r\n{extra}\r\n");
        self.send(req.as_bytes()).await;
        self.read_response().await.expect("a response")
    }

    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 16 * 1024];
        let n = tokio::time::timeout(PATIENCE, self.stream.read(&mut chunk))
            .await
            .expect("the server answers in time")
            .unwrap_or(0);
        self.buf.extend_from_slice(&chunk[..n]);
        n > 0
    }

    /// Reads one response; `None` if the server closed the connection first.
    pub async fn read_response(&mut self) -> Option<Resp> {
        self.read_response_for("GET").await
    }

    pub async fn read_response_for(&mut self, method: &str) -> Option<Resp> {
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut r = httparse::Response::new(&mut headers);
            match r.parse(&self.buf).expect("a valid response") {
                httparse::Status::Complete(head_len) => {
                    let status = r.code.unwrap();
                    let hs: Vec<(String, String)> = r
                        .headers
                        .iter()
                        .map(|h| {
                            (
                                h.name.to_ascii_lowercase(),
                                String::from_utf8_lossy(h.value).into_owned(),
                            )
                        })
                        .collect();
                    let len: usize = if method == "HEAD" || status == 100 {
                        0
                    } else {
                        hs.iter()
                            .find(|(k, _)| k == "content-length")
                            .map(|(_, v)| v.parse().unwrap())
                            .unwrap_or(0)
                    };
                    while self.buf.len() < head_len + len {
                        assert!(self.fill().await, "connection closed mid-body");
                    }
                    let body = self.buf[head_len..head_len + len].to_vec();
                    self.buf.drain(..head_len + len);
                    return Some(Resp {
                        status,
                        headers: hs,
                        body,
                    });
                }
                httparse::Status::Partial => {
                    if !self.fill().await {
                        assert!(self.buf.is_empty(), "closed mid-head: {:?}", self.buf);
                        return None;
                    }
                }
            }
        }
    }

    /// Waits for the server to close the connection; returns what it sent first.
    pub async fn read_to_close(&mut self) -> Vec<u8> {
        while self.fill().await {}
        std::mem::take(&mut self.buf)
    }
}

/// A fresh temporary directory for one test.
pub fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "railyard-http-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every entry of `dir` (hidden ones too).
pub fn entries(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
