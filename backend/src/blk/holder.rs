//! The session that holds a device on the lender for an attachment's lifetime.
//!
//! A lender lends a device to one borrower at a time, for as long as that borrower has
//! a session open. This idle session (queue index [`CONTROL_QUEUE`]) keeps the device the
//! attachment's while no VM is connected. If the lender goes away (restart, network),
//! the holder re-establishes the session as soon as the lender answers again, so that
//! the device stays this attachment's: 100 ms doubling to 5 s
//! ([`devlend_fabric::reconnect`]), for as long as the attachment lives. A permanent
//! refusal (denied: a lease that ended; a TLS certificate refused) is logged as an error
//! at its first answer, and retried like the others: the holder's job is to hold the
//! device again as soon as it can (a renewed lease, a fixed certificate).

use std::io::Read;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devlend_fabric::conn::Stream;
use devlend_fabric::reconnect::{Attempt, Clock, GaveUp, Policy, Reconnector, SystemClock};
use devlend_fabric::tcp::ConnectError;
use devlend_fabric::HelloStatus;

use crate::handover::Holding;
use crate::lender::{DisplayChain, LenderTarget};

/// Queue index of the holding session.
pub const CONTROL_QUEUE: u16 = u16::MAX;

/// How long an attach retries a lender that answers "busy" (the device may be in the
/// middle of being released by its previous borrower).
pub const BUSY_RETRY: Duration = Duration::from_secs(2);

/// Opening: "busy" retried every 100 ms for [`BUSY_RETRY`]; any other failure returned.
const OPEN: Policy =
    Policy::backoff(Duration::from_millis(100), Duration::from_millis(100)).deadline(BUSY_RETRY);

/// Re-establishing a lost holding session: 100 ms doubling to 5 s, for ever.
const REOPEN: Policy = Policy::backoff(Duration::from_millis(100), Duration::from_secs(5));

/// A running holder.
pub struct Holder {
    stop: Arc<AtomicBool>,
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
}

/// Lets a live migration's source give the device up for a while and take it back
/// ([`crate::handover`]): while paused, the holder keeps no session and opens none.
#[derive(Debug, Default)]
pub struct Control {
    paused: AtomicBool,
    /// The holding session open now (a clone, to shut it down from another thread).
    current: Mutex<Option<Stream>>,
}

impl Holding for Control {
    /// Closes the holding session and opens none until [`Self::resume`].
    fn pause(&self) {
        self.paused.store(true, Ordering::Release);
        if let Some(s) = lock(&self.current).as_ref() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Holds the device again: the holder re-opens its session at once (retrying while
    /// the lender answers busy).
    fn resume(&self) {
        self.paused.store(false, Ordering::Release);
    }
}

impl Control {
    /// Whether [`Holding::pause`] is in force.
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Acquire)
    }
}

/// Opens the holding session, retrying "busy" for [`BUSY_RETRY`]; returns it with the
/// path it opened on (of [`LenderTarget::path_count`]).
///
/// # Errors
/// The lender's refusal or the connection error.
pub fn open(
    target: &LenderTarget,
) -> Result<(Stream, devlend_fabric::HelloReply, usize), ConnectError> {
    Reconnector::new(OPEN)
        .run(&SystemClock, |_| match target.open_any(CONTROL_QUEUE, 0) {
            Ok(opened) => Attempt::Done(opened),
            Err(e) if is_busy(&e) => Attempt::Failed(e),
            Err(e) => Attempt::Refused(e),
        })
        .map_err(|g| match g {
            GaveUp::Refused(e) | GaveUp::Deadline(e) => e,
            GaveUp::Stopped => unreachable!("opening is never stopped"),
        })
}

fn is_busy(e: &ConnectError) -> bool {
    matches!(
        e,
        ConnectError::Refused {
            status: HelloStatus::Busy,
            ..
        }
    )
}

/// The system clock, whose sleeps end early once the holder is released.
struct Releasable<'a>(&'a AtomicBool);

impl Clock for Releasable<'_> {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep(&self, d: Duration) -> bool {
        let end = Instant::now() + d;
        loop {
            if self.0.load(Ordering::Acquire) {
                return false;
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }
}

fn lock(m: &Mutex<Option<Stream>>) -> std::sync::MutexGuard<'_, Option<Stream>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Holder {
    /// Watches `stream` (an open holding session, on path `path`) on a thread,
    /// re-establishing it when it drops (from the path after `path`).
    ///
    /// # Errors
    /// The thread or a socket handle could not be created.
    pub fn start(
        name: &str,
        target: LenderTarget,
        stream: Stream,
        path: usize,
    ) -> std::io::Result<Holder> {
        let stop = Arc::new(AtomicBool::new(false));
        let control = Arc::new(Control::default());
        *lock(&control.current) = Some(stream.try_clone()?);
        let thread = {
            let (stop, control, name) = (stop.clone(), control.clone(), name.to_owned());
            std::thread::Builder::new()
                .name(format!("hold-{name}"))
                .spawn(move || watch(&name, &target, stream, path, &stop, &control))?
        };
        Ok(Holder {
            stop,
            control,
            thread: Some(thread),
        })
    }

    /// The pause and resume of a live migration's handover.
    pub fn control(&self) -> Arc<Control> {
        self.control.clone()
    }

    /// Releases the device: closes the session and waits (up to 2 s) until the lender has
    /// closed it too, so that a new attach right after finds the device free.
    pub fn release(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(s) = lock(&self.control.current).as_ref() {
            let _ = s.shutdown(Shutdown::Write);
        }
        if let Some(t) = self.thread.take() {
            // A hung lender never closes its side: stop waiting for it after 2 s (a
            // read already blocked ignores a receive timeout set now, so end it).
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if !t.is_finished() {
                if let Some(s) = lock(&self.control.current).as_ref() {
                    let _ = s.shutdown(Shutdown::Read);
                }
            }
            let _ = t.join();
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.release();
    }
}

fn watch(
    name: &str,
    target: &LenderTarget,
    mut stream: Stream,
    mut path: usize,
    stop: &AtomicBool,
    control: &Control,
) {
    let mut retry = Reconnector::new(REOPEN);
    retry.connected(Instant::now());
    // With several paths, a lost holding session is opened again from the next path.
    loop {
        // Nothing is ever sent on this session: a read returns only at its end.
        let mut sink = [0u8; 64];
        while let Ok(n) = stream.read(&mut sink) {
            if n == 0 {
                break;
            }
        }
        if stop.load(Ordering::Acquire) {
            return;
        }
        if control.is_paused() {
            let _ = stream.shutdown(Shutdown::Both);
            devlend_fabric::limited!(info, attachment = %name, lender = %target.addr, device = %target.device, "let the device go for a handover");
            let clock = Releasable(stop);
            while control.is_paused() {
                if !clock.sleep(Duration::from_millis(20)) {
                    return;
                }
            }
            devlend_fabric::limited!(info, attachment = %name, lender = %target.addr, device = %target.device, "taking the device back");
            retry = Reconnector::new(REOPEN);
        } else {
            tracing::warn!(attachment = %name, lender = %target.addr, device = %target.device, "lost the session holding the device; re-establishing it");
        }
        retry.lost(Instant::now());
        let reopened = retry.run(&Releasable(stop), |r| {
            if stop.load(Ordering::Acquire) {
                return Attempt::Stop;
            }
            match target.open_any(CONTROL_QUEUE, path + 1) {
                Ok((s, _, p)) => Attempt::Done((s, p)),
                Err(e) => {
                    let first = r.failures() == 0;
                    if is_busy(&e) {
                        tracing::warn!(attachment = %name, error = %DisplayChain(&e), "the lender answers busy (another borrower holds the device, or it awaits word from the pool); retrying");
                    } else if first && matches!(e, ConnectError::Tls { .. }) && e.is_permanent() {
                        tracing::error!(attachment = %name, error = %DisplayChain(&e), "TLS with the lender is refused; retrying");
                    } else if first && e.is_permanent() {
                        tracing::error!(attachment = %name, error = %DisplayChain(&e), "a lender refuses this attachment (its lease ended, or, with several paths, this path leads to another lender); retrying");
                    }
                    // Retried all the same: see the module doc.
                    Attempt::Failed(e)
                }
            }
        });
        // Only a release ends the retries.
        let Ok((s, p)) = reopened else { return };
        stream = s;
        path = p;
        tracing::info!(attachment = %name, lender = %target.addr, "holding session re-established");
        *lock(&control.current) = stream.try_clone().ok();
        if control.is_paused() {
            // Paused while it reopened: close it again (the loop waits then).
            let _ = stream.shutdown(Shutdown::Both);
        }
        if stop.load(Ordering::Acquire) {
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    }
}
