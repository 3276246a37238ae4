//! SIGTERM: stop accepting, finish what is in flight, exit 0.

use std::time::Duration;

use crate::support::*;

#[tokio::test]
async fn sigterm_drains_in_flight_requests() {
    let mut mesh = Mesh::start(&[1500]).await;
    let web = authority("web", 8080);
    let outbound = mesh.outbound();
    let in_flight =
        tokio::spawn(async move { request(outbound, &web, "/", http::Version::HTTP_11).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let status = mesh.client.stop(Duration::from_secs(10)).await.unwrap();
    assert!(status.success(), "proxy exited with {status:?}");
    let answer = in_flight.await.unwrap().unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    // New connections are refused once it stopped.
    assert!(tokio::net::TcpStream::connect(outbound).await.is_err());
}
