//! Adaptive polling: how long a worker that just did some work keeps polling before it
//! sleeps, grown and shrunk from how long it then waited, the way QEMU's event loop
//! sizes its `poll-max-ns` window (`util/aio-posix.c`, `adjust_polling_time`).
//!
//! A worker measures its **wait**: the time from the end of its last work to the next
//! work it found, polling included. Then:
//!
//! - a wait within the window: the window caught it, it stays;
//! - a wait longer than the maximum: polling would not have caught it, the window
//!   drops to 0 (the worker sleeps at once next time);
//! - a wait longer than the window but within the maximum: the window doubles (from
//!   [`FIRST_WINDOW`]), up to the maximum.
//!
//! A worker that sees no work polls no more than its window after the last work it did,
//! and after one long wait not at all: an idle worker costs no CPU. A maximum of 0
//! turns polling off.

use std::time::Duration;

/// The window after the first wait that polling could have caught (QEMU's 4 µs).
pub const FIRST_WINDOW: Duration = Duration::from_micros(4);

/// Largest maximum a worker may be given: 1 ms.
pub const MAX_WINDOW: Duration = Duration::from_millis(1);

/// One worker's polling window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollWindow {
    window: Duration,
    max: Duration,
}

impl PollWindow {
    /// A window that grows up to `max` (at most [`MAX_WINDOW`]); 0 never polls.
    pub fn new(max: Duration) -> Self {
        PollWindow {
            window: Duration::ZERO,
            max: max.min(MAX_WINDOW),
        }
    }

    /// How long to keep polling after the last work before sleeping.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The most the window grows to.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// Whether polling is on at all.
    pub fn enabled(&self) -> bool {
        !self.max.is_zero()
    }

    /// Records a wait (from the end of the last work to the next work, polling
    /// included) and adjusts the window.
    pub fn waited(&mut self, wait: Duration) {
        if self.max.is_zero() || wait <= self.window {
            return;
        }
        if wait > self.max {
            self.window = Duration::ZERO;
        } else if self.window < self.max {
            self.window = if self.window.is_zero() {
                FIRST_WINDOW.min(self.max)
            } else {
                (self.window * 2).min(self.max)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn short_waits_grow_the_window_to_the_maximum() {
        let mut w = PollWindow::new(50 * US);
        assert_eq!(w.window(), Duration::ZERO, "a fresh worker sleeps at once");
        w.waited(45 * US);
        assert_eq!(w.window(), 4 * US);
        w.waited(45 * US);
        assert_eq!(w.window(), 8 * US);
        for _ in 0..3 {
            w.waited(45 * US);
        }
        assert_eq!(w.window(), 50 * US, "capped at the maximum");
        w.waited(40 * US);
        assert_eq!(w.window(), 50 * US, "a wait the window caught leaves it");
        // Waits of 20 µs stop the growth once the window catches them.
        let mut w = PollWindow::new(50 * US);
        for _ in 0..10 {
            w.waited(20 * US);
        }
        assert_eq!(w.window(), 32 * US);
    }

    #[test]
    fn a_wait_past_the_maximum_stops_polling() {
        let mut w = PollWindow::new(50 * US);
        for _ in 0..10 {
            w.waited(45 * US);
        }
        assert_eq!(w.window(), 50 * US);
        w.waited(51 * US);
        assert_eq!(w.window(), Duration::ZERO, "an idle gap: sleep at once");
        w.waited(Duration::from_secs(60));
        assert_eq!(w.window(), Duration::ZERO);
    }

    #[test]
    fn a_zero_maximum_never_polls_and_the_maximum_is_bounded() {
        let mut w = PollWindow::new(Duration::ZERO);
        assert!(!w.enabled());
        for _ in 0..10 {
            w.waited(US);
        }
        assert_eq!(w.window(), Duration::ZERO);
        let w = PollWindow::new(Duration::from_secs(1));
        assert_eq!(w.max(), MAX_WINDOW);
        let mut w = PollWindow::new(2 * US);
        w.waited(US + US / 2);
        w.waited(2 * US);
        assert_eq!(
            w.window(),
            2 * US,
            "the first window is cut to a small maximum"
        );
    }
}
