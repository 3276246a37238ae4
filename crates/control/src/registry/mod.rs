//! Registry backends: where services and endpoints come from.
//!
//! A backend watches its source of truth and writes whole services into the
//! [`Index`]; it marks the `registry loaded` readiness condition once its
//! first full load is in. Two backends implement [`Registry`]:
//! [`file::FileRegistry`] and [`kubernetes::KubernetesRegistry`];
//! [`source::RegistrySource`] is the choice between them.

pub mod file;
pub mod kubernetes;
mod merge;
pub mod source;

use std::future::Future;

use crate::index::Index;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("registry directory {path}: {source}")]
    Directory {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("watching registry directory {path}: {source}")]
    Watch {
        path: String,
        #[source]
        source: notify::Error,
    },
}

/// The readiness condition a registry sets after its first full load.
pub const LOADED: &str = "registry loaded";

pub trait Registry: Send + 'static {
    /// Loads the registry into `index`, then keeps it current until the
    /// future is dropped. `loaded` is called once the first load is in.
    fn run(
        self,
        index: Index,
        loaded: Box<dyn FnOnce() + Send>,
    ) -> impl Future<Output = Result<(), RegistryError>> + Send;
}
