//! The listeners' HTTP server against hostile clients, over real sockets
//! and raw HTTP/2 frames: what a client that does not play along can make
//! the server hold or do stays bounded, whichever server drives the
//! connection.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::{serve_http, Conn, ServeConfig, ServeLimits};
use crate::metrics::ProxyMetrics;

/// Bounds every wait: far past the configured timeouts below on a
/// loaded machine, reached only when the awaited event never comes.
const WAIT: Duration = Duration::from_secs(20);

async fn empty_answer<B>(_req: http::Request<B>) -> http::Response<crate::http::Body> {
    http::Response::new(crate::http::empty())
}

/// What the service answers every request with.
enum Answer {
    Empty,
    /// 256 KiB: past a client's default flow-control window.
    Big,
    /// [`panicky`]'s.
    Panicky,
    /// At once, while a task reads the request's body and sends how many
    /// bytes it read.
    Early(tokio::sync::mpsc::Sender<usize>),
}

/// A listener for one client connection, served by `serve_http` with
/// `config` and `drain_timeout`: its address, the serving, to be run
/// beside the client in the test's task (spawned, `serve_http` trips
/// rustc's higher-ranked inference), and the sender that drains it.
async fn serve_one(
    config: ServeConfig,
    drain_timeout: Duration,
    answer: Answer,
) -> (
    std::net::SocketAddr,
    impl std::future::Future<Output = ()>,
    watch::Sender<bool>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ServeConfig {
        max_connections: Some(4),
        ..config
    };
    let limits = ServeLimits::new(&config, drain_timeout, ProxyMetrics::default());
    let (drain_tx, drain) = watch::channel(false);
    let server = async move {
        let (stream, _) = listener.accept().await.unwrap();
        let conn = Conn {
            drain,
            _permit: limits.connections.clone().try_acquire_owned().unwrap(),
            limits,
            direction: "test",
            socket: Some(std::os::fd::AsRawFd::as_raw_fd(&stream)),
        };
        match answer {
            Answer::Empty => serve_http(stream, empty_answer, conn).await,
            Answer::Big => serve_http(stream, big_answer, conn).await,
            Answer::Panicky => serve_http(stream, panicky, conn).await,
            Answer::Early(read) => {
                let answer = move |req| early_answer(req, read.clone());
                serve_http(stream, answer, conn).await
            }
        }
    };
    (addr, server, drain_tx)
}

async fn early_answer(
    req: http::Request<super::RequestBody>,
    read: tokio::sync::mpsc::Sender<usize>,
) -> http::Response<crate::http::Body> {
    tokio::spawn(async move {
        use http_body_util::BodyExt;
        let mut body = req.into_body();
        let mut bytes = 0;
        // To its end as a sender reads it: hyper's last chunk comes before
        // the end of the body is known to the reader.
        while !hyper::body::Body::is_end_stream(&body) {
            match body.frame().await {
                Some(Ok(frame)) => bytes += frame.data_ref().map_or(0, |d| d.len()),
                _ => break,
            }
        }
        let _ = read.send(bytes).await;
    });
    http::Response::new(crate::http::empty())
}

/// An upload the app answers before it has all of it: the connection
/// reads the rest, though past the header-read timeout with no response
/// in flight (the wait for a head, which that timeout bounds, has not
/// begun).
#[tokio::test]
async fn an_http1_body_still_coming_after_its_response_is_read_to_its_end() {
    let config = ServeConfig {
        header_read_timeout: Duration::from_secs(1),
        ..ServeConfig::default()
    };
    let started = std::time::Instant::now();
    let (read_tx, mut read) = tokio::sync::mpsc::channel(1);
    let (addr, server, _drain) = serve_one(config, WAIT, Answer::Early(read_tx)).await;
    let client = async {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 12\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 256];
        let n = tokio::time::timeout(WAIT, conn.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
        // Three seconds of body after the response: past one and two
        // header-read timeouts.
        for _ in 0..12 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            conn.write_all(b"x").await.unwrap();
        }
        let bytes = tokio::time::timeout(WAIT, read.recv()).await.unwrap();
        assert_eq!(bytes, Some(12), "the body was cut");
    };
    tokio::select! {
        _ = server => panic!("the connection ended before its body, at {:?}", started.elapsed()),
        _ = client => {}
    }
}

async fn big_answer<B>(_req: http::Request<B>) -> http::Response<crate::http::Body> {
    http::Response::new(crate::http::full(vec![0u8; 256 * 1024]))
}

/// An HTTP/2 client that sends its preface and SETTINGS, then answers
/// nothing (no SETTINGS ack, no PING ack) and sends no request: once idle,
/// the server's graceful GOAWAY waits for a PING round trip that never
/// ends. The connection (and its place under the connection cap) is
/// released within the drain timeout all the same.
#[tokio::test]
async fn an_idle_http2_client_that_ignores_the_goaway_is_closed() {
    let config = ServeConfig {
        idle_timeout: Duration::from_millis(100),
        ..ServeConfig::default()
    };
    let (addr, server, _drain) = serve_one(config, Duration::from_millis(500), Answer::Empty).await;
    let client = async {
        let mut client = TcpStream::connect(addr).await.unwrap();
        let hello = client_hello(&[]);
        client.write_all(&hello).await.unwrap();
        // What the server sends is read (so it is never stuck writing)
        // and ignored, until it closes.
        let mut buf = [0u8; 4096];
        while let Ok(1..) = client.read(&mut buf).await {}
    };
    let closed = tokio::time::timeout(WAIT, async { tokio::join!(server, client) }).await;
    assert!(closed.is_ok(), "the server still holds the connection");
}

/// An HTTP/2 connection whose response is still being read when the idle
/// timeout first passes is closed once it has been idle that long after
/// the response's end: the idle clock waits for the request (woken when
/// the in-flight count goes back to zero), then runs again. The server
/// polls its idle clock and drain signal only when they wake it.
#[tokio::test]
async fn an_http2_connection_is_closed_once_idle_after_its_response() {
    // The stall limit is the idle timeout too: a reader held up by a busy
    // machine for a few chunks' pauses must not look stalled.
    let config = ServeConfig {
        idle_timeout: Duration::from_millis(300),
        ..ServeConfig::default()
    };
    let (addr, server, _drain) = serve_one(config, Duration::from_millis(500), Answer::Big).await;
    let client = async {
        let io = TcpStream::connect(addr).await.unwrap();
        let (send, conn) = h2::client::handshake(io).await.unwrap();
        let conn = tokio::spawn(conn);
        let mut send = send.ready().await.unwrap();
        let get = http::Request::get("http://a/").body(()).unwrap();
        let (rsp, _) = send.send_request(get, true).unwrap();
        let mut body = rsp.await.unwrap().into_body();
        // Read slowly (each chunk's window given back well within the
        // stall limit, the whole, 16 frames of 16 KiB, past the idle
        // timeout): in flight all along.
        let mut read = 0;
        while let Some(data) = body.data().await {
            let data = data.unwrap();
            read += data.len();
            tokio::time::sleep(Duration::from_millis(25)).await;
            body.flow_control().release_capacity(data.len()).unwrap();
        }
        assert_eq!(read, 256 * 1024);
        // Closed by the server (this side still holds `send`).
        let _ = conn.await.unwrap();
        drop(send);
    };
    let closed = tokio::time::timeout(WAIT, async { tokio::join!(server, client) }).await;
    assert!(closed.is_ok(), "the server still holds the connection");
}

/// What an HTTP/2 client sends first: the preface, then its SETTINGS
/// frame carrying `settings`.
fn client_hello(settings: &[u8]) -> Vec<u8> {
    let mut hello = crate::detect::H2_PREFACE.to_vec();
    hello.extend(frame(SETTINGS, 0, 0, settings));
    hello
}

/// SETTINGS_INITIAL_WINDOW_SIZE 0: no stream may be sent a byte of DATA.
const NO_WINDOW: [u8; 6] = [0x00, 0x04, 0, 0, 0, 0];

/// An HTTP/2 frame: 9-byte header (length, type, flags, stream), payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

const HEADERS: u8 = 0x1;
const SETTINGS: u8 = 0x4;
const RST_STREAM: u8 = 0x3;
const GOAWAY: u8 = 0x7;
const END_STREAM_AND_HEADERS: u8 = 0x5;
const CANCEL: u32 = 0x8;
const ENHANCE_YOUR_CALM: u32 = 0xb;

/// HPACK for `GET http://a/`: indexed `:method GET`, `:scheme http`,
/// `:path /`, then `:authority a` as a literal.
const GET: [u8; 6] = [0x82, 0x86, 0x84, 0x01, 0x01, b'a'];

/// A header literal without indexing, with a new name.
fn literal(name: &str, value: &str) -> Vec<u8> {
    let mut b = vec![0x00, name.len() as u8];
    b.extend(name.as_bytes());
    b.push(value.len() as u8);
    b.extend(value.as_bytes());
    b
}

/// One client connection served by `serve_http`, with a raw client that
/// sends the preface, SETTINGS and `sent`, then reads what the server
/// says until it sends GOAWAY, or HEADERS on stream `last`, or closes:
/// the frames read (type, stream, and the error code of a RST_STREAM or
/// GOAWAY).
async fn frames_answering(sent: Vec<u8>, last: u32) -> Vec<(u8, u32, Option<u32>)> {
    let (addr, server, _drain) = serve_one(ServeConfig::default(), WAIT, Answer::Empty).await;
    let client = async {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut read, mut write) = stream.into_split();
        let mut hello = client_hello(&[]);
        hello.extend(sent);
        // Written beside the reads: the server's answers must not wait
        // for the whole of it.
        let writing = async move {
            let _ = write.write_all(&hello).await;
            write
        };
        let reading = async {
            let mut frames = Vec::new();
            while let Some(f) = next_frame(&mut read).await {
                frames.push(f);
                if f.0 == GOAWAY || (f.0 == HEADERS && f.1 == last) {
                    break;
                }
            }
            frames
        };
        // The write half stays open until the reading ends.
        let (_write, frames) = tokio::join!(writing, reading);
        frames
    };
    let answered = tokio::time::timeout(WAIT, async { tokio::join!(server, client).1 });
    answered.await.expect("the server answers, then closes")
}

/// Rapid reset (CVE-2023-44487): streams opened and reset at once, in a
/// loop, cost the server their setup while never counting as concurrent.
/// Past h2's bound on streams reset before they are accepted (hyper's
/// setting, h2's default of 20), the connection is closed with
/// ENHANCE_YOUR_CALM.
#[tokio::test]
async fn a_rapid_reset_flood_closes_the_connection() {
    let mut sent = Vec::new();
    for i in 0..200u32 {
        let id = 2 * i + 1;
        sent.extend(frame(HEADERS, END_STREAM_AND_HEADERS, id, &GET));
        sent.extend(frame(RST_STREAM, 0, id, &CANCEL.to_be_bytes()));
    }
    let frames = frames_answering(sent, 0).await;
    assert_eq!(
        frames.last().map(|&(kind, _, code)| (kind, code)),
        Some((GOAWAY, Some(ENHANCE_YOUR_CALM))),
        "{frames:?}"
    );
}

/// Requests HTTP/2 forbids never reach the service (h2 resets their
/// streams): a connection-specific header, `te` other than `trailers`,
/// extended CONNECT (`:protocol`, not enabled). A client that sends them
/// in a loop makes the server reset a stream each time; past hyper's
/// bound (1024 such resets) the connection is closed with
/// ENHANCE_YOUR_CALM.
#[tokio::test]
async fn malformed_requests_are_refused_and_a_flood_of_them_closes_the_connection() {
    let with = |extra: Vec<u8>| [GET.to_vec(), extra].concat();
    let connect = [
        vec![0x02, 7],
        b"CONNECT".to_vec(),
        literal(":protocol", "websocket"),
        vec![0x86, 0x84, 0x01, 0x01, b'a'],
    ]
    .concat();
    let malformed = [
        with(literal("connection", "x")),
        with(literal("te", "gzip")),
        connect,
    ];
    // Each once, then a well-formed request: only that one is answered.
    let mut sent = Vec::new();
    let mut id = 1u32;
    for block in &malformed {
        sent.extend(frame(HEADERS, END_STREAM_AND_HEADERS, id, block));
        id += 2;
    }
    sent.extend(frame(HEADERS, END_STREAM_AND_HEADERS, id, &GET));
    let frames = frames_answering(sent, id).await;
    let answered: Vec<_> = frames.iter().filter(|f| f.0 == HEADERS).collect();
    assert_eq!(answered, [&(HEADERS, id, None)], "{frames:?}");
    // A flood of them.
    let mut sent = Vec::new();
    for (i, block) in malformed.iter().cycle().take(1100).enumerate() {
        sent.extend(frame(
            HEADERS,
            END_STREAM_AND_HEADERS,
            2 * i as u32 + 1,
            block,
        ));
    }
    let frames = frames_answering(sent, 0).await;
    assert!(!frames.iter().any(|f| f.0 == HEADERS), "{frames:?}");
    assert_eq!(
        frames.last().map(|&(kind, _, code)| (kind, code)),
        Some((GOAWAY, Some(ENHANCE_YOUR_CALM))),
        "{} frames",
        frames.len()
    );
}

/// The next frame from the server: its type, stream and (RST_STREAM,
/// GOAWAY) error code; `None` once the connection ends.
async fn next_frame(read: &mut (impl AsyncReadExt + Unpin)) -> Option<(u8, u32, Option<u32>)> {
    let mut head = [0u8; 9];
    read.read_exact(&mut head).await.ok()?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & !(1 << 31);
    let mut payload = vec![0u8; len];
    read.read_exact(&mut payload).await.ok()?;
    let code = match head[3] {
        RST_STREAM => Some(u32::from_be_bytes(payload[..4].try_into().unwrap())),
        GOAWAY => Some(u32::from_be_bytes(payload[4..8].try_into().unwrap())),
        _ => None,
    };
    Some((head[3], stream, code))
}

/// A client that gives no flow-control window (SETTINGS_INITIAL_WINDOW_SIZE
/// 0, no WINDOW_UPDATE) gets its response's HEADERS and no data; when it
/// resets the stream, the response (and what it holds upstream) is let
/// go: drained, the connection has nothing in flight any more and, this
/// client answering no PING, is cut. Held, the response would keep it
/// open (past the test's wait, the idle timeout being the default).
#[tokio::test]
async fn a_stuck_response_reset_by_its_client_is_let_go() {
    let (addr, server, drain) = serve_one(
        ServeConfig::default(),
        Duration::from_millis(200),
        Answer::Big,
    )
    .await;
    let client = async {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut read, mut write) = stream.into_split();
        let mut hello = client_hello(&NO_WINDOW);
        hello.extend(frame(HEADERS, END_STREAM_AND_HEADERS, 1, &GET));
        write.write_all(&hello).await.unwrap();
        let mut seen = Vec::new();
        loop {
            let f = next_frame(&mut read).await;
            seen.push(f);
            match f {
                Some((HEADERS, 1, _)) => break,
                None => panic!("closed with the response in flight: {seen:?}"),
                Some(_) => {}
            }
        }
        write
            .write_all(&frame(RST_STREAM, 0, 1, &CANCEL.to_be_bytes()))
            .await
            .unwrap();
        drain.send(true).unwrap();
        while let Some(f) = next_frame(&mut read).await {
            seen.push(Some(f));
        }
        assert!(
            !seen.iter().flatten().any(|f| f.0 == 0x0 && f.1 == 1),
            "no DATA without a window: {seen:?}"
        );
    };
    tokio::time::timeout(WAIT, async { tokio::join!(server, client) })
        .await
        .expect("the reset response is let go and the connection closes");
}

/// A client that opens streams and gives their responses no window (and
/// never resets them) would hold each response, and the app connection
/// behind it, for good: any pod could pin every connection of the
/// inbound's pool to its app with one connection of 100 such streams. A
/// response that gets no window for the idle timeout is reset (CANCEL) and
/// let go, so the connection then idles out and is cut.
#[tokio::test]
async fn a_response_given_no_window_is_reset_after_the_idle_timeout() {
    let config = ServeConfig {
        idle_timeout: Duration::from_millis(100),
        ..ServeConfig::default()
    };
    let (addr, server, _drain) = serve_one(config, Duration::from_millis(200), Answer::Big).await;
    let client = async {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut read, mut write) = stream.into_split();
        let mut hello = client_hello(&NO_WINDOW);
        hello.extend(frame(HEADERS, END_STREAM_AND_HEADERS, 1, &GET));
        write.write_all(&hello).await.unwrap();
        let mut seen = Vec::new();
        while let Some(f) = next_frame(&mut read).await {
            seen.push(f);
        }
        assert!(
            seen.contains(&(RST_STREAM, 1, Some(CANCEL))),
            "the stuck response is reset: {seen:?}"
        );
        drop(write);
    };
    tokio::time::timeout(WAIT, async { tokio::join!(server, client) })
        .await
        .expect("the stuck response is let go and the connection closes");
}

/// Lets [`panicky`]'s slow requests answer.
static RELEASE: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Panics on `/panic` (a bug in one request's handling); answers any
/// other request once [`RELEASE`]d.
async fn panicky<B>(req: http::Request<B>) -> http::Response<crate::http::Body> {
    if req.uri().path() == "/panic" {
        panic!("a bug in the handling of one request");
    }
    RELEASE.notified().await;
    http::Response::new(crate::http::empty())
}

/// A request whose handling panics (a bug) fails alone: the other streams
/// of its connection (for the inbound, every request in flight from one
/// peer proxy) are still answered. The release build keeps panics
/// unwinding for that.
#[tokio::test]
async fn a_panicking_request_fails_alone() {
    use futures::FutureExt;
    let (addr, server, _drain) = serve_one(ServeConfig::default(), WAIT, Answer::Panicky).await;
    let server = std::panic::AssertUnwindSafe(server).catch_unwind();
    let client = async {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut read, mut write) = stream.into_split();
        let path = |p: &str| {
            [
                vec![0x82, 0x86, 0x04, p.len() as u8],
                p.as_bytes().to_vec(),
                vec![0x01, 0x01, b'a'],
            ]
            .concat()
        };
        let mut hello = client_hello(&[]);
        hello.extend(frame(HEADERS, END_STREAM_AND_HEADERS, 1, &path("/slow")));
        hello.extend(frame(HEADERS, END_STREAM_AND_HEADERS, 3, &path("/panic")));
        write.write_all(&hello).await.unwrap();
        let mut seen = Vec::new();
        // Until the panicking stream is reset.
        loop {
            let f = next_frame(&mut read).await;
            seen.push(f);
            match f {
                Some((RST_STREAM, 3, _)) => break,
                Some((GOAWAY, ..)) | None => panic!("the connection ended: {seen:?}"),
                Some(_) => {}
            }
        }
        RELEASE.notify_one();
        loop {
            let f = next_frame(&mut read).await;
            seen.push(f);
            match f {
                Some((HEADERS, 1, _)) => break,
                Some((GOAWAY, ..)) | None => panic!("the connection ended: {seen:?}"),
                Some(_) => {}
            }
        }
    };
    let served = tokio::time::timeout(WAIT, async {
        tokio::select! {
            served = server => served.is_ok(),
            () = client => true,
        }
    })
    .await
    .expect("the other stream is answered");
    assert!(served, "a panic in one stream took its whole connection");
}
