//! The lender's DMA counters notes ([`devlend_fabric::pci::KIND_COUNTERS`]) of one
//! session, added to the function's [`PciStats`].
//!
//! A note carries the lender's totals since the session opened; the borrower's counters
//! run since the compute agent started serving the function, across sessions. So each
//! session keeps the last totals it was sent and adds what grew since: a new session
//! (its totals from zero) adds on top of the old one's, and the counters never go back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use devlend_fabric::pci::DmaCounters;

use crate::pci::PciStats;

/// One session's notes: whether the lender may send them, and the last totals it sent.
pub(crate) struct CounterNotes {
    /// The handshake granted [`devlend_fabric::pci::FEATURE_PCI_COUNTERS`]; otherwise
    /// a note is an unexpected message.
    granted: bool,
    /// The session's last totals (all zero before the first note).
    last: Mutex<DmaCounters>,
    /// Where they add up.
    stats: Arc<PciStats>,
}

impl CounterNotes {
    /// The notes of a new session, granted or not, adding to `stats`.
    pub(crate) fn new(granted: bool, stats: Arc<PciStats>) -> Self {
        CounterNotes {
            granted,
            last: Mutex::new(DmaCounters::default()),
            stats,
        }
    }

    /// Whether the lender may send notes in this session.
    pub(crate) fn granted(&self) -> bool {
        self.granted
    }

    /// Adds what each of the lender's totals grew since its last note. A total that
    /// went back (which a lender should not send) adds nothing, and its highest value
    /// stays the base, so that nothing is counted twice.
    pub(crate) fn add(&self, now: DmaCounters) {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let grow = |counter: &AtomicU64, last: &mut u64, now: u64| {
            if now > *last {
                counter.fetch_add(now - *last, Ordering::Relaxed);
                *last = now;
            }
        };
        let s = &self.stats;
        grow(
            &s.lender_guest_read_bytes,
            &mut last.guest_read,
            now.guest_read,
        );
        grow(
            &s.lender_guest_written_bytes,
            &mut last.guest_written,
            now.guest_written,
        );
        grow(&s.peer_bytes, &mut last.peer, now.peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(guest_read: u64, guest_written: u64, peer: u64) -> DmaCounters {
        DmaCounters {
            guest_read,
            guest_written,
            peer,
        }
    }

    fn totals(s: &PciStats) -> (u64, u64, u64) {
        (
            s.lender_guest_read_bytes.load(Ordering::Relaxed),
            s.lender_guest_written_bytes.load(Ordering::Relaxed),
            s.peer_bytes.load(Ordering::Relaxed),
        )
    }

    #[test]
    fn notes_add_what_grew_and_a_new_session_adds_on_top() {
        let stats = Arc::new(PciStats::default());
        let one = CounterNotes::new(true, Arc::clone(&stats));
        one.add(c(10, 20, 30));
        one.add(c(15, 20, 100));
        assert_eq!(totals(&stats), (15, 20, 100));
        // A total that goes back adds nothing, and is not counted again when it climbs
        // back to where it was.
        one.add(c(5, 20, 100));
        one.add(c(16, 20, 100));
        assert_eq!(totals(&stats), (16, 20, 100));
        // The next session counts from zero: its totals add to the first's.
        let two = CounterNotes::new(true, Arc::clone(&stats));
        two.add(c(4, 1, 0));
        assert_eq!(totals(&stats), (20, 21, 100));
    }
}
