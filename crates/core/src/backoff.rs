//! Jittered exponential backoff, as a calculation only: the caller draws
//! the randomness and sleeps. Used by every reconnect loop (proxy discovery
//! and identity, multicluster links), so they grow and spread alike.
//!
//! Jitter keeps many clients that lost the same server from coming back in
//! step; a pause is drawn in `[step / 2, step)`, then the step doubles up
//! to the maximum.

use std::time::Duration;

/// The step of an exponential backoff between `min` and `max`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    step: Duration,
}

impl Backoff {
    /// Starts at `min`; `max` below `min` is taken as `min`.
    pub const fn new(min: Duration, max: Duration) -> Self {
        let max = if max.as_nanos() < min.as_nanos() {
            min
        } else {
            max
        };
        Self {
            min,
            max,
            step: min,
        }
    }

    /// The pause before the next attempt, drawn by `unit` (uniform in
    /// `[0, 1)`, e.g. `rand::random()`) in `[step / 2, step)`; the step then
    /// doubles, up to the maximum.
    pub fn next_pause(&mut self, unit: f64) -> Duration {
        let pause = jittered(self.step, unit);
        self.step = self.step.saturating_mul(2).min(self.max);
        pause
    }

    /// Back to the minimum, after an attempt that worked.
    pub fn reset(&mut self) {
        self.step = self.min;
    }
}

/// `d` scaled by jitter into `[d / 2, d)`; `unit` is uniform in `[0, 1)`
/// (values outside are clamped, so a bad draw never exceeds `d`).
pub fn jittered(d: Duration, unit: f64) -> Duration {
    let unit = if unit.is_nan() {
        0.0
    } else {
        unit.clamp(0.0, 1.0)
    };
    // As `Duration::mul_f64` computes it, but a rounding past `Duration::MAX`
    // is `d` rather than a panic.
    Duration::try_from_secs_f64(d.as_secs_f64() * (0.5 + 0.5 * unit)).map_or(d, |p| p.min(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_step_doubles_up_to_the_maximum_and_resets() {
        let mut b = Backoff::new(100 * MS, 500 * MS);
        // The largest draw gives the step itself; the smallest, half of it.
        let steps: Vec<_> = (0..5).map(|_| b.next_pause(1.0)).collect();
        assert_eq!(steps, [100 * MS, 200 * MS, 400 * MS, 500 * MS, 500 * MS]);
        b.reset();
        assert_eq!(b.next_pause(0.0), 50 * MS);
        assert_eq!(b.next_pause(0.0), 100 * MS);
    }

    #[test]
    fn pauses_stay_within_half_a_step_and_a_step() {
        for unit in [0.0, 0.25, 0.5, 0.999_999] {
            let pause = jittered(100 * MS, unit);
            assert!(pause >= 50 * MS && pause < 100 * MS, "{unit}: {pause:?}");
        }
        assert_eq!(jittered(100 * MS, -3.0), 50 * MS);
        assert_eq!(jittered(100 * MS, 7.0), 100 * MS);
        assert_eq!(jittered(100 * MS, f64::NAN), 50 * MS);
    }

    #[test]
    fn a_maximum_below_the_minimum_holds_the_minimum() {
        let mut b = Backoff::new(200 * MS, 100 * MS);
        assert_eq!(b.next_pause(1.0), 200 * MS);
        assert_eq!(b.next_pause(1.0), 200 * MS);
    }

    #[test]
    fn a_huge_step_saturates_instead_of_overflowing() {
        let mut b = Backoff::new(Duration::MAX / 2 + MS, Duration::MAX);
        b.next_pause(0.0);
        assert_eq!(b.next_pause(1.0), Duration::MAX);
    }
}
