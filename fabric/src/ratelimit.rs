//! Rate limits for log lines that outside input can trigger.
//!
//! A guest, a VMM or a fabric peer can repeat whatever makes an agent log, as fast as it
//! likes: every such call site gets its own [`RateLimit`] (a `static`), a token bucket
//! that lets a burst of lines through and then one line per period, and says how many
//! lines it suppressed in between. Normal operation (a few sessions, an occasional bad
//! request) is logged in full; no input can make an agent write more than a bounded
//! amount of log per second, whatever its rate.
//!
//! ```
//! use std::time::Duration;
//! use devlend_fabric::ratelimit::RateLimit;
//! static BAD_FRAME: RateLimit = RateLimit::new(10, Duration::from_secs(1));
//! if let Some(suppressed) = BAD_FRAME.check() {
//!     eprintln!("bad frame ({suppressed} suppressed before this one)");
//! }
//! ```

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One call site's limit: up to `burst` lines at once, then one per `every`.
#[derive(Debug)]
pub struct RateLimit {
    burst: u32,
    every: Duration,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Lines that may go now (starts full).
    tokens: Option<u32>,
    /// When the last token was added.
    refilled: Option<Instant>,
    suppressed: u64,
}

impl RateLimit {
    /// Up to `burst` (≥ 1) lines at once, then one every `every`.
    pub const fn new(burst: u32, every: Duration) -> Self {
        RateLimit {
            burst,
            every,
            state: Mutex::new(State {
                tokens: None,
                refilled: None,
                suppressed: 0,
            }),
        }
    }

    /// Whether the line may be logged now: `Some(n)` with the number of lines suppressed
    /// since the last one logged (log it, with `n`), or `None` (skip it; it is counted).
    pub fn check(&self) -> Option<u64> {
        self.check_at(Instant::now())
    }

    fn check_at(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let burst = self.burst.max(1);
        let mut tokens = s.tokens.unwrap_or(burst);
        let since = *s.refilled.get_or_insert(now);
        if !self.every.is_zero() {
            let periods = now.saturating_duration_since(since).as_nanos() / self.every.as_nanos();
            if periods > 0 {
                tokens = tokens.saturating_add(u32::try_from(periods).unwrap_or(u32::MAX));
                tokens = tokens.min(burst);
                s.refilled = Some(now);
            }
        } else {
            tokens = burst;
        }
        if tokens == 0 {
            s.tokens = Some(0);
            s.suppressed += 1;
            return None;
        }
        s.tokens = Some(tokens - 1);
        Some(std::mem::take(&mut s.suppressed))
    }
}

/// Logs through `tracing` at `level` (`warn`, `info`, ...) under a rate limit of this
/// call site's own: a burst of 20 lines, then one a second; before a line that follows
/// suppressed ones, a line says how many were suppressed. For log lines that a guest, a
/// VMM or a fabric peer can trigger.
///
/// ```
/// # let peer = "127.0.0.1:1";
/// devlend_fabric::limited!(warn, %peer, "bad frame; closing");
/// ```
#[macro_export]
macro_rules! limited {
    ($level:ident, $($arg:tt)+) => {{
        static LIMIT: $crate::ratelimit::RateLimit =
            $crate::ratelimit::RateLimit::new(20, ::std::time::Duration::from_secs(1));
        if let Some(suppressed) = LIMIT.check() {
            if suppressed > 0 {
                ::tracing::$level!(suppressed, "{suppressed} more lines like the next were suppressed");
            }
            ::tracing::$level!($($arg)+);
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_one_line_per_period_and_the_rest_counted() {
        let l = RateLimit::new(3, Duration::from_secs(1));
        let t = Instant::now();
        for _ in 0..3 {
            assert_eq!(l.check_at(t), Some(0));
        }
        for i in 1..=1000u64 {
            assert_eq!(l.check_at(t + Duration::from_micros(i)), None);
        }
        assert_eq!(l.check_at(t + Duration::from_secs(1)), Some(1000));
        assert_eq!(l.check_at(t + Duration::from_millis(1500)), None);
        // A flood for a minute lets through about one line a second, not more.
        let mut logged = 0;
        for ms in 0..60_000u64 {
            if l.check_at(t + Duration::from_secs(2) + Duration::from_millis(ms))
                .is_some()
            {
                logged += 1;
            }
        }
        assert!((59..=62).contains(&logged), "{logged} lines in a minute");
    }
}
