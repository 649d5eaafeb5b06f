//! What to lend and where to listen: command-line flags, the TOML config file, and the
//! `NAME=PATH[,ro][,serial=S][,traits=A+B]` device spec.
//!
//! Flags override and extend the file: `--listen` replaces `listen`; each `--device` is
//! added, and replaces a file device of the same name. Within the file, and within the
//! flags, a device name may appear once.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use devlend_daemon::logging::LogFormat;
use devlend_fabric::handshake::MAX_NAME_LEN;
use serde::{Deserialize, Serialize};

use crate::{Error, MAX_SERIAL_LEN};

/// One device to lend.
///
/// As a flag: `NAME=PATH[,ro][,serial=S][,traits=A+B]` (the path may not contain a
/// comma). In the config file: a `[[device]]` table with keys `name`, `path`,
/// `read_only` (default false), `serial` (optional) and `traits` (optional).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// The name borrowers ask for in their hello (1 to 255 bytes of UTF-8).
    pub name: String,
    /// A regular file or a block device (empty for a network interface).
    #[serde(default, skip_serializing_if = "path_is_empty")]
    pub path: PathBuf,
    /// A network interface to lend instead of a path (`NAME=net:IFNAME`; file key `net`):
    /// its frames are moved through AF_PACKET.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<String>,
    /// A PCIe function to lend instead of a path (`NAME=pci:BDF`, e.g.
    /// `pci:0000:00:03.0`; file key `pci`): it must be bound to `vfio-pci`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci: Option<String>,
    /// For a PCIe function: how the function's DMA is kept coherent with guest memory
    /// (`NAME=pci:BDF,coherence=nvme|mirror`; file key `coherence`). Default: `nvme`
    /// for an NVMe controller (class code 01:08:02), `mirror` for any other function.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coherence: Option<Coherence>,
    /// For a network interface: the MAC address the borrower's guest should use
    /// (`aa:bb:cc:dd:ee:ff`); default the interface's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Open the path read-only and answer writes, discards and write-zeroes with an I/O
    /// error.
    #[serde(default)]
    pub read_only: bool,
    /// The virtio-blk serial (GET_ID), 1 to 20 bytes without NUL; when absent, the
    /// device name truncated to 20 bytes.
    pub serial: Option<String>,
    /// Extra traits to register with the pool (upper-case `[A-Z0-9_]+`, e.g. `NUMA_0`,
    /// `SSD`), besides those the lender derives (`FABRIC_TCP`, `DISCARD`, `READ_ONLY`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub traits: Vec<String>,
}

/// How a lent PCIe function's DMA is kept coherent with the borrower's guest memory
/// (`docs/pci.md`, `docs/nvme.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Coherence {
    /// The generic DMA mirror: push before BAR writes, pull after interrupts.
    Mirror,
    /// The NVMe mediator: shadow queues on the lender, only the buffers each command
    /// names move.
    Nvme,
}

fn path_is_empty(p: &Path) -> bool {
    p.as_os_str().is_empty()
}

/// Whether `s` is a PCI address `DDDD:BB:DD.F` (domain, bus, device, function in hex).
pub fn valid_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && hex(0..4)
        && hex(5..7)
        && hex(8..10)
        && (b'0'..=b'7').contains(&b[11])
}

/// Parses a MAC address `aa:bb:cc:dd:ee:ff` (hex, either case).
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

impl DeviceSpec {
    /// Whether this spec lends a network interface.
    pub fn is_net(&self) -> bool {
        self.net.is_some()
    }

    /// Whether this spec lends a PCIe function.
    pub fn is_pci(&self) -> bool {
        self.pci.is_some()
    }

    /// Checks the name and the serial.
    ///
    /// # Errors
    /// [`Error::BadName`] for an empty name or one longer than 255 bytes;
    /// [`Error::SerialTooLong`] for a serial longer than [`MAX_SERIAL_LEN`] bytes;
    /// [`Error::BadSerial`] for an empty serial or one holding a NUL byte.
    pub fn validate(&self) -> Result<(), Error> {
        let bad_name = |reason| {
            Err(Error::BadName {
                name: self.name.clone(),
                reason,
            })
        };
        if self.name.is_empty() {
            return bad_name("empty");
        }
        if self.name.len() > MAX_NAME_LEN {
            return bad_name("longer than 255 bytes");
        }
        if let Some(serial) = &self.serial {
            let bad = |reason| {
                Err(Error::BadSerial {
                    device: self.name.clone(),
                    serial: serial.clone(),
                    reason,
                })
            };
            if serial.len() > MAX_SERIAL_LEN {
                return Err(Error::SerialTooLong {
                    device: self.name.clone(),
                    serial: serial.clone(),
                    len: serial.len(),
                });
            }
            if serial.is_empty() {
                return bad("empty");
            }
            if serial.contains('\0') {
                return bad("holds a NUL byte");
            }
        }
        if let Some(bdf) = &self.pci {
            if self.net.is_some() || !self.path.as_os_str().is_empty() {
                return bad_name("has a PCIe function and also a path or an interface");
            }
            if !valid_bdf(bdf) {
                return Err(Error::BadBdf {
                    name: self.name.clone(),
                    bdf: bdf.clone(),
                });
            }
            if self.read_only || self.serial.is_some() || self.mac.is_some() {
                return bad_name("ro, serial and mac do not apply to a PCIe function");
            }
            return Ok(());
        }
        if self.coherence.is_some() {
            return bad_name("coherence applies to PCIe functions only");
        }
        match (&self.net, self.path.as_os_str().is_empty()) {
            (Some(_), false) => return bad_name("has both a path and a network interface"),
            (None, true) => return bad_name("has neither a path nor a network interface"),
            (Some(ifname), true) => {
                if ifname.is_empty() || ifname.len() > 15 || ifname.contains(['/', '\0', ' ']) {
                    return bad_name("the interface name is not a valid Linux interface name");
                }
                if self.read_only || self.serial.is_some() {
                    return bad_name("ro and serial apply to block devices, not interfaces");
                }
            }
            (None, false) => {}
        }
        if let Some(mac) = &self.mac {
            if self.net.is_none() {
                return bad_name("mac applies to network interfaces only");
            }
            match parse_mac(mac) {
                Some(m) if m[0] & 1 == 0 && m != [0; 6] => {}
                _ => return bad_name("mac is not a unicast aa:bb:cc:dd:ee:ff address"),
            }
        }
        for t in &self.traits {
            let ok = !t.is_empty()
                && t.len() <= 255
                && t.bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
            if !ok {
                return Err(Error::BadTrait {
                    device: self.name.clone(),
                    name: t.clone(),
                });
            }
        }
        Ok(())
    }

    /// The serial as sent in the handshake: the given serial, else the name truncated to
    /// 20 bytes, NUL-padded to 20 bytes.
    pub fn serial_bytes(&self) -> [u8; MAX_SERIAL_LEN] {
        let src = self.serial.as_deref().unwrap_or(&self.name).as_bytes();
        let n = src.len().min(MAX_SERIAL_LEN);
        let mut out = [0u8; MAX_SERIAL_LEN];
        out[..n].copy_from_slice(&src[..n]);
        out
    }
}

impl FromStr for DeviceSpec {
    type Err = Error;

    /// Parses `NAME=PATH[,ro][,serial=S]`.
    ///
    /// # Errors
    /// [`Error::BadSpec`] for a malformed spec, and those of [`DeviceSpec::validate`].
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |reason: String| Error::BadSpec {
            spec: s.to_owned(),
            reason,
        };
        let (name, rest) = s
            .split_once('=')
            .ok_or_else(|| bad("expected NAME=PATH[,ro][,serial=S]".into()))?;
        let mut parts = rest.split(',');
        let path = parts.next().unwrap_or_default();
        if path.is_empty() || path == "net:" || path == "pci:" {
            return Err(bad("empty path".into()));
        }
        let (path, net, pci) = if let Some(ifname) = path.strip_prefix("net:") {
            (PathBuf::new(), Some(ifname.to_owned()), None)
        } else if let Some(bdf) = path.strip_prefix("pci:") {
            (PathBuf::new(), None, Some(bdf.to_owned()))
        } else {
            (PathBuf::from(path), None, None)
        };
        let mut spec = DeviceSpec {
            name: name.to_owned(),
            path,
            net,
            pci,
            coherence: None,
            mac: None,
            read_only: false,
            serial: None,
            traits: Vec::new(),
        };
        for opt in parts {
            match opt {
                "ro" => spec.read_only = true,
                "coherence=nvme" => spec.coherence = Some(Coherence::Nvme),
                "coherence=mirror" => spec.coherence = Some(Coherence::Mirror),
                _ if opt.starts_with("coherence=") => {
                    return Err(bad(format!(
                        "unknown coherence {:?} (expected nvme or mirror)",
                        &opt["coherence=".len()..]
                    )))
                }
                _ if opt.starts_with("mac=") => spec.mac = Some(opt["mac=".len()..].to_owned()),
                _ if opt.starts_with("serial=") => {
                    if spec.serial.is_some() {
                        return Err(bad("serial given twice".into()));
                    }
                    spec.serial = Some(opt["serial=".len()..].to_owned());
                }
                _ if opt.starts_with("traits=") => {
                    spec.traits
                        .extend(opt["traits=".len()..].split('+').map(str::to_owned));
                }
                "" => return Err(bad("empty option".into())),
                _ => {
                    return Err(bad(format!(
                        "unknown option {opt:?} (expected ro, serial=S, traits=A+B or coherence=nvme|mirror)"
                    )))
                }
            }
        }
        spec.validate()?;
        Ok(spec)
    }
}

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
    /// A device to lend; repeatable: a block device or file (PATH), a network interface
    /// (`net:IFNAME`), or a PCIe function bound to vfio-pci (`pci:DDDD:BB:DD.F`, with
    /// its coherence mode). Replaces a config-file device of the same name.
    #[arg(
        long = "device",
        value_name = "NAME=PATH[,ro][,serial=S][,traits=A+B] | NAME=net:IFNAME[,mac=M] | NAME=pci:BDF[,coherence=nvme|mirror]"
    )]
    pub devices: Vec<DeviceSpec>,
    /// TOML config file with `listen`, `log_level`, `log_format`, `metrics_listen` and
    /// `[[device]]` tables; default /etc/devlend/device-agent.toml when it exists.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log filter (e.g. `info`, `debug`, `devlend_device_agent=trace`) [default: info].
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Log line format [default: human].
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Print the merged configuration (file, then flags) as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
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
    /// Direct mode with authentication: serve only borrowers whose tokens verify with
    /// this public key (from `devlend keygen`); repeatable. Adds to `auth_keys`.
    #[arg(long = "auth-key", value_name = "PUBLIC_KEY")]
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
}

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
    /// Milliseconds between heartbeats (500..=60000, default 2000); the pool marks the
    /// lender unavailable after three missed ones.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_interval_ms: u64,
    /// The pool's public key (unpadded base64url), pinned: the lender refuses to start
    /// if the pool presents another. Default: trust the key the pool presents at start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
}

fn default_heartbeat_ms() -> u64 {
    2000
}

/// The config file: `listen = "ADDR:PORT"` and `[[device]]` tables ([`DeviceSpec`]).
/// Unknown keys are refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    log_level: Option<String>,
    log_format: Option<LogFormat>,
    metrics_listen: Option<std::net::SocketAddr>,
    pool: Option<PoolConfig>,
    #[serde(default)]
    auth_keys: Vec<String>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
    #[serde(default, rename = "device")]
    devices: Vec<DeviceSpec>,
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
    /// Devices to lend, with distinct names (file devices first, in file order).
    #[serde(rename = "device")]
    pub devices: Vec<DeviceSpec>,
}

impl Config {
    /// The configuration as TOML, as `--print-config` shows it (a valid config file).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot print the configuration: {e}\n"))
    }
}

/// The default config file, read when `--config` is not given and it exists.
pub const DEFAULT_CONFIG: &str = "/etc/devlend/device-agent.toml";

impl Config {
    /// Reads the config file named by `cli.config` (if any) and applies the flags over it.
    ///
    /// # Errors
    /// [`Error::ConfigRead`], [`Error::ConfigParse`] (bad TOML, unknown key: the message
    /// names the file and the key), [`Error::ConfigDevice`] (a file device fails
    /// [`DeviceSpec::validate`]), [`Error::DuplicateDevice`], [`Error::NoListen`],
    /// [`Error::NoDevices`].
    pub fn from_cli(cli: &Cli) -> Result<Config, Error> {
        let default = PathBuf::from(DEFAULT_CONFIG);
        let path = cli.config.as_ref().or(default.exists().then_some(&default));
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
        let mut pool = file.pool;
        if let Some(url) = &cli.pool {
            pool = Some(PoolConfig {
                url: url.clone(),
                ..pool.unwrap_or(PoolConfig {
                    url: String::new(),
                    provider: None,
                    advertise: None,
                    heartbeat_interval_ms: default_heartbeat_ms(),
                    public_key: None,
                })
            });
        }
        if let Some(p) = pool.as_mut() {
            if cli.provider.is_some() {
                p.provider = cli.provider.clone();
            }
            if cli.advertise.is_some() {
                p.advertise = cli.advertise.clone();
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
            if let Some(a) = &p.advertise {
                if a.starts_with("0.0.0.0:") || a.starts_with("[::]:") || !a.contains(':') {
                    return Err(Error::BadPool(format!(
                        "advertise address {a} must be HOST:PORT that borrowers can reach, not a wildcard"
                    )));
                }
            }
            if p.advertise.is_none() {
                if listen.starts_with("0.0.0.0:") || listen.starts_with("[::]:") {
                    return Err(Error::BadPool(format!(
                        "listen address {listen} is a wildcard: give the address borrowers reach this lender at with --advertise or [pool] advertise"
                    )));
                }
                p.advertise = Some(listen.clone());
            }
        } else if cli.provider.is_some() || cli.advertise.is_some() {
            return Err(Error::BadPool(
                "--provider and --advertise need a pool (--pool URL or [pool] url)".into(),
            ));
        }
        let mut auth_keys = file.auth_keys;
        auth_keys.extend(cli.auth_keys.iter().cloned());
        for k in &auth_keys {
            devlend_fabric::lease_token::PublicKey::from_text(k)
                .map_err(|e| Error::BadPool(format!("auth key {k:?}: {e}")))?;
        }
        if pool.is_some() && !auth_keys.is_empty() {
            return Err(Error::BadPool(
                "auth keys are for direct mode: with a pool, borrowers present lease tokens".into(),
            ));
        }
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
        Ok(Config {
            pool,
            auth_keys,
            tls_cert,
            tls_key,
            tls_client_ca,
            listen,
            transport: cli.transport.unwrap_or_default(),
            log_level: cli
                .log_level
                .clone()
                .or(file.log_level)
                .unwrap_or_else(|| "info".into()),
            log_format: cli.log_format.or(file.log_format).unwrap_or_default(),
            metrics_listen: cli.metrics_listen.or(file.metrics_listen),
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

/// Refuses two devices of the same name, and two devices lending one network
/// interface.
///
/// # Errors
/// [`Error::DuplicateDevice`] naming the first repeated name,
/// [`Error::SharedInterface`].
pub(crate) fn check_unique(devices: &[DeviceSpec]) -> Result<(), Error> {
    let mut seen = HashSet::new();
    let mut interfaces: std::collections::HashMap<&str, &str> = Default::default();
    for d in devices {
        if !seen.insert(d.name.as_str()) {
            return Err(Error::DuplicateDevice(d.name.clone()));
        }
        if let Some(ifname) = d.net.as_deref() {
            if let Some(first) = interfaces.insert(ifname, d.name.as_str()) {
                return Err(Error::SharedInterface {
                    interface: ifname.to_owned(),
                    first: first.to_owned(),
                    second: d.name.clone(),
                });
            }
        }
    }
    Ok(())
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

    fn spec(s: &str) -> Result<DeviceSpec, Error> {
        s.parse()
    }

    #[test]
    fn parses_plain_ro_and_serial() {
        let d = spec("disk0=/dev/nvme0n1").unwrap();
        assert_eq!(d.name, "disk0");
        assert_eq!(d.path, PathBuf::from("/dev/nvme0n1"));
        assert!(!d.read_only);
        assert_eq!(d.serial, None);

        let d = spec("d=/tmp/a.img,ro,serial=SN-1").unwrap();
        assert!(d.read_only);
        assert_eq!(d.serial.as_deref(), Some("SN-1"));

        let d = spec("d=/tmp/a.img,serial=X,ro").unwrap();
        assert!(d.read_only);
        assert_eq!(d.serial.as_deref(), Some("X"));

        // Exactly 20 bytes is fine.
        let d = spec("d=/x,serial=01234567890123456789").unwrap();
        assert_eq!(&d.serial_bytes(), b"01234567890123456789");
    }

    #[test]
    fn parses_pci_functions() {
        let s = spec("fpga0=pci:0000:00:03.0").unwrap();
        assert_eq!(s.pci.as_deref(), Some("0000:00:03.0"));
        assert!(s.is_pci() && s.path.as_os_str().is_empty());
        assert!(spec("fpga0=pci:00:03.0").is_err());
        assert!(spec("fpga0=pci:0000:00:03.8").is_err());
        assert!(spec("fpga0=pci:0000:00:03.0,ro").is_err());
        assert!(spec("fpga0=pci:").is_err());
        assert_eq!(spec("fpga0=pci:0000:00:03.0").unwrap().coherence, None);
        assert_eq!(
            spec("ssd0=pci:0000:00:03.0,coherence=nvme")
                .unwrap()
                .coherence,
            Some(Coherence::Nvme)
        );
        assert_eq!(
            spec("ssd0=pci:0000:00:03.0,coherence=mirror")
                .unwrap()
                .coherence,
            Some(Coherence::Mirror)
        );
        assert!(spec("ssd0=pci:0000:00:03.0,coherence=rdma").is_err());
        assert!(spec("d0=/tmp/x,coherence=nvme").is_err());
    }

    #[test]
    fn parses_network_interfaces() {
        let s = spec("nic0=net:veth1").unwrap();
        assert_eq!(s.net.as_deref(), Some("veth1"));
        assert!(s.path.as_os_str().is_empty() && s.is_net());
        let s = spec("nic0=net:eth0,mac=02:00:00:aa:bb:0C").unwrap();
        assert_eq!(
            parse_mac(s.mac.as_deref().unwrap()),
            Some([2, 0, 0, 0xaa, 0xbb, 0x0c])
        );
        assert!(spec("nic0=net:eth0,mac=03:00:00:00:00:01").is_err()); // multicast
        assert!(spec("nic0=net:eth0,mac=02:00:00").is_err());
        assert!(spec("nic0=net:eth0,ro").is_err());
        let two = [spec("a=net:eth0").unwrap(), spec("b=net:eth0").unwrap()];
        assert!(matches!(
            check_unique(&two),
            Err(Error::SharedInterface { ref interface, .. }) if interface == "eth0"
        ));
        assert!(check_unique(&[spec("a=net:eth0").unwrap(), spec("b=net:eth1").unwrap()]).is_ok());
        assert!(spec("nic0=net:").is_err());
        assert!(spec("d=/x.img,mac=02:00:00:00:00:01").is_err());
        assert!(spec("nic0=net:a-very-long-ifname").is_err());
    }

    #[test]
    fn refuses_bad_forms() {
        for bad in [
            "disk0",
            "=/x",
            "disk0=",
            "disk0=,ro",
            "disk0=/x,",
            "disk0=/x,rw",
            "disk0=/x,readonly",
            "disk0=/x,serial=",
            "disk0=/x,serial=a,serial=b",
        ] {
            assert!(spec(bad).is_err(), "{bad:?} was accepted");
        }
        let long = format!("{}=/x", "n".repeat(256));
        assert!(matches!(spec(&long), Err(Error::BadName { .. })));
    }

    #[test]
    fn refuses_serial_over_20_bytes_naming_the_device() {
        let err = spec("disk7=/x,serial=012345678901234567890").unwrap_err();
        assert!(
            matches!(err, Error::SerialTooLong { len: 21, .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("disk7") && msg.contains("21") && msg.contains("20"),
            "{msg}"
        );
        // Length counts bytes, not characters: 7 × 3 bytes = 21.
        assert!(matches!(
            spec("d=/x,serial=€€€€€€€"),
            Err(Error::SerialTooLong { .. })
        ));
    }

    #[test]
    fn default_serial_is_the_name_truncated_to_20_bytes() {
        let d = spec("disk0=/x").unwrap();
        let mut want = [0u8; 20];
        want[..5].copy_from_slice(b"disk0");
        assert_eq!(d.serial_bytes(), want);
        let d = spec("a-very-long-device-name-indeed=/x").unwrap();
        assert_eq!(&d.serial_bytes(), b"a-very-long-device-n");
    }

    fn write_config(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn file_and_flags_merge() {
        let f = write_config(
            r#"
            listen = "0.0.0.0:7700"
            [[device]]
            name = "disk0"
            path = "/dev/nvme0n1"
            read_only = false
            serial = "SN0"
            [[device]]
            name = "disk1"
            path = "/srv/disk1.img"
            "#,
        );
        let cli = Cli::parse_from([
            "x",
            "--config",
            f.path().to_str().unwrap(),
            "--listen",
            "127.0.0.1:9",
            "--device",
            "disk1=/other.img,ro",
            "--device",
            "disk2=/two.img",
        ]);
        let c = Config::from_cli(&cli).unwrap();
        assert_eq!(c.listen, "127.0.0.1:9");
        let names: Vec<_> = c.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["disk0", "disk1", "disk2"]);
        assert_eq!(c.devices[0].serial.as_deref(), Some("SN0"));
        assert_eq!(c.devices[1].path, PathBuf::from("/other.img"));
        assert!(c.devices[1].read_only);
    }

    #[test]
    fn the_shipped_example_config_parses_with_and_without_its_commented_pool() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../contrib/systemd/device-agent.toml.example");
        let text = std::fs::read_to_string(&path).unwrap();
        let f = Config::parse_file(&path, &text).unwrap();
        assert!(f.pool.is_none() && f.devices.len() == 2);
        // Uncomment the [pool] table (not auth_keys: the two modes exclude each other).
        let pool: String = text
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest)
                    if rest.starts_with("[pool]")
                        || ["url", "provider", "advertise", "heartbeat"]
                            .iter()
                            .any(|k| rest.starts_with(k)) =>
                {
                    rest.to_owned()
                }
                _ => l.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        let f = Config::parse_file(&path, &pool).unwrap();
        let p = f.pool.expect("the [pool] table");
        assert_eq!(p.url, "http://pool.example:7400");
        assert_eq!(p.advertise.as_deref(), Some("devsrv-01:7700"));
    }

    #[test]
    fn file_refuses_unknown_keys_naming_file_and_key() {
        let f = write_config(
            "listen = \"[::]:1\"\n[[device]]\nname = \"d\"\npath = \"/x\"\nreadonly = true\n",
        );
        let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
        let err = Config::from_cli(&cli).unwrap_err();
        let chain = format!("{:#}", anyhow::Error::from(err));
        assert!(chain.contains(&f.path().display().to_string()), "{chain}");
        assert!(chain.contains("readonly"), "{chain}");

        let f = write_config("listen = \"[::]:1\"\nport = 3\n");
        let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
        let chain = format!(
            "{:#}",
            anyhow::Error::from(Config::from_cli(&cli).unwrap_err())
        );
        assert!(chain.contains("port"), "{chain}");
    }

    #[test]
    fn tls_keys_come_from_file_or_flags_and_go_together() {
        let f = write_config(
            "listen = \"[::]:1\"\ntls_cert = \"/etc/l.crt\"\ntls_key = \"/etc/l.key\"\n[[device]]\nname = \"d\"\npath = \"/x\"\n",
        );
        let path = f.path().to_str().unwrap();
        let c = Config::from_cli(&Cli::parse_from(["x", "--config", path])).unwrap();
        assert_eq!(c.tls_cert, Some(PathBuf::from("/etc/l.crt")));
        assert_eq!(c.tls_key, Some(PathBuf::from("/etc/l.key")));
        assert!(
            c.to_toml().contains("tls_cert = \"/etc/l.crt\""),
            "{}",
            c.to_toml()
        );
        let c = Config::from_cli(&Cli::parse_from([
            "x",
            "--config",
            path,
            "--tls-client-ca",
            "/etc/ca.crt",
        ]))
        .unwrap();
        assert_eq!(c.tls_client_ca, Some(PathBuf::from("/etc/ca.crt")));
        // A key without its certificate, a client CA without a certificate: refused.
        let f = write_config(
            "listen = \"[::]:1\"\ntls_key = \"/etc/l.key\"\n[[device]]\nname = \"d\"\npath = \"/x\"\n",
        );
        let e = Config::from_cli(&Cli::parse_from([
            "x",
            "--config",
            f.path().to_str().unwrap(),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("tls_cert and tls_key go together"), "{e}");
        let e = Config::from_cli(&Cli::parse_from([
            "x",
            "--listen",
            "[::]:1",
            "--device",
            "d=/x",
            "--tls-client-ca",
            "/etc/ca.crt",
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("tls_client_ca needs tls_cert"), "{e}");
    }

    #[test]
    fn file_refuses_duplicates_and_long_serials() {
        let f = write_config(
            "listen = \"[::]:1\"\n[[device]]\nname = \"d\"\npath = \"/x\"\n[[device]]\nname = \"d\"\npath = \"/y\"\n",
        );
        let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
        let chain = format!(
            "{:#}",
            anyhow::Error::from(Config::from_cli(&cli).unwrap_err())
        );
        assert!(chain.contains("\"d\" is given more than once"), "{chain}");

        let f = write_config(
            "listen = \"[::]:1\"\n[[device]]\nname = \"d9\"\npath = \"/x\"\nserial = \"123456789012345678901\"\n",
        );
        let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
        let chain = format!(
            "{:#}",
            anyhow::Error::from(Config::from_cli(&cli).unwrap_err())
        );
        assert!(
            chain.contains("d9") && chain.contains("21 bytes"),
            "{chain}"
        );
    }

    #[test]
    fn flags_refuse_duplicates_and_need_listen_and_devices() {
        let cli = Cli::parse_from([
            "x", "--listen", "[::]:1", "--device", "a=/x", "--device", "a=/y",
        ]);
        assert!(matches!(Config::from_cli(&cli), Err(Error::DuplicateDevice(n)) if n == "a"));
        let cli = Cli::parse_from(["x", "--device", "a=/x"]);
        assert!(matches!(Config::from_cli(&cli), Err(Error::NoListen)));
        let cli = Cli::parse_from(["x", "--listen", "[::]:1"]);
        assert!(matches!(Config::from_cli(&cli), Err(Error::NoDevices)));
    }
}
