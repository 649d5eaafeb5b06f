//! A lent device: what every kind has (its name, its holder, its counters) and its
//! [`Backing`], one variant per kind, each implementing [`LentKind`]. Adding a kind
//! means a [`Backing`] variant, a [`crate::config::KindSpec`] variant and one
//! [`LentKind`] impl, which opens the kind's sessions too.

use std::sync::Arc;

use devlend_fabric::qos::Qos;
use devlend_fabric::DeviceDescription;

use crate::block::BlockDevice;
use crate::config::KindSpec;
use crate::device_counters::DeviceCounters;
use crate::kind::LentKind;
use crate::nic::Nic;
use crate::pci::PciFunction;
use crate::qos::{Group, Store};
use crate::stats::DeviceStats;
use crate::{DeviceSpec, Error};

/// What a lent device is, one variant per kind.
#[derive(Debug)]
pub(crate) enum Backing {
    /// A block device or regular file.
    Block(BlockDevice),
    /// A network interface (frames, not block requests).
    Nic(Nic),
    /// A PCIe function (regions, interrupts, DMA; not block requests); boxed, it is
    /// much larger than the other kinds.
    Pci(Box<PciFunction>),
}

impl Backing {
    /// The kind's [`LentKind`].
    pub(crate) fn kind(&self) -> &dyn LentKind {
        match self {
            Backing::Block(b) => b,
            Backing::Nic(n) => n,
            Backing::Pci(f) => f.as_ref(),
        }
    }
}

/// An open, lendable device.
#[derive(Debug)]
pub(crate) struct Device {
    /// Its name and counters, as its kinds and their sessions are handed them.
    pub(crate) counters: Arc<DeviceCounters>,
    /// Who holds the device, and a handover in progress (shared with its claims).
    pub(crate) holding: Arc<crate::holding::Holding>,
    /// What it is.
    pub(crate) backing: Backing,
    /// The spec it was opened from.
    spec: DeviceSpec,
}

impl Device {
    /// Whether a borrower holds the device (has a session open on it).
    pub(crate) fn is_held(&self) -> bool {
        self.holding.is_held()
    }

    /// The kind's [`LentKind`].
    pub(crate) fn kind(&self) -> &dyn LentKind {
        self.backing.kind()
    }

    /// The kind's name: `block`, `net` or `pci` (as `kind` in the config file).
    pub(crate) fn kind_name(&self) -> &'static str {
        self.spec.kind.name()
    }

    /// What the handshake answers for the device.
    pub(crate) fn info(&self) -> DeviceDescription {
        self.kind().device_info()
    }

    /// The traits configured for the device (beyond the derived ones).
    pub(crate) fn traits(&self) -> &[String] {
        &self.spec.traits
    }

    /// Whether `spec` describes this device as it was opened.
    pub(crate) fn spec_matches(&self, spec: &DeviceSpec) -> bool {
        self.spec == *spec
    }

    /// Whether `borrower` holds the device now (a session of it is open).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn held_by(&self, borrower: [u8; 16]) -> bool {
        self.holding.held_by(borrower)
    }

    /// The limits configured for the device (none for a PCIe function).
    pub(crate) fn qos(&self) -> Qos {
        self.spec.qos()
    }

    /// The name of the backing store the device sits on, if configured.
    pub(crate) fn store_name(&self) -> Option<&str> {
        self.spec.store()
    }

    /// The limits its holder's sessions share now, if it is held (or anonymous
    /// sessions are open).
    pub(crate) fn current_group(&self) -> Option<Arc<Group>> {
        self.holding.current_group()
    }

    /// Lets a session use the device ([`crate::holding::claim`]): one borrower at a
    /// time, and the handover of a live migration.
    pub(crate) fn claim(
        &self,
        ask: &crate::holding::Ask<'_>,
        store: Option<Arc<Store>>,
    ) -> Result<crate::holding::Claim, crate::holding::Refusal> {
        crate::holding::claim(&self.holding, self.spec.qos(), ask, store)
    }

    /// Opens what `spec` lends: a file or block device ([`BlockDevice::open`]), a
    /// network interface ([`Nic::open`]) or a PCIe function ([`PciFunction::open`]).
    ///
    /// # Errors
    /// Those of [`DeviceSpec::validate`] and of the kind's open.
    pub(crate) fn open(spec: &DeviceSpec) -> Result<Device, Error> {
        spec.validate()?;
        let backing = match &spec.kind {
            KindSpec::Block(b) => Backing::Block(BlockDevice::open(&spec.name, b)?),
            KindSpec::Net(n) => {
                let mac = n.mac.as_deref().and_then(crate::config::parse_mac);
                Backing::Nic(Nic::open(&spec.name, &n.interface, mac)?)
            }
            KindSpec::Pci(p) => {
                let f = PciFunction::open(&p.bdf, p.coherence).map_err(|source| Error::Pci {
                    device: spec.name.clone(),
                    bdf: p.bdf.clone(),
                    source,
                })?;
                let limited = p.qos.limits.iter().any(Option::is_some) || p.store.is_some();
                if limited && f.coherence == crate::config::Coherence::Mirror {
                    return Err(Error::BadSpec {
                        spec: spec.name.clone(),
                        reason: "limits and stores apply to a function in coherence nvme only (the lender sees no command of a mirrored function)".into(),
                    });
                }
                Backing::Pci(Box::new(f))
            }
            KindSpec::PciPf(_) => {
                return Err(Error::BadSpec {
                    spec: spec.name.clone(),
                    reason: "a PF is lent as its VFs (pci::sriov::expand), never opened itself"
                        .into(),
                })
            }
        };
        Ok(Device {
            counters: Arc::new(DeviceCounters {
                name: spec.name.clone(),
                stats: DeviceStats::default(),
            }),
            holding: Default::default(),
            backing,
            spec: spec.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use devlend_fabric::handshake::{DEV_DISCARD, DEV_WRITE_ZEROES};

    use super::*;
    use crate::config::BlockSpec;

    fn spec_for(path: &std::path::Path, ro: bool) -> DeviceSpec {
        let mut b = BlockSpec::new(path);
        b.read_only = ro;
        DeviceSpec::new("t", b)
    }

    #[test]
    fn a_1000_byte_file_lends_one_sector() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1000).unwrap();
        let d = Device::open(&spec_for(f.path(), false)).unwrap();
        let info = d.info();
        let g = info.as_block().expect("a block device is described as one");
        assert_eq!(g.capacity_sectors, 1);
        assert_eq!(d.kind().capacity_bytes(), 512);
        assert_eq!(g.block_size, 512);
        assert_eq!(g.flags, DEV_DISCARD | DEV_WRITE_ZEROES);
        assert_eq!(&g.serial[..2], b"t\0");
    }

    #[test]
    fn read_only_flag_and_errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("a.img");
        std::fs::write(&img, vec![0u8; 4096]).unwrap();
        let d = Device::open(&spec_for(&img, true)).unwrap();
        assert!(d.info().as_block().is_some_and(|g| g.read_only()));

        let missing = dir.path().join("missing.img");
        let msg = Device::open(&spec_for(&missing, false))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("missing.img") && msg.contains("\"t\""),
            "{msg}"
        );

        let small = dir.path().join("small.img");
        std::fs::write(&small, [0u8; 100]).unwrap();
        assert!(matches!(
            Device::open(&spec_for(&small, false)),
            Err(Error::TooSmall { .. })
        ));

        assert!(matches!(
            Device::open(&spec_for(dir.path(), true)),
            Err(Error::NotBlock { .. })
        ));
    }
}
