//! What both sides of the proxy do to HTTP messages.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full};

use crate::errors::ProxyError;

/// The HTTP version of one hop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Http1,
    Http2,
}

/// A body's error inside the proxy: hyper's (a body from a connection hyper
/// serves) or h2's (a response body from a peer over HTTP/2), boxed.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// The body type inside the proxy: whatever came in, or a response the
/// proxy made itself.
pub type Body = BoxBody<Bytes, BodyError>;

/// A response body on its way back to the client: the next hop's, as it
/// came (most responses: not boxed again on the way), or one the proxy
/// made or wrapped.
pub enum ReplyBody {
    Upstream(crate::client::ResponseBody),
    Made(Body),
}

impl From<Body> for ReplyBody {
    fn from(body: Body) -> Self {
        ReplyBody::Made(body)
    }
}

impl hyper::body::Body for ReplyBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            ReplyBody::Upstream(b) => std::pin::Pin::new(b).poll_frame(cx),
            ReplyBody::Made(b) => std::pin::Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ReplyBody::Upstream(b) => b.is_end_stream(),
            ReplyBody::Made(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            ReplyBody::Upstream(b) => b.size_hint(),
            ReplyBody::Made(b) => b.size_hint(),
        }
    }
}

/// Set by the outbound proxy when it carries an HTTP/1 request over HTTP/2
/// to a peer proxy; the peer's inbound removes it and speaks HTTP/1 to its
/// app. linkerd2-proxy's name and values (`linkerd/proxy/http/src/orig_proto.rs`),
/// so either proxy can be the client of the other.
pub const ORIG_PROTO: &str = "l5d-orig-proto";
/// [`ORIG_PROTO`] as a header name: inserting a name given as a `&str`
/// copies it into a new allocation each time, a static one does not.
pub const ORIG_PROTO_HEADER: HeaderName = HeaderName::from_static(ORIG_PROTO);
/// The name Tether used before it adopted linkerd2-proxy's: still read on
/// inbound (and never passed on) so proxies of both versions interoperate
/// while a mesh is upgraded. Never sent.
pub const LEGACY_ORIG_PROTO: &str = "tether-orig-proto";
pub const LEGACY_ORIG_PROTO_HEADER: HeaderName = HeaderName::from_static(LEGACY_ORIG_PROTO);
/// Names why the proxy, not the app, answered a request.
pub const PROXY_ERROR: &str = "tether-proxy-error";
/// [`PROXY_ERROR`] as a header name: a name looked up as a `&str` is
/// parsed and checked again on every call, a static one is not.
pub const PROXY_ERROR_HEADER: HeaderName = HeaderName::from_static(PROXY_ERROR);
/// The header carrying the client's verified identity to the app.
pub const CLIENT_ID: &str = "tether-client-id";
pub const CLIENT_ID_HEADER: HeaderName = HeaderName::from_static(CLIENT_ID);
/// linkerd2-proxy's name for [`CLIENT_ID`], set beside it: an app moved
/// from Linkerd keeps trusting it, so a client's own value must never
/// reach an app, as with linkerd2-proxy.
pub const L5D_CLIENT_ID: &str = "l5d-client-id";
pub const L5D_CLIENT_ID_HEADER: HeaderName = HeaderName::from_static(L5D_CLIENT_ID);

/// Request headers whose value the mesh asserts. A value that arrives from
/// a client is never passed on, on any side: the inbound sets its own, the
/// outbound and the gateway drop it (a plaintext endpoint has no proxy to
/// drop it for them).
pub const MESH_ASSERTED: &[&str] = &[CLIENT_ID, L5D_CLIENT_ID, ORIG_PROTO, LEGACY_ORIG_PROTO];

/// What an [`ORIG_PROTO`] marker says about the request's first hop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrigProto {
    /// `HTTP/1.1` or `HTTP/1.0`.
    pub version: http::Version,
    /// The request target was in absolute form (`GET http://host/path`).
    pub absolute_form: bool,
    /// Marked with [`LEGACY_ORIG_PROTO`] (by a Tether proxy of an older
    /// version, which would pass a response marker on to its app).
    pub legacy: bool,
}

impl OrigProto {
    /// The marker for a request that arrived as `version` (HTTP/1.x).
    pub fn of(version: http::Version, uri: &http::Uri) -> Self {
        Self {
            version: if version == http::Version::HTTP_10 {
                http::Version::HTTP_10
            } else {
                http::Version::HTTP_11
            },
            absolute_form: uri.scheme().is_some(),
            legacy: false,
        }
    }

    /// The header value, exactly as linkerd2-proxy writes it: the extra
    /// `; absolute-form` only when it differs from the usual origin form.
    pub fn header_value(self) -> HeaderValue {
        HeaderValue::from_static(match (self.version, self.absolute_form) {
            (http::Version::HTTP_10, false) => "HTTP/1.0",
            (http::Version::HTTP_10, true) => "HTTP/1.0; absolute-form",
            (_, false) => "HTTP/1.1",
            (_, true) => "HTTP/1.1; absolute-form",
        })
    }

    /// Reads a marker the way linkerd2-proxy's inbound does: the version
    /// by prefix, `absolute-form` at a fixed offset. An unknown value names
    /// no version: the request stays HTTP/2 (as linkerd2-proxy keeps it).
    fn parse(value: &HeaderValue, legacy: bool) -> Option<Self> {
        let v = value.as_bytes();
        let version = if v.starts_with(b"HTTP/1.1") {
            http::Version::HTTP_11
        } else if v.starts_with(b"HTTP/1.0") {
            http::Version::HTTP_10
        } else {
            return None;
        };
        let absolute_form =
            v.len() >= "HTTP/1.1; absolute-form".len() && &v[10..23] == b"absolute-form";
        Some(Self {
            version,
            absolute_form,
            legacy,
        })
    }
}

/// The request's HTTP/1 origin, when a peer proxy marked it (under either
/// name); both markers are removed, whatever their value.
pub fn take_orig_proto(headers: &mut HeaderMap) -> Option<OrigProto> {
    let current = headers.remove(ORIG_PROTO_HEADER);
    let legacy = headers.remove(LEGACY_ORIG_PROTO_HEADER);
    match (current, legacy) {
        (Some(v), _) => OrigProto::parse(&v, false),
        (None, Some(v)) => OrigProto::parse(&v, true),
        (None, None) => None,
    }
}

/// Removes mesh-asserted headers, and any spelling an app could read as
/// one: CGI and WSGI turn `tether_client_id` into the same variable as
/// `tether-client-id`. One pass over the names decides: a request carries
/// none of them nearly always, and then nothing is looked up or removed.
pub fn strip_mesh_asserted(headers: &mut HeaderMap) {
    if !headers.keys().any(is_mesh_asserted) {
        return;
    }
    let found: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_mesh_asserted(n))
        .cloned()
        .collect();
    for name in found {
        headers.remove(name);
    }
}

/// A mesh-asserted name, spelled with `-` or `_` (names are lowercase).
fn is_mesh_asserted(name: &HeaderName) -> bool {
    let name = name.as_str().as_bytes();
    MESH_ASSERTED.iter().any(|m| {
        name.len() == m.len()
            && name
                .iter()
                .zip(m.bytes())
                .all(|(&n, m)| n == m || (n == b'_' && m == b'-'))
    })
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
    let bytes = bytes.into();
    if bytes.is_empty() {
        return empty();
    }
    Full::new(bytes).map_err(|never| match never {}).boxed()
}

/// An empty body. Boxing it allocates nothing (it has no size), so a
/// request without a body (most of them) costs no allocation for it.
pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed()
}

/// Connection-specific headers, which HTTP/2 forbids and a proxy must not
/// forward (RFC 9110 §7.6.1) — except the two an upgrade the proxy carries
/// needs on every hop (`Connection: upgrade`, `Upgrade`; see
/// [`crate::upgrade`]).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip(headers, true, &[], Hpack::Unused);
}

/// [`strip_hop_by_hop`] for a message that goes out over HTTP/2, which
/// carries no upgrade: the upgrade pair goes too (h2 refuses to send any
/// connection-specific header). What it saw tells whether the message has
/// a `Date` and a `Content-Length`.
///
/// The same pass marks the values that change with every message
/// ([`changes_every_message`]) as never to be indexed by HPACK.
pub fn strip_hop_by_hop_http2(headers: &mut HeaderMap) -> Seen {
    strip(headers, false, &[], Hpack::Used)
}

/// Whether a message goes out through an HPACK encoder (HTTP/2).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hpack {
    Unused,
    Used,
}

/// Whether the values of `name` differ from one message to the next (or
/// from one second to the next), so that HPACK should send them as
/// never-indexed literals. Indexed, each such value is sent once and then
/// pushes out entries worth keeping (the authority, the content type),
/// and h2's encoder walks every value it holds under the name, oldest
/// first, before it adds one: with a new `Date` each second, ~60
/// comparisons per response once a connection is a minute old. Never
/// indexed, the peer decodes a Huffman literal each time instead (~1k
/// instructions), and a name outside HPACK's static table (all but
/// `Date`) is spelled out each time too. For a request id that is a gain
/// from the first message; for a `Date`, from a connection's ~30th second
/// in the plain release build, and even in the PGO + BOLT build
/// (docs/performance.md, fourteenth pass). `bit` is the name's
/// [`seen_bit`].
///
/// The representation is RFC 7541's for sensitive values: an intermediary
/// after the proxy keeps it never indexed too (§7.1.3). h2 offers no
/// other way to keep a value out of its table.
fn changes_every_message(name: &HeaderName, bit: u32) -> bool {
    if bit != 0 {
        return bit == DATE_SEEN;
    }
    let name = name.as_str();
    // Most names start with none of these letters, and are then told
    // apart without comparing a string (`content-type` is as long as
    // `x-request-id`).
    if !matches!(
        name.as_bytes().first(),
        Some(b'x' | b't' | b'b' | b'u' | b'r' | b's' | b'g')
    ) {
        return false;
    }
    matches!(
        name,
        "x-request-id"
            | "request-id"
            | "x-correlation-id"
            | "traceparent"
            | "grpc-trace-bin"
            | "b3"
            | "x-b3-traceid"
            | "x-b3-spanid"
            | "x-b3-parentspanid"
            | "uber-trace-id"
            | "x-amzn-trace-id"
            | "x-cloud-trace-context"
            | "x-datadog-trace-id"
            | "x-datadog-parent-id"
            | "sentry-trace"
    )
}

/// Values this short are few (`b3: 1`, a sampling decision alone), and
/// worth indexing whatever their name.
const SHORTEST_PER_MESSAGE_VALUE: usize = 8;

/// [`strip_hop_by_hop`] for a response: the upgrade pair stays only on
/// `101 Switching Protocols` (elsewhere it would be one more header an
/// HTTP/2 client's connection must drop).
pub fn strip_hop_by_hop_response(status: StatusCode, headers: &mut HeaderMap) {
    strip(
        headers,
        status == StatusCode::SWITCHING_PROTOCOLS,
        &[],
        Hpack::Unused,
    );
}

/// [`strip_hop_by_hop_response`], and the headers named `also` removed
/// too: found in the same pass over the names, so one that is absent
/// (nearly always) costs no lookup of its own.
pub fn strip_hop_by_hop_response_and(
    status: StatusCode,
    headers: &mut HeaderMap,
    also: &[HeaderName],
) {
    strip(
        headers,
        status == StatusCode::SWITCHING_PROTOCOLS,
        also,
        Hpack::Unused,
    );
}

/// What one pass over a message's header names found: which hop-by-hop
/// headers are there (only those are then looked up and removed), and
/// whether the message has a `Date` and a `Content-Length` (the HTTP/2
/// server adds them when missing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seen(u32);

impl Seen {
    pub fn date(self) -> bool {
        self.0 & DATE_SEEN != 0
    }

    pub fn content_length(self) -> bool {
        self.0 & CONTENT_LENGTH_SEEN != 0
    }
}

// The bits of [`Seen`].
const CONNECTION_SEEN: u32 = 1;
const TRANSFER_ENCODING_SEEN: u32 = 1 << 1;
const UPGRADE_SEEN: u32 = 1 << 2;
const PROXY_AUTHORIZATION_SEEN: u32 = 1 << 3;
const PROXY_AUTHENTICATE_SEEN: u32 = 1 << 4;
const TE_SEEN: u32 = 1 << 5;
const KEEP_ALIVE_SEEN: u32 = 1 << 6;
const PROXY_CONNECTION_SEEN: u32 = 1 << 7;
/// A `Connection` value names a header other than `keep-alive` and
/// `upgrade` (removed by their own names anyway).
const NAMES_OTHERS: u32 = 1 << 8;
const DATE_SEEN: u32 = 1 << 9;
const CONTENT_LENGTH_SEEN: u32 = 1 << 10;
/// Bit `ALSO_SEEN + i`: the caller's `also[i]`.
const ALSO_SEEN: u32 = 11;
const MAX_ALSO: usize = (u32::BITS - ALSO_SEEN) as usize;

/// The hop-by-hop headers removed with what `Connection` names, and the
/// names in `also`; the upgrade pair put back when `keep_upgrade` and the
/// message asks for one; over HTTP/2 (`hpack`), the values that change
/// with every message marked as never to be indexed.
fn strip(headers: &mut HeaderMap, keep_upgrade: bool, also: &[HeaderName], hpack: Hpack) -> Seen {
    assert!(also.len() <= MAX_ALSO, "too many names for one pass");
    // One pass over the names decides: most messages carry none of these
    // (HTTP/2 never does), and then nothing is looked up or removed; most
    // others carry `Connection: keep-alive` alone, and then only
    // `Connection` is.
    let bit_of = |name: &HeaderName| match seen_bit(name) {
        0 => also
            .iter()
            .position(|a| a == name)
            .map_or(0, |i| 1 << (ALSO_SEEN + i as u32)),
        bit => bit,
    };
    let mut seen = 0;
    match hpack {
        Hpack::Unused => {
            for name in headers.keys() {
                seen |= bit_of(name);
            }
        }
        Hpack::Used => {
            for (name, value) in headers.iter_mut() {
                let bit = bit_of(name);
                if value.len() >= SHORTEST_PER_MESSAGE_VALUE && changes_every_message(name, bit) {
                    value.set_sensitive(true);
                }
                seen |= bit;
            }
        }
    }
    if seen & !(DATE_SEEN | CONTENT_LENGTH_SEEN) == 0 {
        return Seen(seen);
    }
    if seen & CONNECTION_SEEN != 0 && headers.get_all(header::CONNECTION).iter().any(names_others) {
        seen |= NAMES_OTHERS;
    }
    let upgrade = (keep_upgrade
        && seen & (CONNECTION_SEEN | UPGRADE_SEEN) == CONNECTION_SEEN | UPGRADE_SEEN
        && crate::upgrade::offers_upgrade(headers))
    .then(|| headers.get(header::UPGRADE).cloned())
    .flatten();
    if seen & NAMES_OTHERS != 0 {
        remove_all_named(headers);
        // What `Connection` named is gone, whichever it was: a `Date`,
        // say.
        seen &= !(DATE_SEEN | CONTENT_LENGTH_SEEN);
        if headers.contains_key(header::DATE) {
            seen |= DATE_SEEN;
        }
        if headers.contains_key(header::CONTENT_LENGTH) {
            seen |= CONTENT_LENGTH_SEEN;
        }
    }
    // One by one: a loop over an array of names would make and drop each
    // name whatever the message.
    if seen & CONNECTION_SEEN != 0 {
        headers.remove(header::CONNECTION);
    }
    if seen & TRANSFER_ENCODING_SEEN != 0 {
        headers.remove(header::TRANSFER_ENCODING);
    }
    if seen & UPGRADE_SEEN != 0 {
        headers.remove(header::UPGRADE);
    }
    if seen & PROXY_AUTHORIZATION_SEEN != 0 {
        headers.remove(header::PROXY_AUTHORIZATION);
    }
    if seen & PROXY_AUTHENTICATE_SEEN != 0 {
        headers.remove(header::PROXY_AUTHENTICATE);
    }
    if seen & KEEP_ALIVE_SEEN != 0 {
        headers.remove(KEEP_ALIVE);
    }
    if seen & PROXY_CONNECTION_SEEN != 0 {
        headers.remove(PROXY_CONNECTION);
    }
    if seen & TE_SEEN != 0 && headers.get(header::TE).is_some_and(|v| v != "trailers") {
        headers.remove(header::TE);
    }
    for (i, name) in also.iter().enumerate() {
        if seen & (1 << (ALSO_SEEN + i as u32)) != 0 {
            headers.remove(name);
        }
    }
    if let Some(protocol) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, protocol);
    }
    Seen(seen)
}

/// The bit of [`Seen`] a header name sets. Compared as names, not as
/// text: a standard name is a small number, told apart from another (or
/// from a custom name) in an instruction or two, where spelling it out
/// costs a table lookup and a string comparison per name.
fn seen_bit(name: &HeaderName) -> u32 {
    if *name == header::CONNECTION {
        CONNECTION_SEEN
    } else if *name == header::DATE {
        DATE_SEEN
    } else if *name == header::CONTENT_LENGTH {
        CONTENT_LENGTH_SEEN
    } else if *name == header::TRANSFER_ENCODING {
        TRANSFER_ENCODING_SEEN
    } else if *name == header::TE {
        TE_SEEN
    } else if *name == header::UPGRADE {
        UPGRADE_SEEN
    } else if *name == header::PROXY_AUTHORIZATION {
        PROXY_AUTHORIZATION_SEEN
    } else if *name == header::PROXY_AUTHENTICATE {
        PROXY_AUTHENTICATE_SEEN
    } else if *name == KEEP_ALIVE {
        KEEP_ALIVE_SEEN
    } else if *name == PROXY_CONNECTION {
        PROXY_CONNECTION_SEEN
    } else {
        0
    }
}

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Removes the headers the `Connection` headers name. Its values are
/// shared, cloning them copies nothing. Usually there is one.
fn remove_all_named(headers: &mut HeaderMap) {
    let mut connection = headers.get_all(header::CONNECTION).iter();
    match (connection.next().cloned(), connection.next()) {
        (None, _) => {}
        (Some(only), None) => remove_named(headers, &only),
        (Some(first), Some(_)) => {
            let all: Vec<HeaderValue> = std::iter::once(first)
                .chain(headers.get_all(header::CONNECTION).iter().skip(1).cloned())
                .collect();
            for value in &all {
                remove_named(headers, value);
            }
        }
    }
}

/// The names a `Connection` value lists, other than the two removed by
/// their static names anyway (`Connection: keep-alive` is the usual
/// value): nothing to parse a name from. A value that is not text names
/// nothing.
fn named_by(connection: &HeaderValue) -> impl Iterator<Item = &str> {
    connection
        .to_str()
        .into_iter()
        .flat_map(|names| names.split(',').map(str::trim))
        .filter(|name| {
            !name.eq_ignore_ascii_case("keep-alive") && !name.eq_ignore_ascii_case("upgrade")
        })
}

/// Whether a `Connection` value names a header to remove by its name:
/// [`named_by`] would give one. Looked at as bytes: the usual value
/// (`keep-alive`) is checked on every response from an HTTP/1 app.
fn names_others(connection: &HeaderValue) -> bool {
    // The usual value as servers spell it: one comparison, not a
    // case-blind one byte by byte.
    if connection.as_bytes() == b"keep-alive" {
        return false;
    }
    connection.to_str().is_ok_and(|names| {
        names
            .as_bytes()
            .split(|&b| b == b',')
            .map(<[u8]>::trim_ascii)
            .any(|name| {
                !name.eq_ignore_ascii_case(b"keep-alive") && !name.eq_ignore_ascii_case(b"upgrade")
            })
    })
}

/// Removes the headers a `Connection` header value names. The names go as
/// text: a name made from bytes would be copied into an allocation each.
fn remove_named(headers: &mut HeaderMap, connection: &HeaderValue) {
    for name in named_by(connection) {
        headers.remove(name);
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
    rsp.headers_mut()
        .insert(PROXY_ERROR_HEADER, header_value(&msg));
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

/// The authority requests are rewritten for, parsed once: as a URI's
/// authority (HTTP/2, absolute form) and as a `Host` value (HTTP/1).
/// Cloning either shares its bytes; parsing the text copied them into a
/// new allocation per request.
#[derive(Clone, Debug)]
pub struct HopAuthority {
    /// `None`: not a valid URI authority (the request's URI stays as it
    /// came).
    uri: Option<http::uri::Authority>,
    /// `None`: not a valid header value (no `Host` is set).
    host: Option<HeaderValue>,
}

impl HopAuthority {
    pub fn new(authority: &str) -> Self {
        Self {
            uri: http::uri::Authority::try_from(authority).ok(),
            host: HeaderValue::from_str(authority).ok(),
        }
    }
}

/// Rewrites a request for the next hop. HTTP/2 carries the authority in the
/// URI; HTTP/1 in origin form (absolute form when `orig` says the request
/// came so) with a Host header. An HTTP/1 request carried to a peer proxy
/// over HTTP/2 is marked with [`ORIG_PROTO`] (`orig`).
pub fn rewrite_for_hop(
    mut parts: http::request::Parts,
    body: Body,
    authority: &HopAuthority,
    hop: Proto,
    orig: Option<OrigProto>,
) -> http::Request<Body> {
    // The URI is put together from its parts: the request's own path
    // (moved, not copied) and the authority parsed once; an authority that
    // does not parse leaves the request's URI as it came.
    let mut original = std::mem::take(&mut parts.uri).into_parts();
    let had_path = original.path_and_query.is_some();
    let pq = original
        .path_and_query
        .take()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    let absolute = match hop {
        Proto::Http2 => true,
        Proto::Http1 => orig.is_some_and(|o| o.absolute_form),
    };
    parts.uri = if !absolute {
        http::Uri::from(pq)
    } else if let Some(authority) = &authority.uri {
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(http::uri::Scheme::HTTP);
        uri.authority = Some(authority.clone());
        uri.path_and_query = Some(pq);
        http::Uri::from_parts(uri).unwrap_or_default()
    } else {
        original.path_and_query = had_path.then_some(pq);
        http::Uri::from_parts(original).unwrap_or_default()
    };
    match hop {
        Proto::Http2 => {
            parts.headers.remove(header::HOST);
            if let Some(orig) = orig {
                parts.headers.insert(ORIG_PROTO_HEADER, orig.header_value());
            }
            parts.version = http::Version::HTTP_2;
        }
        Proto::Http1 => {
            if let Some(v) = &authority.host {
                parts.headers.insert(header::HOST, v.clone());
            }
            parts.version = match orig {
                Some(o) => o.version,
                None => http::Version::HTTP_11,
            };
        }
    }
    http::Request::from_parts(parts, body)
}

/// The authority a request names: absolute-form URI or `:authority`,
/// else the Host header.
pub fn request_authority<B>(req: &http::Request<B>) -> Option<&str> {
    if let Some(a) = req.uri().authority() {
        return Some(a.as_str());
    }
    req.headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
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
        // An upgrade keeps exactly what it needs.
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("Upgrade, x-private"),
        );
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h[header::CONNECTION], "upgrade");
        assert_eq!(h[header::UPGRADE], "websocket");
        assert!(!h.contains_key("x-private"));
        let mut response = h.clone();
        strip_hop_by_hop_response(StatusCode::SWITCHING_PROTOCOLS, &mut response);
        assert_eq!(response[header::UPGRADE], "websocket");
        strip_hop_by_hop_response(StatusCode::OK, &mut response);
        assert!(
            !response.contains_key(header::UPGRADE) && !response.contains_key(header::CONNECTION)
        );
        // Over HTTP/2 the pair goes too, with what `Connection` names.
        let mut over_h2 = h.clone();
        over_h2.insert("x-private", HeaderValue::from_static("1"));
        over_h2.insert(
            header::CONNECTION,
            HeaderValue::from_static("upgrade, x-private"),
        );
        strip_hop_by_hop_http2(&mut over_h2);
        assert_eq!(over_h2.len(), 2, "{over_h2:?}");
        assert!(over_h2.contains_key("x-kept") && over_h2.contains_key(header::TE));
        h.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        strip_hop_by_hop(&mut h);
        assert!(!h.contains_key(header::UPGRADE) && !h.contains_key(header::CONNECTION));
    }

    /// Only the names whose values change with every message are marked,
    /// whatever their first letter.
    #[test]
    fn names_that_change_with_every_message() {
        for name in [
            "date",
            "x-request-id",
            "traceparent",
            "b3",
            "x-b3-traceid",
            "x-b3-spanid",
            "x-b3-parentspanid",
            "uber-trace-id",
            "x-amzn-trace-id",
            "x-cloud-trace-context",
            "request-id",
            "x-correlation-id",
            "grpc-trace-bin",
            "x-datadog-trace-id",
            "x-datadog-parent-id",
            "sentry-trace",
        ] {
            let name = HeaderName::from_static(name);
            assert!(changes_every_message(&name, seen_bit(&name)), "{name}");
        }
        for name in [
            "content-type",
            "server",
            "x-b3-sampled",
            "tracestate",
            "user-agent",
            "te",
            "b",
            "x-request",
            "content-length",
            "server",
            "retry-after",
            "grpc-status",
        ] {
            let name = HeaderName::from_static(name);
            assert!(!changes_every_message(&name, seen_bit(&name)), "{name}");
        }
    }

    /// A sampling decision alone (`b3: 1`) stays indexed; a trace in the
    /// same header is marked, and only over HTTP/2.
    #[test]
    fn short_values_stay_indexed() {
        let mut h = HeaderMap::new();
        h.append("b3", HeaderValue::from_static("1"));
        h.append(
            "b3",
            HeaderValue::from_static("80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1"),
        );
        let mut over_h1 = h.clone();
        strip_hop_by_hop_http2(&mut h);
        let marked: Vec<bool> = h.get_all("b3").iter().map(|v| v.is_sensitive()).collect();
        assert_eq!(marked, [false, true]);
        strip_hop_by_hop(&mut over_h1);
        assert!(over_h1.get_all("b3").iter().all(|v| !v.is_sensitive()));
    }

    /// Each hop-by-hop header goes when it is the only one there, and
    /// nothing else does; `TE: trailers` stays.
    #[test]
    fn each_hop_by_hop_header_goes_alone() {
        for (name, value) in [
            ("connection", "keep-alive"),
            ("connection", "close"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("proxy-authorization", "Basic eA=="),
            ("proxy-authenticate", "Basic"),
            ("te", "gzip"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
        ] {
            for strip in [
                strip_hop_by_hop as fn(&mut HeaderMap),
                |h: &mut HeaderMap| {
                    strip_hop_by_hop_http2(h);
                },
                |h: &mut HeaderMap| strip_hop_by_hop_response(StatusCode::OK, h),
            ] {
                let mut h = HeaderMap::new();
                h.insert("x-kept", HeaderValue::from_static("1"));
                h.insert(header::DATE, HeaderValue::from_static("today"));
                h.insert(name, HeaderValue::from_static(value));
                strip(&mut h);
                assert!(!h.contains_key(name), "{name}: {value} kept");
                assert_eq!(h.len(), 2, "{name}: {h:?}");
            }
        }
        let mut h = HeaderMap::new();
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h[header::TE], "trailers");
    }

    /// The names a caller adds go in the same pass, present or not, with
    /// or without hop-by-hop headers beside them.
    #[test]
    fn names_asked_for_go_with_the_hop_by_hop_ones() {
        let also = [PROXY_ERROR_HEADER, ORIG_PROTO_HEADER];
        for hop in [None, Some(("connection", "keep-alive"))] {
            for present in [&[][..], &[PROXY_ERROR][..], &[PROXY_ERROR, ORIG_PROTO][..]] {
                let mut h = HeaderMap::new();
                h.insert(header::SERVER, HeaderValue::from_static("app"));
                if let Some((name, value)) = hop {
                    h.insert(name, HeaderValue::from_static(value));
                }
                for name in present {
                    h.insert(*name, HeaderValue::from_static("x"));
                }
                strip_hop_by_hop_response_and(StatusCode::OK, &mut h, &also);
                let left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
                assert_eq!(left, ["server"], "{hop:?} {present:?}");
            }
        }
    }

    /// What a strip saw of `Date` and `Content-Length` is what the message
    /// has once stripped, also when `Connection` named one of them.
    #[test]
    fn what_a_strip_saw_is_what_is_left() {
        for connection in [
            None,
            Some("keep-alive"),
            Some("date"),
            Some("content-length, x-a"),
        ] {
            for date in [false, true] {
                for length in [false, true] {
                    let mut h = HeaderMap::new();
                    if let Some(c) = connection {
                        h.insert(header::CONNECTION, HeaderValue::from_static(c));
                    }
                    if date {
                        h.insert(header::DATE, HeaderValue::from_static("today"));
                    }
                    if length {
                        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("3"));
                    }
                    let seen = strip_hop_by_hop_http2(&mut h);
                    assert_eq!(seen.date(), h.contains_key(header::DATE), "{connection:?}");
                    assert_eq!(
                        seen.content_length(),
                        h.contains_key(header::CONTENT_LENGTH),
                        "{connection:?}"
                    );
                }
            }
        }
    }

    /// The strip as it was before it looked at the names once: every name
    /// removed unconditionally.
    fn strip_as_before(headers: &mut HeaderMap, keep_upgrade: bool, also: &[HeaderName]) {
        let upgrade = (keep_upgrade && crate::upgrade::wants_upgrade(headers))
            .then(|| headers.get(header::UPGRADE).cloned())
            .flatten();
        let all: Vec<HeaderValue> = headers
            .get_all(header::CONNECTION)
            .iter()
            .cloned()
            .collect();
        for value in &all {
            if let Ok(names) = value.to_str() {
                for name in names.split(',').map(str::trim) {
                    if !name.eq_ignore_ascii_case("keep-alive")
                        && !name.eq_ignore_ascii_case("upgrade")
                    {
                        headers.remove(name);
                    }
                }
            }
        }
        for name in [
            header::CONNECTION,
            header::TRANSFER_ENCODING,
            header::UPGRADE,
            header::PROXY_AUTHORIZATION,
            header::PROXY_AUTHENTICATE,
            KEEP_ALIVE,
            PROXY_CONNECTION,
        ] {
            headers.remove(name);
        }
        if headers.get(header::TE).is_some_and(|v| v != "trailers") {
            headers.remove(header::TE);
        }
        for name in also {
            headers.remove(name);
        }
        if let Some(protocol) = upgrade {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            headers.insert(header::UPGRADE, protocol);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]

        /// Whatever headers a message has, the strip leaves what removing
        /// every name unconditionally left.
        #[test]
        fn strip_leaves_what_removing_everything_left(
            headers in proptest::collection::vec((0..NAMES.len(), 0..VALUES.len()), 0..12),
            keep_upgrade in proptest::prelude::any::<bool>(),
            with_also in proptest::prelude::any::<bool>(),
            over_http2 in proptest::prelude::any::<bool>(),
        ) {
            let mut h = HeaderMap::new();
            for (name, value) in headers {
                h.append(
                    HeaderName::from_static(NAMES[name]),
                    HeaderValue::from_static(VALUES[value]),
                );
            }
            let also: &[HeaderName] = if with_also {
                &[PROXY_ERROR_HEADER, ORIG_PROTO_HEADER]
            } else {
                &[]
            };
            let mut expected = h.clone();
            strip_as_before(&mut expected, keep_upgrade, also);
            let hpack = if over_http2 { Hpack::Used } else { Hpack::Unused };
            let seen = strip(&mut h, keep_upgrade, also, hpack);
            proptest::prop_assert_eq!(&h, &expected);
            for (name, value) in &h {
                let marked = over_http2
                    && (*name == header::DATE || *name == "x-request-id")
                    && value.len() >= SHORTEST_PER_MESSAGE_VALUE;
                proptest::prop_assert_eq!(value.is_sensitive(), marked, "{}", name);
            }
            proptest::prop_assert_eq!(seen.date(), h.contains_key(header::DATE));
            proptest::prop_assert_eq!(
                seen.content_length(),
                h.contains_key(header::CONTENT_LENGTH)
            );
        }
    }

    const NAMES: &[&str] = &[
        "connection",
        "transfer-encoding",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "keep-alive",
        "proxy-connection",
        "date",
        "content-length",
        "x-private",
        "close",
        "server",
        "x-request-id",
        PROXY_ERROR,
        ORIG_PROTO,
    ];

    const VALUES: &[&str] = &[
        "keep-alive",
        "Keep-Alive",
        "close",
        "upgrade",
        "Upgrade, x-private",
        "keep-alive, date",
        "x-private,content-length",
        " , ",
        "trailers",
        "websocket",
        "h2c",
        "1",
    ];

    #[test]
    fn mesh_asserted_headers_go_in_every_spelling() {
        let mut h = HeaderMap::new();
        for name in [
            "tether-client-id",
            "tether_client_id",
            "Tether_Client-ID",
            "x-kept",
            "tether_client_idx",
            "l5d-client-id",
            "L5D_CLIENT_ID",
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
    fn orig_proto_values_are_linkerd2_proxys() {
        let v11: http::Uri = "/path".parse().unwrap();
        let abs: http::Uri = "http://web.demo:80/path".parse().unwrap();
        for (version, uri, expected) in [
            (http::Version::HTTP_11, &v11, "HTTP/1.1"),
            (http::Version::HTTP_11, &abs, "HTTP/1.1; absolute-form"),
            (http::Version::HTTP_10, &v11, "HTTP/1.0"),
            (http::Version::HTTP_10, &abs, "HTTP/1.0; absolute-form"),
        ] {
            let orig = OrigProto::of(version, uri);
            assert_eq!(orig.header_value(), expected);
            let mut h = HeaderMap::new();
            h.insert(ORIG_PROTO, orig.header_value());
            assert_eq!(take_orig_proto(&mut h), Some(orig));
            assert!(h.is_empty());
        }
        // The old name is read too, and both always go.
        let mut h = HeaderMap::new();
        h.insert(LEGACY_ORIG_PROTO, HeaderValue::from_static("HTTP/1.1"));
        let legacy = take_orig_proto(&mut h).unwrap();
        assert!(legacy.legacy && legacy.version == http::Version::HTTP_11);
        h.insert(ORIG_PROTO, HeaderValue::from_static("SPDY/3"));
        h.insert(LEGACY_ORIG_PROTO, HeaderValue::from_static("HTTP/1.1"));
        assert_eq!(
            take_orig_proto(&mut h),
            None,
            "an unknown value names no version"
        );
        assert!(h.is_empty());
    }

    #[test]
    fn an_http1_request_carried_over_http2_is_marked() {
        let req = http::Request::get("http://web.demo:80/x?y")
            .version(http::Version::HTTP_10)
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        let orig = OrigProto::of(parts.version, &parts.uri);
        let authority = HopAuthority::new("web.demo:80");
        let h2 = rewrite_for_hop(parts, full(""), &authority, Proto::Http2, Some(orig));
        assert_eq!(h2.version(), http::Version::HTTP_2);
        assert_eq!(h2.headers()[ORIG_PROTO], "HTTP/1.0; absolute-form");
        assert!(!h2.headers().contains_key(LEGACY_ORIG_PROTO));
        // The peer's inbound restores the first hop's form.
        let (mut parts, _) = h2.into_parts();
        let orig = take_orig_proto(&mut parts.headers);
        let h1 = rewrite_for_hop(parts, full(""), &authority, Proto::Http1, orig);
        assert_eq!(h1.version(), http::Version::HTTP_10);
        assert_eq!(h1.uri(), "http://web.demo:80/x?y");
        assert_eq!(h1.headers()[header::HOST], "web.demo:80");
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
