//! Fewer, larger socket writes on multiplexed connections.
//!
//! An HTTP/2 connection carries hundreds of concurrent calls. Their
//! answers become ready in bursts (every call whose event went into one
//! group commit is answered at once), but each answer wakes the
//! connection's task, which writes what it has and flushes: measured with
//! `perf stat -e 'syscalls:sys_enter_writev'` around `railyard bench saga
//! --protocol omega --transactions 10000`, about 1.5 `writev` per event
//! (requests and answers), each a loopback TCP send that also runs the
//! receiver's network stack inline.
//!
//! [`Coalesced`] lets the other ready tasks run first: the first write of a
//! flush cycle yields once (`tokio::task::yield_now` semantics: the task
//! runs again after the tasks already queued, or at the worker's next
//! maintenance), so the answers those tasks
//! produce go out in the same write. The cost is one extra poll of the
//! connection's task per cycle; the latency, one turn of the scheduler.
//! Writes after the first of a cycle, and reads, pass straight through.
//!
//! Hand-written because it is a policy on top of tokio's I/O traits, not a
//! codec: no crate does "yield before the first write".

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// An I/O object whose first write after each flush yields once to the
/// runtime's other ready tasks (see the module docs).
#[derive(Debug)]
pub struct Coalesced<T> {
    io: T,
    /// The next write yields first: set by each flush, cleared by the yield.
    yield_first: bool,
}

impl<T> Coalesced<T> {
    /// Wraps `io`.
    pub fn new(io: T) -> Self {
        Self {
            io,
            yield_first: true,
        }
    }

    /// The wrapped I/O object.
    pub fn get_ref(&self) -> &T {
        &self.io
    }

    /// `Pending` once per flush cycle, after asking to be polled again once
    /// the other ready tasks have run.
    fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.yield_first {
            return Poll::Ready(());
        }
        self.yield_first = false;
        // `yield_now` defers the wake-up until the worker has run the tasks
        // already queued or does its periodic maintenance (outside a runtime
        // it wakes at once); dropping it after its first poll keeps that
        // wake-up.
        std::pin::pin!(tokio::task::yield_now()).poll(cx)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Coalesced<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Coalesced<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.poll_turn(cx).is_pending() {
            return Poll::Pending;
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.poll_turn(cx).is_pending() {
            return Poll::Pending;
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let flushed = Pin::new(&mut self.io).poll_flush(cx);
        if flushed.is_ready() {
            self.yield_first = true;
        }
        flushed
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Coalesced<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Counts the writes that reach it.
    struct CountingSink {
        writes: Arc<AtomicUsize>,
        bytes: Vec<u8>,
    }

    impl AsyncWrite for CountingSink {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.writes.fetch_add(1, Ordering::SeqCst);
            self.bytes.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn the_first_write_of_each_flush_cycle_yields_once_and_nothing_is_lost() {
        let writes = Arc::new(AtomicUsize::new(0));
        let mut io = Coalesced::new(CountingSink {
            writes: writes.clone(),
            bytes: Vec::new(),
        });
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        // The first write of a cycle yields; the retry goes through.
        assert!(Pin::new(&mut io).poll_write(&mut cx, b"ab").is_pending());
        assert_eq!(writes.load(Ordering::SeqCst), 0);
        assert!(matches!(
            Pin::new(&mut io).poll_write(&mut cx, b"ab"),
            Poll::Ready(Ok(2))
        ));
        // Later writes of the same cycle pass straight through.
        assert!(matches!(
            Pin::new(&mut io).poll_write(&mut cx, b"cd"),
            Poll::Ready(Ok(2))
        ));
        assert!(Pin::new(&mut io).poll_flush(&mut cx).is_ready());
        // A flush starts a new cycle.
        assert!(Pin::new(&mut io).poll_write(&mut cx, b"ef").is_pending());
        io.write_all(b"ef").await.unwrap();
        io.flush().await.unwrap();
        assert_eq!(io.get_ref().bytes, b"abcdef");
        assert_eq!(writes.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_wrapped_socket_carries_everything_both_ways() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let echo = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let mut s = Coalesced::new(s);
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                s.write_all(&buf[..n]).await.unwrap();
                s.flush().await.unwrap();
            }
        });
        let c = Coalesced::new(tokio::net::TcpStream::connect(addr).await.unwrap());
        let (mut r, mut w) = tokio::io::split(c);
        let sent: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let expected = sent.clone();
        let writer = tokio::spawn(async move {
            for chunk in sent.chunks(1000) {
                w.write_all(chunk).await.unwrap();
                w.flush().await.unwrap();
            }
            w.shutdown().await.unwrap();
        });
        let mut got = Vec::new();
        r.read_to_end(&mut got).await.unwrap();
        writer.await.unwrap();
        assert_eq!(got, expected);
        echo.await.unwrap();
    }
}
