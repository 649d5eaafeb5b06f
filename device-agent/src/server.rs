//! The lender: devices, the listener, the accept loop, and the sessions it starts.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use devlend_fabric::latency::LatencySnapshot;
use devlend_fabric::DeviceInfo;

use crate::config::check_unique;
use crate::device::Device;
use crate::engine::IoMode;
use crate::leases::{self, LeaseGuard};
use crate::{session, DeviceSpec, DeviceStatsSnapshot, Error};

/// Tunables of a lender beyond its devices and address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// How long a new connection may take to send its hello, and the lender to send its
    /// reply (default 10 s).
    pub handshake_timeout: Duration,
    /// How long the rest of a request frame may take once its first byte arrived
    /// (default 30 s); between frames there is no timeout. A peer that stalls inside a
    /// frame for longer breaks the protocol and its session is closed.
    pub frame_timeout: Duration,
    /// Most sessions open at once, over all devices (default 256); the next hello is
    /// answered `Busy`.
    pub max_sessions: usize,
    /// How sessions do device I/O (default: plain system calls for files in memory,
    /// io_uring otherwise).
    pub io: IoMode,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            handshake_timeout: Duration::from_secs(10),
            frame_timeout: Duration::from_secs(30),
            max_sessions: 256,
            io: IoMode::Auto,
        }
    }
}

/// How long shutdown waits for the RDMA sessions to answer what they started.
const RDMA_STOP_WAIT: Duration = Duration::from_secs(10);

/// State shared by the accept loop, the sessions and the handle.
pub(crate) struct Shared {
    devices: RwLock<HashMap<String, Arc<Device>>>,
    pub(crate) options: Options,
    active: AtomicUsize,
    registry: Mutex<Registry>,
    /// Set when the lender serves leased devices only (attached to a pool).
    pub(crate) leases: OnceLock<Arc<LeaseGuard>>,
    /// Set when every connection must be TLS.
    pub(crate) tls: OnceLock<devlend_fabric::tls::ServerTls>,
}

/// The open connections, TCP and RDMA, so that shutdown (or the end of a lease) can
/// close them.
#[derive(Default)]
struct Registry {
    closed: bool,
    streams: HashMap<u64, Tracked>,
}

/// An open connection and the lease its session was admitted under.
struct Tracked {
    conn: Conn,
    lease: Option<[u8; 16]>,
    /// The session was told to stop (its lease ended).
    stopping: bool,
}

/// How a tracked session is told to stop.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
enum Conn {
    /// A TCP connection: shutting its read side down ends the session's reader.
    Tcp(TcpStream),
    /// An RDMA session: its thread checks this flag at least every 200 ms, answers
    /// what it has started, then closes.
    Rdma(Arc<AtomicBool>),
}

impl Conn {
    fn stop(&self) {
        match self {
            Conn::Tcp(s) => {
                let _ = s.shutdown(Shutdown::Read);
            }
            Conn::Rdma(flag) => flag.store(true, Ordering::Release),
        }
    }
}

/// A session counted among the lender's active sessions until dropped.
pub(crate) struct ActiveSession<'a>(&'a AtomicUsize);

impl Drop for ActiveSession<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Shared {
    pub(crate) fn device(&self, name: &str) -> Option<Arc<Device>> {
        self.devices
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    fn all_devices(&self) -> Vec<Arc<Device>> {
        let mut v: Vec<_> = self
            .devices
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Applies a new device list: new names are opened and lent, names no longer listed
    /// stop being lent unless a borrower holds them (then they stay, with a warning), and
    /// a changed spec counts as removed + added.
    fn reload(&self, specs: &[DeviceSpec]) -> Result<ReloadReport, Error> {
        check_unique(specs)?;
        let mut report = ReloadReport::default();
        // Open the new devices before touching the map: a bad spec changes nothing.
        let mut opened = Vec::new();
        {
            let current = self.devices.read().unwrap_or_else(PoisonError::into_inner);
            for spec in specs {
                let same = current
                    .get(&spec.name)
                    .is_some_and(|d| d.spec_matches(spec));
                if !same {
                    opened.push(Arc::new(Device::open(spec)?));
                }
            }
        }
        let mut map = self.devices.write().unwrap_or_else(PoisonError::into_inner);
        let wanted: std::collections::HashSet<&str> =
            specs.iter().map(|s| s.name.as_str()).collect();
        let names: Vec<String> = map.keys().cloned().collect();
        for name in names {
            let replaced = opened.iter().any(|d| d.name == name);
            if wanted.contains(name.as_str()) && !replaced {
                continue;
            }
            let held = map.get(&name).is_some_and(|d| d.is_held());
            if held {
                tracing::warn!(device = %name, "device is attached by a borrower; it stays lent until detached");
                report.kept_held.push(name.clone());
                opened.retain(|d| d.name != name);
            } else {
                map.remove(&name);
                report.removed.push(name);
            }
        }
        for d in opened {
            report.added.push(d.name.clone());
            map.insert(d.name.clone(), d);
        }
        report.added.sort();
        report.removed.sort();
        Ok(report)
    }

    /// Counts one more active session, unless at [`Options::max_sessions`].
    pub(crate) fn try_activate(&self) -> Option<ActiveSession<'_>> {
        let max = self.options.max_sessions;
        self.active
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| ActiveSession(&self.active))
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records an accepted connection; false once the lender is shutting down.
    fn register(&self, id: u64, sock: &TcpStream) -> bool {
        let mut reg = self.registry();
        if reg.closed {
            return false;
        }
        match sock.try_clone() {
            Ok(stream) => {
                reg.streams.insert(
                    id,
                    Tracked {
                        conn: Conn::Tcp(stream),
                        lease: None,
                        stopping: false,
                    },
                );
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot track a connection; closing it");
                false
            }
        }
    }

    /// Records an RDMA session; returns the flag that tells it to stop, or `None` once
    /// the lender is shutting down (the session must then close).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn register_rdma(&self, id: u64) -> Option<Arc<AtomicBool>> {
        let mut reg = self.registry();
        if reg.closed {
            return None;
        }
        let flag = Arc::new(AtomicBool::new(false));
        reg.streams.insert(
            id,
            Tracked {
                conn: Conn::Rdma(Arc::clone(&flag)),
                lease: None,
                stopping: false,
            },
        );
        Some(flag)
    }

    pub(crate) fn unregister(&self, id: u64) {
        self.registry().streams.remove(&id);
    }

    /// Waits up to `timeout` until no RDMA session is open; returns how many still are.
    fn wait_rdma_sessions(&self, timeout: Duration) -> usize {
        let until = std::time::Instant::now() + timeout;
        loop {
            let open = self
                .registry()
                .streams
                .values()
                .filter(|t| matches!(t.conn, Conn::Rdma(_)))
                .count();
            if open == 0 || std::time::Instant::now() >= until {
                return open;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Records the lease that session `id` was admitted under.
    pub(crate) fn set_session_lease(&self, id: u64, lease: [u8; 16]) {
        if let Some(t) = self.registry().streams.get_mut(&id) {
            t.lease = Some(lease);
        }
    }

    /// Stops the sessions whose lease has ended: they answer their requests in flight,
    /// then close. Returns how many were stopped.
    fn stop_ended_leases(&self, guard: &LeaseGuard, now_ms: u64) -> usize {
        let mut reg = self.registry();
        let mut n = 0;
        for (id, t) in reg.streams.iter_mut() {
            let Some(lease) = t.lease else { continue };
            if t.stopping || guard.is_live(&lease, now_ms) {
                continue;
            }
            tracing::info!(session = id, lease = %leases::hex(&lease), "lease ended: the session answers its requests in flight, then closes");
            t.conn.stop();
            t.stopping = true;
            n += 1;
        }
        n
    }

    /// Stops accepting and shuts every connection down (their sessions then end).
    /// Stops every session from reading new requests; each answers what it has in
    /// flight, then closes.
    fn close(&self) {
        let mut reg = self.registry();
        reg.closed = true;
        for t in reg.streams.values() {
            t.conn.stop();
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.registry().closed
    }

    fn stats(&self, device: &str) -> Option<DeviceStatsSnapshot> {
        self.device(device).map(|d| d.stats.snapshot())
    }
}

/// A lender bound to its address, with its devices open, not yet serving.
pub struct Lender {
    listener: Arc<TcpListener>,
    addr: SocketAddr,
    shared: Arc<Shared>,
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
            shared: Arc::new(Shared {
                devices: RwLock::new(devices),
                options,
                active: AtomicUsize::new(0),
                registry: Mutex::new(Registry::default()),
                leases: OnceLock::new(),
                tls: OnceLock::new(),
            }),
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
    pub fn device_info(&self, device: &str) -> Option<DeviceInfo> {
        self.shared.device(device).map(|d| d.info.clone())
    }

    /// The names of the lent devices, sorted.
    pub fn devices(&self) -> Vec<String> {
        self.shared
            .all_devices()
            .iter()
            .map(|d| d.name.clone())
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
                .spawn(move || crate::rdma_session::accept_loop(shared, listener))
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
        let mut sessions: Vec<JoinHandle<()>> = Vec::new();
        let mut next_id: u64 = 0;
        let result = loop {
            let (sock, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(_) if self.shared.is_closed() => break Ok(()),
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR | libc::ECONNABORTED | libc::EPROTO | libc::EPERM) => continue,
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                        tracing::warn!(error = %e, "cannot accept a connection; retrying");
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                    _ => break Err(Error::Accept(e)),
                },
            };
            let id = next_id;
            next_id += 1;
            if !self.shared.register(id, &sock) {
                if self.shared.is_closed() {
                    break Ok(());
                }
                continue;
            }
            tracing::debug!(%peer, id, "connection accepted");
            let shared = Arc::clone(&self.shared);
            let spawned = std::thread::Builder::new()
                .name(format!("dl-session-{id}"))
                .spawn(move || {
                    session::serve(&shared, sock, peer, id);
                    shared.unregister(id);
                });
            match spawned {
                Ok(h) => sessions.push(h),
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "cannot start a session thread");
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
        result
    }
}

/// What a reload changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadReport {
    /// Devices lent from now on.
    pub added: Vec<String>,
    /// Devices no longer lent.
    pub removed: Vec<String>,
    /// Devices to remove that stay lent because a borrower holds them.
    pub kept_held: Vec<String>,
}

/// A lent device as the pool sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LentDevice {
    /// Device name.
    pub name: String,
    /// Lendable bytes (a multiple of 512); 0 for a network interface.
    pub capacity_bytes: u64,
    /// The pool's resource class: `BLOCK`, `NIC` for a network interface, or
    /// `PCI_<VENDOR>_<DEVICE>` for a PCIe function.
    pub resource_class: String,
    /// Writes are refused.
    pub read_only: bool,
    /// Traits to register: `FABRIC_TCP`, `DISCARD`, `WRITE_ZEROES`, `READ_ONLY` as they
    /// apply, then the configured ones; sorted, without repeats.
    pub traits: Vec<String>,
}

/// A handle on the list of lent devices, which a reload can change.
#[derive(Clone)]
pub struct InventoryView(Arc<Shared>);

impl InventoryView {
    /// The devices lent now, sorted by name.
    pub fn devices(&self) -> Vec<LentDevice> {
        self.0
            .all_devices()
            .iter()
            .map(|d| {
                let mut traits = vec!["FABRIC_TCP".to_owned()];
                if d.info.max_discard_sectors > 0 && !d.read_only {
                    traits.push("DISCARD".into());
                }
                if d.info.max_write_zeroes_sectors > 0 && !d.read_only {
                    traits.push("WRITE_ZEROES".into());
                }
                if d.read_only {
                    traits.push("READ_ONLY".into());
                }
                traits.extend(d.traits().iter().cloned());
                traits.sort();
                traits.dedup();
                LentDevice {
                    name: d.name.clone(),
                    capacity_bytes: d.capacity_bytes,
                    resource_class: match (&d.nic, &d.pci) {
                        (Some(_), _) => "NIC".into(),
                        (None, Some(f)) => f.resource_class(),
                        (None, None) => "BLOCK".into(),
                    },
                    read_only: d.read_only,
                    traits,
                }
            })
            .collect()
    }
}

/// The counters of every device of a running lender.
#[derive(Clone)]
pub struct StatsView(Arc<Shared>);

impl StatsView {
    /// Each device's name and counters, by name.
    pub fn all(&self) -> Vec<(String, DeviceStatsSnapshot)> {
        self.0
            .all_devices()
            .iter()
            .map(|d| (d.name.clone(), d.stats.snapshot()))
            .collect()
    }

    /// Each device's name, counters and latency histogram (from receiving a request to
    /// queueing its response), by name.
    pub fn all_with_latency(&self) -> Vec<(String, DeviceStatsSnapshot, LatencySnapshot)> {
        self.0
            .all_devices()
            .iter()
            .map(|d| (d.name.clone(), d.stats.snapshot(), d.stats.latency()))
            .collect()
    }
}

/// A lent network interface's frame counters (since the lender started).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NicCounters {
    /// Frames received on the interface and sent to the borrower.
    pub rx_packets: u64,
    /// Their bytes.
    pub rx_bytes: u64,
    /// Frames from the borrower sent on the interface.
    pub tx_packets: u64,
    /// Their bytes.
    pub tx_bytes: u64,
    /// Frames dropped either way (borrower too slow, too large, interface refused).
    pub drops: u64,
}

impl StatsView {
    /// Each lent interface's device name and frame counters, by name.
    pub fn nics(&self) -> Vec<(String, NicCounters)> {
        use std::sync::atomic::Ordering::Relaxed;
        self.0
            .all_devices()
            .iter()
            .filter_map(|d| {
                let s = &d.nic.as_ref()?.stats;
                Some((
                    d.name.clone(),
                    NicCounters {
                        rx_packets: s.rx_packets.load(Relaxed),
                        rx_bytes: s.rx_bytes.load(Relaxed),
                        tx_packets: s.tx_packets.load(Relaxed),
                        tx_bytes: s.tx_bytes.load(Relaxed),
                        drops: s.drops.load(Relaxed),
                    },
                ))
            })
            .collect()
    }
}

impl std::fmt::Debug for StatsView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatsView")
    }
}

/// A lender running on its own thread (see [`Lender::spawn`]). Dropping it shuts the
/// lender down like [`LenderHandle::shutdown`].
pub struct LenderHandle {
    listener: Arc<TcpListener>,
    addr: SocketAddr,
    shared: Arc<Shared>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_sessions_are_stopped_when_their_lease_ends_and_at_shutdown() {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = dir.path().join("d0.img");
        std::fs::write(&img, vec![0u8; 1 << 20]).expect("image");
        let spec: DeviceSpec = format!("d0={}", img.display()).parse().expect("spec");
        let lender = Lender::bind("127.0.0.1:0", vec![spec]).expect("bind");
        let shared = Arc::clone(&lender.shared);
        let leased = shared.register_rdma(1).expect("registered");
        let direct = shared.register_rdma(2).expect("registered");
        shared.set_session_lease(1, [7; 16]);
        // The guard knows no live lease: lease 7 has ended; session 2 has none.
        let guard = LeaseGuard::direct(Vec::new());
        assert_eq!(shared.stop_ended_leases(&guard, leases::now_ms()), 1);
        assert!(leased.load(Ordering::Acquire));
        assert!(!direct.load(Ordering::Acquire));
        // Told once only.
        assert_eq!(shared.stop_ended_leases(&guard, leases::now_ms()), 0);
        // Shutdown stops the others and admits no new session.
        shared.close();
        assert!(direct.load(Ordering::Acquire));
        assert!(shared.register_rdma(3).is_none());
        // Shutdown waits for the open ones to go.
        assert_eq!(shared.wait_rdma_sessions(Duration::from_millis(50)), 2);
        shared.unregister(1);
        shared.unregister(2);
        assert_eq!(shared.wait_rdma_sessions(Duration::from_millis(50)), 0);
    }
}
