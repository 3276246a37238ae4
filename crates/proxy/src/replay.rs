//! A request body streamed as it comes, kept while it is sent (up to
//! [`crate::retry::MAX_BODY`]) so the request can go out again when a peer
//! refused it unprocessed: a draining peer's GOAWAY or REFUSED_STREAM races
//! requests whose bodies are streamed (gRPC's among them: no length is
//! known ahead), and without a copy the proxy could only fail them, where
//! an app talking to the peer directly would have its gRPC client send
//! them again. linkerd2-proxy keeps 64 KiB the same way.
//!
//! The kept chunks are the body's own `Bytes` (shared, not copied). Once
//! the request can no longer go out again (its route step returned, so the
//! [`Replay`] handle is gone), the body stops keeping and lets go of what
//! it kept: a long stream holds at most the cap, and only until its
//! response head arrives.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use hyper::body::{Body as _, Frame, SizeHint};

use crate::http::{Body, BodyError};

struct Shared {
    inner: Body,
    /// The data frames read from `inner` so far, while they fit in `cap`.
    kept: Vec<Bytes>,
    kept_bytes: usize,
    cap: usize,
    /// More than `cap` was read (what was kept is dropped), or `inner`
    /// failed: the body cannot be sent again.
    spent: bool,
    /// `inner` has ended; its trailers, if it had any.
    ended: bool,
    trailers: Option<HeaderMap>,
    /// Which copy of the body may read on: a new one supersedes the ones
    /// before it (a refused attempt's stream may still hold its copy).
    current: u32,
}

/// One copy of the body, as one attempt sends it.
pub struct ReplayBody {
    shared: Arc<Mutex<Shared>>,
    copy: u32,
    /// The next kept frame this copy sends.
    next: usize,
    trailers_sent: bool,
    size_hint: SizeHint,
}

/// What the request's route step keeps to send the body again.
pub struct Replay {
    shared: Arc<Mutex<Shared>>,
    size_hint: SizeHint,
}

/// The first copy of `inner`, and the handle that makes the next ones.
pub fn replayable(inner: Body, cap: usize) -> (Body, Replay) {
    let size_hint = inner.size_hint();
    let shared = Arc::new(Mutex::new(Shared {
        inner,
        kept: Vec::new(),
        kept_bytes: 0,
        cap,
        spent: false,
        ended: false,
        trailers: None,
        current: 0,
    }));
    let body = ReplayBody {
        shared: shared.clone(),
        copy: 0,
        next: 0,
        trailers_sent: false,
        size_hint,
    };
    (
        http_body_util::BodyExt::boxed(body),
        Replay { shared, size_hint },
    )
}

impl Replay {
    /// A new copy of the body from its start, or `None` when it can no
    /// longer be had (more than the cap was read, or reading it failed).
    /// Every earlier copy stops: it fails if polled again.
    pub fn again(&self) -> Option<Body> {
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        if shared.spent {
            return None;
        }
        shared.current += 1;
        let body = ReplayBody {
            shared: self.shared.clone(),
            copy: shared.current,
            next: 0,
            trailers_sent: false,
            size_hint: self.size_hint,
        };
        Some(http_body_util::BodyExt::boxed(body))
    }
}

impl hyper::body::Body for ReplayBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        // Only the handle can make another copy: without it, keeping is
        // wasted.
        let may_go_again = Arc::strong_count(&this.shared) > 1;
        let mut shared = this.shared.lock().unwrap_or_else(|e| e.into_inner());
        if shared.current != this.copy {
            return Poll::Ready(Some(Err("the request is being sent again".into())));
        }
        if let Some(data) = shared.kept.get(this.next) {
            this.next += 1;
            return Poll::Ready(Some(Ok(Frame::data(data.clone()))));
        }
        if shared.ended {
            if !this.trailers_sent {
                this.trailers_sent = true;
                if let Some(trailers) = shared.trailers.clone() {
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
            }
            return Poll::Ready(None);
        }
        if !may_go_again && !shared.spent {
            shared.spent = true;
            shared.kept = Vec::new();
        }
        let polled = Pin::new(&mut shared.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    shared.keep(data);
                    this.next = shared.kept.len();
                } else if let Some(trailers) = frame.trailers_ref() {
                    if !shared.spent {
                        shared.trailers = Some(trailers.clone());
                    }
                    this.trailers_sent = true;
                }
            }
            Poll::Ready(Some(Err(_))) => {
                shared.spent = true;
                shared.kept = Vec::new();
            }
            Poll::Ready(None) => {
                shared.ended = true;
                // Trailers an earlier copy read from `inner` before it was
                // superseded still go out, after this copy's data.
                if !this.trailers_sent {
                    this.trailers_sent = true;
                    if let Some(trailers) = shared.trailers.clone() {
                        return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                    }
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        shared.current == self.copy
            && self.next >= shared.kept.len()
            && shared.ended
            && (self.trailers_sent || shared.trailers.is_none())
    }

    fn size_hint(&self) -> SizeHint {
        self.size_hint
    }
}

impl Shared {
    fn keep(&mut self, data: &Bytes) {
        if self.spent {
            return;
        }
        if self.kept_bytes + data.len() > self.cap {
            self.spent = true;
            self.kept = Vec::new();
            return;
        }
        self.kept_bytes += data.len();
        self.kept.push(data.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn streamed(chunks: &[&'static str], trailers: bool) -> Body {
        let mut frames: Vec<Result<Frame<Bytes>, BodyError>> = chunks
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c.as_bytes()))))
            .collect();
        if trailers {
            let mut t = HeaderMap::new();
            t.insert("grpc-status", "0".parse().unwrap());
            frames.push(Ok(Frame::trailers(t)));
        }
        http_body_util::StreamBody::new(futures::stream::iter(frames)).boxed()
    }

    async fn read_all(body: Body) -> (Vec<u8>, Option<HeaderMap>) {
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        (collected.to_bytes().to_vec(), trailers)
    }

    #[tokio::test]
    async fn a_copy_sends_what_the_first_sent_then_the_rest() {
        let (mut first, replay) = replayable(streamed(&["ab", "cd", "ef"], true), 1024);
        // The first attempt got one frame out before it was refused.
        let frame = first.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "ab");
        let second = replay.again().expect("2 bytes fit");
        assert!(
            first.frame().await.unwrap().is_err(),
            "the first copy stops"
        );
        let (data, trailers) = read_all(second).await;
        assert_eq!(data, b"abcdef");
        assert_eq!(trailers.unwrap()["grpc-status"], "0");
        // A body read to its end (trailers too) can go out once more.
        let (data, trailers) = read_all(replay.again().unwrap()).await;
        assert_eq!(data, b"abcdef");
        assert!(trailers.is_some());
    }

    #[tokio::test]
    async fn trailers_read_by_a_superseded_copy_still_go_out() {
        let (mut first, replay) = replayable(streamed(&["ab"], true), 1024);
        assert!(first.frame().await.unwrap().unwrap().is_data());
        assert!(first.frame().await.unwrap().unwrap().is_trailers());
        let (data, trailers) = read_all(replay.again().unwrap()).await;
        assert_eq!(data, b"ab");
        assert_eq!(trailers.unwrap()["grpc-status"], "0");
    }

    #[tokio::test]
    async fn a_body_larger_than_the_cap_cannot_go_again() {
        let (first, replay) = replayable(streamed(&["0123", "4567", "89"], false), 8);
        let (data, _) = read_all(first).await;
        assert_eq!(data, b"0123456789", "sent whole the first time");
        assert!(replay.again().is_none());
    }

    #[tokio::test]
    async fn without_the_handle_nothing_is_kept() {
        let (mut first, replay) = replayable(streamed(&["ab", "cd"], false), 1024);
        assert!(first.frame().await.is_some());
        drop(replay);
        assert_eq!(read_all(first).await.0, b"cd");
    }

    #[tokio::test]
    async fn a_failed_body_cannot_go_again() {
        let frames: Vec<Result<Frame<Bytes>, BodyError>> = vec![
            Ok(Frame::data(Bytes::from_static(b"ab"))),
            Err("client went away".into()),
        ];
        let body = http_body_util::StreamBody::new(futures::stream::iter(frames)).boxed();
        let (mut first, replay) = replayable(body, 1024);
        assert!(first.frame().await.unwrap().is_ok());
        assert!(first.frame().await.unwrap().is_err());
        assert!(replay.again().is_none());
    }

    #[tokio::test]
    async fn an_ended_copy_says_so() {
        let (first, replay) = replayable(streamed(&["ab"], false), 1024);
        assert!(!first.is_end_stream());
        let _ = read_all(first).await;
        let second = replay.again().unwrap();
        assert!(!second.is_end_stream(), "its kept frame is still to send");
        let (data, _) = read_all(second).await;
        assert_eq!(data, b"ab");
    }
}
