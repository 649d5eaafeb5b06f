//! One reconnector for every session a borrower keeps open: when to try again after a
//! failure (backoff), when to stop trying (deadline), and what a refusal for good ends.
//!
//! The rules, the same for every caller (only the numbers of their [`Policy`] differ):
//! - **Growth.** After a failed attempt the next one waits [`Policy::first`], then twice
//!   as long after each further failure, up to [`Policy::max`].
//! - **Reset.** A session that opened and then lived at least [`Policy::stable`] resets
//!   the backoff when it is lost: the next attempt is at once, but never sooner than
//!   `first` after the session opened (a lender that takes the handshake and drops it
//!   at once is not retried in a tight loop). A session lost sooner than `stable`
//!   counts as a failed attempt: the backoff goes on growing.
//! - **Deadline.** Work that waits for the session (requests, a restore) waits at most
//!   [`Policy::deadline`] from when it began waiting; then it is given up.
//! - **Refusal.** A peer that refuses for good (denied, no such device, a TLS
//!   certificate refused) ends the retries of the work waiting: waiting longer cannot
//!   change its answer.
//!
//! Two ways to use it:
//! - **polled**, from an event loop that owns a timer: [`Reconnector::due`] before an
//!   attempt, [`Reconnector::connected`] / [`Reconnector::failed`] after it,
//!   [`Reconnector::lost`] when the session drops, and [`Reconnector::next_event`] to
//!   arm the timer (the next attempt or the deadline, whichever comes first). Every call
//!   takes the time, so a test drives it with instants of its own;
//! - **blocking**, on a thread of its own: [`Reconnector::run`] makes attempts and
//!   sleeps between them on a [`Clock`] (the [`SystemClock`], or one a test controls).

use std::time::{Duration, Instant};

/// The numbers of one caller's reconnects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// The wait after the first failed attempt.
    pub first: Duration,
    /// The longest wait between two attempts.
    pub max: Duration,
    /// How long a session must have lived for its loss to reset the backoff
    /// (`Duration::ZERO`: every session that opened resets it).
    pub stable: Duration,
    /// How long waiting work waits for the session before it is given up; `None`: for
    /// ever.
    pub deadline: Option<Duration>,
}

impl Policy {
    /// Waits from `first` doubling to `max`; every session resets the backoff; no
    /// deadline.
    pub const fn backoff(first: Duration, max: Duration) -> Self {
        Policy {
            first,
            max,
            stable: Duration::ZERO,
            deadline: None,
        }
    }

    /// The same policy, with sessions that must live `stable` to reset the backoff.
    pub const fn stable_after(mut self, stable: Duration) -> Self {
        self.stable = stable;
        self
    }

    /// The same policy, giving waiting work up after `deadline`.
    pub const fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }
}

/// Time as a blocking [`Reconnector::run`] sees it.
pub trait Clock {
    /// Now.
    fn now(&self) -> Instant;
    /// Waits `d`; returns `false` if it stopped waiting early because the caller is
    /// being stopped (the run then ends).
    fn sleep(&self, d: Duration) -> bool;
}

/// The monotonic clock and `std::thread::sleep`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep(&self, d: Duration) -> bool {
        std::thread::sleep(d);
        true
    }
}

/// What one attempt of [`Reconnector::run`] came to.
#[derive(Debug)]
pub enum Attempt<T, E> {
    /// It succeeded.
    Done(T),
    /// It failed for now: try again after the backoff.
    Failed(E),
    /// The peer refuses for good: stop trying.
    Refused(E),
    /// The caller is stopping: stop trying.
    Stop,
}

/// Why [`Reconnector::run`] stopped trying.
#[derive(Debug, PartialEq, Eq)]
pub enum GaveUp<E> {
    /// The peer refused for good (the refusal).
    Refused(E),
    /// The deadline passed (the last failure).
    Deadline(E),
    /// The attempt said [`Attempt::Stop`], or the clock's sleep was cut short.
    Stopped,
}

impl<E> GaveUp<E> {
    /// The error that ended the retries, if one did.
    pub fn into_error(self) -> Option<E> {
        match self {
            GaveUp::Refused(e) | GaveUp::Deadline(e) => Some(e),
            GaveUp::Stopped => None,
        }
    }
}

/// One session's reconnect state (see the module doc).
#[derive(Debug, Clone)]
pub struct Reconnector {
    policy: Policy,
    /// The wait after the next failure.
    wait: Duration,
    /// Failed attempts since the last session opened.
    failures: u32,
    /// No attempt before this; `None`: one may be made at once.
    retry_at: Option<Instant>,
    /// When the current (or last) session opened, until its loss is seen.
    opened_at: Option<Instant>,
    /// When the work now waiting for the session began waiting.
    waiting_since: Option<Instant>,
}

impl Reconnector {
    /// A reconnector with no attempt made yet: the first may be made at once.
    pub fn new(policy: Policy) -> Self {
        Reconnector {
            policy,
            wait: policy.first,
            failures: 0,
            retry_at: None,
            opened_at: None,
            waiting_since: None,
        }
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Changes the deadline of waiting work (`None`: for ever).
    pub fn set_deadline(&mut self, deadline: Option<Duration>) {
        self.policy.deadline = deadline;
    }

    /// Whether an attempt may be made at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.retry_at.is_none_or(|t| now >= t)
    }

    /// When the next attempt may be made; `None`: none is scheduled (no attempt failed
    /// and no session was lost since the last one opened, or none was made yet).
    pub fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// The wait that the next failure schedules.
    pub fn next_wait(&self) -> Duration {
        self.wait
    }

    /// Failed attempts since the last session opened.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// An attempt at `now` opened the session: the work waiting for it is served.
    pub fn connected(&mut self, now: Instant) {
        self.failures = 0;
        self.retry_at = None;
        self.opened_at = Some(now);
        self.waiting_since = None;
    }

    /// An attempt at `now` failed: schedules the next one, and returns when it is due.
    pub fn failed(&mut self, now: Instant) -> Instant {
        self.failures = self.failures.saturating_add(1);
        let at = now + self.wait;
        self.retry_at = Some(at);
        self.wait = self.wait.saturating_mul(2).min(self.policy.max);
        at
    }

    /// The session was lost at `now` (nothing if none was open). One that lived
    /// [`Policy::stable`] resets the backoff; one lost sooner counts as a failure.
    pub fn lost(&mut self, now: Instant) {
        let Some(opened) = self.opened_at.take() else {
            return;
        };
        if now.saturating_duration_since(opened) >= self.policy.stable {
            self.wait = self.policy.first;
            self.retry_at = Some((opened + self.policy.first).max(now));
        } else {
            self.failed(now);
        }
    }

    /// Work began waiting for the session at `now` (the deadline runs from the first
    /// such call until [`Self::connected`] or [`Self::idle`]).
    pub fn waiting(&mut self, now: Instant) {
        self.waiting_since.get_or_insert(now);
    }

    /// Nothing waits for the session any more (it completed or was given up).
    pub fn idle(&mut self) {
        self.waiting_since = None;
    }

    /// When the waiting work is to be given up, if work waits and there is a deadline.
    pub fn give_up_at(&self) -> Option<Instant> {
        Some(self.waiting_since? + self.policy.deadline?)
    }

    /// Whether the waiting work has waited out the deadline at `now`.
    pub fn expired(&self, now: Instant) -> bool {
        self.give_up_at().is_some_and(|t| now >= t)
    }

    /// When the caller must look again: the next attempt or the deadline, whichever is
    /// first; `None`: neither is scheduled.
    pub fn next_event(&self) -> Option<Instant> {
        match (self.retry_at, self.give_up_at()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Makes attempts until one succeeds, the peer refuses for good, the deadline
    /// (from this call) passes or the attempt says stop; sleeps on `clock` between
    /// attempts, never past the deadline. `attempt` sees this reconnector (e.g. its
    /// [`Self::failures`], to log the first failure differently).
    ///
    /// # Errors
    /// Why it stopped trying.
    pub fn run<T, E>(
        &mut self,
        clock: &dyn Clock,
        mut attempt: impl FnMut(&Self) -> Attempt<T, E>,
    ) -> Result<T, GaveUp<E>> {
        self.waiting(clock.now());
        loop {
            let now = clock.now();
            // Until the next attempt is due, but not past the deadline.
            let until = self
                .retry_at
                .map(|t| self.give_up_at().map_or(t, |g| t.min(g)));
            if let Some(wait) = until.map(|t| t.saturating_duration_since(now)) {
                if !wait.is_zero() {
                    if !clock.sleep(wait) {
                        return Err(GaveUp::Stopped);
                    }
                    continue;
                }
            }
            match attempt(self) {
                Attempt::Done(v) => {
                    self.connected(clock.now());
                    return Ok(v);
                }
                Attempt::Stop => return Err(GaveUp::Stopped),
                Attempt::Refused(e) => {
                    self.failed(clock.now());
                    self.idle();
                    return Err(GaveUp::Refused(e));
                }
                Attempt::Failed(e) => {
                    let now = clock.now();
                    self.failed(now);
                    if self.expired(now) {
                        self.idle();
                        return Err(GaveUp::Deadline(e));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};

    const MS: Duration = Duration::from_millis(1);

    /// A clock that moves only when slept on, and remembers the sleeps.
    struct FakeClock {
        now: Cell<Instant>,
        slept: RefCell<Vec<Duration>>,
    }

    impl FakeClock {
        fn new() -> Self {
            FakeClock {
                now: Cell::new(Instant::now()),
                slept: RefCell::new(Vec::new()),
            }
        }
    }

    impl Clock for FakeClock {
        fn now(&self) -> Instant {
            self.now.get()
        }
        fn sleep(&self, d: Duration) -> bool {
            self.now.set(self.now.get() + d);
            self.slept.borrow_mut().push(d);
            true
        }
    }

    fn policy() -> Policy {
        Policy::backoff(100 * MS, 2000 * MS)
    }

    #[test]
    fn waits_grow_from_first_doubling_and_stop_at_max() {
        let t0 = Instant::now();
        let mut r = Reconnector::new(policy());
        assert!(r.due(t0), "the first attempt is at once");
        let mut now = t0;
        let mut waits = Vec::new();
        for _ in 0..8 {
            let at = r.failed(now);
            assert!(!r.due(now));
            assert!(!r.due(at - MS) && r.due(at));
            waits.push((at - now).as_millis());
            now = at;
        }
        assert_eq!(waits, [100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        assert_eq!(r.failures(), 8);
    }

    #[test]
    fn a_session_that_lived_resets_the_backoff_but_not_sooner_than_first_after_it_opened() {
        let t0 = Instant::now();
        let mut r = Reconnector::new(policy());
        for i in 0..5 {
            r.failed(t0 + i * MS);
        }
        assert_eq!(r.next_wait(), 2000 * MS);
        r.connected(t0 + 10 * MS);
        assert_eq!(r.failures(), 0);
        assert_eq!(
            r.retry_at(),
            None,
            "nothing scheduled while the session is open"
        );
        // Lost 30 ms after it opened: the next attempt waits until 100 ms after that.
        r.lost(t0 + 40 * MS);
        assert_eq!(r.retry_at(), Some(t0 + 110 * MS));
        assert_eq!(r.next_wait(), 100 * MS, "reset to first");
        // Lost long after it opened: at once.
        r.connected(t0 + 200 * MS);
        r.lost(t0 + 5000 * MS);
        assert_eq!(r.retry_at(), Some(t0 + 5000 * MS), "at once");
        // A loss with no session open changes nothing.
        r.failed(t0 + 5000 * MS);
        let before = (r.retry_at(), r.next_wait());
        r.lost(t0 + 5001 * MS);
        assert_eq!((r.retry_at(), r.next_wait()), before);
    }

    #[test]
    fn a_session_lost_before_it_was_stable_counts_as_a_failure() {
        let t0 = Instant::now();
        let mut r = Reconnector::new(policy().stable_after(2000 * MS));
        r.failed(t0); // 100 ms, next 200
        r.connected(t0 + 100 * MS);
        r.lost(t0 + 150 * MS);
        assert_eq!(
            r.retry_at(),
            Some(t0 + 350 * MS),
            "200 ms: the backoff grew on"
        );
        assert_eq!(r.next_wait(), 400 * MS);
        r.connected(t0 + 350 * MS);
        r.lost(t0 + 2350 * MS);
        assert_eq!(r.retry_at(), Some(t0 + 2350 * MS), "lived 2 s: at once");
        assert_eq!(r.next_wait(), 100 * MS);
    }

    #[test]
    fn waiting_work_is_given_up_at_the_deadline_and_the_timer_never_sleeps_past_it() {
        let t0 = Instant::now();
        let mut r = Reconnector::new(policy().deadline(1000 * MS));
        assert_eq!(r.give_up_at(), None, "nothing waits");
        assert!(!r.expired(t0 + 100_000 * MS));
        r.waiting(t0);
        r.waiting(t0 + 500 * MS); // the deadline runs from the first call
        assert_eq!(r.give_up_at(), Some(t0 + 1000 * MS));
        let mut now = t0;
        while !r.expired(now) {
            let at = r.failed(now);
            now = r.next_event().unwrap();
            assert!(now <= at && now <= t0 + 1000 * MS);
        }
        assert_eq!(now, t0 + 1000 * MS);
        r.idle();
        assert!(!r.expired(now));
        // A session that opens serves the waiting work: its deadline is gone.
        r.waiting(now);
        r.connected(now);
        assert_eq!(r.give_up_at(), None);
        // No deadline at all: work waits for ever.
        let mut r = Reconnector::new(policy());
        r.waiting(t0);
        assert!(!r.expired(t0 + 1_000_000 * MS));
        assert_eq!(r.next_event(), None);
    }

    #[test]
    fn a_blocking_run_sleeps_the_backoff_between_attempts() {
        let clock = FakeClock::new();
        let mut r = Reconnector::new(Policy::backoff(100 * MS, 500 * MS));
        let mut n = 0;
        let got = r.run(&clock, |r| {
            assert_eq!(r.failures(), n);
            n += 1;
            if n < 6 {
                Attempt::Failed("not yet")
            } else {
                Attempt::Done(n)
            }
        });
        assert_eq!(got, Ok(6));
        let slept: Vec<u128> = clock
            .slept
            .borrow()
            .iter()
            .map(Duration::as_millis)
            .collect();
        assert_eq!(slept, [100, 200, 400, 500, 500]);
        assert_eq!(r.failures(), 0);
    }

    #[test]
    fn a_permanent_refusal_ends_the_retries_at_once() {
        let clock = FakeClock::new();
        let mut r = Reconnector::new(policy());
        let mut n = 0;
        let got: Result<(), _> = r.run(&clock, |_| {
            n += 1;
            if n < 3 {
                Attempt::Failed("busy")
            } else {
                Attempt::Refused("denied")
            }
        });
        assert_eq!(got, Err(GaveUp::Refused("denied")));
        assert_eq!(n, 3, "no attempt after the refusal");
        assert_eq!(clock.slept.borrow().len(), 2);
        assert_eq!(r.give_up_at(), None, "nothing waits any more");
        // The next run still backs off from where the refusal left it.
        assert!(!r.due(clock.now()));
    }

    #[test]
    fn a_blocking_run_stops_at_its_deadline_with_the_last_error_or_when_told() {
        let clock = FakeClock::new();
        let start = clock.now();
        let mut r = Reconnector::new(Policy::backoff(100 * MS, 100 * MS).deadline(350 * MS));
        let mut n = 0;
        let got: Result<(), _> = r.run(&clock, |_| {
            n += 1;
            Attempt::Failed(n)
        });
        // Attempts at 0, 100, 200, 300 and (the deadline) 350 ms.
        assert_eq!(got, Err(GaveUp::Deadline(5)));
        assert_eq!(clock.now() - start, 350 * MS);
        let clock = FakeClock::new();
        let got: Result<(), GaveUp<()>> = Reconnector::new(policy()).run(&clock, |_| Attempt::Stop);
        assert_eq!(got, Err(GaveUp::Stopped));
        assert!(clock.slept.borrow().is_empty());
        // A sleep cut short (the caller is being stopped) ends the run too.
        struct Stopping;
        impl Clock for Stopping {
            fn now(&self) -> Instant {
                Instant::now()
            }
            fn sleep(&self, _: Duration) -> bool {
                false
            }
        }
        let mut n = 0;
        let got: Result<(), _> = Reconnector::new(policy()).run(&Stopping, |_| {
            n += 1;
            Attempt::Failed(())
        });
        assert_eq!((got, n), (Err(GaveUp::Stopped), 1));
    }
}
