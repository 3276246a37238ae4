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
//! response head arrives; all bodies of the process together hold at most
//! a budget (32 MiB).

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// What keeping costs: the frames' bytes and one [`FRAME_COST`] each,
    /// so a body cut into tiny frames cannot keep more than the cap says.
    kept_cost: usize,
    cap: usize,
    /// What all bodies of the process keep together.
    budget: &'static KeptBudget,
    /// More than `cap` was read (what was kept is dropped), `inner`
    /// failed, or the [`Replay`] handle is gone: the body cannot be sent
    /// again.
    spent: bool,
    /// `inner` has ended; its trailers, if it had any.
    ended: bool,
    trailers: Option<HeaderMap>,
    /// Which copy of the body may read on: a new one supersedes the ones
    /// before it (a refused attempt's stream may still hold its copy).
    current: u32,
    /// The next kept frame the current copy sends (only the current copy
    /// reads, so its progress lives here, where dropping the handle can
    /// see whether the kept frames are all sent).
    next: usize,
    /// The current copy has sent the trailers (or the end).
    trailers_sent: bool,
}

/// What one kept frame costs besides its bytes: its `Bytes` handle in
/// `kept`.
const FRAME_COST: usize = std::mem::size_of::<Bytes>();

/// What the bodies of one process keep at once, all together: without it,
/// every in-flight streamed request whose response head is late (a
/// client-streaming gRPC call is answered only when its stream ends) holds
/// up to the cap, and nothing but the connection cap (derived from the fd
/// limit) times 100 streams bounds how many there are. A body that finds
/// the budget spent is not kept: it is sent once, as before replays
/// existed.
pub struct KeptBudget {
    kept: AtomicUsize,
    max: usize,
}

impl KeptBudget {
    pub const fn new(max: usize) -> Self {
        Self {
            kept: AtomicUsize::new(0),
            max,
        }
    }

    fn take(&self, cost: usize) -> bool {
        self.kept
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |kept| {
                kept.checked_add(cost).filter(|&total| total <= self.max)
            })
            .is_ok()
    }

    fn give_back(&self, cost: usize) {
        self.kept.fetch_sub(cost, Ordering::AcqRel);
    }
}

/// 512 bodies kept whole at once: far more than a peer's drain races, and
/// a bound an operator can count on (32 MiB per proxy).
static KEPT: KeptBudget = KeptBudget::new(512 * crate::retry::MAX_BODY as usize);

/// One copy of the body, as one attempt sends it.
pub struct ReplayBody {
    shared: Arc<Mutex<Shared>>,
    copy: u32,
    size_hint: SizeHint,
}

/// What the request's route step keeps to send the body again. Dropping
/// it (the response head arrived, or the request failed) lets go of what
/// was kept at once, not at the body's next frame: a long-lived stream
/// whose client went quiet would hold it for its whole life.
pub struct Replay {
    shared: Arc<Mutex<Shared>>,
    size_hint: SizeHint,
}

/// The first copy of `inner`, and the handle that makes the next ones.
pub fn replayable(inner: Body, cap: usize) -> (Body, Replay) {
    replayable_within(inner, cap, &KEPT)
}

fn replayable_within(inner: Body, cap: usize, budget: &'static KeptBudget) -> (Body, Replay) {
    let size_hint = inner.size_hint();
    let shared = Arc::new(Mutex::new(Shared {
        inner,
        kept: Vec::new(),
        kept_cost: 0,
        cap,
        budget,
        spent: false,
        ended: false,
        trailers: None,
        current: 0,
        next: 0,
        trailers_sent: false,
    }));
    let body = ReplayBody {
        shared: shared.clone(),
        copy: 0,
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
        let mut shared = lock(&self.shared);
        if shared.spent {
            return None;
        }
        shared.current += 1;
        shared.next = 0;
        shared.trailers_sent = false;
        let body = ReplayBody {
            shared: self.shared.clone(),
            copy: shared.current,
            size_hint: self.size_hint,
        };
        Some(http_body_util::BodyExt::boxed(body))
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        let mut shared = lock(&self.shared);
        shared.spent = true;
        // A copy still sending kept frames lets go of them once past
        // them (in `poll_frame`).
        if shared.next >= shared.kept.len() {
            shared.let_go();
        }
    }
}

/// A panic while the lock was held left `Shared` consistent (no method
/// leaves it half updated across a call that can panic), so a poisoned
/// lock is taken as it is.
fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.let_go();
    }
}

impl hyper::body::Body for ReplayBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut shared = lock(&self.shared);
        let shared = &mut *shared;
        if shared.current != self.copy {
            return Poll::Ready(Some(Err("the request is being sent again".into())));
        }
        if let Some(data) = shared.kept.get(shared.next) {
            let data = data.clone();
            shared.next += 1;
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if shared.spent {
            shared.let_go();
        }
        if shared.ended {
            return Poll::Ready(shared.end());
        }
        let polled = Pin::new(&mut shared.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    shared.keep(data);
                    shared.next = shared.kept.len();
                } else if let Some(trailers) = frame.trailers_ref() {
                    if !shared.spent {
                        shared.trailers = Some(trailers.clone());
                    }
                    shared.trailers_sent = true;
                }
            }
            Poll::Ready(Some(Err(_))) => {
                shared.spent = true;
                shared.let_go();
            }
            Poll::Ready(None) => {
                shared.ended = true;
                return Poll::Ready(shared.end());
            }
            Poll::Pending => {}
        }
        polled
    }

    /// Past the kept frames, the end is `inner`'s: hyper sets END_STREAM
    /// on the last DATA frame only when the body says it ended there, so
    /// waiting for `inner` to return `None` would cost every streamed
    /// request (each gRPC call) an empty DATA frame more.
    fn is_end_stream(&self) -> bool {
        let shared = lock(&self.shared);
        shared.current == self.copy
            && shared.next >= shared.kept.len()
            && (shared.trailers_sent || shared.trailers.is_none())
            && (shared.ended || shared.inner.is_end_stream())
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
        let cost = data.len() + FRAME_COST;
        if self.kept_cost + cost > self.cap || !self.budget.take(cost) {
            self.spent = true;
            self.let_go();
            return;
        }
        self.kept_cost += cost;
        self.kept.push(data.clone());
    }

    fn let_go(&mut self) {
        self.budget.give_back(self.kept_cost);
        self.kept_cost = 0;
        self.kept = Vec::new();
        self.next = 0;
    }

    /// The current copy's last frame: trailers an earlier copy read from
    /// `inner` before it was superseded still go out, after this copy's
    /// data.
    fn end(&mut self) -> Option<Result<Frame<Bytes>, BodyError>> {
        if self.trailers_sent {
            return None;
        }
        self.trailers_sent = true;
        self.trailers.clone().map(|t| Ok(Frame::trailers(t)))
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

    /// Once the request cannot go out again (its response head arrived),
    /// what was kept goes at once: a stream whose client went quiet would
    /// otherwise hold it as long as it lives.
    #[tokio::test]
    async fn dropping_the_handle_lets_go_of_what_was_kept() {
        let (mut first, replay) = replayable(streamed(&["ab", "cd"], false), 1024);
        assert!(first.frame().await.unwrap().is_ok());
        let shared = replay.shared.clone();
        assert_eq!(shared.lock().unwrap().kept.len(), 1);
        drop(replay);
        assert!(shared.lock().unwrap().kept.is_empty());
        assert_eq!(read_all(first).await.0, b"cd");
    }

    /// A copy still sending kept frames when the handle goes sends them
    /// all.
    #[tokio::test]
    async fn a_copy_sending_kept_frames_when_the_handle_goes_sends_them_all() {
        let (mut first, replay) = replayable(streamed(&["ab", "cd", "ef"], false), 1024);
        assert!(first.frame().await.unwrap().is_ok());
        assert!(first.frame().await.unwrap().is_ok());
        let mut second = replay.again().unwrap();
        assert_eq!(
            second.frame().await.unwrap().unwrap().into_data().unwrap(),
            "ab"
        );
        drop(replay);
        assert_eq!(read_all(second).await.0, b"cdef");
    }

    /// hyper puts END_STREAM on the last DATA frame only when the body says
    /// it ended there: a copy must say so as soon as its inner body does,
    /// or each streamed request (every gRPC call) costs an empty DATA
    /// frame more.
    #[tokio::test]
    async fn a_copy_ends_with_its_last_frame() {
        let inner = http_body_util::Full::new(Bytes::from_static(b"ab"))
            .map_err(|never| match never {})
            .boxed();
        let (mut first, replay) = replayable(inner, 1024);
        assert!(!first.is_end_stream());
        assert!(first.frame().await.unwrap().is_ok());
        assert!(first.is_end_stream(), "the first copy ends with its frame");
        let mut second = replay.again().unwrap();
        assert!(!second.is_end_stream());
        assert!(second.frame().await.unwrap().is_ok());
        assert!(second.is_end_stream(), "so does a copy");
    }

    /// Each kept frame costs its handle as well as its bytes: a body cut
    /// into 1-byte frames cannot make the proxy hold 32 times the cap.
    #[tokio::test]
    async fn tiny_frames_count_what_keeping_them_costs() {
        let chunks = vec!["x"; 4096];
        let (first, replay) = replayable(streamed(&chunks, false), 64 * 1024);
        assert_eq!(read_all(first).await.0.len(), 4096);
        assert!(
            replay.again().is_none(),
            "4096 frames cost more than 64 KiB"
        );
    }

    /// What bodies keep together is bounded: one that finds the budget
    /// spent is sent once, and what a body kept is given back when it is
    /// let go.
    #[tokio::test]
    async fn the_process_keeps_no_more_than_its_budget() {
        static BUDGET: KeptBudget = KeptBudget::new(2 * (2 + FRAME_COST) + 1);
        let (first, first_replay) =
            replayable_within(streamed(&["ab", "cd"], false), 1024, &BUDGET);
        assert_eq!(read_all(first).await.0, b"abcd");
        let (second, second_replay) = replayable_within(streamed(&["ef"], false), 1024, &BUDGET);
        assert_eq!(read_all(second).await.0, b"ef", "sent once all the same");
        assert!(second_replay.again().is_none(), "nothing left to keep it");
        let again = first_replay.again().expect("kept within the budget");
        drop(first_replay);
        assert_eq!(read_all(again).await.0, b"abcd");
        let (third, third_replay) = replayable_within(streamed(&["gh"], false), 1024, &BUDGET);
        assert_eq!(read_all(third).await.0, b"gh");
        assert!(
            third_replay.again().is_some(),
            "the first body gave its share back"
        );
    }

    /// The inner body wakes whichever copy polled it last: a copy that
    /// takes over while the one before waits on the client is woken when
    /// the client's next frame comes (no request hung on a lost wake-up).
    #[tokio::test]
    async fn a_copy_that_takes_over_a_waiting_body_is_woken() {
        let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Frame<Bytes>, BodyError>>();
        tx.unbounded_send(Ok(Frame::data(Bytes::from_static(b"ab"))))
            .unwrap();
        let (mut first, replay) = replayable(http_body_util::StreamBody::new(rx).boxed(), 1024);
        assert!(first.frame().await.unwrap().is_ok());
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        assert!(Pin::new(&mut first).poll_frame(&mut cx).is_pending());
        let second = replay.again().unwrap();
        let reader = tokio::spawn(read_all(second));
        tokio::task::yield_now().await;
        tx.unbounded_send(Ok(Frame::data(Bytes::from_static(b"cd"))))
            .unwrap();
        drop(tx);
        let read = tokio::time::timeout(std::time::Duration::from_secs(30), reader)
            .await
            .expect("the copy was woken");
        assert_eq!(read.unwrap().0, b"abcd");
    }
}
