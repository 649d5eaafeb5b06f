//! A borrower's attachment: one lent device served on a local socket for a VMM. The
//! parts every kind shares live here ([`AttachmentConfig`], [`Attachment`]'s accessors,
//! stopping, the socket path); what one kind alone has is its [`Part`]; [`vhost_user`]
//! starts a block device (vhost-user-blk) or a NIC (vhost-user-net), [`pci`] a PCIe
//! function (vfio-user).
//!
//! [`Attachment::start`] checks the device with the lender, binds the socket and serves
//! it on a thread: for a block device each frontend connection (a VMM, libblkio) gets a
//! fresh [`BlkBackend`] and daemon (a daemon cannot serve twice), on the same listening
//! socket, so a VMM can disconnect and come back. [`Attachment::stop`] completes the
//! requests in flight, drops the connection and removes the socket.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use devlend_fabric::reconnect::{Attempt, GaveUp, Policy, Reconnector, SystemClock};
use vhost::vhost_user::Listener;
use vhost_user_backend::ShutdownHandle;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::blk::backend::{BlkBackend, DRAIN_TIMEOUT};
use crate::blk::engine::QueueStats;
use crate::blk::holder::Holder;
use crate::blk::request::DeviceLimits;
use crate::blk::spec::MAX_QUEUES;
use crate::lender::LenderTarget;
use crate::net::spec::MAX_QUEUE_PAIRS;
use crate::net::NetStats;

pub use self::part::{BlockPart, NicPart, Part};
pub use crate::blk::holder::{BUSY_RETRY, CONTROL_QUEUE};
pub use devlend_fabric::DeviceKind;

mod frontends;
mod part;
mod pci;
mod vhost_user;

/// What to serve and where.
#[derive(Debug, Clone)]
pub struct AttachmentConfig {
    /// The attachment's id (for logs).
    pub id: String,
    /// Path of the vhost-user unix socket to create (an existing file there is replaced).
    pub socket: PathBuf,
    /// The lender and device name.
    pub lender: LenderTarget,
    /// Number of virtqueues offered (1..=16), each with its own fabric connection.
    pub num_queues: u16,
    /// How long each queue's worker busy-polls before it sleeps (zero: interrupt-driven).
    pub poll: Duration,
    /// How long requests wait for a lost fabric session to come back (they are resent
    /// on the new one) before they complete with IOERR; see
    /// [`crate::blk::engine::DEFAULT_RECONNECT_DEADLINE`].
    pub reconnect_deadline: Duration,
    /// What to ask the lender for and serve on the socket.
    pub serve: Serve,
    /// A restored attachment: the kind it served before the restart. A lender that now
    /// lends another kind under that name is refused ([`AttachmentError::KindChanged`])
    /// before the socket is bound, so that a VMM reconnecting to it never meets a
    /// backend of another kind. `None`: whatever the lender lends.
    pub expect: Option<DeviceKind>,
    /// A PCIe function ([`Serve::VfioUser`]): the identity of the VM it is lent to
    /// (random, not all zero; the same for every function of that VM), sent to the
    /// lender at each connect before any DMA map so that the VM's functions reach
    /// each other's BARs (peer-to-peer; [`crate::pci::PciBorrower::connect_in_group`]).
    /// A lender's refusal fails the attachment. `None`: no peer group. Ignored for
    /// other kinds.
    pub peer_group: Option<[u8; devlend_fabric::pci::VM_ID_LEN]>,
}

/// What an attachment asks the lender for, and how it serves it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Serve {
    /// The device the lender lends, on vhost-user: a block device (vhost-user-blk) or a
    /// NIC (vhost-user-net), as the lender's handshake reply says.
    #[default]
    VhostUser,
    /// A PCIe function, on vfio-user ([`crate::pci`]); `num_queues`, `poll` and
    /// `reconnect_deadline` do not apply.
    VfioUser,
}

/// Why an attachment could not start.
#[derive(Debug, thiserror::Error)]
pub enum AttachmentError {
    /// The queue count is out of range.
    #[error("queue count {0} is out of range 1..={MAX_QUEUES}")]
    Queues(u16),
    /// For a NIC: the queue pair count is out of range.
    #[error("queue pair count {0} is out of range 1..={MAX_QUEUE_PAIRS} for a NIC")]
    QueuePairs(u16),
    /// For a NIC: the lender reported a link no guest can use.
    #[error("the lender's network interface is unusable: {0}")]
    BadLink(String),
    /// The lender could not be reached or refused the device.
    #[error("cannot open the device on the lender")]
    Lender(#[source] devlend_fabric::tcp::ConnectError),
    /// The socket could not be created.
    #[error("cannot listen on {path}")]
    Listen {
        /// Socket path.
        path: PathBuf,
        /// The error.
        #[source]
        source: vhost::vhost_user::Error,
    },
    /// Something that is not a stale socket is at the socket path.
    #[error("{path}: {reason}")]
    SocketPath {
        /// Socket path.
        path: PathBuf,
        /// What is in the way.
        reason: String,
    },
    /// A thread or eventfd could not be created.
    #[error("cannot start the serving thread")]
    Thread(#[source] std::io::Error),
    /// A restored attachment's device is now of another kind on the lender (e.g. the
    /// lender's configuration changed while the compute agent was down).
    #[error("the lender now lends {device:?} as a {}, not the {} this attachment served; detach it", lent.noun(), expected.noun())]
    KindChanged {
        /// Device name on the lender.
        device: String,
        /// The kind it served before.
        expected: DeviceKind,
        /// The kind the lender lends now.
        lent: DeviceKind,
    },
    /// A kind whose sessions go over TCP only (a NIC's queue pairs) was asked for over
    /// RDMA.
    #[error("{device:?} is a {}: its sessions go over TCP only; attach it without --transport rdma", .kind.noun())]
    TcpOnly {
        /// Device name on the lender.
        device: String,
        /// What the lender lends.
        kind: DeviceKind,
    },
    /// Asked to serve on vhost-user, the lender lends something vhost-user cannot
    /// carry (a PCIe function is attached with `kind` `pci`), or described nothing.
    #[error("the lender lends {device:?} as {}: it is not served on vhost-user", .lent.map_or("an undescribed device", |k| k.noun()))]
    NotVhostUser {
        /// Device name on the lender.
        device: String,
        /// What the lender described, if anything.
        lent: Option<DeviceKind>,
    },
    /// A PCIe function could not be borrowed or served.
    #[error("cannot borrow the PCIe function")]
    Pci(#[source] crate::pci::PciError),
}

#[derive(Default)]
struct Serving {
    stop: AtomicBool,
    /// A live migration's handover of the device.
    handover: Arc<crate::handover::Handover>,
    net_handle: Mutex<Option<ShutdownHandle>>,
    current: Mutex<Option<(Arc<BlkBackend>, Option<ShutdownHandle>)>>,
    connected: AtomicBool,
}

/// A running attachment.
pub struct Attachment {
    /// The session that holds a block device or NIC (a PCIe function's own session
    /// holds it).
    hold: Option<Holder>,
    /// What its kind alone has.
    part: Part,
    config: AttachmentConfig,
    shared: Arc<Serving>,
    wake: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl Attachment {
    /// Opens a session to the lender to learn the device (capacity, limits, serial),
    /// binds the socket and starts serving it.
    ///
    /// # Errors
    /// [`AttachmentError`] naming what failed; nothing is left behind on error.
    pub fn start(config: AttachmentConfig) -> Result<Self, AttachmentError> {
        if config.num_queues == 0 || config.num_queues > MAX_QUEUES {
            return Err(AttachmentError::Queues(config.num_queues));
        }
        prepare_socket_path(&config.socket)?;
        if config.serve == Serve::VfioUser {
            return Self::start_pci(config);
        }
        Self::start_vhost(config)
    }

    /// What it serves: a block device, a NIC or a PCIe function.
    pub fn kind(&self) -> DeviceKind {
        self.part.kind()
    }

    /// What its kind alone has.
    pub fn part(&self) -> &Part {
        &self.part
    }

    /// A live migration's handover of the device ([`crate::handover`]).
    pub fn handover(&self) -> &Arc<crate::handover::Handover> {
        &self.shared.handover
    }

    /// The configuration it was started with.
    pub fn config(&self) -> &AttachmentConfig {
        &self.config
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.config.socket
    }

    /// Whether the lender is gone for good: a PCIe function's fabric session ended (it is
    /// not re-opened under a running VMM). A block device's and a NIC's sessions are
    /// opened again as long as the lender comes back.
    pub fn lender_lost(&self) -> bool {
        match &self.part {
            Part::Pci(p) => p.session_closed(),
            Part::Block(_) | Part::Nic(_) => false,
        }
    }

    /// Whether a frontend is connected now.
    pub fn connected(&self) -> bool {
        self.shared.connected.load(Ordering::Acquire)
    }

    /// Completes the requests in flight (up to [`DRAIN_TIMEOUT`], after which they fail
    /// with IOERR), disconnects the frontend and removes the socket.
    ///
    /// Idempotent; the attachment's counters stay readable afterwards.
    pub fn stop(&mut self) {
        if self.thread.is_some() {
            self.shutdown(DRAIN_TIMEOUT, false);
        }
    }

    /// As [`Self::stop`], for a compute agent that stops to be restarted: requests whose
    /// fabric session is lost, or still in flight after [`DRAIN_TIMEOUT`], are not failed
    /// but left marked in the frontend's inflight buffer for the next agent to resubmit
    /// (when the frontend tracks inflight I/O; otherwise they fail as in `stop`).
    pub fn stop_for_restart(&mut self) {
        if self.thread.is_some() {
            self.shutdown(DRAIN_TIMEOUT, true);
        }
    }

    fn shutdown(&mut self, timeout: Duration, handoff: bool) {
        self.shared.stop.store(true, Ordering::Release);
        if let Part::Pci(pci) = &self.part {
            // vfio-user: one fabric session, no holder, a server thread that cannot be
            // interrupted.
            // The lender quiesces the function and lends it again. The vfio_user
            // server cannot be interrupted: a connection wakes its accept, and a VMM
            // still connected keeps its connection (every request failing) until it
            // closes it, so the thread is left to end then.
            pci.disconnect();
            let _ = std::os::unix::net::UnixStream::connect(&self.config.socket);
            let _ = std::fs::remove_file(&self.config.socket);
            self.thread = None;
            return;
        }
        let _ = self.wake.write(1);
        let current = self
            .shared
            .current
            .lock()
            .map(|c| c.clone())
            .unwrap_or(None);
        if let Some((backend, handle)) = current {
            backend.drain_all(timeout, handoff);
            if let Some(h) = handle {
                h.shutdown();
            }
        }
        if let Some(h) = self
            .shared
            .net_handle
            .lock()
            .ok()
            .and_then(|mut h| h.take())
        {
            h.shutdown();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.config.socket);
        // Release the device on the lender.
        if let Some(h) = &mut self.hold {
            h.release();
        }
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Makes `path` usable for a new listening socket without destroying anything: a stale
/// socket (nobody listening) is removed; a live socket, a file of any other type, or a
/// missing parent directory is an error.
///
/// # Errors
/// [`AttachmentError::SocketPath`] saying what is in the way.
pub fn prepare_socket_path(path: &Path) -> Result<(), AttachmentError> {
    use std::os::unix::fs::FileTypeExt;
    let err = |reason: &str| AttachmentError::SocketPath {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.is_dir() => {
            return Err(err("its directory does not exist"));
        }
        _ => {}
    }
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(err(&format!("cannot inspect it: {e}"))),
    };
    if !meta.file_type().is_socket() {
        return Err(err("exists and is not a socket (refusing to replace it)"));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(err("a live socket: another process is listening on it"));
    }
    std::fs::remove_file(path).map_err(|e| err(&format!("cannot remove the stale socket: {e}")))
}
