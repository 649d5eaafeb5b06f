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
//!
//! **Contention.** QEMU's window does not look at the CPUs; on a machine with few of
//! them, a polling thread takes the CPU that another thread (the client, the other
//! agent, a guest's vCPU) needs. So a worker brackets each **spell** of polling with
//! [`PollWindow::begin_spell`] and [`PollWindow::end_spell`], and the window counts the
//! thread's involuntary context switches (`getrusage(RUSAGE_THREAD)`, `ru_nivcsw`)
//! across it: a spell in which the scheduler took the CPU away means another thread
//! was waiting for it. The window then reads 0 (it is kept for after) for a **hold**:
//! [`FIRST_HOLD`] after a lone preemption, doubled up to [`MAX_HOLD`] while
//! preemptions follow each other (one within a hold of the last hold's end), halved
//! by each spell that was not preempted; polling returns once the CPUs are free again.
//! And a spell does not start while two threads or more wait for a CPU (more are
//! runnable, by `/proc/loadavg`'s running count, than there are CPUs plus one:
//! [`crate::cpu_load::cpus_contended`]): polling would make them wait longer. The spell
//! counts as preempted. A busy queue's short gaps are checked too (one `pread` per
//! spell): on a saturated machine its first spell is refused and the holds that follow
//! keep it from spinning, where unchecked short spins cost 4K QD32 writes 7 %.

use std::time::{Duration, Instant};

use crate::cpu_load::{cpus_contended, involuntary_switches};

/// The window after the first wait that polling could have caught (QEMU's 4 µs).
pub const FIRST_WINDOW: Duration = Duration::from_micros(4);

/// Largest maximum a worker may be given: 1 ms.
pub const MAX_WINDOW: Duration = Duration::from_millis(1);

/// How long a worker stops polling after its first preempted spell.
pub const FIRST_HOLD: Duration = Duration::from_micros(100);

/// The longest hold: a contended worker tries polling again at least this often
/// (one window of spinning per 100 ms: at most 1 % of a CPU at the largest window).
pub const MAX_HOLD: Duration = Duration::from_millis(100);

/// One worker's polling window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollWindow {
    window: Duration,
    max: Duration,
    /// The next hold after a preempted spell.
    hold: Duration,
    /// No polling before then (a spell was preempted).
    held_until: Option<Instant>,
    /// The thread's involuntary context switches when the open spell began.
    spell: Option<u64>,
}

impl PollWindow {
    /// A window that grows up to `max` (at most [`MAX_WINDOW`]); 0 never polls.
    pub fn new(max: Duration) -> Self {
        PollWindow {
            window: Duration::ZERO,
            max: max.min(MAX_WINDOW),
            hold: FIRST_HOLD,
            held_until: None,
            spell: None,
        }
    }

    /// How long to keep polling after the last work before sleeping.
    pub fn window(&self) -> Duration {
        if self.held() {
            Duration::ZERO
        } else {
            self.window
        }
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
        if self.held_until.is_some_and(|until| Instant::now() < until) {
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

    /// Marks the start of a spell of polling; a spell already open goes on. Costs two
    /// system calls when it opens one. While more threads are runnable than there are
    /// CPUs, it opens none and drops the window as if a spell had been preempted.
    pub fn begin_spell(&mut self) {
        if self.spell.is_none() {
            if cpus_contended() {
                self.spell_ended(true, Instant::now());
            } else {
                self.spell = Some(involuntary_switches());
            }
        }
    }

    /// Ends the open spell (nothing if none is open): if the thread was preempted
    /// during it, the window reads 0 for a hold ([`PollWindow`]).
    pub fn end_spell(&mut self) {
        if let Some(at_start) = self.spell.take() {
            self.spell_ended(involuntary_switches() > at_start, Instant::now());
        }
    }

    /// Adjusts the window and the hold after a spell that was (or was not) preempted.
    fn spell_ended(&mut self, preempted: bool, now: Instant) {
        if preempted {
            // Contention that lasts (a preemption within one hold of the last hold's
            // end) doubles the hold; a lone one holds for the first hold only.
            let lasts = self.held_until.is_some_and(|until| now < until + self.hold);
            self.hold = if lasts {
                (self.hold * 2).min(MAX_HOLD)
            } else {
                FIRST_HOLD
            };
            self.held_until = Some(now + self.hold);
        } else {
            self.hold = (self.hold / 2).max(FIRST_HOLD);
        }
    }

    /// Whether polling is held off after a preempted spell.
    pub fn held(&self) -> bool {
        self.held_until.is_some_and(|t| Instant::now() < t)
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

    /// A window of at most 200 µs, grown to it by waits of 150 µs.
    fn grown_to_200us() -> PollWindow {
        let mut w = PollWindow::new(200 * US);
        for _ in 0..10 {
            w.waited(150 * US);
        }
        w
    }

    #[test]
    fn a_preempted_spell_holds_polling_off_for_a_while() {
        let mut w = grown_to_200us();
        assert_eq!(w.window(), 200 * US);
        // A hold that ends long after this test does.
        let later = Instant::now() + Duration::from_secs(60);
        w.spell_ended(true, later);
        assert_eq!(w.window(), Duration::ZERO, "preempted: sleep at once");
        assert!(w.held());
        for _ in 0..10 {
            w.waited(150 * US);
            w.waited(Duration::from_secs(1));
        }
        assert_eq!(w.window(), Duration::ZERO, "no change while held");
        // Holds double up to the maximum while preemptions follow each other, and spells
        // that were not preempted halve them.
        for _ in 0..20 {
            w.spell_ended(true, later);
        }
        assert_eq!(w.hold, MAX_HOLD);
        w.spell_ended(false, later);
        assert_eq!(w.hold, MAX_HOLD / 2);
        for _ in 0..20 {
            w.spell_ended(false, later);
        }
        assert_eq!(w.hold, FIRST_HOLD);
        // A lone preemption long after the last hold holds for the first hold only.
        let mut w = PollWindow::new(200 * US);
        for _ in 0..5 {
            w.spell_ended(true, later);
        }
        assert_eq!(w.hold, 16 * FIRST_HOLD);
        w.spell_ended(true, later + Duration::from_secs(1));
        assert_eq!(w.hold, FIRST_HOLD);
        // Once the hold has passed, the window is back whole: no regrowth from 0.
        let mut w = grown_to_200us();
        w.spell_ended(true, Instant::now() - FIRST_HOLD * 2);
        assert!(!w.held());
        assert_eq!(w.window(), 200 * US);
    }

    /// Two threads spinning on one CPU: the scheduler must switch between them, and
    /// each sees its involuntary switches grow; a spell over such a spin is preempted.
    #[test]
    fn spinning_beside_another_spinner_on_one_cpu_counts_as_preempted() {
        fn pin_to_cpu(cpu: usize) {
            // SAFETY: an all-zero cpu_set_t is a valid empty set.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: CPU_SET writes one bit of the valid set.
            unsafe { libc::CPU_SET(cpu, &mut set) };
            // SAFETY: the set is valid for the call; 0 is the calling thread.
            let rc =
                unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
            assert_eq!(
                rc,
                0,
                "sched_setaffinity: {}",
                std::io::Error::last_os_error()
            );
        }
        // The CPU count is read once per process: before any thread here is pinned.
        assert!(crate::cpu_load::cpus() >= 1);
        // SAFETY: sched_getcpu has no arguments.
        let cpu = usize::try_from(unsafe { libc::sched_getcpu() }).unwrap_or(0);
        let spin = move || {
            pin_to_cpu(cpu);
            let mut w = grown_to_200us();
            let before = involuntary_switches();
            // Refused at once where two threads wait for a CPU already, or
            // preempted while it spins: a hold is set either way.
            w.begin_spell();
            let start = Instant::now();
            while start.elapsed() < Duration::from_millis(300) {
                std::hint::spin_loop();
            }
            w.end_spell();
            (involuntary_switches() - before, w.held_until.is_some())
        };
        let other = std::thread::spawn(spin);
        let mine = spin();
        let other = other.join().expect("spinner");
        for (switches, held) in [mine, other] {
            assert!(
                switches > 0,
                "no involuntary switch in 300 ms beside a spinner"
            );
            assert!(held, "a preempted spell holds polling off");
        }
        // A thread that sleeps gives its CPU up: that is not an involuntary switch.
        let before = involuntary_switches();
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            involuntary_switches() - before <= 1,
            "sleeping counted as preemption"
        );
    }
}
