//! `devlend pool ...`: run the device pool, and list its devices, leases and providers.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use devlend_daemon::logging::{self, LogFormat};
use devlend_pool::api::{Device, DeviceQuery, DeviceState, Lease, LeaseFilter, Provider};
use devlend_pool::auth::AuthMode;
use devlend_pool::listen::{Limits, TlsFiles};
use devlend_pool::server::{DEFAULT_DATA_DIR, DEFAULT_LISTEN};
use devlend_pool::{PoolServer, ServerConfig};

use crate::pool_auth::{default_admin_key, PoolKey, DEFAULT_POOL_URL};

use crate::output::human_bytes;
use devlend_fabric::units::parse_size;

/// The `devlend pool` subcommands.
#[derive(Debug, Subcommand)]
pub enum PoolCmd {
    /// Run the device pool (REST API; SQLite in the data directory, or PostgreSQL).
    Serve {
        /// Listen address (HTTP, or HTTPS with --tls-cert and --tls-key).
        #[arg(long, default_value = DEFAULT_LISTEN)]
        listen: SocketAddr,
        /// Serve HTTPS (TLS 1.3 or 1.2) with this certificate chain (PEM, leaf first).
        #[arg(long, requires = "tls_key", value_name = "FILE")]
        tls_cert: Option<PathBuf>,
        /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
        #[arg(long, requires = "tls_cert", value_name = "FILE")]
        tls_key: Option<PathBuf>,
        /// Seconds a connection may take for its TLS handshake, and for each request's
        /// headers, before it is closed.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
        header_timeout_secs: u64,
        /// Connections served at once; more are closed at accept.
        #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
        max_connections: u64,
        /// Connections served at once from one IP address; more are closed at accept.
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
        max_connections_per_address: u64,
        /// Seconds a request's body and its handling may take after its headers; then it
        /// is answered 408 and its connection closed.
        #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
        request_timeout_secs: u64,
        /// Database URL: sqlite:///PATH, sqlite::memory: or postgres://USER@HOST/DB
        /// (default: SQLite in --data-dir).
        #[arg(long)]
        database: Option<String>,
        /// Directory of the SQLite database (pool.db), created at first start.
        #[arg(long, default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// Log level: off, error, warn, info, debug, trace, or target=level directives.
        #[arg(long, default_value = "info")]
        log_level: String,
        /// Log format on stderr.
        #[arg(long, value_enum, default_value_t = LogFormat::Human)]
        log_format: LogFormat,
        /// The admin key file, made (0600) at first start (default: DATA_DIR/admin.key).
        #[arg(long)]
        admin_key_file: Option<PathBuf>,
        /// Pin a lender's key to its provider name at its first registration, when no
        /// key holds that name yet (trust on first use), instead of requiring enrollment.
        #[arg(long)]
        trust_first_use: bool,
        /// INSECURE, for a lab: no authentication at all. Anyone who reaches the API can
        /// register lenders (and so redirect borrowers), lease and release anything.
        #[arg(long)]
        insecure_open_api: bool,
    },
    /// Enroll a key (admin): print a one-time join token for a lender or compute host,
    /// or pin a public key at once (--public-key). Re-enrolling a name rotates its key.
    Enroll(crate::pool_auth::Enroll),
    /// Redeem a join token: enroll this host's key (made if it does not exist yet).
    Join(crate::pool_auth::Join),
    /// List enrolled keys (admin).
    Principals {
        /// Pool URL.
        #[arg(long, env = "DEVLEND_POOL", default_value = DEFAULT_POOL_URL)]
        pool: String,
        /// The admin key.
        #[command(flatten)]
        key: PoolKey,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Revoke an enrolled key (admin): its requests are refused from now on.
    Revoke {
        /// Pool URL.
        #[arg(long, env = "DEVLEND_POOL", default_value = DEFAULT_POOL_URL)]
        pool: String,
        /// The public key to revoke.
        public_key: String,
        /// The admin key.
        #[command(flatten)]
        key: PoolKey,
    },
    /// List devices: ID, provider, name, class, capacity, traits, state, lease.
    Devices {
        /// Pool URL.
        #[arg(long, env = "DEVLEND_POOL", default_value = DEFAULT_POOL_URL)]
        pool: String,
        /// Only this resource class (BLOCK, NIC, PCI_<vendor>_<device>).
        #[arg(long)]
        class: Option<String>,
        /// Only devices with this trait (repeatable: all of them).
        #[arg(long = "trait", value_name = "TRAIT")]
        traits: Vec<String>,
        /// Only devices of at least this size (bytes, or with a K, M, G or T suffix).
        #[arg(long, value_parser = parse_size)]
        min_capacity: Option<u64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// The key requests are signed with.
        #[command(flatten)]
        key: PoolKey,
    },
    /// List leases (the live ones; --all for every lease the pool remembers).
    Leases {
        /// Pool URL.
        #[arg(long, env = "DEVLEND_POOL", default_value = DEFAULT_POOL_URL)]
        pool: String,
        /// Include released and expired leases.
        #[arg(long)]
        all: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// The key requests are signed with.
        #[command(flatten)]
        key: PoolKey,
    },
    /// List providers (device servers): address, transports, availability, devices.
    Providers {
        /// Pool URL.
        #[arg(long, env = "DEVLEND_POOL", default_value = DEFAULT_POOL_URL)]
        pool: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// The key requests are signed with.
        #[command(flatten)]
        key: PoolKey,
    },
}

/// Runs a `devlend pool` subcommand.
///
/// # Errors
/// The pool cannot be reached or refuses; `serve` cannot open its database or address.
pub fn run(cmd: PoolCmd) -> Result<()> {
    match cmd {
        PoolCmd::Serve {
            listen,
            tls_cert,
            tls_key,
            header_timeout_secs,
            max_connections,
            max_connections_per_address,
            request_timeout_secs,
            database,
            data_dir,
            log_level,
            log_format,
            admin_key_file,
            trust_first_use,
            insecure_open_api,
        } => {
            // Logs the URL, the signing key and the database backend at start.
            logging::init(&log_level, log_format)?;
            let tls = match (tls_cert, tls_key) {
                (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
                _ => None,
            };
            let server = PoolServer::start(ServerConfig {
                listen,
                tls,
                limits: Limits {
                    header_timeout: std::time::Duration::from_secs(header_timeout_secs),
                    max_connections: usize::try_from(max_connections).unwrap_or(usize::MAX),
                    max_per_address: usize::try_from(max_connections_per_address)
                        .unwrap_or(usize::MAX),
                    request_timeout: std::time::Duration::from_secs(request_timeout_secs),
                },
                database,
                data_dir,
                auth: if insecure_open_api {
                    AuthMode::Open
                } else {
                    AuthMode::Signed { trust_first_use }
                },
                admin_key_file,
            })
            .context("cannot start the pool")?;
            server.wait_for_signal();
            server.stop();
        }
        PoolCmd::Devices {
            pool,
            class,
            traits,
            min_capacity,
            json,
            key,
        } => {
            let devices = key
                .client(&pool, &default_admin_key())?
                .devices(&DeviceQuery {
                    class,
                    traits,
                    min_capacity,
                })?;
            if json {
                return print_json(&devices);
            }
            print!("{}", devices_table(&devices));
        }
        PoolCmd::Leases {
            pool,
            all,
            json,
            key,
        } => {
            let filter = if all {
                LeaseFilter::All
            } else {
                LeaseFilter::Active
            };
            let leases = key.client(&pool, &default_admin_key())?.leases(filter)?;
            if json {
                return print_json(&leases);
            }
            print!("{}", leases_table(&leases, now_ms()));
        }
        PoolCmd::Providers { pool, json, key } => {
            let providers = key.client(&pool, &default_admin_key())?.providers()?;
            if json {
                return print_json(&providers);
            }
            print!("{}", providers_table(&providers, now_ms()));
        }
        PoolCmd::Enroll(e) => crate::pool_auth::enroll(&e)?,
        PoolCmd::Join(j) => crate::pool_auth::join(&j)?,
        PoolCmd::Principals { pool, key, json } => {
            let all = key.client(&pool, &default_admin_key())?.principals()?;
            if json {
                return print_json(&all);
            }
            for p in &all {
                println!("{}", crate::pool_auth::principal_line(p));
            }
        }
        PoolCmd::Revoke {
            pool,
            public_key,
            key,
        } => {
            let p = key
                .client(&pool, &default_admin_key())?
                .revoke(&public_key)?;
            println!("revoked {}", crate::pool_auth::principal_line(&p));
        }
    }
    Ok(())
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

use devlend_fabric::lease_token::now_ms;

/// The first 8 characters of a UUID, as people read them.
fn short(id: &uuid::Uuid) -> String {
    id.to_string()[..8].to_string()
}

/// Columns padded to their widest cell; the last column is not padded.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let n = cells.len();
        let mut s = String::new();
        for (i, (c, w)) in cells.into_iter().zip(&widths).enumerate() {
            if i + 1 == n {
                s.push_str(&c);
            } else {
                s.push_str(&format!("{c:<w$}  "));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r.clone()));
    }
    out
}

fn state_name(s: DeviceState) -> &'static str {
    match s {
        DeviceState::Available => "available",
        DeviceState::Leased => "leased",
        DeviceState::Unavailable => "unavailable",
    }
}

/// The `devlend pool devices` table.
pub fn devices_table(devices: &[Device]) -> String {
    if devices.is_empty() {
        return "no devices\n".into();
    }
    let rows: Vec<Vec<String>> = devices
        .iter()
        .map(|d| {
            vec![
                short(&d.id),
                d.provider.clone(),
                d.name.clone(),
                d.resource_class.clone(),
                human_bytes(d.capacity_bytes),
                if d.traits.is_empty() {
                    "-".into()
                } else {
                    d.traits.join(",")
                },
                state_name(d.state).into(),
                d.lease_id.as_ref().map(short).unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    table(
        &[
            "ID", "PROVIDER", "NAME", "CLASS", "CAPACITY", "TRAITS", "STATE", "LEASE",
        ],
        &rows,
    )
}

fn in_secs(at_ms: u64, now_ms: u64) -> String {
    if at_ms >= now_ms {
        format!("in {}s", (at_ms - now_ms).div_ceil(1000))
    } else {
        format!("{}s ago", (now_ms - at_ms) / 1000)
    }
}

/// The `devlend pool leases` table.
pub fn leases_table(leases: &[Lease], now_ms: u64) -> String {
    if leases.is_empty() {
        return "no leases\n".into();
    }
    let rows: Vec<Vec<String>> = leases
        .iter()
        .map(|l| {
            vec![
                short(&l.id),
                l.consumer.clone(),
                l.compute_host.clone(),
                l.provider.clone(),
                l.device.clone(),
                l.state.as_str().into(),
                if l.state.is_live() {
                    in_secs(l.expires_at_ms, now_ms)
                } else {
                    "-".into()
                },
                l.generation.to_string(),
            ]
        })
        .collect();
    table(
        &[
            "ID", "CONSUMER", "HOST", "PROVIDER", "DEVICE", "STATE", "EXPIRES", "GEN",
        ],
        &rows,
    )
}

/// The `devlend pool providers` table.
pub fn providers_table(providers: &[Provider], now_ms: u64) -> String {
    if providers.is_empty() {
        return "no providers\n".into();
    }
    let rows: Vec<Vec<String>> = providers
        .iter()
        .map(|p| {
            let leased = p
                .devices
                .iter()
                .filter(|d| d.state == DeviceState::Leased)
                .count();
            vec![
                short(&p.id),
                p.name.clone(),
                // The first address, then the further paths.
                std::iter::once(&p.fabric_address)
                    .chain(&p.fabric_paths)
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    .join(","),
                p.transports.join(","),
                if p.available {
                    "available"
                } else {
                    "unavailable"
                }
                .into(),
                in_secs(p.last_heartbeat_ms, now_ms),
                format!("{} ({leased} leased)", p.devices.len()),
                p.generation.to_string(),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "NAME",
            "ADDRESS",
            "TRANSPORTS",
            "STATE",
            "HEARTBEAT",
            "DEVICES",
            "GEN",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_table_has_the_columns() {
        let d = Device {
            id: uuid::Uuid::nil(),
            provider: "lender-a".into(),
            provider_id: uuid::Uuid::nil(),
            fabric_address: "a:7700".into(),
            fabric_paths: vec![],
            name: "disk0".into(),
            resource_class: "BLOCK".into(),
            capacity_bytes: 10 << 30,
            traits: vec!["DISCARD".into(), "FABRIC_TCP".into()],
            state: DeviceState::Available,
            lease_id: None,
            generation: 1,
        };
        let t = devices_table(&[d]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("ID"), "{t}");
        assert!(
            lines[0].contains("CAPACITY") && lines[0].ends_with("LEASE"),
            "{t}"
        );
        assert!(
            lines[1].contains("lender-a") && lines[1].contains("DISCARD,FABRIC_TCP"),
            "{t}"
        );
        assert!(lines[1].contains("available"), "{t}");
        assert_eq!(devices_table(&[]), "no devices\n");
    }

    #[test]
    fn providers_table_lists_every_address() {
        let p = Provider {
            id: uuid::Uuid::nil(),
            name: "lender-a".into(),
            fabric_address: "a:7700".into(),
            fabric_paths: vec!["b:7700".into(), "c:7700".into()],
            transports: vec!["tcp".into()],
            heartbeat_ttl_ms: 6000,
            generation: 1,
            available: true,
            last_heartbeat_ms: 0,
            devices: vec![],
        };
        let t = providers_table(&[p], 0);
        assert!(t.contains("a:7700,b:7700,c:7700"), "{t}");
    }
}
