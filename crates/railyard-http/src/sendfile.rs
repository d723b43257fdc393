//! The zero-copy file path.
//!
//! hyper has no `sendfile(2)`. A file body on a plain TCP connection yields
//! placeholder chunks: slices of one static buffer, recognised by address.
//! hyper queues them behind the response head as it would any body chunk (it
//! is told to use vectored writes, so it never copies body chunks into its own
//! buffer); when the connection's writer meets a placeholder slice it calls
//! `sendfile` for that many bytes of the next queued file run instead. Heads,
//! keep-alive and pipelining stay hyper's business.
//!
//! `sendfile` reads the file through the page cache on the core's thread, so
//! a page that is not cached would be read from the disk right there, with
//! every connection of the core waiting. Before the first `sendfile` of each
//! window of a run ([`WARM_SPAN`]), [`Warmth`] asks `cachestat(2)` whether
//! the window's pages are all cached (one system call that never waits on
//! the disk); if not, the window is read on the blocking pool first, and the
//! connection's write waits for that. See docs/http.md, "Cold pages".

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

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
    /// The file's pages are known to be cached up to here (exclusive).
    pub(crate) cached_to: u64,
    /// A blocking-pool read of the next window, under way; it returns where
    /// the window ends.
    pub(crate) warming: Option<JoinHandle<std::io::Result<u64>>>,
    /// Waiting for one of the core's slots for such a read.
    pub(crate) slot: Option<tokio_util::sync::PollSemaphore>,
}

impl Run {
    pub(crate) fn new(file: Arc<File>, offset: u64, remaining: u64) -> Self {
        Self {
            file,
            offset,
            remaining,
            cached_to: offset,
            warming: None,
            slot: None,
        }
    }
}

/// How much of a run one residency check (and, if it finds the pages cold,
/// one blocking-pool read) covers.
pub(crate) const WARM_SPAN: u64 = 1 << 20;

// A window always covers the most one `sendfile` call sends, so checking
// (or warming) one window is always enough for the call to proceed.
const _: () = assert!(PLACEHOLDER_LEN as u64 <= WARM_SPAN);

/// How long a core trusts that a file range it found cached (or warmed)
/// stays cached. A page evicted within it is read by `sendfile` on the core
/// as before; the trust is what keeps a small hot file (the C10K bench's
/// 4 KiB) from paying a system call per response, and a file whose pages
/// `cachestat` cannot see (stacking filesystems such as overlayfs keep them
/// on the underlying inode) from a blocking-pool trip per response.
const TRUST: Duration = Duration::from_secs(1);

/// Most file ranges a core remembers as cached.
const REMEMBERED: usize = 64;

/// `cachestat(2)` failed with `ENOSYS` (a kernel before 6.5, or a seccomp
/// filter that answers so): nobody asks again, and `sendfile` reads as it
/// did.
static NO_CACHESTAT: AtomicBool = AtomicBool::new(false);

/// `cachestat(2)`'s number: the same on every architecture (a syscall
/// added after the tables were unified); the `libc` crate does not name it.
#[cfg(target_os = "linux")]
const SYS_CACHESTAT: libc::c_long = 451;

/// Whether this kernel has `cachestat(2)` (Linux 6.5+, and no seccomp
/// filter refusing it), so that cold file windows are read on the blocking
/// pool before `sendfile` (without it they are sent as they are). Asked
/// with no file: an existing call answers `EBADF` for the invalid
/// descriptor, a missing one `ENOSYS`.
pub fn cachestat_available() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: an invalid descriptor and null pointers: the kernel
        // checks the descriptor first and touches no memory.
        let r = unsafe {
            libc::syscall(
                SYS_CACHESTAT,
                -1i32,
                std::ptr::null::<u8>(),
                std::ptr::null_mut::<u8>(),
                0u32,
            )
        };
        !(r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS))
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// What `cachestat` says about a file range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Residency {
    /// Every page is cached.
    Cached,
    /// Some page is not, or the kernel will not say for this file (newer
    /// kernels answer `EPERM` for a file the process could not write): the
    /// window is read on the blocking pool either way.
    Cold,
    /// Cannot tell (no `cachestat`, or it failed): send as before.
    Unknown,
}

/// `cachestat(2)` on `len` bytes of `file` from `offset`.
pub(crate) fn residency(file: &File, offset: u64, len: u64) -> Residency {
    if len == 0 || NO_CACHESTAT.load(Ordering::Relaxed) {
        return Residency::Unknown;
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        /// `struct cachestat_range` (include/uapi/linux/mman.h).
        #[repr(C)]
        struct Range {
            off: u64,
            len: u64,
        }
        /// `struct cachestat`.
        #[repr(C)]
        #[derive(Default)]
        struct Stat {
            nr_cache: u64,
            nr_dirty: u64,
            nr_writeback: u64,
            nr_evicted: u64,
            nr_recently_evicted: u64,
        }
        let range = Range { off: offset, len };
        let mut stat = Stat::default();
        // SAFETY: the file descriptor is open for the call's duration (we
        // hold the `File`), and both pointers are to live, properly laid
        // out structs the kernel reads and writes within their size.
        let r = unsafe {
            libc::syscall(
                SYS_CACHESTAT,
                file.as_raw_fd(),
                &range as *const Range,
                &mut stat as *mut Stat,
                0u32,
            )
        };
        if r != 0 {
            return match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::ENOSYS) => {
                    NO_CACHESTAT.store(true, Ordering::Relaxed);
                    Residency::Unknown
                }
                // This file only (one the process could not write, on
                // kernels that keep page-cache state of such files to
                // themselves): read it off the core, then trust it for
                // `TRUST` like a cached one.
                Some(libc::EPERM) => Residency::Cold,
                _ => Residency::Unknown,
            };
        }
        static PAGE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        // SAFETY: sysconf has no preconditions.
        let page = *PAGE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            n if n > 0 => n as u64,
            _ => 4096,
        });
        let pages = (offset + len).div_ceil(page) - offset / page;
        if stat.nr_cache >= pages {
            Residency::Cached
        } else {
            Residency::Cold
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, offset);
        Residency::Unknown
    }
}

/// Most cold windows one core reads on the blocking pool at once. Each is
/// up to 1 MiB read by a blocking thread that cannot be cancelled, and a
/// core's runtime would start up to 512 such threads: a burst of
/// connections to a large cold file must not. Further cold windows wait
/// for a slot (their connections' writes wait, the core does not).
pub(crate) const MAX_WARMS: usize = 4;

/// Reads `len` bytes of `file` from `offset` (or to its end) so that they
/// are cached; runs on the blocking pool, holding `slot` (one of the core's
/// [`MAX_WARMS`]) until it is done, whether or not its connection is still
/// there. Returns where the range ends.
pub(crate) fn warm(
    file: Arc<File>,
    offset: u64,
    len: u64,
    slot: OwnedSemaphorePermit,
) -> JoinHandle<std::io::Result<u64>> {
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; 64 * 1024];
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let want = usize::try_from(end - at)
                .unwrap_or(usize::MAX)
                .min(buf.len());
            match file.read_at(&mut buf[..want], at) {
                Ok(0) => break,
                Ok(n) => at += n as u64,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(end)
    })
}

/// The file ranges one core found cached (or warmed) lately, so that it asks
/// `cachestat` about each at most once per [`TRUST`].
pub(crate) struct Warmth {
    known: RefCell<Vec<Known>>,
    /// This core's blocking-pool reads of cold windows, [`MAX_WARMS`] at a
    /// time.
    pub(crate) slots: Arc<Semaphore>,
}

impl Default for Warmth {
    fn default() -> Self {
        Self {
            known: RefCell::default(),
            slots: Arc::new(Semaphore::new(MAX_WARMS)),
        }
    }
}

/// A file range found cached.
struct Known {
    /// Held weakly: its allocation, so its address, cannot be reused by
    /// another file while the entry exists.
    file: Weak<File>,
    from: u64,
    to: u64,
    at: Instant,
}

impl Known {
    fn is(&self, file: &Arc<File>) -> bool {
        std::ptr::eq(self.file.as_ptr(), Arc::as_ptr(file))
    }
}

impl Warmth {
    /// Whether `file`'s `offset..end` was found cached within [`TRUST`].
    pub(crate) fn trusted(&self, file: &Arc<File>, offset: u64, end: u64, now: Instant) -> bool {
        self.known.borrow().iter().any(|k| {
            k.is(file) && k.from <= offset && end <= k.to && now.duration_since(k.at) < TRUST
        })
    }

    /// Remembers that `file`'s `offset..end` was cached at `now` (in place
    /// of what it knew of that file).
    pub(crate) fn remember(&self, file: &Arc<File>, offset: u64, end: u64, now: Instant) {
        let mut known = self.known.borrow_mut();
        known.retain(|k| {
            k.file.strong_count() > 0 && now.duration_since(k.at) < TRUST && !k.is(file)
        });
        if known.len() >= REMEMBERED {
            known.remove(0);
        }
        known.push(Known {
            file: Arc::downgrade(file),
            from: offset,
            to: end,
            at: now,
        });
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn cold_reads_wait_for_a_free_slot_and_are_woken_when_one_frees() {
        let w = Warmth::default();
        let taken: Vec<OwnedSemaphorePermit> = (0..MAX_WARMS)
            .map(|_| w.slots.clone().try_acquire_owned().expect("a slot"))
            .collect();
        // Full: the next one waits, and is woken by the first slot freed.
        let mut waiting = tokio_util::sync::PollSemaphore::new(w.slots.clone());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(waiting.poll_acquire(&mut cx).is_pending());
        drop(taken);
        assert!(matches!(
            waiting.poll_acquire(&mut cx),
            std::task::Poll::Ready(Some(_))
        ));
    }

    #[test]
    fn a_range_found_cached_is_trusted_for_a_while_and_only_for_that_file() {
        let path = std::env::temp_dir().join(format!("railyard-warmth-{}", std::process::id()));
        std::fs::write(&path, b"x").unwrap();
        let a = Arc::new(File::open(&path).unwrap());
        let b = Arc::new(File::open(&path).unwrap());
        let w = Warmth::default();
        let now = Instant::now();
        w.remember(&a, 0, 100, now);
        assert!(w.trusted(&a, 10, 90, now));
        assert!(!w.trusted(&a, 10, 101, now), "beyond the range");
        assert!(!w.trusted(&b, 10, 90, now), "another file");
        assert!(!w.trusted(&a, 10, 90, now + TRUST), "too old");
        // A file's newer range replaces its older one; the list stays bounded.
        w.remember(&a, 100, 200, now);
        assert!(!w.trusted(&a, 0, 50, now));
        let files: Vec<Arc<File>> = (0..2 * REMEMBERED)
            .map(|_| Arc::new(File::open(&path).unwrap()))
            .collect();
        for f in &files {
            w.remember(f, 0, 1, now);
        }
        assert_eq!(w.known.borrow().len(), REMEMBERED);
        let _ = std::fs::remove_file(&path);
    }
}
