//! The borrower of a PCIe function: a vfio-user server (the `vfio_user` crate's
//! [`Server`] and [`ServerBackend`]) on a unix socket, in front of a fabric session to
//! the lender ([`link`]).
//!
//! A VMM joins the socket (Cloud Hypervisor `--user-device socket=PATH`, QEMU 11
//! `-device vfio-user-pci,socket=PATH`) and sees the function as the lender reports it:
//! its regions (BARs, the virtualized config space) and interrupt indexes. Region reads
//! and writes go to the lender (no region is offered for mmap: every access is a
//! message); DMA_MAP maps the VMM's memory fd here and has the lender map a mirror at the
//! same IOVA; interrupts from the lender are written to the VMM's eventfds.
//!
//! # Coherence mode `mirror`
//!
//! The function on the lender works on the mirror, so the borrower keeps guest memory and
//! mirror in step around the two events that order DMA for a driver:
//! - **before a BAR write** (the doorbell that may start DMA): every page of the
//!   DMA-mapped guest memory that differs from the borrower's shadow copy is pushed
//!   ([`devlend_fabric::pci::KIND_PUSH`]), and the shadow updated;
//! - **after an interrupt, before it reaches the VMM's eventfd**: the lender sends the
//!   mirror pages that differ from what it last synced ([`devlend_fabric::pci::KIND_PULL`]);
//!   they are written into guest memory and the shadow.
//!
//! Cost: the borrower holds a shadow as large as the mapped memory and compares all of
//! it (`memcmp`, page by page) on every BAR write; the lender does the same on every
//! interrupt. Only changed pages cross the fabric. That suits functions whose drivers
//! map little memory and ring doorbells rarely (FPGAs, accelerators, test devices); it
//! does not suit an SSD or a NIC whose driver maps all guest RAM and writes a doorbell
//! per request (see `docs/pci.md`).
//!
//! # Mediated functions (coherence mode `nvme`)
//!
//! When the lender reports [`INFO_MEDIATED`], it keeps no mirror: it reads and writes
//! guest memory itself ([`devlend_fabric::pci::KIND_MEM_READ`],
//! [`devlend_fabric::pci::KIND_MEM_WRITE`]), served by the link's reader from the DMA
//! maps ([`guest_mem`]). The borrower then neither pushes, pulls nor keeps a shadow.
//!
//! # Peer-to-peer (one VM's functions)
//!
//! A borrower given the VM's identity ([`PciBorrower::connect_in_group`]) sends it to
//! the lender ([`devlend_fabric::pci::KIND_PEER_GROUP`]) right after the INFO, before
//! any DMA map; the lender then lets the function's DMA reach the BARs of the other
//! functions it lends to that VM. A lender that refuses fails the connect. The lender's
//! DMA counters notes (guest memory read and written, bytes moved to or from a peer)
//! land in [`PciStats`].
//!
//! Modules, one job each: `dma` (the DMA maps), `mirror` (pushes and pulls of the
//! mirror), `irq` (interrupts both ways), `server` (the vfio-user side), [`link`]
//! (the fabric session) and `guest_mem` (a mediated function's guest memory accesses).

mod dma;
#[cfg(test)]
mod fake_link;
mod guest_mem;
mod irq;
pub mod link;
mod mirror;
mod server;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};

use devlend_fabric::pci::{
    Access, Message, PciInfo, PeerGroup, INFO_MEDIATED, KIND_PEER_GROUP, KIND_READ, VM_ID_LEN,
};
use devlend_fabric::CoherenceMode;

use irq::irq_loop;

pub use link::{
    GuestMemory, LinkCounters, LinkError, LinkTarget, NoGuestMemory, PciLink, Registration,
};

/// Why the borrower could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum PciError {
    /// The fabric session could not be opened (or was refused).
    #[error("opening the PCI session")]
    Connect(#[source] devlend_fabric::tcp::ConnectError),
    /// The vfio-user socket could not be created.
    #[error("vfio-user socket {path}")]
    Socket {
        /// The socket's path.
        path: String,
        /// Why.
        #[source]
        source: vfio_user::Error,
    },
    /// The interrupt thread could not be started.
    #[error("starting the interrupt thread")]
    Thread(#[source] io::Error),
    /// The lender did not put the function in the VM's peer group: its refusal (with
    /// its reason), or the session failing meanwhile.
    #[error("joining the VM's peer group on the lender")]
    PeerGroup(#[source] LinkError),
    /// A VM identity of zeros, which no lender accepts (it must be random).
    #[error("a VM identity of zeros: it must be random")]
    ZeroVm,
    /// The lender's handshake description and its INFO disagree on how the function's
    /// DMA is kept coherent: a lender that cannot be served safely.
    #[error("the lender describes the function as {described:?} but its INFO says {info:?}")]
    CoherenceMismatch {
        /// The handshake description's mode.
        described: CoherenceMode,
        /// What the INFO's `INFO_MEDIATED` flag says.
        info: CoherenceMode,
    },
}

/// Most DMA maps a VMM may hold at once on one borrowed function (advertised to it as
/// vfio-user's `max_dma_maps`; a map past it is refused with ENOSPC). Each map is an
/// mmap of the agent's, which all its attachments share (`vm.max_map_count`); a VMM
/// maps each RAM section once (a handful, a few hundred with many hot-plugged DIMMs).
pub const MAX_DMA_MAPS: u32 = 1024;

/// Who a borrowed function is: its address on the lender and its PCI IDs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PciIdentity {
    /// The function's address on the lender (`DDDD:BB:DD.F`), as the lender describes
    /// it in the handshake.
    pub bdf: String,
    /// PCI vendor ID, read from the function's config space at attach; `None` when the
    /// lender did not answer that read.
    pub vendor_id: Option<u16>,
    /// PCI device ID, as `vendor_id`.
    pub device_id: Option<u16>,
}

/// Counters of one borrowed function.
#[derive(Debug, Default)]
pub struct PciStats {
    /// Region reads forwarded.
    pub reads: AtomicU64,
    /// Region writes forwarded.
    pub writes: AtomicU64,
    /// Pages pushed to the mirror.
    pub pages_pushed: AtomicU64,
    /// Pages pulled from the mirror.
    pub pages_pulled: AtomicU64,
    /// Interrupts delivered to the VMM.
    pub irqs: AtomicU64,
    /// Bytes of guest memory the lender read for the function (a mediated function's
    /// fetches), as its DMA counters notes say; summed over sessions.
    pub lender_guest_read_bytes: AtomicU64,
    /// Bytes the lender wrote to guest memory from the function, as its notes say.
    pub lender_guest_written_bytes: AtomicU64,
    /// Bytes the function moved straight to or from a peer function's BAR
    /// (peer-to-peer, never through guest memory), as the lender's notes say.
    pub peer_bytes: AtomicU64,
}

/// What the vfio-user thread and the interrupt thread share.
struct Borrowed {
    link: PciLink,
    info: PciInfo,
    /// Guest memory mapped for DMA. Lock order: `maps`, then a call on `link` (a
    /// mediated function's lender reads and writes the maps from the link's reader:
    /// then no call is made with `maps` held).
    maps: Arc<guest_mem::Maps>,
    /// The VMM's eventfds by (interrupt index, vector).
    eventfds: Mutex<HashMap<(u32, u32), File>>,
    /// Vectors enabled on the lender, by interrupt index (from vector 0).
    lender_irqs: Mutex<HashMap<u32, u32>>,
    /// Shared with the link, whose reader adds the lender's DMA counters.
    stats: Arc<PciStats>,
    /// Its address and IDs.
    identity: PciIdentity,
    /// The VM's identity sent to the lender, if any.
    peer_group: Option<[u8; VM_ID_LEN]>,
}

/// A handle on a [`PciBorrower`] served by another thread: its counters, and a way to
/// drop its fabric session.
#[derive(Clone)]
pub struct PciHandle(Arc<Borrowed>);

impl PciHandle {
    /// The counters.
    pub fn stats(&self) -> &PciStats {
        &self.0.stats
    }

    /// Whether the fabric session to the lender has ended.
    pub fn session_closed(&self) -> bool {
        self.0.link.is_closed()
    }

    /// As [`PciBorrower::disconnect`].
    pub fn disconnect(&self) {
        self.0.link.shutdown();
    }

    /// The fabric traffic of the session so far.
    pub fn link_counters(&self) -> &LinkCounters {
        self.0.link.counters()
    }

    /// Whether the lender mediates the function ([`INFO_MEDIATED`]).
    pub fn mediated(&self) -> bool {
        self.0.info.flags & INFO_MEDIATED != 0
    }

    /// How DMA-mapped guest memory is kept coherent with the lender.
    pub fn coherence(&self) -> CoherenceMode {
        if self.mediated() {
            CoherenceMode::Mediated
        } else {
            CoherenceMode::Mirror
        }
    }

    /// The function's address and IDs.
    pub fn identity(&self) -> &PciIdentity {
        &self.0.identity
    }

    /// The VM's identity the function was put in the peer group of, if any
    /// ([`PciBorrower::connect_in_group`]).
    pub fn peer_group(&self) -> Option<[u8; VM_ID_LEN]> {
        self.0.peer_group
    }

    /// Bytes of the VMM's memory mapped for DMA now (summed over its DMA maps).
    pub fn dma_mapped_bytes(&self) -> u64 {
        let maps = self.0.maps.lock().unwrap_or_else(PoisonError::into_inner);
        maps.iter().map(|m| m.size as u64).sum()
    }
}

/// Reads the vendor and device IDs (the first 4 bytes of config space) from the lender;
/// `None` when it does not answer.
fn read_ids(link: &PciLink) -> Option<(u16, u16)> {
    let a = Access {
        region: vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX,
        len: 4,
        offset: 0,
    };
    let r = link.call(Message::new(KIND_READ, a.encode())).ok()?;
    let b = r.first()?.payload.get(..4)?;
    Some((
        u16::from_le_bytes([b[0], b[1]]),
        u16::from_le_bytes([b[2], b[3]]),
    ))
}

/// A borrowed PCIe function, served to one VMM at a time over vfio-user.
pub struct PciBorrower {
    shared: Arc<Borrowed>,
}

impl Drop for PciBorrower {
    fn drop(&mut self) {
        // Ends the reader, hence the interrupt thread and its share of `Borrowed`.
        self.shared.link.shutdown();
    }
}

/// A refusal (EINVAL) with its reason; the VMM gets the errno, the log the reason
/// (`ServerBackend::refused`, rate-limited).
fn einval(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.into())
}

fn link_err(e: LinkError) -> io::Error {
    match e {
        LinkError::Refused { .. } => einval(e.to_string()),
        e => io::Error::new(io::ErrorKind::BrokenPipe, e.to_string()),
    }
}

impl PciBorrower {
    /// Opens the fabric session and starts the interrupt thread.
    ///
    /// # Errors
    /// [`PciError::Connect`] (the lender's refusal included), [`PciError::Thread`].
    pub fn connect(target: &LinkTarget) -> Result<PciBorrower, PciError> {
        PciBorrower::connect_in_group(target, None)
    }

    /// As [`Self::connect`], and with `peer_group` (the identity of the VM the
    /// function is lent to, random and the same for all of that VM's functions) has
    /// the lender put the function in that VM's peer group, before any DMA map: the
    /// function's DMA then reaches the BARs of the VM's other functions on that lender,
    /// and theirs its BARs. `None`: no peer group (as [`Self::connect`]).
    ///
    /// # Errors
    /// As [`Self::connect`]; [`PciError::PeerGroup`] when the lender refuses (its
    /// reason in the source), [`PciError::ZeroVm`].
    pub fn connect_in_group(
        target: &LinkTarget,
        peer_group: Option<[u8; VM_ID_LEN]>,
    ) -> Result<PciBorrower, PciError> {
        if peer_group == Some([0; VM_ID_LEN]) {
            return Err(PciError::ZeroVm);
        }
        let maps = Arc::new(guest_mem::Maps::default());
        let (link, info, irqs) =
            PciLink::connect(target, Arc::clone(&maps) as Arc<dyn GuestMemory>)
                .map_err(PciError::Connect)?;
        PciBorrower::start(link, info, irqs, maps, peer_group)
    }

    /// Checks the lender's description against its INFO, joins the VM's peer group
    /// (first thing after the INFO, before any DMA map), reads the function's IDs when
    /// the lender did not describe them, and starts the interrupt thread.
    fn start(
        link: PciLink,
        info: PciInfo,
        irqs: std::sync::mpsc::Receiver<devlend_fabric::pci::Irq>,
        maps: Arc<guest_mem::Maps>,
        peer_group: Option<[u8; VM_ID_LEN]>,
    ) -> Result<PciBorrower, PciError> {
        let lent = link.lent();
        // A version 2 lender describes the function (a vendor ID is never 0) with its
        // coherence mode, which its INFO must repeat; a version 1 lender says it in the
        // INFO alone.
        let info_mode = if info.flags & INFO_MEDIATED != 0 {
            CoherenceMode::Mediated
        } else {
            CoherenceMode::Mirror
        };
        let described = lent.vendor_id != 0 || lent.device_id != 0;
        if described && lent.coherence != info_mode {
            return Err(PciError::CoherenceMismatch {
                described: lent.coherence,
                info: info_mode,
            });
        }
        maps.set_mediated(info_mode == CoherenceMode::Mediated);
        if let Some(vm) = peer_group {
            link.call(Message::new(KIND_PEER_GROUP, PeerGroup { vm }.encode()))
                .map_err(PciError::PeerGroup)?;
        }
        // A version 2 lender describes the IDs; from a version 1 lender (zeros) they are
        // read from the function's config space.
        let ids = if lent.vendor_id != 0 || lent.device_id != 0 {
            Some((lent.vendor_id, lent.device_id))
        } else {
            read_ids(&link)
        };
        if ids.is_none() {
            tracing::debug!("the lender did not answer the read of the function's IDs");
        }
        let identity = PciIdentity {
            bdf: lent.bdf.clone(),
            vendor_id: ids.map(|i| i.0),
            device_id: ids.map(|i| i.1),
        };
        let shared = Arc::new(Borrowed {
            identity,
            stats: link.shared_stats(),
            link,
            info,
            maps,
            eventfds: Mutex::new(HashMap::new()),
            lender_irqs: Mutex::new(HashMap::new()),
            peer_group,
        });
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("devlend-pci-irq".into())
            .spawn(move || irq_loop(&s, irqs))
            .map_err(PciError::Thread)?;
        Ok(PciBorrower { shared })
    }

    /// The function as the lender reports it.
    pub fn info(&self) -> &PciInfo {
        &self.shared.info
    }

    /// The counters.
    pub fn stats(&self) -> &PciStats {
        &self.shared.stats
    }

    /// Shuts the fabric session down (as a lost network would): the lender quiesces the
    /// function and may lend it again.
    pub fn disconnect(&self) {
        self.shared.link.shutdown();
    }

    /// A handle that outlives moving the borrower into its serving thread.
    pub fn handle(&self) -> PciHandle {
        PciHandle(Arc::clone(&self.shared))
    }
}
