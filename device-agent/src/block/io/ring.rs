//! A session's io_uring: device I/O, and the wait for the socket or a completion.
//!
//! Only the session's thread uses it, through its [`super::DeviceIo`].

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring};

/// A session's ring.
pub(crate) struct Ring {
    ring: IoUring,
    ext_arg: bool,
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
        let ext_arg = ring.params().is_feature_ext_arg();
        Ok(Ring { ring, ext_arg })
    }

    /// Queues one entry (submitting to make room when the queue is full). The entry is
    /// handed to the kernel by the next [`Ring::submit`] or [`Ring::wait`].
    ///
    /// # Errors
    /// Those of [`Ring::submit`] when the queue was full.
    ///
    /// # Safety
    /// Every buffer the entry points to must stay valid (and, for a read, not be accessed)
    /// until its completion has been reaped, and its `user_data` must be owned by that
    /// completion.
    pub(crate) unsafe fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: the caller guarantees the buffers and user_data (see `# Safety`).
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return Ok(());
            }
            self.submit()?;
        }
    }

    /// Queues a one-shot poll of `fd` for `events`, completing with `user_data`.
    ///
    /// # Errors
    /// Those of [`Ring::submit`] when the queue was full.
    pub(crate) fn poll(
        &mut self,
        fd: RawFd,
        events: libc::c_short,
        user_data: u64,
    ) -> io::Result<()> {
        let entry = opcode::PollAdd::new(types::Fd(fd), events as u16 as u32)
            .build()
            .user_data(user_data);
        // SAFETY: a poll refers to no memory; its user_data is a token, not a request.
        unsafe { self.push(&entry) }
    }

    /// Hands every queued entry to the kernel. Retries on EINTR, and after a millisecond
    /// on EAGAIN/EBUSY (transient kernel resource shortage).
    ///
    /// # Errors
    /// Any other `io_uring_enter` error.
    pub(crate) fn submit(&mut self) -> io::Result<()> {
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_transient(&e) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether [`Ring::wait`] honours its timeout.
    pub(crate) fn timed_waits(&self) -> bool {
        self.ext_arg
    }

    /// Submits queued entries and waits for at least one completion, at most `timeout`
    /// (when the kernel supports timed waits; else without limit). Returns early (with
    /// no completion) on a timeout, EINTR, EAGAIN and EBUSY; the caller reaps and
    /// decides.
    ///
    /// # Errors
    /// Any other `io_uring_enter` error.
    pub(crate) fn wait(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        let res = match timeout {
            Some(t) if self.ext_arg => {
                let ts = types::Timespec::from(t);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
            }
            _ => self.ring.submit_and_wait(1),
        };
        match res {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(()),
            Err(e) if is_transient(&e) => {
                std::thread::sleep(Duration::from_millis(1));
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Moves every available completion, as `(user_data, result)`, into `out`.
    pub(crate) fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        out.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
    }
}

fn is_transient(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY))
}
