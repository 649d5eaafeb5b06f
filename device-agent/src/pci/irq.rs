//! The eventfds VFIO signals for a lent function's enabled interrupt vectors, shared by
//! the session's request loop (which enables and disables them) and whatever waits on
//! them (the TCP session's interrupt thread, the RDMA session's one loop).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError};

use vmm_sys_util::eventfd::EventFd;

/// The eventfds VFIO signals, shared with the interrupt thread.
pub(crate) struct IrqTable {
    /// `(index, vector, eventfd)` of every enabled vector.
    pub(crate) fds: Mutex<Vec<(u32, u32, Arc<EventFd>)>>,
    /// Wakes the interrupt thread to re-read `fds`.
    pub(crate) wake: EventFd,
    pub(crate) stop: AtomicBool,
}

impl IrqTable {
    /// The interrupt index enabled for `vector`: MSI-X before MSI before INTx.
    pub(crate) fn index_of(&self, vector: u32) -> Option<u32> {
        let t = self.fds.lock().unwrap_or_else(PoisonError::into_inner);
        [2u32, 1, 0]
            .into_iter()
            .find(|i| t.iter().any(|(x, v, _)| x == i && *v == vector))
    }
}

impl IrqTable {
    /// No vector enabled yet.
    pub(crate) fn new() -> std::io::Result<IrqTable> {
        Ok(IrqTable {
            fds: Mutex::new(Vec::new()),
            wake: EventFd::new(libc::EFD_NONBLOCK)?,
            stop: AtomicBool::new(false),
        })
    }
}
