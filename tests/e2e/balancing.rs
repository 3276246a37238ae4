//! Latency-aware balancing: peak-EWMA with power of two choices.

use crate::support::*;

#[tokio::test]
async fn most_requests_go_to_the_fast_endpoint() {
    let mesh = Mesh::start(&[1, 50]).await;
    let web = authority("web", 8080);
    // Judge only once both endpoints are in the balancer: until then every
    // request goes to the one known, which would pass for free.
    assert!(
        eventually(std::time::Duration::from_secs(10), || async {
            get(mesh.outbound(), &web).await.replica() == "web-1"
        })
        .await,
        "the slow endpoint was never used"
    );
    let mut fast = 0;
    let total = 100;
    for _ in 0..total {
        let a = get(mesh.outbound(), &web).await;
        assert_eq!(a.status, 200, "{}", a.body);
        if a.replica() == "web-0" {
            fast += 1;
        }
    }
    assert!(
        fast >= 80,
        "only {fast} of {total} requests went to the 1 ms endpoint"
    );
}
