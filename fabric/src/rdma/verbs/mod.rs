//! A small safe layer over libibverbs and librdmacm (`rdma-sys`): each object owns
//! its handle and frees it on drop, in an order enforced by `Arc`s (an MR holds its PD,
//! a CQ its completion channel; a [`Connection`] drops its QP before its buffers).
//!
//! One [`Connection`] is one RC queue pair set up by rdma_cm, with one CQ for sends and
//! receives, armed on a completion channel, and two pools of registered message buffers.
//! Its [`Connection::fd`] is an epoll fd watching the completion channel and the
//! connection's rdma_cm event channel, so a worker waits on one fd for completions and
//! disconnects alike.
//!
//! This file holds the owned wrappers of the libibverbs and librdmacm objects; the
//! connection and its work requests are in `connection.rs`, its setup (the active
//! [`connect`] and the passive [`Listener`] and [`Incoming`]) in `setup.rs`.

use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::*;

use super::RdmaError;

mod buffers;
mod connection;
mod setup;
#[cfg(test)]
mod tests;

pub use buffers::HANDSHAKE_BUFFERS;
pub use connection::{lender_shape, Completion, Connection, Shape, BORROWER, RECV_BIT};
pub use setup::{connect, open_connection, Incoming, Listener};

fn os_err() -> io::Error {
    io::Error::last_os_error()
}

fn resources(what: &'static str) -> RdmaError {
    RdmaError::Resources {
        what,
        source: os_err(),
    }
}

/// Fails with [`RdmaError::NoDevice`] when the machine has no RDMA device.
///
/// # Errors
/// [`RdmaError::NoDevice`].
pub fn check_devices() -> Result<usize, RdmaError> {
    let mut n: i32 = 0;
    // SAFETY: ibv_get_device_list writes the count and returns a list (or NULL) that
    // we free at once; no pointer from it is kept.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if !list.is_null() {
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ibv_free_device_list(list) };
    }
    if list.is_null() || n <= 0 {
        return Err(RdmaError::NoDevice);
    }
    Ok(n as usize)
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on an fd owned by a live verbs object; no memory passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(os_err());
    }
    Ok(())
}

/// Waits up to `timeout` for `fd` to be readable.
/// Waits up to `timeout` for `fd` to be readable (e.g. [`Connection::fd`]); whether it
/// is.
pub fn wait_fd(fd: RawFd, timeout: Duration) -> bool {
    wait_readable(fd, timeout)
}

fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

/// An rdma_cm event channel.
pub struct EventChannel(*mut rdma_event_channel);

// SAFETY: the channel is a kernel fd wrapper; librdmacm allows its use from any thread,
// and devlend uses each from one thread at a time.
unsafe impl Send for EventChannel {}

impl EventChannel {
    /// Opens a channel (non-blocking).
    ///
    /// # Errors
    /// [`RdmaError::NoCm`] when rdma_cm is unavailable.
    pub fn new() -> Result<Self, RdmaError> {
        // SAFETY: no arguments; returns NULL on failure.
        let ch = unsafe { rdma_create_event_channel() };
        if ch.is_null() {
            return Err(RdmaError::NoCm(os_err()));
        }
        let me = EventChannel(ch);
        set_nonblocking(me.fd()).map_err(|source| RdmaError::Resources {
            what: "a non-blocking rdma_cm event channel",
            source,
        })?;
        Ok(me)
    }

    /// The channel's fd.
    pub fn fd(&self) -> RawFd {
        // SAFETY: self.0 is a live channel.
        unsafe { (*self.0).fd }
    }

    /// The next event, if one is ready: its type, status, and the id it concerns.
    fn try_next(&self) -> Option<(rdma_cm_event_type::Type, i32, *mut rdma_cm_id)> {
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is live and non-blocking; `ev` receives an event we ack
        // below after copying its fields.
        if unsafe { rdma_get_cm_event(self.0, &mut ev) } != 0 || ev.is_null() {
            return None;
        }
        // SAFETY: `ev` is a valid event until acked.
        let out = unsafe { ((*ev).event, (*ev).status, (*ev).id) };
        // SAFETY: acked once; a CONNECT_REQUEST's id stays valid (we own it from now).
        unsafe { rdma_ack_cm_event(ev) };
        Some(out)
    }

    /// Waits up to `timeout` for the next event.
    fn next(
        &self,
        timeout: Duration,
        what: &'static str,
    ) -> Result<(rdma_cm_event_type::Type, i32, *mut rdma_cm_id), RdmaError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.try_next() {
                return Ok(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RdmaError::Timeout { what });
            }
            wait_readable(self.fd(), left);
        }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on the channel was destroyed before (owners drop first).
        unsafe { rdma_destroy_event_channel(self.0) };
    }
}

/// The name of an rdma_cm event.
fn event_name(e: rdma_cm_event_type::Type) -> String {
    // SAFETY: rdma_event_str returns a static string for any value.
    unsafe { CStr::from_ptr(rdma_event_str(e)) }
        .to_string_lossy()
        .into_owned()
}

/// An rdma_cm id, with its QP once created.
pub struct CmId(*mut rdma_cm_id);

// SAFETY: used from one thread at a time; librdmacm ids are not thread-bound.
unsafe impl Send for CmId {}

impl CmId {
    fn new(ch: &EventChannel) -> Result<Self, RdmaError> {
        let mut id = std::ptr::null_mut();
        // SAFETY: `ch` is live; `id` receives the new id.
        if unsafe {
            rdma_create_id(
                ch.0,
                &mut id,
                std::ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        } != 0
        {
            return Err(resources("an rdma_cm id"));
        }
        Ok(CmId(id))
    }

    fn verbs(&self) -> *mut ibv_context {
        // SAFETY: self.0 is live.
        unsafe { (*self.0).verbs }
    }

    fn qp(&self) -> *mut ibv_qp {
        // SAFETY: self.0 is live.
        unsafe { (*self.0).qp }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: the id is live; its QP (if any) is destroyed before the id.
        unsafe {
            if !(*self.0).qp.is_null() {
                rdma_destroy_qp(self.0);
            }
            rdma_destroy_id(self.0);
        }
    }
}

/// A protection domain.
pub struct Pd(*mut ibv_pd);
// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Pd {}
// SAFETY: the PD is only read (used as a handle) after creation.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of the PD holds an Arc to it, so none is left.
        unsafe { ibv_dealloc_pd(self.0) };
    }
}

/// What a peer may do to a range registered with [`Mr::register_for_peer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerAccess {
    /// RDMA READ it.
    Read,
    /// RDMA WRITE it.
    Write,
}

/// A registered memory region; deregistered on drop.
pub struct Mr {
    mr: *mut ibv_mr,
    _pd: Arc<Pd>,
}
// SAFETY: an MR handle is plain data for the verbs library.
unsafe impl Send for Mr {}
// SAFETY: only read after creation.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `len` bytes at `addr` in `pd`; `remote` adds remote read and write.
    ///
    /// # Safety
    /// The range must stay mapped for as long as the MR lives (the caller keeps its
    /// owner alive beside it).
    pub unsafe fn register(
        pd: &Arc<Pd>,
        addr: *mut u8,
        len: usize,
        remote: bool,
    ) -> Result<Mr, RdmaError> {
        let mut access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if remote {
            access |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
                | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        // SAFETY: the caller's contract.
        unsafe { Self::register_access(pd, addr, len, access, "a memory region") }
    }

    /// `ibv_reg_mr` with `access`; `what` names the region in the error.
    ///
    /// # Safety
    /// As [`Mr::register`].
    unsafe fn register_access(
        pd: &Arc<Pd>,
        addr: *mut u8,
        len: usize,
        access: u32,
        what: &'static str,
    ) -> Result<Mr, RdmaError> {
        // SAFETY: the range is mapped (caller's contract); pd is live.
        let mr = unsafe { ibv_reg_mr(pd.0, addr.cast(), len, access as i32) };
        if mr.is_null() {
            return Err(resources(what));
        }
        Ok(Mr {
            mr,
            _pd: pd.clone(),
        })
    }

    /// Registers `len` bytes at `addr` in `pd` for the peer alone, in one direction:
    /// [`PeerAccess::Read`] lets it RDMA READ the range (the data of a write request),
    /// [`PeerAccess::Write`] lets it RDMA WRITE it (the buffers of a read request; the
    /// verbs require local write beside remote write). Nothing outside the range is
    /// reachable with its rkey, and the rkey dies when the MR is dropped.
    ///
    /// # Safety
    /// As [`Mr::register`].
    pub unsafe fn register_for_peer(
        pd: &Arc<Pd>,
        addr: *mut u8,
        len: usize,
        peer: PeerAccess,
    ) -> Result<Mr, RdmaError> {
        let access = match peer {
            PeerAccess::Read => ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            PeerAccess::Write => {
                ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
                    | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            }
        };
        // SAFETY: the caller's contract.
        unsafe { Self::register_access(pd, addr, len, access, "a memory region for one request") }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        // SAFETY: live MR.
        unsafe { (*self.mr).addr as u64 }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        // SAFETY: live MR.
        unsafe { (*self.mr).length }
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).lkey }
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: the MR is live; nothing posted uses it any more (its owner's QP is
        // destroyed or idle).
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

struct CompChannel(*mut ibv_comp_channel);
// SAFETY: a kernel fd wrapper.
unsafe impl Send for CompChannel {}
// SAFETY: only read after creation.
unsafe impl Sync for CompChannel {}
impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: its CQ (which holds an Arc to it) is destroyed before.
        unsafe { ibv_destroy_comp_channel(self.0) };
    }
}

struct Cq {
    cq: *mut ibv_cq,
    _ch: Arc<CompChannel>,
}
// SAFETY: used by one thread at a time.
unsafe impl Send for Cq {}
impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: the QP using it is destroyed before (Connection's field order).
        unsafe { ibv_destroy_cq(self.cq) };
    }
}
