//! Keeping a pool lease while its attachment lives: bind it when the attachment is up,
//! renew it (lease heartbeat) every third of its time to live, release it at detach.
//!
//! A renewal that fails because the pool is unreachable is retried at the next tick;
//! the lease then lapses at its expiry unless a later renewal gets through, and the
//! lender ends the attachment's sessions. A renewal answered `lease_ended` stops the
//! renewals and is logged as an error: the attachment has lost its device.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use devlend_fabric::lease_token::{LeaseToken, PublicKey, TokenSigner};
use devlend_pool::api::{Lease, LeaseState};
use devlend_pool::client::{ClientError, PoolClient};
use uuid::Uuid;

use crate::api::LeaseRef;

/// Shortest renewal period.
const MIN_RENEW: Duration = Duration::from_millis(200);

/// Why a lease cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The lease reference is malformed.
    #[error("bad lease: {0}")]
    Bad(String),
    /// The lease is no longer live.
    #[error("lease {id} is {state}; ask the pool for a new one")]
    Ended {
        /// Lease id.
        id: Uuid,
        /// Its state.
        state: &'static str,
    },
    /// The pool refused or could not be reached.
    #[error("device pool")]
    Pool(#[source] ClientError),
}

/// How this compute host reaches pools: the key its requests are signed with, and the
/// CA an `https://` pool's certificate must chain to (`pool_ca_file`; without one, the
/// system's trust store).
#[derive(Debug, Clone, Default)]
pub struct PoolAccess {
    /// Signs pool requests (lease bind, renew, release).
    pub identity: Option<Arc<TokenSigner>>,
    /// CA certificates (PEM) for `https://` pools.
    pub ca_file: Option<PathBuf>,
    /// The pool's signing key (`pool_public_key`): lease tokens must verify with it and
    /// match their lease; `None`: tokens are taken as given.
    pub pool_key: Option<PublicKey>,
}

/// Checks `token` against the pool's key and the lease it came with: the signature,
/// and the lease id, device and provider it names.
///
/// # Errors
/// [`LeaseError::Bad`] naming what does not hold.
pub fn verify_token(token: &LeaseToken, key: &PublicKey, lease: &Lease) -> Result<(), LeaseError> {
    let claims = key.verify(token).map_err(|e| {
        LeaseError::Bad(format!(
            "the lease token does not verify with the pool's key {} (pool_public_key): {e}",
            key.to_text()
        ))
    })?;
    let mismatch = |what: &str, got: &str, want: &str| {
        LeaseError::Bad(format!(
            "the lease token names {what} {got:?}, its lease {want:?}"
        ))
    };
    if claims.lease_id != *lease.id.as_bytes() {
        return Err(mismatch(
            "lease",
            &Uuid::from_bytes(claims.lease_id).to_string(),
            &lease.id.to_string(),
        ));
    }
    if claims.device != lease.device {
        return Err(mismatch("device", &claims.device, &lease.device));
    }
    if claims.provider != lease.provider {
        return Err(mismatch("lender", &claims.provider, &lease.provider));
    }
    Ok(())
}

/// A client of the pool at `url`, signing with the identity when there is one and
/// trusting the CA file for HTTPS.
///
/// # Errors
/// [`ClientError::BadUrl`], [`ClientError::CaWithoutHttps`], [`ClientError::Https`].
pub fn pool_client(url: &str, access: &PoolAccess) -> Result<PoolClient, ClientError> {
    let c = PoolClient::with_ca(url, access.ca_file.as_deref())?;
    Ok(match &access.identity {
        Some(k) => c.with_identity(Arc::clone(k)),
        None => c,
    })
}

/// A lease checked with the pool, ready for its attachment to start.
#[derive(Debug)]
pub struct CheckedLease {
    client: PoolClient,
    lease: Lease,
    /// The token in binary form, for the hello.
    pub token: Vec<u8>,
}

impl CheckedLease {
    /// Reads the lease from its pool and checks that it is live.
    ///
    /// # Errors
    /// [`LeaseError::Bad`] for a bad URL, id or token; [`LeaseError::Ended`];
    /// [`LeaseError::Pool`].
    pub fn check(r: &LeaseRef, access: &PoolAccess) -> Result<CheckedLease, LeaseError> {
        let client = pool_client(&r.pool, access).map_err(|e| match e {
            ClientError::BadUrl { .. } | ClientError::CaWithoutHttps { .. } => {
                LeaseError::Bad(e.to_string())
            }
            e => LeaseError::Pool(e),
        })?;
        let token = LeaseToken::from_text(&r.token).map_err(|e| LeaseError::Bad(e.to_string()))?;
        let lease = client.lease(r.id).map_err(LeaseError::Pool)?;
        if let Some(key) = &access.pool_key {
            verify_token(&token, key, &lease)?;
        }
        let token = token.as_bytes().to_vec();
        if !lease.state.is_live() {
            return Err(LeaseError::Ended {
                id: r.id,
                state: lease.state.as_str(),
            });
        }
        Ok(CheckedLease {
            client,
            lease,
            token,
        })
    }

    /// The lease id: the borrower identity in every hello.
    pub fn borrower(&self) -> [u8; 16] {
        *self.lease.id.as_bytes()
    }

    /// The device name on the lender.
    pub fn device(&self) -> &str {
        &self.lease.device
    }

    /// The lender's fabric address.
    pub fn lender(&self) -> &str {
        &self.lease.fabric_address
    }

    /// Binds the lease (claimed → bound) and renews it on a new thread until
    /// [`LeaseKeeper::release`].
    ///
    /// # Errors
    /// [`LeaseError::Pool`] when the bind is refused (e.g. a stale generation).
    pub fn bind_and_keep(self, attachment: &str) -> Result<LeaseKeeper, LeaseError> {
        let lease = if self.lease.state == LeaseState::Claimed {
            self.client
                .bind_lease(self.lease.id, self.lease.generation)
                .map_err(LeaseError::Pool)?
        } else {
            // Already bound (an attachment served again after a restart): its last
            // renewal may be most of a TTL ago, so renew now rather than a third of a TTL
            // from now.
            match self.client.lease_heartbeat(self.lease.id) {
                Ok(l) => l,
                Err(e) if e.code() == Some("lease_ended") => {
                    return Err(LeaseError::Ended {
                        id: self.lease.id,
                        state: "ended",
                    })
                }
                Err(e) => {
                    tracing::warn!(attachment, lease = %self.lease.id, error = %e, "cannot renew the lease now; the renewal thread retries");
                    self.lease
                }
            }
        };
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let ended = Arc::new(AtomicBool::new(false));
        let period = Duration::from_millis(lease.ttl_ms / 3).max(MIN_RENEW);
        let thread = {
            let (client, stop, ended, id, name) = (
                self.client.clone(),
                Arc::clone(&stop),
                Arc::clone(&ended),
                lease.id,
                attachment.to_owned(),
            );
            std::thread::Builder::new()
                .name(format!("lease-{attachment}"))
                .spawn(move || renew(&client, id, period, &stop, &ended, &name))
                .map_err(|e| LeaseError::Bad(format!("cannot start the renewal thread: {e}")))?
        };
        tracing::info!(attachment, lease = %lease.id, expires_at_ms = lease.expires_at_ms, "lease bound");
        Ok(LeaseKeeper {
            client: self.client,
            id: lease.id,
            ended,
            stop,
            thread: Some(thread),
        })
    }
}

fn renew(
    client: &PoolClient,
    id: Uuid,
    period: Duration,
    stop: &(Mutex<bool>, Condvar),
    ended: &AtomicBool,
    name: &str,
) {
    let (m, cv) = stop;
    let mut failing = false;
    loop {
        {
            let mut stopped = m.lock().unwrap_or_else(PoisonError::into_inner);
            let deadline = std::time::Instant::now() + period;
            while !*stopped {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    break;
                }
                stopped = cv
                    .wait_timeout(stopped, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            if *stopped {
                return;
            }
        }
        match client.lease_heartbeat(id) {
            Ok(_) => {
                if failing {
                    tracing::info!(attachment = name, lease = %id, "lease renewed again");
                    failing = false;
                }
            }
            Err(e) if e.code() == Some("lease_ended") => {
                ended.store(true, Ordering::Release);
                tracing::error!(attachment = name, lease = %id, "the lease has ended: the lender will refuse this attachment's sessions");
                return;
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(attachment = name, lease = %id, error = %e, "cannot renew the lease; retrying");
                    failing = true;
                }
            }
        }
    }
}

/// A lease renewed on a thread while its attachment lives.
#[derive(Debug)]
pub struct LeaseKeeper {
    client: PoolClient,
    id: Uuid,
    ended: Arc<AtomicBool>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl LeaseKeeper {
    /// The lease id.
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// The client of the lease's pool (signed as this compute host).
    pub fn client(&self) -> &PoolClient {
        &self.client
    }

    /// Whether a renewal was answered that the lease has ended (released or expired at
    /// the pool): the lender refuses the attachment from then on.
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    fn stop_renewing(&mut self) {
        let (m, cv) = &*self.stop;
        *m.lock().unwrap_or_else(PoisonError::into_inner) = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Stops renewing and releases the lease at the pool (the device becomes free). A
    /// lease that already ended is left as is; a pool that cannot be reached lets the
    /// lease lapse at its expiry (logged).
    pub fn release(mut self) {
        self.stop_renewing();
        match self.client.release_current(self.id) {
            Ok(_) => tracing::info!(lease = %self.id, "lease released"),
            Err(e) => {
                tracing::warn!(lease = %self.id, error = %e, "cannot release the lease; it lapses at its expiry")
            }
        }
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.stop_renewing();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devlend_fabric::lease_token::LeaseClaims;

    fn lease() -> Lease {
        Lease {
            id: Uuid::from_bytes([7; 16]),
            device_id: Uuid::from_bytes([8; 16]),
            device: "disk0".into(),
            provider: "devsrv".into(),
            fabric_address: "10.0.0.2:7700".into(),
            consumer: "vm1".into(),
            compute_host: "computehost".into(),
            state: LeaseState::Claimed,
            created_ms: 1,
            expires_at_ms: 2,
            ttl_ms: 1,
            generation: 1,
            qos: None,
            successor_of: None,
        }
    }

    fn token(pool: &TokenSigner, edit: impl FnOnce(&mut LeaseClaims)) -> LeaseToken {
        let mut c = LeaseClaims {
            lease_id: [7; 16],
            expires_at_ms: u64::MAX,
            provider: "devsrv".into(),
            device: "disk0".into(),
            consumer: "vm1".into(),
            provider_key: Some([0x42; 32]),
            qos: None,
            successor_of: None,
        };
        edit(&mut c);
        pool.sign(&c).unwrap()
    }

    #[test]
    fn a_token_must_verify_with_the_pinned_pool_key_and_match_its_lease() {
        let pool = TokenSigner::from_seed([1; 32]);
        let key = pool.public_key();
        let l = lease();
        assert!(verify_token(&token(&pool, |_| ()), &key, &l).is_ok());
        // Signed by another key (a changed answer on the way from the pool).
        let other = TokenSigner::from_seed([2; 32]);
        let e = verify_token(&token(&other, |_| ()), &key, &l).unwrap_err();
        assert!(e.to_string().contains("does not verify"), "{e}");
        // The pool's token, but for another lease, device or lender.
        let e = verify_token(&token(&pool, |c| c.lease_id = [9; 16]), &key, &l).unwrap_err();
        assert!(e.to_string().contains("names lease"), "{e}");
        let e = verify_token(&token(&pool, |c| c.device = "disk1".into()), &key, &l).unwrap_err();
        assert!(e.to_string().contains("names device"), "{e}");
        let e = verify_token(&token(&pool, |c| c.provider = "rogue".into()), &key, &l).unwrap_err();
        assert!(e.to_string().contains("names lender"), "{e}");
    }
}
