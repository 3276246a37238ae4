//! Classifies a response once its outcome is known, and only then counts
//! it. For HTTP the status says it all; gRPC says it in `grpc-status`,
//! usually in the trailers at the end of the body, so a response body is
//! wrapped and counted when its trailers arrive (or when it ends, fails or
//! is dropped). Classes: `1xx`–`5xx`, `grpc_error` (a non-zero
//! `grpc-status`), `error` (the body failed).

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use hyper::body::{Frame, SizeHint};

use crate::http::{status_class, ReplyBody};

/// `grpc-status` as a static name: a name looked up as a `&str` is parsed
/// again on every call.
const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");

/// `grpc-status`, when present.
pub fn grpc_status(headers: &HeaderMap) -> Option<u32> {
    headers.get(GRPC_STATUS)?.to_str().ok()?.trim().parse().ok()
}

/// What is told a response's class, once, when it is known.
pub trait Record: Send + Sync + Unpin + 'static {
    fn record(self, class: &'static str);
}

/// A response body that reports its response's class when its outcome is
/// known. Named and generic rather than boxed: it is the body type the
/// proxy's HTTP servers send, so no response is boxed again for it.
pub struct Classified<R: Record> {
    inner: ReplyBody,
    /// The class if nothing more specific turns up.
    default_class: &'static str,
    record: Option<R>,
}

impl<R: Record> Classified<R> {
    fn finish(&mut self, class: &'static str) {
        if let Some(record) = self.record.take() {
            record.record(class);
        }
    }
}

impl<R: Record> hyper::body::Body for Classified<R> {
    type Data = Bytes;
    type Error = crate::http::BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, crate::http::BodyError>>> {
        let this = &mut *self;
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &frame {
            Some(Ok(f)) => {
                if let Some(code) = f.trailers_ref().and_then(grpc_status) {
                    this.finish(if code == 0 { "2xx" } else { "grpc_error" });
                }
            }
            Some(Err(_)) => this.finish("error"),
            None => {
                let class = this.default_class;
                this.finish(class);
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<R: Record> Drop for Classified<R> {
    fn drop(&mut self) {
        let class = self.default_class;
        self.finish(class);
    }
}

/// Wraps `rsp` so that `record` is told its class once.
pub fn classify<R: Record>(
    rsp: http::Response<ReplyBody>,
    record: R,
) -> http::Response<Classified<R>> {
    let grpc = crate::http::is_grpc(rsp.headers());
    // Only a gRPC response's headers are looked at for a status.
    let class = match grpc.then(|| grpc_status(rsp.headers())).flatten() {
        Some(code) if code != 0 => "grpc_error",
        _ => status_class(rsp.status()),
    };
    let (parts, body) = rsp.into_parts();
    let wrapped = Classified {
        inner: body,
        default_class: class,
        record: Some(record),
    };
    http::Response::from_parts(parts, wrapped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::{Arc, Mutex};

    fn grpc_response(trailer: &str) -> http::Response<ReplyBody> {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", trailer.parse().unwrap());
        let frames = vec![
            Ok::<_, crate::http::BodyError>(Frame::data(Bytes::from_static(b"\\0\\0\\0\\0\\0"))),
            Ok(Frame::trailers(trailers)),
        ];
        let body = http_body_util::StreamBody::new(futures::stream::iter(frames))
            .boxed()
            .into();
        http::Response::builder()
            .header("content-type", "application/grpc")
            .body(body)
            .unwrap()
    }

    struct Seen(Arc<Mutex<String>>);

    impl Record for Seen {
        fn record(self, class: &'static str) {
            *self.0.lock().unwrap() = class.to_string();
        }
    }

    async fn class_of(rsp: http::Response<ReplyBody>) -> String {
        let seen = Arc::new(Mutex::new(String::new()));
        let rsp = classify(rsp, Seen(seen.clone()));
        let _ = rsp.into_body().collect().await;
        let class = seen.lock().unwrap().clone();
        class
    }

    #[tokio::test]
    async fn grpc_status_in_trailers_decides() {
        assert_eq!(class_of(grpc_response("0")).await, "2xx");
        assert_eq!(class_of(grpc_response("13")).await, "grpc_error");
        let plain = http::Response::builder()
            .status(503)
            .body(crate::http::full("x").into())
            .unwrap();
        assert_eq!(class_of(plain).await, "5xx");
    }
}
