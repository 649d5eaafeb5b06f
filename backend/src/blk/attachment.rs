//! A lent block device served on a vhost-user socket.
//!
//! [`Attachment::start`] checks the device with the lender, binds the socket and serves
//! it on a thread: each frontend connection (a VMM, libblkio) gets a fresh
//! [`BlkBackend`] and daemon (a daemon cannot serve twice), on the same listening socket,
//! so a VMM can disconnect and come back. [`Attachment::stop`] completes the requests in
//! flight, drops the connection and removes the socket.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use devlend_fabric::reconnect::{Attempt, GaveUp, Policy, Reconnector, SystemClock};
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::blk::backend::{BlkBackend, DRAIN_TIMEOUT};
use crate::blk::engine::{LenderTarget, QueueStats, StatsSnapshot};
use crate::blk::holder::Holder;
use crate::blk::request::DeviceLimits;
use crate::blk::spec::MAX_QUEUES;
use crate::net::spec::MAX_QUEUE_PAIRS;
use crate::net::{NetStats, NetStatsSnapshot};

pub use crate::blk::holder::{BUSY_RETRY, CONTROL_QUEUE};

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
    /// The device is a PCIe function: serve it over vfio-user ([`crate::pci`]) instead
    /// of vhost-user; `num_queues`, `poll` and `reconnect_deadline` do not apply.
    pub pci: bool,
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
    /// A PCIe function could not be borrowed or served.
    #[error("cannot borrow the PCIe function")]
    Pci(#[source] crate::pci::PciError),
}

#[derive(Default)]
struct Shared {
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
    /// For a PCIe function: its borrower.
    pci: Option<crate::pci::PciHandle>,
    config: AttachmentConfig,
    limits: Arc<DeviceLimits>,
    stats: Arc<QueueStats>,
    net: Option<Arc<NetStats>>,
    /// A lent NIC's link (MAC, MTU) as the lender reported it at start.
    link: Option<devlend_fabric::net::LinkState>,
    shared: Arc<Shared>,
    wake: EventFd,
    thread: Option<JoinHandle<()>>,
}

/// How long attaching a PCIe function retries while the lender answers busy (it may
/// still be quiescing the function for its previous borrower).
const PCI_BUSY_WAIT: Duration = Duration::from_secs(3);
/// Attaching a PCIe function: "busy" retried every 250 ms for [`PCI_BUSY_WAIT`].
const PCI_BUSY: Policy =
    Policy::backoff(Duration::from_millis(250), Duration::from_millis(250)).deadline(PCI_BUSY_WAIT);

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
        if config.pci {
            return Self::start_pci(config);
        }
        // This session holds the device on the lender for the attachment's lifetime
        // (a device is lent to one borrower at a time); it carries no I/O.
        let (hold, reply) =
            crate::blk::holder::open(&config.lender).map_err(AttachmentError::Lender)?;
        // An RDMA attachment fails now, with the reason, when RDMA cannot work (no
        // device, no route, the lender not serving it), not later at the first request.
        crate::blk::engine::probe_transport(&config.lender).map_err(AttachmentError::Lender)?;
        let holder = Holder::start(&config.id, config.lender.clone(), hold)
            .map_err(AttachmentError::Thread)?;
        let shared = Arc::new(Shared {
            handover: Arc::new(crate::handover::Handover::new(Some(holder.control()))),
            ..Shared::default()
        });
        let hold = Some(holder);
        let limits = Arc::new(
            reply
                .device
                .as_ref()
                .map_or_else(DeviceLimits::not_block, DeviceLimits::from_description),
        );
        let listener =
            Listener::new(&config.socket, true).map_err(|source| AttachmentError::Listen {
                path: config.socket.clone(),
                source,
            })?;
        // Only the owner and its group (e.g. the VMM's) may join the socket.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&config.socket, std::fs::Permissions::from_mode(0o660))
                .map_err(|source| AttachmentError::Listen {
                    path: config.socket.clone(),
                    source: vhost::vhost_user::Error::SocketError(source),
                })?;
        }
        let wake = EventFd::new(EFD_NONBLOCK).map_err(AttachmentError::Thread)?;
        let stats = Arc::new(QueueStats::new(config.num_queues));
        if let Some(nic) = reply.nic() {
            // A lent NIC: `num_queues` counts queue pairs.
            if config.num_queues > MAX_QUEUE_PAIRS {
                return Err(AttachmentError::QueuePairs(config.num_queues));
            }
            let link = nic.link();
            crate::net::spec::check_link(&link).map_err(AttachmentError::BadLink)?;
            let offload = reply.features & devlend_fabric::net::FEATURE_NET_OFFLOAD != 0;
            let net = Arc::new(NetStats::new(config.num_queues, link.up, link.mtu));
            let thread = {
                let (config, net, shared) = (config.clone(), net.clone(), shared.clone());
                let wake = wake.try_clone().map_err(AttachmentError::Thread)?;
                std::thread::Builder::new()
                    .name(format!("attach-{}", config.lender.device))
                    .spawn(move || {
                        crate::net::backend::serve(
                            listener,
                            &config.id,
                            &config.lender,
                            config.num_queues,
                            &link,
                            offload,
                            &net,
                            &shared.stop,
                            &shared.handover,
                            |l| wait_for_client(l, &wake, &shared),
                            |h| {
                                if let Ok(mut c) = shared.net_handle.lock() {
                                    *c = h;
                                }
                            },
                            &shared.connected,
                        )
                    })
                    .map_err(AttachmentError::Thread)?
            };
            return Ok(Attachment {
                hold,
                pci: None,
                config,
                limits,
                stats,
                net: Some(net),
                link: Some(link),
                shared,
                wake,
                thread: Some(thread),
            });
        }
        let thread = {
            let (config, limits, stats, shared) = (
                config.clone(),
                limits.clone(),
                stats.clone(),
                shared.clone(),
            );
            let wake = wake.try_clone().map_err(AttachmentError::Thread)?;
            std::thread::Builder::new()
                .name(format!("attach-{}", config.lender.device))
                .spawn(move || serve(listener, wake, config, limits, stats, shared))
                .map_err(AttachmentError::Thread)?
        };
        Ok(Attachment {
            hold,
            pci: None,
            config,
            limits,
            stats,
            net: None,
            link: None,
            shared,
            wake,
            thread: Some(thread),
        })
    }

    /// A PCIe function on a vfio-user socket: one fabric session to the lender holds the
    /// function and carries everything; the serving thread takes one VMM connection
    /// after the other.
    fn start_pci(config: AttachmentConfig) -> Result<Self, AttachmentError> {
        let target = crate::pci::LinkTarget {
            lender: config.lender.addr.clone(),
            device: config.lender.device.clone(),
            borrower: config.lender.borrower,
            token: config.lender.token.clone(),
            tls: config.lender.tls.clone(),
            timeout: Duration::from_secs(10),
            transport: config.lender.transport,
            lender_key: config.lender.lender_key,
        };
        // A function just given back by this compute agent (a detach, then an attach at
        // once) may still be quiescing on the lender, which answers busy meanwhile.
        let borrower = Reconnector::new(PCI_BUSY)
            .run(&SystemClock, |_| {
                match crate::pci::PciBorrower::connect(&target) {
                    Ok(b) => Attempt::Done(b),
                    Err(
                        e @ crate::pci::PciError::Connect(
                            devlend_fabric::tcp::ConnectError::Refused {
                                status: devlend_fabric::HelloStatus::Busy,
                                ..
                            },
                        ),
                    ) => Attempt::Failed(e),
                    Err(e) => Attempt::Refused(e),
                }
            })
            .map_err(|g| match g {
                GaveUp::Refused(e) | GaveUp::Deadline(e) => AttachmentError::Pci(e),
                GaveUp::Stopped => unreachable!("attaching is never stopped"),
            })?;
        let server = borrower
            .listen(&config.socket)
            .map_err(AttachmentError::Pci)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&config.socket, std::fs::Permissions::from_mode(0o660))
                .map_err(|source| AttachmentError::Listen {
                    path: config.socket.clone(),
                    source: vhost::vhost_user::Error::SocketError(source),
                })?;
        }
        let handle = borrower.handle();
        let shared = Arc::new(Shared::default());
        let thread = {
            let (shared, id) = (shared.clone(), config.id.clone());
            let mut borrower = borrower;
            std::thread::Builder::new()
                .name(format!("attach-{}", config.lender.device))
                .spawn(move || {
                    while !shared.stop.load(Ordering::Acquire) {
                        if let Err(e) = server.run(&mut borrower) {
                            tracing::info!(attachment = %id, error = %e, "vfio-user connection ended");
                        }
                        if shared.stop.load(Ordering::Acquire) {
                            break;
                        }
                        if let Err(e) = borrower.vmm_gone() {
                            tracing::warn!(attachment = %id, error = %e, "the PCI session is gone");
                            break;
                        }
                    }
                })
                .map_err(AttachmentError::Thread)?
        };
        Ok(Attachment {
            hold: None,
            pci: Some(handle),
            limits: Arc::new(DeviceLimits::not_block()),
            stats: Arc::new(QueueStats::new(1)),
            net: None,
            link: None,
            shared,
            wake: EventFd::new(EFD_NONBLOCK).map_err(AttachmentError::Thread)?,
            thread: Some(thread),
            config,
        })
    }

    /// For a borrowed PCIe function: its counters.
    pub fn pci_stats(&self) -> Option<&crate::pci::PciStats> {
        self.pci.as_ref().map(|h| h.stats())
    }

    /// For a lent NIC: its packet counters and link state.
    pub fn net_stats(&self) -> Option<NetStatsSnapshot> {
        self.net.as_ref().map(|n| n.snapshot())
    }

    /// For a lent NIC: its counters, shared (e.g. with a thread that follows the link).
    pub fn net_counters(&self) -> Option<Arc<NetStats>> {
        self.net.clone()
    }

    /// For a lent NIC: the link (MAC, MTU) the lender reported when it was attached.
    pub fn net_link(&self) -> Option<devlend_fabric::net::LinkState> {
        self.link
    }

    /// A live migration's handover of the device ([`crate::handover`]).
    pub fn handover(&self) -> &Arc<crate::handover::Handover> {
        &self.shared.handover
    }

    /// The configuration it was started with.
    pub fn config(&self) -> &AttachmentConfig {
        &self.config
    }

    /// The device as the lender described it.
    pub fn limits(&self) -> &DeviceLimits {
        &self.limits
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.config.socket
    }

    /// I/O counters since start.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Whether the lender is gone for good: a PCIe function's fabric session ended (it is
    /// not re-opened under a running VMM).
    pub fn lender_lost(&self) -> bool {
        self.pci.as_ref().is_some_and(|p| p.session_closed())
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
        if let Some(pci) = &self.pci {
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

fn set_current(shared: &Shared, v: Option<(Arc<BlkBackend>, Option<ShutdownHandle>)>) {
    if let Ok(mut c) = shared.current.lock() {
        *c = v;
    }
}

/// Waits until the listener has a pending connection (true) or stop is asked (false).
fn wait_for_client(listener: &Listener, wake: &EventFd, shared: &Shared) -> bool {
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return false;
        }
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: fds is a valid array of two pollfds for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n > 0 && fds[0].revents & libc::POLLIN != 0 && !shared.stop.load(Ordering::Acquire) {
            return true;
        }
    }
}

fn serve(
    listener: Listener,
    wake: EventFd,
    config: AttachmentConfig,
    limits: Arc<DeviceLimits>,
    stats: Arc<QueueStats>,
    shared: Arc<Shared>,
) {
    let name = format!("devlend-blk-{}", config.lender.device);
    let budget = crate::budget::for_attachment();
    while wait_for_client(&listener, &wake, &shared) {
        let Some(stream) =
            crate::budget::accept_admitted(&listener, &budget, &shared.stop, &config.id)
        else {
            continue;
        };
        let backend = Arc::new(
            BlkBackend::new(
                Arc::from(config.id.as_str()),
                limits.clone(),
                config.num_queues,
                &config.lender,
                stats.clone(),
                config.reconnect_deadline,
            )
            .with_poll(config.poll)
            .with_handover(shared.handover.clone()),
        );
        let mut daemon = match VhostUserDaemon::new(name.clone(), backend.clone(), backend.memory())
        {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(attachment = %config.id, error = %e, "cannot create vhost-user daemon");
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
        };
        daemon.set_message_budget(budget.clone());
        backend.attach_handlers(&daemon.get_epoll_handlers());
        set_current(&shared, Some((backend.clone(), None)));
        if let Err(e) = daemon.start_stream(stream) {
            devlend_fabric::limited!(warn, attachment = %config.id, error = %e, "vhost-user connection failed to start");
        } else {
            set_current(&shared, Some((backend.clone(), daemon.shutdown_handle())));
            shared.connected.store(true, Ordering::Release);
            devlend_fabric::limited!(info, attachment = %config.id, socket = %config.socket.display(), "frontend connected");
            if shared.stop.load(Ordering::Acquire) {
                backend.drain_all(DRAIN_TIMEOUT, false);
                daemon.request_shutdown();
            }
            match daemon.wait() {
                Ok(()) => {
                    devlend_fabric::limited!(info, attachment = %config.id, socket = %config.socket.display(), "frontend disconnected")
                }
                Err(e) => {
                    devlend_fabric::limited!(info, attachment = %config.id, socket = %config.socket.display(), error = %e, "frontend connection ended")
                }
            }
            shared.connected.store(false, Ordering::Release);
        }
        set_current(&shared, None);
        drop(daemon);
        backend.close_exit_fds();
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
