//! Lending a PCIe function bound to `vfio-pci`: the function is opened once with
//! `vfio-ioctls` (a VFIO container with the type1 IOMMU, its group, the device), and
//! lent to one borrower at a time over a PCI session (`session`).
//!
//! What the borrower reaches: the regions (BARs by `pread`/`pwrite` on the VFIO device,
//! the config space through `config::VirtConfig`), reset, interrupts (VFIO eventfds
//! turned into [`devlend_fabric::pci::KIND_IRQ`] messages), and DMA: each DMA map of the
//! borrower gets a `mirror::Mirror` mapped at the same IOVA in the function's IOMMU
//! domain (VFIO_IOMMU_MAP_DMA), or, for an NVMe controller, goes to the mediator
//! (`nvme`).
//!
//! The layers, top down:
//! - `session`: the message loop per transport (`tcp`, `rdma`);
//! - `lending`: one lending's requests and checks, whatever the transport;
//! - `nvme`: the NVMe mediator, which reaches guest memory through `guest`;
//! - `config`, `mirror`, `irq`: the config space, the DMA mirrors, the interrupt
//!   eventfds; here: the function itself (`PciFunction`).

pub(crate) mod config;
pub(crate) mod guest;
pub(crate) mod irq;
pub(crate) mod lending;
pub(crate) mod mirror;
pub(crate) mod nvme;
pub(crate) mod peer;
pub(crate) mod session;
pub mod sriov;

use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use devlend_fabric::pci::{IrqInfo, PciInfo, RegionInfo, INFO_MEDIATED, INFO_RESET};
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_NUM_IRQS, VFIO_PCI_NUM_REGIONS,
    VFIO_PCI_ROM_REGION_INDEX, VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_READ,
    VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioError};

use crate::config::Coherence;

/// Class code of an NVMe controller (base class 01h mass storage, subclass 08h
/// non-volatile memory, programming interface 02h NVM Express): lent through the NVMe
/// mediator unless the spec says otherwise.
pub(crate) const CLASS_NVME: [u8; 3] = [0x01, 0x08, 0x02];

/// Why a PCIe function could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum PciError {
    /// The function does not exist in sysfs.
    #[error("no PCI function at {0}")]
    NoFunction(PathBuf),
    /// The function is not bound to vfio-pci.
    #[error("the function is bound to {driver:?}, not vfio-pci (echo vfio-pci > driver_override, then drivers_probe)")]
    NotVfio {
        /// The driver it is bound to ("none" if unbound).
        driver: String,
    },
    /// VFIO refused: no IOMMU, a group not viable, the container, the device.
    #[error("VFIO")]
    Vfio(#[source] VfioError),
    /// Reading the config space failed.
    #[error("reading the config space")]
    Config(#[source] io::Error),
}

/// A function taken by one borrower's session; given back on drop.
pub(crate) struct Lent<'a>(&'a PciFunction);

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        self.0.lent.store(false, Ordering::Release);
    }
}

/// A function opened through VFIO, lendable.
pub(crate) struct PciFunction {
    /// `DDDD:BB:DD.F`.
    pub(crate) bdf: String,
    container: Arc<VfioContainer>,
    device: VfioDevice,
    /// What the borrower is told.
    pub(crate) info: PciInfo,
    /// Per region index: VFIO's offset of the region in the device fd.
    offsets: Vec<u64>,
    layout: config::Layout,
    /// How the function's DMA is kept coherent with guest memory.
    pub(crate) coherence: Coherence,
    /// Set while a borrower's session holds the function.
    lent: AtomicBool,
    /// Its memory BARs that VFIO lets be mapped, by BAR index: what the IOMMU domains
    /// of its peers map (`peer`).
    pub(crate) bar_maps: [Option<Arc<peer::BarMap>>; 6],
    /// The peers' BARs the current lending reaches (`peer`).
    pub(crate) reach: Arc<peer::Reach>,
}

impl std::fmt::Debug for PciFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciFunction")
            .field("bdf", &self.bdf)
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl PciFunction {
    /// Opens the function at `bdf` (bound to vfio-pci) in a container of its own, and
    /// reads its regions, interrupts and config space. `coherence` `None` picks `nvme`
    /// for an NVMe controller ([`CLASS_NVME`]), `mirror` for any other function.
    ///
    /// # Errors
    /// [`PciError`].
    pub(crate) fn open(bdf: &str, coherence: Option<Coherence>) -> Result<PciFunction, PciError> {
        let sysfs = PathBuf::from("/sys/bus/pci/devices").join(bdf);
        if !sysfs.exists() {
            return Err(PciError::NoFunction(sysfs));
        }
        let driver = std::fs::read_link(sysfs.join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "none".into());
        if driver != "vfio-pci" {
            return Err(PciError::NotVfio { driver });
        }
        let container = Arc::new(VfioContainer::new(None).map_err(PciError::Vfio)?);
        let device = VfioDevice::new(&sysfs, container.clone(), false).map_err(PciError::Vfio)?;
        let mut regions = Vec::new();
        let mut offsets = Vec::new();
        for i in 0..VFIO_PCI_NUM_REGIONS {
            regions.push(RegionInfo {
                size: device.get_region_size(i),
                flags: device.get_region_flags(i)
                    & (VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE),
            });
            offsets.push(device.get_region_offset(i));
        }
        let irqs = (0..VFIO_PCI_NUM_IRQS)
            .map(|i| {
                device
                    .get_irq_info(i)
                    .map(|q| IrqInfo {
                        count: q.count,
                        flags: q.flags,
                    })
                    .unwrap_or_default()
            })
            .collect();
        let mut f = PciFunction {
            bdf: bdf.to_owned(),
            container,
            device,
            info: PciInfo {
                regions,
                irqs,
                flags: INFO_RESET,
            },
            offsets,
            layout: config::Layout {
                bar_sizes: [0; 7],
                initial: Vec::new(),
            },
            coherence: Coherence::Mirror,
            lent: AtomicBool::new(false),
            bar_maps: Default::default(),
            reach: Arc::default(),
        };
        for (i, m) in f.bar_maps.iter_mut().enumerate() {
            let (size, flags) = (
                f.device.get_region_size(i as u32),
                f.device.get_region_flags(i as u32),
            );
            if size < 4096 || size % 4096 != 0 || flags & VFIO_REGION_INFO_FLAG_MMAP == 0 {
                if size > 0 {
                    tracing::debug!(
                        bdf,
                        bar = i,
                        size,
                        flags,
                        "a BAR VFIO does not let be mapped: no peer reaches it"
                    );
                }
                continue;
            }
            match peer::BarMap::new(f.device.as_raw_fd(), f.offsets[i], size) {
                Ok(b) => *m = Some(Arc::new(b)),
                Err(e) => {
                    tracing::debug!(bdf, bar = i, error = %e, "a BAR VFIO does not let be mapped: no peer reaches it")
                }
            }
        }
        let cfg_size = f.info.regions[VFIO_PCI_CONFIG_REGION_INDEX as usize].size;
        let mut initial = vec![0u8; cfg_size.min(4096) as usize];
        f.pread(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut initial)
            .map_err(PciError::Config)?;
        let mut bar_sizes = [0u64; 7];
        for (i, s) in bar_sizes.iter_mut().enumerate() {
            *s = f.info.regions[i].size;
        }
        bar_sizes[6] = f.info.regions[VFIO_PCI_ROM_REGION_INDEX as usize].size;
        f.layout = config::Layout { bar_sizes, initial };
        // The MSI-X table and PBA are virtualized here: no peer writes them.
        for i in config::msix_bars(&f.layout.initial) {
            if let Some(m) = f.bar_maps.get_mut(i) {
                *m = None;
            }
        }
        let id = |o: usize| {
            let b = |i: usize| f.layout.initial.get(i).copied().unwrap_or(0xff);
            format!("{:04x}", u16::from_le_bytes([b(o), b(o + 1)]))
        };
        let class = [
            f.layout.initial.get(11).copied().unwrap_or(0),
            f.layout.initial.get(10).copied().unwrap_or(0),
            f.layout.initial.get(9).copied().unwrap_or(0),
        ];
        f.coherence = coherence.unwrap_or(if class == CLASS_NVME {
            Coherence::Nvme
        } else {
            Coherence::Mirror
        });
        if f.coherence == Coherence::Nvme {
            f.info.flags |= INFO_MEDIATED;
            if class != CLASS_NVME {
                tracing::warn!(
                    bdf,
                    ?class,
                    "coherence=nvme on a function that is not an NVMe controller (class 01:08:02)"
                );
            }
        }
        tracing::info!(bdf, vendor = id(0), device = id(2), coherence = ?f.coherence, "PCIe function ready");
        Ok(f)
    }

    /// What the handshake describes of the function: its address, the IDs and class from
    /// the config space read at open, the regions that exist, and its coherence mode.
    pub(crate) fn description(&self) -> devlend_fabric::PciIdentity {
        let b = |i: usize| self.layout.initial.get(i).copied().unwrap_or(0);
        let w = |i: usize| u16::from_le_bytes([b(i), b(i + 1)]);
        devlend_fabric::PciIdentity {
            bdf: self.bdf.clone(),
            vendor_id: w(0x00),
            device_id: w(0x02),
            subsystem_vendor_id: w(0x2c),
            subsystem_id: w(0x2e),
            class: u32::from_le_bytes([b(0x09), b(0x0a), b(0x0b), 0]),
            regions: (0u32..)
                .zip(&self.info.regions)
                .filter(|(_, r)| r.size > 0)
                .map(|(index, r)| devlend_fabric::PciRegion {
                    index,
                    size: r.size,
                    flags: r.flags,
                })
                .collect(),
            coherence: match self.coherence {
                Coherence::Mirror => devlend_fabric::CoherenceMode::Mirror,
                Coherence::Nvme => devlend_fabric::CoherenceMode::Mediated,
            },
        }
    }

    /// The pool's resource class of the function: `PCI_<VENDOR>_<DEVICE>` (upper-case
    /// hex, from the config space read at open), e.g. `PCI_1234_11E8`.
    pub(crate) fn resource_class(&self) -> String {
        let (vendor, device) = self.ids();
        format!("PCI_{vendor:04X}_{device:04X}")
    }

    /// The function's vendor and device IDs, from the config space read at open
    /// (`0xffff` each if it was too short).
    pub(crate) fn ids(&self) -> (u16, u16) {
        let b = |i: usize| self.layout.initial.get(i).copied().unwrap_or(0xff);
        (
            u16::from_le_bytes([b(0), b(1)]),
            u16::from_le_bytes([b(2), b(3)]),
        )
    }

    /// Takes the function for one borrower; `None` while another holds it.
    pub(crate) fn try_lend(&self) -> Option<Lent<'_>> {
        self.lent
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| Lent(self))
    }

    /// Reads `buf.len()` bytes of region `index` at `off` through the VFIO device fd.
    fn pread(&self, index: u32, off: u64, buf: &mut [u8]) -> io::Result<()> {
        let pos = self.offsets[index as usize]
            .checked_add(off)
            .and_then(|p| i64::try_from(p).ok())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes; the fd is the
        // open VFIO device.
        let n = unsafe {
            libc::pread(
                self.device.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                pos,
            )
        };
        match n {
            n if n < 0 => Err(io::Error::last_os_error()),
            n if n as usize != buf.len() => Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            _ => Ok(()),
        }
    }

    /// Writes `buf` to region `index` at `off` through the VFIO device fd.
    fn pwrite(&self, index: u32, off: u64, buf: &[u8]) -> io::Result<()> {
        let pos = self.offsets[index as usize]
            .checked_add(off)
            .and_then(|p| i64::try_from(p).ok())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: `buf` is a live buffer of `buf.len()` bytes; the fd is the open VFIO
        // device.
        let n =
            unsafe { libc::pwrite(self.device.as_raw_fd(), buf.as_ptr().cast(), buf.len(), pos) };
        match n {
            n if n < 0 => Err(io::Error::last_os_error()),
            n if n as usize != buf.len() => Err(io::Error::from(io::ErrorKind::WriteZero)),
            _ => Ok(()),
        }
    }
}

impl crate::kind::LentKind for PciFunction {
    fn device_info(&self) -> devlend_fabric::DeviceDescription {
        self.description().into()
    }

    fn check_hello(&self, device: &str, hello: &devlend_fabric::Hello) -> Result<(), String> {
        if hello.features & devlend_fabric::pci::FEATURE_PCI == 0 || hello.queue_index != 0 {
            return Err(format!(
                "device {device:?} is a PCIe function: a borrower must ask for feature PCI on queue 0 (devlend attach --kind pci)"
            ));
        }
        Ok(())
    }

    fn open_tcp<'a>(
        &'a self,
        at: &crate::session::open::Opening<'a>,
    ) -> Result<
        crate::session::open::Opened<Box<dyn crate::session::open::TcpSession + 'a>>,
        crate::session::open::Refused,
    > {
        session::open_tcp(self, at)
    }

    #[cfg(feature = "rdma")]
    fn open_rdma<'a>(
        &'a self,
        at: &crate::session::open::Opening<'a>,
        _conn: &devlend_fabric::rdma::verbs::Connection,
    ) -> Result<
        crate::session::open::Opened<Box<dyn crate::session::open::RdmaSession + 'a>>,
        crate::session::open::Refused,
    > {
        session::open_rdma(self, at)
    }

    /// A PCIe function has no holding session: over RDMA it is refused whenever the
    /// lender requires TLS.
    fn check_rdma_under_tls(&self, device: &str, _held: bool) -> Result<(), String> {
        Err(format!(
            "this lender requires TLS: PCIe function {device:?} is lent over TCP with TLS only (attach without --transport rdma)"
        ))
    }

    fn resource_class(&self) -> String {
        PciFunction::resource_class(self)
    }

    fn is_limited(&self) -> bool {
        false
    }

    fn view(&self) -> crate::kind_view::KindView {
        let (vendor_id, device_id) = self.ids();
        crate::kind_view::KindView::Pci {
            bdf: self.bdf.clone(),
            vendor_id,
            device_id,
            coherence: self.coherence,
        }
    }
}
