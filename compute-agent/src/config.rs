//! The compute agent's configuration: command line over the config file.

use std::net::SocketAddr;
use std::path::PathBuf;

use devlend_daemon::config::CommonFlags;
use devlend_daemon::logging::LogFormat;
use serde::{Deserialize, Serialize};

use crate::DEFAULT_API_SOCKET;

/// The name of this daemon's config file: `/etc/devlend/compute-agent.toml`.
pub const DAEMON: &str = "compute-agent";
/// Where the compute agent keeps its pool key by default.
pub const DEFAULT_POOL_KEY_FILE: &str = "/var/lib/devlend/compute-agent/identity.key";

/// Serves devices lent by device agents to VMs: block devices as vhost-user-blk sockets,
/// NICs as vhost-user-net, PCIe functions as vfio-user.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "devlend-compute-agent", version)]
pub struct Cli {
    /// The config file, logging, metrics and `--print-config`, as every daemon takes them.
    #[command(flatten)]
    pub common: CommonFlags,
    /// Path of the control API unix socket (used by `devlend`) [default:
    /// /run/devlend/compute-agent.sock].
    #[arg(long, value_name = "PATH")]
    pub api: Option<PathBuf>,
    /// Direct mode with authentication: sign a token for each session with the key in
    /// FILE (from `devlend keygen`); lenders given its public key (`--auth-key`) admit
    /// only such borrowers.
    #[arg(long, value_name = "FILE")]
    pub auth_key_file: Option<PathBuf>,
    /// The key this compute host signs its pool requests with (leases: bind, renew,
    /// release); made (0600) at first start [default:
    /// /var/lib/devlend/compute-agent/identity.key]. Enroll it with `devlend pool join`.
    #[arg(long, value_name = "FILE")]
    pub pool_key_file: Option<PathBuf>,
    /// CA certificates (PEM) the certificate of an https:// pool must chain to, for
    /// lease bind, renewal and release [default: the system's trust store].
    #[arg(long = "pool-ca", value_name = "FILE")]
    pub pool_ca_file: Option<PathBuf>,
    /// The pool's signing key (unpadded base64url, as `GET /v1/signing-key` and the
    /// pool's start log give it): every lease token must verify with it and match its
    /// lease before it is used, so a changed answer on the way from the pool cannot name
    /// another lender [default: tokens are taken as the pool's answer gives them].
    // A key is unpadded base64url: it may start with `-`.
    #[arg(long, value_name = "KEY", allow_hyphen_values = true)]
    pub pool_public_key: Option<String>,
    /// Where attachments are saved, to be served again when the agent restarts
    /// (`none`: not saved; a shutdown then detaches everything) [default: beside the API
    /// socket, e.g. /run/devlend/compute-agent.state.json].
    #[arg(long, value_name = "FILE|none")]
    pub state_file: Option<PathBuf>,
    /// CA certificates (PEM) trusted for lenders' TLS certificates; attachments made
    /// with `--tls` verify their lender against them.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate chain (PEM) presented to lenders that require one (mutual
    /// TLS); needs `--tls-key` and `--tls-ca`.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of `--tls-cert` (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// This compute host's cluster (a name in the gateways' routing tables); with
    /// `--gateway`, lenders can be addressed `CLUSTER/LENDER`.
    #[arg(long, value_name = "NAME", requires = "gateway")]
    pub cluster: Option<String>,
    /// The cluster gateway (`devlend-gateway`'s local listen address, `HOST:PORT`)
    /// through which sessions to lenders addressed `CLUSTER/LENDER` go.
    #[arg(long, value_name = "HOST:PORT", requires = "cluster")]
    pub gateway: Option<String>,
}

/// The config file; every key is optional and a flag of the same name overrides it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Control API socket path.
    pub api: Option<PathBuf>,
    /// Log filter.
    pub log_level: Option<String>,
    /// `human` or `json`.
    pub log_format: Option<LogFormat>,
    /// Metrics address, `ADDR:PORT`.
    pub metrics_listen: Option<SocketAddr>,
    /// Key file for direct-mode authentication.
    pub auth_key_file: Option<PathBuf>,
    /// Key file for pool requests.
    pub pool_key_file: Option<PathBuf>,
    /// CA certificates for `https://` pools (PEM).
    pub pool_ca_file: Option<PathBuf>,
    /// The pool's signing key that lease tokens must verify with.
    pub pool_public_key: Option<String>,
    /// State file path, or `none`.
    pub state_file: Option<PathBuf>,
    /// CA certificates trusted for lenders (PEM).
    pub tls_ca: Option<PathBuf>,
    /// Client certificate chain for mutual TLS (PEM).
    pub tls_cert: Option<PathBuf>,
    /// Private key of `tls_cert` (PEM).
    pub tls_key: Option<PathBuf>,
    /// This host's cluster.
    pub cluster: Option<String>,
    /// The cluster gateway, `HOST:PORT`.
    pub gateway: Option<String>,
}

/// The merged configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Config {
    /// Control API socket path.
    pub api: PathBuf,
    /// Log filter.
    pub log_level: String,
    /// Log line format.
    pub log_format: LogFormat,
    /// Metrics address, if any.
    pub metrics_listen: Option<SocketAddr>,
    /// Key file for direct-mode authentication, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth_key_file: Option<PathBuf>,
    /// Key file pool requests are signed with; `None`: [`DEFAULT_POOL_KEY_FILE`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_key_file: Option<PathBuf>,
    /// CA certificates for `https://` pools (PEM); `None`: the system's trust store.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_ca_file: Option<PathBuf>,
    /// The pool's signing key that lease tokens must verify with; `None`: not checked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_public_key: Option<String>,
    /// Where attachments are saved for a restart; `None`: not saved (`none`).
    #[serde(serialize_with = "state_file_text")]
    pub state_file: Option<PathBuf>,
    /// CA certificates trusted for lenders (PEM), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate chain for mutual TLS (PEM), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// Private key of `tls_cert` (PEM), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// This host's cluster, if any (with `gateway`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// The cluster gateway `HOST:PORT`, if any (with `cluster`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// The config file read, if any (not a key of the file).
    #[serde(skip)]
    pub file: Option<PathBuf>,
}

impl Config {
    /// Reads the config file and applies the flags over it.
    ///
    /// # Errors
    /// The file cannot be read or has an unknown key or a bad value (named in the error).
    pub fn load(cli: &Cli) -> Result<Config, devlend_daemon::config::ConfigError> {
        let (file, path): (FileConfig, _) =
            devlend_daemon::config::load(DAEMON, cli.common.config.as_deref())?;
        Ok(Config::merge(&file, cli, path))
    }

    /// The flags over the file.
    pub fn merge(file: &FileConfig, cli: &Cli, path: Option<PathBuf>) -> Config {
        let api = cli
            .api
            .clone()
            .or_else(|| file.api.clone())
            .unwrap_or_else(|| PathBuf::from(DEFAULT_API_SOCKET));
        let common =
            cli.common
                .resolve(file.log_level.clone(), file.log_format, file.metrics_listen);
        Config {
            log_level: common.log_level,
            log_format: common.log_format,
            metrics_listen: common.metrics_listen,
            auth_key_file: cli
                .auth_key_file
                .clone()
                .or_else(|| file.auth_key_file.clone()),
            pool_key_file: cli
                .pool_key_file
                .clone()
                .or_else(|| file.pool_key_file.clone()),
            pool_ca_file: cli
                .pool_ca_file
                .clone()
                .or_else(|| file.pool_ca_file.clone()),
            pool_public_key: cli
                .pool_public_key
                .clone()
                .or_else(|| file.pool_public_key.clone()),
            state_file: match cli.state_file.clone().or_else(|| file.state_file.clone()) {
                Some(p) if p.as_os_str() == "none" => None,
                Some(p) => Some(p),
                None => Some(crate::state::default_path(&api)),
            },
            api,
            tls_ca: cli.tls_ca.clone().or_else(|| file.tls_ca.clone()),
            tls_cert: cli.tls_cert.clone().or_else(|| file.tls_cert.clone()),
            tls_key: cli.tls_key.clone().or_else(|| file.tls_key.clone()),
            cluster: cli.cluster.clone().or_else(|| file.cluster.clone()),
            gateway: cli.gateway.clone().or_else(|| file.gateway.clone()),
            file: path,
        }
    }

    /// The configuration as TOML, as `--print-config` shows it.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot print the configuration: {e}\n"))
    }
}

fn state_file_text<S: serde::Serializer>(p: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
    match p {
        Some(p) => s.serialize_str(&p.to_string_lossy()),
        None => s.serialize_str("none"),
    }
}

impl Config {
    /// The TLS configuration for attachments that ask for TLS: `None` without
    /// `tls_ca`.
    ///
    /// # Errors
    /// A certificate without its key (or the reverse), a client certificate without
    /// `tls_ca`, or a file that cannot be loaded (named in the message).
    pub fn client_tls(&self) -> anyhow::Result<Option<devlend_fabric::tls::ClientTls>> {
        let identity = match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
            (None, None) => None,
            _ => anyhow::bail!("tls_cert and tls_key go together: give both or neither"),
        };
        let Some(ca) = &self.tls_ca else {
            if identity.is_some() {
                anyhow::bail!("tls_cert needs tls_ca (the CAs trusted for lenders)");
            }
            return Ok(None);
        };
        let tls = devlend_fabric::tls::ClientTls::load(ca, identity)
            .map_err(|e| anyhow::anyhow!("TLS: {}", devlend_fabric::error::chain(&e)))?;
        Ok(Some(tls))
    }
}

impl Config {
    /// This host's cluster and gateway, for lenders addressed `CLUSTER/LENDER`; `None`
    /// without them.
    ///
    /// # Errors
    /// Only one of the two given, or a cluster name that is not valid.
    pub fn gateway(&self) -> anyhow::Result<Option<(String, String)>> {
        match (&self.cluster, &self.gateway) {
            (None, None) => Ok(None),
            (Some(c), Some(g)) => {
                if !devlend_fabric::relay::valid_name(c) {
                    anyhow::bail!(
                        "cluster {c:?} is not a valid name (1..=64 letters, digits, -, _, .)"
                    );
                }
                Ok(Some((c.clone(), g.clone())))
            }
            _ => anyhow::bail!("cluster and gateway go together: give both or neither"),
        }
    }
}

impl devlend_daemon::DaemonConfig for Config {
    fn to_toml(&self) -> String {
        Config::to_toml(self)
    }

    fn logging(&self) -> (&str, LogFormat) {
        (&self.log_level, self.log_format)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn flags_override_the_file() {
        let file: FileConfig = devlend_daemon::config::parse(
            std::path::Path::new("c.toml"),
            "api = \"/run/a.sock\"\nlog_level = \"debug\"\nlog_format = \"json\"\nmetrics_listen = \"127.0.0.1:9100\"\n",
        )
        .unwrap();
        let cli = Cli::parse_from(["x", "--api", "/run/b.sock"]);
        let c = Config::merge(&file, &cli, None);
        assert_eq!(c.api, PathBuf::from("/run/b.sock"));
        assert_eq!(c.log_level, "debug");
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9100".parse().unwrap()));
        let d = Config::merge(&FileConfig::default(), &Cli::parse_from(["x"]), None);
        assert_eq!(d.api, PathBuf::from(DEFAULT_API_SOCKET));
        assert!(c.to_toml().contains("log_format = \"json\""));
        assert_eq!(c.state_file, Some(PathBuf::from("/run/b.state.json")));
        let none = Config::merge(
            &FileConfig::default(),
            &Cli::parse_from(["x", "--state-file", "none"]),
            None,
        );
        assert_eq!(none.state_file, None);
        assert!(none.to_toml().contains("state_file = \"none\""));
    }

    #[test]
    fn tls_keys_merge_and_are_checked_before_loading() {
        let file: FileConfig = devlend_daemon::config::parse(
            std::path::Path::new("c.toml"),
            "tls_ca = \"/etc/ca.crt\"\ntls_cert = \"/etc/c.crt\"\n",
        )
        .unwrap();
        let c = Config::merge(
            &file,
            &Cli::parse_from(["x", "--tls-ca", "/etc/other.crt"]),
            None,
        );
        assert_eq!(c.tls_ca, Some(PathBuf::from("/etc/other.crt")));
        assert_eq!(c.tls_cert, Some(PathBuf::from("/etc/c.crt")));
        let e = c.client_tls().unwrap_err().to_string();
        assert!(e.contains("tls_cert and tls_key go together"), "{e}");
        let none = Config::merge(&FileConfig::default(), &Cli::parse_from(["x"]), None);
        assert!(none.client_tls().unwrap().is_none());
        let missing = Config::merge(
            &FileConfig::default(),
            &Cli::parse_from(["x", "--tls-ca", "/nonexistent/ca.crt"]),
            None,
        );
        let e = missing.client_tls().unwrap_err().to_string();
        assert!(e.contains("/nonexistent/ca.crt"), "{e}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = devlend_daemon::config::parse::<FileConfig>(
            std::path::Path::new("/etc/devlend/compute-agent.toml"),
            "apii = \"x\"",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("compute-agent.toml") && e.contains("apii"),
            "{e}"
        );
    }
}
