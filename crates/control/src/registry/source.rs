//! Which registry backend a control plane runs: chosen once from
//! `--registry`, checked before any listener binds, then spawned.

use std::path::{Path, PathBuf};

use tokio::task::JoinHandle;

use super::file::FileRegistry;
use super::kubernetes::{KubernetesRegistry, WatchLag};
use super::{Registry, RegistryError};
use crate::index::Index;
use crate::memory::MemoryRelease;
use crate::metrics::ControlMetrics;

/// Where services and endpoints come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistrySource {
    /// A directory of registry YAML documents, watched for changes; files
    /// over `max_file_bytes` are refused unread.
    Directory { path: PathBuf, max_file_bytes: u64 },
    /// Services, EndpointSlices and Pods of a Kubernetes API server: `api`,
    /// or the in-cluster configuration, else the kubeconfig.
    Kubernetes { api: Option<String> },
}

impl RegistrySource {
    /// The `--registry` value that selects the Kubernetes API instead of a
    /// directory.
    pub const KUBERNETES: &'static str = "kubernetes";

    /// Reads `--registry`: [`Self::KUBERNETES`], or a directory.
    /// `max_file_bytes` applies to a directory, `kube_api` to Kubernetes.
    pub fn from_flag(registry: &Path, max_file_bytes: u64, kube_api: Option<String>) -> Self {
        if registry.as_os_str() == Self::KUBERNETES {
            Self::Kubernetes { api: kube_api }
        } else {
            Self::Directory {
                path: registry.to_path_buf(),
                max_file_bytes,
            }
        }
    }

    /// Checks the source can be read: the directory exists, or a
    /// Kubernetes client can be configured.
    pub async fn connect(&self) -> Result<Backend, SourceError> {
        match self {
            Self::Directory {
                path,
                max_file_bytes,
            } => {
                if !path.is_dir() {
                    return Err(RegistryError::Directory {
                        path: path.display().to_string(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::NotFound,
                            "not a directory",
                        ),
                    }
                    .into());
                }
                Ok(Backend::Directory {
                    path: path.clone(),
                    max_file_bytes: *max_file_bytes,
                })
            }
            Self::Kubernetes { api } => Ok(Backend::Kubernetes(kube_client(api.as_deref()).await?)),
        }
    }
}

/// Why a Kubernetes client could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum KubeClientError {
    #[error("--kube-api {0:?} is not a URL")]
    ApiUrl(String),
    #[error(transparent)]
    Client(kube::Error),
    #[error("no in-cluster configuration or kubeconfig: {0}")]
    NoConfiguration(#[source] kube::Error),
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    Directory(#[from] RegistryError),
    #[error("Kubernetes: {0}")]
    Kubernetes(#[from] KubeClientError),
}

async fn kube_client(api: Option<&str>) -> Result<kube::Client, KubeClientError> {
    match api {
        Some(url) => {
            let uri = url
                .parse()
                .map_err(|_| KubeClientError::ApiUrl(url.to_string()))?;
            kube::Client::try_from(kube::Config::new(uri)).map_err(KubeClientError::Client)
        }
        None => kube::Client::try_default()
            .await
            .map_err(KubeClientError::NoConfiguration),
    }
}

/// A registry source that passed [`RegistrySource::connect`].
pub enum Backend {
    Directory { path: PathBuf, max_file_bytes: u64 },
    Kubernetes(kube::Client),
}

impl Backend {
    /// The API client, which Certify also uses for TokenReview.
    pub fn kube_client(&self) -> Option<&kube::Client> {
        match self {
            Self::Kubernetes(client) => Some(client),
            Self::Directory { .. } => None,
        }
    }

    /// Runs the backend into `index`; `loaded` is called after its first
    /// full load.
    pub fn spawn(
        self,
        index: Index,
        loaded: Box<dyn FnOnce() + Send>,
        cluster_domain: &str,
        metrics: ControlMetrics,
        kube_lag: WatchLag,
        memory: MemoryRelease,
    ) -> JoinHandle<Result<(), RegistryError>> {
        match self {
            Self::Kubernetes(client) => tokio::spawn(
                KubernetesRegistry::new(client, cluster_domain, metrics, kube_lag)
                    .with_memory_release(memory)
                    .run(index, loaded),
            ),
            Self::Directory {
                path,
                max_file_bytes,
            } => tokio::spawn(
                FileRegistry::new(path, metrics)
                    .with_max_file_bytes(max_file_bytes)
                    .run(index, loaded),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_kubernetes_selects_the_api_and_anything_else_is_a_directory() {
        assert_eq!(
            RegistrySource::from_flag(Path::new("kubernetes"), 7, Some("https://k".into())),
            RegistrySource::Kubernetes {
                api: Some("https://k".into())
            }
        );
        assert_eq!(
            RegistrySource::from_flag(Path::new("./kubernetes"), 7, None),
            RegistrySource::Directory {
                path: "./kubernetes".into(),
                max_file_bytes: 7
            }
        );
    }

    #[tokio::test]
    async fn a_missing_directory_and_a_bad_api_url_are_named() {
        let missing = RegistrySource::Directory {
            path: "/nonexistent/registry".into(),
            max_file_bytes: 1,
        };
        let err = missing.connect().await.err().unwrap().to_string();
        assert!(err.contains("/nonexistent/registry"), "{err}");
        let bad = RegistrySource::Kubernetes {
            api: Some("not a url".into()),
        };
        let err = bad.connect().await.err().unwrap().to_string();
        assert_eq!(err, "Kubernetes: --kube-api \"not a url\" is not a URL");
    }
}
