//! What both sides that drive `h2` directly do with a stream — the client
//! proxy's connections to peers (`client/h2_conn.rs`) and the listeners'
//! HTTP/2 server (`serve/h2_server.rs`): read a body off a stream, giving
//! its flow-control window back as the data is taken, and send a body onto
//! one as the peer's window allows.

use std::future::poll_fn;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap};
use hyper::body::{Body, Frame, SizeHint};

use crate::http::BodyError;

/// A body read from an h2 stream: gives back flow-control capacity as its
/// data is taken, and ends with the trailers (gRPC's status).
pub struct RecvBody {
    recv: h2::RecvStream,
    /// Data still to come, when the message said how much.
    remaining: Option<u64>,
    data_done: bool,
}

impl RecvBody {
    /// The body of a message whose head is `headers`.
    pub fn new(recv: h2::RecvStream, headers: &HeaderMap) -> Self {
        Self {
            recv,
            remaining: content_length(headers),
            data_done: false,
        }
    }

    pub fn into_stream(self) -> h2::RecvStream {
        self.recv
    }
}

impl Body for RecvBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        if !this.data_done {
            match ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    if let Some(remaining) = &mut this.remaining {
                        *remaining = remaining.saturating_sub(data.len() as u64);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(bounded(&e).into()))),
                None => this.data_done = true,
            }
        }
        match ready!(this.recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(bounded(&e).into()))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match self.remaining {
            Some(remaining) => SizeHint::with_exact(remaining),
            None => SizeHint::default(),
        }
    }
}

/// Sends a body's frames as the peer's flow control allows, ending the
/// stream with its last frame. Fails with the reason to reset the stream
/// with, or none when the stream is gone (the peer reset it, the
/// connection ended). With `stall`, a peer that gives no window for that
/// long, data waiting, gets the stream reset (CANCEL): what the body holds
/// (a connection to the app, say) is not held for a peer that never reads.
pub async fn send_body<B>(
    mut body: B,
    stream: &mut h2::SendStream<Bytes>,
    stall: Option<std::time::Duration>,
) -> Result<(), Option<h2::Reason>>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    loop {
        let frame = poll_fn(|cx| {
            if stream.poll_reset(cx).is_ready() {
                return Poll::Ready(None);
            }
            Pin::new(&mut body).poll_frame(cx).map(Some)
        })
        .await
        .ok_or(None)?;
        let frame = match frame {
            None => return stream.send_data(Bytes::new(), true).map_err(|_| None),
            Some(Err(e)) => {
                tracing::debug!(error = %e, "body failed; resetting its stream");
                return Err(Some(h2::Reason::INTERNAL_ERROR));
            }
            Some(Ok(frame)) => frame,
        };
        let mut data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    return stream.send_trailers(trailers).map_err(|_| None);
                }
                continue;
            }
        };
        let end = body.is_end_stream();
        if data.is_empty() {
            // An empty frame (a peer's way to end its stream, often).
            if end {
                return stream.send_data(data, true).map_err(|_| None);
            }
            continue;
        }
        while !data.is_empty() {
            stream.reserve_capacity(data.len());
            let granted = loop {
                let capacity = stream.capacity();
                if capacity > 0 {
                    break capacity;
                }
                let window = poll_fn(|cx| {
                    if stream.poll_reset(cx).is_ready() {
                        return Poll::Ready(None);
                    }
                    stream.poll_capacity(cx)
                });
                let window = match stall {
                    Some(limit) => tokio::time::timeout(limit, window).await.map_err(|_| {
                        tracing::debug!(?limit, "the peer gave no window; resetting its stream");
                        Some(h2::Reason::CANCEL)
                    })?,
                    None => window.await,
                };
                window.and_then(Result::ok).ok_or(None)?;
            };
            let chunk = data.split_to(granted.min(data.len()));
            stream
                .send_data(chunk, end && data.is_empty())
                .map_err(|_| None)?;
        }
        if end {
            return Ok(());
        }
    }
}

/// An h2 error's message, bounded: h2 shows a GOAWAY's debug data whole
/// (the peer's bytes, up to a frame, escaped: 64 KiB), and the message
/// goes to the client (`tether-proxy-error`, `grpc-message`) and the logs.
pub fn bounded(e: &h2::Error) -> String {
    tether_core::truncate::bounded_message(e)
}

pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}
