//! Waits polled on every wake-up of a connection's task, several per
//! request, made cheap for it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Waker};

use tokio::time::{Instant, Sleep};

/// A timer polled only when that may be news: once it has fired, or for
/// another waker than the one its wake-up is registered with (the
/// `Future` contract: only the latest waker need be woken). Polling a
/// tokio `Sleep` costs ~120 instructions; looking at its state, one
/// atomic load.
pub struct ArmedSleep {
    sleep: Pin<Box<Sleep>>,
    /// The waker the timer's wake-up is registered with, while it has not
    /// fired since.
    armed: Option<Waker>,
}

impl ArmedSleep {
    pub fn new(deadline: Instant) -> Self {
        Self {
            sleep: Box::pin(tokio::time::sleep_until(deadline)),
            armed: None,
        }
    }

    /// Whether the timer has ended; when not, `cx`'s waker is woken when
    /// it does.
    pub fn ended(&mut self, cx: &mut Context<'_>) -> bool {
        let registered = self.armed.as_ref().is_some_and(|w| w.will_wake(cx.waker()));
        if registered && !self.sleep.is_elapsed() {
            return false;
        }
        if self.sleep.as_mut().poll(cx).is_pending() {
            self.armed = Some(cx.waker().clone());
            return false;
        }
        self.armed = None;
        true
    }

    /// Whether the timer is set, has been polled since, and has not fired.
    pub fn running(&self) -> bool {
        self.armed.is_some() && !self.sleep.is_elapsed()
    }

    /// Sets the timer for `deadline`; it is polled again on the next
    /// [`Self::ended`].
    pub fn set(&mut self, deadline: Instant) {
        self.sleep.as_mut().reset(deadline);
        self.armed = None;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::ArmedSleep;

    const WAIT: Duration = Duration::from_secs(10);

    #[tokio::test(start_paused = true)]
    async fn the_timer_ends_at_its_deadline_and_again_once_set() {
        let mut timer = ArmedSleep::new(Instant::now() + WAIT);
        let start = Instant::now();
        std::future::poll_fn(|cx| {
            if timer.ended(cx) {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await;
        assert_eq!(start.elapsed(), WAIT);
        assert!(!timer.running());
        timer.set(Instant::now() + WAIT);
        assert!(!timer.running(), "not running until polled");
        let start = Instant::now();
        std::future::poll_fn(|cx| {
            let ended = timer.ended(cx);
            assert!(ended || timer.running());
            if ended {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await;
        assert_eq!(start.elapsed(), WAIT);
    }
}
