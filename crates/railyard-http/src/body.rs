//! Request and response bodies.
//!
//! [`Body`] is one concrete type for every response, so the common cases
//! (empty, shared `Bytes`) need no boxing. A file body is sent by
//! `sendfile(2)` on plain TCP connections (see the crate docs) and read in
//! 64 KiB chunks on a blocking thread everywhere else, e.g. when a test calls
//! the router directly.

use std::fmt;
use std::fs::File;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

/// Why reading or producing a body failed.
#[derive(Debug)]
pub struct BodyError(Box<dyn std::error::Error + Send + Sync>);

impl BodyError {
    /// Wraps any error.
    pub fn new(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self(e.into())
    }
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "body error: {}", self.0)
    }
}

impl std::error::Error for BodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// A boxed body stream, for responses produced piece by piece.
pub type BoxBody = Pin<Box<dyn http_body::Body<Data = Bytes, Error = BodyError> + Send>>;

/// A response body.
pub struct Body {
    kind: Kind,
}

enum Kind {
    Empty,
    Full(Option<Bytes>),
    File(FileBody),
    Stream(BoxBody),
}

/// Size of one chunk when a file is read instead of sent with `sendfile`.
const FILE_CHUNK: u64 = 64 * 1024;

/// A byte range of an open file.
pub(crate) struct FileBody {
    pub(crate) file: Arc<File>,
    /// Next byte to produce.
    pub(crate) offset: u64,
    /// Bytes left to produce.
    pub(crate) remaining: u64,
    /// How the bytes are produced.
    pub(crate) mode: FileMode,
}

pub(crate) enum FileMode {
    /// Read chunks on the blocking pool; `pending` is the read in flight.
    Read {
        pending: Option<tokio::task::JoinHandle<io::Result<Bytes>>>,
    },
    /// Produce placeholder chunks that the connection turns into `sendfile`.
    Placeholder,
}

impl Body {
    /// No body.
    pub fn empty() -> Self {
        Self { kind: Kind::Empty }
    }

    /// Bytes already in memory (shared, never copied).
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        let b = bytes.into();
        if b.is_empty() {
            return Self::empty();
        }
        Self {
            kind: Kind::Full(Some(b)),
        }
    }

    /// `len` bytes of `file` from `offset`: zero-copy `sendfile(2)` on a plain
    /// TCP connection, chunked reads on a blocking thread otherwise.
    ///
    /// The response's `Content-Length` is `len`, whatever the handler's own
    /// header says. `sendfile` runs on the connection's event loop and reads
    /// through the page cache: keep the range cached (read it once on a
    /// blocking thread, as [`crate::c10k::app`] does), or a cold page is read
    /// from the disk while that core's other connections wait.
    pub fn file(file: Arc<File>, offset: u64, len: u64) -> Self {
        if len == 0 {
            return Self::empty();
        }
        Self {
            kind: Kind::File(FileBody {
                file,
                offset,
                remaining: len,
                mode: FileMode::Read { pending: None },
            }),
        }
    }

    /// Any body stream.
    pub fn stream(body: BoxBody) -> Self {
        Self {
            kind: Kind::Stream(body),
        }
    }

    /// The in-memory bytes, if this is a [`Body::full`] (or empty) body.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match &self.kind {
            Kind::Empty => Some(&[]),
            Kind::Full(b) => Some(b.as_deref().unwrap_or(&[])),
            _ => None,
        }
    }

    /// Whether this body is a file range.
    pub fn is_file(&self) -> bool {
        matches!(self.kind, Kind::File(_))
    }

    /// Switches a file body (not yet polled) to placeholder chunks and returns
    /// the file range the connection must `sendfile` in their place.
    pub(crate) fn take_sendfile_run(&mut self) -> Option<(Arc<File>, u64, u64)> {
        match &mut self.kind {
            Kind::File(f) if matches!(f.mode, FileMode::Read { pending: None }) => {
                f.mode = FileMode::Placeholder;
                Some((f.file.clone(), f.offset, f.remaining))
            }
            _ => None,
        }
    }
}

impl Default for Body {
    fn default() -> Self {
        Self::empty()
    }
}

impl fmt::Debug for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Empty => f.write_str("Body::Empty"),
            Kind::Full(b) => write!(f, "Body::Full({} bytes)", b.as_ref().map_or(0, Bytes::len)),
            Kind::File(fb) => write!(f, "Body::File({} bytes left)", fb.remaining),
            Kind::Stream(_) => f.write_str("Body::Stream"),
        }
    }
}

impl From<Bytes> for Body {
    fn from(b: Bytes) -> Self {
        Self::full(b)
    }
}

impl From<&'static str> for Body {
    fn from(s: &'static str) -> Self {
        Self::full(Bytes::from_static(s.as_bytes()))
    }
}

impl From<String> for Body {
    fn from(s: String) -> Self {
        Self::full(Bytes::from(s))
    }
}

impl From<Vec<u8>> for Body {
    fn from(v: Vec<u8>) -> Self {
        Self::full(Bytes::from(v))
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match &mut self.kind {
            Kind::Empty => Poll::Ready(None),
            Kind::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Kind::Stream(s) => s.as_mut().poll_frame(cx),
            Kind::File(f) => f.poll_chunk(cx).map(|r| r.map(|r| r.map(Frame::data))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Empty => true,
            Kind::Full(b) => b.is_none(),
            Kind::Stream(s) => s.is_end_stream(),
            Kind::File(f) => f.remaining == 0,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Empty => SizeHint::with_exact(0),
            Kind::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Stream(s) => s.size_hint(),
            Kind::File(f) => SizeHint::with_exact(f.remaining),
        }
    }
}

impl FileBody {
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        match &mut self.mode {
            FileMode::Placeholder => {
                let n = self.remaining.min(crate::sendfile::PLACEHOLDER_LEN as u64) as usize;
                self.remaining -= n as u64;
                self.offset += n as u64;
                Poll::Ready(Some(Ok(crate::sendfile::placeholder(n))))
            }
            FileMode::Read { pending } => {
                let handle = pending.get_or_insert_with(|| {
                    let file = self.file.clone();
                    let offset = self.offset;
                    let n = self.remaining.min(FILE_CHUNK) as usize;
                    tokio::task::spawn_blocking(move || read_exact_at(&file, offset, n))
                });
                let res = ready!(Pin::new(handle).poll(cx));
                *pending = None;
                let chunk = match res {
                    Ok(Ok(b)) => b,
                    Ok(Err(e)) => return Poll::Ready(Some(Err(BodyError::new(e)))),
                    Err(e) => return Poll::Ready(Some(Err(BodyError::new(e)))),
                };
                self.remaining -= chunk.len() as u64;
                self.offset += chunk.len() as u64;
                Poll::Ready(Some(Ok(chunk)))
            }
        }
    }
}

use std::future::Future as _;

fn read_exact_at(file: &File, offset: u64, n: usize) -> io::Result<Bytes> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; n];
    file.read_exact_at(&mut buf, offset)?;
    Ok(Bytes::from(buf))
}

/// A request body: hyper's streaming body on a socket, or bytes in memory
/// when a test (or another in-process caller) calls the router directly.
pub struct RequestBody {
    inner: ReqInner,
}

enum ReqInner {
    Incoming(hyper::body::Incoming),
    Full(Option<Bytes>),
}

impl RequestBody {
    /// An empty body.
    pub fn empty() -> Self {
        Self {
            inner: ReqInner::Full(None),
        }
    }

    pub(crate) fn incoming(b: hyper::body::Incoming) -> Self {
        Self {
            inner: ReqInner::Incoming(b),
        }
    }
}

impl fmt::Debug for RequestBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            ReqInner::Incoming(_) => f.write_str("RequestBody::Incoming"),
            ReqInner::Full(b) => write!(
                f,
                "RequestBody::Full({} bytes)",
                b.as_ref().map_or(0, Bytes::len)
            ),
        }
    }
}

impl From<Bytes> for RequestBody {
    fn from(b: Bytes) -> Self {
        Self {
            inner: ReqInner::Full((!b.is_empty()).then_some(b)),
        }
    }
}

impl From<&'static str> for RequestBody {
    fn from(s: &'static str) -> Self {
        Bytes::from_static(s.as_bytes()).into()
    }
}

impl From<Vec<u8>> for RequestBody {
    fn from(v: Vec<u8>) -> Self {
        Bytes::from(v).into()
    }
}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match &mut self.inner {
            ReqInner::Incoming(b) => Pin::new(b).poll_frame(cx).map_err(BodyError::new),
            ReqInner::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            ReqInner::Incoming(b) => b.is_end_stream(),
            ReqInner::Full(b) => b.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            ReqInner::Incoming(b) => b.size_hint(),
            ReqInner::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
        }
    }
}
