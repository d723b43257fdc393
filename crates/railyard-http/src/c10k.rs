//! Seed 004's routes: the C10K demo app.
//!
//! | route | answer |
//! |---|---|
//! | `GET /0k` | empty 200 |
//! | `GET /static/4k`, `/static/8k`, `/static/64k` | fixed random alphanumeric bodies made at start, compressed once per encoding |
//! | `GET /cached/4k`, `/cached/8k`, `/cached/64k` | a body from a moka cache (random key in 0..5000 per request, like the seed's Caffeine caches; entries expire after `cache_ttl`), compressed at most once per entry and encoding |
//! | `GET /sendFile/test` | the file `send_file`, by zero-copy `sendfile(2)` |
//! | `POST /upload` | the body (raw, or every file part of a `multipart/form-data` body) streamed to `upload_dir`; 413 over `max_upload_bytes`, leaving no partial file |

use std::cell::Cell;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONNECTION, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, VARY};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt as _;
use tokio::io::AsyncWriteExt as _;

use crate::body::{Body, RequestBody};
use crate::compress::{compress_async, Encoding, FixedBody};
use crate::router::{self, Router};

const TEXT: &str = "text/plain; charset=utf-8";

/// Size of the file written at `send_file` when it does not exist.
pub const DEFAULT_SEND_FILE_LEN: usize = 16 * 1024;

/// Keys per cache: requests pick one at random, as in the seed.
pub const CACHE_KEYS: u32 = 5000;

/// Entries per cache at most (the seed's Caffeine `maximumSize`).
pub const CACHE_CAPACITY: u64 = 10_000;

/// Where the app keeps its files and how big things may get.
#[derive(Debug, Clone)]
pub struct C10kOptions {
    /// The file served at `/sendFile/test`; created with
    /// [`DEFAULT_SEND_FILE_LEN`] random alphanumeric bytes if missing.
    pub send_file: PathBuf,
    /// Where uploads land (created if missing).
    pub upload_dir: PathBuf,
    /// Largest upload; larger gets 413.
    pub max_upload_bytes: u64,
    /// How long a cached body lives.
    pub cache_ttl: Duration,
    /// Smallest body worth compressing.
    pub compress_min_bytes: usize,
}

impl C10kOptions {
    /// Files under `dir`: `dir/test` and `dir/uploads`; other values default.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            send_file: dir.join("test"),
            upload_dir: dir.join("uploads"),
            max_upload_bytes: crate::HttpConfig::default().max_body_bytes,
            cache_ttl: Duration::from_secs(300),
            compress_min_bytes: crate::HttpConfig::default().compress_min_bytes,
        }
    }
}

/// Builds the app. Does blocking file I/O (creates directories, opens and
/// warms the send file): call it before serving, or on a blocking thread.
///
/// # Errors
/// If the upload directory or the send file cannot be created or opened.
pub fn app(opts: &C10kOptions) -> io::Result<Router> {
    std::fs::create_dir_all(&opts.upload_dir)?;
    let (file, len) = open_send_file(&opts.send_file)?;
    let min = opts.compress_min_bytes;
    let fixed = |n| FixedBody::new(random_alnum(n), TEXT, min);
    let upload_dir = Arc::new(opts.upload_dir.clone());
    let max_upload = opts.max_upload_bytes;
    let mut router = Router::new()
        .compress_min_bytes(min)
        .fixed("/0k", FixedBody::new(Bytes::new(), TEXT, min))
        .fixed("/static/4k", fixed(4 * 1024))
        .fixed("/static/8k", fixed(8 * 1024))
        .fixed("/static/64k", fixed(64 * 1024));
    for (path, size) in [
        ("/cached/4k", 4 * 1024),
        ("/cached/8k", 8 * 1024),
        ("/cached/64k", 64 * 1024),
    ] {
        let cache: moka::sync::Cache<u32, Arc<CachedBody>> = moka::sync::Cache::builder()
            .max_capacity(CACHE_CAPACITY)
            .time_to_live(opts.cache_ttl)
            .build();
        router = router.get(path, move |req: Request<RequestBody>| {
            cached(cache.clone(), size, min, Encoding::negotiate(req.headers()))
        });
    }
    let file = Arc::new(file);
    router = router
        .get("/sendFile/test", move |_req| {
            let mut r = Response::new(Body::file(file.clone(), 0, len));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            std::future::ready(r)
        })
        .post("/upload", move |req| {
            upload(req, upload_dir.clone(), max_upload)
        });
    Ok(router)
}

/// Opens (creating if missing) the send file and reads it once so its pages
/// are cached: `sendfile` then copies from memory and does not wait on disk.
fn open_send_file(path: &Path) -> io::Result<(File, u64)> {
    if !path.exists() {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // Written aside and renamed, so a concurrent starter never sees half a file.
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, random_alnum(DEFAULT_SEND_FILE_LEN))?;
        std::fs::rename(&tmp, path)?;
    }
    let mut f = File::open(path)?;
    let len = io::copy(&mut f, &mut io::sink())?;
    Ok((File::open(path)?, len))
}

thread_local! {
    static RNG: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (t ^ COUNTER.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)) | 1
}

/// xorshift64*: plenty for picking cache keys and making filler text.
fn next_random() -> u64 {
    RNG.with(|r| {
        let mut x = r.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        r.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    })
}

/// `len` random alphanumeric bytes, like the seed's `RandomStringUtils.randomAlphanumeric`.
pub fn random_alnum(len: usize) -> Bytes {
    const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        let mut r = next_random();
        for _ in 0..8 {
            if v.len() == len {
                break;
            }
            v.push(ALNUM[(r % ALNUM.len() as u64) as usize]);
            r >>= 8;
        }
    }
    Bytes::from(v)
}

/// A cached body and its compressed forms, made on first demand.
struct CachedBody {
    identity: Bytes,
    gzip: OnceLock<Bytes>,
    deflate: OnceLock<Bytes>,
}

async fn cached(
    cache: moka::sync::Cache<u32, Arc<CachedBody>>,
    size: usize,
    min: usize,
    enc: Encoding,
) -> Response<Body> {
    let key = (next_random() % u64::from(CACHE_KEYS)) as u32;
    // A miss makes the body here (~0.1 ms for 64 KiB); moka makes concurrent
    // misses of one key wait for a single maker.
    let entry = cache.get_with(key, || {
        Arc::new(CachedBody {
            identity: random_alnum(size),
            gzip: OnceLock::new(),
            deflate: OnceLock::new(),
        })
    });
    let slot = match enc {
        Encoding::Gzip => Some(&entry.gzip),
        Encoding::Deflate => Some(&entry.deflate),
        Encoding::Identity => None,
    };
    let mut body = entry.identity.clone();
    let mut coding = None;
    if let Some(slot) = slot.filter(|_| entry.identity.len() >= min) {
        body = match slot.get() {
            Some(b) => b.clone(),
            None => {
                let c = compress_async(enc, entry.identity.clone()).await;
                slot.get_or_init(|| c).clone()
            }
        };
        coding = enc.header_value();
    }
    let mut r = Response::new(Body::full(body));
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(TEXT));
    h.insert(VARY, HeaderValue::from_static("accept-encoding"));
    if let Some(c) = coding {
        h.insert(CONTENT_ENCODING, c);
    }
    r
}

/// Why an upload failed, and the status it maps to.
#[derive(Debug, thiserror::Error)]
enum UploadError {
    #[error("upload larger than the limit")]
    TooLarge,
    #[error("the request body could not be read: {0}")]
    Body(String),
    #[error("no file part in the multipart body")]
    NoFile,
    #[error("writing the upload failed: {0}")]
    Disk(#[from] io::Error),
}

impl UploadError {
    fn response(&self) -> Response<Body> {
        let mut r = match self {
            UploadError::TooLarge => router::text(
                StatusCode::PAYLOAD_TOO_LARGE,
                "upload larger than the server's limit\n",
            ),
            UploadError::Body(_) => {
                router::text(StatusCode::BAD_REQUEST, "the upload could not be read\n")
            }
            UploadError::NoFile => router::text(
                StatusCode::BAD_REQUEST,
                "no file part in the multipart upload\n",
            ),
            UploadError::Disk(_) => router::text(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the upload could not be stored\n",
            ),
        };
        // The body may be partly unread: do not reuse the connection.
        r.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
        r
    }
}

async fn upload(req: Request<RequestBody>, dir: Arc<PathBuf>, max: u64) -> Response<Body> {
    match store_upload(req, &dir, max).await {
        Ok(()) => Response::new(Body::empty()),
        Err(e) => {
            if let UploadError::Disk(_) = &e {
                tracing::warn!(error = %e, "upload failed");
            } else {
                tracing::debug!(error = %e, "upload refused");
            }
            e.response()
        }
    }
}

async fn store_upload(req: Request<RequestBody>, dir: &Path, max: u64) -> Result<(), UploadError> {
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max) {
        // Refused before reading: with `Expect: 100-continue` the client
        // never sends the body.
        return Err(UploadError::TooLarge);
    }
    let boundary = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|ct| multer::parse_boundary(ct).ok());
    let body = req.into_body();
    match boundary {
        Some(b) => store_multipart(body, b, dir, max).await,
        None => store_raw(body, dir, max).await,
    }
}

async fn store_raw(mut body: RequestBody, dir: &Path, max: u64) -> Result<(), UploadError> {
    let mut part = PartialFile::create(dir).await?;
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                part.discard().await;
                return Err(UploadError::Body(e.to_string()));
            }
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len() as u64;
        if total > max {
            part.discard().await;
            return Err(UploadError::TooLarge);
        }
        if let Err(e) = part.write(&data).await {
            part.discard().await;
            return Err(e.into());
        }
    }
    part.commit().await?;
    Ok(())
}

async fn store_multipart(
    body: RequestBody,
    boundary: String,
    dir: &Path,
    max: u64,
) -> Result<(), UploadError> {
    let constraints =
        multer::Constraints::new().size_limit(multer::SizeLimit::new().whole_stream(max));
    let mut mp =
        multer::Multipart::with_constraints(body.into_data_stream(), boundary, constraints);
    let mut files = 0usize;
    loop {
        let field = match mp.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return Err(multipart_error(e)),
        };
        let mut field = field;
        if field.file_name().is_none() {
            // A plain form field: read and drop it (the size limit still applies).
            loop {
                match field.chunk().await {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) => return Err(multipart_error(e)),
                }
            }
            continue;
        }
        let mut part = PartialFile::create(dir).await?;
        loop {
            match field.chunk().await {
                Ok(Some(chunk)) => {
                    if let Err(e) = part.write(&chunk).await {
                        part.discard().await;
                        return Err(e.into());
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    part.discard().await;
                    return Err(multipart_error(e));
                }
            }
        }
        part.commit().await?;
        files += 1;
    }
    if files == 0 {
        return Err(UploadError::NoFile);
    }
    Ok(())
}

fn multipart_error(e: multer::Error) -> UploadError {
    match e {
        multer::Error::StreamSizeExceeded { .. } | multer::Error::FieldSizeExceeded { .. } => {
            UploadError::TooLarge
        }
        other => UploadError::Body(other.to_string()),
    }
}

/// An upload being written under a hidden temporary name; renamed into place
/// by [`PartialFile::commit`], removed otherwise (also when the request is
/// cancelled: see `Drop`).
struct PartialFile {
    tmp: PathBuf,
    dst: PathBuf,
    file: Option<tokio::fs::File>,
}

static UPLOAD_ID: AtomicU64 = AtomicU64::new(0);

impl PartialFile {
    async fn create(dir: &Path) -> io::Result<Self> {
        let id = UPLOAD_ID.fetch_add(1, Ordering::Relaxed);
        let name = format!("upload-{}-{id}", std::process::id());
        let tmp = dir.join(format!(".{name}.part"));
        let file = tokio::fs::File::create(&tmp).await?;
        Ok(Self {
            dst: dir.join(name),
            tmp,
            file: Some(file),
        })
    }

    async fn write(&mut self, data: &[u8]) -> io::Result<()> {
        match &mut self.file {
            Some(f) => f.write_all(data).await,
            None => Err(io::Error::other("upload file already closed")),
        }
    }

    async fn commit(mut self) -> io::Result<PathBuf> {
        if let Some(mut f) = self.file.take() {
            f.flush().await?;
        }
        tokio::fs::rename(&self.tmp, &self.dst).await?;
        self.tmp = PathBuf::new();
        Ok(std::mem::take(&mut self.dst))
    }

    /// Removes the partial file before returning.
    async fn discard(mut self) {
        if let Some(mut f) = self.file.take() {
            let _ = f.flush().await;
        }
        let tmp = std::mem::take(&mut self.tmp);
        if let Err(e) = tokio::fs::remove_file(&tmp).await {
            tracing::warn!(error = %e, file = %tmp.display(), "cannot remove a partial upload");
        }
    }
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if self.tmp.as_os_str().is_empty() {
            return;
        }
        // Cancelled mid-upload (the client left): unlink on the blocking
        // pool. An in-flight write only touches the already unlinked inode.
        let tmp = std::mem::take(&mut self.tmp);
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(move || {
                    let _ = std::fs::remove_file(tmp);
                });
            }
            Err(_) => {
                let _ = std::fs::remove_file(tmp);
            }
        }
    }
}
