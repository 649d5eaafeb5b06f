//! One device to lend, as the flag `NAME=PATH[,ro][,serial=S][,traits=A+B]` (or
//! `NAME=net:IFNAME[,mac=MAC]`, `NAME=pci:DDDD:BB:DD.F[,coherence=C]`) or a `[[device]]`
//! table gives it, and its checks.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use devlend_fabric::handshake::MAX_NAME_LEN;
use devlend_fabric::qos::{Lane, Qos, LANES};
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
    /// Limits on whoever borrows it (file: a `[device.qos]` table; flag:
    /// `iops_read=N`, `bps_write=N`, `weight=N`, ... as options), enforced together
    /// with the lease's, the tighter of each (`docs/qos.md`). Block devices take the
    /// `iops_*`/`bps_*` limits, interfaces the `tx_*`/`rx_*` ones.
    #[serde(default, skip_serializing_if = "Qos::is_empty")]
    pub qos: Qos,
    /// The backing store it shares with other devices (a `[[store]]` name): its
    /// borrowers divide the store's capacity by weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
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
            if !self.qos.is_empty() || self.store.is_some() {
                return bad_name("limits and stores do not apply to a PCIe function");
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
        self.qos.validate().map_err(|e| Error::BadSpec {
            spec: self.name.clone(),
            reason: e.to_string(),
        })?;
        let net_lane = |l: Lane| l >= Lane::TxPps;
        if let Some((lane, _)) = LANES
            .iter()
            .find(|(l, _)| self.qos.get(*l).is_some() && net_lane(*l) != self.is_net())
        {
            return Err(Error::BadSpec {
                spec: self.name.clone(),
                reason: format!(
                    "limit {} does not apply to a {}",
                    lane.name(),
                    if self.is_net() {
                        "network interface"
                    } else {
                        "block device"
                    }
                ),
            });
        }
        if self.store.is_some() && self.is_net() {
            return bad_name("a network interface has no backing store");
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
            qos: Qos::default(),
            store: None,
        };
        let mut bursts = Vec::new();
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
                _ if opt.starts_with("store=") => {
                    spec.store = Some(opt["store=".len()..].to_owned());
                }
                "" => return Err(bad("empty option".into())),
                _ => match qos_option(&mut spec.qos, &mut bursts, opt) {
                    Some(r) => r.map_err(bad)?,
                    None => {
                        return Err(bad(format!(
                            "unknown option {opt:?} (expected ro, serial=S, traits=A+B, store=NAME, coherence=nvme|mirror, or a limit such as iops_read=N)"
                        )))
                    }
                },
            }
        }
        apply_bursts(&mut spec.qos, bursts).map_err(bad)?;
        spec.validate()?;
        Ok(spec)
    }
}

/// Sets the bucket sizes of `bursts` (from [`qos_option`]) on their lanes, after all
/// the options were read, and checks the result.
///
/// # Errors
/// A burst whose lane has no rate, a rate of 0, a weight out of range.
pub(super) fn apply_bursts(q: &mut Qos, bursts: Vec<(Lane, u64)>) -> Result<(), String> {
    for (lane, n) in bursts {
        match q.limits[lane.index()].as_mut() {
            Some(l) => l.burst = n,
            None => return Err(format!("{}_burst without {}", lane.name(), lane.name())),
        }
    }
    q.validate().map_err(|e| e.to_string())
}

/// Applies a limit option `KEY=N` of a device flag (`iops_read=2000`,
/// `iops_read_burst=400`, `weight=3`, ...) to `q`. `None` when `opt` is not one; an
/// error for one whose number does not parse.
pub(super) fn qos_option(
    q: &mut Qos,
    bursts: &mut Vec<(Lane, u64)>,
    opt: &str,
) -> Option<Result<(), String>> {
    let (key, value) = opt.split_once('=')?;
    let lane = |name: &str| LANES.iter().find(|(_, n)| *n == name).map(|(l, _)| *l);
    let (target, burst) = match (key, key.strip_suffix("_burst")) {
        ("weight", _) => (None, false),
        (_, Some(base)) => (Some(lane(base)?), true),
        (k, None) => (Some(lane(k)?), false),
    };
    let Ok(n) = value.parse::<u64>() else {
        return Some(Err(format!("{key}: {value:?} is not a whole number")));
    };
    match (target, burst) {
        (None, _) => q.weight = Some(u32::try_from(n).unwrap_or(u32::MAX)),
        (Some(l), true) => bursts.push((l, n)),
        (Some(l), false) => *q = q.with(l, n, 0),
    }
    Some(Ok(()))
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
