//! A one-shot monotonic timer as a file descriptor (timerfd), for a queue's worker to
//! wait on in its epoll set: the engine arms it for its next reconnect attempt.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// A non-blocking `CLOCK_MONOTONIC` timerfd.
#[derive(Debug)]
pub struct RetryTimer {
    fd: OwnedFd,
    armed: bool,
}

impl RetryTimer {
    /// A disarmed timer.
    ///
    /// # Errors
    /// `timerfd_create` failed (out of file descriptors).
    pub fn new() -> io::Result<Self> {
        // SAFETY: plain system call with constant flags; the result is checked.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(RetryTimer {
            // SAFETY: `fd` was just created and is owned by nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            armed: false,
        })
    }

    /// Fires once after `after` (at least 1 ms), replacing any earlier setting.
    pub fn arm(&mut self, after: Duration) {
        let after = after.max(Duration::from_millis(1));
        self.set(libc::timespec {
            tv_sec: after.as_secs() as libc::time_t,
            tv_nsec: after.subsec_nanos() as libc::c_long,
        });
        self.armed = true;
    }

    /// Cancels the timer and drops an expiry not yet read.
    pub fn disarm(&mut self) {
        if self.armed {
            self.set(libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            });
            self.armed = false;
        }
        self.clear();
    }

    /// Reads the expiry count (after the fd polled readable), so that it stops polling
    /// readable.
    pub fn clear(&mut self) {
        let mut n = 0u64;
        // SAFETY: reads 8 bytes into a live u64; the fd is non-blocking, so EAGAIN (no
        // expiry) returns at once and is ignored.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
        self.armed = false;
    }

    fn set(&self, value: libc::timespec) {
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: value,
        };
        // SAFETY: `spec` is a valid itimerspec for the call; a null old value is allowed.
        let rc =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "cannot set the reconnect timer");
        }
    }
}

impl AsRawFd for RetryTimer {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
