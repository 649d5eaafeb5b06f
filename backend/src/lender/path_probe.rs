//! The paths of an attachment with several: a thread that finds the paths marked down
//! reachable again ([`PathProbe`]), so that a disk's queues move back to them and
//! `devlend status` shows them up, and the paths that are up unreachable, so that a path
//! cut while nothing was in flight on it shows down.

use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::lender::path_cell::PathCell;
use crate::lender::target::PATH_CONNECT_TIMEOUT;

/// Counters that keep the state of an attachment's paths (a disk's, a NIC's).
pub(crate) trait WithPaths: Send + Sync + 'static {
    /// One cell per path; empty with one path.
    fn paths(&self) -> &[PathCell];
}

/// How often the paths marked down are tried, and how long a try may take.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);

/// How often the paths not marked down are tried too (each try bounded by
/// [`PATH_CONNECT_TIMEOUT`]): a path cut while none of its sessions had a request in
/// flight (no heartbeat, no loss to see) shows down within this and that timeout.
pub const UP_PROBE_EVERY: Duration = Duration::from_secs(5);

/// Tries a TCP connect to every path marked down, every [`PROBE_EVERY`], and marks the
/// ones that answer up; and to every path, every [`UP_PROBE_EVERY`], and marks the
/// ones that do not answer down (only a connect: the lender sees a connection closed
/// before its hello, which it does not log above debug). Stops when dropped.
pub struct PathProbe {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PathProbe {
    /// Starts probing the paths of `stats` (none to probe with one path: `None`).
    ///
    /// # Errors
    /// The thread cannot be started.
    pub(crate) fn start<S: WithPaths>(name: &str, stats: Arc<S>) -> std::io::Result<Option<Self>> {
        if stats.paths().is_empty() {
            return Ok(None);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("paths-{name}"))
                .spawn(move || probe(stats.paths(), &stop))?
        };
        Ok(Some(PathProbe {
            stop,
            thread: Some(thread),
        }))
    }
}

impl Drop for PathProbe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn probe(paths: &[PathCell], stop: &AtomicBool) {
    let mut up_round = Instant::now() + UP_PROBE_EVERY;
    while !stop.load(Ordering::Acquire) {
        let all = Instant::now() >= up_round;
        if all {
            up_round = Instant::now() + UP_PROBE_EVERY;
        }
        for p in paths {
            if stop.load(Ordering::Acquire) {
                break;
            }
            let up = p.is_up();
            if up && !all {
                continue;
            }
            let wait = if up {
                PATH_CONNECT_TIMEOUT
            } else {
                PROBE_EVERY
            };
            match (reaches(p.addr(), wait), up) {
                (true, false) => p.reachable(),
                (false, true) => p.unreachable(),
                _ => {}
            }
        }
        std::thread::sleep(PROBE_EVERY);
    }
}

/// Whether a TCP connect to `addr` succeeds within `wait`.
fn reaches(addr: &str, wait: Duration) -> bool {
    addr.to_socket_addrs()
        .is_ok_and(|mut a| a.any(|a| TcpStream::connect_timeout(&a, wait).is_ok()))
}
