//! SR-IOV: a physical function (PF) that the lender keeps, and its virtual functions
//! (VFs), each lent as a PCIe function of its own (`docs/pci.md`, "SR-IOV").
//!
//! `expand` turns each [`KindSpec::PciPf`] of a device list into one
//! [`KindSpec::Pci`] per VF, named `NAME-vfI`, after making the VFs exist: it enables
//! them on the PF (`sriov_numvfs`, with automatic driver probing off), for an NVMe PF
//! gives each VF's secondary controller its queue and interrupt resources, brings it
//! online and attaches the namespaces the spec names (`nvme_admin`), and binds each VF
//! to vfio-pci. It is idempotent: a lender restart finds the VFs as it left them and
//! lends them under the same names. At a reload (`Mode::Reload`) the number of VFs
//! cannot change: the VFs are open, perhaps lent.

pub(crate) mod nvme_admin;
pub(crate) mod sysfs;

use std::io;
use std::path::PathBuf;
use std::time::Instant;

use self::nvme_admin::{
    Admin, AdminCommand, AdminError, CharDev, PrimaryCaps, Resource, Secondary,
    ACT_PRIMARY_FLEXIBLE, ACT_SECONDARY_ASSIGN, ACT_SECONDARY_ONLINE, STATUS_NS_ALREADY_ATTACHED,
};
use self::sysfs::Sysfs;
use crate::config::{Coherence, DeviceSpec, KindSpec, PciSpec, PfSpec, StoreSpec};
use crate::Error;

/// The trait every VF's pool item carries.
pub const TRAIT_SRIOV_VF: &str = "SRIOV_VF";

/// The class code of an NVMe controller, as sysfs spells it.
const CLASS_NVME: u32 = 0x01_08_02;

/// Why a PF's VFs could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum SriovError {
    /// The PF does not exist.
    #[error("no PCI function at {0}")]
    NoFunction(PathBuf),
    /// The function has no SR-IOV capability.
    #[error("the function has no SR-IOV capability (no sriov_totalvfs); lend it whole as pci:BDF")]
    NoSriov,
    /// More VFs asked for than the PF has.
    #[error("{asked} VFs asked for, but the PF offers at most {total} (sriov_totalvfs)")]
    TooManyVfs {
        /// Asked for.
        asked: u16,
        /// `sriov_totalvfs`.
        total: u16,
    },
    /// The PF is bound to no driver, or to vfio-pci: its own driver enables the VFs.
    #[error("the PF is bound to {driver}; it must stay on its own driver (nvme, igb, ...), which enables the VFs: echo BDF > /sys/bus/pci/drivers/DRIVER/bind")]
    PfDriver {
        /// Its driver, or "no driver".
        driver: String,
    },
    /// Limits on a PF whose VFs are lent through the generic mirror.
    #[error("limits on a PF whose VFs are lent in coherence mirror, where the lender sees none of their DMA and cannot enforce them: remove the limits (only NVMe VFs, through the mediator, take limits)")]
    LimitsOnMirror,
    /// At a reload, the PF has a different number of VFs than the spec asks.
    #[error("the PF has {current} VFs and the configuration now asks for {asked}; the VFs are open (perhaps lent), so the number changes only at a lender restart")]
    VfsChanged {
        /// Enabled now.
        current: u16,
        /// Asked for.
        asked: u16,
    },
    /// A sysfs attribute could not be read or written.
    #[error("{path}")]
    Sysfs {
        /// The attribute.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A VF did not bind to vfio-pci.
    #[error(
        "VF {vf} did not bind to vfio-pci (bound to {driver}; is the vfio-pci module loaded?)"
    )]
    NotBound {
        /// The VF.
        vf: String,
        /// Its driver, or "none".
        driver: String,
    },
    /// The NVMe PF's character device could not be opened.
    #[error("opening {path} (the PF's NVMe admin queue)")]
    CharDev {
        /// `/dev/nvmeN`.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An NVMe admin command failed.
    #[error("NVMe {what}")]
    Admin {
        /// What it was for.
        what: String,
        /// How it failed.
        #[source]
        source: AdminError,
    },
    /// The PF's flexible resources cannot give each VF an admin queue, an I/O queue
    /// and an interrupt.
    #[error("the PF's flexible resources ({queues} queues, {interrupts} interrupts; at most {queue_max} and {interrupt_max} per VF) cannot give {vfs} VFs 2 queues and 1 interrupt each")]
    Resources {
        /// VFs asked for.
        vfs: u16,
        /// VQFRT.
        queues: u32,
        /// VIFRT.
        interrupts: u32,
        /// VQFRSM.
        queue_max: u16,
        /// VIFRSM.
        interrupt_max: u16,
    },
    /// A VF's secondary controller went offline while the lender readied the VFs.
    #[error("the secondary controller of VF {0} went offline (was the PF's controller reset meanwhile?); restart the lender")]
    Offline(u16),
    /// The NVMe PF lists no secondary controller for a VF.
    #[error("the NVMe PF lists no secondary controller for VF {0}")]
    NoSecondary(u16),
}

/// Whether the VFs may be enabled or their number changed ([`Mode::Start`]), or must be
/// as they are ([`Mode::Reload`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// At lender start: nothing is open.
    Start,
    /// At a reload: the VFs are open, perhaps lent.
    Reload,
}

/// How the lender reaches a PF's admin queue: the kernel's `/dev/nvmeN`, or a fake.
pub(crate) type AdminOpener<'a> = &'a dyn Fn(&Sysfs, &str) -> Result<Box<dyn Admin>, SriovError>;

/// Opens the NVMe PF's admin queue through its kernel driver.
pub(crate) fn kernel_admin(sysfs: &Sysfs, pf: &str) -> Result<Box<dyn Admin>, SriovError> {
    let path = sysfs.nvme_char_dev(pf)?;
    CharDev::open(&path)
        .map(|d| Box::new(d) as Box<dyn Admin>)
        .map_err(|source| SriovError::CharDev { path, source })
}

/// The device list with each PF spec replaced by its VFs' specs, the VFs made ready
/// (module doc). The PF is never lent: a `pci:` spec naming a PF or one of its VFs is
/// refused.
///
/// # Errors
/// [`Error::Sriov`] naming the PF's device; [`Error::BadSpec`] for a PF or VF also
/// given as `pci:`, or a PF spec that [`DeviceSpec::validate`] refuses.
pub(crate) fn expand(
    specs: &[DeviceSpec],
    mode: Mode,
    sysfs: &Sysfs,
    admin: AdminOpener<'_>,
) -> Result<Vec<DeviceSpec>, Error> {
    let mut out = Vec::with_capacity(specs.len());
    let mut pfs = Vec::new();
    for spec in specs {
        let KindSpec::PciPf(pf) = &spec.kind else {
            out.push(spec.clone());
            continue;
        };
        // A spec built in code, not parsed, may not have been checked (vfs = 0).
        spec.validate()?;
        let err = |source| Error::Sriov {
            device: spec.name.clone(),
            bdf: pf.bdf.clone(),
            source,
        };
        let vfs = prepare(pf, mode, sysfs, admin).map_err(err)?;
        let mut traits = spec.traits.clone();
        traits.push(TRAIT_SRIOV_VF.to_owned());
        traits.push(pf_trait(&spec.name));
        traits.sort();
        traits.dedup();
        for (i, bdf) in vfs.iter().enumerate() {
            out.push(DeviceSpec {
                name: format!("{}-vf{i}", spec.name),
                traits: traits.clone(),
                kind: KindSpec::Pci(PciSpec {
                    bdf: bdf.clone(),
                    coherence: pf.coherence,
                    qos: Default::default(),
                    store: pf_store(spec).map(|s| s.name),
                }),
            });
        }
        pfs.push((spec.name.clone(), pf.bdf.clone(), vfs));
    }
    for s in &out {
        let KindSpec::Pci(p) = &s.kind else { continue };
        if s.traits.iter().any(|t| t == TRAIT_SRIOV_VF) {
            continue;
        }
        if let Some((pf_name, pf_bdf, _)) = pfs
            .iter()
            .find(|(_, pf, vfs)| *pf == p.bdf || vfs.contains(&p.bdf))
        {
            let what = if *pf_bdf == p.bdf { "the PF" } else { "a VF" };
            return Err(Error::BadSpec {
                spec: s.name.clone(),
                reason: format!(
                    "{} is {what} of device {pf_name:?} (pci-pf): the lender keeps a PF with VFs and lends its VFs as {pf_name}-vfN",
                    p.bdf
                ),
            });
        }
    }
    Ok(out)
}

/// The store whose capacity is PF `spec`'s limits, which its VFs' borrowers share
/// (`pf:NAME`); `None` for a PF without limits, or a spec of another kind.
pub(crate) fn pf_store(spec: &DeviceSpec) -> Option<StoreSpec> {
    match &spec.kind {
        KindSpec::PciPf(pf) if pf.qos.limits.iter().any(Option::is_some) => Some(StoreSpec {
            name: format!("pf:{}", spec.name),
            capacity: pf.qos,
        }),
        _ => None,
    }
}

/// The trait naming a VF's PF: `PF_` and the PF device's name in upper case, other
/// characters than A-Z and 0-9 as `_` (at most 64 bytes, the pool's limit).
pub fn pf_trait(name: &str) -> String {
    let mut t: String = "PF_"
        .chars()
        .chain(name.chars().map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        }))
        .collect();
    t.truncate(64);
    t
}

/// What to tell a borrower that asked for `asked`, a name no device has, when it
/// looks like a VF or a PF (`names`: the devices lent): the VFs a PF has, or that a
/// function is lent whole and has none.
pub(crate) fn unknown_device_hint(asked: &str, names: &[String]) -> Option<String> {
    let vfs_of = |pf: &str| {
        let n = names
            .iter()
            .filter(|d| {
                d.strip_prefix(pf)
                    .and_then(|r| r.strip_prefix("-vf"))
                    .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
            })
            .count();
        (n > 0).then(|| format!("{pf}-vf0 to {pf}-vf{}", n - 1))
    };
    if let Some(range) = vfs_of(asked) {
        return Some(format!(
            "{asked:?} is an SR-IOV physical function, which the lender keeps; borrow one of its VFs, {range}"
        ));
    }
    let (pf, index) = asked.rsplit_once("-vf")?;
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if let Some(range) = vfs_of(pf) {
        return Some(format!("{pf:?} has VFs {range} only"));
    }
    names.iter().any(|d| d == pf).then(|| {
        format!(
            "{pf:?} is lent whole and has no VFs (its lender declares an SR-IOV function as NAME=pci-pf:BDF,vfs=N to lend its VFs)"
        )
    })
}

/// Makes the VFs of `pf` ready and returns their addresses, VF 0 first.
fn prepare(
    pf: &PfSpec,
    mode: Mode,
    sysfs: &Sysfs,
    admin: AdminOpener<'_>,
) -> Result<Vec<String>, SriovError> {
    let dev = sysfs.device(&pf.bdf);
    if !dev.exists() {
        return Err(SriovError::NoFunction(dev));
    }
    if !sysfs.has_sriov(&pf.bdf) {
        return Err(SriovError::NoSriov);
    }
    let total = sysfs.read_number(&pf.bdf, "sriov_totalvfs")?;
    if pf.vfs > total {
        return Err(SriovError::TooManyVfs {
            asked: pf.vfs,
            total,
        });
    }
    match sysfs.driver(&pf.bdf) {
        Some(d) if d != "vfio-pci" => {}
        other => {
            return Err(SriovError::PfDriver {
                driver: other.unwrap_or_else(|| "no driver".into()),
            })
        }
    }
    let nvme = sysfs.class(&pf.bdf)? == CLASS_NVME;
    // Limits need the mediator: refused before anything is changed on the PF.
    let mirrored = pf.coherence == Some(Coherence::Mirror) || (pf.coherence.is_none() && !nvme);
    if mirrored && pf.qos.limits.iter().any(Option::is_some) {
        return Err(SriovError::LimitsOnMirror);
    }
    let mut queue = if nvme {
        Some(admin(sysfs, &pf.bdf)?)
    } else {
        None
    };
    let current = sysfs.read_number(&pf.bdf, "sriov_numvfs")?;
    if current != pf.vfs {
        if mode == Mode::Reload {
            return Err(SriovError::VfsChanged {
                current,
                asked: pf.vfs,
            });
        }
        if current > 0 {
            sysfs.write(&pf.bdf, "sriov_numvfs", "0")?;
        }
        if let Some(q) = queue.as_mut() {
            release_primary_flexible(q.as_mut(), sysfs, &pf.bdf)?;
        }
        // The VFs appear unbound: the lender binds them to vfio-pci, not the PF's
        // driver's VF driver.
        sysfs.write(&pf.bdf, "sriov_drivers_autoprobe", "0")?;
        sysfs.write(&pf.bdf, "sriov_numvfs", &pf.vfs.to_string())?;
        tracing::info!(pf = %pf.bdf, vfs = pf.vfs, "SR-IOV virtual functions enabled");
    }
    if let Some(q) = queue.as_mut() {
        bring_online(q.as_mut(), pf)?;
    }
    let mut vfs = Vec::with_capacity(usize::from(pf.vfs));
    for i in 0..pf.vfs {
        let vf = sysfs.vf(&pf.bdf, i)?;
        sysfs.bind_vfio(&vf)?;
        vfs.push(vf);
    }
    // A reset of the PF's controller (by its driver, or the operator's `nvme reset`)
    // takes every secondary controller offline: check they still are online.
    if let Some(q) = queue.as_mut() {
        let list = secondaries(q.as_mut())?;
        if let Some(i) =
            (0..pf.vfs).find(|&i| !list.iter().any(|s| s.vf_number == i + 1 && s.online))
        {
            return Err(SriovError::Offline(i));
        }
    }
    Ok(vfs)
}

fn admin_err(what: impl Into<String>) -> impl FnOnce(AdminError) -> SriovError {
    let what = what.into();
    move |source| SriovError::Admin { what, source }
}

/// Reads the Primary Controller Capabilities.
fn primary_caps(q: &mut dyn Admin) -> Result<PrimaryCaps, SriovError> {
    let mut d = vec![0u8; 4096];
    q.run(&AdminCommand::identify_primary(), &mut d)
        .map_err(admin_err("Identify Primary Controller Capabilities"))?;
    Ok(PrimaryCaps::parse(&d))
}

/// Reads the Secondary Controller List.
fn secondaries(q: &mut dyn Admin) -> Result<Vec<Secondary>, SriovError> {
    let mut d = vec![0u8; 4096];
    q.run(&AdminCommand::identify_secondaries(), &mut d)
        .map_err(admin_err("Identify Secondary Controller List"))?;
    Ok(nvme_admin::parse_secondaries(&d))
}

/// Takes the flexible resources the primary controller holds back from it, so that
/// they can be assigned to the VFs, and resets the PF for that to take effect (NVMe
/// Base 2.0 §8.26.3: a primary's flexible allocation changes at its next reset).
fn release_primary_flexible(q: &mut dyn Admin, sysfs: &Sysfs, pf: &str) -> Result<(), SriovError> {
    let caps = primary_caps(q)?;
    if caps.queues.primary == 0 && caps.interrupts.primary == 0 {
        return Ok(());
    }
    for rt in [Resource::Queues, Resource::Interrupts] {
        q.run(
            &AdminCommand::virt_mgmt(ACT_PRIMARY_FLEXIBLE, rt, caps.cntlid, 0),
            &mut [],
        )
        .map_err(admin_err(format!(
            "Virtualization Management: primary flexible {rt:?} to 0"
        )))?;
    }
    sysfs.write(pf, "reset", "1")?;
    // The kernel's driver brings the controller back after the reset: wait for its
    // admin queue.
    let until = Instant::now() + sysfs.settle;
    loop {
        match primary_caps(q) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= until => return Err(e),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    }
}

/// Gives each VF's secondary controller that is offline its share of the flexible
/// resources and brings it online, then attaches the namespaces `pf` names.
fn bring_online(q: &mut dyn Admin, pf: &PfSpec) -> Result<(), SriovError> {
    let caps = primary_caps(q)?;
    let list = secondaries(q)?;
    let share = |f: &nvme_admin::Flexible| {
        let gran = u32::from(f.granularity.max(1));
        let n = (f.total / u32::from(pf.vfs)).min(u32::from(f.per_secondary));
        u16::try_from(n - n % gran).unwrap_or(u16::MAX)
    };
    let (queues, interrupts) = (share(&caps.queues), share(&caps.interrupts));
    for i in 0..pf.vfs {
        let vf_number = i + 1;
        let sc = list
            .iter()
            .find(|s| s.vf_number == vf_number)
            .copied()
            .ok_or(SriovError::NoSecondary(i))?;
        if !sc.online {
            if queues < 2 || interrupts < 1 {
                return Err(SriovError::Resources {
                    vfs: pf.vfs,
                    queues: caps.queues.total,
                    interrupts: caps.interrupts.total,
                    queue_max: caps.queues.per_secondary,
                    interrupt_max: caps.interrupts.per_secondary,
                });
            }
            for (rt, n, have) in [
                (Resource::Queues, queues, sc.queues),
                (Resource::Interrupts, interrupts, sc.interrupts),
            ] {
                if have == n {
                    continue;
                }
                q.run(
                    &AdminCommand::virt_mgmt(ACT_SECONDARY_ASSIGN, rt, sc.cntlid, n),
                    &mut [],
                )
                .map_err(admin_err(format!(
                    "Virtualization Management: assign {n} {rt:?} to controller {}",
                    sc.cntlid
                )))?;
            }
            q.run(
                &AdminCommand::virt_mgmt(ACT_SECONDARY_ONLINE, Resource::Queues, sc.cntlid, 0),
                &mut [],
            )
            .map_err(admin_err(format!(
                "Virtualization Management: controller {} online",
                sc.cntlid
            )))?;
            tracing::info!(pf = %pf.bdf, vf = i, controller = sc.cntlid, queues, interrupts, "NVMe secondary controller online");
        }
        for &nsid in pf.namespaces.get(usize::from(i)).into_iter().flatten() {
            let mut list = nvme_admin::controller_list(sc.cntlid);
            match q.run(&AdminCommand::attach(nsid), &mut list) {
                Ok(_) => {
                    tracing::info!(pf = %pf.bdf, vf = i, controller = sc.cntlid, nsid, "namespace attached");
                }
                Err(AdminError::Status(STATUS_NS_ALREADY_ATTACHED)) => {}
                Err(e) => {
                    return Err(admin_err(format!(
                        "Namespace Attachment of namespace {nsid} to controller {} (VF {i})",
                        sc.cntlid
                    ))(e))
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
