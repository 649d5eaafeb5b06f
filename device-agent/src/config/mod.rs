//! What to lend and where to listen: command-line flags and the TOML config file
//! (here), and the device spec (`spec`).
//!
//! Flags override and extend the file: `--listen` replaces `listen`; each `--device` is
//! added, and replaces a file device of the same name. Within the file, and within the
//! flags, a device name may appear once.

mod pool;
mod spec;
mod spec_file;
mod spec_flag;
mod store;

use std::path::{Path, PathBuf};

use devlend_fabric::lease_token::TokenSigner;

use devlend_daemon::logging::LogFormat;
use serde::{Deserialize, Serialize};

pub use self::pool::{PoolConfig, MAX_ADVERTISE_PATHS};
pub(crate) use self::spec::check_unique;
pub use self::spec::{
    parse_mac, valid_bdf, BlockSpec, Coherence, DeviceSpec, KindSpec, NetSpec, PciSpec, PfSpec,
};
pub use self::store::StoreSpec;
use crate::Error;

/// The command line of `devlend-device-agent`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "devlend-device-agent",
    version,
    about = "Lends block devices, network interfaces and PCIe functions to devlend borrowers"
)]
pub struct Cli {
    /// Address and port to listen on, e.g. 0.0.0.0:7700 (overrides `listen` in the file).
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<String>,
    /// Fabric transport: `tcp` (default), or `rdma` to also serve RDMA sessions with
    /// rdma_cm on the listen address (which must be an RDMA device's IP).
    #[arg(long, value_enum, value_name = "tcp|rdma")]
    pub transport: Option<Transport>,
    /// How sessions do block device I/O: `auto` (default: plain system calls on the
    /// session's thread for files on tmpfs/ramfs, io_uring otherwise), `uring` (io_uring
    /// for every device), `sync` (plain system calls for every device). Overrides
    /// `io_mode` in the file.
    #[arg(long, value_enum, value_name = "auto|uring|sync")]
    pub io_mode: Option<IoMode>,
    /// A device to lend; repeatable: a block device or file (PATH), a network interface
    /// (`net:IFNAME`), or a PCIe function bound to vfio-pci (`pci:DDDD:BB:DD.F`, with
    /// its coherence mode). Limits (docs/qos.md): `iops_read=N`, `bps_write=N` (bytes a
    /// second), `tx_pps=N`, ..., `KEY_burst=N`, `weight=N`; N takes K, M, G, T suffixes
    /// (powers of 1024: 50M is 52428800). Replaces a config-file device of the same name.
    #[arg(
        long = "device",
        value_name = "NAME=PATH[,ro][,serial=S][,traits=A+B][,store=S][,LIMIT=N...] | NAME=net:IFNAME[,mac=M][,LIMIT=N...] | NAME=pci:BDF[,coherence=nvme|mirror]"
    )]
    pub devices: Vec<DeviceSpec>,
    /// A backing store that devices share (`store=NAME` in a device), with the capacity
    /// its borrowers divide by weight: `NAME:bps_total=N,iops_total=N,...` (bytes per
    /// second, operations per second; N takes K, M, G, T suffixes, powers of 1024);
    /// repeatable. Replaces a `[[store]]` of that name.
    #[arg(long = "store", value_name = "NAME:KEY=N[,KEY=N...]")]
    pub stores: Vec<StoreSpec>,
    /// The config file, logging, metrics and `--print-config`, as every daemon takes them.
    #[command(flatten)]
    pub common: devlend_daemon::config::CommonFlags,
    /// Register with the device pool at this URL and serve leased devices only
    /// (overrides `[pool] url`). Without a pool the lender is in direct mode,
    /// unauthenticated.
    #[arg(long, value_name = "URL")]
    pub pool: Option<String>,
    /// This lender's name in the pool [default: the host name].
    #[arg(long, value_name = "NAME")]
    pub provider: Option<String>,
    /// Address borrowers reach this lender at, registered with the pool [default: the
    /// listen address, which must then not be a wildcard].
    #[arg(long, value_name = "HOST:PORT")]
    pub advertise: Option<String>,
    /// A further address borrowers reach this lender at (another network or NIC),
    /// registered with the pool beside `--advertise`: a leased block device or NIC is
    /// attached over all of them (docs/faults.md, "Paths"). Repeatable, at most 7; replaces
    /// `[pool] advertise_paths`.
    #[arg(long = "advertise-path", value_name = "HOST:PORT")]
    pub advertise_paths: Vec<String>,
    /// This lender's own key (overrides `key_file`): it signs the lender's pool requests
    /// and proves the lender's identity in every handshake that asks; made (0600) at
    /// first start [default: /var/lib/devlend/device-agent/identity.key].
    #[arg(long, value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// During a key rotation: this lender's previous key file. The lender proves it to
    /// borrowers that ask for it (the attachments whose leases were granted before the
    /// rotation), and its current key to every other; remove it once those attachments
    /// have gone (docs/security.md, "Rotating keys"). In the file: `previous_key_file`.
    #[arg(long, value_name = "FILE")]
    pub previous_key_file: Option<PathBuf>,
    /// A one-time join token from `devlend pool enroll --role lender` that enrolls this
    /// lender's key at start (overrides `[pool] join_token`).
    #[arg(long, value_name = "TOKEN")]
    pub pool_join_token: Option<String>,
    /// CA certificates (PEM) the certificate of an https:// pool must chain to
    /// (overrides `[pool] ca_file`) [default: the system's trust store].
    #[arg(long = "pool-ca", value_name = "FILE")]
    pub pool_ca: Option<PathBuf>,
    /// Direct mode with authentication: serve only borrowers whose tokens verify with
    /// this public key (from `devlend keygen`); repeatable. Adds to `auth_keys`.
    // A key is unpadded base64url: it may start with `-` (one in 64 do).
    #[arg(
        long = "auth-key",
        value_name = "PUBLIC_KEY",
        allow_hyphen_values = true
    )]
    pub auth_keys: Vec<String>,
    /// Serve TLS 1.3 only, with this certificate chain (PEM, leaf first); needs
    /// `--tls-key`. Plaintext borrowers are refused. Recommended when traffic leaves a
    /// rack (docs/tls.md).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of `--tls-cert` (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require a client certificate signed by this CA (PEM) from every borrower
    /// (mutual TLS); needs `--tls-cert`.
    #[arg(long, value_name = "FILE")]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve borrowers without authentication (no pool, no --auth-key, no
    /// --tls-client-ca) on an address other hosts can reach: anyone who reaches the port
    /// can open the devices. For a lab network you trust; without it such a lender
    /// refuses to start (on loopback it is not needed). In the file: `insecure = true`.
    #[arg(long)]
    pub insecure: bool,
    /// Take lease tokens that name no holder key (bearer tokens: from a pool or compute
    /// agent older than proof of possession, or a pool run with `--insecure-open-api`
    /// whose compute hosts have no enrolled key). Anyone who saw such a token on the wire
    /// can open its device with it. In the file: `allow_bearer_tokens = true`.
    #[arg(long)]
    pub allow_bearer_tokens: bool,
    /// Most borrower sessions open at once, over all devices (default 256, at most
    /// 65536); the next hello is answered `Busy`. A session is a thread and a few
    /// descriptors (docs/performance.md, "Scale"). In the file: `max_sessions = N`.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=MAX_SESSIONS_LIMIT as i64))]
    pub max_sessions: Option<u32>,
    /// Most µs a block session over TCP polls before it sleeps, an adaptive window
    /// that drops to 0 while the CPUs are contended (0..=1000, default 200; 0: sleep at
    /// once). Lower QD1 latency for idle CPU time (docs/performance.md, "Adaptive
    /// polling"). In the file: `poll_us = N`.
    #[arg(long, value_name = "µs", value_parser = clap::value_parser!(u32).range(0..=MAX_POLL_US as i64))]
    pub poll_us: Option<u32>,
}

/// The largest `max_sessions` taken.
pub const MAX_SESSIONS_LIMIT: u32 = 65536;

/// The largest `poll_us` taken: 1 ms.
pub const MAX_POLL_US: u32 = 1000;

/// Where the lender keeps its own key by default.
pub const DEFAULT_KEY_FILE: &str = "/var/lib/devlend/device-agent/identity.key";

/// The config file: `listen = "ADDR:PORT"` and `[[device]]` tables ([`DeviceSpec`]).
/// Unknown keys are refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    transport: Option<Transport>,
    log_level: Option<String>,
    log_format: Option<LogFormat>,
    metrics_listen: Option<std::net::SocketAddr>,
    io_mode: Option<IoMode>,
    pool: Option<PoolConfig>,
    #[serde(default)]
    auth_keys: Vec<String>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
    key_file: Option<PathBuf>,
    previous_key_file: Option<PathBuf>,
    #[serde(default)]
    insecure: bool,
    #[serde(default)]
    allow_bearer_tokens: bool,
    max_sessions: Option<u32>,
    poll_us: Option<u32>,
    #[serde(default, rename = "device")]
    devices: Vec<DeviceSpec>,
    #[serde(default, rename = "store")]
    stores: Vec<StoreSpec>,
}

/// The fabric transport a lender serves.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// TCP (optionally TLS) only.
    #[default]
    Tcp,
    /// RDMA (rdma_cm, RC queue pairs) beside TCP.
    Rdma,
}

/// How a session does device I/O (`--io-mode`, `io_mode` in the config file).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum IoMode {
    /// Plain system calls for files in memory (tmpfs, ramfs), io_uring otherwise.
    #[default]
    Auto,
    /// io_uring for every device.
    Uring,
    /// Plain system calls on the session's thread for every device (a slow device then
    /// serialises the session's requests).
    Sync,
}

impl IoMode {
    /// Whether this is the default, [`IoMode::Auto`].
    pub fn is_auto(&self) -> bool {
        *self == IoMode::Auto
    }
}

/// A complete, validated configuration: what to lend and where.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Config {
    /// Address and port to listen on.
    pub listen: String,
    /// Fabric transport.
    pub transport: Transport,
    /// Log filter.
    pub log_level: String,
    /// Log line format.
    pub log_format: LogFormat,
    /// Metrics address, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// How sessions do block device I/O.
    #[serde(skip_serializing_if = "IoMode::is_auto")]
    pub io_mode: IoMode,
    /// The pool to register with; `None`: direct mode (unauthenticated).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolConfig>,
    /// Direct mode with authentication: the borrowers' public keys (unpadded
    /// base64url Ed25519, from `devlend keygen`); empty: unauthenticated direct mode.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub auth_keys: Vec<String>,
    /// TLS: this lender's certificate chain (PEM); with `tls_key`, every connection
    /// must be TLS 1.3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// TLS: the private key of `tls_cert` (PEM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// TLS: require client certificates signed by this CA (PEM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_ca: Option<PathBuf>,
    /// This lender's own key file, if configured (`None`: [`DEFAULT_KEY_FILE`], made
    /// when it can be; see [`Config::key_path`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// The previous key during a key rotation (`--previous-key-file`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous_key_file: Option<PathBuf>,
    /// Serve without authentication beyond loopback (`--insecure`): see
    /// [`crate::exposure::allow_unauthenticated`].
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
    /// Take lease tokens that name no holder key (`--allow-bearer-tokens`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub allow_bearer_tokens: bool,
    /// Most sessions open at once (`--max-sessions`); `None`: the default, 256.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_sessions: Option<u32>,
    /// Most µs a block session polls before it sleeps (`--poll-us`); `None`: 200.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub poll_us: Option<u32>,
    /// Backing stores that devices share, with their capacities.
    #[serde(rename = "store", skip_serializing_if = "Vec::is_empty")]
    pub stores: Vec<StoreSpec>,
    /// Devices to lend, with distinct names (file devices first, in file order).
    #[serde(rename = "device")]
    pub devices: Vec<DeviceSpec>,
}

impl Config {
    /// This lender's key file: `key_file`, or [`DEFAULT_KEY_FILE`].
    pub fn key_path(&self) -> PathBuf {
        self.key_file
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_KEY_FILE))
    }

    /// Reads or makes this lender's key. A configured `key_file` must be usable; the
    /// default one is made when the agent may write its state directory, and otherwise
    /// the lender goes on without a key (it then cannot prove itself to borrowers that
    /// ask, nor sign pool requests), with a warning.
    ///
    /// # Errors
    /// [`Error::PoolKey`] for a configured key file that cannot be read or made.
    pub fn load_key(&self) -> Result<Option<std::sync::Arc<TokenSigner>>, Error> {
        let path = self.key_path();
        match devlend_fabric::identity::load_or_create(&path) {
            Ok((key, made)) => {
                if made {
                    tracing::info!(path = %path.display(), key = %key.public_key().to_text(), "made this lender's key");
                }
                Ok(Some(std::sync::Arc::new(key)))
            }
            Err(e) if self.key_file.is_none() => {
                tracing::warn!(error = %devlend_fabric::error::chain(&e), "no key: this lender cannot prove who it is to borrowers, nor sign pool requests");
                Ok(None)
            }
            Err(e) => Err(Error::PoolKey(e)),
        }
    }

    /// Reads the previous key of a rotation (`previous_key_file`), if configured; it
    /// must exist (a rotation keeps the old key, it does not make one).
    ///
    /// # Errors
    /// [`Error::PoolKey`] when the file cannot be read or is not a key.
    pub fn load_previous_key(&self) -> Result<Option<std::sync::Arc<TokenSigner>>, Error> {
        self.previous_key_file
            .as_ref()
            .map(|p| {
                devlend_fabric::identity::load(p)
                    .map(std::sync::Arc::new)
                    .map_err(Error::PreviousKey)
            })
            .transpose()
    }

    /// The configuration as TOML, as `--print-config` shows it (a valid config file).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot print the configuration: {e}\n"))
    }
}

/// The default config file, read when `--config` is not given and it exists.
pub const DEFAULT_CONFIG: &str = "/etc/devlend/device-agent.toml";

impl Config {
    /// Reads the config file named by `--config` (if any) and applies the flags over it.
    ///
    /// # Errors
    /// [`Error::ConfigRead`], [`Error::ConfigParse`] (bad TOML, unknown key: the message
    /// names the file and the key), [`Error::ConfigDevice`] (a file device fails
    /// [`DeviceSpec::validate`]), [`Error::DuplicateDevice`], [`Error::NoListen`],
    /// [`Error::NoDevices`].
    pub fn from_cli(cli: &Cli) -> Result<Config, Error> {
        let default = PathBuf::from(DEFAULT_CONFIG);
        let path = cli
            .common
            .config
            .as_ref()
            .or(default.exists().then_some(&default));
        let file = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| Error::ConfigRead {
                    path: path.clone(),
                    source,
                })?;
                Self::parse_file(path, &text)?
            }
            None => FileConfig::default(),
        };
        check_unique(&cli.devices)?;
        let mut devices: Vec<DeviceSpec> = file
            .devices
            .into_iter()
            .filter(|d| !cli.devices.iter().any(|f| f.name == d.name))
            .collect();
        devices.extend(cli.devices.iter().cloned());
        let listen = cli.listen.clone().or(file.listen).ok_or(Error::NoListen)?;
        if devices.is_empty() {
            return Err(Error::NoDevices);
        }
        let pool = self::pool::resolve(cli, file.pool, &listen)?;
        let mut auth_keys = file.auth_keys;
        auth_keys.extend(cli.auth_keys.iter().cloned());
        for k in &auth_keys {
            devlend_fabric::lease_token::PublicKey::from_text(k).map_err(|e| {
                Error::BadAuthKey {
                    key: k.clone(),
                    reason: e.to_string(),
                }
            })?;
        }
        if pool.is_some() && !auth_keys.is_empty() {
            return Err(Error::BadPool(
                "auth keys are for direct mode: with a pool, borrowers present lease tokens".into(),
            ));
        }
        let mut stores: Vec<StoreSpec> = file
            .stores
            .into_iter()
            .filter(|s| !cli.stores.iter().any(|f| f.name == s.name))
            .collect();
        stores.extend(cli.stores.iter().cloned());
        self::store::check_stores(&stores, &devices)?;
        let tls_cert = cli.tls_cert.clone().or(file.tls_cert);
        let tls_key = cli.tls_key.clone().or(file.tls_key);
        let tls_client_ca = cli.tls_client_ca.clone().or(file.tls_client_ca);
        if tls_cert.is_some() != tls_key.is_some() {
            return Err(Error::BadTls(
                "tls_cert and tls_key go together: give both or neither".into(),
            ));
        }
        if tls_client_ca.is_some() && tls_cert.is_none() {
            return Err(Error::BadTls(
                "tls_client_ca needs tls_cert and tls_key (client certificates are checked inside TLS)".into(),
            ));
        }
        let max_sessions = cli.max_sessions.or(file.max_sessions);
        if let Some(n) = max_sessions.filter(|n| !(1..=MAX_SESSIONS_LIMIT).contains(n)) {
            return Err(Error::BadMaxSessions(n));
        }
        let poll_us = cli.poll_us.or(file.poll_us);
        if let Some(n) = poll_us.filter(|n| *n > MAX_POLL_US) {
            return Err(Error::BadPollUs(n));
        }
        let common = cli
            .common
            .resolve(file.log_level, file.log_format, file.metrics_listen);
        Ok(Config {
            pool,
            auth_keys,
            tls_cert,
            tls_key,
            tls_client_ca,
            key_file: cli.key_file.clone().or(file.key_file),
            previous_key_file: cli.previous_key_file.clone().or(file.previous_key_file),
            insecure: cli.insecure || file.insecure,
            allow_bearer_tokens: cli.allow_bearer_tokens || file.allow_bearer_tokens,
            max_sessions,
            poll_us,
            listen,
            transport: cli.transport.or(file.transport).unwrap_or_default(),
            log_level: common.log_level,
            log_format: common.log_format,
            metrics_listen: common.metrics_listen,
            io_mode: cli.io_mode.or(file.io_mode).unwrap_or_default(),
            stores,
            devices,
        })
    }

    fn parse_file(path: &Path, text: &str) -> Result<FileConfig, Error> {
        let file: FileConfig = toml::from_str(text).map_err(|source| Error::ConfigParse {
            path: path.to_owned(),
            source,
        })?;
        let in_file = |source: Error| Error::ConfigDevice {
            path: path.to_owned(),
            source: Box::new(source),
        };
        for d in &file.devices {
            d.validate().map_err(in_file)?;
        }
        check_unique(&file.devices).map_err(in_file)?;
        Ok(file)
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
mod tests;
