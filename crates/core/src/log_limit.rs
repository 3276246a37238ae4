//! At most one log line per interval for a condition that a client (or a
//! full fd table) can repeat at will: the rest are counted, and the next
//! line that is written says how many were suppressed. Metrics count every
//! occurrence; the log only has to say that it is happening.

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub struct LogLimit {
    interval: Duration,
    /// When the last line was allowed, and how many were refused since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimit {
    pub const fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(suppressed)` when a line may be written now, with the number of
    /// lines suppressed since the last one; `None` when it must be skipped.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match state.0 {
            Some(last) if now.saturating_duration_since(last) < self.interval => {
                state.1 += 1;
                None
            }
            _ => {
                let suppressed = std::mem::take(&mut state.1);
                state.0 = Some(now);
                Some(suppressed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_then_the_count() {
        let limit = LogLimit::new(Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(limit.allow_at(t0), Some(0));
        for i in 1..1000 {
            assert_eq!(limit.allow_at(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(limit.allow_at(t0 + Duration::from_secs(5)), Some(999));
        assert_eq!(limit.allow_at(t0 + Duration::from_secs(6)), None);
    }
}
