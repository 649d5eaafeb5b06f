//! The gateway's configuration file (TOML).
//!
//! ```toml
//! cluster = "a"                      # this gateway's cluster
//! listen = "10.0.0.1:7710"           # sessions from borrowers of this cluster (TCP)
//! peer_listen = "192.0.2.1:7711"     # links from peer gateways (TLS 1.3, mutual)
//! control = "127.0.0.1:7712"         # status over HTTP (`devlend gateway status`)
//! tls_cert = "/etc/devlend/gw-a.crt" # this gateway's certificate, both as server and client
//! tls_key = "/etc/devlend/gw-a.key"
//! tls_ca = "/etc/devlend/gw-ca.crt"  # the CA that signs every peer gateway's certificate
//! window = 33554432                  # per-session window on peer links, bytes
//!
//! [routes]                           # cluster -> peer gateway (its peer_listen)
//! b = "192.0.2.2:7711"
//! c = { addr = "192.0.2.3:7711", server_name = "gw-c.example" }
//!
//! [lenders]                          # lender name -> HOST:PORT, in this cluster
//! store1 = "10.0.0.5:7700"
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::mux::{DEFAULT_WINDOW, MIN_WINDOW};

/// Relays lend sessions between clusters: borrowers of this cluster open sessions here
/// for lenders elsewhere; peer gateways open links here for lenders of this cluster.
#[derive(Debug, clap::Parser)]
#[command(name = "devlend-gateway", version)]
pub struct Cli {
    /// Config file (TOML).
    #[arg(long, value_name = "FILE", default_value = "/etc/devlend/gateway.toml")]
    pub config: PathBuf,
    /// Log filter, over the file's `log_level`.
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Print the configuration as read and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// A route to a peer gateway: its address, and optionally the name its certificate
/// carries (default: the host part of the address).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RouteConfig {
    /// `HOST:PORT` only.
    Addr(String),
    /// With a TLS server name.
    Full {
        /// `HOST:PORT` of the peer's `peer_listen`.
        addr: String,
        /// The name to verify its certificate against.
        #[serde(default)]
        server_name: Option<String>,
    },
}

impl RouteConfig {
    /// The peer's address.
    pub fn addr(&self) -> &str {
        match self {
            RouteConfig::Addr(a) | RouteConfig::Full { addr: a, .. } => a,
        }
    }

    /// The TLS server name given, if any.
    pub fn server_name(&self) -> Option<&str> {
        match self {
            RouteConfig::Addr(_) => None,
            RouteConfig::Full { server_name, .. } => server_name.as_deref(),
        }
    }
}

/// The gateway's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This gateway's cluster name (letters, digits, `-`, `_`, `.`; 1..=64 bytes).
    pub cluster: String,
    /// Where borrowers of this cluster open relayed sessions (plain TCP, the cluster's
    /// fabric).
    pub listen: SocketAddr,
    /// Where peer gateways connect (TLS 1.3 with client certificates).
    pub peer_listen: SocketAddr,
    /// Status endpoint (HTTP, `GET /v1/status`); none if absent.
    #[serde(default)]
    pub control: Option<SocketAddr>,
    /// Prometheus metrics at `http://ADDR/metrics`; none if absent.
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// This gateway's certificate chain (PEM), presented to peers both ways.
    pub tls_cert: PathBuf,
    /// Its private key (PEM).
    pub tls_key: PathBuf,
    /// The CA (PEM) that peer gateways' certificates must chain to.
    pub tls_ca: PathBuf,
    /// Per-session credit window on peer links, in bytes (≥ 65536): the most a session
    /// has in flight between two gateways; it must cover bandwidth × RTT
    /// (`docs/gateway.md`). Default 32 MiB.
    #[serde(default = "default_window")]
    pub window: u32,
    /// Milliseconds between RTT pings on each peer link; default 1000.
    #[serde(default = "default_ping_ms")]
    pub ping_interval_ms: u64,
    /// Milliseconds without a frame from a peer after which its link is declared dead
    /// and closed (its sessions reset, the link redialled); default 5000. Peers' pings
    /// (`ping_interval_ms`) must come well within it.
    #[serde(default = "default_link_timeout_ms")]
    pub link_timeout_ms: u64,
    /// Milliseconds a new session waits for a peer link that is down before it is
    /// refused as unreachable; default 2000.
    #[serde(default = "default_wait_ms")]
    pub peer_wait_ms: u64,
    /// Log filter; default `info`.
    #[serde(default = "default_log_level")]
    pub log_level: String,
    /// Routing table: cluster name to peer gateway.
    #[serde(default)]
    pub routes: BTreeMap<String, RouteConfig>,
    /// Lenders of this cluster: name to `HOST:PORT`.
    #[serde(default)]
    pub lenders: BTreeMap<String, String>,
}

fn default_window() -> u32 {
    DEFAULT_WINDOW
}
fn default_ping_ms() -> u64 {
    1000
}
fn default_link_timeout_ms() -> u64 {
    5000
}
fn default_wait_ms() -> u64 {
    2000
}
fn default_log_level() -> String {
    "info".into()
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown keys.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What and where.
        message: String,
    },
    /// A value is out of range or inconsistent.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What.
        message: String,
    },
}

impl Config {
    /// Reads and validates `path`.
    ///
    /// # Errors
    /// [`ConfigError`], naming the file and the problem.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(path, &text)
    }

    /// Parses and validates config text (`path` names it in errors).
    ///
    /// # Errors
    /// [`ConfigError::Parse`], [`ConfigError::Invalid`].
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_owned(),
            message,
        };
        let name_ok = devlend_fabric::relay::valid_name;
        if !name_ok(&c.cluster) {
            return Err(invalid(format!(
                "cluster {:?} is not a valid name",
                c.cluster
            )));
        }
        if c.window < MIN_WINDOW {
            return Err(invalid(format!(
                "window {} is below {MIN_WINDOW} bytes",
                c.window
            )));
        }
        if c.ping_interval_ms == 0 {
            return Err(invalid("ping_interval_ms must be at least 1".into()));
        }
        if c.link_timeout_ms < 2 * c.ping_interval_ms {
            return Err(invalid(format!(
                "link_timeout_ms {} must be at least twice ping_interval_ms {}",
                c.link_timeout_ms, c.ping_interval_ms
            )));
        }
        for (name, r) in &c.routes {
            if !name_ok(name) {
                return Err(invalid(format!(
                    "route cluster {name:?} is not a valid name"
                )));
            }
            if name == &c.cluster {
                return Err(invalid(format!(
                    "a route to this gateway's own cluster {name:?}"
                )));
            }
            if !r.addr().contains(':') {
                return Err(invalid(format!(
                    "route {name}: {:?} is not HOST:PORT",
                    r.addr()
                )));
            }
        }
        for (name, addr) in &c.lenders {
            if !name_ok(name) {
                return Err(invalid(format!("lender {name:?} is not a valid name")));
            }
            if !addr.contains(':') {
                return Err(invalid(format!("lender {name}: {addr:?} is not HOST:PORT")));
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "cluster = \"a\"\nlisten = \"127.0.0.1:1\"\npeer_listen = \"127.0.0.1:2\"\ntls_cert = \"c\"\ntls_key = \"k\"\ntls_ca = \"ca\"\n";

    #[test]
    fn parses_routes_and_lenders() {
        let text = format!(
            "{BASE}[routes]\nb = \"10.0.0.2:7711\"\nc = {{ addr = \"10.0.0.3:7711\", server_name = \"gw-c\" }}\n[lenders]\ns1 = \"10.0.0.5:7700\"\n"
        );
        let c = Config::parse(Path::new("g.toml"), &text).unwrap();
        assert_eq!(c.routes["b"].addr(), "10.0.0.2:7711");
        assert_eq!(c.routes["c"].server_name(), Some("gw-c"));
        assert_eq!(c.lenders["s1"], "10.0.0.5:7700");
        assert_eq!(c.window, DEFAULT_WINDOW);
    }

    #[test]
    fn refuses_bad_values() {
        let p = Path::new("g.toml");
        for (extra, what) in [
            ("window = 10\n", "window"),
            ("[routes]\na = \"x:1\"\n", "own cluster"),
            ("[routes]\n\"b/c\" = \"x:1\"\n", "not a valid name"),
            ("[lenders]\ns = \"nohost\"\n", "HOST:PORT"),
            ("bogus = 1\n", "bogus"),
        ] {
            let e = Config::parse(p, &format!("{BASE}{extra}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(what) && e.contains("g.toml"), "{extra}: {e}");
        }
    }
}
