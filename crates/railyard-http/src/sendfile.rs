//! The zero-copy file path.
//!
//! hyper has no `sendfile(2)`. A file body on a plain TCP connection yields
//! placeholder chunks: slices of one static buffer, recognised by address.
//! hyper queues them behind the response head as it would any body chunk (it
//! is told to use vectored writes, so it never copies body chunks into its own
//! buffer); when the connection's writer meets a placeholder slice it calls
//! `sendfile` for that many bytes of the next queued file run instead. Heads,
//! keep-alive and pipelining stay hyper's business.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fs::File;
use std::sync::Arc;

use bytes::Bytes;

/// Length of the placeholder buffer, hence of the largest placeholder chunk.
pub(crate) const PLACEHOLDER_LEN: usize = 64 * 1024;

/// The placeholder buffer. Its content is never sent; only its address range
/// matters, and a `static` has one of its own.
static PLACEHOLDER: [u8; PLACEHOLDER_LEN] = [0; PLACEHOLDER_LEN];

/// `n` (1..=PLACEHOLDER_LEN) placeholder bytes.
pub(crate) fn placeholder(n: usize) -> Bytes {
    Bytes::from_static(&PLACEHOLDER[..n])
}

/// Whether `s` points into the placeholder buffer.
pub(crate) fn is_placeholder(s: &[u8]) -> bool {
    let start = PLACEHOLDER.as_ptr() as usize;
    let p = s.as_ptr() as usize;
    !s.is_empty() && p >= start && p < start + PLACEHOLDER_LEN
}

/// A file range to send, in response order.
pub(crate) struct Run {
    pub(crate) file: Arc<File>,
    pub(crate) offset: u64,
    pub(crate) remaining: u64,
}

/// The file runs of one connection, front first. Responses are written in
/// order, so the n-th placeholder byte written is the n-th byte of the runs.
///
/// A run is queued when hyper first polls its body (never for a body hyper
/// will not write: `HEAD`, 1xx, 204, 304) and removed once its last byte is
/// sent, so it holds only runs whose placeholders hyper has taken or is about
/// to take. hyper polls the next body only once the previous one is all in
/// its write buffer, and stops taking chunks while that buffer is full
/// (16 chunks or about 400 KiB), so the queue never holds more runs than
/// that buffer holds chunks, plus the one being taken: it cannot fill up.
pub(crate) type Runs = RefCell<VecDeque<Run>>;
