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

use devlend_fabric::lease_token::{LeaseToken, TokenSigner};
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
        let token = LeaseToken::from_text(&r.token)
            .map_err(|e| LeaseError::Bad(e.to_string()))?
            .as_bytes()
            .to_vec();
        let lease = client.lease(r.id).map_err(LeaseError::Pool)?;
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
            self.lease
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
