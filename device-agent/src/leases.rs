//! Lease enforcement: which sessions a lender attached to a pool may serve.
//!
//! A borrower opens a session with the pool's lease token in its hello
//! ([`devlend_fabric::lease_token`]). [`LeaseGuard::admit`] checks the signature against
//! the pool's public key, that the token names this lender (provider) and the device
//! asked for, that the hello's borrower identity is the lease id, and that the lease has
//! not ended. The guard then tracks the lease: the pool's heartbeat answers
//! ([`LeaseGuard::update_from_pool`]) carry renewed expiries, and a lease the pool no
//! longer lists has been released or has expired. [`LeaseGuard::is_live`] is what the
//! lender's sweeper asks, every [`SWEEP_INTERVAL`], of each open session's lease; the
//! sessions of an ended lease stop reading requests, answer those in flight, and close.
//!
//! Without word from the pool (unreachable), a lease lives until the last expiry known:
//! the token's, or the last heartbeat answer's. The lender fails closed.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use devlend_fabric::lease_token::{LeaseToken, PublicKey};
use devlend_fabric::{Hello, HelloStatus};

/// The outcome of a failed check.
enum Check {
    /// Past the token's expiry, no word from the pool yet.
    Unconfirmed(String),
    /// For good.
    Refused(String),
}

/// How often the lender checks the leases of its open sessions.
pub const SWEEP_INTERVAL: Duration = Duration::from_millis(250);

/// How long an ended lease is remembered, so that its token stays refused.
const FORGET_AFTER_MS: u64 = 24 * 3600 * 1000;

/// A lease's expiry as the pool reports it in a heartbeat answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolLease {
    /// The lease id (a UUID's 16 bytes).
    pub id: [u8; 16],
    /// Device name on this lender.
    pub device: String,
    /// Expiry in milliseconds since the Unix epoch.
    pub expires_at_ms: u64,
}

#[derive(Debug, Clone)]
struct Tracked {
    device: String,
    expires_at_ms: u64,
    /// When the lender first learned of it (admitted a token, or saw it listed), ms
    /// since the epoch. The lease existed at the pool by then, so any heartbeat asked
    /// later that does not list it proves it ended.
    known_since_ms: u64,
    /// A heartbeat answer has listed it (its expiry is the pool's, not the token's).
    listed: bool,
    /// Released, or gone from the pool's answers: refused for good.
    ended: bool,
    /// Which of the guard's keys signed its first token (none: learned from the pool):
    /// its later tokens must be signed by the same key. In direct mode each compute agent
    /// signs with its own key, so one agent cannot take on another's lease id. (A
    /// handover token may be signed by any trusted key: a destination hands over in turn
    /// with its own key a lease whose token the source signed.)
    key: Option<usize>,
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

/// The lease checks of one lender.
#[derive(Debug)]
pub struct LeaseGuard {
    keys: Vec<PublicKey>,
    provider: String,
    leases: Mutex<HashMap<[u8; 16], Tracked>>,
}

pub use devlend_fabric::lease_token::now_ms;

impl LeaseGuard {
    /// A guard that accepts tokens signed by `key` for the provider named `provider`.
    pub fn new(key: PublicKey, provider: &str) -> Self {
        LeaseGuard {
            keys: vec![key],
            provider: provider.to_owned(),
            leases: Mutex::new(HashMap::new()),
        }
    }

    /// A guard for direct mode with authentication: it accepts tokens that a borrower
    /// signed itself with one of `keys` (its compute agent's `auth_key_file`), with an
    /// empty provider. No pool tells it of renewals or releases: a token is good until
    /// its own expiry.
    pub fn direct(keys: Vec<PublicKey>) -> Self {
        LeaseGuard {
            keys,
            provider: String::new(),
            leases: Mutex::new(HashMap::new()),
        }
    }

    /// The provider name tokens must carry.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 16], Tracked>> {
        self.leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Checks the token of `hello` at `now_ms`. Returns the lease, or the refusal:
    /// `Busy` (retry) for a token past its own expiry whose lease the pool has not
    /// listed yet (a renewal may be on its way: a lender that just restarted), `Denied`
    /// for everything else.
    pub fn admit(&self, hello: &Hello, now_ms: u64) -> Result<Admitted, (HelloStatus, String)> {
        self.check(hello, now_ms).map_err(|r| match r {
            Check::Unconfirmed(m) => (HelloStatus::Busy, m),
            Check::Refused(m) => (HelloStatus::Denied, m),
        })
    }

    fn check(&self, hello: &Hello, now_ms: u64) -> Result<Admitted, Check> {
        if hello.token.is_empty() {
            return Err(Check::Refused(
                "the hello carries no lease token: this lender serves only borrowers with a pool lease or a key it trusts".into(),
            ));
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
        let claims = verified.map_err(|e| Check::Refused(format!("lease token refused: {e}")))?;
        if claims.provider != self.provider {
            return Err(Check::Refused(format!(
                "lease token is for provider {:?}, this lender is {:?}",
                claims.provider, self.provider
            )));
        }
        if claims.device != hello.device {
            return Err(Check::Refused(format!(
                "lease token is for device {:?}, not {:?}",
                claims.device, hello.device
            )));
        }
        if claims.lease_id != hello.borrower {
            return Err(Check::Refused(
                "the hello's borrower identity is not the token's lease id".into(),
            ));
        }
        let mut leases = self.leases();
        let other_key = |t: &Tracked| t.key.is_some_and(|k| k != signer);
        if leases.get(&claims.lease_id).is_some_and(other_key) {
            return Err(Check::Refused(
                "the token's lease id belongs to another borrower key".into(),
            ));
        }
        let t = leases.entry(claims.lease_id).or_insert_with(|| Tracked {
            device: claims.device.clone(),
            expires_at_ms: claims.expires_at_ms,
            known_since_ms: now_ms,
            listed: false,
            ended: false,
            key: Some(signer),
        });
        t.key.get_or_insert(signer);
        if t.ended {
            return Err(Check::Refused(
                "the lease has ended (released or expired)".into(),
            ));
        }
        if t.expires_at_ms <= now_ms {
            let m = format!("the lease expired {} ms ago", now_ms - t.expires_at_ms);
            return Err(if t.listed || self.provider.is_empty() {
                Check::Refused(m)
            } else {
                Check::Unconfirmed(format!(
                    "{m} by its token; the pool has not confirmed a renewal yet, retry"
                ))
            });
        }
        Ok(Admitted {
            lease: claims.lease_id,
            qos: claims.qos,
            successor_of: claims.successor_of,
        })
    }

    /// Whether the lease may still be served at `now_ms`.
    pub fn is_live(&self, lease: &[u8; 16], now_ms: u64) -> bool {
        self.leases()
            .get(lease)
            .is_some_and(|t| !t.ended && t.expires_at_ms > now_ms)
    }

    /// Applies the pool's list of this lender's live leases (a heartbeat answer to a
    /// request sent at `asked_at_ms`): their expiries are renewed, and a lease the lender
    /// knew of before `asked_at_ms` that is not listed has ended (released or expired).
    pub fn update_from_pool(&self, live: &[PoolLease], asked_at_ms: u64) {
        let mut leases = self.leases();
        for l in live {
            let t = leases.entry(l.id).or_insert_with(|| Tracked {
                device: l.device.clone(),
                expires_at_ms: l.expires_at_ms,
                known_since_ms: asked_at_ms,
                listed: true,
                ended: false,
                key: None,
            });
            if !t.ended {
                t.expires_at_ms = l.expires_at_ms;
                t.listed = true;
            }
        }
        for (id, t) in leases.iter_mut() {
            if t.known_since_ms <= asked_at_ms && !t.ended && !live.iter().any(|l| l.id == *id) {
                tracing::info!(lease = %hex(id), device = %t.device, "lease ended at the pool");
                t.ended = true;
            }
        }
        leases.retain(|_, t| t.expires_at_ms.saturating_add(FORGET_AFTER_MS) > asked_at_ms);
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
    use devlend_fabric::lease_token::{LeaseClaims, TokenSigner};

    fn hello(signer: &TokenSigner, provider: &str, device: &str, expires: u64) -> Hello {
        let claims = LeaseClaims {
            lease_id: [9; 16],
            expires_at_ms: expires,
            provider: provider.into(),
            device: device.into(),
            consumer: "vm".into(),
            provider_key: None,
            qos: None,
            successor_of: None,
        };
        let mut h = Hello::new(device, 0);
        h.borrower = [9; 16];
        h.token = signer.sign(&claims).unwrap().as_bytes().to_vec();
        h
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
        };
        let mut h = Hello::new("disk0", 0);
        h.borrower = [lease; 16];
        h.token = signer.sign(&claims).unwrap().as_bytes().to_vec();
        h
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
    fn admits_only_a_matching_unexpired_lease() {
        let signer = TokenSigner::from_seed([1; 32]);
        let g = LeaseGuard::new(signer.public_key(), "lender-a");
        assert!(g
            .admit(&hello(&signer, "lender-a", "d0", 2000), 1000)
            .is_ok());
        assert!(g.is_live(&[9; 16], 1999));
        assert!(!g.is_live(&[9; 16], 2000));
        let g = LeaseGuard::new(signer.public_key(), "lender-a");
        assert!(g
            .admit(&hello(&signer, "lender-b", "d0", 2000), 1000)
            .is_err());
        assert!(g
            .admit(&hello(&signer, "lender-a", "d0", 900), 1000)
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
    }

    #[test]
    fn pool_answers_renew_and_end_leases() {
        let signer = TokenSigner::from_seed([1; 32]);
        let g = LeaseGuard::new(signer.public_key(), "p");
        let h = hello(&signer, "p", "d0", 2000);
        g.admit(&h, 1000).unwrap();
        // An answer to a heartbeat asked before the lender learned of the lease says
        // nothing about it: the token's expiry holds.
        g.update_from_pool(&[], 900);
        assert!(g.is_live(&[9; 16], 1500));
        let renewed = PoolLease {
            id: [9; 16],
            device: "d0".into(),
            expires_at_ms: 5000,
        };
        g.update_from_pool(std::slice::from_ref(&renewed), 1200);
        assert!(g.is_live(&[9; 16], 4000));
        // Known before the heartbeat was asked, not listed: released.
        g.update_from_pool(&[], 1300);
        assert!(!g.is_live(&[9; 16], 1300));
        assert!(g.admit(&h, 1300).unwrap_err().1.contains("ended"));
    }
}
