//! Diagnostics: is what the control plane serves what the registry says?
//!
//! `endpoints` subscribes to one authority on every replica, the way a
//! proxy does, collects the state each one sends, prints it, and compares
//! the replicas with each other and with the registry directory when one is
//! given. The result is `Ok(false)` when anything differs, so the command
//! can exit non-zero.

use crate::control::ControlAccess;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tether_identity::control::status_chain;

use linkerd2_proxy_api::destination::{
    destination_client::DestinationClient, tls_identity, update, GetDestination,
};
use tether_control::registry::file::read_once;
use tether_core::authority::parse_service_authority;
use tether_core::truncate::{bounded_message, for_log};

/// How long to wait for a replica to answer, and for its stream to go quiet.
const ANSWER: Duration = Duration::from_secs(3);
const QUIET: Duration = Duration::from_millis(300);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub ready: bool,
    pub identity: Option<String>,
    pub zone: Option<String>,
    pub weight: u32,
}

/// One source's view: whether the service exists, and its endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct View {
    pub exists: Option<bool>,
    pub endpoints: BTreeMap<SocketAddr, Row>,
}

impl View {
    fn ready(&self) -> BTreeMap<SocketAddr, Row> {
        self.endpoints
            .iter()
            .filter(|(_, r)| r.ready)
            .map(|(a, r)| (*a, r.clone()))
            .collect()
    }
}

/// What one replica serves for `authority`.
pub async fn replica_view(
    access: &ControlAccess,
    control: &str,
    authority: &str,
) -> Result<View, String> {
    let channel = access.channel(control).await?;
    let mut client = DestinationClient::new(channel);
    let req = GetDestination {
        path: authority.to_string(),
        ..Default::default()
    };
    let mut stream = tokio::time::timeout(ANSWER, client.get(req))
        .await
        .map_err(|_| "no answer".to_string())?
        .map_err(|s| format!("{:?}: {}", s.code(), bounded_message(status_chain(&s))))?
        .into_inner();
    let mut view = View::default();
    let mut wait = ANSWER;
    loop {
        let msg = match tokio::time::timeout(wait, stream.message()).await {
            Err(_) if view.exists.is_some() => return Ok(view),
            Err(_) => return Err("no update within 3s".into()),
            Ok(Err(s)) => return Err(format!("stream failed: {}", bounded_message(s.message()))),
            Ok(Ok(None)) => return Ok(view),
            Ok(Ok(Some(m))) => m,
        };
        wait = QUIET;
        match msg.update {
            Some(update::Update::Add(set)) => {
                view.exists = Some(true);
                for wa in set.addrs {
                    let Some(addr) = wa.addr else { continue };
                    let (Some(ip), Ok(port)) = (addr.ip, u16::try_from(addr.port)) else {
                        continue;
                    };
                    let Ok(ip) = std::net::IpAddr::try_from(ip) else {
                        continue;
                    };
                    let identity = wa.tls_identity.and_then(|t| match t.strategy {
                        Some(tls_identity::Strategy::DnsLikeIdentity(d)) => Some(d.name),
                        _ => None,
                    });
                    view.endpoints.insert(
                        SocketAddr::new(ip, port),
                        Row {
                            ready: true,
                            identity,
                            zone: wa.metric_labels.get("zone").cloned(),
                            weight: wa.weight,
                        },
                    );
                }
            }
            Some(update::Update::Remove(set)) => {
                for a in set.addrs {
                    if let (Some(ip), Ok(port)) = (a.ip, u16::try_from(a.port)) {
                        if let Ok(ip) = std::net::IpAddr::try_from(ip) {
                            view.endpoints.remove(&SocketAddr::new(ip, port));
                        }
                    }
                }
            }
            Some(update::Update::NoEndpoints(n)) => {
                view.endpoints.clear();
                view.exists = Some(n.exists);
            }
            None => {}
        }
    }
}

/// What the registry directory says about `authority` (ready or not).
pub fn registry_view(
    dir: &Path,
    authority: &str,
    cluster_domain: &str,
) -> anyhow::Result<(View, Vec<String>)> {
    let auth = parse_service_authority(authority, cluster_domain)?;
    let (services, rejected) = read_once(dir)?;
    let mut view = View::default();
    if let Some(svc) = services.get(&auth.service) {
        if svc.ports.iter().any(|p| p.port == auth.port) {
            view.exists = Some(true);
            for ep in svc
                .endpoints
                .iter()
                .filter(|e| e.port.is_none_or(|p| p == auth.port))
            {
                view.endpoints.insert(
                    ep.address,
                    Row {
                        ready: ep.ready,
                        identity: ep.identity.as_deref().map(String::from),
                        zone: ep.zone.as_deref().map(String::from),
                        weight: ep.weight,
                    },
                );
            }
        } else {
            view.exists = Some(false);
        }
    } else {
        view.exists = Some(false);
    }
    Ok((view, rejected))
}

fn print_view(name: &str, view: &View) {
    let exists = match view.exists {
        Some(true) => "service exists",
        Some(false) => "service unknown",
        None => "no answer",
    };
    println!("{name}: {exists}, {} endpoints", view.endpoints.len());
    if view.endpoints.is_empty() {
        return;
    }
    println!(
        "  {:<24} {:<6} {:<56} {:<10} {:>6}",
        "ADDRESS", "READY", "IDENTITY", "ZONE", "WEIGHT"
    );
    // Replicas may be any control plane: what they send is cut short.
    let shown = |value: &Option<String>| value.as_deref().map_or("-".into(), bounded_message);
    for (addr, r) in &view.endpoints {
        println!(
            "  {:<24} {:<6} {:<56} {:<10} {:>6}",
            addr.to_string(),
            if r.ready { "yes" } else { "no" },
            shown(&r.identity),
            shown(&r.zone),
            r.weight
        );
    }
}

/// A row for a difference line, values cut short.
fn describe(row: &Row) -> String {
    let opt = |v: &Option<String>| {
        v.as_deref()
            .map_or("-".to_string(), |v| for_log(v).to_string())
    };
    format!(
        "ready={} identity={} zone={} weight={}",
        row.ready,
        opt(&row.identity),
        opt(&row.zone),
        row.weight
    )
}

/// The differences between two views of ready endpoints, one per line.
pub fn differences(a_name: &str, a: &View, b_name: &str, b: &View) -> Vec<String> {
    let mut out = Vec::new();
    let (ra, rb) = (a.ready(), b.ready());
    let addrs: BTreeSet<&SocketAddr> = ra.keys().chain(rb.keys()).collect();
    for addr in addrs {
        match (ra.get(addr), rb.get(addr)) {
            (Some(_), None) => out.push(format!("{addr}: served by {a_name}, not by {b_name}")),
            (None, Some(_)) => out.push(format!("{addr}: served by {b_name}, not by {a_name}")),
            (Some(x), Some(y)) if x != y => out.push(format!(
                "{addr}: {a_name} says {}, {b_name} says {}",
                describe(x),
                describe(y)
            )),
            _ => {}
        }
    }
    if ra.is_empty() && rb.is_empty() && a.exists != b.exists {
        out.push(format!(
            "{a_name} says exists={:?}, {b_name} says exists={:?}",
            a.exists, b.exists
        ));
    }
    out
}

/// Prints every view and their differences; `Ok(true)` when all agree.
pub async fn endpoints(
    access: &ControlAccess,
    authority: &str,
    controls: &[String],
    registry: Option<&PathBuf>,
    cluster_domain: &str,
) -> anyhow::Result<bool> {
    anyhow::ensure!(!controls.is_empty(), "give at least one --control address");
    let mut views = Vec::new();
    let mut agree = true;
    for control in controls {
        let name = format!("replica {control}");
        match replica_view(access, control, authority).await {
            Ok(view) => {
                print_view(&name, &view);
                views.push((name, view));
            }
            Err(e) => {
                println!("{name}: {e}");
                agree = false;
            }
        }
    }
    if let Some(dir) = registry {
        let (view, rejected) = registry_view(dir, authority, cluster_domain)?;
        let name = format!("registry {}", dir.display());
        print_view(&name, &view);
        for r in rejected {
            println!("  {r}");
        }
        views.push((name, view));
    }
    println!();
    let mut diffs = Vec::new();
    if let Some(((first_name, first), rest)) = views.split_first() {
        for (name, view) in rest {
            diffs.extend(differences(first_name, first, name, view));
        }
    }
    if diffs.is_empty() && agree {
        println!("all {} views agree", views.len());
    } else {
        agree = false;
        println!("differences:");
        for d in diffs {
            println!("  {d}");
        }
    }
    Ok(agree)
}

/// Prints every replica's metrics, headed by replica; `Ok(false)` if any
/// replica could not be read.
pub async fn controller_metrics(
    access: &ControlAccess,
    controls: &[String],
    filter: Option<&str>,
) -> anyhow::Result<bool> {
    anyhow::ensure!(!controls.is_empty(), "give at least one --control address");
    let mut all_ok = true;
    for control in controls {
        let fetched = async {
            let channel = access.channel(control).await?;
            tether_control::diagnostics::fetch_metrics(channel)
                .await
                .map_err(|s| format!("{:?}: {}", s.code(), status_chain(&s)))
        };
        match tokio::time::timeout(ANSWER * 2, fetched).await {
            Ok(Ok(m)) => {
                println!("=== replica {control} (tether {}) ===", m.version);
                for line in m.text.lines() {
                    if filter.is_none_or(|f| line.contains(f)) {
                        println!("{line}");
                    }
                }
            }
            Ok(Err(e)) => {
                all_ok = false;
                println!("=== replica {control}: {e} ===");
            }
            Err(_) => {
                all_ok = false;
                println!("=== replica {control}: timed out ===");
            }
        }
        println!();
    }
    Ok(all_ok)
}
