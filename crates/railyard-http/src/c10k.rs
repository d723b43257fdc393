//! Seed 004's routes: the C10K demo app.
//!
//! | route | answer |
//! |---|---|
//! | `GET /0k` | empty 200 |
//! | `GET /static/4k`, `/static/8k`, `/static/64k` | fixed random alphanumeric bodies made at start, compressed once per encoding |
//! | `GET /cached/4k`, `/cached/8k`, `/cached/64k` | a body from a moka cache (random key in 0..5000 per request, like the seed's Caffeine caches; entries expire after `cache_ttl`), compressed at most once per entry and encoding |
//! | `GET /sendFile/test` | the file `send_file`, by zero-copy `sendfile(2)` |
//! | `POST /upload` | the body (raw, or every file part of a `multipart/form-data` body) streamed to `upload_dir`, all or nothing: a failed upload leaves none of its files; the 200 comes only once every file's data and its rename are durable (fsynced); 413 over `max_upload_bytes`; 400 for a malformed multipart body, when its preamble or a part header block passes [`MAX_MULTIPART_HEAD_BYTES`], or past [`MAX_UPLOAD_FILES`] file parts. [`app`] removes the hidden `.part` files that processes no longer running left in `upload_dir` |

use std::cell::Cell;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
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

/// Most bytes of a `multipart/form-data` upload that may arrive while the
/// parser is looking for the next part rather than reading one: the preamble,
/// first boundary line and header block of the first part, then, afresh for
/// every later part, its boundary line and header block.
///
/// multer keeps those bytes in one buffer and searches all of it again each
/// time more arrive, until it finds the boundary or the blank line ending the
/// headers. Bounded only by `max_upload_bytes`, a body that never gets there
/// would hold up to that much (64 MiB by default) per connection and cost
/// quadratic CPU on its core's only thread, stalling every other connection
/// there. Past this
/// limit the upload gets 400 with `Connection: close`. 16 KiB is also the
/// default cap on a request's own head (`HttpConfig::max_header_bytes`).
pub const MAX_MULTIPART_HEAD_BYTES: usize = 16 * 1024;

/// Most file parts one multipart upload may store. Each is a file created
/// on the blocking pool and renamed at the end: without a cap, a body of
/// tiny parts within `max_upload_bytes` (64 MiB by default) could make the
/// server create hundreds of thousands of files for one request. Past it the
/// upload gets 400 with `Connection: close` and leaves none of its files.
pub const MAX_UPLOAD_FILES: usize = 1024;

/// Largest piece of the request body given to multer per poll. multer pulls
/// every chunk that is ready into its buffer before parsing, so the bytes it
/// holds when a part's data ends (the start of the next boundary and header
/// block, not counted against [`MAX_MULTIPART_HEAD_BYTES`]) are at most one
/// piece: what it buffers between parts stays under this plus that limit
/// (plus a boundary), however large the chunks hyper reads.
const MULTIPART_PIECE_BYTES: usize = 64 * 1024;

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

/// Builds the app. Does blocking file I/O (creates directories, removes the
/// stale upload parts of processes no longer running, opens and warms the
/// send file): call it before serving, or on a blocking thread.
///
/// # Errors
/// If the upload directory or the send file cannot be created or opened. A
/// stale part that cannot be removed is logged, not an error.
pub fn app(opts: &C10kOptions) -> io::Result<Router> {
    create_dir_durably(&opts.upload_dir)?;
    remove_stale_parts(&opts.upload_dir);
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
    #[error("{PartHeadTooLong}")]
    PartHead,
    #[error("more than {MAX_UPLOAD_FILES} file parts in one upload")]
    TooManyFiles,
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
            UploadError::PartHead => router::text(
                StatusCode::BAD_REQUEST,
                "multipart preamble or part headers longer than the server's limit\n",
            ),
            UploadError::TooManyFiles => router::text(
                StatusCode::BAD_REQUEST,
                "more file parts in one upload than the server's limit; send them in several uploads\n",
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
    let mut files = UploadFiles::new(dir);
    let read = match boundary {
        Some(b) => read_multipart(body, b, &mut files, max).await,
        None => read_raw(body, &mut files, max).await,
    };
    match read {
        Ok(()) => Ok(files.commit().await?),
        Err(e) => {
            files.discard().await;
            Err(e)
        }
    }
}

async fn read_raw(
    mut body: RequestBody,
    files: &mut UploadFiles,
    max: u64,
) -> Result<(), UploadError> {
    files.start().await?;
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| UploadError::Body(e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len() as u64;
        if total > max {
            return Err(UploadError::TooLarge);
        }
        files.write(&data).await?;
    }
    Ok(())
}

async fn read_multipart(
    body: RequestBody,
    boundary: String,
    files: &mut UploadFiles,
    max: u64,
) -> Result<(), UploadError> {
    let constraints =
        multer::Constraints::new().size_limit(multer::SizeLimit::new().whole_stream(max));
    let meter = HeadMeter::default();
    let stream = HeadLimited::new(body.into_data_stream(), &meter);
    let mut mp = multer::Multipart::with_constraints(stream, boundary, constraints);
    loop {
        meter.start_head();
        let Some(mut field) = mp.next_field().await.map_err(multipart_error)? else {
            break;
        };
        meter.start_data();
        // A plain form field is read and dropped (the size limit still applies).
        let is_file = field.file_name().is_some();
        if is_file {
            if files.len() >= MAX_UPLOAD_FILES {
                return Err(UploadError::TooManyFiles);
            }
            files.start().await?;
        }
        while let Some(chunk) = field.chunk().await.map_err(multipart_error)? {
            if is_file {
                files.write(&chunk).await?;
            }
        }
    }
    if files.is_empty() {
        return Err(UploadError::NoFile);
    }
    Ok(())
}

fn multipart_error(e: multer::Error) -> UploadError {
    match e {
        multer::Error::StreamSizeExceeded { .. } | multer::Error::FieldSizeExceeded { .. } => {
            UploadError::TooLarge
        }
        multer::Error::StreamReadFailed(inner) if inner.is::<PartHeadTooLong>() => {
            UploadError::PartHead
        }
        multer::Error::StreamReadFailed(inner) => UploadError::Body(inner.to_string()),
        other => UploadError::Body(other.to_string()),
    }
}

/// The stream error [`HeadLimited`] fails multer with.
#[derive(Debug, thiserror::Error)]
#[error("multipart preamble or part headers longer than {MAX_MULTIPART_HEAD_BYTES} bytes")]
struct PartHeadTooLong;

/// Which stretch of a multipart body multer is in, set by [`read_multipart`]
/// (which alone knows) and read by [`HeadLimited`] (which sees the bytes).
/// Atomics only because multer wants a `Send` stream: both sides run on the
/// same task.
#[derive(Debug, Default)]
struct HeadMeter {
    /// `next_field` is pending: multer looks for a boundary or reads headers.
    in_head: AtomicBool,
    /// Bytes given to multer since `in_head` was last set.
    used: AtomicUsize,
}

impl HeadMeter {
    fn start_head(&self) {
        self.used.store(0, Ordering::Relaxed);
        self.in_head.store(true, Ordering::Relaxed);
    }

    fn start_data(&self) {
        self.in_head.store(false, Ordering::Relaxed);
    }
}

/// The request body as multer sees it: at most one piece of at most
/// [`MULTIPART_PIECE_BYTES`] per poll, and, while multer is between parts,
/// at most [`MAX_MULTIPART_HEAD_BYTES`] in all. Pieces are cut to the budget
/// left, so a chunk holding short headers and then much part data spends at
/// most the budget (multer finds the headers in that piece; the rest of the
/// chunk goes to it as data); once the budget is spent, multer's next request
/// for more fails the stream with [`PartHeadTooLong`] instead of waiting for
/// bytes it could only buffer and search again.
struct HeadLimited<'m, S> {
    inner: S,
    meter: &'m HeadMeter,
    /// What is left of the chunk last read from `inner` (part of hyper's read
    /// buffer, so no copy; at most one chunk).
    rest: Bytes,
    /// A piece went out on the previous poll: the next one yields.
    gave: bool,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<'m, S> HeadLimited<'m, S> {
    fn new(inner: S, meter: &'m HeadMeter) -> Self {
        Self {
            inner,
            meter,
            rest: Bytes::new(),
            gave: false,
        }
    }
}

impl<S, E> Stream for HeadLimited<'_, S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: Into<BoxError>,
{
    type Item = Result<Bytes, BoxError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if std::mem::take(&mut this.gave) {
            // Ends multer's "pull all that is ready" loop after one piece; the
            // wake has it parse that piece and come back for the next one.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let in_head = this.meter.in_head.load(Ordering::Relaxed);
        let mut most = MULTIPART_PIECE_BYTES;
        if in_head {
            let left =
                MAX_MULTIPART_HEAD_BYTES.saturating_sub(this.meter.used.load(Ordering::Relaxed));
            if left == 0 {
                // multer has parsed all it was given and still wants more.
                return Poll::Ready(Some(Err(Box::new(PartHeadTooLong))));
            }
            most = most.min(left);
        }
        if this.rest.is_empty() {
            match ready!(Pin::new(&mut this.inner).poll_next(cx)) {
                Some(Ok(chunk)) => this.rest = chunk,
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                None => return Poll::Ready(None),
            }
        }
        let piece = this.rest.split_to(this.rest.len().min(most));
        if in_head {
            this.meter.used.fetch_add(piece.len(), Ordering::Relaxed);
        }
        this.gave = true;
        Poll::Ready(Some(Ok(piece)))
    }
}

/// The files of one upload request (one for a raw body, one per file part
/// of a multipart body). Each is written under a hidden `.part` name, and
/// [`UploadFiles::commit`] renames them all into place once the whole request
/// has been read: a request that fails anywhere (413, 400, a disk error, the
/// client leaving mid-body) leaves none of its files, not only none of the
/// part that failed. [`UploadFiles::discard`] removes them before the error
/// answer; `Drop` removes them when the request is cancelled.
///
/// Every step that makes a name appear (creating a file, the renames) and the
/// removal run on the blocking pool holding the `steps` lock. Removal marks
/// the upload abandoned, and a step that finds it so does nothing: so a
/// create or rename still queued when a cancelled request was dropped cannot
/// bring a file back after the removal ran, and one that ran first is undone
/// by it. Removal deletes a file's final name only if this upload renamed it
/// there: names are unique to this run of the process (see [`run_tag`]), but
/// a file under a final name is someone's stored upload. A removal tokio
/// drops without running it (see [`Removal`]) removes the files all the same.
///
/// # Durability
/// The 200 goes out only once what it acknowledges survives a crash: every
/// file's data is synced (`sync_data`, which covers its size) before its rename, and the upload
/// directory is synced once after the renames, so the new names are durable
/// too. This adds no blocking-pool hop: a finished part is synced and closed
/// in the step that creates the next one, and the commit's one step syncs the
/// last part, renames every file and syncs the directory. An upload of `n`
/// files thus takes `n` create steps and one commit step, plus tokio's hops
/// for the writes. A failed sync fails the upload (500) and removes its
/// files like any other error. (Whether the disk was synced cannot be seen
/// from a test; the order above is the whole argument.)
struct UploadFiles {
    dir: PathBuf,
    /// Held while a step runs (a std mutex: only blocking-pool threads take
    /// it).
    steps: Arc<std::sync::Mutex<Steps>>,
    /// The ids of the files made so far, the one being written last (ids, not
    /// paths: a multipart body of tiny parts may hold very many).
    ids: Vec<u64>,
    /// The file being written, if a part is open.
    open: Option<tokio::fs::File>,
}

/// What an upload's blocking steps have done.
#[derive(Debug, Default)]
struct Steps {
    /// The files have been (or are being) removed.
    abandoned: bool,
    /// How many of the upload's files (its first ids) are under their final
    /// names.
    renamed: usize,
}

static UPLOAD_ID: AtomicU64 = AtomicU64::new(0);

/// Part of every upload file name, unique to this run of the process: the
/// ids restart at 0 with every run, and a process id alone repeats (a
/// container's server is often pid 1 on every start, and two containers can
/// share a volume), so without it a new upload could replace, or a failed
/// one remove, a file an earlier run stored. The process id comes first:
/// [`remove_stale_parts`] reads it back.
fn run_tag() -> &'static str {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TAG.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        format!("{}-{:016x}", std::process::id(), h.finish())
    })
}

fn stored_name(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("upload-{}-{id}", run_tag()))
}

fn partial_name(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!(".upload-{}-{id}.part", run_tag()))
}

/// Removes the hidden `.part` files in `dir` that no running process will
/// finish, and returns how many it removed: those of a process that has
/// exited (by the process id in their name, see [`run_tag`]), and those of
/// an earlier run that had this process's id (that run is over: this process
/// holds its id). The parts of this run and of other live processes stay, as
/// do stored uploads and every name this server does not make. A part that
/// cannot be removed is logged and left: it never fails the start. Blocking
/// (lists the directory): [`app`] runs it.
///
/// Liveness is `kill(pid, 0)` in this process's pid namespace. A server
/// writing to the same directory from another namespace (another container
/// sharing the volume) can look exited, or have this process's id. So a
/// part is removed only if, besides, it was last written more than
/// [`STALE_PART_AGE`] ago: an upload under way writes its part as its body
/// arrives, and the default timeouts end one that stalls far sooner.
/// Younger leftovers wait for a later start. Were a live peer's part still
/// removed, its upload would fail at its rename (500) instead of being
/// acknowledged: nothing acknowledged is lost.
fn remove_stale_parts(dir: &Path) -> usize {
    remove_stale_parts_older_than(dir, STALE_PART_AGE)
}

/// Creates `dir` and any missing parents, then syncs the directory that
/// holds each new entry, so that a crash cannot take the upload directory
/// (and the uploads acknowledged in it) with the entry it was created under.
/// An existing `dir` costs one `stat`.
fn create_dir_durably(dir: &Path) -> io::Result<()> {
    // The directory that holds `p`'s entry (`.` for a relative name).
    fn holder(p: &Path) -> &Path {
        p.parent()
            .filter(|q| !q.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
    }
    let mut missing = Vec::new();
    let mut at = dir;
    while !at.exists() && at != Path::new(".") {
        missing.push(at);
        at = holder(at);
    }
    std::fs::create_dir_all(dir)?;
    for new in missing {
        File::open(holder(new))?.sync_all()?;
    }
    Ok(())
}

/// How long a leftover part must have gone unwritten before the start
/// sweep removes it (see [`remove_stale_parts`]).
const STALE_PART_AGE: Duration = Duration::from_secs(10 * 60);

fn remove_stale_parts_older_than(dir: &Path, age: Duration) -> usize {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            tracing::warn!(error = %e, dir = %dir.display(), "cannot list the upload directory for stale parts");
            return 0;
        }
    };
    let (mut removed, mut kept, mut failed) = (0usize, 0usize, 0usize);
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                tracing::warn!(error = %e, dir = %dir.display(), "cannot list the upload directory for stale parts");
                break;
            }
        };
        let name = entry.file_name();
        let Some((pid, tag)) = name.to_str().and_then(part_owner) else {
            continue;
        };
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let idle = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok());
        if !is_stale(pid, tag) || idle.is_none_or(|d| d < age) {
            kept += 1;
            continue;
        }
        let path = entry.path();
        match std::fs::remove_file(&path) {
            Ok(()) => removed += 1,
            // Its owner finished or removed it meanwhile.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                failed += 1;
                tracing::warn!(error = %e, file = %path.display(), "cannot remove a stale upload part");
            }
        }
    }
    if removed + kept + failed > 0 {
        tracing::info!(removed, kept, failed, dir = %dir.display(), "swept the upload directory for stale parts");
    }
    removed
}

/// The process id and run tag in `name` if it is an upload part's name as
/// [`partial_name`] makes it: `.upload-<pid>-<16 hex digits>-<id>.part`.
fn part_owner(name: &str) -> Option<(libc::pid_t, &str)> {
    let rest = name.strip_prefix(".upload-")?.strip_suffix(".part")?;
    let (tag, id) = rest.rsplit_once('-')?;
    let (pid, random) = tag.split_once('-')?;
    // Exactly as `run_tag` and `partial_name` write them: decimal numbers
    // without leading zeros, 16 lowercase hex digits.
    let number = |s: &str| {
        s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.is_empty() && !s.starts_with('0'))
    };
    if !number(id) || !number(pid) {
        return None;
    }
    if random.len() != 16
        || !random
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        return None;
    }
    // A process id is positive and fits a pid_t; anything else is not a
    // name this server made.
    let pid = pid.parse::<libc::pid_t>().ok().filter(|&p| p > 0)?;
    Some((pid, tag))
}

/// Whether the part of run `tag` of process `pid` is left over: not this
/// run's, and either of this process's id (an earlier run's) or of a process
/// that no longer exists.
fn is_stale(pid: libc::pid_t, tag: &str) -> bool {
    if tag == run_tag() {
        return false;
    }
    u32::try_from(pid).is_ok_and(|p| p == std::process::id()) || !process_exists(pid)
}

/// Whether process `pid` (> 0) exists in this pid namespace.
fn process_exists(pid: libc::pid_t) -> bool {
    // Safety: signal 0 sends nothing, kill only checks that the process
    // exists and may be signalled; `pid` > 0 names one process, not a group.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    // EPERM: it exists but belongs to another user. A zombie counts as
    // existing too: its parts wait for the next start.
    io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Syncs a finished part's data to disk and closes it: blocking, the work of
/// a step on the blocking pool.
fn sync_and_close(part: Option<File>) -> io::Result<()> {
    // Closing after a successful sync loses nothing, so drop's silent close
    // is enough.
    // `fdatasync`: the data and what reading it needs (the size), not
    // the times.
    part.map_or(Ok(()), |f| f.sync_data())
}

impl UploadFiles {
    fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            steps: Arc::default(),
            ids: Vec::new(),
            open: None,
        }
    }

    fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Files started so far.
    fn len(&self) -> usize {
        self.ids.len()
    }

    /// Runs `step` on the blocking pool, unless the upload has been
    /// abandoned by then.
    async fn unless_abandoned<T: Send + 'static>(
        &self,
        step: impl FnOnce(&mut Steps) -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        let steps = self.steps.clone();
        let job = tokio::task::spawn_blocking(move || {
            // A step that panicked left nothing half-done that removal minds.
            let mut steps = steps
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if steps.abandoned {
                return Err(io::Error::other("the upload was abandoned"));
            }
            step(&mut steps)
        });
        job.await.map_err(io::Error::other)?
    }

    /// Finishes the part being written, if any, and starts the next file:
    /// one blocking step syncs and closes the finished part, then creates
    /// the next.
    async fn start(&mut self) -> io::Result<()> {
        let finished = self.finish_part().await?;
        let id = UPLOAD_ID.fetch_add(1, Ordering::Relaxed);
        // Listed before it exists, so a cancelled create is cleaned up too.
        self.ids.push(id);
        let path = partial_name(&self.dir, id);
        let file = self
            .unless_abandoned(move |_| {
                sync_and_close(finished)?;
                File::create(path)
            })
            .await?;
        self.open = Some(tokio::fs::File::from_std(file));
        Ok(())
    }

    async fn write(&mut self, data: &[u8]) -> io::Result<()> {
        match &mut self.open {
            Some(f) => f.write_all(data).await,
            None => Err(io::Error::other("no upload file is open")),
        }
    }

    /// Waits for the open part's writes (tokio's file writes in the
    /// background) and hands its file over, for the next blocking step to
    /// sync and close ([`sync_and_close`]). `None` if no part is open.
    async fn finish_part(&mut self) -> io::Result<Option<File>> {
        let Some(mut f) = self.open.take() else {
            return Ok(None);
        };
        f.flush().await?;
        // Nothing is in flight after the flush: this does not wait.
        Ok(Some(f.into_std().await))
    }

    /// Makes every file durable and renames it into place, in one blocking
    /// step: syncs the last part (each earlier one was synced when the next
    /// began), renames the files one after another, then syncs the directory
    /// so that the renames are durable too. On an error, removes them all
    /// first.
    async fn commit(mut self) -> io::Result<()> {
        let renamed = match self.finish_part().await {
            Ok(last) => {
                let (dir, ids) = (self.dir.clone(), self.ids.clone());
                self.unless_abandoned(move |steps| {
                    sync_and_close(last)?;
                    // One after another: should one fail, removal takes
                    // back those already renamed.
                    for &id in &ids {
                        std::fs::rename(partial_name(&dir, id), stored_name(&dir, id))?;
                        steps.renamed += 1;
                    }
                    // A name lives in the directory: synced once for all.
                    File::open(&dir)?.sync_all()
                })
                .await
            }
            Err(e) => Err(e),
        };
        match renamed {
            Ok(()) => {
                self.ids.clear();
                Ok(())
            }
            Err(e) => {
                self.discard().await;
                Err(e)
            }
        }
    }

    /// Removes every file before returning.
    async fn discard(mut self) {
        if let Some(removal) = self.removal() {
            let _ = tokio::task::spawn_blocking(move || removal.run()).await;
        }
    }

    /// The job that abandons the upload and removes its files. `None` if
    /// there are none.
    fn removal(&mut self) -> Option<Removal> {
        if self.ids.is_empty() {
            return None;
        }
        Some(Removal {
            dir: std::mem::take(&mut self.dir),
            ids: std::mem::take(&mut self.ids),
            steps: self.steps.clone(),
            open: self.open.take(),
        })
    }
}

impl Drop for UploadFiles {
    fn drop(&mut self) {
        // Cancelled mid-upload (the client left, or shutdown dropped the
        // request): remove on the blocking pool. A write still in flight
        // only touches an unlinked inode.
        let Some(removal) = self.removal() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                // Should the pool be shutting down, tokio drops the job
                // unrun, and its drop removes the files.
                h.spawn_blocking(move || removal.run());
            }
            // Outside the runtime (its core's thread is shutting down):
            // blocking here holds up no event loop.
            Err(_) => removal.run(),
        }
    }
}

/// The job that abandons an upload and removes its files: under their final
/// names those it renamed, the others under their hidden names. It does its
/// work in [`Removal::run`], or else when dropped: tokio drops a
/// blocking job it never starts (one spawned once its runtime's blocking
/// pool is shutting down, as when a runtime drops the requests still open),
/// and the files must go all the same. Blocking: it is run on the blocking
/// pool, and dropped unrun only there or by a runtime that is shutting down,
/// never on a serving event loop.
struct Removal {
    dir: PathBuf,
    ids: Vec<u64>,
    steps: Arc<std::sync::Mutex<Steps>>,
    /// The part being written, if any: closed here, off the event loop.
    open: Option<tokio::fs::File>,
}

impl Removal {
    fn run(mut self) {
        self.remove();
    }

    /// Removes the files; does nothing the second time.
    fn remove(&mut self) {
        self.open = None;
        let ids = std::mem::take(&mut self.ids);
        if ids.is_empty() {
            return;
        }
        let mut steps = self
            .steps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        steps.abandoned = true;
        for (k, id) in ids.into_iter().enumerate() {
            let path = if k < steps.renamed {
                stored_name(&self.dir, id)
            } else {
                partial_name(&self.dir, id)
            };
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    tracing::warn!(error = %e, file = %path.display(), "cannot remove a failed upload's file");
                }
                _ => {}
            }
        }
    }
}

impl Drop for Removal {
    fn drop(&mut self) {
        self.remove();
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;

    use super::*;

    /// Missing parents are created too, and an existing directory is left
    /// as it is.
    #[test]
    fn the_upload_directory_is_created_with_its_parents() {
        let tmp = upload_dir("durable");
        let dir = tmp.join("a").join("b").join("uploads");
        create_dir_durably(&dir).unwrap();
        assert!(dir.is_dir());
        std::fs::write(dir.join("kept"), b"x").unwrap();
        create_dir_durably(&dir).unwrap();
        assert_eq!(std::fs::read(dir.join("kept")).unwrap(), b"x");
        // A file in the way is an error, not a silent success.
        let blocked = tmp.join("file");
        std::fs::write(&blocked, b"x").unwrap();
        assert!(create_dir_durably(&blocked.join("uploads")).is_err());
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    fn limited<'m>(
        meter: &'m HeadMeter,
        chunks: Vec<Bytes>,
    ) -> HeadLimited<'m, impl Stream<Item = Result<Bytes, BoxError>> + Unpin> {
        HeadLimited::new(
            futures_util::stream::iter(chunks.into_iter().map(Ok)),
            meter,
        )
    }

    fn poll<S: Stream + Unpin>(s: &mut S) -> Poll<Option<S::Item>> {
        Pin::new(s).poll_next(&mut Context::from_waker(Waker::noop()))
    }

    fn upload_dir(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("railyard-http-unit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[tokio::test]
    async fn files_appear_only_when_the_whole_upload_commits() {
        let dir = upload_dir("commit");
        let mut files = UploadFiles::new(&dir);
        for data in [&b"one"[..], b"two"] {
            files.start().await.unwrap();
            files.write(data).await.unwrap();
        }
        let hidden = names(&dir);
        assert_eq!(hidden.len(), 2);
        assert!(hidden.iter().all(|n| n.ends_with(".part")), "{hidden:?}");
        files.commit().await.unwrap();
        let stored = names(&dir);
        assert_eq!(stored.len(), 2);
        assert!(
            stored.iter().all(|n| n.starts_with("upload-")),
            "{stored:?}"
        );
        // Each part's bytes, under the name of its id (ids grow).
        let mut bytes: Vec<(u64, Vec<u8>)> = stored
            .iter()
            .map(|n| {
                let id = n.rsplit('-').next().unwrap().parse().unwrap();
                (id, std::fs::read(dir.join(n)).unwrap())
            })
            .collect();
        bytes.sort();
        assert_eq!(bytes[0].1, b"one");
        assert_eq!(bytes[1].1, b"two");

        let dir = upload_dir("discard");
        let mut files = UploadFiles::new(&dir);
        files.start().await.unwrap();
        files.write(b"one").await.unwrap();
        files.start().await.unwrap();
        files.discard().await;
        assert_eq!(names(&dir), Vec::<String>::new());
    }

    #[tokio::test]
    async fn no_step_runs_once_the_upload_is_removed() {
        let dir = upload_dir("abandoned");
        let mut files = UploadFiles::new(&dir);
        files.start().await.unwrap();
        // As when a cancelled request's removal runs before a create or
        // rename it had queued.
        let steps = files.steps.clone();
        let remove = files.removal().expect("one file to remove");
        tokio::task::spawn_blocking(move || remove.run())
            .await
            .unwrap();
        assert!(steps.lock().unwrap().abandoned);
        let late = dir.join("late");
        let made = files
            .unless_abandoned({
                let late = late.clone();
                move |_| File::create(late)
            })
            .await;
        assert!(made.is_err());
        assert!(!late.exists());
        assert_eq!(names(&dir), Vec::<String>::new());
    }

    /// A failed upload removes only its own files: a stored file of another
    /// upload (or of an earlier run of the process) stays, whatever its
    /// name; and a rename that fails half-way takes back those done.
    #[tokio::test]
    async fn a_failed_upload_removes_its_own_files_and_no_other() {
        let dir = upload_dir("own");
        let mut stored = UploadFiles::new(&dir);
        stored.start().await.unwrap();
        stored.write(b"kept").await.unwrap();
        stored.commit().await.unwrap();
        let kept = names(&dir);
        assert_eq!(kept.len(), 1);
        // Three files; the second's hidden file vanishes, so the renames
        // stop after the first.
        let mut failing = UploadFiles::new(&dir);
        for data in [&b"a"[..], b"b", b"c"] {
            failing.start().await.unwrap();
            failing.write(data).await.unwrap();
        }
        std::fs::remove_file(partial_name(&dir, failing.ids[1])).unwrap();
        assert!(failing.commit().await.is_err());
        assert_eq!(names(&dir), kept, "only the earlier upload's file is left");
        // Names are unique to this run: not the process id alone.
        assert!(
            kept[0].starts_with(&format!("upload-{}-", run_tag())) && run_tag().len() > 17,
            "{kept:?}"
        );
    }

    #[tokio::test]
    async fn a_dropped_upload_removes_its_files() {
        let dir = upload_dir("drop");
        let mut files = UploadFiles::new(&dir);
        files.start().await.unwrap();
        files.write(b"one").await.unwrap();
        files.start().await.unwrap();
        drop(files);
        for _ in 0..2000 {
            if names(&dir).is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("files left behind: {:?}", names(&dir));
    }

    /// A removal tokio never starts still removes the files: here the
    /// runtime's blocking pool has stopped when the runtime drops the task
    /// holding the upload (as a core's runtime drops the requests still
    /// open), so the removal's job is dropped unrun.
    #[test]
    fn an_upload_dropped_as_its_runtime_shuts_down_removes_its_files() {
        let dir = upload_dir("runtime-drop");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
            let dir = dir.clone();
            tokio::spawn(async move {
                let mut files = UploadFiles::new(&dir);
                files.start().await.unwrap();
                files.write(b"one").await.unwrap();
                files.start().await.unwrap();
                let _ = ready_tx.send(());
                std::future::pending::<()>().await;
                drop(files);
            });
            ready_rx.await.unwrap();
        });
        assert_eq!(names(&dir).len(), 2);
        // Stops the blocking pool first, then drops the task inside the
        // runtime: spawning the removal finds the pool shut down.
        rt.shutdown_timeout(Duration::from_secs(5));
        assert_eq!(names(&dir), Vec::<String>::new());
    }

    #[test]
    fn only_part_names_are_read_as_parts() {
        let tag = run_tag();
        let ours = format!(".upload-{tag}-12.part");
        assert_eq!(
            part_owner(&ours),
            Some((std::process::id() as libc::pid_t, tag))
        );
        for other in [
            "upload-7-0123456789abcdef-1",
            ".upload-7-0123456789abcdef-1",
            ".upload-7-0123456789abcdef-.part",
            ".upload-7-0123456789abcdeg-1.part",
            ".upload-7-0123456789abcdef0-1.part",
            ".upload-0-0123456789abcdef-1.part",
            ".upload-+7-0123456789abcdef-1.part",
            ".upload-99999999999-0123456789abcdef-1.part",
            ".upload-7-1.part",
            ".upload-07-0123456789abcdef-1.part",
            ".upload-7-0123456789ABCDEF-1.part",
            ".upload-7-0123456789abcdef-01.part",
        ] {
            assert_eq!(part_owner(other), None, "{other}");
        }
    }

    /// At start, the parts of this run stay (another app in this process may
    /// be writing them), and those of an earlier run that had this
    /// process's id go: that run is over. (Other processes' parts, live and
    /// exited: `tests/routes.rs`.)
    #[test]
    fn stale_parts_of_an_earlier_run_with_this_pid_are_removed() {
        let dir = upload_dir("stale-own-pid");
        let this_run = partial_name(&dir, 3);
        let earlier_run = dir.join(format!(
            ".upload-{}-0123456789abcdef-3.part",
            std::process::id()
        ));
        for f in [&this_run, &earlier_run] {
            std::fs::write(f, b"x").unwrap();
        }
        // Both just written: too young for the start sweep.
        assert_eq!(remove_stale_parts(&dir), 0);
        assert_eq!(remove_stale_parts_older_than(&dir, Duration::ZERO), 1);
        assert!(this_run.exists());
        assert!(!earlier_run.exists());
    }

    #[test]
    fn field_data_reaches_multer_one_bounded_piece_per_poll() {
        let meter = HeadMeter::default();
        meter.start_data();
        let len = 3 * MULTIPART_PIECE_BYTES + 5;
        let mut s = limited(&meter, vec![Bytes::from(vec![b'd'; len])]);
        let mut total = 0;
        loop {
            match poll(&mut s) {
                Poll::Ready(Some(Ok(piece))) => {
                    assert!(piece.len() <= MULTIPART_PIECE_BYTES, "{}", piece.len());
                    total += piece.len();
                    // multer parses each piece before it can pull the next.
                    assert!(poll(&mut s).is_pending());
                }
                Poll::Ready(None) => break,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(total, len);
    }

    #[test]
    fn between_parts_the_stream_fails_once_the_head_budget_is_spent() {
        let meter = HeadMeter::default();
        meter.start_head();
        let chunks = vec![Bytes::from(vec![b'h'; 1000]); 40];
        let mut s = limited(&meter, chunks);
        let mut given = 0;
        let err = loop {
            match poll(&mut s) {
                Poll::Ready(Some(Ok(piece))) => given += piece.len(),
                Poll::Ready(Some(Err(e))) => break e,
                Poll::Pending => {}
                Poll::Ready(None) => panic!("the stream ended within the budget"),
            }
        };
        assert_eq!(given, MAX_MULTIPART_HEAD_BYTES);
        assert!(err.is::<PartHeadTooLong>(), "{err}");
        // Each part gets its own budget.
        meter.start_head();
        assert!(matches!(poll(&mut s), Poll::Ready(Some(Ok(_)))));
    }

    #[test]
    fn part_data_sharing_a_chunk_with_headers_is_not_counted() {
        let meter = HeadMeter::default();
        meter.start_head();
        let mut s = limited(&meter, vec![Bytes::from(vec![b'x'; 100 * 1024])]);
        // Cut at the budget, so multer finds short headers in the first piece
        // and the rest of the chunk is read as data.
        let Poll::Ready(Some(Ok(first))) = poll(&mut s) else {
            panic!("a piece")
        };
        assert_eq!(first.len(), MAX_MULTIPART_HEAD_BYTES);
        assert!(poll(&mut s).is_pending());
        meter.start_data();
        let mut rest = 0;
        while let Poll::Ready(Some(r)) = poll(&mut s) {
            rest += r.unwrap().len();
            assert!(poll(&mut s).is_pending());
        }
        assert_eq!(first.len() + rest, 100 * 1024);
    }
}
