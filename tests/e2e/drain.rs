//! SIGTERM: stop accepting, finish what is in flight, exit 0.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::support::*;

/// An HTTP/1 app that holds each request until released.
struct HeldApp {
    addr: SocketAddr,
    /// Notified when a request has arrived.
    received: Arc<Notify>,
    /// Lets one held request be answered.
    release: Arc<Notify>,
}

async fn held_app() -> HeldApp {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (received, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (r, l) = (received.clone(), release.clone());
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let (r, l) = (r.clone(), l.clone());
            let svc = hyper::service::service_fn(move |_req| {
                let (r, l) = (r.clone(), l.clone());
                async move {
                    r.notify_one();
                    l.notified().await;
                    Ok::<_, std::convert::Infallible>(http::Response::new(
                        http_body_util::Full::new(bytes::Bytes::from_static(b"done")),
                    ))
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(conn), svc),
            );
        }
    });
    HeldApp {
        addr,
        received,
        release,
    }
}

#[tokio::test]
async fn sigterm_refuses_new_connections_while_it_finishes_in_flight_requests() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let control = scratch.control().await;
    let app = held_app().await;
    scratch.endpoint("web-0", "web", app.addr, false);
    let drain = Duration::from_secs(30);
    let mut client = scratch
        .proxy(
            "client",
            control.addr("grpc"),
            None,
            &["--drain-timeout", &drain.as_secs().to_string()],
        )
        .await;
    let outbound = client.addr("outbound");
    let web = authority("web", 8080);
    let in_flight =
        tokio::spawn(async move { request(outbound, &web, "/", http::Version::HTTP_11).await });
    tokio::time::timeout(Duration::from_secs(10), app.received.notified())
        .await
        .expect("the request never reached the app");

    let stopping = tokio::spawn(async move { client.stop(drain * 2).await });
    // While the request is still held: new connections are refused.
    assert!(
        eventually(Duration::from_secs(5), || async {
            tokio::net::TcpStream::connect(outbound).await.is_err()
        })
        .await,
        "the draining proxy still accepts connections"
    );
    assert!(!in_flight.is_finished() && !stopping.is_finished());

    // Released, the request is answered and the proxy exits cleanly.
    app.release.notify_one();
    let answer = in_flight.await.unwrap().unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body, "done");
    let status = stopping.await.unwrap().unwrap();
    assert!(status.success(), "proxy exited with {status:?}");
}
