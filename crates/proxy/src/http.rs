//! What both sides of the proxy do to HTTP messages.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};

use crate::errors::ProxyError;

/// The HTTP version of one hop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Http1,
    Http2,
}

/// The body type inside the proxy: whatever came in, or a response the
/// proxy made itself.
pub type Body = BoxBody<Bytes, hyper::Error>;

/// Set by the outbound proxy when it carries an HTTP/1 request over HTTP/2
/// to a peer proxy; the peer's inbound removes it and speaks HTTP/1 to its
/// app.
pub const ORIG_PROTO: &str = "tether-orig-proto";
/// Names why the proxy, not the app, answered a request.
pub const PROXY_ERROR: &str = "tether-proxy-error";
/// The header carrying the client's verified identity to the app.
pub const CLIENT_ID: &str = "tether-client-id";

/// Request headers whose value the mesh asserts. A value that arrives from
/// a client is never passed on, on any side: the inbound sets its own, the
/// outbound and the gateway drop it (a plaintext endpoint has no proxy to
/// drop it for them).
pub const MESH_ASSERTED: &[&str] = &[CLIENT_ID];

/// Removes mesh-asserted headers, and any spelling an app could read as
/// one: CGI and WSGI turn `tether_client_id` into the same variable as
/// `tether-client-id`.
pub fn strip_mesh_asserted(headers: &mut HeaderMap) {
    let spelled_alike = |name: &HeaderName| {
        let name = name.as_str();
        name.contains('_')
            && MESH_ASSERTED
                .iter()
                .any(|m| name.len() == m.len() && name.replace('_', "-") == *m)
    };
    let lookalikes: Vec<HeaderName> = headers
        .keys()
        .filter(|n| spelled_alike(n))
        .cloned()
        .collect();
    for name in MESH_ASSERTED
        .iter()
        .copied()
        .map(HeaderName::from_static)
        .chain(lookalikes)
    {
        headers.remove(name);
    }
}

/// What the proxy answers on a connection whose first line is not a valid
/// HTTP/1 request line (the connection is closed after it).
pub fn raw_bad_request(reason: &str) -> Vec<u8> {
    let msg = format!("not a valid HTTP request: {reason}");
    format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n\
         {PROXY_ERROR}: {msg}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{msg}\n",
        msg.len() + 1
    )
    .into_bytes()
}

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// Connection-specific headers, which HTTP/2 forbids and a proxy must not
/// forward (RFC 9110 §7.6.1).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
    if headers.get(header::TE).is_some_and(|v| v != "trailers") {
        headers.remove(header::TE);
    }
}

pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

fn header_value(s: &str) -> HeaderValue {
    let clean: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .collect();
    HeaderValue::from_str(&clean).unwrap_or_else(|_| HeaderValue::from_static("error"))
}

/// The response the proxy gives instead of the app's: an HTTP status, or a
/// trailers-only gRPC response with `grpc-status`, both naming the cause.
pub fn error_response(err: &ProxyError, grpc: bool) -> Response<Body> {
    let msg = err.to_string();
    let mut rsp = if grpc {
        let mut r = Response::new(full(Bytes::new()));
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        h.insert("grpc-status", HeaderValue::from(err.grpc_code()));
        h.insert("grpc-message", header_value(&msg));
        r
    } else {
        let mut r = Response::new(full(format!("{msg}\n")));
        *r.status_mut() = err.status();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        r
    };
    rsp.headers_mut().insert(PROXY_ERROR, header_value(&msg));
    rsp
}

/// The status class label of a response: `2xx` … `5xx`.
pub fn status_class(status: StatusCode) -> &'static str {
    match status.as_u16() {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// Rewrites a request for the next hop. HTTP/2 carries the authority in the
/// URI; HTTP/1 in origin form with a Host header. An HTTP/1 request carried
/// to a peer proxy over HTTP/2 is marked with [`ORIG_PROTO`].
pub fn rewrite_for_hop(
    mut parts: http::request::Parts,
    body: Body,
    authority: &str,
    hop: Proto,
    carry_http1: bool,
) -> http::Request<Body> {
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    match hop {
        Proto::Http2 => {
            if let Ok(uri) = format!("http://{authority}{pq}").parse() {
                parts.uri = uri;
            }
            parts.headers.remove(header::HOST);
            if carry_http1 {
                parts
                    .headers
                    .insert(ORIG_PROTO, HeaderValue::from_static("HTTP/1.1"));
            }
            parts.version = http::Version::HTTP_2;
        }
        Proto::Http1 => {
            if let Ok(uri) = pq.parse() {
                parts.uri = uri;
            }
            if let Ok(v) = HeaderValue::from_str(authority) {
                parts.headers.insert(header::HOST, v);
            }
            parts.version = http::Version::HTTP_11;
        }
    }
    http::Request::from_parts(parts, body)
}

/// The authority a request names: absolute-form URI or `:authority`,
/// else the Host header.
pub fn request_authority<B>(req: &http::Request<B>) -> Option<String> {
    if let Some(a) = req.uri().authority() {
        return Some(a.as_str().to_string());
    }
    req.headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_connection_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 2, "{h:?}");
        assert!(h.contains_key("x-kept") && h.contains_key(header::TE));
    }

    #[test]
    fn mesh_asserted_headers_go_in_every_spelling() {
        let mut h = HeaderMap::new();
        for name in [
            "tether-client-id",
            "tether_client_id",
            "Tether_Client-ID",
            "x-kept",
            "tether_client_idx",
        ] {
            h.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_static("admin"),
            );
        }
        strip_mesh_asserted(&mut h);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["tether_client_idx", "x-kept"]);
    }

    #[test]
    fn grpc_errors_are_trailers_only() {
        let rsp = error_response(&ProxyError::FailFast, true);
        assert_eq!(rsp.status(), StatusCode::OK);
        assert_eq!(rsp.headers()["grpc-status"], "14");
        assert_eq!(rsp.headers()[PROXY_ERROR], "service in fail-fast");
        let rsp = error_response(&ProxyError::ControlPlaneUnreachable, false);
        assert_eq!(rsp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(rsp.headers()[PROXY_ERROR], "control plane unreachable");
    }
}
