//! The tokio runtime a process runs on; for a data-path process (proxy,
//! gateway), sized for a sidecar's share of the host.

/// Builds the runtime. `data_path_workers` is the worker count of a
/// data-path process (`--threads`, else the CPU quota, else one), `None`
/// for every other process (one worker per core).
pub fn build(data_path_workers: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    // One worker runs on the current-thread scheduler: no work-stealing
    // queues or cross-thread wake-ups, which cost a multi-thread runtime
    // with one worker measurable CPU per request (docs/performance.md).
    let mut builder = match data_path_workers {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    builder.enable_all();
    if let Some(n) = data_path_workers {
        tracing::info!("data-path runtime: {n} worker threads");
        if n > 1 {
            builder.worker_threads(n);
        }
    }
    let runtime = builder.build()?;
    if data_path_workers.is_some() {
        runtime.spawn(release_startup_pages());
    }
    Ok(runtime)
}

/// A data-path process lets go of the start-up pages of its binary and
/// libraries once start-up is over ([`crate::memory`]).
async fn release_startup_pages() {
    tokio::time::sleep(crate::memory::RELEASE_STARTUP_PAGES_AFTER).await;
    match crate::memory::release_file_pages() {
        Ok(bytes) => tracing::debug!(
            mapped_mib = bytes >> 20,
            "let go of start-up pages of the binary and libraries"
        ),
        Err(e) => tracing::debug!(error = %e, "could not read this process's mappings"),
    }
}
