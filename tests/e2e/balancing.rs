//! Latency-aware balancing: peak-EWMA with power of two choices.

use crate::support::*;

/// The fast endpoint's added latency.
const FAST_MS: u32 = 1;
/// The slow endpoint's, a thousand times more. Peak-EWMA takes any slower
/// answer as an endpoint's latency at once and forgets it over seconds. On
/// a loaded machine a request to the fast endpoint can stall for tens of
/// milliseconds in the run queue; against a 50 ms endpoint one such stall
/// made the fast endpoint look slower, and every later answer of the slow
/// one (about 50 ms) kept it so for the rest of the test (CI saw it). Now
/// a stall must approach a second to cost even one request.
const SLOW_MS: u32 = 1000;

#[tokio::test]
async fn most_requests_go_to_the_fast_endpoint() {
    let mesh = Mesh::start(&[FAST_MS, SLOW_MS]).await;
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
    let (total, at_least) = (100, 80);
    let (mut fast, mut slow) = (0, 0);
    // A balancer that ignores latency fails by sending the slow endpoint
    // more than it may have: stop there rather than wait a second for
    // each of the rest.
    while fast + slow < total && slow <= total - at_least {
        let a = get(mesh.outbound(), &web).await;
        assert_eq!(a.status, 200, "{}", a.body);
        match a.replica() {
            "web-0" => fast += 1,
            _ => slow += 1,
        }
    }
    assert!(
        fast >= at_least,
        "{slow} requests went to the {SLOW_MS} ms endpoint, {fast} to the {FAST_MS} ms one"
    );
}
