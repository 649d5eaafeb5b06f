//! The `--device` flag: `NAME=PATH[,ro][,serial=S][,traits=A+B][,store=S][,LIMIT=N]`,
//! `NAME=net:IFNAME[,mac=MAC][,LIMIT=N]`,
//! `NAME=pci:DDDD:BB:DD.F[,coherence=C][,store=S][,LIMIT=N]` or
//! `NAME=pci-pf:DDDD:BB:DD.F,vfs=N[,namespaces=1+2:3][,coherence=C][,LIMIT=N]` parsed into a
//! [`DeviceSpec`] of its kind.

use std::str::FromStr;

use devlend_fabric::qos::{Lane, Qos, LANES};
use devlend_fabric::units::parse_size;

use super::spec::{BlockSpec, Coherence, DeviceSpec, KindSpec, NetSpec, PciSpec, PfSpec};
use crate::Error;

/// The options of any kind, for the message naming one that does not apply to the
/// kind given.
const KNOWN_OPTIONS: [&str; 8] = [
    "ro",
    "serial",
    "traits",
    "store",
    "mac",
    "coherence",
    "vfs",
    "namespaces",
];

impl FromStr for DeviceSpec {
    type Err = Error;

    /// Parses `NAME=PATH[,ro][,serial=S]...`, `NAME=net:IFNAME[,mac=MAC]...` or
    /// `NAME=pci:BDF[,coherence=C]`: the backing says the kind, and each option must
    /// apply to it.
    ///
    /// # Errors
    /// [`Error::BadSpec`] for a malformed spec, [`Error::NotOfKind`] for an option of
    /// another kind, and those of [`DeviceSpec::validate`].
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |reason: String| Error::BadSpec {
            spec: s.to_owned(),
            reason,
        };
        let (name, rest) = s
            .split_once('=')
            .ok_or_else(|| bad("expected NAME=PATH[,OPTION...], NAME=net:INTERFACE[,OPTION...] or NAME=pci:DDDD:BB:DD.F[,OPTION...]".into()))?;
        let mut parts = rest.split(',');
        let backing = parts.next().unwrap_or_default();
        match backing {
            "" => return Err(bad("empty path".into())),
            "net:" => return Err(bad("empty interface name".into())),
            "pci:" | "pci-pf:" => return Err(bad("empty PCIe address".into())),
            _ => {}
        }
        let kind: KindSpec = if let Some(ifname) = backing.strip_prefix("net:") {
            NetSpec::new(ifname).into()
        } else if let Some(bdf) = backing.strip_prefix("pci:") {
            PciSpec::new(bdf).into()
        } else if let Some(bdf) = backing.strip_prefix("pci-pf:") {
            // vfs is required: 0 until the option sets it, which validate refuses.
            KindSpec::PciPf(PfSpec::new(bdf, 0))
        } else {
            BlockSpec::new(backing).into()
        };
        let mut spec = DeviceSpec::new(name, kind);
        let mut bursts = Vec::new();
        for opt in parts {
            if opt.is_empty() {
                return Err(bad("empty option".into()));
            }
            let (key, value) = opt.split_once('=').unwrap_or((opt, ""));
            if key == "traits" {
                spec.traits.extend(value.split('+').map(str::to_owned));
                continue;
            }
            let (kind, own) = (spec.kind.name(), flag_options(&spec.kind));
            let qos = match &mut spec.kind {
                KindSpec::Block(b) => match (key, opt) {
                    (_, "ro") => {
                        b.read_only = true;
                        continue;
                    }
                    ("serial", _) if opt.contains('=') => {
                        if b.serial.replace(value.to_owned()).is_some() {
                            return Err(bad("serial given twice".into()));
                        }
                        continue;
                    }
                    ("store", _) if opt.contains('=') => {
                        b.store = Some(value.to_owned());
                        continue;
                    }
                    _ => Some(&mut b.qos),
                },
                KindSpec::Net(n) => match key {
                    "mac" if opt.contains('=') => {
                        n.mac = Some(value.to_owned());
                        continue;
                    }
                    _ => Some(&mut n.qos),
                },
                KindSpec::Pci(p) => match key {
                    "coherence" => {
                        p.coherence = Some(coherence(value).map_err(bad)?);
                        continue;
                    }
                    "store" if opt.contains('=') => {
                        p.store = Some(value.to_owned());
                        continue;
                    }
                    _ => Some(&mut p.qos),
                },
                KindSpec::PciPf(p) => match key {
                    "coherence" => {
                        p.coherence = Some(coherence(value).map_err(bad)?);
                        continue;
                    }
                    "vfs" => {
                        p.vfs = value
                            .parse()
                            .map_err(|_| bad(format!("vfs={value:?} is not a number")))?;
                        continue;
                    }
                    "namespaces" => {
                        p.namespaces = namespace_lists(value).map_err(bad)?;
                        continue;
                    }
                    _ => Some(&mut p.qos),
                },
            };
            let not_of_kind = || Error::NotOfKind {
                device: name.to_owned(),
                field: key.to_owned(),
                kind,
            };
            if KNOWN_OPTIONS.contains(&key) && !own.contains(&key) {
                return Err(not_of_kind());
            }
            let limit = qos.and_then(|q| qos_option(q, &mut bursts, opt));
            match limit {
                Some(r) => r.map_err(bad)?,
                None => {
                    return Err(bad(format!(
                        "unknown option {opt:?} (expected ro, serial=S, traits=A+B, store=NAME, mac=MAC, coherence=nvme|mirror, vfs=N, namespaces=1+2:3, or a limit such as iops_read=N)"
                    )))
                }
            }
        }
        match &mut spec.kind {
            KindSpec::Block(BlockSpec { qos, .. })
            | KindSpec::Net(NetSpec { qos, .. })
            | KindSpec::Pci(PciSpec { qos, .. })
            | KindSpec::PciPf(PfSpec { qos, .. }) => {
                apply_bursts(qos, bursts).map_err(bad)?;
            }
        }
        spec.validate()?;
        Ok(spec)
    }
}

/// The flag options of a kind besides `traits` and the limits.
fn flag_options(kind: &KindSpec) -> &'static [&'static str] {
    match kind {
        KindSpec::Block(_) => &["ro", "serial", "store"],
        KindSpec::Net(_) => &["mac"],
        KindSpec::Pci(_) => &["coherence", "store"],
        KindSpec::PciPf(_) => &["coherence", "vfs", "namespaces"],
    }
}

/// A coherence option's value.
fn coherence(value: &str) -> Result<Coherence, String> {
    match value {
        "nvme" => Ok(Coherence::Nvme),
        "mirror" => Ok(Coherence::Mirror),
        _ => Err(format!(
            "unknown coherence {value:?} (expected nvme or mirror)"
        )),
    }
}

/// `namespaces=1+2:3`: VF 0 gets namespaces 1 and 2, VF 1 gets 3 (an empty entry,
/// as in `1::3`, gives that VF none).
fn namespace_lists(value: &str) -> Result<Vec<Vec<u32>>, String> {
    value
        .split(':')
        .map(|vf| {
            vf.split('+')
                .filter(|n| !n.is_empty())
                .map(|n| {
                    parse_nsid(n).ok_or_else(|| {
                        format!("namespaces: {n:?} is not a namespace ID (decimal, or hex with 0x)")
                    })
                })
                .collect()
        })
        .collect()
}

/// A namespace ID, decimal or `0x` hex.
fn parse_nsid(s: &str) -> Option<u32> {
    match s.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
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
/// `iops_read_burst=400`, `bps_read=50M`, `weight=3`, ...) to `q`; the number takes
/// the K, M, G, T suffixes of every size and rate ([`parse_size`]: powers of 1024, as
/// the CLI's `--qos`). `None` when `opt` is not one; an error for one whose number
/// does not parse.
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
    let n = match parse_size(value) {
        Ok(n) => n,
        Err(e) => return Some(Err(format!("{key}: {e}"))),
    };
    match (target, burst) {
        (None, _) => q.weight = Some(u32::try_from(n).unwrap_or(u32::MAX)),
        (Some(l), true) => bursts.push((l, n)),
        (Some(l), false) => *q = q.with(l, n, 0),
    }
    Some(Ok(()))
}
