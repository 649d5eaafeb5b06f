//! A lender's tunables beyond its devices and address ([`Options`]): what the server
//! keeps and every session reads. A leaf: it uses nothing of the lender but its config's
//! types.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::config::IoMode;

/// Tunables of a lender beyond its devices and address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// How long a new connection may take to send its hello, and the lender to send its
    /// reply (default 10 s).
    pub handshake_timeout: Duration,
    /// How long the rest of a request frame may take once its first byte arrived
    /// (default 30 s); between frames there is no timeout. A peer that stalls inside a
    /// frame for longer breaks the protocol and its session is closed.
    pub frame_timeout: Duration,
    /// Most sessions open at once, over all devices (default 256); the next hello is
    /// answered `Busy`.
    pub max_sessions: usize,
    /// The most a block session over TCP polls its socket and device I/O after its
    /// last work before it sleeps: an adaptive window that drops to 0 while the CPUs
    /// are contended ([`devlend_fabric::poll_window::PollWindow`]), 0 to sleep at once
    /// (default [`DEFAULT_POLL`]).
    pub poll: Duration,
    /// How sessions do device I/O (default: plain system calls for files in memory,
    /// io_uring otherwise).
    pub io: IoMode,
    /// Backing stores that devices share (`store` in a device), with the capacity their
    /// borrowers divide by weight (default none). Read at start: a reload keeps them.
    pub stores: Vec<crate::config::StoreSpec>,
    /// A test hook, never set by the command line or the config: the first block write
    /// this lender runs waits this long before it is applied, as a slow device would
    /// hold it (the fence's tests, `docs/protocol.md`). `None` by default.
    #[doc(hidden)]
    pub hold_first_write: Option<HoldFirstWrite>,
}

/// The test hook of [`Options::hold_first_write`]: a hold, taken once.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct HoldFirstWrite(Arc<(Duration, AtomicBool)>);

impl HoldFirstWrite {
    /// The first write waits `hold`.
    pub fn new(hold: Duration) -> Self {
        HoldFirstWrite(Arc::new((hold, AtomicBool::new(true))))
    }

    /// How long this write waits: the hold for the first caller, then nothing.
    pub(crate) fn take(&self) -> Option<Duration> {
        let (hold, armed) = &*self.0;
        armed.swap(false, Ordering::AcqRel).then_some(*hold)
    }
}

impl PartialEq for HoldFirstWrite {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for HoldFirstWrite {}

/// The default most a block session polls before it sleeps: 200 µs, above one loopback
/// round trip here (docs/performance.md, "Adaptive polling").
pub const DEFAULT_POLL: Duration = Duration::from_micros(200);

impl Default for Options {
    fn default() -> Self {
        Options {
            handshake_timeout: Duration::from_secs(10),
            frame_timeout: Duration::from_secs(30),
            max_sessions: 256,
            poll: DEFAULT_POLL,
            io: IoMode::Auto,
            stores: Vec::new(),
            hold_first_write: None,
        }
    }
}
