//! The `[pool]` table and its flags: where the pool is, and the addresses this lender
//! registers with it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use devlend_pool::rules;

use super::Cli;
use crate::Error;

/// Most further addresses (`advertise_paths`) a lender registers beside `advertise`:
/// what the pool takes.
pub const MAX_ADVERTISE_PATHS: usize = devlend_pool::api::MAX_FABRIC_PATHS;

/// The `[pool]` table: register with a device pool and enforce its leases.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The pool's base URL, e.g. `http://pool.example:7400`.
    pub url: String,
    /// This lender's provider name (default: the host name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// `HOST:PORT` registered as this lender's fabric address (default: `listen`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
    /// Further `HOST:PORT` addresses of this lender registered beside `advertise`
    /// (another network or NIC), at most [`MAX_ADVERTISE_PATHS`], none a wildcard.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub advertise_paths: Vec<String>,
    /// Milliseconds between heartbeats (500..=60000, default 2000); the pool marks the
    /// lender unavailable after three missed ones.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_interval_ms: u64,
    /// The pool's public key (unpadded base64url), pinned: the lender refuses to start
    /// if the pool presents another. Default: trust the key the pool presents at start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
    /// A one-time join token (`devlend pool enroll --role lender --name PROVIDER`) that
    /// enrolls the key at start. Harmless once used: an enrolled key is not asked again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_token: Option<String>,
    /// CA certificates (PEM) an `https://` pool's certificate must chain to. Default:
    /// the system's trust store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
}

fn default_heartbeat_ms() -> u64 {
    2000
}

/// The `[pool]` table of the file with the flags applied over it, checked; `None`:
/// direct mode.
pub(super) fn resolve(
    cli: &Cli,
    file: Option<PoolConfig>,
    listen: &str,
) -> Result<Option<PoolConfig>, Error> {
    let mut pool = file;
    if let Some(url) = &cli.pool {
        pool = Some(PoolConfig {
            url: url.clone(),
            ..pool.unwrap_or(PoolConfig {
                url: String::new(),
                provider: None,
                advertise: None,
                advertise_paths: Vec::new(),
                heartbeat_interval_ms: default_heartbeat_ms(),
                public_key: None,
                join_token: None,
                ca_file: None,
            })
        });
    }
    if let Some(p) = pool.as_mut() {
        if cli.pool_join_token.is_some() {
            p.join_token = cli.pool_join_token.clone();
        }
        if cli.pool_ca.is_some() {
            p.ca_file = cli.pool_ca.clone();
        }
        if cli.provider.is_some() {
            p.provider = cli.provider.clone();
        }
        if cli.advertise.is_some() {
            p.advertise = cli.advertise.clone();
        }
        if !cli.advertise_paths.is_empty() {
            p.advertise_paths = cli.advertise_paths.clone();
        }
        if !(500..=60_000).contains(&p.heartbeat_interval_ms) {
            return Err(Error::BadPool(format!(
                "heartbeat_interval_ms {} is outside 500..=60000",
                p.heartbeat_interval_ms
            )));
        }
        if p.provider.is_none() {
            p.provider = Some(devlend_daemon::host_name());
        }
        // What the pool would refuse at every registration fails here, at once.
        if let Some(name) = &p.provider {
            rules::name("provider name", name).map_err(Error::BadPool)?;
        }
        if let Some(a) = &p.advertise {
            rules::reachable_address(a)
                .map_err(|why| Error::BadPool(format!("advertise address: {why}")))?;
        }
        if p.advertise.is_none() {
            if let Err(why) = rules::reachable_address(listen) {
                return Err(Error::BadPool(format!(
                    "the listen address cannot be registered ({why}): give the address borrowers reach this lender at with --advertise or [pool] advertise"
                )));
            }
            p.advertise = Some(listen.to_owned());
        }
        if let Some(a) = &p.advertise {
            rules::fabric_paths(a, &p.advertise_paths)
                .map_err(|why| Error::BadPool(format!("advertise paths: {why}")))?;
        }
    } else if cli.provider.is_some()
        || cli.advertise.is_some()
        || !cli.advertise_paths.is_empty()
        || cli.pool_join_token.is_some()
        || cli.pool_ca.is_some()
    {
        return Err(Error::BadPool(
            "--provider, --advertise, --advertise-path, --pool-join-token and --pool-ca need a pool \
             (--pool URL or [pool] url)"
                .into(),
        ));
    }
    Ok(pool)
}
