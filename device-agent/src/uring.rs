//! One io_uring instance shared by the two threads of a session.
//!
//! Both threads push submission entries (the request reader, and the completion thread
//! for continuations); only the completion thread reaps completions. Each queue is
//! guarded by its own mutex, private to the session, so the unsafe `*_shared` accessors
//! of the io-uring crate are never used concurrently.

use std::io;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use io_uring::{squeue, IoUring};

/// A session's ring.
pub(crate) struct Ring {
    ring: IoUring,
    sq: Mutex<()>,
    cq: Mutex<()>,
}

impl Ring {
    /// A ring with `entries` submission entries and twice as many completion entries.
    ///
    /// # Errors
    /// `io_uring_setup` failures (e.g. ENOMEM, or io_uring disabled by the system).
    pub(crate) fn new(entries: u32) -> io::Result<Ring> {
        // SUBMIT_ALL (Linux 5.18) keeps submitting after an entry that fails early; older
        // kernels refuse the flag and get a ring without it.
        let ring = match IoUring::builder().setup_submit_all().build(entries) {
            Ok(r) => r,
            Err(_) => IoUring::new(entries)?,
        };
        Ok(Ring {
            ring,
            sq: Mutex::new(()),
            cq: Mutex::new(()),
        })
    }

    /// Queues one entry (submitting to make room when the queue is full). The entry is
    /// handed to the kernel by the next [`Ring::submit`] or [`Ring::submit_and_wait`].
    ///
    /// # Errors
    /// Those of [`Ring::submit`] when the queue was full.
    ///
    /// # Safety
    /// Every buffer the entry points to must stay valid (and, for a read, not be accessed)
    /// until its completion has been reaped, and its `user_data` must be owned by that
    /// completion.
    pub(crate) unsafe fn push(&self, entry: &squeue::Entry) -> io::Result<()> {
        let _guard = self.sq.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            // SAFETY: the guard makes this the only submission queue alive.
            let mut sq = unsafe { self.ring.submission_shared() };
            // SAFETY: the caller guarantees the buffers and user_data (see `# Safety`).
            if unsafe { sq.push(entry) }.is_ok() {
                return Ok(());
            }
            drop(sq);
            self.submit()?;
        }
    }

    /// Hands every queued entry to the kernel. Retries on EINTR, and after a millisecond
    /// on EAGAIN/EBUSY (transient kernel resource shortage).
    ///
    /// # Errors
    /// Any other `io_uring_enter` error.
    pub(crate) fn submit(&self) -> io::Result<()> {
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_transient(&e) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => return Err(e),
            }
        }
    }

    /// Submits queued entries and waits for at least one completion. Returns early (with
    /// no completion) on EINTR, EAGAIN and EBUSY; the caller reaps and calls again.
    ///
    /// # Errors
    /// Any other `io_uring_enter` error.
    pub(crate) fn submit_and_wait(&self) -> io::Result<()> {
        match self.ring.submit_and_wait(1) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) if is_transient(&e) => {
                std::thread::sleep(Duration::from_millis(1));
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Moves every available completion, as `(user_data, result)`, into `out`.
    pub(crate) fn reap(&self, out: &mut Vec<(u64, i32)>) {
        let _guard = self.cq.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the guard makes this the only completion queue alive.
        let cq = unsafe { self.ring.completion_shared() };
        out.extend(cq.map(|c| (c.user_data(), c.result())));
    }
}

fn is_transient(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY))
}
