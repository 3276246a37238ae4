//! A bound on how long a write to an HTTP/1 client may make no progress.
//!
//! hyper's HTTP/1 server waits for the socket as long as it takes. A
//! client that sends requests and never reads their responses would hold
//! the response being written, and what feeds it (an app connection from
//! the pool every client shares), for good. Reads are bounded elsewhere
//! (the header-read timeout); this bounds writes, flushes and shutdown.
//!
//! Progress is also what the kernel sees. Linux wakes a writer only once a
//! third of the socket's send buffer (up to 4 MiB) is free, and a client
//! that once read fast may hold megabytes in its receive buffer: one that
//! now reads steadily but slowly (a player at its bitrate) lets no write
//! through for minutes, yet its socket sends on each window it opens. So
//! when the deadline passes, the socket's unacknowledged bytes
//! (`SIOCOUTQ`) are compared with those at the stall's start: fewer, and
//! the clock starts again.
//!
//! The fast path is the common one: a write the socket takes at once does
//! not touch the timer. The timer is armed only when a write returns
//! `Pending` after progress, and it is one `Sleep` per connection,
//! allocated at its first stall and reset at later ones.

use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Why a connection was cut: the payload of the `io::Error` a stalled
/// write ends with, found again by [`is_write_stall`].
#[derive(Debug, thiserror::Error)]
#[error("the client read nothing the proxy wrote for {0:?} (--idle-timeout): it stopped reading its responses")]
pub struct WriteStalled(Duration);

/// Whether `error`, or an error it was caused by, is a [`WriteStalled`].
pub fn is_write_stall(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        // `io::Error::source` skips its own payload, so look inside it.
        let payload = e.downcast_ref::<io::Error>().and_then(|io| io.get_ref());
        if payload.is_some_and(|p| p.is::<WriteStalled>()) || e.is::<WriteStalled>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// `inner`, whose writes fail once one has made no progress for `limit`.
pub struct WriteStall<I> {
    inner: I,
    limit: Duration,
    /// The TCP socket under `inner`, if it is one (it is owned by `inner`,
    /// so it is open while this is): its send queue shows progress the
    /// writes cannot.
    socket: Option<RawFd>,
    /// Whether the last write, flush or shutdown returned `Pending`: the
    /// deadline is running.
    stalled: bool,
    /// The socket's unacknowledged bytes when the deadline was last set.
    unacked: Option<u32>,
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<I> WriteStall<I> {
    pub fn new(inner: I, limit: Duration, socket: Option<RawFd>) -> Self {
        Self {
            inner,
            limit,
            socket,
            stalled: false,
            unacked: None,
            deadline: None,
        }
    }

    /// Passes a ready result on (progress: the deadline is off); on
    /// `Pending`, starts the deadline if it is not running, and fails once
    /// it has passed with the socket's queue no shorter. The deadline's
    /// waker is `cx`'s, so the connection's task is woken to fail even if
    /// the socket never is.
    fn bound<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = false;
            return polled;
        }
        if !self.stalled {
            self.stalled = true;
            self.unacked = self.socket.and_then(unacknowledged);
            let at = Instant::now() + self.limit;
            match &mut self.deadline {
                Some(deadline) => deadline.as_mut().reset(at),
                None => self.deadline = Some(Box::pin(tokio::time::sleep_until(at))),
            }
        }
        let Some(deadline) = self.deadline.as_mut() else {
            return Poll::Pending;
        };
        while deadline.as_mut().poll(cx).is_ready() {
            let now = self.socket.and_then(unacknowledged);
            match (self.unacked, now) {
                // The client read some: its socket sent on.
                (Some(before), Some(now)) if now < before => {
                    self.unacked = Some(now);
                    deadline.as_mut().reset(Instant::now() + self.limit);
                }
                _ => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        WriteStalled(self.limit),
                    )))
                }
            }
        }
        Poll::Pending
    }
}

/// The bytes `socket` holds that its peer has not acknowledged, sent or
/// not (`SIOCOUTQ`); `None` if it is no TCP socket.
fn unacknowledged(socket: RawFd) -> Option<u32> {
    let mut queued: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ for a socket) writes at most one int,
    // through a pointer valid for one.
    let rc = unsafe { libc::ioctl(socket, libc::TIOCOUTQ, &mut queued) };
    if rc != 0 {
        return None;
    }
    u32::try_from(queued).ok()
}

impl<I: AsyncRead + Unpin> AsyncRead for WriteStall<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for WriteStall<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.bound(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.bound(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.bound(cx, polled)
    }

    /// Bounded too: a TLS stream's shutdown writes its close_notify.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.bound(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;

    const LIMIT: Duration = Duration::from_secs(10);
    /// What the pipe holds before a write waits for its reader.
    const PIPE: usize = 64;

    fn stalling() -> (WriteStall<DuplexStream>, DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(PIPE);
        (WriteStall::new(ours, LIMIT, None), theirs)
    }

    #[tokio::test(start_paused = true)]
    async fn writes_taken_at_once_arm_no_timer() {
        let (mut io, _reader) = stalling();
        io.write_all(&[0; PIPE]).await.unwrap();
        io.flush().await.unwrap();
        assert!(
            io.deadline.is_none(),
            "a timer for writes that never waited"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_stalled_past_the_limit_fails_naming_the_stall() {
        let (mut io, _reader) = stalling();
        let started = Instant::now();
        let error = io.write_all(&[0; 4 * PIPE]).await.unwrap_err();
        assert!(
            started.elapsed() >= LIMIT,
            "failed after {:?}",
            started.elapsed()
        );
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(is_write_stall(&error));
        let text = error.to_string();
        assert!(
            text.contains("stopped reading") && text.contains("--idle-timeout"),
            "{text}"
        );
        // What hyper hands back wraps it; it is still found.
        let wrapped = io::Error::other(Wrapper(error));
        assert!(is_write_stall(&wrapped));
        assert!(!is_write_stall(&io::Error::from(io::ErrorKind::TimedOut)));
    }

    #[derive(Debug, thiserror::Error)]
    #[error("connection error")]
    struct Wrapper(#[source] io::Error);

    #[tokio::test(start_paused = true)]
    async fn progress_before_the_limit_starts_the_clock_again() {
        let (mut io, mut reader) = stalling();
        let total = 8 * PIPE;
        let writing = tokio::spawn(async move { io.write_all(&vec![7; total]).await.map(|()| io) });
        // Each stall lasts most of the limit, all of them together several
        // times it: only a stall past the limit counts.
        let mut read = 0;
        let mut buf = [0; PIPE];
        while read < total {
            tokio::time::sleep(LIMIT * 9 / 10).await;
            read += reader.read(&mut buf).await.unwrap();
        }
        let io = writing
            .await
            .unwrap()
            .expect("a write that kept making progress failed");
        assert!(io.deadline.is_some(), "the stalls never armed the deadline");
    }

    #[tokio::test(start_paused = true)]
    async fn one_timer_serves_every_stall_of_a_connection() {
        let (mut io, mut reader) = stalling();
        let mut buf = [0; PIPE];
        let mut timers = Vec::new();
        for _ in 0..3 {
            io.write_all(&[1; PIPE]).await.unwrap();
            // Full: the next write waits, arming the deadline.
            let waiting = tokio::time::timeout(LIMIT / 2, io.write_all(&[2; 1])).await;
            assert!(waiting.is_err(), "a write into a full pipe finished");
            timers.push(io.deadline.as_ref().map(|d| &**d as *const Sleep).unwrap());
            reader.read_exact(&mut buf).await.unwrap();
        }
        assert!(timers.windows(2).all(|w| w[0] == w[1]), "a timer per stall");
    }

    /// A writer that never takes a byte: what a write sees above a socket
    /// the kernel wakes only once a third of its buffer is free.
    struct NeverWritable;

    impl AsyncWrite for NeverWritable {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Pending
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Pending
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Pending
        }
    }

    /// Polls one write of `io` once.
    fn write_once<I: AsyncWrite + Unpin>(io: &mut WriteStall<I>) -> Poll<io::Result<usize>> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        Pin::new(io).poll_write(&mut cx, b"more")
    }

    /// Waits (in real time: the kernel moves the bytes) until `socket` holds
    /// fewer unacknowledged bytes than `than`.
    fn until_unacked_below(socket: RawFd, than: u32) {
        let bound = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while unacknowledged(socket).unwrap() >= than {
            assert!(
                std::time::Instant::now() < bound,
                "the socket never sent on"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_whose_socket_sends_on_is_not_cut_though_no_write_goes_through() {
        use std::io::{Read, Write};
        use std::os::fd::AsRawFd;

        // A real connection, its server end filled until the kernel takes
        // no more: the client reads nothing yet.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        server.set_nonblocking(true).unwrap();
        let chunk = vec![0; 64 * 1024];
        loop {
            match server.write(&chunk) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling the socket: {e}"),
            }
        }
        let socket = server.as_raw_fd();
        let mut io = WriteStall::new(NeverWritable, LIMIT, Some(socket));
        assert!(write_once(&mut io).is_pending());
        let at_stall = io.unacked.expect("a TCP socket's send queue");

        // The client reads what its receive buffer holds: the window opens
        // and the server's socket sends on, though no write would wake.
        client.set_nonblocking(true).unwrap();
        let mut buf = vec![0; 64 * 1024];
        while client.read(&mut buf).is_ok() {}
        until_unacked_below(socket, at_stall);
        tokio::time::advance(LIMIT).await;
        assert!(
            write_once(&mut io).is_pending(),
            "cut though its socket sent {} bytes on",
            at_stall - unacknowledged(socket).unwrap()
        );

        // It reads no more: once the window it opened is full, nothing
        // moves, and the next deadline cuts it.
        let mut deadlines = 0;
        let error = loop {
            tokio::time::advance(LIMIT).await;
            deadlines += 1;
            match write_once(&mut io) {
                Poll::Ready(result) => break result.unwrap_err(),
                Poll::Pending => {
                    assert!(deadlines < 1000, "a client that reads nothing is never cut");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
        };
        assert!(is_write_stall(&error), "{error}");
    }
}
