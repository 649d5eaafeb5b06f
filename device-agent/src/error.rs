//! Errors of starting a lender: configuration, opening devices, binding the listener.
//!
//! Nothing a peer sends ends up here: a bad request fails that request or closes that
//! session, and is logged.

use std::io;
use std::path::PathBuf;

/// Why a lender could not be configured or started.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The RDMA transport cannot be used (not compiled in, no device, no rdma_cm, ...).
    #[error("--transport rdma")]
    Rdma(#[source] devlend_fabric::rdma::RdmaError),
    /// A `NAME=PATH[,ro][,serial=S]` device spec could not be parsed.
    #[error("invalid device spec {spec:?}: {reason}")]
    BadSpec {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A `--device` option of another kind (`ro` on a network interface, `mac` on a
    /// file, a limit on a PCIe function, ...).
    #[error("device `{device}`: `{field}` does not apply to kind `{kind}`")]
    NotOfKind {
        /// The device name.
        device: String,
        /// The option as given (`ro`, `serial`, `mac`, `iops_read`, ...).
        field: String,
        /// The device's kind: `block`, `net` or `pci`.
        kind: &'static str,
    },
    /// A device's PCIe address is not `DDDD:BB:DD.F`.
    #[error("device `{name}`: PCIe address {bdf:?} is not DDDD:BB:DD.F (hex, with the domain{})", bdf_hint(.bdf))]
    BadBdf {
        /// The device name.
        name: String,
        /// The address as given.
        bdf: String,
    },
    /// A device name is empty or longer than the protocol allows.
    #[error("invalid device name {name:?}: {reason}")]
    BadName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A serial is longer than [`crate::MAX_SERIAL_LEN`] bytes.
    #[error("serial {serial:?} of device {device:?} is {len} bytes long; at most {max} bytes are allowed", max = crate::MAX_SERIAL_LEN)]
    SerialTooLong {
        /// The device it was given for.
        device: String,
        /// The serial.
        serial: String,
        /// Its length in bytes.
        len: usize,
    },
    /// A serial is empty or holds a NUL byte.
    #[error("invalid serial {serial:?} of device {device:?}: {reason}")]
    BadSerial {
        /// The device it was given for.
        device: String,
        /// The serial.
        serial: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Two devices have the same name (within the config file, or within the flags).
    #[error("device {0:?} is given more than once")]
    DuplicateDevice(String),
    /// Two devices lend the same network interface (a NIC goes to one borrower at a
    /// time: two names would split its frames between two guests).
    #[error("devices {first:?} and {second:?} both lend network interface {interface:?}")]
    SharedInterface {
        /// The interface.
        interface: String,
        /// The first device naming it.
        first: String,
        /// The second.
        second: String,
    },
    /// The backing file or block device could not be opened.
    #[error("cannot open {} for device {device:?}", path.display())]
    Open {
        /// The device.
        device: String,
        /// Its path.
        path: PathBuf,
        /// The open error.
        #[source]
        source: io::Error,
    },
    /// The size (or logical block size) of the backing file or device could not be read.
    #[error("cannot read the size of {} (device {device:?})", path.display())]
    Size {
        /// The device.
        device: String,
        /// Its path.
        path: PathBuf,
        /// The `fstat` or ioctl error.
        #[source]
        source: io::Error,
    },
    /// The path is neither a regular file nor a block device.
    #[error("{} (device {device:?}) is neither a regular file nor a block device", path.display())]
    NotBlock {
        /// The device.
        device: String,
        /// Its path.
        path: PathBuf,
    },
    /// The backing file or device holds less than one 512-byte sector.
    #[error("{} (device {device:?}) is {bytes} bytes: smaller than one 512-byte sector", path.display())]
    TooSmall {
        /// The device.
        device: String,
        /// Its path.
        path: PathBuf,
        /// Its size in bytes.
        bytes: u64,
    },
    /// The configuration file could not be read.
    #[error("cannot read config file {}", path.display())]
    ConfigRead {
        /// The file.
        path: PathBuf,
        /// The read error.
        #[source]
        source: io::Error,
    },
    /// The configuration file is not valid TOML or holds an unknown or ill-typed key.
    #[error("invalid config file {}", path.display())]
    ConfigParse {
        /// The file.
        path: PathBuf,
        /// The parser's error, naming the key, line and column.
        #[source]
        source: toml::de::Error,
    },
    /// A device in the configuration file is invalid.
    #[error("config file {}", path.display())]
    ConfigDevice {
        /// The file.
        path: PathBuf,
        /// What is wrong with the device.
        #[source]
        source: Box<Error>,
    },
    /// `max_sessions` in the config file out of range.
    #[error("max_sessions {0} is out of range: from 1 to {max}", max = crate::config::MAX_SESSIONS_LIMIT)]
    BadMaxSessions(u32),
    /// `poll_us` in the config file above its limit.
    #[error("poll_us {0} is out of range: from 0 to {max}", max = crate::config::MAX_POLL_US)]
    BadPollUs(u32),
    /// Neither `--listen` nor `listen` in the config file was given.
    #[error("no listen address: give --listen ADDR:PORT or `listen` in the config file")]
    NoListen,
    /// No device was given.
    #[error("no device to lend: give --device NAME=PATH or [[device]] in the config file")]
    NoDevices,
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address as given.
        addr: String,
        /// The socket error.
        #[source]
        source: io::Error,
    },
    /// The accept loop failed in a way it cannot recover from.
    #[error("accepting connections failed")]
    Accept(#[source] io::Error),
    /// A device trait is not upper-case `[A-Z0-9_]+`.
    #[error("device {device}: trait {name:?} must be upper-case letters, digits and _")]
    BadTrait {
        /// The device.
        device: String,
        /// The trait as given.
        name: String,
    },
    /// The pool settings are inconsistent.
    #[error("pool settings: {0}")]
    BadPool(String),
    /// An `--auth-key` (or `auth_keys` entry) is not a public key.
    #[error("auth key {key:?}: {reason}")]
    BadAuthKey {
        /// The key as given.
        key: String,
        /// Why it is not one.
        reason: String,
    },
    /// No borrower would be authenticated (no pool, no auth keys, no required client
    /// certificates) on an address that other hosts can reach, and `--insecure` was not
    /// given.
    #[error(
        "refusing to lend without authentication on {addr}, which is not a loopback address: \
         any host that reaches it could open the devices. Authenticate borrowers with a key \
         (`devlend keygen --out FILE` prints the public key for --auth-key; the compute agent \
         signs with --auth-key-file FILE), or register with a device pool (--pool URL), or \
         require TLS client certificates (--tls-client-ca); or, on a lab network you trust, \
         pass --insecure (`insecure = true` in the config file)"
    )]
    Unauthenticated {
        /// The listen address as given.
        addr: String,
    },
    /// The TLS settings are inconsistent (e.g. a certificate without its key).
    #[error("TLS settings: {0}")]
    BadTls(String),
    /// The TLS certificate, key or client CA could not be loaded.
    #[error("TLS")]
    Tls(#[source] devlend_fabric::tls::TlsConfigError),
    /// The pool could not be used at start.
    #[error("device pool at {url}: {reason}")]
    Pool {
        /// The pool's URL.
        url: String,
        /// What failed.
        reason: String,
    },
    /// This lender's key (`key_file`) cannot be read or made.
    #[error("the lender's key")]
    PoolKey(#[source] devlend_fabric::identity::IdentityError),
    /// The previous key of a rotation (`previous_key_file`) cannot be read.
    #[error("the lender's previous key (--previous-key-file)")]
    PreviousKey(#[source] devlend_fabric::identity::IdentityError),
    /// A PCIe function could not be opened through VFIO.
    #[error("cannot lend PCIe function {bdf} as device {device:?}")]
    Pci {
        /// The device.
        device: String,
        /// The function's address.
        bdf: String,
        /// Why.
        #[source]
        source: crate::pci::PciError,
    },
    /// An SR-IOV PF's virtual functions could not be made ready.
    #[error("cannot lend the VFs of PCIe function {bdf} (device {device:?})")]
    Sriov {
        /// The PF's device.
        device: String,
        /// The PF's address.
        bdf: String,
        /// Why.
        #[source]
        source: crate::pci::sriov::SriovError,
    },
    /// A thread could not be started.
    #[error("cannot start a thread")]
    Thread(#[source] io::Error),
}

/// For an address without its domain (`BB:DD.F`), the same with domain 0000; else
/// nothing.
fn bdf_hint(bdf: &str) -> String {
    let with_domain = format!("0000:{bdf}");
    if crate::config::valid_bdf(&with_domain) {
        format!(": {with_domain}")
    } else {
        String::new()
    }
}
