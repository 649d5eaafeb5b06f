//! One PCI session: the borrower's requests on a lent function, answered in order, and
//! the function's interrupts sent as they come (from a second thread, under the same
//! write lock, so that messages never interleave).
//!
//! A malformed message (unknown kind, bad length, reserved bits) ends the session with
//! the reason logged. A well-formed request the lender will not do (a region index out
//! of range, an offset past a BAR, a DMA range that overlaps a mapped one) is answered
//! with an error status and the session goes on. When the session ends, however it
//! ends, the function is quiesced for the next borrower: interrupts disabled, bus
//! mastering turned off, VFIO_DEVICE_RESET (when the function supports a reset), every
//! mirror unmapped from the IOMMU and freed.
//!
//! In coherence mode `nvme` the session has a [`Mediator`] instead of mirrors: BAR0's
//! controller registers and doorbells go to it (from the request loop, which may read
//! guest memory), the function's interrupts too (from the interrupt thread, which only
//! writes guest memory and raises the guest's interrupts), and DMA maps are only
//! recorded.

use std::io::Read;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use devlend_fabric::conn::Stream;
use devlend_fabric::pci::{
    decode_pages, encode_page, page_cost, Access, DmaRange, Irq, IrqAction, IrqSet, Message,
    PciStatus, FLAG_MORE, KIND_DMA_MAP, KIND_DMA_UNMAP, KIND_INFO, KIND_IRQ, KIND_PULL, KIND_PUSH,
    KIND_READ, KIND_RESET, KIND_SET_IRQS, KIND_WRITE, MAX_ACCESS, REPLY,
};
use devlend_fabric::WireError;
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vmm_sys_util::eventfd::EventFd;

use super::config::VirtConfig;
use super::guest_access::{AccessCounters, TcpGuest};
use super::mirror::Mirror;
use super::nvme::{Handled, Mediator};
use super::PciFunction;
use crate::config::Coherence;
use crate::engine::End;

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

/// How often the interrupt thread looks at its stop flag when no interrupt comes.
const IRQ_POLL: Duration = Duration::from_millis(200);
/// With the NVMe mediator, how often it also looks at the shadow completion queues when
/// no interrupt comes (a controller interrupt may be lost while vectors are re-enabled).
const NVME_IDLE_POLL: Duration = Duration::from_millis(10);

/// A refusal: the status and the reason sent back.
pub(super) type Refusal = (PciStatus, String);
/// The answer to a request: the reply's payload, or a refusal.
pub(super) type Answer = Result<Vec<u8>, Refusal>;

pub(super) fn invalid(reason: impl Into<String>) -> Refusal {
    (PciStatus::Invalid, reason.into())
}

/// The mediator of a session in coherence mode `nvme`, and what it needs to reach guest
/// memory over the session's stream.
struct Nvme<'a> {
    mediator: Mutex<Mediator>,
    counters: Mutex<AccessCounters>,
    /// Why the borrower broke the protocol during a guest memory read, if it did.
    broken: Mutex<Option<String>>,
    sock: &'a Stream,
    writer: &'a Mutex<()>,
    timeout: Duration,
}

impl Nvme<'_> {
    /// Runs `op` on the mediator with guest access from the request loop (`can_read`)
    /// or the interrupt thread, which raises interrupts of the vectors in `table`.
    fn with<T>(
        &self,
        table: &IrqTable,
        can_read: bool,
        op: impl FnOnce(&mut Mediator, &mut TcpGuest<'_>) -> T,
    ) -> T {
        let index_of = |v: u32| table.index_of(v);
        let mut g = TcpGuest {
            sock: self.sock,
            writer: self.writer,
            timeout: self.timeout,
            can_read,
            index_of: &index_of,
            counters: &self.counters,
            broken: &self.broken,
        };
        let mut m = self.mediator.lock().unwrap_or_else(PoisonError::into_inner);
        op(&mut m, &mut g)
    }
}

/// The eventfds VFIO signals, shared with the interrupt thread.
pub(super) struct IrqTable {
    /// `(index, vector, eventfd)` of every enabled vector.
    pub(super) fds: Mutex<Vec<(u32, u32, Arc<EventFd>)>>,
    /// Wakes the interrupt thread to re-read `fds`.
    wake: EventFd,
    stop: AtomicBool,
}

impl IrqTable {
    /// The interrupt index enabled for `vector`: MSI-X before MSI before INTx.
    pub(super) fn index_of(&self, vector: u32) -> Option<u32> {
        let t = self.fds.lock().unwrap_or_else(PoisonError::into_inner);
        [2u32, 1, 0]
            .into_iter()
            .find(|i| t.iter().any(|(x, v, _)| x == i && *v == vector))
    }
}

/// Serves one borrower's session on `f` until it closes or breaks the protocol, then
/// quiesces the function.
///
/// Between messages the lender waits as long as the borrower likes; once a message has
/// begun, the rest of it must arrive within `frame_timeout`, else the session ends (a
/// borrower stalled mid-message must not hold the function).
pub(crate) fn serve(
    f: &PciFunction,
    sock: &Stream,
    peer: SocketAddr,
    frame_timeout: Duration,
) -> End {
    let table = match IrqTable::new() {
        Ok(t) => t,
        Err(e) => return End::Socket(e),
    };
    let writer = Mutex::new(());
    let nvme = match f.coherence {
        Coherence::Nvme => match Mediator::new(f) {
            Ok(m) => Some(Nvme {
                mediator: Mutex::new(m),
                counters: Mutex::new(AccessCounters::default()),
                broken: Mutex::new(None),
                sock,
                writer: &writer,
                timeout: frame_timeout,
            }),
            Err(e) => return End::Socket(e),
        },
        Coherence::Mirror => None,
    };
    let mut lending = Lending::new(f, &table);
    lending.nvme = nvme.as_ref();
    let end = std::thread::scope(|s| {
        let irq_thread = s.spawn(|| irq_loop(&table, sock, &writer, f, nvme.as_ref()));
        let end = lending.run(sock, &writer, frame_timeout);
        table.stop.store(true, Ordering::Release);
        let _ = table.wake.write(1);
        let _ = irq_thread.join();
        end
    });
    lending.quiesce();
    if let Some(n) = &nvme {
        let m = n.mediator.lock().unwrap_or_else(PoisonError::into_inner);
        let c = n.counters.lock().unwrap_or_else(PoisonError::into_inner);
        tracing::info!(%peer, stats = ?m.stats, fabric = ?*c, "NVMe mediator ends");
    }
    tracing::info!(%peer, bdf = %f.bdf, "function quiesced for the next borrower");
    end
}

fn send(sock: &Stream, writer: &Mutex<()>, m: &Message) -> Result<(), WireError> {
    let _g = writer.lock().unwrap_or_else(PoisonError::into_inner);
    m.write_to(&mut &*sock)
}

/// Reads one message: the first byte without a timeout, the rest within
/// `frame_timeout`.
fn read_message(sock: &Stream, frame_timeout: Duration) -> Result<Message, WireError> {
    let mut first = [0u8; 1];
    loop {
        match (&mut &*sock).read(&mut first) {
            Ok(0) => return Err(WireError::Closed),
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    sock.set_read_timeout(Some(frame_timeout))?;
    let m = Message::read_from(&mut first.as_slice().chain(sock));
    sock.set_read_timeout(None)?;
    m
}

/// Waits on the enabled vectors' eventfds and sends a [`KIND_IRQ`] for each signal.
fn irq_loop(
    table: &IrqTable,
    sock: &Stream,
    writer: &Mutex<()>,
    f: &PciFunction,
    nvme: Option<&Nvme<'_>>,
) {
    loop {
        if table.stop.load(Ordering::Acquire) {
            return;
        }
        let fds: Vec<(u32, u32, Arc<EventFd>)> = table
            .fds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut pfds: Vec<libc::pollfd> = std::iter::once(table.wake.as_raw_fd())
            .chain(fds.iter().map(|(_, _, e)| e.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `pfds` is a live array of `pfds.len()` pollfds; every fd is open for
        // the duration of the call (the Arcs in `fds` keep them).
        let n = unsafe {
            libc::poll(
                pfds.as_mut_ptr(),
                pfds.len() as libc::nfds_t,
                if nvme.is_some() {
                    NVME_IDLE_POLL
                } else {
                    IRQ_POLL
                }
                .as_millis() as libc::c_int,
            )
        };
        if n <= 0 {
            if let Some(nv) = nvme {
                nv.with(table, false, |m, g| m.on_interrupt(f, g, None));
            }
            continue;
        }
        if pfds[0].revents != 0 {
            let _ = table.wake.read();
        }
        for (p, (index, vector, efd)) in pfds[1..].iter().zip(&fds) {
            if p.revents & libc::POLLIN == 0 || efd.read().is_err() {
                continue;
            }
            if let Some(nv) = nvme {
                // The mediator copies the completions, then raises the guest's vector.
                nv.with(table, false, |m, g| m.on_interrupt(f, g, Some(*vector)));
                continue;
            }
            let m = Message::new(
                KIND_IRQ,
                Irq {
                    index: *index,
                    vector: *vector,
                }
                .encode(),
            );
            if let Err(e) = send(sock, writer, &m) {
                tracing::debug!(error = %e, "cannot send an interrupt; the session is ending");
                return;
            }
        }
    }
}

impl IrqTable {
    /// No vector enabled yet.
    pub(super) fn new() -> std::io::Result<IrqTable> {
        Ok(IrqTable {
            fds: Mutex::new(Vec::new()),
            wake: EventFd::new(libc::EFD_NONBLOCK)?,
            stop: AtomicBool::new(false),
        })
    }
}

/// The state of one lending, whatever the transport.
pub(super) struct Lending<'a> {
    pub(super) f: &'a PciFunction,
    /// The NVMe mediator, in coherence mode `nvme` over TCP.
    nvme: Option<&'a Nvme<'a>>,
    cfg: VirtConfig,
    pub(super) maps: Vec<Mirror>,
    /// Bytes of all `maps`.
    mapped: u64,
    table: &'a IrqTable,
    /// The first refusal within a push that spans several messages, answered at its end.
    pub(super) push_error: Option<Refusal>,
}

impl<'a> Lending<'a> {
    /// A fresh lending of `f`: config space as after reset, nothing mapped.
    pub(super) fn new(f: &'a PciFunction, table: &'a IrqTable) -> Lending<'a> {
        Lending {
            f,
            nvme: None,
            cfg: VirtConfig::new(&f.layout),
            maps: Vec::new(),
            mapped: 0,
            table,
            push_error: None,
        }
    }

    fn run(&mut self, sock: &Stream, writer: &Mutex<()>, frame_timeout: Duration) -> End {
        loop {
            let m = match read_message(sock, frame_timeout) {
                Ok(m) => m,
                Err(WireError::Closed) => return End::PeerClosed,
                Err(WireError::Io(e)) => return End::Socket(e),
                Err(e) => return End::Protocol(e.to_string()),
            };
            if m.kind & REPLY != 0 || m.kind == KIND_IRQ {
                return End::Protocol(format!("message kind {:#04x} from a borrower", m.kind));
            }
            if m.flags & FLAG_MORE != 0 && m.kind != KIND_PUSH {
                return End::Protocol(format!("more flag on request {:#04x}", m.kind));
            }
            let answer = match m.kind {
                KIND_PULL => {
                    if !m.payload.is_empty() {
                        return End::Protocol("payload on a pull".into());
                    }
                    match self.pull(sock, writer) {
                        Ok(()) => continue,
                        Err(e) => return End::Socket(e),
                    }
                }
                KIND_PUSH => match self.push(&m) {
                    Ok(None) => continue,
                    Ok(Some(r)) => r,
                    Err(e) => return End::Protocol(e.to_string()),
                },
                _ => match self.request(&m) {
                    Ok(r) => r,
                    Err(e) => return End::Protocol(e.to_string()),
                },
            };
            if let Some(reason) = self.nvme.and_then(|n| {
                n.broken
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take()
            }) {
                return End::Protocol(reason);
            }
            let reply = match answer {
                Ok(payload) => Message::new(m.kind | REPLY, payload),
                Err((status, reason)) => {
                    tracing::info!(bdf = %self.f.bdf, kind = m.kind, %reason, "request refused");
                    Message::refusal(m.kind, status, &reason)
                }
            };
            if let Err(e) = send(sock, writer, &reply) {
                return match e {
                    WireError::Io(e) => End::Socket(e),
                    e => End::Protocol(e.to_string()),
                };
            }
        }
    }

    /// A request answered by one reply: its payload or a refusal. A malformed payload
    /// is an `Err` of the outer result (the session ends).
    pub(super) fn request(&mut self, m: &Message) -> Result<Answer, WireError> {
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
            _ => return Err(WireError::Invalid("PCI request kind")),
        })
    }

    /// [`Self::check`] for a read.
    pub(super) fn check_read(&self, a: &Access) -> Result<(), Refusal> {
        self.check(a, VFIO_REGION_INFO_FLAG_READ)
    }

    /// [`Self::check`] for a write.
    pub(super) fn check_write(&self, a: &Access) -> Result<(), Refusal> {
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
        Ok(())
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

    pub(super) fn dma_map(&mut self, r: DmaRange) -> Result<(), Refusal> {
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

    pub(super) fn dma_unmap(&mut self, r: DmaRange) -> Result<(), Refusal> {
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

    /// Applies one push message; answers (`Some`) at the last message of the push.
    fn push(&mut self, m: &Message) -> Result<Option<Answer>, WireError> {
        for p in decode_pages(&m.payload)? {
            let len = p.data.len() as u64;
            match self.maps.iter_mut().find(|x| x.contains(p.iova, len)) {
                Some(mirror) => mirror.push(p.iova, p.data),
                None => {
                    if self.push_error.is_none() {
                        self.push_error = Some(invalid(format!(
                            "pushed {len} bytes at IOVA {:#x}, outside every mapped range",
                            p.iova
                        )));
                    }
                }
            }
        }
        if m.flags & FLAG_MORE != 0 {
            return Ok(None);
        }
        Ok(Some(match self.push_error.take() {
            Some(r) => Err(r),
            None => Ok(Vec::new()),
        }))
    }

    /// Sends the pages the function changed, in messages of at most about
    /// [`MAX_ACCESS`] bytes, the last without [`FLAG_MORE`].
    fn pull(&mut self, sock: &Stream, writer: &Mutex<()>) -> std::io::Result<()> {
        let mut chunks: Vec<Vec<u8>> = vec![Vec::new()];
        for m in &mut self.maps {
            m.pull(|iova, data| {
                let full = chunks
                    .last()
                    .is_some_and(|c| c.len() + page_cost(data.len()) > MAX_ACCESS as usize);
                if full {
                    chunks.push(Vec::new());
                }
                if let Some(c) = chunks.last_mut() {
                    encode_page(iova, data, c);
                }
            });
        }
        let n = chunks.len();
        for (i, c) in chunks.into_iter().enumerate() {
            let mut msg = Message::new(KIND_PULL | REPLY, c);
            if i + 1 < n {
                msg.flags = FLAG_MORE;
            }
            send(sock, writer, &msg).map_err(|e| match e {
                WireError::Io(e) => e,
                e => std::io::Error::other(e.to_string()),
            })?;
        }
        Ok(())
    }

    /// Leaves the function as the next borrower should find it.
    pub(super) fn quiesce(&mut self) {
        let f = self.f;
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
        // Bus mastering off first: no DMA into a mirror about to be freed.
        let mut cmd = [0u8; 2];
        if f.pread(VFIO_PCI_CONFIG_REGION_INDEX, 0x04, &mut cmd)
            .is_ok()
        {
            cmd[0] &= !0x04;
            if let Err(e) = f.pwrite(VFIO_PCI_CONFIG_REGION_INDEX, 0x04, &cmd) {
                tracing::warn!(bdf = %f.bdf, error = %e, "cannot turn bus mastering off");
            }
        }
        f.device.reset();
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
