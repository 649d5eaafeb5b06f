//! Lease enforcement: which sessions a lender may serve.
//!
//! A borrower opens a session with a lease token in its hello
//! ([`devlend_fabric::lease_token`]). [`LeaseGuard::admit`] checks the signature, that
//! the token names this lender (provider) and the device asked for, and that the hello's
//! borrower identity is the lease id. [`LeaseGuard::is_live`] is what the lender's
//! sweeper asks, every [`SWEEP_INTERVAL`], of each open session's lease; the sessions of
//! an ended lease stop reading requests, answer those in flight, and close.
//!
//! **Pool mode** ([`LeaseGuard::new`]): a lease ends at the lender only when the pool
//! says so, or when a newer lease of the same device is presented: never by a clock.
//! Every lease carries a fencing epoch (the pool's counter that only grows), and the
//! guard keeps, per device, a *fence*: the lowest epoch it may still serve. The fence
//! rises to the epoch of every ordinary lease admitted (the pool grants a device anew
//! only once its lease before ended, so an older holder is fenced even while the pool
//! cannot be reached), and to what the pool's heartbeat answers say
//! ([`LeaseGuard::update_from_pool`]: one past a released or expired lease). A pool
//! that cannot be reached changes nothing: the leases served go on. The fences are kept
//! in a file ([`LeaseGuard::with_state_file`]), so a lender restarted while the pool
//! is away still fences what it fenced before (docs/pool.md, "When a lease ends").
//!
//! **Direct mode** ([`LeaseGuard::direct`]): tokens signed by the borrowers' own keys; no
//! pool renews or ends them. A token that names its holder's key (every compute agent
//! mints one for each hello, valid minutes) may open sessions until its expiry, and
//! those live on; a bearer token's sessions end at its expiry.
//!
//! **Possession** (both modes): a token names its holder's key, and the borrower signs
//! the lender's nonce of each handshake with it ([`devlend_fabric::holder_proof`]); a
//! token that names no holder key is a bearer token, refused unless the operator allows
//! them ([`LeaseGuard::allow_bearer_tokens`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use devlend_fabric::holder_proof;
use devlend_fabric::lease_token::{LeaseClaims, LeaseToken, PublicKey};
use devlend_fabric::{Hello, HelloStatus};

/// How often the lender checks the leases of its open sessions.
pub const SWEEP_INTERVAL: Duration = Duration::from_millis(250);

/// Most leases tracked: admissions past it forget those of fenced epochs first.
const MAX_TRACKED: usize = 65_536;

/// One device's fence as the pool's heartbeat answer gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolFence {
    /// Device name on this lender.
    pub device: String,
    /// The lowest lease epoch the device may be served to.
    pub fence: u64,
}

#[derive(Debug, Clone)]
struct Tracked {
    device: String,
    /// Pool mode: the token's epoch (0 for a token without one).
    epoch: u64,
    /// Direct mode: the token's expiry, ms since the epoch.
    expires_at_ms: u64,
    /// Which of the guard's keys signed its first token: its later tokens must be
    /// signed by the same key. In direct mode each compute agent signs with its own
    /// key, so one agent cannot take on another's lease id. (A handover token may be
    /// signed by any trusted key: a destination hands over in turn with its own key a
    /// lease whose token the source signed.)
    key: usize,
    /// Logged as ended already.
    told: bool,
}

/// The fence of `device` in `fences` (0: none known).
fn fence_of(fences: &HashMap<String, u64>, device: &str) -> u64 {
    fences.get(device).copied().unwrap_or(0)
}

impl Tracked {
    /// Pool mode: its epoch is not below its device's fence.
    fn servable(&self, fences: &HashMap<String, u64>) -> bool {
        self.epoch >= fence_of(fences, &self.device)
    }
}

/// A session's lease, as its token gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The lease id.
    pub lease: [u8; 16],
    /// The lease's limits, if its token carries any.
    pub qos: Option<devlend_fabric::qos::Qos>,
    /// The lease it takes the device over from (a live migration's handover).
    pub successor_of: Option<[u8; 16]>,
}

#[derive(Debug, Default)]
struct State {
    leases: HashMap<[u8; 16], Tracked>,
    /// Pool mode: per device, the lowest epoch served.
    fences: HashMap<String, u64>,
}

/// Where the fences are kept, and for which pool key.
#[derive(Debug)]
struct FenceFile {
    path: PathBuf,
    /// Serializes writers, so that the last write holds the newest fences.
    write: Mutex<()>,
}

/// The fences file's content.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct SavedFences {
    /// The pool key the fences were learned under (base64url).
    pool_key: String,
    fences: HashMap<String, u64>,
}

/// The lease checks of one lender.
#[derive(Debug)]
pub struct LeaseGuard {
    keys: Vec<PublicKey>,
    provider: String,
    pool_mode: bool,
    /// Tokens that name no holder key are taken (`--allow-bearer-tokens`).
    bearer: std::sync::atomic::AtomicBool,
    state: Mutex<State>,
    file: Option<FenceFile>,
}

pub use devlend_fabric::lease_token::now_ms;

impl LeaseGuard {
    /// A guard that accepts tokens signed by the pool's `key` for the provider named
    /// `provider`.
    pub fn new(key: PublicKey, provider: &str) -> Self {
        LeaseGuard {
            keys: vec![key],
            provider: provider.to_owned(),
            pool_mode: true,
            bearer: std::sync::atomic::AtomicBool::new(false),
            state: Mutex::new(State::default()),
            file: None,
        }
    }

    /// The same guard, keeping its fences in `path` (JSON, written atomically): the
    /// fences learned under the same pool key before are loaded now. A missing,
    /// unreadable or other pool's file starts empty (logged).
    pub fn with_state_file(mut self, path: PathBuf) -> Self {
        let key = self
            .keys
            .first()
            .map(PublicKey::to_text)
            .unwrap_or_default();
        match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<SavedFences>(&bytes) {
                Ok(saved) if saved.pool_key == key => {
                    tracing::info!(file = %path.display(), devices = saved.fences.len(), "lease fences loaded");
                    self.state
                        .get_mut()
                        .unwrap_or_else(PoisonError::into_inner)
                        .fences = saved.fences;
                }
                Ok(saved) => {
                    tracing::warn!(file = %path.display(), pinned = %saved.pool_key, presented = %key, "the pool presents another key than the one pinned in the lease fences file: its fences are dropped and the new key pinned (set [pool] public_key to refuse another key)")
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "the lease fences file is damaged; starting without fences")
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "cannot read the lease fences file; starting without fences")
            }
        }
        self.file = Some(FenceFile {
            path,
            write: Mutex::new(()),
        });
        self
    }

    /// A guard for direct mode with authentication: it accepts tokens that a borrower
    /// signed itself with one of `keys` (its compute agent's `auth_key_file`), with an
    /// empty provider. No pool tells it of renewals or releases: a token is good until
    /// its own expiry.
    pub fn direct(keys: Vec<PublicKey>) -> Self {
        LeaseGuard {
            keys,
            provider: String::new(),
            pool_mode: false,
            bearer: std::sync::atomic::AtomicBool::new(false),
            state: Mutex::new(State::default()),
            file: None,
        }
    }

    /// Takes tokens that name no holder key when `allow` (bearer
    /// tokens: of a pool or compute agent from before proof of possession, or of a pool
    /// with `--insecure-open-api`). Anyone who saw such a token on the wire can use it.
    pub fn allow_bearer_tokens(&self, allow: bool) {
        self.bearer
            .store(allow, std::sync::atomic::Ordering::Relaxed);
    }

    /// The provider name tokens must carry.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Checks the token of `hello` at `now_ms` (direct mode's clock; pool mode reads no
    /// clock). Returns the lease, or the refusal (`Denied`).
    pub fn admit(&self, hello: &Hello, now_ms: u64) -> Result<Admitted, (HelloStatus, String)> {
        let (admitted, raised) = self
            .check(hello, now_ms)
            .map_err(|m| (HelloStatus::Denied, m))?;
        if raised {
            self.save();
        }
        Ok(admitted)
    }

    fn check(&self, hello: &Hello, now_ms: u64) -> Result<(Admitted, bool), String> {
        if hello.token.is_empty() {
            return Err(
                "the hello carries no lease token: this lender serves only borrowers with a pool lease or a key it trusts".into(),
            );
        }
        let token = LeaseToken::from_bytes(hello.token.clone());
        let mut verified = Err(devlend_fabric::lease_token::TokenError::BadSignature);
        let mut signer = 0;
        for (i, key) in self.keys.iter().enumerate() {
            verified = key.verify(&token);
            if verified.is_ok() {
                signer = i;
                break;
            }
        }
        let claims = verified.map_err(|e| format!("lease token refused: {e}"))?;
        self.check_possession(hello, &claims)?;
        if claims.provider != self.provider {
            return Err(format!(
                "lease token is for provider {:?}, this lender is {:?}",
                claims.provider, self.provider
            ));
        }
        if claims.device != hello.device {
            return Err(format!(
                "lease token is for device {:?}, not {:?}",
                claims.device, hello.device
            ));
        }
        if claims.lease_id != hello.borrower {
            return Err("the hello's borrower identity is not the token's lease id".into());
        }
        let epoch = claims.epoch.unwrap_or(0);
        let mut st = self.state();
        if st
            .leases
            .get(&claims.lease_id)
            .is_some_and(|t| t.key != signer)
        {
            return Err("the token's lease id belongs to another borrower key".into());
        }
        let mut raised = false;
        if self.pool_mode {
            let fence = fence_of(&st.fences, &claims.device);
            if epoch < fence {
                return Err(format!(
                    "the lease has ended: device {:?} was released, or leased again, since (lease epoch {epoch}, the device's fence {fence})",
                    claims.device
                ));
            }
            // An ordinary lease is granted only once the device's lease before it has
            // ended: older holders are fenced from now on. A handover's successor waits
            // for its predecessor instead, which stays live until it lets go.
            if claims.successor_of.is_none() && epoch > fence {
                st.fences.insert(claims.device.clone(), epoch);
                raised = true;
            }
        } else if claims.expires_at_ms <= now_ms {
            return Err(format!(
                "the lease expired {} ms ago",
                now_ms - claims.expires_at_ms
            ));
        }
        if st.leases.len() >= MAX_TRACKED && !st.leases.contains_key(&claims.lease_id) {
            let State { leases, fences } = &mut *st;
            leases.retain(|_, t| t.servable(fences));
        }
        if st.leases.len() < MAX_TRACKED {
            // Direct mode: a token that names its holder's key is minted for each
            // hello, valid minutes; its expiry bounds when it may open a session, and
            // the sessions it opened live on. A bearer token ends its sessions at its
            // expiry, as before.
            let expires_at_ms = match claims.holder_key {
                Some(_) if !self.pool_mode => u64::MAX,
                _ => claims.expires_at_ms,
            };
            st.leases.entry(claims.lease_id).or_insert(Tracked {
                device: claims.device.clone(),
                epoch,
                expires_at_ms,
                key: signer,
                told: false,
            });
        }
        Ok((
            Admitted {
                lease: claims.lease_id,
                qos: claims.qos,
                successor_of: claims.successor_of,
            },
            raised,
        ))
    }

    /// The borrower proved possession of the token's holder key for this handshake, or
    /// the token is a bearer token and those are allowed.
    fn check_possession(&self, hello: &Hello, claims: &LeaseClaims) -> Result<(), String> {
        let Some(k) = claims.holder_key else {
            return if self.bearer.load(std::sync::atomic::Ordering::Relaxed) {
                Ok(())
            } else {
                Err("the lease token names no holder key (a bearer token, from a pool or compute agent without proof of possession): refused (a lender takes such tokens with --allow-bearer-tokens)".into())
            };
        };
        let key = PublicKey::from_bytes(&k)
            .map_err(|_| "the lease token's holder key is not an Ed25519 key".to_owned())?;
        let Some(held) = hello.held.as_ref() else {
            return Err(holder_proof::HolderError::Missing.to_string());
        };
        holder_proof::check(Some(held), &hello.possession_message(&held.nonce), &key)
            .map_err(|e| e.to_string())
    }

    /// Whether the lease may still be served: in pool mode, while its epoch is not
    /// below its device's fence; in direct mode, until its token's expiry (`now_ms`).
    pub fn is_live(&self, lease: &[u8; 16], now_ms: u64) -> bool {
        let mut st = self.state();
        let State { leases, fences } = &mut *st;
        let Some(t) = leases.get_mut(lease) else {
            return false;
        };
        let live = if self.pool_mode {
            t.servable(fences)
        } else {
            t.expires_at_ms > now_ms
        };
        if !live && !t.told {
            t.told = true;
            tracing::info!(lease = %hex(lease), device = %t.device, "lease ended (released or expired at the pool, or the device leased again)");
        }
        live
    }

    /// The fence of `device` (0: none known).
    pub fn fence(&self, device: &str) -> u64 {
        fence_of(&self.state().fences, device)
    }

    /// Takes in the fences of a pool's heartbeat answer: a device's fence only rises.
    /// The leases below their device's new fence have ended (released, or expired while
    /// the pool was there and nobody served them).
    pub fn update_from_pool(&self, fences: &[PoolFence]) {
        let mut raised = false;
        {
            let mut st = self.state();
            for f in fences {
                let e = st.fences.entry(f.device.clone()).or_insert(0);
                if f.fence > *e {
                    *e = f.fence;
                    raised = true;
                }
            }
            if raised {
                let State { leases, fences } = &mut *st;
                // Forget what can never be served again and no session holds (a session's
                // lease is looked up by is_live, which answers false for a forgotten one).
                leases.retain(|_, t| !t.told || t.servable(fences));
            }
        }
        if raised {
            self.save();
        }
    }

    /// Writes the fences, and the pool key they are under, to the state file, if any
    /// (logged on failure: the fences still hold in memory). Called at each change, and
    /// once the pool answered at start, so that the file names the pool's current key.
    pub fn save(&self) {
        let Some(file) = &self.file else { return };
        let _writing = file.write.lock().unwrap_or_else(PoisonError::into_inner);
        let saved = SavedFences {
            pool_key: self
                .keys
                .first()
                .map(PublicKey::to_text)
                .unwrap_or_default(),
            fences: self.state().fences.clone(),
        };
        let result = serde_json::to_vec_pretty(&saved)
            .map_err(std::io::Error::other)
            .and_then(|bytes| {
                let tmp = file.path.with_extension("tmp");
                std::fs::write(&tmp, bytes)?;
                std::fs::rename(&tmp, &file.path)
            });
        if let Err(e) = result {
            devlend_fabric::limited!(warn, file = %file.path.display(), error = %e, "cannot save the lease fences; they hold until the lender restarts");
        }
    }
}

/// A lease id as the pool and the CLI write it: a dashed lower-case UUID.
pub fn hex(id: &[u8; 16]) -> String {
    let h: String = id.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use devlend_fabric::holder_proof::{Held, Possession};
    use devlend_fabric::lease_token::{LeaseClaims, TokenSigner};

    /// The compute host's key that the test tokens name as holder.
    fn holder() -> TokenSigner {
        TokenSigner::from_seed([0x42; 32])
    }

    /// What the lender reads from a borrower that holds `key`: the token, and the
    /// signature of a fresh nonce.
    fn proved(mut h: Hello, key: &TokenSigner) -> Hello {
        let nonce = holder_proof::nonce().unwrap();
        let p = Possession::sign(key, &h.possession_message(&nonce), h.token.clone());
        h.held = Some(Held {
            nonce,
            signature: p.signature,
        });
        h
    }

    fn hello(signer: &TokenSigner, provider: &str, device: &str, expires: u64) -> Hello {
        leased(signer, provider, device, expires, 9, None, None)
    }

    fn leased(
        signer: &TokenSigner,
        provider: &str,
        device: &str,
        expires: u64,
        lease: u8,
        epoch: Option<u64>,
        successor_of: Option<u8>,
    ) -> Hello {
        let claims = LeaseClaims {
            lease_id: [lease; 16],
            expires_at_ms: expires,
            provider: provider.into(),
            device: device.into(),
            consumer: "vm".into(),
            provider_key: None,
            qos: None,
            successor_of: successor_of.map(|p| [p; 16]),
            epoch,
            holder_key: Some(holder().public_key().to_bytes()),
        };
        let mut h = Hello::new(device, 0);
        h.borrower = [lease; 16];
        h.token = signer.sign(&claims).unwrap().as_bytes().to_vec();
        proved(h, &holder())
    }

    fn direct_hello(signer: &TokenSigner, lease: u8, successor_of: Option<u8>) -> Hello {
        let claims = LeaseClaims {
            lease_id: [lease; 16],
            expires_at_ms: u64::MAX,
            provider: String::new(),
            device: "disk0".into(),
            consumer: "vm".into(),
            provider_key: None,
            qos: None,
            successor_of: successor_of.map(|p| [p; 16]),
            epoch: None,
            holder_key: Some(signer.public_key().to_bytes()),
        };
        let mut h = Hello::new("disk0", 0);
        h.borrower = [lease; 16];
        h.token = signer.sign(&claims).unwrap().as_bytes().to_vec();
        proved(h, signer)
    }

    #[test]
    fn a_token_opens_only_with_its_holders_signature_of_this_handshake() {
        let pool = TokenSigner::from_seed([8; 32]);
        let g = LeaseGuard::new(pool.public_key(), "p");
        let h = leased(&pool, "p", "disk0", u64::MAX, 1, Some(1), None);
        assert!(g.admit(&h, 0).is_ok());
        // The token replayed as captured: no signature (a hello that sent it in the
        // clear, as before proof of possession).
        let mut bare = h.clone();
        bare.held = None;
        let e = g.admit(&bare, 0).unwrap_err();
        assert_eq!(e.0, HelloStatus::Denied);
        assert!(e.1.contains("did not prove possession"), "{}", e.1);
        // The captured signature under the lender's next nonce.
        let mut replayed = h.clone();
        if let Some(held) = replayed.held.as_mut() {
            held.nonce = holder_proof::nonce().unwrap();
        }
        let e = g.admit(&replayed, 0).unwrap_err();
        assert!(e.1.contains("does not verify"), "{}", e.1);
        // Another host's key signing this very handshake.
        let mut thief = h.clone();
        thief.held = None;
        let e = g
            .admit(&proved(thief, &TokenSigner::from_seed([9; 32])), 0)
            .unwrap_err();
        assert!(e.1.contains("does not verify"), "{}", e.1);
        // Signed for another queue than the hello's.
        let mut other_queue = h.clone();
        other_queue.queue_index = 1;
        assert!(g.admit(&other_queue, 0).is_err());
    }

    #[test]
    fn bearer_tokens_are_refused_unless_allowed() {
        let pool = TokenSigner::from_seed([8; 32]);
        let claims = LeaseClaims {
            lease_id: [3; 16],
            expires_at_ms: u64::MAX,
            provider: "p".into(),
            device: "disk0".into(),
            consumer: "vm".into(),
            provider_key: None,
            qos: None,
            successor_of: None,
            epoch: Some(1),
            holder_key: None,
        };
        let mut h = Hello::new("disk0", 0);
        h.borrower = [3; 16];
        h.token = pool.sign(&claims).unwrap().as_bytes().to_vec();
        let e = LeaseGuard::new(pool.public_key(), "p")
            .admit(&h, 0)
            .unwrap_err();
        assert!(e.1.contains("--allow-bearer-tokens"), "{}", e.1);
        let g = LeaseGuard::new(pool.public_key(), "p");
        g.allow_bearer_tokens(true);
        assert!(g.admit(&h, 0).is_ok());
    }

    #[test]
    fn a_lease_id_belongs_to_the_key_that_first_signed_it() {
        // Found by a trial: any trusted key could sign a token for the holder's lease id
        // (shown in a busy refusal) and write its disk.
        let (a, c) = (
            TokenSigner::from_seed([1; 32]),
            TokenSigner::from_seed([3; 32]),
        );
        let g = LeaseGuard::direct(vec![a.public_key(), c.public_key()]);
        assert!(g.admit(&direct_hello(&a, 5, None), 1).is_ok());
        let refused = |h| g.admit(&h, 1).unwrap_err();
        assert_eq!(refused(direct_hello(&c, 5, None)).0, HelloStatus::Denied);
        // A handover token (A's) makes lease 6 A's key's; the destination hands it over
        // in turn with its own key (C here), whose successor is C's.
        assert!(g.admit(&direct_hello(&a, 6, Some(5)), 1).is_ok());
        assert_eq!(refused(direct_hello(&c, 6, Some(5))).0, HelloStatus::Denied);
        assert!(g.admit(&direct_hello(&c, 8, Some(6)), 1).is_ok());
        assert_eq!(refused(direct_hello(&a, 8, Some(6))).0, HelloStatus::Denied);
        assert!(g.admit(&direct_hello(&a, 5, None), 1).is_ok());
        // C's own leases are C's.
        assert!(g.admit(&direct_hello(&c, 7, None), 1).is_ok());
        assert_eq!(refused(direct_hello(&a, 7, None)).0, HelloStatus::Denied);
    }

    #[test]
    fn admits_only_a_matching_lease_whatever_the_clocks_say() {
        let signer = TokenSigner::from_seed([1; 32]);
        let g = LeaseGuard::new(signer.public_key(), "lender-a");
        // Pool mode reads no clock: a token "expired" by this lender's clock (minutes of
        // skew, or a pool outage past its TTL) is served; only the pool ends it.
        assert!(g
            .admit(&hello(&signer, "lender-a", "d0", 900), 1000)
            .is_ok());
        assert!(g.is_live(&[9; 16], u64::MAX));
        assert!(g
            .admit(&hello(&signer, "lender-b", "d0", 2000), 1000)
            .is_err());
        let mut h = hello(&signer, "lender-a", "d0", 2000);
        h.device = "d1".into();
        assert!(g.admit(&h, 1000).is_err());
        let mut h = hello(&signer, "lender-a", "d0", 2000);
        h.borrower = [8; 16];
        assert!(g.admit(&h, 1000).is_err());
        let mut h = hello(&signer, "lender-a", "d0", 2000);
        h.token.clear();
        assert!(g.admit(&h, 1000).is_err());
        let other = TokenSigner::from_seed([2; 32]);
        assert!(g
            .admit(&hello(&other, "lender-a", "d0", 2000), 1000)
            .is_err());
        // Direct mode: a token that names its holder (minted for each hello) opens
        // sessions until its expiry, and those live on.
        let d = LeaseGuard::direct(vec![signer.public_key()]);
        let h = hello(&signer, "", "d0", 2000);
        assert!(d.admit(&h, 1000).is_ok());
        assert!(d.is_live(&[9; 16], 1999));
        assert!(d.is_live(&[9; 16], 2000));
        let e = d.admit(&h, 2000).unwrap_err();
        assert!(e.1.contains("expired"), "{}", e.1);
        // A bearer token (allowed) is good until its own expiry, sessions included.
        let d = LeaseGuard::direct(vec![signer.public_key()]);
        d.allow_bearer_tokens(true);
        let claims = LeaseClaims {
            lease_id: [4; 16],
            expires_at_ms: 2000,
            provider: String::new(),
            device: "d0".into(),
            consumer: "vm".into(),
            provider_key: None,
            qos: None,
            successor_of: None,
            epoch: None,
            holder_key: None,
        };
        let mut h = Hello::new("d0", 0);
        h.borrower = [4; 16];
        h.token = signer.sign(&claims).unwrap().as_bytes().to_vec();
        assert!(d.admit(&h, 1000).is_ok());
        assert!(d.is_live(&[4; 16], 1999));
        assert!(!d.is_live(&[4; 16], 2000));
    }

    #[test]
    fn a_newer_lease_fences_the_older_without_the_pool() {
        let pool = TokenSigner::from_seed([1; 32]);
        let g = LeaseGuard::new(pool.public_key(), "p");
        let old = leased(&pool, "p", "d0", 1, 1, Some(5), None);
        g.admit(&old, 0).unwrap();
        assert!(g.is_live(&[1; 16], 0));
        // Host B got the device after host A's lease expired at the pool; B's token
        // fences A here even though this lender never heard from the pool.
        g.admit(&leased(&pool, "p", "d0", 1, 2, Some(7), None), 0)
            .unwrap();
        assert!(!g.is_live(&[1; 16], 0));
        assert!(g.is_live(&[2; 16], 0));
        let (status, why) = g.admit(&old, 0).unwrap_err();
        assert_eq!(status, HelloStatus::Denied);
        assert!(why.contains("epoch 5"), "{why}");
        // Other devices are not touched.
        g.admit(&leased(&pool, "p", "d1", 1, 3, Some(6), None), 0)
            .unwrap();
        assert!(g.is_live(&[3; 16], 0));
        // A handover's successor (epoch 8) waits for its predecessor (7) and does not
        // fence it.
        g.admit(&leased(&pool, "p", "d0", 1, 4, Some(8), Some(2)), 0)
            .unwrap();
        assert!(g.is_live(&[2; 16], 0));
        assert!(g.is_live(&[4; 16], 0));
    }

    #[test]
    fn pool_answers_fence_ended_leases_and_outages_change_nothing() {
        let pool = TokenSigner::from_seed([1; 32]);
        let g = LeaseGuard::new(pool.public_key(), "p");
        g.admit(&leased(&pool, "p", "d0", 1, 1, Some(5), None), 0)
            .unwrap();
        let fence = |f| {
            [PoolFence {
                device: "d0".into(),
                fence: f,
            }]
        };
        // Live at the pool: its fence is its epoch.
        g.update_from_pool(&fence(5));
        assert!(g.is_live(&[1; 16], u64::MAX));
        // An older answer never lowers a fence.
        g.update_from_pool(&fence(2));
        assert_eq!(g.fence("d0"), 5);
        // Released (or expired while the pool was there and nobody served it).
        g.update_from_pool(&fence(6));
        assert!(!g.is_live(&[1; 16], 0));
        assert!(g
            .admit(&leased(&pool, "p", "d0", 1, 1, Some(5), None), 0)
            .unwrap_err()
            .1
            .contains("ended"));
    }

    #[test]
    fn fences_survive_a_restart_under_the_same_pool_key_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lease-fences.json");
        let pool = TokenSigner::from_seed([1; 32]);
        let g = LeaseGuard::new(pool.public_key(), "p").with_state_file(path.clone());
        g.admit(&leased(&pool, "p", "d0", 1, 2, Some(7), None), 0)
            .unwrap();
        drop(g);
        // Restarted while the pool is away: the old holder stays fenced.
        let g = LeaseGuard::new(pool.public_key(), "p").with_state_file(path.clone());
        assert_eq!(g.fence("d0"), 7);
        assert!(g
            .admit(&leased(&pool, "p", "d0", 1, 1, Some(5), None), 0)
            .is_err());
        assert!(g
            .admit(&leased(&pool, "p", "d0", 1, 2, Some(7), None), 0)
            .is_ok());
        // Another pool's fences are not taken.
        let other = TokenSigner::from_seed([2; 32]);
        let g = LeaseGuard::new(other.public_key(), "p").with_state_file(path.clone());
        assert_eq!(g.fence("d0"), 0);
        // Saved once the new pool answered: the file pins its key from then on.
        g.save();
        let saved: SavedFences = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(saved.pool_key, other.public_key().to_text());
        assert!(saved.fences.is_empty());
    }
}
