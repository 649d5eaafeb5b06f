//! One device to lend, of one kind ([`KindSpec`]: a block device, a network interface
//! or a PCIe function), as the flag `--device NAME=...` (`spec_flag.rs`) or a
//! `[[device]]` table (`spec_file.rs`) gives it, and the checks of each kind.

use std::collections::HashSet;
use std::path::PathBuf;

use devlend_fabric::handshake::MAX_NAME_LEN;
use devlend_fabric::qos::{Lane, Qos, LANES};
use serde::{Deserialize, Serialize};

use crate::{Error, MAX_SERIAL_LEN};

/// One device to lend: what every kind has (its name, its traits) and its kind.
///
/// As a flag: `NAME=PATH[,ro][,serial=S][,traits=A+B]`, `NAME=net:IFNAME[,mac=MAC]` or
/// `NAME=pci:DDDD:BB:DD.F[,coherence=C]`. In the config file: a `[[device]]` table with
/// `name`, an optional `kind` (`block`, `net` or `pci`; when absent, the key that names
/// the backing, `path`, `net` or `pci`, says it) and the kind's own keys
/// (`docs/configuration.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceSpec {
    /// The name borrowers ask for in their hello (1 to 255 bytes of UTF-8).
    pub name: String,
    /// Extra traits to register with the pool (upper-case `[A-Z0-9_]+`, e.g. `NUMA_0`,
    /// `SSD`), besides those the lender derives (`FABRIC_TCP`, `DISCARD`, `READ_ONLY`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub traits: Vec<String>,
    /// The kind of device and its own settings.
    #[serde(flatten)]
    pub kind: KindSpec,
}

/// The kind of a lent device, each with its own settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum KindSpec {
    /// A regular file or a block device, lent as a virtio-blk disk.
    Block(BlockSpec),
    /// A network interface, lent as a virtio-net NIC (frames through AF_PACKET).
    Net(NetSpec),
    /// A PCIe function bound to `vfio-pci`, lent as a vfio-user device.
    Pci(PciSpec),
    /// An SR-IOV physical function whose virtual functions are lent, each as a
    /// [`KindSpec::Pci`] of its own (`crate::pci::sriov` turns it into those at start);
    /// the physical function itself is the lender's, never lent.
    #[serde(rename = "pci-pf")]
    PciPf(PfSpec),
}

/// A block device or a regular file to lend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockSpec {
    /// The regular file or block device (flag: `NAME=PATH`, no comma in it).
    pub path: PathBuf,
    /// Open the path read-only and answer writes, discards and write-zeroes with an I/O
    /// error (flag option `ro`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// The virtio-blk serial (GET_ID), 1 to 20 bytes without NUL; when absent, the
    /// device name truncated to 20 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// Limits on whoever borrows it, the `iops_*`/`bps_*` lanes and `weight` (file: a
    /// `[device.qos]` table; flag: `iops_read=N`, ... as options), enforced together with
    /// the lease's, the tighter of each (`docs/qos.md`).
    #[serde(default, skip_serializing_if = "Qos::is_empty")]
    pub qos: Qos,
    /// The backing store it shares with other devices (a `[[store]]` name): its
    /// borrowers divide the store's capacity by weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
}

/// A network interface to lend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetSpec {
    /// The Linux interface name, 1 to 15 bytes (flag: `NAME=net:IFNAME`; file key `net`
    /// or `interface`).
    #[serde(rename = "net", alias = "interface")]
    pub interface: String,
    /// The MAC address the borrower's guest should use (`aa:bb:cc:dd:ee:ff`, unicast);
    /// default the interface's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Limits on whoever borrows it, the `tx_*`/`rx_*` lanes and `weight`
    /// (`docs/qos.md`).
    #[serde(default, skip_serializing_if = "Qos::is_empty")]
    pub qos: Qos,
}

/// A PCIe function to lend; it must be bound to `vfio-pci`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciSpec {
    /// Its address `DDDD:BB:DD.F`, e.g. `0000:00:03.0` (flag: `NAME=pci:BDF`; file key
    /// `pci` or `bdf`).
    #[serde(rename = "pci", alias = "bdf")]
    pub bdf: String,
    /// How the function's DMA is kept coherent with guest memory (flag option
    /// `coherence=nvme|mirror`). Default: `nvme` for an NVMe controller (class code
    /// 01:08:02), `mirror` for any other function.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coherence: Option<Coherence>,
    /// Limits on whoever borrows it, the `iops_*`/`bps_*` lanes and `weight`, as a block
    /// device's (`docs/qos.md`): the NVMe mediator holds commands back in the guest's
    /// submission queues, so they apply in coherence mode `nvme` only.
    #[serde(default, skip_serializing_if = "Qos::is_empty")]
    pub qos: Qos,
    /// The store its borrowers share (a `[[store]]` name), as a block device's; a VF
    /// of a PF with limits has its PF's (`pf:NAME`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
}

/// An SR-IOV physical function (PF) and the virtual functions (VFs) to enable on it,
/// lent as `NAME-vf0`, `NAME-vf1`, ... (`docs/pci.md`, "SR-IOV").
///
/// Flag: `NAME=pci-pf:DDDD:BB:DD.F,vfs=N[,namespaces=1+2:3][,coherence=C]`. File:
/// `pf = "DDDD:BB:DD.F"`, `vfs = N`, `namespaces = [[1, 2], [3]]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PfSpec {
    /// The PF's address; it stays bound to its own driver (`nvme`, `igb`, ...), which
    /// enables the VFs.
    #[serde(rename = "pf")]
    pub bdf: String,
    /// How many VFs to enable and lend: 1 up to the PF's `sriov_totalvfs`.
    pub vfs: u16,
    /// For an NVMe PF: the namespace IDs to attach to each VF's controller, in VF order
    /// (entry 0 for VF 0); a VF past the list gets none attached by the lender (flag:
    /// `+` between a VF's IDs, `:` between VFs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<Vec<u32>>,
    /// The VFs' coherence mode, as [`PciSpec::coherence`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coherence: Option<Coherence>,
    /// The PF's limits (`iops_*`/`bps_*`, no weight): what all its VFs' borrowers
    /// together may do, divided among those busy by their leases' weights, as a
    /// store's capacity (the store `pf:NAME`, `docs/qos.md`). Each VF's own lease
    /// limits apply on top.
    #[serde(default, skip_serializing_if = "Qos::is_empty")]
    pub qos: Qos,
}

/// The most VFs a PF spec may ask for (PCIe SR-IOV's NumVFs is 16 bits; real devices
/// offer at most a few hundred).
pub const MAX_VFS: u16 = 256;

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

impl From<BlockSpec> for KindSpec {
    fn from(b: BlockSpec) -> KindSpec {
        KindSpec::Block(b)
    }
}

impl From<NetSpec> for KindSpec {
    fn from(n: NetSpec) -> KindSpec {
        KindSpec::Net(n)
    }
}

impl From<PciSpec> for KindSpec {
    fn from(p: PciSpec) -> KindSpec {
        KindSpec::Pci(p)
    }
}

impl BlockSpec {
    /// A writable file or block device at `path`, with no serial, limits or store.
    pub fn new(path: impl Into<PathBuf>) -> BlockSpec {
        BlockSpec {
            path: path.into(),
            read_only: false,
            serial: None,
            qos: Qos::default(),
            store: None,
        }
    }
}

impl NetSpec {
    /// The interface `interface`, with its own MAC and no limits.
    pub fn new(interface: impl Into<String>) -> NetSpec {
        NetSpec {
            interface: interface.into(),
            mac: None,
            qos: Qos::default(),
        }
    }
}

impl PciSpec {
    /// The function at `bdf`, with the default coherence.
    pub fn new(bdf: impl Into<String>) -> PciSpec {
        PciSpec {
            bdf: bdf.into(),
            coherence: None,
            qos: Qos::default(),
            store: None,
        }
    }
}

impl PfSpec {
    /// The PF at `bdf` with `vfs` VFs, no namespaces named, the default coherence.
    pub fn new(bdf: impl Into<String>, vfs: u16) -> PfSpec {
        PfSpec {
            bdf: bdf.into(),
            vfs,
            namespaces: Vec::new(),
            coherence: None,
            qos: Qos::default(),
        }
    }

    /// Checks the address, the number of VFs and the namespace lists.
    fn validate(&self, name: &str) -> Result<(), Error> {
        if !valid_bdf(&self.bdf) {
            return Err(Error::BadBdf {
                name: name.to_owned(),
                bdf: self.bdf.clone(),
            });
        }
        let bad = |reason: String| {
            Err(Error::BadSpec {
                spec: name.to_owned(),
                reason,
            })
        };
        if self.vfs == 0 || self.vfs > MAX_VFS {
            return bad(format!(
                "vfs = {}: a PF lends 1 to {MAX_VFS} VFs (lend a function without VFs as pci:BDF)",
                self.vfs
            ));
        }
        if self.namespaces.len() > usize::from(self.vfs) {
            return bad(format!(
                "namespaces for {} VFs, but vfs = {}",
                self.namespaces.len(),
                self.vfs
            ));
        }
        if let Some(list) = self.namespaces.iter().find(|l| l.len() > 1024) {
            return bad(format!(
                "{} namespaces for one VF: at most 1024",
                list.len()
            ));
        }
        if self
            .namespaces
            .iter()
            .flatten()
            .any(|&n| n == 0 || n == u32::MAX)
        {
            return bad("namespace ID 0 or FFFFFFFFh: IDs are 1 to FFFFFFFEh".into());
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(n) = self.namespaces.iter().flatten().find(|&&n| !seen.insert(n)) {
            return bad(format!(
                "namespace {n} is named twice: a namespace is attached to one VF's controller only (two VMs sharing a namespace would see each other's data)"
            ));
        }
        if self.qos.weight.is_some() {
            return bad("a PF's limits bound its VFs together: weights are the VFs' borrowers' (their leases')".into());
        }
        check_lanes(name, &self.qos, "pci-pf")
    }
}

impl KindSpec {
    /// The kind's name as the config file spells it: `block`, `net` or `pci`.
    pub fn name(&self) -> &'static str {
        match self {
            KindSpec::Block(_) => "block",
            KindSpec::Net(_) => "net",
            KindSpec::Pci(_) => "pci",
            KindSpec::PciPf(_) => "pci-pf",
        }
    }
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
    /// A device named `name` of the given kind, with no extra traits.
    pub fn new(name: impl Into<String>, kind: impl Into<KindSpec>) -> DeviceSpec {
        DeviceSpec {
            name: name.into(),
            traits: Vec::new(),
            kind: kind.into(),
        }
    }

    /// A writable file or block device `path` named `name` ([`BlockSpec::new`]).
    pub fn block(name: impl Into<String>, path: impl Into<PathBuf>) -> DeviceSpec {
        DeviceSpec::new(name, BlockSpec::new(path))
    }

    /// The limits configured for the device (a PF's are its VFs' store's capacity,
    /// not a device's: none here).
    pub fn qos(&self) -> Qos {
        match &self.kind {
            KindSpec::Block(b) => b.qos,
            KindSpec::Net(n) => n.qos,
            KindSpec::Pci(p) => p.qos,
            KindSpec::PciPf(_) => Qos::default(),
        }
    }

    /// The backing store the device shares, if configured (block devices and PCIe
    /// functions).
    pub fn store(&self) -> Option<&str> {
        match &self.kind {
            KindSpec::Block(b) => b.store.as_deref(),
            KindSpec::Pci(p) => p.store.as_deref(),
            KindSpec::Net(_) | KindSpec::PciPf(_) => None,
        }
    }

    /// Checks the name, the traits and the kind's own settings.
    ///
    /// # Errors
    /// [`Error::BadName`] for an empty name or one longer than 255 bytes, or a bad
    /// interface name or MAC; [`Error::SerialTooLong`] for a serial longer than
    /// [`MAX_SERIAL_LEN`] bytes; [`Error::BadSerial`] for an empty serial or one holding
    /// a NUL byte; [`Error::BadBdf`]; [`Error::BadSpec`] for limits that do not apply to
    /// the kind; [`Error::BadTrait`].
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
        match &self.kind {
            KindSpec::Block(b) => b.validate(&self.name)?,
            KindSpec::Net(n) => n.validate(&self.name)?,
            KindSpec::Pci(p) => {
                if !valid_bdf(&p.bdf) {
                    return Err(Error::BadBdf {
                        name: self.name.clone(),
                        bdf: p.bdf.clone(),
                    });
                }
                if p.coherence == Some(Coherence::Mirror)
                    && (!p.qos.limits.iter().all(Option::is_none) || p.store.is_some())
                {
                    return Err(Error::BadSpec {
                        spec: self.name.clone(),
                        reason: "limits and stores apply to a function in coherence nvme only (the lender sees no command of a mirrored function)".into(),
                    });
                }
                check_lanes(&self.name, &p.qos, "pci")?;
            }
            KindSpec::PciPf(p) => p.validate(&self.name)?,
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
}

impl BlockSpec {
    /// Checks the serial and that the limits are block lanes.
    fn validate(&self, name: &str) -> Result<(), Error> {
        if let Some(serial) = &self.serial {
            let bad = |reason| {
                Err(Error::BadSerial {
                    device: name.to_owned(),
                    serial: serial.clone(),
                    reason,
                })
            };
            if serial.len() > MAX_SERIAL_LEN {
                return Err(Error::SerialTooLong {
                    device: name.to_owned(),
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
        check_lanes(name, &self.qos, "block")
    }

    /// The serial as sent in the handshake: the given serial, else the device's `name`
    /// truncated to 20 bytes, NUL-padded to 20 bytes.
    pub fn serial_bytes(&self, name: &str) -> [u8; MAX_SERIAL_LEN] {
        let src = self.serial.as_deref().unwrap_or(name).as_bytes();
        let n = src.len().min(MAX_SERIAL_LEN);
        let mut out = [0u8; MAX_SERIAL_LEN];
        out[..n].copy_from_slice(&src[..n]);
        out
    }
}

impl NetSpec {
    /// Checks the interface name, the MAC and that the limits are NIC lanes.
    fn validate(&self, name: &str) -> Result<(), Error> {
        // The device's name is fine; its interface or MAC is not.
        let bad_name = |reason: &str| {
            Err(Error::BadSpec {
                spec: name.to_owned(),
                reason: reason.to_owned(),
            })
        };
        let ifname = &self.interface;
        if ifname.is_empty() || ifname.len() > 15 || ifname.contains(['/', '\0', ' ']) {
            return bad_name("the interface name is not a valid Linux interface name");
        }
        if let Some(mac) = &self.mac {
            match parse_mac(mac) {
                Some(m) if m[0] & 1 == 0 && m != [0; 6] => {}
                _ => return bad_name("mac is not a unicast aa:bb:cc:dd:ee:ff address"),
            }
        }
        check_lanes(name, &self.qos, "net")
    }
}

/// Checks `qos` on its own, and that its lanes are NIC lanes (kind `net`) or block
/// lanes (any other kind).
fn check_lanes(name: &str, qos: &Qos, kind: &'static str) -> Result<(), Error> {
    let net = kind == "net";
    qos.validate().map_err(|e| Error::BadSpec {
        spec: name.to_owned(),
        reason: e.to_string(),
    })?;
    let net_lane = |l: Lane| l >= Lane::TxPps;
    if let Some((lane, _)) = LANES
        .iter()
        .find(|(l, _)| qos.get(*l).is_some() && net_lane(*l) != net)
    {
        return Err(Error::NotOfKind {
            device: name.to_owned(),
            field: lane.name().to_owned(),
            kind,
        });
    }
    Ok(())
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
        if let KindSpec::Net(n) = &d.kind {
            let ifname = n.interface.as_str();
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

#[cfg(test)]
#[path = "spec_tests.rs"]
mod tests;
