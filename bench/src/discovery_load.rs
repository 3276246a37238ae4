//! The subscriber side of `bench/discovery`, run as its own process:
//! opens M `Destination.Get` streams over real gRPC, spread over the given
//! authorities, and measures for every `Add` it receives the time since the
//! registry change (the driver stamps each new endpoint's `zone` with the
//! wall-clock time of the write). Prints `subscribed` once every stream has
//! its initial state, and a JSON summary at the end, with a digest of each
//! subscriber's final endpoint set (counted per authority and digest) so
//! the driver can check that every subscriber converged on the registry.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use hdrhistogram::Histogram;
use linkerd2_proxy_api::destination::{
    destination_client::DestinationClient, update, GetDestination,
};

/// Streams per HTTP/2 connection (servers commonly allow ~200).
const STREAMS_PER_CONNECTION: usize = 100;

fn socket_addr(a: &linkerd2_proxy_api::net::TcpAddress) -> Option<SocketAddr> {
    let ip = std::net::IpAddr::try_from(a.ip?).ok()?;
    Some(SocketAddr::new(ip, u16::try_from(a.port).ok()?))
}

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let control = args
        .next()
        .context("usage: discovery-load CONTROL SUBSCRIBERS SECONDS AUTHORITY...")?;
    let subscribers: usize = args.next().context("SUBSCRIBERS")?.parse()?;
    let seconds: f64 = args.next().context("SECONDS")?.parse()?;
    let authorities: Vec<String> = args.collect();
    anyhow::ensure!(!authorities.is_empty(), "no authorities");

    let latency = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1,
        120_000_000,
        3,
    )?));
    let received = Arc::new(AtomicU64::new(0));
    let initial = Arc::new(AtomicUsize::new(0));
    // Each subscriber's current endpoint set, as its updates leave it.
    let views: Vec<Arc<Mutex<BTreeSet<SocketAddr>>>> =
        (0..subscribers).map(|_| Arc::default()).collect();
    let mut channels = Vec::new();
    for _ in 0..subscribers.div_ceil(STREAMS_PER_CONNECTION) {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{control}"))?
            .connect()
            .await
            .context("connecting to the control plane")?;
        channels.push(ch);
    }
    for i in 0..subscribers {
        let mut client = DestinationClient::new(channels[i / STREAMS_PER_CONNECTION].clone());
        let path = authorities[i % authorities.len()].clone();
        let (latency, received, initial, view) = (
            latency.clone(),
            received.clone(),
            initial.clone(),
            views[i].clone(),
        );
        tokio::spawn(async move {
            let req = GetDestination {
                path,
                ..Default::default()
            };
            let Ok(rsp) = client.get(req).await else {
                return;
            };
            let mut stream = rsp.into_inner();
            let mut first = true;
            while let Ok(Some(msg)) = stream.message().await {
                {
                    let mut view = view.lock().unwrap();
                    match &msg.update {
                        Some(update::Update::Add(set)) => {
                            view.extend(
                                set.addrs
                                    .iter()
                                    .filter_map(|a| socket_addr(a.addr.as_ref()?)),
                            );
                        }
                        Some(update::Update::Remove(set)) => {
                            for a in set.addrs.iter().filter_map(socket_addr) {
                                view.remove(&a);
                            }
                        }
                        Some(update::Update::NoEndpoints(_)) => view.clear(),
                        None => {}
                    }
                }
                if first {
                    first = false;
                    initial.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                received.fetch_add(1, Ordering::Relaxed);
                if let Some(update::Update::Add(set)) = msg.update {
                    let now = now_nanos();
                    let mut h = latency.lock().unwrap();
                    for wa in set.addrs {
                        let stamp = wa
                            .metric_labels
                            .get("zone")
                            .and_then(|z| z.strip_prefix('t')?.parse::<u64>().ok());
                        if let Some(t) = stamp {
                            let _ = h.record((now.saturating_sub(t) / 1000).max(1));
                        }
                    }
                }
            }
        });
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while initial.load(Ordering::SeqCst) < subscribers {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "subscribers not all answered within 60s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("subscribed");
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    let h = latency.lock().unwrap().clone();
    // authority -> digest of the final view -> subscribers holding it.
    let mut finals: BTreeMap<&str, BTreeMap<String, usize>> = BTreeMap::new();
    for (i, view) in views.iter().enumerate() {
        let digest = tether_bench::endpoints_digest(view.lock().unwrap().iter());
        *finals
            .entry(authorities[i % authorities.len()].as_str())
            .or_default()
            .entry(format!("{digest:016x}"))
            .or_default() += 1;
    }
    let q = |q: f64| {
        if h.is_empty() {
            0.0
        } else {
            h.value_at_quantile(q) as f64 / 1000.0
        }
    };
    println!(
        "{}",
        serde_json::json!({
            "subscribers": subscribers,
            "updates_received": received.load(Ordering::Relaxed),
            "adds_timed": h.len(),
            "p50_ms": q(0.5),
            "p99_ms": q(0.99),
            "max_ms": h.max() as f64 / 1000.0,
            "final_views": finals,
        })
    );
    Ok(())
}
