//! The `tether up` manifest: which services to run (in one cluster, or in
//! several linked clusters), how many replicas, how the demo app behaves,
//! what load to send, and scripted events. Errors name the field.

use std::io::Read;

use serde::{Deserialize, Serialize};
use tether_core::authority::is_dns_label;
use tether_core::registry::MulticlusterMode;
use tether_core::truncate::{bounded_message, for_log};

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
/// Services per cluster, load targets and events: each service runs up to
/// `MAX_REPLICAS` processes, so the manifest bounds what one file starts.
pub const MAX_SERVICES: usize = 64;
pub const MAX_LOAD_TARGETS: usize = 64;
pub const MAX_EVENTS: usize = 256;
/// The largest manifest file read.
pub const MAX_MANIFEST_BYTES: u64 = 1024 * 1024;

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
            message: bounded_message(message),
        };
        if text.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(err(format!(
                "{} bytes, over the limit of {MAX_MANIFEST_BYTES} bytes",
                text.len()
            )));
        }
        tether_core::yaml::refuse_anchors(text).map_err(err)?;
        let m: Manifest = serde_yaml::from_str(text).map_err(|e| ManifestError {
            source_name: source_name.to_string(),
            message: bounded_message(e),
        })?;
        m.validate().map_err(err)?;
        Ok(m)
    }

    /// Reads and parses a manifest file, reading no more than the limit.
    pub fn load(path: &std::path::Path) -> Result<Self, ManifestError> {
        let name = path.display().to_string();
        let err = |message: String| ManifestError {
            source_name: name.clone(),
            message,
        };
        let file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
        let mut bytes = Vec::new();
        file.take(MAX_MANIFEST_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| err(e.to_string()))?;
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(err(format!("over the limit of {MAX_MANIFEST_BYTES} bytes")));
        }
        let text = String::from_utf8(bytes).map_err(|e| err(format!("not UTF-8 text ({e})")))?;
        Self::parse(&text, &name)
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
                "field `namespace`: {} is not a valid namespace",
                for_log(&self.namespace)
            ));
        }
        if self.load.len() > MAX_LOAD_TARGETS {
            return Err(format!("field `load`: at most {MAX_LOAD_TARGETS} targets"));
        }
        if self.events.len() > MAX_EVENTS {
            return Err(format!("field `events`: at most {MAX_EVENTS} events"));
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
                    "field `clusters[{c}].name`: {} is not a valid name",
                    for_log(&cluster.name)
                ));
            }
            if self.clusters[..c].iter().any(|o| o.name == cluster.name) {
                return Err(format!(
                    "field `clusters[{c}].name`: {} is listed twice",
                    for_log(&cluster.name)
                ));
            }
            for (l, link) in cluster.links.iter().enumerate() {
                if !self.clusters.iter().any(|o| o.name == link.cluster)
                    || link.cluster == cluster.name
                {
                    return Err(format!(
                        "field `clusters[{c}].links[{l}].cluster`: {} is not another cluster of this manifest",
                        for_log(&link.cluster)
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
                    "field `events[{i}]`: {} is not a cluster of this manifest",
                    for_log(target)
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
                            "field `load[{i}].cluster`: {} is not a cluster of this manifest",
                            for_log(c)
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
                    "field `load[{i}].service`: {} is not a service of this manifest",
                    for_log(&l.service)
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
        if services.len() > MAX_SERVICES {
            return Err(format!("field `{path}`: at most {MAX_SERVICES} services"));
        }
        for (i, s) in services.iter().enumerate() {
            let f = |field: &str| format!("field `{path}[{i}].{field}`");
            if !is_dns_label(&s.name) {
                return Err(format!(
                    "{}: {} is not a valid name",
                    f("name"),
                    for_log(&s.name)
                ));
            }
            if let Some(ns) = &s.namespace {
                if !is_dns_label(ns) {
                    return Err(format!(
                        "{}: {} is not a valid namespace",
                        f("namespace"),
                        for_log(ns)
                    ));
                }
            }
            if let Some(g) = &s.global_id {
                if !g.split('.').all(is_dns_label) {
                    return Err(format!(
                        "{}: {} is not a valid global id",
                        f("global_id"),
                        for_log(g)
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
                    "{}: service {} is listed twice",
                    f("name"),
                    for_log(&s.name)
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

    /// The longest error a manifest may produce, whatever it holds.
    const MAX_ERROR_BYTES: usize = 1024;

    #[test]
    fn limits_and_huge_values() {
        let huge = "x".repeat(1 << 19);
        for text in [
            format!("services: [{{name: {huge}}}]"),
            format!("namespace: {huge}\nservices: [{{name: web}}]"),
            format!("services: [{{name: web, {huge}: 1}}]"),
            format!("services: [{{name: web}}]\nload: [{{service: {huge}}}]"),
        ] {
            let e = Manifest::parse(&text, "m.yaml").unwrap_err().to_string();
            assert!(e.len() < MAX_ERROR_BYTES, "{} bytes", e.len());
        }
        let e = Manifest::parse(&format!("services: []\n#{}", "x".repeat(1 << 20)), "m")
            .unwrap_err()
            .to_string();
        assert!(e.contains("over the limit of 1048576 bytes"), "{e}");
        let many: Vec<String> = (0..=MAX_SERVICES)
            .map(|i| format!("{{name: s{i}}}"))
            .collect();
        let e = Manifest::parse(&format!("services: [{}]", many.join(", ")), "m")
            .unwrap_err()
            .to_string();
        assert!(e.contains("field `services`: at most 64"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.yaml");
        std::fs::write(&path, vec![b'#'; MAX_MANIFEST_BYTES as usize + 1]).unwrap();
        let e = Manifest::load(&path).unwrap_err().to_string();
        assert!(
            e.contains("big.yaml") && e.contains("over the limit"),
            "{e}"
        );
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// Fragments of manifests, so random input gets past YAML into the
        /// checks, plus raw noise and one long value.
        fn manifest_text() -> impl Strategy<Value = String> {
            let fragment = prop_oneof![
                Just("services:\n  - name: web\n".to_string()),
                Just("clusters:\n  - name: east\n    services: [{name: web}]\n".to_string()),
                Just("    links: [{cluster: west}]\n".to_string()),
                Just("load:\n  - service: web\n".to_string()),
                Just("    cluster: east\n".to_string()),
                Just("events: [{at: 1, kill: east}]\n".to_string()),
                Just("    replicas: 0\n".to_string()),
                "[a-z_ ]{1,10}: [a-z0-9.:{}\\[\\]-]{0,12}\n",
                any::<String>(),
                (
                    prop::sample::select(vec![
                        "namespace",
                        "  - name",
                        "    service",
                        "    global_id",
                        "cluster_domain"
                    ]),
                    0usize..20_000,
                )
                    .prop_map(|(key, n)| format!("{key}: {}\n", "q".repeat(n))),
            ];
            proptest::collection::vec(fragment, 0..10).prop_map(|v| v.concat())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            #[test]
            fn parsing_never_panics_and_errors_are_bounded(text in manifest_text()) {
                if let Err(e) = Manifest::parse(&text, "m.yaml") {
                    let e = e.to_string();
                    prop_assert!(e.len() < super::MAX_ERROR_BYTES, "{} bytes", e.len());
                }
            }

            #[test]
            fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
                let _ = Manifest::parse(&String::from_utf8_lossy(&bytes), "m.yaml");
            }
        }
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
