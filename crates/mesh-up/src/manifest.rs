//! The `tether up` manifest: which services to run, how many replicas, how
//! the demo app behaves, and what load to send. Errors name the field.

use serde::{Deserialize, Serialize};
use tether_core::authority::is_dns_label;

use crate::loadgen::LoadProtocol;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    #[serde(default = "default_domain")]
    pub cluster_domain: String,
    /// The namespace of services that name none.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    pub services: Vec<ServiceSpec>,
    #[serde(default)]
    pub load: Vec<LoadTarget>,
    /// Issue every workload a certificate and require mTLS between proxies.
    #[serde(default = "yes")]
    pub identity: bool,
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
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LoadTarget {
    /// The name of a service in this manifest.
    pub service: String,
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

    pub fn parse(text: &str, source_name: &str) -> Result<Self, ManifestError> {
        let err = |message: String| ManifestError {
            source_name: source_name.to_string(),
            message,
        };
        let m: Manifest = serde_yaml::from_str(text).map_err(|e| err(e.to_string()))?;
        m.validate().map_err(err)?;
        Ok(m)
    }

    fn validate(&self) -> Result<(), String> {
        if !is_dns_label(&self.namespace) {
            return Err(format!(
                "field `namespace`: {:?} is not a valid namespace",
                self.namespace
            ));
        }
        if self.services.is_empty() {
            return Err("field `services`: at least one service is needed".into());
        }
        for (i, s) in self.services.iter().enumerate() {
            let f = |field: &str| format!("field `services[{i}].{field}`");
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
            if self.services[..i]
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
        for (i, l) in self.load.iter().enumerate() {
            if !self.services.iter().any(|s| s.name == l.service) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_is_valid() {
        let m = Manifest::demo();
        assert_eq!(m.services.len(), 2);
        assert_eq!(m.load[1].protocol, LoadProtocol::Grpc);
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
    }
}
