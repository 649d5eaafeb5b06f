//! The lender's side of the device pool: fetch the pool's signing key at start,
//! register this lender (a resource provider) and its devices, heartbeat, and feed the
//! [`LeaseGuard`] the pool's list of live leases.
//!
//! A heartbeat answered `404 unknown_provider` (the pool lost or dropped the
//! registration) registers again. Each heartbeat reports the leases whose holders have a
//! session open here (the pool renews them: a holder cut from the pool keeps its device)
//! and takes the devices' fences from the answer. An unreachable pool is retried every
//! interval and logged at most every 30 s; meanwhile the lender keeps serving every
//! lease it serves, with no end ([`crate::leases`]). A lender that starts while the pool
//! is away serves at once with the pool key it pinned before (its fences file, or
//! `public_key`), and registers when the pool returns.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devlend_daemon::pool_health::{Change, PoolHealth};

use devlend_fabric::error::chain;
use devlend_fabric::lease_token::{PublicKey, TokenSigner};
use devlend_pool::api::{DeviceSpec as PoolDevice, ProviderHeartbeatBody, RegisterProvider};
use devlend_pool::client::{ClientError, PoolClient};

use crate::config::PoolConfig;
use crate::leases::{LeaseGuard, PoolFence};
use crate::{Error, InventoryView};

/// The file beside the lender's key that keeps the pool key pinned at first contact and
/// the devices' lease fences ([`LeaseGuard::with_state_file`]).
pub const STATE_FILE: &str = "lease-fences.json";

/// How long the lender waits for the pool's key at start before giving up.
pub const STARTUP_WAIT: Duration = Duration::from_secs(30);

/// Heartbeats a provider may miss before the pool marks it unavailable.
const MISSED_HEARTBEATS: u64 = 3;

/// How often a failing pool is logged.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// A pool, reached and its key known: the lender's next step is [`PoolLink::start`].
#[derive(Debug)]
pub struct PoolSession {
    client: PoolClient,
    config: PoolConfig,
    provider: String,
    advertise: String,
    guard: Arc<LeaseGuard>,
    /// The pool was not reached at start: the join token (if any) waits.
    reached: bool,
    health: PoolHealth,
}

/// How long the pool's key is asked for at start when a key is pinned already: the
/// lender does not wait on a pool that hangs before it serves.
const PINNED_PROBE: Duration = Duration::from_secs(2);

/// The pool key saved in the state file at `path`, if any. A file that is there but
/// unusable is logged: a start while the pool is away then has no key to serve with.
fn saved_pool_key(path: &Path) -> Option<PublicKey> {
    #[derive(serde::Deserialize)]
    struct Saved {
        pool_key: String,
    }
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "cannot read the lease fences file: no pool key pinned; waiting for the pool");
            return None;
        }
    };
    let key = serde_json::from_slice::<Saved>(&bytes)
        .map_err(|e| e.to_string())
        .and_then(|s| PublicKey::from_text(&s.pool_key).map_err(|e| e.to_string()));
    match key {
        Ok(k) => Some(k),
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "the lease fences file is damaged: no pool key pinned (nor fences); waiting for the pool");
            None
        }
    }
}

impl PoolSession {
    /// Fetches the pool's public key, retrying for up to `wait` while the pool is
    /// unreachable, and checks it against the pinned key if one is configured; then
    /// signs with `own_key` (the lender's key) and redeems the join token, if any.
    /// With `state_file`, the guard keeps its fences there, and a pool unreachable at
    /// start is not waited for when a key was pinned before (configured, or saved there
    /// at an earlier start): the lender serves at once. `health` is kept up to date
    /// from then on (the metrics read it).
    ///
    /// # Errors
    /// [`Error::Pool`] for a bad URL, a pool that stays unreachable with no key pinned,
    /// a malformed key, or a key that differs from the configured one;
    /// [`Error::BadPool`] when the provider or advertise address is missing.
    pub fn connect(
        config: &PoolConfig,
        wait: Duration,
        own_key: Arc<TokenSigner>,
        state_file: Option<PathBuf>,
        health: PoolHealth,
    ) -> Result<PoolSession, Error> {
        let err = |reason: String| Error::Pool {
            url: config.url.clone(),
            reason,
        };
        let provider = config
            .provider
            .clone()
            .ok_or_else(|| Error::BadPool("no provider name".into()))?;
        let advertise = config
            .advertise
            .clone()
            .ok_or_else(|| Error::BadPool("no advertise address".into()))?;
        let client = PoolClient::with_ca(&config.url, config.ca_file.as_deref())
            .map_err(|e| err(chain(&e)))?;
        let configured = config
            .public_key
            .as_deref()
            .map(PublicKey::from_text)
            .transpose()
            .map_err(|e| Error::BadPool(format!("public_key: {e}")))?;
        let pinned = configured.or_else(|| state_file.as_deref().and_then(saved_pool_key));
        // With a key pinned, a pool that hangs is not waited for: a short probe.
        let probe = match pinned {
            Some(_) => PoolClient::connect(&config.url, PINNED_PROBE, config.ca_file.as_deref())
                .map_err(|e| err(chain(&e)))?,
            None => client.clone(),
        };
        let deadline = Instant::now() + wait;
        let mut logged = false;
        let fetched = loop {
            match probe.signing_key() {
                Ok(k) => break Some(k),
                Err(ClientError::Transport { .. }) if pinned.is_some() => break None,
                Err(ClientError::Transport { .. }) if Instant::now() < deadline => {
                    if !logged {
                        tracing::info!(url = %config.url, "waiting for the device pool");
                        logged = true;
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => return Err(err(format!("cannot fetch its signing key: {}", chain(&e)))),
            }
        };
        let public = match (&fetched, pinned) {
            (Some(key), _) => {
                if key.algorithm != "ed25519" {
                    return Err(err(format!(
                        "unsupported signing algorithm {:?}",
                        key.algorithm
                    )));
                }
                let public =
                    PublicKey::from_text(&key.public_key).map_err(|e| err(e.to_string()))?;
                if let Some(pinned) = configured.filter(|p| *p != public) {
                    return Err(err(format!(
                        "its signing key {} is not the pinned key {}",
                        public.to_text(),
                        pinned.to_text()
                    )));
                }
                public
            }
            (None, Some(pinned)) => {
                tracing::warn!(url = %config.url, key = %pinned.to_text(), "device pool unreachable at start: serving the leases whose tokens verify with the pool key pinned before; registering when the pool answers");
                pinned
            }
            (None, None) => return Err(err("it cannot be reached and no key was pinned".into())),
        };
        let identity = own_key.public_key().to_text();
        let client = client.with_identity(own_key);
        let reached = fetched.is_some();
        if let (Some(token), true) = (&config.join_token, reached) {
            let p = client
                .join(token)
                .map_err(|e| err(format!("cannot redeem the join token: {}", chain(&e))))?;
            if p.role != devlend_pool::api::Role::Lender || p.name != provider {
                return Err(err(format!(
                    "the join token enrolled this key as {} {:?}, not as lender {provider:?}",
                    p.role, p.name
                )));
            }
        }
        let mut guard = LeaseGuard::new(public, &provider);
        if let Some(path) = state_file {
            guard = guard.with_state_file(path);
            if reached {
                // Pins the key the pool presents now for a start while it is away.
                guard.save();
            }
        }
        if !reached {
            health.failed();
        }
        if reached {
            tracing::info!(url = %config.url, provider = %provider, key = %public.to_text(), identity = %identity, "device pool reached; serving leased devices only");
        }
        Ok(PoolSession {
            client,
            config: config.clone(),
            guard: Arc::new(guard),
            provider,
            advertise,
            reached,
            health,
        })
    }

    /// The lease checks to give the lender ([`crate::Lender::require_leases`]).
    pub fn guard(&self) -> Arc<LeaseGuard> {
        Arc::clone(&self.guard)
    }
}

#[derive(Default)]
struct Control {
    stop: bool,
    reregister: bool,
}

/// The registration and heartbeat thread.
pub struct PoolLink {
    control: Arc<(Mutex<Control>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl PoolLink {
    /// Registers the lender's devices and takes the pool's list of live leases once,
    /// before the lender serves (so that a restarted lender knows the renewed expiries
    /// of the leases its borrowers come back with), then heartbeats every interval on a
    /// new thread.
    ///
    /// # Errors
    /// [`Error::Pool`] when the pool refuses the registration (a bad provider name or
    /// address: it names the reason); [`Error::Thread`] when the thread cannot start. An
    /// unreachable pool is not an error here: the thread keeps trying.
    pub fn start(session: PoolSession, inventory: InventoryView) -> Result<PoolLink, Error> {
        let mut registered = false;
        let first = if session.reached {
            exchange(&session, &inventory, &mut registered)
        } else {
            Ok(())
        };
        match first {
            Ok(()) => {}
            Err(ClientError::Api {
                status, message, ..
            }) if (400..500).contains(&status) && status != 404 => {
                return Err(Error::Pool {
                    url: session.config.url.clone(),
                    reason: format!("it refuses this lender's registration: {message}"),
                });
            }
            Err(e) => {
                session.health.failed();
                tracing::warn!(provider = %session.provider, error = %chain(&e), "device pool not reachable yet; retrying every heartbeat");
            }
        }
        let control = Arc::new((Mutex::new(Control::default()), Condvar::new()));
        let c = Arc::clone(&control);
        let thread = std::thread::Builder::new()
            .name("dl-pool".into())
            .spawn(move || run(&session, &inventory, registered, &c))
            .map_err(Error::Thread)?;
        Ok(PoolLink {
            control,
            thread: Some(thread),
        })
    }

    /// Registers again now (after the device list changed).
    pub fn reregister(&self) {
        let (m, cv) = &*self.control;
        m.lock().unwrap_or_else(PoisonError::into_inner).reregister = true;
        cv.notify_all();
    }

    /// Stops heartbeating (the pool marks the lender unavailable after its TTL).
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        let (m, cv) = &*self.control;
        m.lock().unwrap_or_else(PoisonError::into_inner).stop = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for PoolLink {
    fn drop(&mut self) {
        self.halt();
    }
}

fn registration(s: &PoolSession, inventory: &InventoryView) -> RegisterProvider {
    RegisterProvider {
        fabric_address: s.advertise.clone(),
        fabric_paths: s.config.advertise_paths.clone(),
        transports: vec!["tcp".into()],
        heartbeat_ttl_ms: s.config.heartbeat_interval_ms * MISSED_HEARTBEATS,
        devices: inventory
            .devices()
            .into_iter()
            .map(|d| PoolDevice {
                name: d.name,
                resource_class: d.resource_class,
                capacity_bytes: d.capacity_bytes,
                traits: d.traits,
            })
            .collect(),
    }
}

/// One exchange with the pool: registers if not registered, then heartbeats and hands
/// the live leases to the guard. A heartbeat answered `unknown_provider` clears
/// `registered`, so the next exchange registers again.
fn exchange(
    s: &PoolSession,
    inventory: &InventoryView,
    registered: &mut bool,
) -> Result<(), ClientError> {
    if !*registered {
        let p = s
            .client
            .register_provider(&s.provider, &registration(s, inventory))?;
        tracing::info!(provider = %s.provider, devices = p.devices.len(), generation = p.generation, "registered with the device pool");
        *registered = true;
    }
    let body = ProviderHeartbeatBody {
        serving: inventory
            .served_leases()
            .into_iter()
            .map(uuid::Uuid::from_bytes)
            .collect(),
    };
    match s.client.provider_heartbeat(&s.provider, &body) {
        Ok(hb) => {
            let fences: Vec<PoolFence> = hb
                .fences
                .into_iter()
                .map(|f| PoolFence {
                    device: f.device,
                    fence: f.fence,
                })
                .collect();
            s.guard.update_from_pool(&fences);
            Ok(())
        }
        Err(e) => {
            if e.code() == Some("unknown_provider") {
                tracing::info!(provider = %s.provider, "the pool does not know this lender; registering again");
                *registered = false;
            }
            Err(e)
        }
    }
}

fn run(
    s: &PoolSession,
    inventory: &InventoryView,
    mut registered: bool,
    control: &(Mutex<Control>, Condvar),
) {
    let interval = Duration::from_millis(s.config.heartbeat_interval_ms);
    let mut last_log: Option<Instant> = None;
    loop {
        let (m, cv) = control;
        {
            let mut c = m.lock().unwrap_or_else(PoisonError::into_inner);
            let deadline = Instant::now() + interval;
            while !c.stop && !c.reregister {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                c = cv
                    .wait_timeout(c, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            if c.stop {
                return;
            }
            if c.reregister {
                c.reregister = false;
                registered = false;
            }
        }
        let asked = std::time::SystemTime::now();
        match exchange(s, inventory, &mut registered) {
            Ok(()) => {
                if let Change::Back(after) = s.health.reached() {
                    tracing::info!(provider = %s.provider, unreachable_s = after.as_secs(), "device pool reachable again");
                }
            }
            Err(e) if e.code() == Some("unknown_provider") => {
                // Registers again at once.
                let _ = exchange(s, inventory, &mut registered);
            }
            Err(e) => {
                if e.status().is_none() {
                    // Unreachable since the request went out, not since it timed out.
                    s.health.failed_at(asked);
                }
                if last_log.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
                    tracing::warn!(provider = %s.provider, error = %chain(&e), "device pool request failed; the devices lent go on; retrying every heartbeat");
                    last_log = Some(Instant::now());
                }
            }
        }
    }
}
