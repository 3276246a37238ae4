//! The file registry: a directory of YAML documents, watched for changes.
//!
//! Changes are applied per file: only the files named by change events are
//! re-read, and only the services those files mention are rebuilt, so the
//! cost of a reload follows the size of the change, not of the registry.
//! Events arriving within a short window are coalesced into one batch. A
//! periodic rescan compares modification stamps and catches anything the
//! watcher missed (or dropped when its bounded queue was full).
//!
//! A file that fails to parse or validate is rejected as a whole and logged
//! with its path and the failing field; whatever it contributed before stays
//! in force. Writers should write a temporary file (a name starting with `.`
//! or not ending in `.yaml`/`.yml`) and rename it into place, so a
//! half-written file is never read.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use notify::Watcher;
use tether_core::authority::ServiceKey;
use tether_core::registry::{parse_documents, Document};
use tokio::sync::mpsc;

use super::{Registry, RegistryError};
use crate::index::{Index, ServiceState};
use crate::metrics::ControlMetrics;

/// How long to keep collecting events after the first one of a burst.
const COALESCE_WINDOW: Duration = Duration::from_millis(10);
/// Bound on queued watcher events; beyond it the registry rescans instead.
const EVENT_QUEUE: usize = 4096;

pub struct FileRegistry {
    dir: PathBuf,
    metrics: ControlMetrics,
    rescan_interval: Duration,
}

type Stamp = (SystemTime, u64);

struct FileEntry {
    stamp: Option<Stamp>,
    docs: Vec<Document>,
}

/// What has been loaded: documents per file, and which files mention each
/// service (so a change rebuilds only the services it touches).
#[derive(Default)]
struct Loaded {
    files: HashMap<PathBuf, FileEntry>,
    mentions: HashMap<ServiceKey, BTreeSet<PathBuf>>,
    /// Rejections since this was last drained, for one-shot readers.
    rejections: Vec<String>,
}

pub fn is_registry_file(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
}

fn stamp_of(meta: &std::fs::Metadata) -> Stamp {
    (
        meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        meta.len(),
    )
}

impl FileRegistry {
    pub fn new(dir: impl Into<PathBuf>, metrics: ControlMetrics) -> Self {
        let dir = dir.into();
        // The watcher reports absolute paths; listing must name files the
        // same way, or one file would be loaded twice under two names.
        let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
        Self {
            dir,
            metrics,
            rescan_interval: Duration::from_secs(5),
        }
    }

    pub fn with_rescan_interval(mut self, interval: Duration) -> Self {
        self.rescan_interval = interval;
        self
    }

    fn dir_error(&self, source: std::io::Error) -> RegistryError {
        RegistryError::Directory {
            path: self.dir.display().to_string(),
            source,
        }
    }

    /// Lists the registry files and their stamps.
    fn list(&self) -> Result<HashMap<PathBuf, Stamp>, RegistryError> {
        let mut out = HashMap::new();
        for entry in std::fs::read_dir(&self.dir).map_err(|e| self.dir_error(e))? {
            let Ok(entry) = entry else { continue };
            let path = entry.path();
            if !is_registry_file(&path) {
                continue;
            }
            if let Ok(meta) = entry.metadata() {
                if meta.is_file() {
                    out.insert(path, stamp_of(&meta));
                }
            }
        }
        Ok(out)
    }
}

impl Loaded {
    /// Re-reads one file; returns the services whose state may have changed.
    fn reload(&mut self, path: &Path, metrics: &ControlMetrics) -> BTreeSet<ServiceKey> {
        let mut touched = BTreeSet::new();
        let meta = std::fs::metadata(path).ok().filter(|m| m.is_file());
        let Some(meta) = meta else {
            if let Some(old) = self.files.remove(path) {
                metrics.registry_documents.dec_by(old.docs.len() as i64);
                for doc in &old.docs {
                    let key = doc.service_key();
                    self.forget(&key, path);
                    touched.insert(key);
                }
                tracing::info!(file = %path.display(), "registry file removed");
            }
            return touched;
        };
        let stamp = stamp_of(&meta);
        if self.files.get(path).is_some_and(|f| f.stamp == Some(stamp)) {
            return touched;
        }
        let parsed = std::fs::read_to_string(path)
            .map_err(|e| e.to_string())
            .and_then(|text| parse_documents(&text).map_err(|e| e.to_string()))
            .and_then(|docs| self.check_conflicts(path, docs));
        let docs = match parsed {
            Ok(docs) => docs,
            Err(error) => {
                metrics.registry_reload_errors.inc();
                self.rejections.push(format!("{}: {error}", path.display()));
                tracing::error!(
                    "registry file {} rejected: {error}; its last good state stays in force",
                    path.display()
                );
                // Remember the stamp so the rescan does not report it again.
                let entry = self.files.entry(path.to_path_buf()).or_insert(FileEntry {
                    stamp: None,
                    docs: Vec::new(),
                });
                entry.stamp = Some(stamp);
                return touched;
            }
        };
        let old = self.files.insert(
            path.to_path_buf(),
            FileEntry {
                stamp: Some(stamp),
                docs,
            },
        );
        let old_docs = old.map(|f| f.docs).unwrap_or_default();
        metrics.registry_documents.dec_by(old_docs.len() as i64);
        for doc in &old_docs {
            let key = doc.service_key();
            self.forget(&key, path);
            touched.insert(key);
        }
        let new_docs = &self.files[path].docs;
        metrics.registry_documents.inc_by(new_docs.len() as i64);
        for doc in new_docs {
            let key = doc.service_key();
            self.mentions
                .entry(key.clone())
                .or_default()
                .insert(path.to_path_buf());
            touched.insert(key);
        }
        metrics.registry_events_applied.inc();
        tracing::debug!(file = %path.display(), services = touched.len(), "registry file applied");
        touched
    }

    fn forget(&mut self, key: &ServiceKey, path: &Path) {
        if let Some(paths) = self.mentions.get_mut(key) {
            paths.remove(path);
            if paths.is_empty() {
                self.mentions.remove(key);
            }
        }
    }

    /// A service may be defined (`kind: Service`) by one file only.
    fn check_conflicts(&self, path: &Path, docs: Vec<Document>) -> Result<Vec<Document>, String> {
        let mut defined = HashSet::new();
        for (i, doc) in docs.iter().enumerate() {
            let Document::Service(_) = doc else { continue };
            let key = doc.service_key();
            if !defined.insert(key.clone()) {
                return Err(format!(
                    "document {}: service {key} is defined twice in this file",
                    i + 1
                ));
            }
            for other in self.mentions.get(&key).into_iter().flatten() {
                if other != path && self.defines(other, &key) {
                    return Err(format!(
                        "document {}: service {key} is already defined in {}",
                        i + 1,
                        other.display()
                    ));
                }
            }
        }
        Ok(docs)
    }

    fn defines(&self, path: &Path, key: &ServiceKey) -> bool {
        self.files.get(path).is_some_and(|f| {
            f.docs
                .iter()
                .any(|d| matches!(d, Document::Service(_)) && d.service_key() == *key)
        })
    }

    /// Merges every document that mentions `key` into one service state.
    fn merged(&self, key: &ServiceKey) -> Option<ServiceState> {
        let paths = self.mentions.get(key)?;
        let docs = || {
            paths
                .iter()
                .filter_map(|p| self.files.get(p))
                .flat_map(|f| f.docs.iter())
                .filter(|d| d.service_key() == *key)
        };
        let Some(Document::Service(svc)) = docs().find(|d| matches!(d, Document::Service(_)))
        else {
            return None; // endpoints wait for their service to be defined
        };
        Some(ServiceState {
            ports: svc.ports.clone(),
            global_id: svc.global_id.clone(),
            mode: svc.mode,
            retry_budget: svc.retry_budget,
            cluster_ip: svc.cluster_ip,
            endpoints: docs().flat_map(|d| d.endpoints().iter().cloned()).collect(),
        })
    }
}

/// Reads a registry directory once, exactly as the file registry would,
/// for tools that compare it with what control planes serve. Returns every
/// service and the files that were rejected (with why).
pub fn read_once(
    dir: &Path,
) -> Result<
    (
        std::collections::BTreeMap<ServiceKey, ServiceState>,
        Vec<String>,
    ),
    RegistryError,
> {
    let registry = FileRegistry::new(dir, ControlMetrics::default());
    let mut loaded = Loaded::default();
    for path in registry.list()?.into_keys() {
        loaded.reload(&path, &registry.metrics);
    }
    let services = loaded
        .mentions
        .keys()
        .filter_map(|k| loaded.merged(k).map(|s| (k.clone(), s)))
        .collect();
    Ok((services, std::mem::take(&mut loaded.rejections)))
}

/// Applies a batch of changed paths to the index.
fn apply(
    loaded: &mut Loaded,
    paths: impl IntoIterator<Item = PathBuf>,
    index: &Index,
    metrics: &ControlMetrics,
    observed_at: std::time::Instant,
) {
    let mut touched = BTreeSet::new();
    for path in paths {
        touched.extend(loaded.reload(&path, metrics));
    }
    for key in touched {
        index.set_service_observed(&key, loaded.merged(&key), observed_at);
    }
}

impl Registry for FileRegistry {
    async fn run(
        self,
        index: Index,
        loaded_cb: Box<dyn FnOnce() + Send>,
    ) -> Result<(), RegistryError> {
        let (tx, mut rx) = mpsc::channel::<PathBuf>(EVENT_QUEUE);
        let overflowed = Arc::new(AtomicBool::new(false));
        let overflow_flag = overflowed.clone();
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            let Ok(event) = res else {
                overflow_flag.store(true, Ordering::Relaxed);
                return;
            };
            if event.need_rescan() {
                overflow_flag.store(true, Ordering::Relaxed);
            }
            // Our own reads show up as access events; they change nothing.
            if matches!(event.kind, notify::EventKind::Access(_)) {
                return;
            }
            for path in event.paths {
                if is_registry_file(&path) && tx.try_send(path).is_err() {
                    overflow_flag.store(true, Ordering::Relaxed);
                }
            }
        })
        .map_err(|source| RegistryError::Watch {
            path: self.dir.display().to_string(),
            source,
        })?;
        watcher
            .watch(&self.dir, notify::RecursiveMode::NonRecursive)
            .map_err(|source| RegistryError::Watch {
                path: self.dir.display().to_string(),
                source,
            })?;

        let mut loaded = Loaded::default();
        let files = self.list()?;
        apply(
            &mut loaded,
            files.into_keys(),
            &index,
            &self.metrics,
            std::time::Instant::now(),
        );
        tracing::info!(
            dir = %self.dir.display(),
            files = loaded.files.len(),
            services = loaded.mentions.len(),
            "registry loaded"
        );
        loaded_cb();

        let mut rescan = tokio::time::interval(self.rescan_interval);
        rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let mut batch = BTreeSet::new();
            let mut observed_at = std::time::Instant::now();
            tokio::select! {
                path = rx.recv() => {
                    observed_at = std::time::Instant::now();
                    let Some(path) = path else { return Ok(()) };
                    batch.insert(path);
                    let deadline = tokio::time::Instant::now() + COALESCE_WINDOW;
                    while let Ok(Some(path)) = tokio::time::timeout_at(deadline, rx.recv()).await {
                        batch.insert(path);
                    }
                }
                _ = rescan.tick() => {}
            }
            if overflowed.swap(false, Ordering::Relaxed) || batch.is_empty() {
                // Full comparison of stamps: new, changed and removed files.
                match self.list() {
                    Ok(files) => {
                        for (path, stamp) in &files {
                            if loaded.files.get(path).and_then(|f| f.stamp) != Some(*stamp) {
                                batch.insert(path.clone());
                            }
                        }
                        batch.extend(
                            loaded
                                .files
                                .keys()
                                .filter(|p| !files.contains_key(*p))
                                .cloned(),
                        );
                    }
                    Err(e) => tracing::warn!(error = %e, "registry rescan failed"),
                }
            }
            if !batch.is_empty() {
                apply(&mut loaded, batch, &index, &self.metrics, observed_at);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_core::registry::MulticlusterMode;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        let path = dir.join(name);
        std::fs::rename(&tmp, &path).unwrap();
        path
    }

    #[test]
    fn merges_files_and_keeps_last_good_state() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = ControlMetrics::default();
        let index = Index::new(metrics.clone());
        let key = ServiceKey::new("web", "demo");
        let mut loaded = Loaded::default();

        let svc = write(
            dir.path(),
            "web.yaml",
            "kind: Service\nname: web\nnamespace: demo\nports: [{port: 80}]\nmode: failover\n",
        );
        let eps = write(
            dir.path(),
            "web-1.yaml",
            "kind: Endpoints\nservice: web\nnamespace: demo\nendpoints: [{address: 127.0.0.1:1}]\n",
        );
        apply(
            &mut loaded,
            [svc.clone(), eps.clone()],
            &index,
            &metrics,
            std::time::Instant::now(),
        );
        let state = index.service(&key).unwrap();
        assert_eq!(state.endpoints.len(), 1);
        assert_eq!(state.mode, Some(MulticlusterMode::Failover));

        // A broken file keeps what it contributed before.
        std::thread::sleep(Duration::from_millis(10));
        write(
            dir.path(),
            "web-1.yaml",
            "kind: Endpoints\nservice: web\nendpoints: [{address: nope}]\n",
        );
        apply(
            &mut loaded,
            [eps.clone()],
            &index,
            &metrics,
            std::time::Instant::now(),
        );
        assert_eq!(index.service(&key).unwrap().endpoints.len(), 1);
        assert_eq!(metrics.registry_reload_errors.get(), 1);

        // A second definition of the same service is refused.
        let dup = write(
            dir.path(),
            "dup.yaml",
            "kind: Service\nname: web\nnamespace: demo\nports: [{port: 81}]\n",
        );
        apply(
            &mut loaded,
            [dup],
            &index,
            &metrics,
            std::time::Instant::now(),
        );
        assert_eq!(metrics.registry_reload_errors.get(), 2);
        assert_eq!(index.service(&key).unwrap().ports[0].port, 80);

        // Removing the service file removes the service; endpoints wait.
        std::fs::remove_file(&svc).unwrap();
        apply(
            &mut loaded,
            [svc],
            &index,
            &metrics,
            std::time::Instant::now(),
        );
        assert!(index.service(&key).is_none());
    }

    /// A registry named by a relative path once loaded each file twice (by
    /// the relative name it was listed under, and by the absolute name the
    /// watcher reported), so every service conflicted with itself.
    #[tokio::test]
    async fn files_are_loaded_once_whatever_the_path_spelling() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("reg")).unwrap();
        let cwd = std::env::current_dir().unwrap();
        let up = "../".repeat(cwd.components().count() - 1);
        let spelled = PathBuf::from(up)
            .join(dir.path().strip_prefix("/").unwrap())
            .join("reg");
        assert!(spelled.is_relative() && spelled.is_dir());
        write(
            &spelled,
            "web.yaml",
            "kind: Service\nname: web\nports: [{port: 80}]\n",
        );
        let metrics = ControlMetrics::default();
        let index = Index::new(metrics.clone());
        let registry = FileRegistry::new(&spelled, metrics.clone())
            .with_rescan_interval(Duration::from_millis(50));
        let task = tokio::spawn(registry.run(index.clone(), Box::new(|| {})));
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Touch it: the watcher reports the change by its absolute path.
        write(
            &spelled,
            "web.yaml",
            "kind: Service\nname: web\nports: [{port: 81}]\n",
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        task.abort();
        assert_eq!(metrics.registry_reload_errors.get(), 0);
        assert_eq!(metrics.registry_documents.get(), 1);
        let svc = index.service(&ServiceKey::new("web", "default")).unwrap();
        assert_eq!(svc.ports[0].port, 81);
    }

    #[test]
    fn ignores_temporary_files() {
        assert!(is_registry_file(Path::new("/r/web.yaml")));
        assert!(is_registry_file(Path::new("/r/web.yml")));
        assert!(!is_registry_file(Path::new("/r/.web.yaml")));
        assert!(!is_registry_file(Path::new("/r/web.yaml.tmp")));
    }
}
