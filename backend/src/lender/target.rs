//! Where a device is lent from, and how a queue's session to it is opened.

use std::time::Duration;

/// Where the device is lent from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LenderTarget {
    /// `HOST:PORT` of the lender (with [`Transport::Tcp`]'s `relay`, of the local
    /// cluster gateway): its first path.
    pub addr: String,
    /// More addresses of the same lender (`HOST:PORT`: other NICs, other networks),
    /// paths 1, 2, ... after `addr`. With any, every session is opened on one path and
    /// moves to the next when it fails, sessions carry heartbeats, and a path that
    /// drops silently is left within [`PATH_USER_TIMEOUT`] (`docs/faults.md`, "Paths").
    pub alt_addrs: Vec<String>,
    /// Device name on the lender.
    pub device: String,
    /// The attachment's identity, sent in every hello: the lender lends a device to one
    /// borrower at a time. Under a lease, the lease id.
    pub borrower: [u8; 16],
    /// The pool's lease token (binary form), sent in every hello; empty in direct mode.
    pub token: Vec<u8>,
    /// Open every TCP session inside TLS, verifying the lender against this; `None`:
    /// plain TCP. Over [`Transport::Rdma`] it still covers the holding session, which
    /// is TCP (RDMA traffic is not encrypted).
    pub tls: Option<devlend_fabric::tls::TlsTarget>,
    /// The transport of the virtqueues' sessions (the holding session is TCP), with
    /// what only it has.
    pub transport: Transport,
    /// The lender's public key: every session's hello carries a fresh challenge, and a
    /// session whose lender does not prove this key is refused before any request is
    /// sent ([`devlend_fabric::lender_proof`]). `None`: the lender is not verified
    /// (unless TLS verifies it).
    pub lender_key: Option<devlend_fabric::lease_token::PublicKey>,
    /// The key the token names as its holder: the hello then proves possession of it
    /// and sends the token only after the lender proved itself
    /// ([`devlend_fabric::holder_proof`]). `None`: the token is sent in the hello (a
    /// bearer token, which lenders refuse unless told otherwise).
    pub holder: Option<devlend_fabric::holder_proof::HolderKey>,
    /// Direct mode with this agent's own key: every hello carries a token minted for
    /// it from these claims, valid [`MINTED_TOKEN_LIFETIME_MS`] (instead of `token`).
    pub mint: Option<Mint>,
}

/// How long a token minted for one hello is valid, in ms: the lender admits it within
/// this time, and the session it opens lives on.
pub const MINTED_TOKEN_LIFETIME_MS: u64 = 5 * 60 * 1000;

/// The claims of an attachment's own direct-mode tokens and the key that signs them
/// (and proves possession of them): a fresh token for each hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mint {
    /// Signs the tokens; their holder key.
    pub key: devlend_fabric::holder_proof::HolderKey,
    /// The claims; the expiry is set at each mint.
    pub claims: devlend_fabric::lease_token::LeaseClaims,
}

impl Mint {
    /// A token of these claims expiring [`MINTED_TOKEN_LIFETIME_MS`] from now.
    ///
    /// # Errors
    /// A claim too long for a token.
    pub fn token(&self) -> Result<Vec<u8>, devlend_fabric::lease_token::TokenError> {
        let mut c = self.claims.clone();
        c.expires_at_ms =
            devlend_fabric::lease_token::now_ms().saturating_add(MINTED_TOKEN_LIFETIME_MS);
        Ok(self.key.0.sign(&c)?.as_bytes().to_vec())
    }
}

/// The transport of a target's virtqueue sessions, with its own settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// TCP, optionally inside TLS ([`LenderTarget::tls`]).
    Tcp {
        /// A lender in another cluster: [`LenderTarget::addr`] is then the local
        /// cluster gateway, asked to relay every session to this route; `None`: `addr`
        /// is the lender.
        relay: Option<devlend_fabric::relay::Route>,
    },
    /// RDMA (the holding session stays TCP, never relayed).
    Rdma {
        /// What of the guest's memory the lender can reach.
        exposure: RdmaExposure,
    },
}

impl Transport {
    /// Which transport this is, without its settings.
    pub fn kind(&self) -> devlend_fabric::transport::Transport {
        match self {
            Transport::Tcp { .. } => devlend_fabric::transport::Transport::Tcp,
            Transport::Rdma { .. } => devlend_fabric::transport::Transport::Rdma,
        }
    }

    /// The gateway route of every session (TCP only).
    pub fn relay(&self) -> Option<&devlend_fabric::relay::Route> {
        match self {
            Transport::Tcp { relay } => relay.as_ref(),
            Transport::Rdma { .. } => None,
        }
    }
}

pub use devlend_fabric::transport::RdmaExposure;

impl LenderTarget {
    /// A target in direct mode over plain TCP: `device` of the lender at `addr`, for the
    /// borrower identity `borrower` (no lease token, no TLS, no gateway).
    pub fn direct(addr: impl Into<String>, device: impl Into<String>, borrower: [u8; 16]) -> Self {
        LenderTarget {
            addr: addr.into(),
            alt_addrs: Vec::new(),
            device: device.into(),
            borrower,
            token: Vec::new(),
            tls: None,
            transport: Transport::Tcp { relay: None },
            lender_key: None,
            holder: None,
            mint: None,
        }
    }

    /// How many paths reach the lender: `addr` and every one of `alt_addrs`.
    pub fn path_count(&self) -> usize {
        1 + self.alt_addrs.len()
    }

    /// The address of path `i` (counted modulo [`Self::path_count`]).
    pub fn path_addr(&self, i: usize) -> &str {
        match i % self.path_count() {
            0 => &self.addr,
            k => &self.alt_addrs[k - 1],
        }
    }

    /// Every path's address, in path order.
    pub fn path_addrs(&self) -> impl Iterator<Item = String> + '_ {
        std::iter::once(&self.addr)
            .chain(&self.alt_addrs)
            .map(String::clone)
    }

    /// This target with path `i` first (`addr`), the others after it in their order:
    /// what a session opened on that path is opened with.
    pub fn on_path(&self, i: usize) -> LenderTarget {
        let n = self.path_count();
        let mut t = self.clone();
        t.addr = self.path_addr(i).to_owned();
        t.alt_addrs = (1..n).map(|k| self.path_addr(i + k).to_owned()).collect();
        t
    }

    /// Opens a TCP session (TLS if configured, through the gateway if routed) with
    /// `hello` on `addr`, each step bounded by [`CONNECT_TIMEOUT`]. With several paths,
    /// the TCP connect is bounded by [`PATH_CONNECT_TIMEOUT`] instead (the later steps
    /// keep [`CONNECT_TIMEOUT`]: a lender fencing an earlier session of the queue
    /// answers the hello only once it ended, up to 2 s) and the session's
    /// `TCP_USER_TIMEOUT` is [`PATH_USER_TIMEOUT`].
    ///
    /// # Errors
    /// The connect, relay, TLS or handshake failure.
    pub fn open(
        &self,
        hello: &devlend_fabric::Hello,
    ) -> Result<
        (devlend_fabric::conn::Stream, devlend_fabric::HelloReply),
        devlend_fabric::tcp::ConnectError,
    > {
        let (stream, reply) = if self.path_count() > 1 {
            devlend_fabric::tcp::open_path(
                &self.addr,
                self.transport.relay(),
                hello,
                (PATH_CONNECT_TIMEOUT, CONNECT_TIMEOUT),
                self.tls.as_ref(),
                PATH_USER_TIMEOUT,
            )?
        } else {
            devlend_fabric::tcp::open_via(
                &self.addr,
                self.transport.relay(),
                hello,
                CONNECT_TIMEOUT,
                self.tls.as_ref(),
            )?
        };
        self.check_lender(hello, &reply)?;
        Ok((stream, reply))
    }

    /// Opens the session of `queue` on the first path that takes it, trying each once
    /// from path `start` on; returns it with the path it is on.
    ///
    /// # Errors
    /// Every path failed: the first refusal ([`ConnectError::is_permanent`]) if a path
    /// gave one, else the first busy answer (retried as such), else the first path's
    /// error.
    ///
    /// [`ConnectError::is_permanent`]: devlend_fabric::tcp::ConnectError::is_permanent
    pub fn open_any(
        &self,
        queue: u16,
        start: usize,
    ) -> Result<
        (
            devlend_fabric::conn::Stream,
            devlend_fabric::HelloReply,
            usize,
        ),
        devlend_fabric::tcp::ConnectError,
    > {
        let n = self.path_count();
        let mut first: Option<devlend_fabric::tcp::ConnectError> = None;
        for k in 0..n {
            let path = (start + k) % n;
            let t = self.on_path(path);
            match t.open(&t.hello(queue)) {
                Ok((s, r)) => return Ok((s, r, path)),
                Err(e) => {
                    if first.as_ref().is_none_or(|f| rank(&e) > rank(f)) {
                        first = Some(e);
                    }
                }
            }
        }
        Err(first.unwrap_or(devlend_fabric::tcp::ConnectError::Resolve {
            addr: self.addr.clone(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no path"),
        }))
    }

    /// Checks that the lender that answered `hello` proved [`LenderTarget::lender_key`]
    /// (nothing to check without one).
    ///
    /// # Errors
    /// [`devlend_fabric::tcp::ConnectError::WrongLender`].
    pub fn check_lender(
        &self,
        hello: &devlend_fabric::Hello,
        reply: &devlend_fabric::HelloReply,
    ) -> Result<(), devlend_fabric::tcp::ConnectError> {
        devlend_fabric::tcp::check_lender(&self.addr, self.lender_key.as_ref(), hello, reply)
    }

    /// With several paths and no lender key given: takes the key the lender proved in
    /// `reply` (the holding session's) as the one every later session of the attachment
    /// must prove, on any path. A path that leads to another lender (another key) is
    /// then refused like a lender that cannot prove itself, instead of taking part of
    /// the guest's I/O. A lender without a key proves none: nothing is pinned then.
    /// Returns whether a key was pinned.
    pub fn pin_lender(&mut self, reply: &devlend_fabric::HelloReply) -> bool {
        if self.lender_key.is_some() || self.path_count() < 2 {
            return false;
        }
        self.lender_key = reply.proof.as_ref().map(|p| p.key);
        self.lender_key.is_some()
    }

    /// Whether the token is a live migration's handover token (it names a lease this
    /// one takes the device over from): the attachment is a migration's destination.
    pub fn is_successor(&self) -> bool {
        !self.token.is_empty()
            && devlend_fabric::lease_token::LeaseToken::from_bytes(self.token.clone())
                .claims_unverified()
                .is_ok_and(|c| c.successor_of.is_some())
    }

    /// The hello for virtqueue `queue_index`.
    pub fn hello(&self, queue_index: u16) -> devlend_fabric::Hello {
        let mut h = devlend_fabric::Hello::new(&self.device, queue_index);
        // This borrower can take a NIC too, with transmit offloads: the lender grants
        // them only for one.
        h.features = devlend_fabric::net::FEATURE_NET
            | devlend_fabric::net::FEATURE_NET_OFFLOAD
            | devlend_fabric::FEATURE_CREDIT
            | devlend_fabric::FEATURE_THROTTLE_NOTE;
        if self.path_count() > 1 {
            // Each path's liveness rides on its TCP acknowledgements (heartbeats).
            h.features |= devlend_fabric::FEATURE_HEARTBEAT;
        }
        h.borrower = self.borrower;
        h.token = match self.mint.as_ref().map(Mint::token) {
            Some(Ok(t)) => t,
            _ => self.token.clone(),
        };
        if let Some(k) = &self.lender_key {
            h.ask_proof_of(k);
        } else if self.path_count() > 1 {
            // Several paths and no key given: the holding session learns the key of the
            // lender that answers it, and every other session must prove that one
            // (`Self::pin_lender`), so a path to another lender is refused.
            h.ask_proof();
        }
        h.holder = holder(&h.token, self.holder.as_ref(), self.lender_key);
        h
    }
}

/// How much an error of one path says about the lender, for [`LenderTarget::open_any`]:
/// a refusal, then a busy answer, then a path that failed.
fn rank(e: &devlend_fabric::tcp::ConnectError) -> u8 {
    match e {
        _ if e.is_permanent() => 2,
        devlend_fabric::tcp::ConnectError::Refused { .. } => 1,
        _ => 0,
    }
}

/// What a hello proves possession with: `key`, when there is a token to send.
pub fn holder(
    token: &[u8],
    key: Option<&devlend_fabric::holder_proof::HolderKey>,
    lender: Option<devlend_fabric::lease_token::PublicKey>,
) -> Option<devlend_fabric::holder_proof::Holder> {
    match key {
        Some(k) if !token.is_empty() => Some(devlend_fabric::holder_proof::Holder {
            key: k.clone(),
            lender,
        }),
        _ => None,
    }
}

/// A fresh random borrower identity (from the kernel's random source; falls back to
/// the clock and process id if it is unavailable).
pub fn new_borrower_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut id))
        .is_ok();
    if !ok || id == [0; 16] {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(1);
        id[..8].copy_from_slice(&(t as u64).to_le_bytes());
        id[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        id[15] |= 1;
    }
    id
}

/// Timeout of one connect + handshake attempt to the lender.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// With several paths, the timeout of the TCP connect of a session on one: a path cut
/// silently costs a queue this before it tries the next, and it is marked down for the
/// others. TLS and the hello keep [`CONNECT_TIMEOUT`], above the lender's 2 s wait for
/// a fenced session to end.
pub const PATH_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// With several paths, how long a session stays on the path it failed over to before it
/// moves back to its own, once that is up again (a disk's queue waits for an idle
/// moment too).
pub const FAILBACK_AFTER: Duration = Duration::from_secs(1);

/// With several paths, how often a session sends a heartbeat (a disk's while requests
/// are in flight, a NIC's always): with [`PATH_USER_TIMEOUT`], a path that drops
/// silently is left at most this plus that after the drop.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(100);

/// With several paths, how long data sent on a session may stay unacknowledged by the
/// lender's TCP before the session is declared lost (`TCP_USER_TIMEOUT`; one path
/// rides out a cut for 15 s instead, since it has nowhere else to go).
pub const PATH_USER_TIMEOUT: Duration = Duration::from_millis(300);

#[cfg(test)]
mod tests {
    use super::*;
    use devlend_fabric::lease_token::{LeaseClaims, LeaseToken, TokenSigner};

    #[test]
    fn paths_rotate_and_only_several_ask_for_heartbeats() {
        let mut t = LenderTarget::direct("a:1", "disk0", [1; 16]);
        assert_eq!(t.path_count(), 1);
        assert_eq!(t.hello(0).features & devlend_fabric::FEATURE_HEARTBEAT, 0);
        t.alt_addrs = vec!["b:1".into(), "c:1".into()];
        assert_eq!(t.path_count(), 3);
        assert_eq!((t.path_addr(1), t.path_addr(5)), ("b:1", "c:1"));
        let p = t.on_path(2);
        assert_eq!(p.addr, "c:1");
        assert_eq!(p.alt_addrs, vec!["a:1".to_owned(), "b:1".to_owned()]);
        assert_ne!(p.hello(0).features & devlend_fabric::FEATURE_HEARTBEAT, 0);
    }

    #[test]
    fn every_hello_carries_a_freshly_minted_token_bound_to_the_key() {
        let key = devlend_fabric::holder_proof::HolderKey::new(TokenSigner::from_seed([3; 32]));
        let claims = LeaseClaims {
            lease_id: [1; 16],
            expires_at_ms: 1,
            provider: String::new(),
            device: "disk0".into(),
            consumer: "vm".into(),
            provider_key: None,
            qos: None,
            successor_of: None,
            epoch: None,
            holder_key: Some(key.public_key().to_bytes()),
        };
        let mut t = LenderTarget::direct("127.0.0.1:1", "disk0", [1; 16]);
        t.token = vec![9; 4];
        t.holder = Some(key.clone());
        t.mint = Some(Mint {
            key: key.clone(),
            claims: claims.clone(),
        });
        let h = t.hello(0);
        let got = key
            .public_key()
            .verify(&LeaseToken::from_bytes(h.token.clone()))
            .expect("signed by the key");
        let now = devlend_fabric::lease_token::now_ms();
        assert!(got.expires_at_ms > now && got.expires_at_ms <= now + MINTED_TOKEN_LIFETIME_MS);
        assert_eq!(
            LeaseClaims {
                expires_at_ms: 1,
                ..got
            },
            claims
        );
        // Possession is proven with the key the token names.
        assert_eq!(h.holder.map(|x| x.key), Some(key));
        // Without a mint, the stored token goes out.
        t.mint = None;
        assert_eq!(t.hello(0).token, vec![9; 4]);
    }
}
