//! Handing freed heap memory back to the operating system. glibc keeps what
//! a burst of frees leaves (closed subscriptions, a full list's fresh copies
//! of objects that did not change) until asked, and asking walks the heap:
//! callers ask only after a large free, off the async workers.

/// Returns the heap's free pages to the kernel. It blocks for the walk of
/// the heap (milliseconds for hundreds of MiB): call it through
/// `tokio::task::spawn_blocking`.
pub(crate) fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free heap pages to the kernel.
        unsafe { libc::malloc_trim(0) };
        tracing::debug!("returned freed memory to the operating system");
    }
}
