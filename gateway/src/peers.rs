//! Links to peer gateways: one dialled per distinct peer address of the routing table
//! (rejoined with backoff when it drops), and those peers open here (accepted, each
//! offering streams to relay).
//!
//! Both ways the connection is TCP, then TLS 1.3 with certificates on both sides
//! (`fabric`'s TLS: the peer's certificate must chain to the configured CA; a dialler
//! checks the name too), then the [`crate::mux`] link.

use std::collections::{BTreeMap, HashMap};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::config::Config;
use crate::mux::{Incoming, Link, LinkHello, Role};
use crate::Gateway;

/// First delay before redialling a peer.
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest delay between redials.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Bound of the TCP connect, the TLS handshake and the link HELLO, each.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Most TLS handshakes of connecting peers run at once: each holds a blocking thread
/// (shared with this gateway's own dials) for up to [`DIAL_TIMEOUT`]; past it, new
/// connections are closed at once, so that a flood on the peer port cannot starve the
/// dials.
pub const MAX_INBOUND_HANDSHAKES: usize = 32;

/// Why a peer could not be joined.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// The address does not resolve, or no address answers.
    #[error("cannot connect to {addr}")]
    Connect {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// TLS failed (certificate, name, or the connection during the handshake).
    #[error("TLS with {addr} failed")]
    Tls {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: devlend_fabric::tls::TlsError,
    },
    /// The link's HELLO exchange failed.
    #[error("link with {addr} failed")]
    Link {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: crate::mux::MuxError,
    },
}

/// One peer gateway of the routing table.
pub struct PeerSlot {
    /// The clusters routed to it.
    pub clusters: Vec<String>,
    /// Its `HOST:PORT`.
    pub addr: String,
    /// The name its certificate must carry.
    pub server_name: Option<String>,
    link: watch::Sender<Option<Arc<Link>>>,
    /// Links established so far.
    pub connects: AtomicU64,
    /// Why the last attempt failed, if it did.
    pub last_error: Mutex<Option<String>>,
    /// Totals of the links that have ended: bytes sent, bytes received, sessions.
    pub past: [AtomicU64; 3],
}

impl PeerSlot {
    /// The link if it is up, waiting up to `wait` for it to come up.
    pub async fn link(&self, wait: Duration) -> Option<Arc<Link>> {
        let mut rx = self.link.subscribe();
        let up = |l: &Option<Arc<Link>>| l.as_ref().is_some_and(|l| !l.is_closed());
        let r = tokio::time::timeout(wait, rx.wait_for(up)).await;
        match r {
            Ok(Ok(l)) => l.clone(),
            _ => None,
        }
    }

    /// The current link, if any.
    pub fn current(&self) -> Option<Arc<Link>> {
        self.link.borrow().clone().filter(|l| !l.is_closed())
    }

    /// Why the last dial failed, or a placeholder.
    pub fn last_error(&self) -> String {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| "not connected yet".into())
    }
}

/// A link a peer gateway opened to this one.
pub struct Inbound {
    /// The peer's address.
    pub remote: SocketAddr,
    /// The link.
    pub link: Arc<Link>,
}

/// The peer gateways.
pub struct Peers {
    by_cluster: HashMap<String, Arc<PeerSlot>>,
    /// One slot per distinct peer address, in routing-table order.
    pub slots: Vec<Arc<PeerSlot>>,
    /// Links peers opened here, while they last.
    pub inbound: Mutex<Vec<Inbound>>,
}

impl Peers {
    /// The slots of `config`'s routing table (clusters sharing an address share a slot).
    pub fn new(config: &Config) -> Peers {
        let mut by_addr: BTreeMap<(String, Option<String>), Vec<String>> = BTreeMap::new();
        for (cluster, r) in &config.routes {
            by_addr
                .entry((r.addr().to_owned(), r.server_name().map(str::to_owned)))
                .or_default()
                .push(cluster.clone());
        }
        let mut by_cluster = HashMap::new();
        let mut slots = Vec::new();
        for ((addr, server_name), clusters) in by_addr {
            let (tx, _) = watch::channel(None);
            let slot = Arc::new(PeerSlot {
                clusters: clusters.clone(),
                addr,
                server_name,
                link: tx,
                connects: AtomicU64::new(0),
                last_error: Mutex::new(None),
                past: Default::default(),
            });
            for c in clusters {
                by_cluster.insert(c, slot.clone());
            }
            slots.push(slot);
        }
        Peers {
            by_cluster,
            slots,
            inbound: Mutex::new(Vec::new()),
        }
    }

    /// The slot routing `cluster`, if the table has one.
    pub fn for_cluster(&self, cluster: &str) -> Option<&Arc<PeerSlot>> {
        self.by_cluster.get(cluster)
    }

    fn lock_inbound(&self) -> std::sync::MutexGuard<'_, Vec<Inbound>> {
        self.inbound.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Keeps a link to `slot`'s peer up: dials, pings every `ping_interval_ms` while it
/// lasts, and redials with backoff (100 ms doubling to 5 s) when it drops. Runs for
/// ever.
pub async fn keep_peer(gw: Arc<Gateway>, slot: Arc<PeerSlot>) {
    let mut backoff = BACKOFF_MIN;
    let mut failures = 0u64;
    let ping = Duration::from_millis(gw.config.ping_interval_ms);
    loop {
        match dial(&gw, &slot).await {
            Ok(link) => {
                backoff = BACKOFF_MIN;
                failures = 0;
                slot.connects.fetch_add(1, Ordering::Relaxed);
                devlend_fabric::limited!(info, peer = %slot.addr, clusters = ?slot.clusters, peer_cluster = %link.peer_cluster, "link to peer gateway up");
                slot.link.send_replace(Some(link.clone()));
                let _ = link.ping();
                let dead_after = Duration::from_millis(gw.config.link_timeout_ms);
                loop {
                    tokio::select! {
                        _ = link.wait_closed() => break,
                        _ = tokio::time::sleep(ping) => {
                            if link.silent_for() > dead_after {
                                devlend_fabric::limited!(warn, peer = %slot.addr, silent_ms = link.silent_for().as_millis() as u64, "peer gateway silent past link_timeout_ms; closing the link");
                                link.close();
                                break;
                            }
                            let _ = link.ping();
                        }
                    }
                }
                slot.link.send_replace(None);
                let s = &link.stats;
                slot.past[0].fetch_add(s.bytes_sent.load(Ordering::Relaxed), Ordering::Relaxed);
                slot.past[1].fetch_add(s.bytes_received.load(Ordering::Relaxed), Ordering::Relaxed);
                slot.past[2].fetch_add(s.sessions_total.load(Ordering::Relaxed), Ordering::Relaxed);
                devlend_fabric::limited!(warn, peer = %slot.addr, "link to peer gateway lost; rejoining with backoff");
                *slot.last_error.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some("the link was lost; rejoining".into());
            }
            Err(e) => {
                let msg = devlend_fabric::error::chain(&e);
                failures += 1;
                // The first failures, then one in 20: a peer down for long is not a flood.
                if failures <= 3 || failures.is_multiple_of(20) {
                    devlend_fabric::limited!(warn, peer = %slot.addr, error = %msg, attempt = failures, "cannot join peer gateway; retrying with backoff");
                }
                *slot.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(msg);
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// TCP keepalive and user timeout on a peer link: a dead peer shows within ~10 s.
fn set_liveness(tcp: &TcpStream) -> std::io::Result<()> {
    tcp.set_nodelay(true)?;
    devlend_fabric::tcp::set_int_options(
        tcp,
        &[
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 3),
            (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 2),
            (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
            (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 10_000),
        ],
    )
}

async fn dial(gw: &Arc<Gateway>, slot: &PeerSlot) -> Result<Arc<Link>, DialError> {
    let addr = slot.addr.clone();
    let target = devlend_fabric::tls::TlsTarget::new(
        gw.client_tls.clone(),
        &addr,
        slot.server_name.as_deref(),
    )
    .map_err(|source| DialError::Tls {
        addr: addr.clone(),
        source,
    })?;
    let a = addr.clone();
    let unix = tokio::task::spawn_blocking(move || -> Result<_, DialError> {
        let conn_err = |source| DialError::Connect {
            addr: a.clone(),
            source,
        };
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        let mut tcp = None;
        for sa in a.to_socket_addrs().map_err(conn_err)? {
            match TcpStream::connect_timeout(&sa, DIAL_TIMEOUT) {
                Ok(s) => {
                    tcp = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let mut tcp = tcp.ok_or_else(|| conn_err(last))?;
        set_liveness(&tcp).map_err(conn_err)?;
        tcp.set_read_timeout(Some(DIAL_TIMEOUT)).map_err(conn_err)?;
        tcp.set_write_timeout(Some(DIAL_TIMEOUT))
            .map_err(conn_err)?;
        let conn = devlend_fabric::tls::client_handshake(&target, &mut tcp).map_err(|source| {
            DialError::Tls {
                addr: a.clone(),
                source,
            }
        })?;
        let unix = devlend_fabric::tls::spawn_pump(conn, tcp, &a).map_err(conn_err)?;
        unix.set_nonblocking(true).map_err(conn_err)?;
        Ok(unix)
    })
    .await
    .map_err(|e| DialError::Connect {
        addr: addr.clone(),
        source: std::io::Error::other(e),
    })??;
    let io = tokio::net::UnixStream::from_std(unix).map_err(|source| DialError::Connect {
        addr: addr.clone(),
        source,
    })?;
    Link::start(io, Role::Dialer, hello(gw), DIAL_TIMEOUT, None)
        .await
        .map_err(|source| DialError::Link { addr, source })
}

fn hello(gw: &Gateway) -> LinkHello {
    LinkHello {
        cluster: gw.config.cluster.clone(),
        window: gw.config.window,
    }
}

/// Accepts peer gateways on `listener`: TLS with a client certificate, then a link whose
/// streams are relayed ([`crate::relay::transit`]). Runs for ever.
pub async fn accept_peers(gw: Arc<Gateway>, listener: tokio::net::TcpListener) {
    let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_INBOUND_HANDSHAKES));
    let mut refused_logged = std::time::Instant::now() - Duration::from_secs(60);
    loop {
        let (sock, remote) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                devlend_fabric::limited!(warn, error = %e, "cannot accept a peer gateway connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = handshakes.clone().try_acquire_owned() else {
            if refused_logged.elapsed() >= Duration::from_secs(10) {
                refused_logged = std::time::Instant::now();
                tracing::warn!(%remote, limit = MAX_INBOUND_HANDSHAKES, "too many peer handshakes at once; closing new connections");
            }
            drop(sock);
            continue;
        };
        let gw = gw.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_peer(gw, sock, remote, permit).await {
                devlend_fabric::limited!(warn, %remote, error = %e, "peer gateway connection refused or failed");
            }
        });
    }
}

async fn serve_peer(
    gw: Arc<Gateway>,
    sock: tokio::net::TcpStream,
    remote: SocketAddr,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> anyhow::Result<()> {
    let std_sock = sock.into_std()?;
    std_sock.set_nonblocking(false)?;
    let tls = gw.server_tls.clone();
    let label = remote.to_string();
    // The whole handshake within DIAL_TIMEOUT, not just each read: a peer dribbling a
    // byte at a time has its socket shut, which ends the blocking handshake.
    let watchdog = {
        let guard = std_sock.try_clone()?;
        tokio::spawn(async move {
            tokio::time::sleep(DIAL_TIMEOUT).await;
            let _ = guard.shutdown(std::net::Shutdown::Both);
        })
    };
    let unix = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let mut tcp = std_sock;
        set_liveness(&tcp)?;
        tcp.set_read_timeout(Some(DIAL_TIMEOUT))?;
        tcp.set_write_timeout(Some(DIAL_TIMEOUT))?;
        let conn = devlend_fabric::tls::server_handshake(&tls, &mut tcp)
            .map_err(|e| anyhow::anyhow!("TLS: {}", devlend_fabric::error::chain(&e)))?;
        let unix = devlend_fabric::tls::spawn_pump(conn, tcp, &label)?;
        unix.set_nonblocking(true)?;
        Ok(unix)
    })
    .await;
    watchdog.abort();
    drop(permit);
    let unix = unix??;
    let io = tokio::net::UnixStream::from_std(unix)?;
    let (tx, mut rx) = mpsc::unbounded_channel::<Incoming>();
    let link = Link::start(io, Role::Acceptor, hello(&gw), DIAL_TIMEOUT, Some(tx))
        .await
        .map_err(|e| anyhow::anyhow!("link: {}", devlend_fabric::error::chain(&e)))?;
    devlend_fabric::limited!(info, %remote, peer_cluster = %link.peer_cluster, "peer gateway joined");
    gw.peers.lock_inbound().push(Inbound {
        remote,
        link: link.clone(),
    });
    let dead_after = Duration::from_millis(gw.config.link_timeout_ms);
    let mut check = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            s = rx.recv() => match s {
                Some((stream, open)) => {
                    tokio::spawn(crate::relay::transit(gw.clone(), stream, open));
                }
                None => break,
            },
            _ = link.wait_closed() => break,
            _ = check.tick() => {
                if link.silent_for() > dead_after {
                    devlend_fabric::limited!(warn, %remote, silent_ms = link.silent_for().as_millis() as u64, "peer gateway silent past link_timeout_ms; closing its link");
                    link.close();
                    break;
                }
            }
        }
    }
    gw.peers
        .lock_inbound()
        .retain(|i| !Arc::ptr_eq(&i.link, &link));
    devlend_fabric::limited!(info, %remote, peer_cluster = %link.peer_cluster, "peer gateway left");
    Ok(())
}
