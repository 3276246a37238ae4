//! The `tether up` manifest: which services to run (in one cluster, or in
//! several linked clusters), how many replicas, how the demo app behaves,
//! what load to send, and scripted events. Errors name the field.

use serde::{Deserialize, Serialize};
use tether_core::authority::is_dns_label;
use tether_core::registry::MulticlusterMode;

use crate::loadgen::LoadProtocol;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    #[serde(default = "default_domain")]
    pub cluster_domain: String,
    /// The namespace of services that name none.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Services of a single-cluster mesh (or use `clusters`).
    #[serde(default)]
    pub services: Vec<ServiceSpec>,
    /// Several clusters on this machine, each with its own control plane
    /// and gateway, linked to each other.
    #[serde(default)]
    pub clusters: Vec<ClusterSpec>,
    #[serde(default)]
    pub load: Vec<LoadTarget>,
    /// Issue every workload a certificate and require mTLS between proxies.
    #[serde(default = "yes")]
    pub identity: bool,
    /// Scripted events (headless runs): kill or revive a cluster's replicas.
    #[serde(default)]
    pub events: Vec<Event>,
    /// Whether proxies retry idempotent requests (with their default budget).
    #[serde(default = "yes")]
    pub retries: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub name: String,
    pub services: Vec<ServiceSpec>,
    /// Other clusters of this manifest whose global services this one uses.
    #[serde(default)]
    pub links: Vec<LinkSpec>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    pub cluster: String,
    #[serde(default = "one")]
    pub priority: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Event {
    /// Seconds after the load starts.
    pub at: f64,
    /// Stops a cluster's replicas gracefully: not ready first, then gone.
    #[serde(default)]
    pub kill: Option<String>,
    /// Kills a cluster's replicas and their sidecars at once (SIGKILL); the
    /// registry learns `detect_after` seconds later.
    #[serde(default)]
    pub crash: Option<String>,
    #[serde(default)]
    pub detect_after: f64,
    #[serde(default)]
    pub revive: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default = "default_port")]
    pub port: u16,
    #[serde(default = "one")]
    pub replicas: u32,
    /// The demo app's added latency per request, in milliseconds.
    #[serde(default)]
    pub latency_ms: f64,
    /// The fraction of requests the demo app fails, 0 to 1.
    #[serde(default)]
    pub error_rate: f64,
    /// Joins this service with same-id services of other clusters.
    #[serde(default)]
    pub global_id: Option<String>,
    #[serde(default)]
    pub mode: Option<MulticlusterMode>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LoadTarget {
    /// The name of a service in this manifest.
    pub service: String,
    /// The cluster the load runs in (multicluster manifests).
    #[serde(default)]
    pub cluster: Option<String>,
    #[serde(default = "default_rps")]
    pub rps: f64,
    #[serde(default)]
    pub protocol: LoadProtocol,
}

fn default_domain() -> String {
    "cluster.local".into()
}
fn default_namespace() -> String {
    "demo".into()
}
fn default_port() -> u16 {
    8080
}
fn yes() -> bool {
    true
}
fn one() -> u32 {
    1
}
fn default_rps() -> f64 {
    20.0
}

pub const MAX_REPLICAS: u32 = 20;
pub const MAX_RPS: f64 = 5000.0;
pub const MAX_CLUSTERS: usize = 4;

/// The built-in demo: a fast HTTP service and a slower gRPC one with a few
/// errors, both under steady load.
pub const DEMO: &str = r#"
namespace: demo
services:
  - name: web
    replicas: 3
    latency_ms: 2
  - name: api
    replicas: 2
    latency_ms: 10
    error_rate: 0.02
load:
  - service: web
    rps: 40
    protocol: http1
  - service: api
    rps: 20
    protocol: grpc
"#;

/// Two clusters serving one global id under different names and
/// namespaces: `east` fails over to `west` when its replicas die.
pub const MULTICLUSTER_DEMO: &str = r#"
clusters:
  - name: east
    services:
      - name: web
        namespace: shop
        global_id: web-global
        mode: failover
        replicas: 2
        latency_ms: 2
    links:
      - cluster: west
        priority: 1
  - name: west
    services:
      - name: storefront
        namespace: retail
        global_id: web-global
        replicas: 2
        latency_ms: 5
load:
  - cluster: east
    service: web
    rps: 40
events:
  - at: 4
    kill: east
  - at: 8
    revive: east
"#;

#[derive(Debug, thiserror::Error)]
#[error("manifest {source_name}: {message}")]
pub struct ManifestError {
    pub source_name: String,
    pub message: String,
}

impl ServiceSpec {
    pub fn namespace<'a>(&'a self, manifest: &'a Manifest) -> &'a str {
        self.namespace.as_deref().unwrap_or(&manifest.namespace)
    }
}

impl Manifest {
    pub fn demo() -> Self {
        Self::parse(DEMO, "built-in demo").expect("the built-in demo is valid")
    }

    pub fn multicluster_demo() -> Self {
        Self::parse(MULTICLUSTER_DEMO, "built-in multicluster demo")
            .expect("the built-in demo is valid")
    }

    pub fn parse(text: &str, source_name: &str) -> Result<Self, ManifestError> {
        let err = |message: String| ManifestError {
            source_name: source_name.to_string(),
            message,
        };
        let m: Manifest = serde_yaml::from_str(text).map_err(|e| err(e.to_string()))?;
        m.validate().map_err(err)?;
        Ok(m)
    }

    /// The clusters to run: the `clusters` list, or one unnamed cluster
    /// holding `services`.
    pub fn cluster_specs(&self) -> Vec<ClusterSpec> {
        if self.clusters.is_empty() {
            vec![ClusterSpec {
                name: String::new(),
                services: self.services.clone(),
                links: vec![],
            }]
        } else {
            self.clusters.clone()
        }
    }

    fn validate(&self) -> Result<(), String> {
        if !is_dns_label(&self.namespace) {
            return Err(format!(
                "field `namespace`: {:?} is not a valid namespace",
                self.namespace
            ));
        }
        match (self.services.is_empty(), self.clusters.is_empty()) {
            (true, true) => {
                return Err(
                    "field `services`: at least one service is needed (or `clusters`)".into(),
                )
            }
            (false, false) => {
                return Err("fields `services` and `clusters`: give one or the other".into())
            }
            _ => {}
        }
        if self.clusters.len() > MAX_CLUSTERS {
            return Err(format!("field `clusters`: at most {MAX_CLUSTERS}"));
        }
        if !self.clusters.is_empty() && !self.identity {
            return Err("field `identity`: multicluster needs identity (gateways are mTLS)".into());
        }
        for (c, cluster) in self.clusters.iter().enumerate() {
            if !is_dns_label(&cluster.name) {
                return Err(format!(
                    "field `clusters[{c}].name`: {:?} is not a valid name",
                    cluster.name
                ));
            }
            if self.clusters[..c].iter().any(|o| o.name == cluster.name) {
                return Err(format!(
                    "field `clusters[{c}].name`: {:?} is listed twice",
                    cluster.name
                ));
            }
            for (l, link) in cluster.links.iter().enumerate() {
                if !self.clusters.iter().any(|o| o.name == link.cluster)
                    || link.cluster == cluster.name
                {
                    return Err(format!(
                        "field `clusters[{c}].links[{l}].cluster`: {:?} is not another cluster of this manifest",
                        link.cluster
                    ));
                }
                if link.priority == 0 {
                    return Err(format!(
                        "field `clusters[{c}].links[{l}].priority`: must be at least 1"
                    ));
                }
            }
            self.validate_services(&cluster.services, &format!("clusters[{c}].services"))?;
        }
        if self.clusters.is_empty() {
            self.validate_services(&self.services, "services")?;
        }
        for (i, e) in self.events.iter().enumerate() {
            let target = match (&e.kill, &e.crash, &e.revive) {
                (Some(t), None, None) | (None, Some(t), None) | (None, None, Some(t)) => t,
                _ => {
                    return Err(format!(
                        "field `events[{i}]`: give exactly one of `kill`, `crash` or `revive`"
                    ))
                }
            };
            if !(0.0..=60.0).contains(&e.detect_after) {
                return Err(format!(
                    "field `events[{i}].detect_after`: must be 0-60 seconds"
                ));
            }
            if !self.clusters.iter().any(|c| &c.name == target) {
                return Err(format!(
                    "field `events[{i}]`: {target:?} is not a cluster of this manifest"
                ));
            }
            if !(0.0..=3600.0).contains(&e.at) {
                return Err(format!("field `events[{i}].at`: must be 0-3600 seconds"));
            }
        }
        for (i, l) in self.load.iter().enumerate() {
            let services = match (&l.cluster, self.clusters.is_empty()) {
                (None, true) => &self.services,
                (Some(c), false) => match self.clusters.iter().find(|x| &x.name == c) {
                    Some(x) => &x.services,
                    None => {
                        return Err(format!(
                            "field `load[{i}].cluster`: {c:?} is not a cluster of this manifest"
                        ))
                    }
                },
                (None, false) => {
                    return Err(format!(
                        "field `load[{i}].cluster`: required with `clusters`"
                    ))
                }
                (Some(_), true) => {
                    return Err(format!("field `load[{i}].cluster`: only with `clusters`"))
                }
            };
            if !services.iter().any(|s| s.name == l.service) {
                return Err(format!(
                    "field `load[{i}].service`: {:?} is not a service of this manifest",
                    l.service
                ));
            }
            if !(l.rps > 0.0 && l.rps <= MAX_RPS) {
                return Err(format!(
                    "field `load[{i}].rps`: must be above 0 and at most {MAX_RPS}"
                ));
            }
        }
        Ok(())
    }

    fn validate_services(&self, services: &[ServiceSpec], path: &str) -> Result<(), String> {
        if services.is_empty() {
            return Err(format!("field `{path}`: at least one service is needed"));
        }
        for (i, s) in services.iter().enumerate() {
            let f = |field: &str| format!("field `{path}[{i}].{field}`");
            if !is_dns_label(&s.name) {
                return Err(format!("{}: {:?} is not a valid name", f("name"), s.name));
            }
            if let Some(ns) = &s.namespace {
                if !is_dns_label(ns) {
                    return Err(format!(
                        "{}: {ns:?} is not a valid namespace",
                        f("namespace")
                    ));
                }
            }
            if let Some(g) = &s.global_id {
                if !g.split('.').all(is_dns_label) {
                    return Err(format!(
                        "{}: {g:?} is not a valid global id",
                        f("global_id")
                    ));
                }
            }
            if s.port == 0 {
                return Err(format!("{}: must be 1-65535", f("port")));
            }
            if s.replicas == 0 || s.replicas > MAX_REPLICAS {
                return Err(format!("{}: must be 1-{MAX_REPLICAS}", f("replicas")));
            }
            if !(0.0..=1.0).contains(&s.error_rate) {
                return Err(format!("{}: must be between 0 and 1", f("error_rate")));
            }
            if !(0.0..=60_000.0).contains(&s.latency_ms) {
                return Err(format!("{}: must be 0-60000", f("latency_ms")));
            }
            if services[..i]
                .iter()
                .any(|o| o.name == s.name && o.namespace(self) == s.namespace(self))
            {
                return Err(format!(
                    "{}: service {:?} is listed twice",
                    f("name"),
                    s.name
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demos_are_valid() {
        let m = Manifest::demo();
        assert_eq!(m.services.len(), 2);
        assert_eq!(m.load[1].protocol, LoadProtocol::Grpc);
        assert_eq!(Manifest::multicluster_demo().cluster_specs().len(), 2);
    }

    #[test]
    fn errors_name_the_field() {
        let e = Manifest::parse("services: [{name: web, replicas: 0}]", "m.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("services[0].replicas"), "{e}");
        let e = Manifest::parse("services: [{name: web, replica: 2}]", "m.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `replica`"), "{e}");
        let e = Manifest::parse("services: [{name: web}]\nload: [{service: db}]", "m.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("load[0].service"), "{e}");
        let e = Manifest::parse("services: [{name: web, error_rate: 2}]", "m.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("services[0].error_rate"), "{e}");
        let e = Manifest::parse("services: []", "m.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("field `services`") && e.starts_with("manifest m.yaml"),
            "{e}"
        );
        let e = Manifest::parse(
            "clusters: [{name: a, services: [{name: web}], links: [{cluster: b}]}]",
            "m",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("clusters[0].links[0].cluster"), "{e}");
        let e = Manifest::parse(
            "clusters: [{name: a, services: [{name: web}]}]\nload: [{service: web}]",
            "m",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("load[0].cluster"), "{e}");
        let e = Manifest::parse(
            "clusters: [{name: a, services: [{name: web}]}]\nevents: [{at: 1, kill: b}]",
            "m",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("events[0]"), "{e}");
    }
}
