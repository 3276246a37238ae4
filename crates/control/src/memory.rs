//! Handing freed heap memory back to the operating system. glibc keeps
//! what a burst of frees leaves (closed subscriptions, a full list's fresh
//! copies of objects that did not change) until asked, and asking walks
//! the heap: callers ask only after a large free, and [`MemoryRelease`]
//! runs one walk at a time, off the async workers, spaced out.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::histogram::Histogram;
use tether_admin::Shutdown;
use tokio::sync::Notify;

/// Asks for freed heap memory to be returned to the operating system.
/// One task serves every ask: one walk of the heap at a time, the next
/// after [`MemoryRelease::SPACING`] or a hundred times the walk's length
/// (whichever is longer, up to ten minutes), and the asks made meanwhile
/// served together by it.
#[derive(Clone, Default)]
pub struct MemoryRelease {
    asked: Arc<Notify>,
}

impl MemoryRelease {
    /// A walk of a fragmented heap of hundreds of MiB can take a second of
    /// CPU: after one, the next waits this long.
    pub const SPACING: Duration = Duration::from_secs(10);
    /// And at least this many times the walk's own length: glibc holds an
    /// arena's lock through its walk, so a thread allocating from it waits
    /// that long, for at most 1% of its time however slow walks get.
    const WAIT_PER_WALK: u32 = 100;

    /// Never longer than this: asks are served within ten minutes.
    const LONGEST_SPACING: Duration = Duration::from_secs(600);

    /// The wait after a walk that took `took`.
    fn spacing_after(took: Duration) -> Duration {
        Self::SPACING
            .max(took.saturating_mul(Self::WAIT_PER_WALK))
            .min(Self::LONGEST_SPACING)
    }

    /// Starts the task that serves the asks, until `shutdown`; each walk's
    /// time goes to `took`.
    pub fn spawn(took: Histogram, shutdown: Shutdown) -> Self {
        let release = Self::default();
        let asked = release.asked.clone();
        tokio::spawn(serve(asked, release_free_memory, took, shutdown));
        release
    }

    /// Asks for what is free to be returned soon. Never waits. Asks to one
    /// made by [`Default`] (a registry built for a test) go unserved.
    pub fn ask(&self) {
        self.asked.notify_one();
    }
}

async fn serve(asked: Arc<Notify>, release: fn(), took: Histogram, shutdown: Shutdown) {
    loop {
        tokio::select! {
            _ = asked.notified() => {}
            _ = shutdown.triggered() => return,
        }
        // The runtime's clock: a walk takes no time in a test whose clock
        // is paused, however late its blocking thread runs.
        let started = tokio::time::Instant::now();
        if tokio::task::spawn_blocking(release).await.is_err() {
            return;
        }
        let walk = started.elapsed();
        took.observe(walk.as_secs_f64());
        tracing::debug!(
            took_ms = walk.as_millis() as u64,
            "returned freed memory to the operating system"
        );
        tokio::select! {
            _ = tokio::time::sleep(MemoryRelease::spacing_after(walk)) => {}
            _ = shutdown.triggered() => return,
        }
    }
}

/// Returns the heap's free pages to the kernel. It blocks for the walk of
/// the heap: 7 ms after 100,000 Pods listed again (`a_large_cluster`, 370
/// MiB), but up to a second on a heap of that size fragmented into free
/// and used chunks side by side (the hostile review's model).
pub(crate) fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free heap pages to the kernel.
        unsafe { libc::malloc_trim(0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static RELEASES: AtomicUsize = AtomicUsize::new(0);
    /// The thread the test's runtime polls its tasks on.
    static RUNTIME_THREAD: std::sync::OnceLock<std::thread::ThreadId> = std::sync::OnceLock::new();
    /// Releases made there, where a walk would stall every task.
    static ON_RUNTIME_THREAD: AtomicUsize = AtomicUsize::new(0);

    fn count_release() {
        if RUNTIME_THREAD.get() == Some(&std::thread::current().id()) {
            ON_RUNTIME_THREAD.fetch_add(1, Ordering::SeqCst);
        }
        RELEASES.fetch_add(1, Ordering::SeqCst);
    }

    /// Lets the serving task run, and a blocking release finish, without
    /// moving the paused clock: until `n` releases were made, or for 50
    /// ms of real time when `n` is what was made already (nothing more
    /// may come), or 5 s at most.
    async fn released(n: usize) -> usize {
        let started = std::time::Instant::now();
        let made_already = RELEASES.load(Ordering::SeqCst) >= n;
        loop {
            tokio::task::yield_now().await;
            let made = RELEASES.load(Ordering::SeqCst);
            let waited = started.elapsed();
            if (made >= n && !made_already)
                || (made_already && waited > Duration::from_millis(50))
                || made > n
                || waited > Duration::from_secs(5)
            {
                return made;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn slow_walks_are_spaced_further_apart() {
        let spacing = MemoryRelease::spacing_after;
        assert_eq!(spacing(Duration::ZERO), MemoryRelease::SPACING);
        assert_eq!(spacing(Duration::from_millis(7)), MemoryRelease::SPACING);
        assert_eq!(spacing(Duration::from_millis(250)), Duration::from_secs(25));
        assert_eq!(spacing(Duration::from_secs(2)), Duration::from_secs(200));
        assert_eq!(spacing(Duration::from_secs(10)), Duration::from_secs(600));
        assert_eq!(spacing(Duration::MAX), Duration::from_secs(600));
    }

    #[tokio::test(start_paused = true)]
    async fn asks_are_served_one_walk_at_a_time_and_spaced_out() {
        RUNTIME_THREAD.get_or_init(|| std::thread::current().id());
        let release = MemoryRelease::default();
        let shutdown = Shutdown::default();
        let took = crate::metrics::ControlMetrics::default().memory_releases;
        let task = tokio::spawn(serve(
            release.asked.clone(),
            count_release,
            took.clone(),
            shutdown.clone(),
        ));
        assert_eq!(released(0).await, 0, "nothing asked");
        // Asks in a burst (three kinds' lists ending together): one walk,
        // then one more for those made while it ran or waited.
        for _ in 0..5 {
            release.ask();
        }
        assert_eq!(released(1).await, 1);
        release.ask();
        release.ask();
        tokio::time::sleep(MemoryRelease::SPACING / 2).await;
        assert_eq!(released(1).await, 1, "spaced out");
        tokio::time::sleep(MemoryRelease::SPACING).await;
        assert_eq!(released(2).await, 2);
        tokio::time::sleep(MemoryRelease::SPACING * 3).await;
        assert_eq!(released(2).await, 2, "nothing more asked");
        let mut text = String::new();
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("release_seconds", "", took);
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("release_seconds_count 2"), "{text}");
        assert_eq!(
            ON_RUNTIME_THREAD.load(Ordering::SeqCst),
            0,
            "walks on the blocking pool"
        );
        shutdown.trigger();
        task.await.expect("the task ends at shutdown");
    }
}
