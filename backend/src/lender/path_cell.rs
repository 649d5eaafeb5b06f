//! The live state of each path to a lender, when an attachment has several: sessions
//! open on it, whether it is marked down, its failures (`docs/faults.md`, "Paths").
//! Shared by the sessions of one attachment, whatever its kind; read as
//! [`PathState`] by the compute agent's API.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use devlend_fabric::io_counters::PathState;

/// The live state of one path to the lender, shared by the sessions of an attachment
/// (a disk's queues, a NIC's queue pairs).
#[derive(Debug, Default)]
pub(crate) struct PathCell {
    addr: String,
    /// Sessions open on it now.
    sessions: AtomicI64,
    /// Its last session was lost, or its last connect failed, and since then no
    /// session opened on it and no probe reached it.
    down: AtomicBool,
    /// Sessions lost on it and connects that failed on it.
    failures: AtomicU64,
    /// When the lender there last refused a session for good, in ms since
    /// [`epoch`] plus one (0: never): the probe leaves it down for
    /// [`REFUSED_PATH_RESTS`] after that.
    refused_at: AtomicU64,
}

/// How long a path whose lender refused a session for good (a wrong address: another
/// lender, or one without this device) stays marked down: the probe, which only
/// connects, cannot tell it from a good path, and queues would try it at every
/// failback.
pub const REFUSED_PATH_RESTS: Duration = Duration::from_secs(30);

/// The instant path refusals are counted from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn since_epoch_ms(t: Instant) -> u64 {
    t.saturating_duration_since(epoch()).as_millis() as u64
}

impl PathCell {
    /// One cell per address, in path order; none with one address (no path states
    /// are kept then).
    pub(crate) fn for_addrs(addrs: impl IntoIterator<Item = String>) -> Vec<PathCell> {
        let paths: Vec<PathCell> = addrs
            .into_iter()
            .map(|addr| PathCell {
                addr,
                ..PathCell::default()
            })
            .collect();
        if paths.len() > 1 {
            paths
        } else {
            Vec::new()
        }
    }

    /// Its state now.
    pub(crate) fn snapshot(&self) -> PathState {
        PathState {
            addr: self.addr.clone(),
            sessions: self.sessions.load(Ordering::Relaxed).max(0) as u64,
            up: !self.down.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
        }
    }

    /// A session opened on this path.
    pub(crate) fn opened(&self) {
        self.sessions.fetch_add(1, Ordering::Relaxed);
        self.refused_at.store(0, Ordering::Relaxed);
        self.down.store(false, Ordering::Relaxed);
    }

    /// A session on this path ended; `failed`: it was lost (not closed by us).
    pub(crate) fn closed(&self, failed: bool) {
        self.sessions.fetch_sub(1, Ordering::Relaxed);
        if failed {
            self.failed();
        }
    }

    /// Its address.
    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    /// Not marked down: a session opened on it, or a probe reached it, since the last
    /// failure on it.
    pub(crate) fn is_up(&self) -> bool {
        !self.down.load(Ordering::Relaxed)
    }

    /// A probe reached it ([`crate::lender::path_probe`]): up again, unless its lender
    /// refused a session for good less than [`REFUSED_PATH_RESTS`] ago.
    pub(crate) fn reachable(&self) {
        let refused = self.refused_at.load(Ordering::Relaxed);
        if refused == 0
            || since_epoch_ms(Instant::now()).saturating_sub(refused - 1)
                >= REFUSED_PATH_RESTS.as_millis() as u64
        {
            self.down.store(false, Ordering::Relaxed);
        }
    }

    /// A probe did not reach it ([`crate::lender::path_probe`]): marked down, not
    /// counted as a failure (no session or connect of the attachment failed). An idle
    /// queue whose session is on it then leaves it before it sends anything there.
    pub(crate) fn unreachable(&self) {
        self.down.store(true, Ordering::Relaxed);
    }

    /// The lender on this path refused a session for good: it is marked down (counted
    /// as a failure) and stays so for [`REFUSED_PATH_RESTS`], unless a session opens
    /// on it.
    pub(crate) fn refused(&self) {
        self.refused_at
            .store(since_epoch_ms(Instant::now()) + 1, Ordering::Relaxed);
        self.failed();
    }

    /// Opening a session on this path failed with `e`: the path failed, unless the
    /// lender answered on it. A busy answer says nothing against it; a refusal for
    /// good, a lender that does not prove the attachment's lender key, or a peer that
    /// does not speak the protocol say the path leads elsewhere (a wrong address) for a
    /// while ([`Self::refused`]): the probe, which only connects, cannot tell.
    pub(crate) fn open_failed(&self, e: &devlend_fabric::tcp::ConnectError) {
        use devlend_fabric::tcp::ConnectError;
        let elsewhere = matches!(
            e,
            ConnectError::WrongLender { .. }
                | ConnectError::Handshake {
                    source: devlend_fabric::WireError::BadMagic(_),
                    ..
                }
        );
        if e.is_permanent() || elsewhere {
            self.refused();
        } else if !matches!(e, ConnectError::Refused { .. }) {
            self.failed();
        }
    }

    /// A connect on this path failed, or its session was lost.
    pub(crate) fn failed(&self) {
        self.down.store(true, Ordering::Relaxed);
        self.failures.fetch_add(1, Ordering::Relaxed);
    }
}

/// The failovers of an attachment with several paths: sessions that reopened on
/// another path after theirs was lost, and how long the last took.
#[derive(Debug, Default)]
pub(crate) struct Failovers {
    count: AtomicU64,
    last_us: AtomicU64,
}

impl Failovers {
    /// Counts one whose session was lost at `since`; returns how long it took, µs (at
    /// least 1: 0 says there was none).
    pub(crate) fn record(&self, since: Instant) -> u64 {
        let us = since.elapsed().as_micros().clamp(1, u128::from(u64::MAX)) as u64;
        self.count.fetch_add(1, Ordering::Relaxed);
        self.last_us.store(us, Ordering::Relaxed);
        us
    }

    /// How many so far.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// How long the last took, µs (0: none yet).
    pub(crate) fn last_us(&self) -> u64 {
        self.last_us.load(Ordering::Relaxed)
    }
}
