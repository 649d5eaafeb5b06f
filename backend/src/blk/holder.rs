//! The session that holds a device on the lender for an attachment's lifetime.
//!
//! A lender lends a device to one borrower at a time, for as long as that borrower has
//! a session open. This idle session (queue index [`CONTROL_QUEUE`]) keeps the device the
//! attachment's while no VM is connected. If the lender goes away (restart, network),
//! the holder re-establishes the session as soon as the lender answers again, so that
//! the device stays this attachment's.

use std::io::Read;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use devlend_fabric::conn::Stream;
use devlend_fabric::tcp::ConnectError;
use devlend_fabric::HelloStatus;

use crate::blk::engine::{DisplayChain, LenderTarget};

/// Queue index of the holding session.
pub const CONTROL_QUEUE: u16 = u16::MAX;

/// How long an attach retries a lender that answers "busy" (the device may be in the
/// middle of being released by its previous borrower).
pub const BUSY_RETRY: Duration = Duration::from_secs(2);

/// Most time between two attempts to re-establish a lost holding session.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// A running holder.
pub struct Holder {
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<Stream>>>,
    thread: Option<JoinHandle<()>>,
}

/// Opens the holding session, retrying "busy" for [`BUSY_RETRY`].
///
/// # Errors
/// The lender's refusal or the connection error.
pub fn open(target: &LenderTarget) -> Result<(Stream, devlend_fabric::HelloReply), ConnectError> {
    let deadline = std::time::Instant::now() + BUSY_RETRY;
    loop {
        match target.open(&target.hello(CONTROL_QUEUE)) {
            Err(ConnectError::Refused {
                status: HelloStatus::Busy,
                ..
            }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            other => return other,
        }
    }
}

fn lock(m: &Mutex<Option<Stream>>) -> std::sync::MutexGuard<'_, Option<Stream>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Holder {
    /// Watches `stream` (an open holding session) on a thread, re-establishing it when
    /// it drops.
    ///
    /// # Errors
    /// The thread or a socket handle could not be created.
    pub fn start(name: &str, target: LenderTarget, stream: Stream) -> std::io::Result<Holder> {
        let stop = Arc::new(AtomicBool::new(false));
        let current = Arc::new(Mutex::new(Some(stream.try_clone()?)));
        let thread = {
            let (stop, current, name) = (stop.clone(), current.clone(), name.to_owned());
            std::thread::Builder::new()
                .name(format!("hold-{name}"))
                .spawn(move || watch(&name, &target, stream, &stop, &current))?
        };
        Ok(Holder {
            stop,
            current,
            thread: Some(thread),
        })
    }

    /// Releases the device: closes the session and waits (up to 2 s) until the lender has
    /// closed it too, so that a new attach right after finds the device free.
    pub fn release(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(s) = lock(&self.current).as_ref() {
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
                if let Some(s) = lock(&self.current).as_ref() {
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
    stop: &AtomicBool,
    current: &Mutex<Option<Stream>>,
) {
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
        tracing::warn!(attachment = %name, lender = %target.addr, device = %target.device, "lost the session holding the device; re-establishing it");
        let mut backoff = Duration::from_millis(100);
        stream = loop {
            if stop.load(Ordering::Acquire) {
                return;
            }
            match target.open(&target.hello(CONTROL_QUEUE)) {
                Ok((s, _)) => break s,
                Err(e) => {
                    match &e {
                        ConnectError::Refused {
                            status: HelloStatus::Busy,
                            ..
                        } => {
                            tracing::warn!(attachment = %name, error = %DisplayChain(&e), "the lender answers busy (another borrower holds the device, or it awaits word from the pool); retrying");
                        }
                        ConnectError::Refused {
                            status: HelloStatus::Denied,
                            ..
                        } if backoff == Duration::from_millis(100) => {
                            tracing::error!(attachment = %name, error = %DisplayChain(&e), "the lender refuses this attachment (its lease ended?)");
                        }
                        ConnectError::Tls { source, .. }
                            if source.is_permanent() && backoff == Duration::from_millis(100) =>
                        {
                            tracing::error!(attachment = %name, error = %DisplayChain(&e), "TLS with the lender is refused; retrying");
                        }
                        _ => {}
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        };
        tracing::info!(attachment = %name, lender = %target.addr, "holding session re-established");
        match stream.try_clone() {
            Ok(c) => *lock(current) = Some(c),
            Err(_) => *lock(current) = None,
        }
        if stop.load(Ordering::Acquire) {
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    }
}
