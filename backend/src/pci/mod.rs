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
//! Why this file is over 600 lines: it holds the whole borrower of a function: the DMA maps
//! with their shadows, the mirror's pushes and pulls (`push`, `push_range`, `pull`,
//! `irq_loop`) and the vfio-user side (the `ServerBackend` impl, about 300 lines). The
//! mirror coherence could move to its own module beside `guest_mem` and is left here for
//! now; the planned reshaping of device kinds into types (issue 21) will split this file.

mod guest_mem;
pub mod link;

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write as _};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, PoisonError};

use devlend_fabric::pci::{
    decode_pages, decode_ranges, encode_page, encode_range, page_cost, Access, DmaRange, Irq,
    IrqAction, IrqSet, Message, PciInfo, Range, RemoteDmaRange, FLAG_MORE, INFO_MEDIATED,
    KIND_DMA_MAP, KIND_DMA_UNMAP, KIND_PULL, KIND_PUSH, KIND_READ, KIND_RESET, KIND_SET_IRQS,
    KIND_WRITE, MAX_ACCESS, MIRROR_PAGE, RDMA_MAX_RANGES,
};
use devlend_fabric::CoherenceMode;
use vfio_bindings::bindings::vfio::{
    vfio_region_info, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_TYPE_MASK,
    VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE,
    VFIO_IRQ_SET_DATA_TYPE_MASK, VFIO_PCI_ROM_REGION_INDEX,
};
use vfio_user::{DmaMapFlags, DmaUnmapFlags, IrqInfo, Server, ServerBackend, ServerRegion};
use vm_memory::VolatileSlice;

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
}

/// How one DMA map is kept coherent with the lender ([`Coherence`], per map).
enum MapSync {
    /// The lender keeps a mirror of the map: this is what the mirror holds, as far as
    /// the borrower knows (as long as the map).
    Mirror {
        /// The mirror's contents.
        shadow: Vec<u8>,
    },
    /// The lender mediates the function and moves guest memory itself: no shadow.
    Mediated,
}

/// One DMA mapping of the VMM's memory.
struct GuestMap {
    /// Over RDMA, the mapping's registration (dropped before the mapping).
    reg: Option<link::Registration>,
    iova: u64,
    size: usize,
    ptr: NonNull<u8>,
    /// How this map is kept coherent with the lender.
    sync: MapSync,
    /// The VMM's file, and the end of the mapped range in it (bytes).
    file: File,
    file_end: u64,
    /// Whether the file cannot shrink (F_SEAL_SHRINK).
    sealed: bool,
}

// SAFETY: the mapping belongs to this GuestMap alone and is touched only through
// volatile copies (the guest may write it at any time).
unsafe impl Send for GuestMap {}

impl GuestMap {
    /// Whether the VMM's file still covers the whole mapping: a shared mapping touched
    /// past its file's end raises SIGBUS, and a VMM may shrink its file after DMA_MAP.
    /// Checked before every pass over guest memory; a sealed file cannot shrink.
    fn intact(&self) -> bool {
        self.sealed || self.file.metadata().is_ok_and(|m| m.len() >= self.file_end)
    }

    fn slice(&self) -> VolatileSlice<'_> {
        // SAFETY: `ptr..ptr + size` is our live mapping while `self` lives.
        unsafe { VolatileSlice::new(self.ptr.as_ptr(), self.size) }
    }

    fn overlaps(&self, iova: u64, size: u64) -> bool {
        iova < self.iova + self.size as u64 && self.iova < iova.saturating_add(size)
    }
}

impl Drop for GuestMap {
    fn drop(&mut self) {
        drop(self.reg.take());
        // SAFETY: our own mapping, of this size; its registration is gone.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.size);
        }
    }
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
    stats: PciStats,
    /// Its address and IDs.
    identity: PciIdentity,
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

/// Makes sure the VMM's memory file cannot shrink under a DMA map: it is sealed against
/// shrinking already (QEMU's memfd backend seals its files), or the seal can be added
/// (a memfd created with MFD_ALLOW_SEALING). Otherwise (a plain file, hugetlbfs) the
/// map's [`GuestMap::intact`] checks the file's size before each pass.
fn seal_shrink(f: &File) -> bool {
    // SAFETY: fcntl on an open fd we own, with integer arguments only.
    let seals = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GET_SEALS) };
    if seals >= 0 && seals & libc::F_SEAL_SHRINK != 0 {
        return true;
    }
    // SAFETY: as above.
    seals >= 0 && unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } == 0
}

/// The refusal of a pass over a map whose file shrank under it.
fn shrunk(m: &GuestMap) -> io::Error {
    einval(format!(
        "the VMM's memory file behind DMA map {:#x}+{:#x} shrank below the mapped range; \
         its memory is not touched",
        m.iova, m.size
    ))
}

/// A refusal (EINVAL) with its reason; the VMM gets the errno, the log the reason
/// (`ServerBackend::refused`, rate-limited).
fn einval(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.into())
}

/// The name of vfio-user command `c`, for the log.
fn command_name(c: u16) -> String {
    match vfio_user::Command::n(c) {
        Some(c) => format!("{c:?}"),
        None => format!("unknown ({c})"),
    }
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
        let maps = Arc::new(guest_mem::Maps::default());
        let (link, info, irqs) =
            PciLink::connect(target, Arc::clone(&maps) as Arc<dyn GuestMemory>)
                .map_err(PciError::Connect)?;
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
            link,
            info,
            maps,
            eventfds: Mutex::new(HashMap::new()),
            lender_irqs: Mutex::new(HashMap::new()),
            stats: PciStats::default(),
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

    /// A vfio-user server for this function listening on `path` (which must not exist).
    ///
    /// # Errors
    /// [`PciError::Socket`].
    pub fn listen(&self, path: &Path) -> Result<Server, PciError> {
        let regions = self
            .shared
            .info
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| ServerRegion {
                region_info: vfio_region_info {
                    argsz: std::mem::size_of::<vfio_region_info>() as u32,
                    flags: r.flags,
                    index: i as u32,
                    cap_offset: 0,
                    size: r.size,
                    offset: 0,
                },
                sparse_areas: Vec::new(),
                mmap_fd: None,
            })
            .collect();
        let irqs = self
            .shared
            .info
            .irqs
            .iter()
            .enumerate()
            .map(|(i, q)| IrqInfo {
                index: i as u32,
                flags: q.flags,
                count: q.count,
            })
            .collect();
        Server::new(path, true, irqs, regions)
            .map(|s| s.with_max_dma_maps(MAX_DMA_MAPS))
            .map_err(|source| PciError::Socket {
                path: path.display().to_string(),
                source,
            })
    }

    /// Serves VMM connections on `server` one after the other, forever: when a VMM
    /// leaves, its DMA mappings and interrupts are dropped and the function reset, so
    /// that the next VMM finds it as new. Returns when the fabric session is gone.
    pub fn serve(&mut self, server: &Server) {
        loop {
            match server.run(self) {
                Ok(()) => devlend_fabric::limited!(info, "VMM left the vfio-user socket"),
                Err(e) => devlend_fabric::limited!(warn, error = %e, "vfio-user connection ended"),
            }
            if let Err(e) = self.vmm_gone() {
                tracing::warn!(error = %e, "the lender is gone; no more VMM connections");
                return;
            }
        }
    }

    /// Drops what a VMM set up: interrupts, DMA mappings, and resets the function.
    ///
    /// # Errors
    /// When the fabric session is gone.
    pub fn vmm_gone(&mut self) -> io::Result<()> {
        self.shared
            .eventfds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let indexes: Vec<u32> = self
            .shared
            .lender_irqs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(i, _)| i)
            .collect();
        for index in indexes {
            self.irq_action(index, IrqAction::Disable, 0)?;
        }
        self.unmap_all()?;
        self.reset()
    }

    /// Has the lender signal vectors `0..need` of `index` (none: disabled). It enables
    /// whole ranges from vector 0 (as VFIO does), so a range that grows is disabled and
    /// enabled again; it shrinks only to nothing (the borrower drops an interrupt whose
    /// vector has no eventfd).
    fn lender_vectors(&self, index: u32, need: u32) -> io::Result<()> {
        let have = self
            .shared
            .lender_irqs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&index)
            .copied()
            .unwrap_or(0);
        if have > 0 && (need == 0 || need > have) {
            self.irq_action(index, IrqAction::Disable, 0)?;
            self.set_lender_count(index, 0);
        }
        if need > have {
            self.irq_action(index, IrqAction::Enable, need)?;
            self.set_lender_count(index, need);
        }
        Ok(())
    }

    fn set_lender_count(&self, index: u32, n: u32) {
        let mut l = self
            .shared
            .lender_irqs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if n == 0 {
            l.remove(&index);
        } else {
            l.insert(index, n);
        }
    }

    fn irq_action(&self, index: u32, action: IrqAction, count: u32) -> io::Result<()> {
        let p = IrqSet {
            index,
            action,
            count,
        }
        .encode();
        self.shared
            .link
            .call(Message::new(KIND_SET_IRQS, p))
            .map(|_| ())
            .map_err(link_err)
    }

    fn unmap_all(&self) -> io::Result<()> {
        let ranges: Vec<DmaRange> = self
            .shared
            .maps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|m| DmaRange {
                iova: m.iova,
                size: m.size as u64,
            })
            .collect();
        for r in ranges {
            self.unmap_one(r)?;
        }
        Ok(())
    }

    /// Has the lender unmap `r`, then drops the map here (not before: the lender's
    /// writes sent before its reply are applied to it, in stream order).
    fn unmap_one(&self, r: DmaRange) -> io::Result<()> {
        self.shared
            .link
            .call(Message::new(KIND_DMA_UNMAP, r.encode()))
            .map_err(link_err)?;
        self.shared
            .maps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|m| !(m.iova == r.iova && m.size as u64 == r.size));
        Ok(())
    }

    /// Pushes the DMA-mapped guest pages that changed since last synced: over TCP with
    /// their bytes, over RDMA as IOVA ranges the lender reads one-sided.
    fn push(&self, maps: &mut [GuestMap]) -> io::Result<()> {
        let rdma = self.shared.link.is_rdma();
        let page = MIRROR_PAGE as usize;
        let mut buf = vec![0u8; page];
        let mut chunk = Vec::new();
        let mut pushed = 0u64;
        // Over RDMA: the run of changed pages being built (IOVA, bytes).
        let mut run: Option<(u64, u32)> = None;
        for m in maps.iter_mut() {
            if !m.intact() {
                return Err(shrunk(m));
            }
            // SAFETY: `ptr..ptr + size` is the map's live mapping while `m` lives; built
            // from the raw parts so that the shadow may be borrowed beside it.
            let slice = unsafe { VolatileSlice::new(m.ptr.as_ptr(), m.size) };
            for off in (0..m.size).step_by(page) {
                let Ok(s) = slice.subslice(off, page) else {
                    break;
                };
                // A mediated map has no mirror to push to.
                let MapSync::Mirror { shadow } = &mut m.sync else {
                    break;
                };
                let Some(shadow) = shadow.get_mut(off..off + page) else {
                    break;
                };
                s.copy_to(&mut buf[..]);
                if shadow == buf.as_slice() {
                    continue;
                }
                shadow.copy_from_slice(&buf);
                pushed += 1;
                let iova = m.iova + off as u64;
                if rdma {
                    run = match run {
                        Some((start, len))
                            if start + u64::from(len) == iova
                                && len as usize + page <= RDMA_MAX_RUN =>
                        {
                            Some((start, len + page as u32))
                        }
                        Some((start, len)) => {
                            self.push_range(&mut chunk, Range { iova: start, len })?;
                            Some((iova, page as u32))
                        }
                        None => Some((iova, page as u32)),
                    };
                    continue;
                }
                if chunk.len() + page_cost(page) > MAX_ACCESS as usize {
                    let mut msg = Message::new(KIND_PUSH, std::mem::take(&mut chunk));
                    msg.flags = FLAG_MORE;
                    self.shared.link.send(&msg).map_err(link_err)?;
                }
                encode_page(iova, &buf, &mut chunk);
            }
            // Runs do not cross maps (each has its own registration).
            if let Some((start, len)) = run.take() {
                self.push_range(&mut chunk, Range { iova: start, len })?;
            }
        }
        if pushed == 0 {
            return Ok(());
        }
        self.shared
            .stats
            .pages_pushed
            .fetch_add(pushed, Ordering::Relaxed);
        self.shared
            .link
            .call(Message::new(KIND_PUSH, chunk))
            .map(|_| ())
            .map_err(link_err)
    }

    /// Adds a range to an RDMA push, sending the chunk first when it is full.
    fn push_range(&self, chunk: &mut Vec<u8>, r: Range) -> io::Result<()> {
        if chunk.len() / 16 >= RDMA_MAX_RANGES {
            let mut msg = Message::new(KIND_PUSH, std::mem::take(chunk));
            msg.flags = FLAG_MORE;
            self.shared.link.send(&msg).map_err(link_err)?;
        }
        encode_range(r, chunk);
        Ok(())
    }
}

/// Longest run of pages one range of an RDMA push names, in bytes (1 MiB: one RDMA
/// READ of the lender's).
const RDMA_MAX_RUN: usize = 1 << 20;

/// Pulls the pages the function changed into guest memory: over TCP their bytes come in
/// the replies; over RDMA the lender wrote them already and the replies name their
/// ranges, which the shadow then takes from guest memory.
fn pull(shared: &Borrowed, maps: &mut [GuestMap]) -> Result<(), LinkError> {
    if maps.is_empty() {
        return Ok(());
    }
    let replies = shared.link.call(Message::new(KIND_PULL, Vec::new()))?;
    let protocol = |e: devlend_fabric::WireError| LinkError::Protocol(e.to_string());
    let mut n = 0;
    for r in &replies {
        let moved: Vec<(u64, Option<&[u8]>, usize)> = if shared.link.is_rdma() {
            decode_ranges(&r.payload)
                .map_err(protocol)?
                .into_iter()
                .map(|x| (x.iova, None, x.len as usize))
                .collect()
        } else {
            decode_pages(&r.payload)
                .map_err(protocol)?
                .into_iter()
                .map(|p| (p.iova, Some(p.data), p.data.len()))
                .collect()
        };
        for (iova, data, len) in moved {
            let Some(m) = maps
                .iter_mut()
                .find(|m| iova >= m.iova && iova - m.iova + len as u64 <= m.size as u64)
            else {
                return Err(LinkError::Protocol(format!(
                    "pulled {len} bytes at IOVA {iova:#x} outside every mapping"
                )));
            };
            if !m.intact() {
                return Err(LinkError::Protocol(shrunk(m).to_string()));
            }
            let off = (iova - m.iova) as usize;
            // SAFETY: `ptr..ptr + size` is the map's live mapping while `m` lives; built
            // from the raw parts so that the shadow may be borrowed beside it.
            let slice = unsafe { VolatileSlice::new(m.ptr.as_ptr(), m.size) };
            if let Ok(s) = slice.subslice(off, len) {
                if let Some(d) = data {
                    s.copy_from(d);
                }
                // The mirror now holds what guest memory does.
                if let MapSync::Mirror { shadow } = &mut m.sync {
                    if let Some(shadow) = shadow.get_mut(off..off + len) {
                        match data {
                            Some(d) => shadow.copy_from_slice(d),
                            None => {
                                s.copy_to(shadow);
                            }
                        }
                    }
                }
            }
            n += len.div_ceil(MIRROR_PAGE as usize) as u64;
        }
    }
    shared.stats.pages_pulled.fetch_add(n, Ordering::Relaxed);
    Ok(())
}

/// Delivers the lender's interrupts: pull what the function wrote, then signal the
/// VMM's eventfd. Ends with the fabric session.
fn irq_loop(shared: &Borrowed, irqs: Receiver<Irq>) {
    let mediated = shared.info.flags & INFO_MEDIATED != 0;
    for irq in irqs {
        if !mediated {
            let mut maps = shared.maps.lock().unwrap_or_else(PoisonError::into_inner);
            if let Err(e) = pull(shared, &mut maps) {
                devlend_fabric::limited!(warn, error = %e, "pull after an interrupt failed");
            }
        }
        let fds = shared
            .eventfds
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match fds.get(&(irq.index, irq.vector)) {
            Some(mut f) => {
                if let Err(e) = f.write_all(&1u64.to_ne_bytes()) {
                    devlend_fabric::limited!(warn, error = %e, "cannot signal the VMM's eventfd");
                }
                shared.stats.irqs.fetch_add(1, Ordering::Relaxed);
            }
            None => tracing::debug!(?irq, "interrupt without an eventfd; dropped"),
        }
    }
    tracing::debug!("interrupt thread ends with the fabric session");
}

impl ServerBackend for PciBorrower {
    fn refused(&mut self, command: u16, errno: u32, error: &vfio_user::Error) {
        let reason = match error {
            vfio_user::Error::Backend(e) => e.to_string(),
            e => e.to_string(),
        };
        devlend_fabric::limited!(
            info,
            command = %command_name(command),
            errno,
            %reason,
            "vfio-user request refused"
        );
    }

    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        let max = self.shared.link.max_access() as usize;
        for (i, chunk) in data.chunks_mut(max).enumerate() {
            let off = offset
                .checked_add((i * max) as u64)
                .ok_or_else(|| einval("offset overflows"))?;
            let a = Access {
                region,
                len: chunk.len() as u32,
                offset: off,
            };
            let r = self
                .shared
                .link
                .call(Message::new(KIND_READ, a.encode()))
                .map_err(link_err)?;
            if r[0].payload.len() != chunk.len() {
                return Err(io::Error::other("short read from the lender"));
            }
            chunk.copy_from_slice(&r[0].payload);
        }
        self.shared.stats.reads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        if region < VFIO_PCI_ROM_REGION_INDEX && self.shared.info.flags & INFO_MEDIATED == 0 {
            // A BAR write may start DMA: the mirror must hold guest memory first.
            let mut maps = self
                .shared
                .maps
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !maps.is_empty() {
                self.push(&mut maps)?;
            }
        }
        let max = self.shared.link.max_access() as usize;
        for (i, chunk) in data.chunks(max).enumerate() {
            let off = offset
                .checked_add((i * max) as u64)
                .ok_or_else(|| einval("offset overflows"))?;
            let mut p = Access {
                region,
                len: chunk.len() as u32,
                offset: off,
            }
            .encode();
            p.extend_from_slice(chunk);
            self.shared
                .link
                .call(Message::new(KIND_WRITE, p))
                .map_err(link_err)?;
        }
        self.shared.stats.writes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn dma_map(
        &mut self,
        _flags: DmaMapFlags,
        offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> io::Result<()> {
        let Some(fd) = fd else {
            return Err(einval(
                "DMA_MAP without a file descriptor (DMA_READ/DMA_WRITE are not supported)",
            ));
        };
        let r = DmaRange {
            iova: address,
            size,
        };
        // The lender checks too; checking here first keeps a bad map from mmap.
        DmaRange::decode(&r.encode()).map_err(|_| {
            einval(format!(
                "DMA range {address:#x}+{size:#x} is not page-aligned"
            ))
        })?;
        if !offset.is_multiple_of(MIRROR_PAGE) {
            return Err(einval("DMA_MAP offset is not page-aligned"));
        }
        let len = usize::try_from(size).map_err(|_| einval("DMA range too large"))?;
        let file_off = libc::off_t::try_from(offset).map_err(|_| einval("DMA_MAP offset"))?;
        let mut maps = self
            .shared
            .maps
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(m) = maps.iter().find(|m| m.overlaps(address, size)) {
            return Err(einval(format!(
                "DMA range {address:#x}+{size:#x} overlaps the mapped {:#x}+{:#x}",
                m.iova, m.size
            )));
        }
        if maps.len() >= MAX_DMA_MAPS as usize {
            // ENOSPC, as VFIO's type1 IOMMU answers past its dma_entry_limit.
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!(
                    "DMA range {address:#x}+{size:#x}: the VMM holds {MAX_DMA_MAPS} DMA maps already, the most it may (max_dma_maps)"
                ),
            ));
        }
        // Before mapping or allocating anything: within the mirror limit, and within the
        // VMM's file (reading a shared mapping past the file's end raises SIGBUS).
        let mapped: u64 = maps.iter().map(|m| m.size as u64).sum();
        if mapped.saturating_add(size) > devlend_fabric::pci::MAX_MIRROR_BYTES {
            return Err(einval(format!(
                "DMA range {address:#x}+{size:#x} passes the mirror limit of {:#x} bytes",
                devlend_fabric::pci::MAX_MIRROR_BYTES
            )));
        }
        let file_len = fd.metadata()?.len();
        if offset.checked_add(size).is_none_or(|end| end > file_len) {
            return Err(einval(format!(
                "DMA_MAP of {size:#x} bytes at offset {offset:#x} passes the end of the VMM's file ({file_len:#x} bytes)"
            )));
        }
        let ptr = crate::shared_map::map_shared(fd.as_raw_fd(), len, file_off)?;
        let mediated = self.shared.info.flags & INFO_MEDIATED != 0;
        let sealed = seal_shrink(&fd);
        let mut map = GuestMap {
            reg: None,
            iova: address,
            size: len,
            ptr,
            sync: if mediated {
                MapSync::Mediated
            } else {
                MapSync::Mirror {
                    shadow: vec![0; len],
                }
            },
            file: fd,
            file_end: offset + size,
            sealed,
        };
        // SAFETY: the mapping lives in `map`, which drops the registration first.
        map.reg = unsafe { self.shared.link.register(ptr.as_ptr(), len) }.map_err(link_err)?;
        let payload = match &map.reg {
            Some(reg) => {
                let (addr, rkey) = reg.remote();
                RemoteDmaRange {
                    range: r,
                    addr,
                    rkey,
                }
                .encode()
            }
            None => r.encode(),
        };
        if !mediated {
            self.shared
                .link
                .call(Message::new(KIND_DMA_MAP, payload))
                .map_err(link_err)?;
            maps.push(map);
            return Ok(());
        }
        // Mapped here before the lender knows of it (its accesses come from the reader
        // thread, which takes `maps`): the map is in place for the first of them, and
        // `maps` is not held across the call.
        maps.push(map);
        drop(maps);
        if let Err(e) = self.shared.link.call(Message::new(KIND_DMA_MAP, payload)) {
            self.shared
                .maps
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .retain(|m| !(m.iova == address && m.size == len));
            return Err(link_err(e));
        }
        Ok(())
    }

    fn dma_unmap(&mut self, flags: DmaUnmapFlags, address: u64, size: u64) -> io::Result<()> {
        if flags.contains(DmaUnmapFlags::UNMAP_ALL) {
            return self.unmap_all();
        }
        let known = self
            .shared
            .maps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(|m| m.iova == address && m.size as u64 == size);
        if !known {
            return Err(einval(format!(
                "DMA range {address:#x}+{size:#x} is not mapped as such"
            )));
        }
        self.unmap_one(DmaRange {
            iova: address,
            size,
        })
    }

    fn reset(&mut self) -> io::Result<()> {
        self.shared
            .link
            .call(Message::new(KIND_RESET, Vec::new()))
            .map(|_| ())
            .map_err(link_err)
    }

    fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> io::Result<()> {
        let data = flags & VFIO_IRQ_SET_DATA_TYPE_MASK;
        let action = flags & VFIO_IRQ_SET_ACTION_TYPE_MASK;
        match (action, data) {
            (VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD) if count > 0 => {
                // QEMU sends a partial update per run of vectors: eventfds for a run
                // it uses, none for a run it does not (its fd -1).
                if !fds.is_empty() && fds.len() != count as usize {
                    return Err(einval(format!(
                        "SET_IRQS: {} eventfds for vectors {start}..+{count}",
                        fds.len()
                    )));
                }
                let end = start
                    .checked_add(count)
                    .filter(|&e| {
                        self.shared
                            .info
                            .irqs
                            .get(index as usize)
                            .is_some_and(|q| e <= q.count)
                    })
                    .ok_or_else(|| {
                        einval(format!(
                            "SET_IRQS: vectors {start}..+{count} of index {index} out of range"
                        ))
                    })?;
                {
                    let mut e = self
                        .shared
                        .eventfds
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    e.retain(|(i, v), _| !(*i == index && (start..end).contains(v)));
                    for (v, f) in (start..end).zip(fds) {
                        e.insert((index, v), f);
                    }
                }
                // As VFIO: the vectors named stay enabled, with or without an eventfd (a
                // device may need its interrupts enabled before it is set up: QEMU's
                // emulated NVMe only signals a vector that was enabled when the queue
                // using it was created).
                let have = self
                    .shared
                    .lender_irqs
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&index)
                    .copied()
                    .unwrap_or(0);
                self.lender_vectors(index, have.max(end))
            }
            (VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_DATA_EVENTFD)
                if count == 0 =>
            {
                self.shared
                    .eventfds
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .retain(|(i, _), _| *i != index);
                self.lender_vectors(index, 0)
            }
            (VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_NONE) => {
                self.irq_action(index, IrqAction::Unmask, 0)
            }
            _ => Err(einval(format!(
                "SET_IRQS flags {flags:#x} on index {index} are not supported"
            ))),
        }
    }
}
