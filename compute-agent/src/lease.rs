//! Keeping a pool lease while its attachment lives: bind it when the attachment is up,
//! renew it (lease heartbeat) every third of its time to live, release it at detach.
//!
//! A renewal that fails because the pool is unreachable is retried at the next tick,
//! and the device goes on meanwhile: the lender ends a lease only when the pool says so
//! (docs/pool.md, "When a lease ends"), and it reports the attachment's open sessions
//! to the pool, which renews the lease for it. The agent's [`PoolHealth`] says since
//! when the pool has not answered (`devlend status`, the metrics). A renewal answered
//! `lease_ended` (released, or its device leased again) stops the renewals and is
//! logged as an error: the attachment has lost its device.
//!
//! An attachment restored while the pool cannot be reached starts from its saved token
//! alone ([`CheckedLease::offline`]), and is renewed once the pool answers.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use devlend_daemon::pool_health::{Change, PoolHealth};
use devlend_fabric::lease_token::{LeaseToken, PublicKey, TokenSigner};
use devlend_pool::api::{Lease, LeaseState};
use devlend_pool::client::{ClientError, PoolClient};
use uuid::Uuid;

use crate::api::LeaseRef;

/// Shortest renewal period.
const MIN_RENEW: Duration = Duration::from_millis(200);

/// Longest a pool request of a restored attachment may take ([`CheckedLease::check_within`]).
pub const RESTORE_TIMEOUT: Duration = Duration::from_secs(2);

/// Renewal period while the lease's TTL is not known yet (restored offline).
const UNKNOWN_TTL_RENEW: Duration = Duration::from_secs(1);

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
    /// Whether the pool answers this agent (shared by every lease).
    pub health: PoolHealth,
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
    pool_client_within(url, access, devlend_pool::client::DEFAULT_TIMEOUT)
}

/// As [`pool_client`], each request given at most `timeout`.
///
/// # Errors
/// As [`pool_client`].
pub fn pool_client_within(
    url: &str,
    access: &PoolAccess,
    timeout: Duration,
) -> Result<PoolClient, ClientError> {
    let c = PoolClient::connect(url, timeout, access.ca_file.as_deref())?;
    Ok(match &access.identity {
        Some(k) => c.with_identity(Arc::clone(k)),
        None => c,
    })
}

/// A lease checked with the pool (or, restored while the pool is away, from its saved
/// token), ready for its attachment to start.
#[derive(Debug)]
pub struct CheckedLease {
    client: PoolClient,
    id: Uuid,
    device: String,
    lender: String,
    /// What the pool answered; `None`: restored offline, not read from the pool.
    lease: Option<Lease>,
    /// The token in binary form, for the hello.
    pub token: Vec<u8>,
    health: PoolHealth,
}

impl CheckedLease {
    /// Reads the lease from its pool and checks that it is live.
    ///
    /// # Errors
    /// [`LeaseError::Bad`] for a bad URL, id or token; [`LeaseError::Ended`];
    /// [`LeaseError::Pool`].
    pub fn check(r: &LeaseRef, access: &PoolAccess) -> Result<CheckedLease, LeaseError> {
        Self::check_within(r, access, devlend_pool::client::DEFAULT_TIMEOUT)
    }

    /// As [`CheckedLease::check`], each pool request given at most `timeout` (the
    /// renewals too): a restore does not wait long on a pool server that hangs, so that
    /// its sessions open, and its lender reports them, well within the lease's TTL.
    ///
    /// # Errors
    /// As [`CheckedLease::check`].
    pub fn check_within(
        r: &LeaseRef,
        access: &PoolAccess,
        timeout: Duration,
    ) -> Result<CheckedLease, LeaseError> {
        let client = pool_client_within(&r.pool, access, timeout).map_err(|e| match e {
            ClientError::BadUrl { .. } | ClientError::CaWithoutHttps { .. } => {
                LeaseError::Bad(e.to_string())
            }
            e => LeaseError::Pool(e),
        })?;
        let token = LeaseToken::from_text(&r.token).map_err(|e| LeaseError::Bad(e.to_string()))?;
        let lease = client.lease(r.id).map_err(|e| {
            if e.status().is_none() {
                access.health.failed();
            }
            LeaseError::Pool(e)
        })?;
        access.health.reached();
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
            id: lease.id,
            device: lease.device.clone(),
            lender: lease.fabric_address.clone(),
            lease: Some(lease),
            token,
            health: access.health.clone(),
        })
    }

    /// A saved attachment's lease while its pool cannot be reached: taken from the
    /// token the agent saved (checked against `pool_public_key` when configured) and
    /// the lender it was attached to. The lender judges the token itself; the renewals
    /// start when the pool answers.
    ///
    /// # Errors
    /// [`LeaseError::Bad`] for a bad URL or a token that is malformed, does not verify,
    /// or names another lease.
    pub fn offline(
        r: &LeaseRef,
        lender: &str,
        access: &PoolAccess,
    ) -> Result<CheckedLease, LeaseError> {
        let client = pool_client_within(&r.pool, access, RESTORE_TIMEOUT)
            .map_err(|e| LeaseError::Bad(e.to_string()))?;
        let token = LeaseToken::from_text(&r.token).map_err(|e| LeaseError::Bad(e.to_string()))?;
        let claims = match &access.pool_key {
            Some(key) => key.verify(&token).map_err(|e| {
                LeaseError::Bad(format!(
                    "the saved lease token does not verify with the pool's key {} (pool_public_key): {e}",
                    key.to_text()
                ))
            })?,
            None => token
                .claims_unverified()
                .map_err(|e| LeaseError::Bad(e.to_string()))?,
        };
        if claims.lease_id != *r.id.as_bytes() {
            return Err(LeaseError::Bad(format!(
                "the saved lease token names lease {}, its attachment {}",
                Uuid::from_bytes(claims.lease_id),
                r.id
            )));
        }
        Ok(CheckedLease {
            client,
            id: r.id,
            device: claims.device,
            lender: lender.to_owned(),
            lease: None,
            token: token.as_bytes().to_vec(),
            health: access.health.clone(),
        })
    }

    /// The lease id: the borrower identity in every hello.
    pub fn borrower(&self) -> [u8; 16] {
        *self.id.as_bytes()
    }

    /// The device name on the lender.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// The lender's fabric address.
    pub fn lender(&self) -> &str {
        &self.lender
    }

    /// The lender's further fabric addresses, as the pool gave them with the lease;
    /// none when restored offline (the saved attachment keeps the paths it had).
    pub fn paths(&self) -> &[String] {
        self.lease.as_ref().map_or(&[], |l| &l.fabric_paths)
    }

    /// Binds the lease (claimed → bound) and renews it on a new thread until
    /// [`LeaseKeeper::release`].
    ///
    /// # Errors
    /// [`LeaseError::Pool`] when the bind is refused (e.g. a stale generation).
    pub fn bind_and_keep(self, attachment: &str) -> Result<LeaseKeeper, LeaseError> {
        let ttl_ms = match &self.lease {
            Some(l) if l.state == LeaseState::Claimed => {
                let bound = self
                    .client
                    .bind_lease(l.id, l.generation)
                    .map_err(LeaseError::Pool)?;
                Some(bound.ttl_ms)
            }
            // Already bound (an attachment served again after a restart): its last
            // renewal may be most of a TTL ago, so renew now rather than a third of a TTL
            // from now. Restored offline: the renewal thread keeps trying.
            known => match self.client.lease_heartbeat(self.id) {
                Ok(l) => {
                    self.health.reached();
                    Some(l.ttl_ms)
                }
                Err(e) if e.code() == Some("lease_ended") => {
                    return Err(LeaseError::Ended {
                        id: self.id,
                        state: "ended",
                    })
                }
                Err(e) => {
                    if e.status().is_none() {
                        self.health.failed();
                    }
                    tracing::warn!(attachment, lease = %self.id, error = %e, "cannot renew the lease now; the device goes on and the renewal thread retries");
                    known.as_ref().map(|l| l.ttl_ms)
                }
            },
        };
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let ended = Arc::new(AtomicBool::new(false));
        let period = ttl_ms.map(renewal_period);
        let thread = {
            let (client, stop, ended, id, name, health) = (
                self.client.clone(),
                Arc::clone(&stop),
                Arc::clone(&ended),
                self.id,
                attachment.to_owned(),
                self.health.clone(),
            );
            std::thread::Builder::new()
                .name(format!("lease-{attachment}"))
                .spawn(move || {
                    renew(&Renewal {
                        client: &client,
                        id,
                        period,
                        stop: &stop,
                        ended: &ended,
                        name: &name,
                        health: &health,
                    })
                })
                .map_err(|e| LeaseError::Bad(format!("cannot start the renewal thread: {e}")))?
        };
        tracing::info!(attachment, lease = %self.id, ttl_ms, "lease bound");
        Ok(LeaseKeeper {
            client: self.client,
            id: self.id,
            ended,
            stop,
            thread: Some(thread),
        })
    }
}

/// A third of the lease's time to live, at least [`MIN_RENEW`].
fn renewal_period(ttl_ms: u64) -> Duration {
    Duration::from_millis(ttl_ms / 3).max(MIN_RENEW)
}

/// What the renewal thread works with.
struct Renewal<'a> {
    client: &'a PoolClient,
    id: Uuid,
    /// `None` until the TTL is known (restored offline): [`UNKNOWN_TTL_RENEW`].
    period: Option<Duration>,
    stop: &'a (Mutex<bool>, Condvar),
    ended: &'a AtomicBool,
    name: &'a str,
    health: &'a PoolHealth,
}

fn renew(r: &Renewal<'_>) {
    let (m, cv) = r.stop;
    let mut period = r.period;
    let mut failing = false;
    loop {
        {
            let mut stopped = m.lock().unwrap_or_else(PoisonError::into_inner);
            let deadline = std::time::Instant::now() + period.unwrap_or(UNKNOWN_TTL_RENEW);
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
        let asked = std::time::SystemTime::now();
        match r.client.lease_heartbeat(r.id) {
            Ok(l) => {
                period = Some(renewal_period(l.ttl_ms));
                if let Change::Back(after) = r.health.reached() {
                    tracing::info!(attachment = r.name, lease = %r.id, unreachable_s = after.as_secs(), "device pool reachable again");
                }
                if failing {
                    tracing::info!(attachment = r.name, lease = %r.id, "lease renewed again");
                    failing = false;
                }
            }
            Err(e) if e.code() == Some("lease_ended") => {
                r.ended.store(true, Ordering::Release);
                tracing::error!(attachment = r.name, lease = %r.id, "the lease has ended (released, or the device leased again): the lender will refuse this attachment's sessions");
                return;
            }
            Err(e) => {
                if e.status().is_none() {
                    // Unreachable since the request went out, not since it timed out.
                    r.health.failed_at(asked);
                }
                // Once per failing stretch: the device goes on meanwhile.
                if !failing {
                    tracing::warn!(attachment = r.name, lease = %r.id, error = %e, "cannot renew the lease; the device goes on (its lender vouches for its sessions); retrying every renewal period");
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
            fabric_paths: vec![],
            consumer: "vm1".into(),
            compute_host: "computehost".into(),
            state: LeaseState::Claimed,
            created_ms: 1,
            expires_at_ms: 2,
            ttl_ms: 1,
            generation: 1,
            qos: None,
            successor_of: None,
            epoch: 0,
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
            epoch: None,
            holder_key: None,
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
