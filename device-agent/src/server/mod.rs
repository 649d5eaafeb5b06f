//! The lender: its devices opened, the TCP listener and its accept loop (the RDMA one
//! in [`crate::session::rdma`]), one session thread per connection
//! ([`crate::session::tcp::serve`]), the lease sweeper, reload and shutdown.
//!
//! - [`shared`]: the state every session reads (devices, options, the registry);
//! - [`views`]: read-only handles for the pool link and the metrics.

pub(crate) mod shared;
mod views;

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use devlend_fabric::DeviceDescription;

use self::shared::{LenderState, Registered, Unregister};
pub use self::shared::{Options, ReloadReport};
pub use self::views::{
    DeviceQos, InventoryView, KindCounters, KindView, LentDevice, NicCounters, StatsView,
};
use crate::config::check_unique;
use crate::device::Device;
use crate::leases::{self, LeaseGuard};
use crate::session;
use crate::{DeviceSpec, DeviceStatsSnapshot, Error};

/// How long shutdown waits for the RDMA sessions to answer what they started.
const RDMA_STOP_WAIT: Duration = Duration::from_secs(10);

/// A lender bound to its address, with its devices open, not yet serving.
pub struct Lender {
    listener: Arc<TcpListener>,
    addr: SocketAddr,
    shared: Arc<LenderState>,
}

impl Lender {
    /// Opens `devices` and binds `listen` (`ADDR:PORT`; port 0 picks a free port), with
    /// default [`Options`].
    ///
    /// # Errors
    /// [`Error::NoDevices`], [`Error::DuplicateDevice`], the errors of opening a device
    /// ([`Error::Open`], [`Error::Size`], [`Error::NotBlock`], [`Error::TooSmall`],
    /// [`Error::SerialTooLong`], ...), [`Error::Bind`].
    pub fn bind(listen: &str, devices: Vec<DeviceSpec>) -> Result<Lender, Error> {
        Self::bind_with(listen, devices, Options::default())
    }

    /// [`Lender::bind`] with explicit options. Zero durations are raised to 1 ms.
    ///
    /// # Errors
    /// Those of [`Lender::bind`].
    pub fn bind_with(
        listen: &str,
        devices: Vec<DeviceSpec>,
        mut options: Options,
    ) -> Result<Lender, Error> {
        if devices.is_empty() {
            return Err(Error::NoDevices);
        }
        check_unique(&devices)?;
        // A PF's limits are a store its VFs share.
        for store in devices.iter().filter_map(crate::pci::sriov::pf_store) {
            if options.stores.iter().any(|s| s.name == store.name) {
                return Err(Error::BadSpec {
                    spec: store.name,
                    reason: "a store of this name is configured, and it names a PF's limits (rename the store)".into(),
                });
            }
            options.stores.push(store);
        }
        let devices = crate::pci::sriov::expand(
            &devices,
            crate::pci::sriov::Mode::Start,
            &Default::default(),
            &crate::pci::sriov::kernel_admin,
        )?;
        check_unique(&devices)?;
        let min = Duration::from_millis(1);
        options.handshake_timeout = options.handshake_timeout.max(min);
        options.frame_timeout = options.frame_timeout.max(min);
        let devices = devices
            .iter()
            .map(|spec| Ok((spec.name.clone(), Arc::new(Device::open(spec)?))))
            .collect::<Result<HashMap<_, _>, Error>>()?;
        let bind_err = |source| Error::Bind {
            addr: listen.to_owned(),
            source,
        };
        let listener = TcpListener::bind(listen).map_err(bind_err)?;
        let addr = listener.local_addr().map_err(bind_err)?;
        tracing::info!(%addr, devices = devices.len(), "listening");
        Ok(Lender {
            listener: Arc::new(listener),
            addr,
            shared: Arc::new(LenderState::new(devices, options)),
        })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The counters of `device`; `None` if no device has that name.
    pub fn stats(&self, device: &str) -> Option<DeviceStatsSnapshot> {
        self.shared.stats(device)
    }

    /// What the handshake advertises for `device` (capacity in 512-byte sectors, limits,
    /// flags, serial); `None` if no device has that name.
    pub fn device_info(&self, device: &str) -> Option<DeviceDescription> {
        self.shared.device(device).map(|d| d.info())
    }

    /// The names of the lent devices, sorted.
    pub fn devices(&self) -> Vec<String> {
        self.shared
            .all_devices()
            .iter()
            .map(|d| d.counters.name.clone())
            .collect()
    }

    /// A handle on the counters of every device, for a metrics endpoint.
    pub fn stats_view(&self) -> StatsView {
        StatsView(Arc::clone(&self.shared))
    }

    /// A handle on the list of lent devices (for registering with a pool).
    pub fn inventory_view(&self) -> InventoryView {
        InventoryView(Arc::clone(&self.shared))
    }

    /// Serves leased devices only: every hello must carry a lease token that `guard`
    /// admits, and sessions end when their lease does (see [`crate::leases`]). Without
    /// this call the lender is in direct mode (unauthenticated). Call before serving;
    /// a second call is ignored.
    pub fn require_leases(&self, guard: Arc<LeaseGuard>) {
        if self.shared.leases.set(guard).is_err() {
            tracing::warn!("lease checks were already set; keeping the first");
        }
    }

    /// Serves TLS only (TLS 1.3, `config`'s certificate; client certificates required
    /// if it has a client CA): each connection runs the TLS handshake before the
    /// devlend hello, and plaintext connections are refused. Call before serving; a
    /// second call is ignored.
    pub fn require_tls(&self, config: devlend_fabric::tls::ServerTls) {
        if self.shared.tls.set(config).is_err() {
            tracing::warn!("TLS was already set; keeping the first configuration");
        }
    }

    /// Proves this lender's identity with `key` to every borrower that asks (a
    /// challenge in its hello, `devlend_fabric::lender_proof`).
    pub fn prove_with(&self, key: std::sync::Arc<devlend_fabric::lease_token::TokenSigner>) {
        if self.shared.identity.set(key).is_err() {
            tracing::warn!("the lender's key was already set; keeping the first");
        }
    }

    /// During a key rotation: also proves `key` (the previous one) to the borrowers
    /// whose hello names it as the key they expect; others get the current key's proof.
    pub fn also_prove_with(&self, key: std::sync::Arc<devlend_fabric::lease_token::TokenSigner>) {
        if self.shared.previous_identity.set(key).is_err() {
            tracing::warn!("the lender's previous key was already set; keeping the first");
        }
    }

    /// Also serves RDMA sessions: listens with rdma_cm on `addr` (an `IP:PORT` of an
    /// RDMA device's interface) and serves each connection on its own thread, until
    /// the lender shuts down. The TCP listener stays (holding sessions, TCP borrowers).
    ///
    /// # Errors
    /// [`Error::Rdma`] at once when this build has no RDMA, the machine no RDMA device
    /// or rdma_cm, or the address is on none.
    pub fn serve_rdma(&self, addr: &str) -> Result<(), Error> {
        #[cfg(feature = "rdma")]
        {
            let listener =
                devlend_fabric::rdma::verbs::Listener::bind(addr).map_err(Error::Rdma)?;
            let shared = Arc::clone(&self.shared);
            std::thread::Builder::new()
                .name("dl-rdma-accept".into())
                .spawn(move || crate::session::rdma::accept_loop(shared, listener))
                .map_err(Error::Thread)?;
            tracing::info!(%addr, "serving RDMA sessions (rdma_cm)");
            Ok(())
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = addr;
            Err(Error::Rdma(devlend_fabric::rdma::RdmaError::NotCompiled))
        }
    }

    /// Runs the accept loop on a new thread.
    ///
    /// # Panics
    /// If the thread cannot be created.
    pub fn spawn(self) -> LenderHandle {
        let listener = Arc::clone(&self.listener);
        let shared = Arc::clone(&self.shared);
        let addr = self.addr;
        let thread = std::thread::Builder::new()
            .name("dl-accept".into())
            .spawn(move || {
                if let Err(e) = self.run() {
                    tracing::error!(error = %e, "the lender stopped");
                }
            })
            .expect("cannot start the lender's accept thread");
        LenderHandle {
            listener,
            addr,
            shared,
            thread: Some(thread),
        }
    }

    /// Runs the accept loop on this thread: one session (two threads) per connection.
    /// Returns after [`LenderHandle::shutdown`] once every session has ended.
    ///
    /// # Errors
    /// [`Error::Accept`] if accepting fails for a reason other than a transient one
    /// (a connection aborted, or running out of file descriptors or memory: those are
    /// logged and retried).
    pub fn run(self) -> Result<(), Error> {
        let sweeper = self.shared.leases.get().cloned().map(|guard| {
            let shared = Arc::clone(&self.shared);
            std::thread::Builder::new()
                .name("dl-lease-sweep".into())
                .spawn(move || {
                    while !shared.is_closed() {
                        shared.stop_ended_leases(&guard, leases::now_ms());
                        std::thread::sleep(leases::SWEEP_INTERVAL);
                    }
                })
                .map_err(Error::Thread)
        });
        let sweeper = sweeper.transpose()?;
        // Connections whose TLS handshake and hello are not done in time are closed
        // (the per-read timeout alone lets a peer send its hello a byte at a time).
        let handshakes = {
            let shared = Arc::clone(&self.shared);
            std::thread::Builder::new()
                .name("dl-handshake-sweep".into())
                .spawn(move || {
                    while !shared.is_closed() {
                        let closed = shared.close_overdue_handshakes(std::time::Instant::now());
                        if closed > 0 {
                            devlend_fabric::limited!(
                                info,
                                closed,
                                "connections closed: handshake not done in time"
                            );
                        }
                        std::thread::sleep(Duration::from_millis(250));
                    }
                })
                .map_err(Error::Thread)?
        };
        let mut sessions: Vec<JoinHandle<()>> = Vec::new();
        let mut next_id: u64 = 0;
        let result = loop {
            let (sock, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(_) if self.shared.is_closed() => break Ok(()),
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR | libc::ECONNABORTED | libc::EPROTO | libc::EPERM) => continue,
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                        devlend_fabric::limited!(warn, error = %e, "cannot accept a connection; retrying");
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                    _ => break Err(Error::Accept(e)),
                },
            };
            let id = next_id;
            next_id += 1;
            match self.shared.register(id, &sock, peer.ip()) {
                Registered::Yes => {}
                Registered::Closed => break Ok(()),
                Registered::Refused(why) => {
                    devlend_fabric::limited!(warn, %peer, reason = why, "connection closed at accept");
                    continue;
                }
            }
            tracing::debug!(%peer, id, "connection accepted");
            let shared = Arc::clone(&self.shared);
            let spawned = std::thread::Builder::new()
                .name(format!("dl-session-{id}"))
                .spawn(move || {
                    let _registered = Unregister(Arc::clone(&shared), id);
                    session::tcp::serve(&shared, sock, peer, id);
                });
            match spawned {
                Ok(h) => sessions.push(h),
                Err(e) => {
                    devlend_fabric::limited!(warn, %peer, error = %e, "cannot start a session thread");
                    self.shared.unregister(id);
                }
            }
            sessions.retain(|h| !h.is_finished());
        };
        for h in sessions {
            let _ = h.join();
        }
        let open = self.shared.wait_rdma_sessions(RDMA_STOP_WAIT);
        if open > 0 {
            tracing::warn!(open, "RDMA sessions still open at shutdown");
        }
        if let Some(h) = sweeper {
            let _ = h.join();
        }
        // The handshake sweeper ends with the lender (`is_closed`); not joined, so that
        // an accept error that ends `run` early does not wait for it.
        drop(handshakes);
        result
    }
}

/// A lender running on its own thread (see [`Lender::spawn`]). Dropping it shuts the
/// lender down like [`LenderHandle::shutdown`].
pub struct LenderHandle {
    listener: Arc<TcpListener>,
    addr: SocketAddr,
    shared: Arc<LenderState>,
    thread: Option<JoinHandle<()>>,
}

impl LenderHandle {
    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The counters of `device`; `None` if no device has that name.
    pub fn stats(&self, device: &str) -> Option<DeviceStatsSnapshot> {
        self.shared.stats(device)
    }

    /// A handle on the counters of every device, for a metrics endpoint.
    pub fn stats_view(&self) -> StatsView {
        StatsView(Arc::clone(&self.shared))
    }

    /// Applies a new device list without dropping I/O (SIGHUP): added devices are lent
    /// from now on, removed ones are refused to new sessions unless a borrower holds
    /// them, in which case they stay lent until it detaches.
    ///
    /// # Errors
    /// A new device cannot be opened, or names repeat; nothing changes then.
    pub fn reload(&self, devices: &[DeviceSpec]) -> Result<ReloadReport, Error> {
        self.shared.reload(devices)
    }

    /// Stops accepting, closes every session's connection, and waits until every
    /// session has finished the I/O it had in flight.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.shared.close();
        // Wakes the blocked accept(): on Linux, shutting a listening socket down makes
        // accept fail with EINVAL.
        // SAFETY: the listener's fd stays open while `self.listener` holds its Arc.
        if unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) } != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "cannot stop the listener");
        }
        let _ = thread.join();
        tracing::info!(addr = %self.addr, "lender stopped");
    }
}

impl Drop for LenderHandle {
    fn drop(&mut self) {
        self.stop();
    }
}
