//! The state of one lending of a PCIe function, whatever the transport: the requests
//! a borrower makes (info, region reads and writes with the config space virtualized,
//! reset, interrupts, DMA maps with their mirrors) checked and done, and the function
//! quiesced when the session ends.
//!
//! A well-formed request the lender will not do (a region index out of range, an offset
//! past a BAR, a DMA range that overlaps a mapped one) is answered with an error status
//! and the session goes on. When the session ends, however it ends, the function is
//! quiesced for the next borrower: interrupts disabled, bus mastering turned off,
//! VFIO_DEVICE_RESET (when the function supports a reset), every mirror unmapped from
//! the IOMMU and freed.
//!
//! In coherence mode `nvme` over TCP the lending has the session's mediator
//! ([`TcpMediated`]) instead of mirrors: BAR0 goes to it, and DMA maps are only
//! recorded. (Over RDMA the session keeps its mediator itself, `session/rdma.rs`.) The
//! transports' own message loops, pushes and pulls are in `pci/session/`, above this.

use std::sync::{Arc, PoisonError};

use devlend_fabric::pci::{
    Access, DmaRange, IrqAction, IrqSet, Message, PciStatus, PeerGroup, KIND_DMA_MAP,
    KIND_DMA_UNMAP, KIND_INFO, KIND_PEER_GROUP, KIND_READ, KIND_RESET, KIND_SET_IRQS, KIND_WRITE,
};
use devlend_fabric::WireError;
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vmm_sys_util::eventfd::EventFd;

use super::config::VirtConfig;
use super::mirror::Mirror;
use super::nvme::Handled;
use super::peer::{Membership, Window};
use super::PciFunction;
use crate::config::Coherence;
use crate::pci::guest::tcp::TcpMediated;
use crate::pci::irq::IrqTable;

/// Most bytes of mirrors one borrower may map (4 GiB): each costs as much again in the
/// lender's synced copy.
pub(crate) const MAX_MIRROR_BYTES: u64 = devlend_fabric::pci::MAX_MIRROR_BYTES;
/// Memory the lender keeps free beside mirrors (bytes): 128 MiB.
const MEMORY_RESERVE: u64 = 128 << 20;

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A refusal: the status and the reason sent back.
pub(crate) type Refusal = (PciStatus, String);
/// The answer to a request: the reply's payload, or a refusal.
pub(crate) type Answer = Result<Vec<u8>, Refusal>;

pub(crate) fn invalid(reason: impl Into<String>) -> Refusal {
    (PciStatus::Invalid, reason.into())
}

/// The state of one lending, whatever the transport.
pub(crate) struct Lending<'a> {
    pub(crate) f: &'a PciFunction,
    /// The NVMe mediator, in coherence mode `nvme` over TCP.
    pub(crate) nvme: Option<&'a TcpMediated<'a>>,
    cfg: VirtConfig,
    pub(crate) maps: Vec<Mirror>,
    /// Bytes of all `maps`.
    mapped: u64,
    pub(crate) table: &'a IrqTable,
    /// The first refusal within a push that spans several messages, answered at its end.
    pub(crate) push_error: Option<Refusal>,
    /// Its VM's peer group, once the borrower named the VM (`peer`).
    peer: Option<Membership>,
    /// Memory decoding as this lending's borrower last set it (off until it does: the
    /// function's own bit is on between lendings, for the lender).
    decoding: bool,
}

impl<'a> Lending<'a> {
    /// A fresh lending of `f`: config space as after reset, nothing mapped.
    pub(crate) fn new(f: &'a PciFunction, table: &'a IrqTable) -> Lending<'a> {
        Lending {
            f,
            nvme: None,
            cfg: VirtConfig::new(&f.layout),
            maps: Vec::new(),
            mapped: 0,
            table,
            push_error: None,
            peer: None,
            decoding: false,
        }
    }

    /// is an `Err` of the outer result (the session ends).
    pub(crate) fn request(&mut self, m: &Message) -> Result<Answer, WireError> {
        Ok(match m.kind {
            KIND_INFO => {
                if !m.payload.is_empty() {
                    return Err(WireError::Invalid("payload on an info request"));
                }
                Ok(self.f.info.encode())
            }
            KIND_READ => {
                let (a, _) = Access::decode(&m.payload, false)?;
                self.read(a)
            }
            KIND_WRITE => {
                let (a, data) = Access::decode(&m.payload, true)?;
                self.write(a, data).map(|()| Vec::new())
            }
            KIND_RESET => {
                if !m.payload.is_empty() {
                    return Err(WireError::Invalid("payload on a reset"));
                }
                self.f.device.reset();
                self.cfg = VirtConfig::new(&self.f.layout);
                self.decoding = false;
                self.refresh_windows();
                if let Some(nv) = self.nvme {
                    nv.with(self.table, true, |m, _| m.reset());
                }
                tracing::info!(bdf = %self.f.bdf, "function reset by the borrower");
                Ok(Vec::new())
            }
            KIND_SET_IRQS => self
                .set_irqs(IrqSet::decode(&m.payload)?)
                .map(|()| Vec::new()),
            KIND_DMA_MAP => self
                .dma_map(DmaRange::decode(&m.payload)?)
                .map(|()| Vec::new()),
            KIND_DMA_UNMAP => self
                .dma_unmap(DmaRange::decode(&m.payload)?)
                .map(|()| Vec::new()),
            KIND_PEER_GROUP => self
                .join_peers(PeerGroup::decode(&m.payload)?)
                .map(|()| Vec::new()),
            _ => return Err(WireError::Invalid("PCI request kind")),
        })
    }

    /// [`Self::check`] for a read.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn check_read(&self, a: &Access) -> Result<(), Refusal> {
        self.check(a, VFIO_REGION_INFO_FLAG_READ)
    }

    /// [`Self::check`] for a write.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn check_write(&self, a: &Access) -> Result<(), Refusal> {
        self.check(a, VFIO_REGION_INFO_FLAG_WRITE)
    }

    /// Checks that `a` addresses an existing region with `flag`, within its size.
    fn check(&self, a: &Access, flag: u32) -> Result<(), Refusal> {
        let Some(r) = self.f.info.regions.get(a.region as usize) else {
            return Err(invalid(format!(
                "region {} out of range (the function has {})",
                a.region,
                self.f.info.regions.len()
            )));
        };
        if r.size == 0 || r.flags & flag == 0 {
            return Err(invalid(format!(
                "region {} is absent or not {}",
                a.region,
                if flag == VFIO_REGION_INFO_FLAG_READ {
                    "readable"
                } else {
                    "writable"
                }
            )));
        }
        let end = a.offset.checked_add(u64::from(a.len));
        let size = if a.region == VFIO_PCI_CONFIG_REGION_INDEX {
            r.size.min(self.cfg.len() as u64)
        } else {
            r.size
        };
        if end.is_none_or(|e| e > size) {
            return Err(invalid(format!(
                "{} bytes at {:#x} pass the end of region {} ({:#x} bytes)",
                a.len, a.offset, a.region, size
            )));
        }
        Ok(())
    }

    fn read(&mut self, a: Access) -> Result<Vec<u8>, Refusal> {
        self.check(&a, VFIO_REGION_INFO_FLAG_READ)?;
        let mut buf = vec![0u8; a.len as usize];
        if let (Some(nv), 0) = (self.nvme, a.region) {
            if nv.with(self.table, true, |m, _| m.bar_read(a.offset, &mut buf)) == Handled::Yes {
                return Ok(buf);
            }
        }
        self.f
            .pread(a.region, a.offset, &mut buf)
            .map_err(|e| (PciStatus::Io, format!("read of region {}: {e}", a.region)))?;
        if a.region == VFIO_PCI_CONFIG_REGION_INDEX {
            self.cfg.overlay_read(a.offset as usize, &mut buf);
        }
        Ok(buf)
    }

    fn write(&mut self, a: Access, data: &[u8]) -> Result<(), Refusal> {
        self.check(&a, VFIO_REGION_INFO_FLAG_WRITE)?;
        let io = |e: std::io::Error| (PciStatus::Io, format!("write of region {}: {e}", a.region));
        if let (Some(nv), 0) = (self.nvme, a.region) {
            let f = self.f;
            if nv.with(self.table, true, |m, g| m.bar_write(f, g, a.offset, data))? == Handled::Yes
            {
                return Ok(());
            }
        }
        if a.region != VFIO_PCI_CONFIG_REGION_INDEX {
            return self.f.pwrite(a.region, a.offset, data).map_err(io);
        }
        // Config space: forward only the runs of bytes with forwarded bits.
        let fwd = self.cfg.write(a.offset as usize, data);
        let mut i = 0;
        while i < fwd.len() {
            if fwd[i].is_none() {
                i += 1;
                continue;
            }
            let start = i;
            let mut run = Vec::new();
            while let Some(Some(v)) = fwd.get(i) {
                run.push(*v);
                i += 1;
            }
            self.f
                .pwrite(a.region, a.offset + start as u64, &run)
                .map_err(io)?;
        }
        // The command register (memory decoding) or a BAR: where peers reach it.
        let touched = |o: u64, n: u64| a.offset < o + n && o < a.offset + data.len() as u64;
        if touched(0x04, 1) {
            self.decoding = data[(0x04 - a.offset) as usize] & 0x02 != 0;
        }
        if touched(0x04, 2) || touched(0x10, 24) {
            self.refresh_windows();
        }
        Ok(())
    }

    /// Joins the peer group of the borrower's VM: the other functions this lender lends
    /// to it reach this one's BARs by DMA, and it theirs.
    fn join_peers(&mut self, g: PeerGroup) -> Result<(), Refusal> {
        if self.peer.is_some() {
            return Err(invalid("this session has named its VM already"));
        }
        let f = self.f;
        let identity = f.coherence == Coherence::Mirror;
        self.peer = Some(Membership::join(
            g.vm,
            &f.bdf,
            &f.container,
            identity,
            &f.reach,
        ));
        self.refresh_windows();
        Ok(())
    }

    /// Tells the peer group where the guest placed this function's memory BARs: each
    /// one VFIO lets be mapped, with memory decoding on, at an address other than 0
    /// (none of a mediated function's BAR 0, whose doorbells are the mediator's).
    fn refresh_windows(&mut self) {
        let Some(m) = &self.peer else {
            return;
        };
        let f = self.f;
        let decoding = self.decoding;
        let mediated = f.coherence == Coherence::Nvme;
        let windows = if decoding {
            self.cfg
                .bar_addresses()
                .iter()
                .enumerate()
                .filter(|(i, _)| !(mediated && *i == 0))
                .filter_map(|(i, a)| {
                    Some(Window {
                        bar: i as u8,
                        guest: (*a)?,
                        map: f.bar_maps[i].clone()?,
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        tracing::debug!(bdf = %f.bdf, decoding, windows = windows.len(), "peer windows");
        m.update(windows);
    }

    fn set_irqs(&mut self, s: IrqSet) -> Result<(), Refusal> {
        let Some(info) = self.f.info.irqs.get(s.index as usize) else {
            return Err(invalid(format!("interrupt index {} out of range", s.index)));
        };
        if info.count == 0 {
            return Err((
                PciStatus::Unsupported,
                format!("the function has no interrupt of index {}", s.index),
            ));
        }
        let io = |what: &str, e: &dyn std::fmt::Display| {
            (
                PciStatus::Io,
                format!("{what} interrupt index {}: {e}", s.index),
            )
        };
        match s.action {
            IrqAction::Enable => {
                if s.count > info.count {
                    return Err(invalid(format!(
                        "{} vectors asked of interrupt index {}, which has {}",
                        s.count, s.index, info.count
                    )));
                }
                let mut efds = Vec::new();
                for _ in 0..s.count {
                    efds.push(Arc::new(
                        EventFd::new(libc::EFD_NONBLOCK).map_err(|e| io("enabling", &e))?,
                    ));
                }
                self.f
                    .device
                    .enable_irq(s.index, efds.iter().map(|e| e.as_ref()).collect())
                    .map_err(|e| io("enabling", &e))?;
                let mut t = self
                    .table
                    .fds
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                t.retain(|(i, _, _)| *i != s.index);
                t.extend(
                    efds.into_iter()
                        .enumerate()
                        .map(|(v, e)| (s.index, v as u32, e)),
                );
            }
            IrqAction::Disable => {
                self.f
                    .device
                    .disable_irq(s.index)
                    .map_err(|e| io("disabling", &e))?;
                self.table
                    .fds
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .retain(|(i, _, _)| *i != s.index);
            }
            IrqAction::Unmask => self
                .f
                .device
                .unmask_irq(s.index)
                .map_err(|e| io("unmasking", &e))?,
        }
        let _ = self.table.wake.write(1);
        Ok(())
    }

    pub(crate) fn dma_map(&mut self, r: DmaRange) -> Result<(), Refusal> {
        if let Some(nv) = self.nvme {
            return nv.with(self.table, true, |m, _| m.map(r.iova, r.size));
        }
        if let Some(m) = self.maps.iter().find(|m| m.overlaps(r.iova, r.size)) {
            return Err(invalid(format!(
                "DMA range {:#x}+{:#x} overlaps the mapped {:#x}+{:#x}",
                r.iova, r.size, m.iova, m.size
            )));
        }
        if self.mapped.saturating_add(r.size) > MAX_MIRROR_BYTES {
            return Err(invalid(format!(
                "mapping {:#x} more bytes passes the mirror limit of {MAX_MIRROR_BYTES:#x}",
                r.size
            )));
        }
        // The mirror and its synced copy are pinned or touched in full: refuse a map the
        // lender's memory cannot hold, rather than be killed for it (a VMM that maps all
        // its RAM for DMA needs twice that here).
        if let Some(avail) = mem_available() {
            let need = r.size.saturating_mul(2).saturating_add(MEMORY_RESERVE);
            if need > avail {
                return Err((
                    PciStatus::Io,
                    format!(
                        "a mirror of {} MiB needs {} MiB of the lender's memory, {} MiB are available",
                        r.size >> 20,
                        need >> 20,
                        avail >> 20
                    ),
                ));
            }
        }
        let size = usize::try_from(r.size).map_err(|_| invalid("DMA range too large"))?;
        let mirror = Mirror::new(r.iova, size)
            .map_err(|e| (PciStatus::Io, format!("allocating the mirror: {e}")))?;
        // SAFETY: the mirror lives in `self.maps` until `vfio_dma_unmap` of this very
        // range succeeded (dma_unmap, quiesce); it is touched only through volatile
        // copies, never a Rust reference.
        unsafe {
            self.f
                .container
                .vfio_dma_map(r.iova, size, mirror.as_ptr())
                .map_err(|e| (PciStatus::Io, format!("VFIO_IOMMU_MAP_DMA: {e}")))?;
        }
        tracing::debug!(bdf = %self.f.bdf, iova = r.iova, size = r.size, "DMA range mirrored");
        self.mapped += r.size;
        self.maps.push(mirror);
        Ok(())
    }

    pub(crate) fn dma_unmap(&mut self, r: DmaRange) -> Result<(), Refusal> {
        if let Some(nv) = self.nvme {
            return nv.with(self.table, true, |m, _| m.unmap(r.iova, r.size));
        }
        let Some(i) = self
            .maps
            .iter()
            .position(|m| m.iova == r.iova && m.size as u64 == r.size)
        else {
            return Err(invalid(format!(
                "DMA range {:#x}+{:#x} is not mapped as such",
                r.iova, r.size
            )));
        };
        self.f
            .container
            .vfio_dma_unmap(r.iova, self.maps[i].size)
            .map_err(|e| (PciStatus::Io, format!("VFIO_IOMMU_UNMAP_DMA: {e}")))?;
        self.mapped -= r.size;
        self.maps.swap_remove(i);
        Ok(())
    }

    /// Leaves the function as the next borrower should find it.
    pub(crate) fn quiesce(&mut self) {
        let f = self.f;
        // Out of its VM's peer group first: no peer reaches it any more, nor it them.
        self.peer = None;
        let enabled: Vec<u32> = {
            let mut t = self
                .table
                .fds
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let mut v: Vec<u32> = t.iter().map(|(i, _, _)| *i).collect();
            t.clear();
            v.dedup();
            v
        };
        for index in enabled {
            if let Err(e) = f.device.disable_irq(index) {
                tracing::warn!(bdf = %f.bdf, index, error = %e, "cannot disable an interrupt index");
            }
        }
        // Bus mastering off first: no DMA into a mirror about to be freed. Memory
        // decoding on, as VFIO opened it: the next session (its mediator) reads BAR 0
        // before its borrower writes the command register, and a borrower that turned
        // decoding off must not leave the function unusable.
        let command = |what: &str| {
            let mut cmd = [0u8; 2];
            if f.pread(VFIO_PCI_CONFIG_REGION_INDEX, 0x04, &mut cmd)
                .is_ok()
            {
                cmd[0] = (cmd[0] & !0x04) | 0x02;
                if let Err(e) = f.pwrite(VFIO_PCI_CONFIG_REGION_INDEX, 0x04, &cmd) {
                    tracing::warn!(bdf = %f.bdf, error = %e, "cannot {what}");
                }
            }
        };
        command("turn bus mastering off");
        f.device.reset();
        command("turn memory decoding back on after the reset");
        if let Some(nv) = self.nvme {
            // Bus mastering is off: the shadow queues and bounce buffers can go.
            nv.with(self.table, false, |m, _| m.reset());
        }
        for m in self.maps.drain(..) {
            if let Err(e) = f.container.vfio_dma_unmap(m.iova, m.size) {
                // The IOMMU still points at the mirror: keep its memory rather than free
                // memory a device may write.
                tracing::error!(bdf = %f.bdf, iova = m.iova, error = %e, "cannot unmap a mirror; its memory is kept");
                std::mem::forget(m);
            }
        }
        self.mapped = 0;
        self.cfg = VirtConfig::new(&f.layout);
    }
}
