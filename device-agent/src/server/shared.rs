//! The lender's state shared by its accept loops, its sessions and its handle: the
//! devices lent (which a reload changes), the options, the count of active sessions,
//! the registry of open connections (TCP and RDMA, so that shutdown or the end of a
//! lease can stop them), and the lease guard and TLS configuration when set.
//!
//! The bottom of the session layer: sessions read it, nothing here knows a session.

use std::collections::HashMap;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use crate::config::check_unique;
use crate::device::Device;
use crate::leases::{self, LeaseGuard};
pub use crate::options::Options;
use crate::{DeviceSpec, DeviceStatsSnapshot, Error};

mod fence;
pub(crate) use fence::QueueKey;

impl LenderState {
    /// The proof for `hello`'s challenge, when it asks for one and this lender has a
    /// key (without a key, the borrower that asked refuses the session): by the
    /// previous key of a rotation when the hello names that one, else by the current.
    pub(crate) fn proof(
        &self,
        hello: &devlend_fabric::Hello,
    ) -> Option<devlend_fabric::lender_proof::LenderProof> {
        let current = self.identity.get()?;
        let key = match (hello.expected_lender, self.previous_identity.get()) {
            (Some(asked), Some(previous))
                if asked == previous.public_key().to_bytes()
                    && asked != current.public_key().to_bytes() =>
            {
                previous
            }
            (Some(asked), previous)
                if asked != current.public_key().to_bytes()
                    && previous.is_none_or(|p| asked != p.public_key().to_bytes()) =>
            {
                // It will refuse this lender: say why here too.
                devlend_fabric::limited!(warn, device = %hello.device, expected = %devlend_fabric::lease_token::PublicKey::from_bytes(&asked).map(|k| k.to_text()).unwrap_or_default(), "the borrower expects a lender key this lender does not hold (its lease predates a key rotation? keep the old key with --previous-key-file)");
                current
            }
            _ => current,
        };
        hello.prove(key)
    }
}

/// State shared by the accept loop, the sessions and the handle.
pub(crate) struct LenderState {
    devices: RwLock<HashMap<String, Arc<Device>>>,
    pub(crate) options: Options,
    active: AtomicUsize,
    registry: Mutex<Registry>,
    /// Signalled when a connection leaves the registry (a fence waits on it).
    unregistered: Condvar,
    /// Set when the lender serves leased devices only (attached to a pool).
    pub(crate) leases: OnceLock<Arc<LeaseGuard>>,
    /// Set when every connection must be TLS.
    pub(crate) tls: OnceLock<devlend_fabric::tls::ServerTls>,
    /// This lender's key, which answers the challenges of borrowers that ask it to prove
    /// who it is ([`devlend_fabric::lender_proof`]).
    pub(crate) identity: OnceLock<Arc<devlend_fabric::lease_token::TokenSigner>>,
    /// During a key rotation, the previous key: proven to borrowers that ask for it.
    pub(crate) previous_identity: OnceLock<Arc<devlend_fabric::lease_token::TokenSigner>>,
    /// The backing stores of [`Options::stores`], by name.
    stores: HashMap<String, Arc<crate::qos::Store>>,
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
    /// Set when a newer session of the same queue fences this one (for RDMA, the
    /// session's stop flag).
    fence: Arc<AtomicBool>,
    /// The borrower's queue this session serves, once admitted as one that fences and
    /// is fenced ([`LenderState::fence_earlier`]).
    queue: Option<QueueKey>,
    lease: Option<[u8; 16]>,
    /// The session was told to stop (its lease ended).
    stopping: bool,
    /// While its TLS handshake and hello are not done: the peer's address, and when the
    /// connection is closed if they are still not done.
    handshake: Option<(IpAddr, Instant)>,
}

/// Connections in their handshake (TLS and hello) at once; more are closed at accept.
pub const MAX_HANDSHAKES: usize = 256;
/// Connections in their handshake at once from one IP address.
pub const MAX_HANDSHAKES_PER_ADDRESS: usize = 64;

/// Why one more connection in its handshake from `peer` is too many ([`MAX_HANDSHAKES`]
/// at all, [`MAX_HANDSHAKES_PER_ADDRESS`] from one address; TCP and RDMA together).
fn over_handshake_caps(reg: &Registry, peer: IpAddr) -> Option<&'static str> {
    let (mut all, mut from_peer) = (0, 0);
    for (ip, _) in reg.streams.values().filter_map(|t| t.handshake) {
        all += 1;
        from_peer += usize::from(ip == peer);
    }
    if all >= MAX_HANDSHAKES {
        return Some("too many connections in their handshake");
    }
    (from_peer >= MAX_HANDSHAKES_PER_ADDRESS)
        .then_some("too many connections in their handshake from this address")
}

/// What [`LenderState::register`] did with an accepted connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Registered {
    /// Tracked: serve it.
    Yes,
    /// The lender is shutting down.
    Closed,
    /// Too many connections are in their handshake (from its address, or at all), or
    /// it cannot be tracked: close it.
    Refused(&'static str),
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

/// Removes a connection from the registry when dropped: when its session thread ends,
/// by return or by panic (a registry entry left behind would keep fencing its queue,
/// every new session of it answered busy).
pub(crate) struct Unregister(pub(crate) Arc<LenderState>, pub(crate) u64);

impl Drop for Unregister {
    fn drop(&mut self) {
        self.0.unregister(self.1);
    }
}

/// A session counted among the lender's active sessions until dropped.
pub(crate) struct ActiveSession<'a>(&'a AtomicUsize);

impl Drop for ActiveSession<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl LenderState {
    /// The state of a lender of `devices`, serving no session yet.
    pub(super) fn new(devices: HashMap<String, Arc<Device>>, options: Options) -> LenderState {
        let stores = options
            .stores
            .iter()
            .map(|s| {
                let store = crate::qos::Store::new(s.capacity);
                (s.name.clone(), Arc::new(store))
            })
            .collect();
        LenderState {
            stores,
            devices: RwLock::new(devices),
            options,
            active: AtomicUsize::new(0),
            registry: Mutex::new(Registry::default()),
            unregistered: Condvar::new(),
            leases: OnceLock::new(),
            tls: OnceLock::new(),
            identity: OnceLock::new(),
            previous_identity: OnceLock::new(),
        }
    }
    /// The backing store `dev` sits on, if it names one that is configured.
    pub(crate) fn store_of(&self, dev: &Device) -> Option<Arc<crate::qos::Store>> {
        self.stores.get(dev.store_name()?).cloned()
    }

    pub(crate) fn device(&self, name: &str) -> Option<Arc<Device>> {
        self.devices
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    pub(crate) fn all_devices(&self) -> Vec<Arc<Device>> {
        let mut v: Vec<_> = self
            .devices
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.counters.name.cmp(&b.counters.name));
        v
    }

    /// Applies a new device list: new names are opened and lent, names no longer listed
    /// stop being lent unless a borrower holds them (then they stay, with a warning), and
    /// a changed spec counts as removed + added.
    pub(super) fn reload(&self, specs: &[DeviceSpec]) -> Result<ReloadReport, Error> {
        check_unique(specs)?;
        // A PF's limits are a store, read at start like the others: say that a change
        // waits for a restart, rather than take it silently.
        for store in specs.iter().filter_map(crate::pci::sriov::pf_store) {
            if let Some(s) = self.stores.get(&store.name) {
                if s.capacity != store.capacity {
                    tracing::warn!(store = %store.name, "a PF's limits changed: they are read at start only; restart the lender to apply them");
                }
            }
        }
        let specs = &crate::pci::sriov::expand(
            specs,
            crate::pci::sriov::Mode::Reload,
            &Default::default(),
            &crate::pci::sriov::kernel_admin,
        )?;
        check_unique(specs)?;
        // Stores are read at start: a device may name only one of those.
        if let Some((spec, store)) = specs
            .iter()
            .find_map(|s| Some((s, s.store()?)).filter(|(_, st)| !self.stores.contains_key(*st)))
        {
            return Err(Error::BadSpec {
                spec: spec.name.clone(),
                reason: format!(
                    "store {store:?} was not configured when the lender started; stores are read at start only (restart the lender)"
                ),
            });
        }
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
            let replaced = opened.iter().any(|d| d.counters.name == name);
            if wanted.contains(name.as_str()) && !replaced {
                continue;
            }
            let held = map.get(&name).is_some_and(|d| d.is_held());
            if held {
                tracing::warn!(device = %name, "device is attached by a borrower; it stays lent until detached");
                report.kept_held.push(name.clone());
                opened.retain(|d| d.counters.name != name);
            } else {
                map.remove(&name);
                report.removed.push(name);
            }
        }
        for d in opened {
            report.added.push(d.counters.name.clone());
            map.insert(d.counters.name.clone(), d);
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

    /// Records a connection accepted from `peer`, in its handshake until
    /// [`Self::handshake_done`]: at most [`MAX_HANDSHAKES`] at once, and
    /// [`MAX_HANDSHAKES_PER_ADDRESS`] from one address; one that is not done within the
    /// handshake timeout of now is closed by [`Self::close_overdue_handshakes`].
    pub(super) fn register(&self, id: u64, sock: &TcpStream, peer: IpAddr) -> Registered {
        let mut reg = self.registry();
        if reg.closed {
            return Registered::Closed;
        }
        if let Some(why) = over_handshake_caps(&reg, peer) {
            return Registered::Refused(why);
        }
        match sock.try_clone() {
            Ok(stream) => {
                reg.streams.insert(
                    id,
                    Tracked {
                        conn: Conn::Tcp(stream),
                        fence: Arc::new(AtomicBool::new(false)),
                        queue: None,
                        lease: None,
                        stopping: false,
                        handshake: Some((peer, Instant::now() + self.options.handshake_timeout)),
                    },
                );
                Registered::Yes
            }
            Err(_) => Registered::Refused("cannot track the connection (out of file descriptors?)"),
        }
    }

    /// The connection's hello was answered: it no longer counts as in its handshake.
    pub(crate) fn handshake_done(&self, id: u64) {
        if let Some(t) = self.registry().streams.get_mut(&id) {
            t.handshake = None;
        }
    }

    /// Whether connection `id`'s handshake is past its deadline (the sweeper closes such
    /// connections: what their session then reads is the lender's doing).
    pub(crate) fn handshake_overdue(&self, id: u64, now: Instant) -> bool {
        self.registry()
            .streams
            .get(&id)
            .and_then(|t| t.handshake)
            .is_some_and(|(_, deadline)| deadline <= now)
    }

    /// Closes the connections whose TLS handshake and hello are not done by their
    /// deadline (a peer that sends its hello a byte at a time); returns how many.
    pub(super) fn close_overdue_handshakes(&self, now: Instant) -> usize {
        let reg = self.registry();
        let mut closed = 0;
        for t in reg.streams.values() {
            if let (Some((_, deadline)), Conn::Tcp(s)) = (t.handshake, &t.conn) {
                if deadline <= now {
                    let _ = s.shutdown(Shutdown::Both);
                    closed += 1;
                }
            }
        }
        closed
    }

    /// Records an RDMA connection request from `peer`, in its handshake until
    /// [`Self::handshake_done`], under the same caps as TCP's ([`Self::register`]);
    /// its session thread holds it to its deadline (`deadline`, from now). Returns the
    /// flag that tells the session to stop, or why it must be rejected.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn register_rdma(
        &self,
        id: u64,
        peer: IpAddr,
        deadline: Instant,
    ) -> Result<Arc<AtomicBool>, Registered> {
        let mut reg = self.registry();
        if reg.closed {
            return Err(Registered::Closed);
        }
        if let Some(why) = over_handshake_caps(&reg, peer) {
            return Err(Registered::Refused(why));
        }
        let flag = Arc::new(AtomicBool::new(false));
        reg.streams.insert(
            id,
            Tracked {
                conn: Conn::Rdma(Arc::clone(&flag)),
                fence: Arc::clone(&flag),
                queue: None,
                lease: None,
                stopping: false,
                handshake: Some((peer, deadline)),
            },
        );
        Ok(flag)
    }

    pub(crate) fn unregister(&self, id: u64) {
        self.registry().streams.remove(&id);
        self.unregistered.notify_all();
    }

    /// Waits up to `timeout` until no RDMA session is open; returns how many still are.
    pub(super) fn wait_rdma_sessions(&self, timeout: Duration) -> usize {
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

    /// The leases of the sessions open now (each once): their holders are alive, which
    /// the pool's heartbeat is told so that it renews them.
    pub(crate) fn served_leases(&self) -> Vec<[u8; 16]> {
        let mut out: Vec<[u8; 16]> = self
            .registry()
            .streams
            .values()
            .filter(|t| !t.stopping)
            .filter_map(|t| t.lease)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Stops the sessions whose lease has ended: they answer their requests in flight,
    /// then close. Returns how many were stopped.
    pub(super) fn stop_ended_leases(&self, guard: &LeaseGuard, now_ms: u64) -> usize {
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
    pub(super) fn close(&self) {
        let mut reg = self.registry();
        reg.closed = true;
        for t in reg.streams.values() {
            t.conn.stop();
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.registry().closed
    }

    pub(super) fn stats(&self, device: &str) -> Option<DeviceStatsSnapshot> {
        self.device(device).map(|d| d.counters.stats.snapshot())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::Lender;

    /// A lender of one 1 MiB file device `d0`, on loopback (the directory holds it).
    fn lender() -> (tempfile::TempDir, Lender) {
        let dir = tempfile::tempdir().expect("tempdir");
        let img = dir.path().join("d0.img");
        std::fs::write(&img, vec![0u8; 1 << 20]).expect("image");
        let spec: DeviceSpec = format!("d0={}", img.display()).parse().expect("spec");
        let lender = Lender::bind("127.0.0.1:0", vec![spec]).expect("bind");
        (dir, lender)
    }

    #[test]
    fn rdma_sessions_are_stopped_when_their_lease_ends_and_at_shutdown() {
        let (_dir, lender) = lender();
        let shared = Arc::clone(&lender.shared);
        let (ip, later) = (
            IpAddr::from([10, 0, 0, 1]),
            Instant::now() + Duration::from_secs(10),
        );
        let leased = shared.register_rdma(1, ip, later).expect("registered");
        let direct = shared.register_rdma(2, ip, later).expect("registered");
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
        assert_eq!(
            shared.register_rdma(3, ip, later).err(),
            Some(Registered::Closed)
        );
        // Shutdown waits for the open ones to go.
        assert_eq!(shared.wait_rdma_sessions(Duration::from_millis(50)), 2);
        shared.unregister(1);
        shared.unregister(2);
        assert_eq!(shared.wait_rdma_sessions(Duration::from_millis(50)), 0);
    }

    #[test]
    fn rdma_connection_requests_count_against_the_handshake_caps() {
        let (_dir, lender) = lender();
        let shared = Arc::clone(&lender.shared);
        let later = Instant::now() + Duration::from_secs(10);
        let flood = IpAddr::from([10, 0, 0, 2]);
        for id in 0..MAX_HANDSHAKES_PER_ADDRESS as u64 {
            assert!(
                shared.register_rdma(id, flood, later).is_ok(),
                "request {id}"
            );
        }
        assert_eq!(
            shared.register_rdma(100, flood, later).err(),
            Some(Registered::Refused(
                "too many connections in their handshake from this address"
            ))
        );
        // Another address is served; a handshake done no longer counts.
        let other = IpAddr::from([10, 0, 0, 3]);
        assert!(shared.register_rdma(101, other, later).is_ok());
        shared.handshake_done(0);
        assert!(shared.register_rdma(102, flood, later).is_ok());
        // The cap over all addresses, RDMA and TCP together.
        let mut id = 200;
        let mut taken = 0;
        for a in 0..8u8 {
            for _ in 0..MAX_HANDSHAKES_PER_ADDRESS {
                id += 1;
                if shared
                    .register_rdma(id, IpAddr::from([10, 1, 0, a]), later)
                    .is_ok()
                {
                    taken += 1;
                }
            }
        }
        assert_eq!(taken, MAX_HANDSHAKES - MAX_HANDSHAKES_PER_ADDRESS - 1);
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let sock = TcpStream::connect(tcp.local_addr().expect("addr")).expect("connect");
        assert!(matches!(
            shared.register(999, &sock, IpAddr::from([10, 2, 0, 1])),
            Registered::Refused("too many connections in their handshake")
        ));
    }

    #[test]
    fn during_a_rotation_the_key_a_hello_asks_for_is_proven() {
        use devlend_fabric::lease_token::TokenSigner;
        let (_dir, lender) = lender();
        let (old, new) = (
            TokenSigner::from_seed([1; 32]),
            TokenSigner::from_seed([2; 32]),
        );
        let other = TokenSigner::from_seed([3; 32]);
        lender.prove_with(Arc::new(TokenSigner::from_seed([2; 32])));
        let proven = |asked: Option<&TokenSigner>| {
            let mut h = devlend_fabric::Hello::new("d0", 0);
            match asked {
                Some(k) => h.ask_proof_of(&k.public_key()),
                None => h.ask_proof(),
            }
            lender.shared.proof(&h).expect("a proof").key
        };
        // Before the previous key is given, the current one answers every hello.
        assert_eq!(proven(Some(&old)), new.public_key());
        lender.also_prove_with(Arc::new(TokenSigner::from_seed([1; 32])));
        assert_eq!(proven(Some(&old)), old.public_key());
        assert_eq!(proven(Some(&new)), new.public_key());
        assert_eq!(proven(Some(&other)), new.public_key());
        assert_eq!(proven(None), new.public_key());
    }
}
