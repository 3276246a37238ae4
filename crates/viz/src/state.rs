//! The mesh state file: what `tether up` runs and where its admin
//! listeners are. `tether up` writes it once the mesh is ready and removes
//! it on exit; `tether stat`, `tether tap` and `tether dashboard` read it, so
//! they work against a local mesh with no flags. It also yields Prometheus
//! `file_sd` targets with the same labels.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The environment variable naming the state file (else [`default_path`]).
pub const STATE_ENV: &str = "TETHER_UP_STATE";

/// Where `tether up` writes its state file unless told otherwise.
pub fn default_path() -> PathBuf {
    std::env::temp_dir().join("tether-up.json")
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MeshState {
    /// The `tether up` process that wrote this (a stale file names a dead one).
    pub pid: u32,
    pub cluster_domain: String,
    pub clusters: Vec<ClusterState>,
    /// The dashboard's URL, when `tether up` started one.
    #[serde(default)]
    pub dashboard: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ClusterState {
    /// Empty for a single-cluster mesh.
    pub name: String,
    /// The file registry the cluster's control plane reads.
    pub registry: PathBuf,
    /// Admin addresses of the control-plane replicas.
    pub control_planes: Vec<SocketAddr>,
    /// Linked clusters whose global services this one uses.
    #[serde(default)]
    pub links: Vec<LinkState>,
    pub proxies: Vec<ProxyState>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LinkState {
    pub cluster: String,
    pub priority: u32,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A workload's sidecar (inbound and outbound).
    #[default]
    Sidecar,
    /// A sidecar with no app behind it: the load generator's.
    Client,
    /// The multicluster gateway.
    Gateway,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ProxyState {
    /// The workload (replica) name, unique in the cluster.
    pub workload: String,
    pub namespace: String,
    /// The service the workload is an endpoint of.
    #[serde(default)]
    pub service: Option<String>,
    pub role: Role,
    pub admin: SocketAddr,
    #[serde(default)]
    pub outbound: Option<SocketAddr>,
    #[serde(default)]
    pub inbound: Option<SocketAddr>,
    /// The tap API (`tether tap`), when the proxy serves one.
    #[serde(default)]
    pub tap: Option<SocketAddr>,
    #[serde(default)]
    pub identity: Option<String>,
}

impl ProxyState {
    pub fn new(workload: String, namespace: String, role: Role, admin: SocketAddr) -> Self {
        Self {
            workload,
            namespace,
            service: None,
            role,
            admin,
            outbound: None,
            inbound: None,
            tap: None,
            identity: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(
        "no mesh state at {path} (is `tether up` running? or pass --admin / --state): {source}"
    )]
    Missing {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("mesh state {path} is not valid: {source}")]
    Invalid {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("writing mesh state {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A bounded read: a state file is a few KiB; a huge one is not ours.
const MAX_STATE_BYTES: u64 = 4 << 20;

impl MeshState {
    pub fn load(path: &Path) -> Result<Self, StateError> {
        use std::io::Read;
        let missing = |source| StateError::Missing {
            path: path.to_path_buf(),
            source,
        };
        let mut text = String::new();
        std::fs::File::open(path)
            .map_err(missing)?
            .take(MAX_STATE_BYTES)
            .read_to_string(&mut text)
            .map_err(missing)?;
        serde_json::from_str(&text).map_err(|source| StateError::Invalid {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Writes the file the safe way (temporary file, then rename), so a
    /// reader never sees half of it.
    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        let write = |source| StateError::Write {
            path: path.to_path_buf(),
            source,
        };
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(self).expect("plain data serializes");
        std::fs::write(&tmp, text).map_err(write)?;
        std::fs::rename(&tmp, path).map_err(write)
    }

    pub fn proxies(&self) -> impl Iterator<Item = (&ClusterState, &ProxyState)> {
        self.clusters
            .iter()
            .flat_map(|c| c.proxies.iter().map(move |p| (c, p)))
    }

    /// Prometheus `file_sd` targets: every admin listener, labelled the way
    /// `tether stat --prometheus` and the Grafana dashboard group by.
    pub fn prometheus_targets(&self) -> serde_json::Value {
        let mut groups = Vec::new();
        for c in &self.clusters {
            for p in &c.proxies {
                groups.push(serde_json::json!({
                    "targets": [p.admin.to_string()],
                    "labels": {
                        "job": "tether-proxy",
                        "cluster": c.name,
                        "namespace": p.namespace,
                        "workload": p.workload,
                        "service": p.service.clone().unwrap_or_default(),
                        "role": p.role,
                    }
                }));
            }
            for (i, admin) in c.control_planes.iter().enumerate() {
                groups.push(serde_json::json!({
                    "targets": [admin.to_string()],
                    "labels": {
                        "job": "tether-control",
                        "cluster": c.name,
                        "replica": i.to_string(),
                    }
                }));
            }
        }
        serde_json::Value::Array(groups)
    }
}

impl MeshState {
    /// Every proxy as a scrape target named `namespace/workload`.
    pub fn targets(&self) -> Vec<crate::stat::Target> {
        self.proxies()
            .map(|(_, p)| crate::stat::Target {
                workload: format!("{}/{}", p.namespace, p.workload),
                admin: p.admin,
            })
            .collect()
    }

    /// The file of Prometheus `file_sd` targets written beside the state file.
    pub fn targets_path(state_path: &Path) -> PathBuf {
        state_path.with_extension("targets.json")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_a_bad_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let state = MeshState {
            pid: 7,
            cluster_domain: "cluster.local".into(),
            clusters: vec![ClusterState {
                proxies: vec![ProxyState::new(
                    "web-0".into(),
                    "demo".into(),
                    Role::Sidecar,
                    "127.0.0.1:9".parse().unwrap(),
                )],
                ..Default::default()
            }],
            dashboard: None,
        };
        state.save(&path).unwrap();
        assert_eq!(MeshState::load(&path).unwrap(), state);
        let targets = state.prometheus_targets();
        assert_eq!(targets[0]["labels"]["workload"], "web-0");
        std::fs::write(&path, "{").unwrap();
        let err = MeshState::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("state.json") && err.contains("not valid"),
            "{err}"
        );
        let err = MeshState::load(&dir.path().join("none"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("tether up"), "{err}");
    }
}

#[cfg(test)]
mod deploy_tests {
    //! The Prometheus and Grafana files in deploy/ use only metric names
    //! Tether exports (docs/metrics.md lists every one).

    const METRICS_DOC: &str = include_str!("../../../docs/metrics.md");
    const GRAFANA: &str = include_str!("../../../deploy/grafana/tether-dashboard.json");
    const PROMETHEUS: [&str; 2] = [
        include_str!("../../../deploy/prometheus/tether-up.yml"),
        include_str!("../../../deploy/prometheus/kubernetes.yml"),
    ];

    fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        let mut rest = text;
        while let Some(i) = rest.find("tether_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            names.insert(name);
        }
        names
    }

    #[test]
    fn grafana_uses_documented_metrics() {
        let dashboard: serde_json::Value = serde_json::from_str(GRAFANA).unwrap();
        assert!(dashboard["panels"].as_array().unwrap().len() > 10);
        let documented = metric_names(METRICS_DOC);
        let used = metric_names(GRAFANA);
        assert!(used.len() > 15, "{used:?}");
        for name in used {
            let base = ["_bucket", "_total"].iter().fold(name.clone(), |n, s| {
                n.strip_suffix(s).map_or(n.clone(), str::to_string)
            });
            assert!(
                documented.contains(&name)
                    || documented.contains(&base)
                    || documented.contains(&format!("{base}_total")),
                "{name} is not in docs/metrics.md"
            );
        }
    }

    #[test]
    fn prometheus_config_labels_what_stat_groups_by() {
        assert!(PROMETHEUS[0].contains("tether-up.targets.json"));
        for needed in [
            "target_label: workload",
            "target_label: namespace",
            "target_label: cluster",
        ] {
            assert!(PROMETHEUS[1].contains(needed), "{needed}");
        }
    }
}
