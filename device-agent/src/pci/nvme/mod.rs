//! The NVMe mediator (coherence mode `nvme`, `docs/nvme.md`): the lender keeps the
//! admin and I/O queues of the controller in its own memory (shadow queues), and moves
//! between guest memory and its own only what each command names.
//!
//! - **Registers** (NVMe Base 2.0 §3.1): the guest's AQA, ASQ and ACQ are kept here;
//!   CC.EN 0 → 1 sets up the shadow admin queues and gives the controller their
//!   addresses; CC.EN 1 → 0 resets the controller and drops every queue. Other BAR0
//!   registers pass (CAP, VS, CSTS, CC's other bits...).
//! - **Submission** (§3.3): on a guest SQ tail doorbell the new entries are fetched from
//!   the guest's queue, checked ([`cmd`]), their data fetched when the controller will
//!   read it, their PRPs rewritten to bounce buffers here, copied into the shadow SQ,
//!   and the controller's doorbell rung. A refused command is completed to the guest at
//!   once with its NVMe status, never submitted.
//! - **Completion**: on the controller's interrupt (vector v), each shadow CQ of vector v
//!   is drained: the data the controller wrote is pushed to guest memory, then the
//!   completion entry (the guest's phase, its SQ head), then the guest's interrupt v is
//!   raised. Guest memory is written before the interrupt. The shadow CQ head doorbell
//!   is rung here; the guest's CQ head doorbell only says how far the guest has read.
//!
//! Queue identifiers and command identifiers are the guest's, on the controller too;
//! an I/O CQ's interrupt vector is the guest's too.

pub(crate) mod cmd;
pub(crate) mod dma;
pub(crate) mod spec;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use devlend_fabric::pci::PciStatus;
use vfio_ioctls::VfioContainer;

use self::cmd::{Dir, Segment};
use self::dma::{Arena, DmaBuf};
use self::spec::{
    admin, cdw, le16, le32, le64, Status, CC_EN, CC_MPS_MASK, CID_CONFLICT, CQE, CQ_INVALID,
    DATA_TRANSFER_ERROR, INTERNAL_ERROR, INVALID_FIELD, INVALID_QID, INVALID_QSIZE, PAGE, REG_ACQ,
    REG_AQA, REG_ASQ, REG_CAP, REG_CC, REG_DOORBELLS, REG_NSSR, SQE,
};
use super::guest_access::{GuestAccess, GuestError};
use super::PciFunction;

/// Highest queue identifier the mediator serves (64 I/O queue pairs beside the admin
/// pair): the doorbells of queues 0..=64 are the mediator's; writes past them pass to
/// the controller, which has no such queue (the mediator never creates one).
pub(crate) const MAX_QID: u16 = 64;
/// Largest transfer of one command: 128 KiB (the MDTS the guest is told, 5 with 4 KiB
/// pages, or the controller's own when smaller).
pub(crate) const MAX_TRANSFER: usize = 128 << 10;
/// Most entries of a queue the mediator shadows (the controller's CAP.MQES + 1 when
/// smaller).
pub(crate) const MAX_ENTRIES: u32 = 4096;
/// Pages of bounce buffers (16 MiB): commands that find no room wait in their queue's
/// pending list until completions free some.
const ARENA_PAGES: usize = 4096;
/// IOVA of the bounce buffers in the function's domain; shadow queues follow.
const ARENA_IOVA: u64 = 1 << 32;

/// A refusal of a BAR access (the fabric status and reason).
pub(crate) type Refusal = (PciStatus, String);

fn invalid(reason: impl Into<String>) -> Refusal {
    (PciStatus::Invalid, reason.into())
}

fn io(reason: impl Into<String>) -> Refusal {
    (PciStatus::Io, reason.into())
}

/// What [`Mediator::bar_write`] and [`Mediator::bar_read`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Handled {
    /// The access is the mediator's (a read's bytes are filled).
    Yes,
    /// Not a mediated register: the caller passes it to the function.
    Pass,
}

/// Counters of the mediator.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct NvmeStats {
    /// Commands submitted to the controller.
    pub(crate) submitted: u64,
    /// Commands completed to the guest (including refused ones).
    pub(crate) completed: u64,
    /// Commands refused by the mediator.
    pub(crate) refused: u64,
}

/// A guest submission queue and its shadow.
struct Sq {
    /// Guest IOVA of the queue.
    guest: u64,
    /// Entries.
    size: u16,
    cqid: u16,
    /// Next guest entry to fetch (the SQ head the guest is told).
    head: u16,
    shadow: DmaBuf,
    /// Next free shadow slot.
    sh_tail: u16,
    /// The controller's SQ head, from its completions.
    sh_head: u16,
    /// Commands checked and fetched, waiting for a shadow slot or bounce pages.
    pending: VecDeque<Prepared>,
}

/// A guest completion queue and its shadow.
struct Cq {
    guest: u64,
    size: u16,
    /// Next guest slot to write, and its phase.
    tail: u16,
    phase: bool,
    /// The guest's CQ head doorbell.
    head: u16,
    vector: u16,
    shadow: DmaBuf,
    sh_head: u16,
    sh_phase: bool,
    /// Entries for the guest that found its queue full.
    backlog: VecDeque<[u8; CQE]>,
}

impl Cq {
    fn full(&self) -> bool {
        (self.tail + 1) % self.size == self.head
    }
}

/// What to do when a command completes, beside pushing its data.
enum Post {
    None,
    /// Identify Controller: restrict what the guest is told (see `fix_identify`).
    IdentifyController,
    /// Identify Namespace: learn the namespace's block size.
    IdentifyNamespace(u32),
    CreateSq(u16, Box<Sq>),
    CreateCq(u16, Box<Cq>),
    DeleteSq(u16),
    DeleteCq(u16),
}

/// A command checked and fetched, not yet submitted.
struct Prepared {
    sqe: [u8; SQE],
    dir: Dir,
    len: usize,
    /// Guest memory of the data, in order.
    segs: Vec<Segment>,
    /// Data for the controller ([`Dir::ToDevice`]).
    data: Vec<u8>,
    post: Post,
}

/// A command at the controller.
struct Inflight {
    /// Bounce pages: first and count (data pages, plus a PRP list page when > 2).
    bounce: Option<(usize, usize)>,
    dir: Dir,
    len: usize,
    segs: Vec<Segment>,
    post: Post,
}

/// The mediator of one lending of an NVMe controller.
pub(crate) struct Mediator {
    container: Arc<VfioContainer>,
    /// Doorbell stride, bytes.
    stride: u64,
    /// CAP.MQES + 1, at most [`MAX_ENTRIES`]: most entries of a queue.
    max_entries: u32,
    /// The controller's MDTS in bytes (0: no limit).
    device_mdts: usize,
    aqa: u32,
    asq: u64,
    acq: u64,
    /// The guest's DMA maps: (IOVA, bytes).
    maps: Vec<(u64, u64)>,
    next_iova: u64,
    arena: Option<Arena>,
    sqs: BTreeMap<u16, Sq>,
    cqs: BTreeMap<u16, Cq>,
    inflight: HashMap<(u16, u16), Inflight>,
    /// Bytes per logical block by namespace.
    lba: HashMap<u32, usize>,
    pub(crate) stats: NvmeStats,
}

fn mem_err(e: &GuestError) -> Status {
    tracing::warn!(error = %devlend_fabric::error::chain(e), "guest memory access failed");
    DATA_TRANSFER_ERROR
}

impl Mediator {
    /// A mediator for `f`, reading its CAP.
    ///
    /// # Errors
    /// When CAP cannot be read.
    pub(crate) fn new(f: &PciFunction) -> std::io::Result<Mediator> {
        let mut cap = [0u8; 8];
        f.pread(0, REG_CAP, &mut cap[..4])?;
        f.pread(0, REG_CAP + 4, &mut cap[4..])?;
        let cap = u64::from_le_bytes(cap);
        let dstrd = (cap >> 32) & 0xf;
        Ok(Mediator {
            container: Arc::clone(&f.container),
            stride: 4 << dstrd,
            max_entries: ((cap & 0xffff) as u32 + 1).min(MAX_ENTRIES),
            device_mdts: 0,
            aqa: 0,
            asq: 0,
            acq: 0,
            maps: Vec::new(),
            next_iova: ARENA_IOVA + (ARENA_PAGES * PAGE) as u64,
            arena: None,
            sqs: BTreeMap::new(),
            cqs: BTreeMap::new(),
            inflight: HashMap::new(),
            lba: HashMap::new(),
            stats: NvmeStats::default(),
        })
    }

    // ---- DMA maps -------------------------------------------------------------

    /// Records a DMA map of the borrower (no mirror: only checked against).
    pub(crate) fn map(&mut self, iova: u64, size: u64) -> Result<(), Refusal> {
        if let Some((i, s)) = self
            .maps
            .iter()
            .find(|(i, s)| iova < i + s && *i < iova.saturating_add(size))
        {
            return Err(invalid(format!(
                "DMA range {iova:#x}+{size:#x} overlaps the mapped {i:#x}+{s:#x}"
            )));
        }
        self.maps.push((iova, size));
        Ok(())
    }

    /// Forgets a DMA map recorded before, exactly as recorded.
    pub(crate) fn unmap(&mut self, iova: u64, size: u64) -> Result<(), Refusal> {
        let n = self.maps.len();
        self.maps.retain(|&(i, s)| !(i == iova && s == size));
        if self.maps.len() == n {
            return Err(invalid(format!(
                "DMA range {iova:#x}+{size:#x} is not mapped as such"
            )));
        }
        Ok(())
    }

    fn inside(&self, iova: u64, len: u64) -> bool {
        cmd::inside_maps(&self.maps, iova, len)
    }

    // ---- Registers ------------------------------------------------------------

    /// A guest read of BAR0 at `off`: the guest's own AQA, ASQ and ACQ; doorbells read
    /// as 0; everything else passes.
    pub(crate) fn bar_read(&self, off: u64, buf: &mut [u8]) -> Handled {
        let regs: [(u64, u64, usize); 3] = [
            (REG_AQA, u64::from(self.aqa), 4),
            (REG_ASQ, self.asq, 8),
            (REG_ACQ, self.acq, 8),
        ];
        for (base, value, len) in regs {
            if off >= base && off + buf.len() as u64 <= base + len as u64 {
                let bytes = value.to_le_bytes();
                let o = (off - base) as usize;
                buf.copy_from_slice(&bytes[o..o + buf.len()]);
                return Handled::Yes;
            }
        }
        if self.doorbell(off).is_some() {
            buf.fill(0);
            return Handled::Yes;
        }
        Handled::Pass
    }

    /// The doorbell at `off`: (queue id, is the CQ head doorbell).
    fn doorbell(&self, off: u64) -> Option<(u16, bool)> {
        let rel = off.checked_sub(REG_DOORBELLS)?;
        let idx = rel / self.stride;
        (rel % self.stride == 0 && idx <= 2 * u64::from(MAX_QID) + 1)
            .then_some(((idx / 2) as u16, idx % 2 == 1))
    }

    /// A guest write of BAR0 at `off`.
    ///
    /// # Errors
    /// A refusal for a mediated register written with a size other than 4 (or 8 for
    /// ASQ and ACQ), a controller enabled with a page size other than 4 KiB or admin
    /// queues outside the DMA maps, or the function failing.
    pub(crate) fn bar_write(
        &mut self,
        f: &PciFunction,
        g: &mut dyn GuestAccess,
        off: u64,
        data: &[u8],
    ) -> Result<Handled, Refusal> {
        let v32 = || -> Result<u32, Refusal> {
            <[u8; 4]>::try_from(data)
                .map(u32::from_le_bytes)
                .map_err(|_| {
                    invalid(format!(
                        "{} bytes written to NVMe register {off:#x}",
                        data.len()
                    ))
                })
        };
        let set64 = |reg: &mut u64, base: u64| -> Result<(), Refusal> {
            match (off - base, data.len()) {
                (0, 8) => *reg = le64(data, 0),
                (0, 4) => *reg = (*reg & !0xffff_ffff) | u64::from(le32(data, 0)),
                (4, 4) => *reg = (*reg & 0xffff_ffff) | u64::from(le32(data, 0)) << 32,
                _ => return Err(invalid(format!("{} bytes written at {off:#x}", data.len()))),
            }
            Ok(())
        };
        match off {
            REG_CC => {
                let cc = v32()?;
                self.write_cc(f, cc)?;
            }
            REG_AQA => self.aqa = v32()?,
            o if (REG_ASQ..REG_ASQ + 8).contains(&o) => set64(&mut self.asq, REG_ASQ)?,
            o if (REG_ACQ..REG_ACQ + 8).contains(&o) => set64(&mut self.acq, REG_ACQ)?,
            REG_NSSR => {
                tracing::info!("NVM subsystem reset by the guest ignored");
            }
            _ => {
                let Some((qid, cq)) = self.doorbell(off) else {
                    return Ok(Handled::Pass);
                };
                let v = v32()? as u16;
                if cq {
                    self.cq_head(g, qid, v);
                } else {
                    self.sq_tail(f, g, qid, v);
                }
            }
        }
        Ok(Handled::Yes)
    }

    fn write_cc(&mut self, f: &PciFunction, cc: u32) -> Result<(), Refusal> {
        let mut cur = [0u8; 4];
        f.pread(0, REG_CC, &mut cur)
            .map_err(|e| io(format!("reading CC: {e}")))?;
        let was = u32::from_le_bytes(cur) & CC_EN != 0;
        let en = cc & CC_EN != 0;
        if en && !was {
            if cc & CC_MPS_MASK != 0 {
                return Err(invalid("CC.MPS other than 4 KiB pages is not mediated"));
            }
            self.drop_queues();
            self.setup_admin(f)?;
        }
        f.pwrite(0, REG_CC, &cc.to_le_bytes())
            .map_err(|e| io(format!("writing CC: {e}")))?;
        if was && !en {
            self.drop_queues();
            tracing::info!("NVMe controller disabled by the guest; queues dropped");
        }
        Ok(())
    }

    /// Allocates `bytes` (rounded to pages) of lender memory for the function.
    fn alloc(&mut self, bytes: usize) -> Result<DmaBuf, String> {
        let size = bytes.div_ceil(PAGE) * PAGE;
        let iova = self.next_iova;
        let b = DmaBuf::new(&self.container, iova, size).map_err(|e| e.to_string())?;
        self.next_iova += size as u64;
        Ok(b)
    }

    fn setup_admin(&mut self, f: &PciFunction) -> Result<(), Refusal> {
        let sq_n = (self.aqa & 0xfff) as u16 + 1;
        let cq_n = ((self.aqa >> 16) & 0xfff) as u16 + 1;
        if sq_n < 2 || cq_n < 2 {
            return Err(invalid("admin queues of fewer than 2 entries"));
        }
        for (what, base, n, es) in [("ASQ", self.asq, sq_n, SQE), ("ACQ", self.acq, cq_n, CQE)] {
            if !base.is_multiple_of(PAGE as u64) || !self.inside(base, (usize::from(n) * es) as u64)
            {
                return Err(invalid(format!(
                    "{what} {base:#x} ({n} entries) is not page-aligned inside the DMA maps"
                )));
            }
        }
        if self.arena.is_none() {
            let a = Arena::new(&self.container, ARENA_IOVA, ARENA_PAGES)
                .map_err(|e| io(format!("bounce buffers: {e}")))?;
            self.arena = Some(a);
        }
        let sq = self
            .alloc(usize::from(sq_n) * SQE)
            .map_err(|e| io(format!("shadow admin SQ: {e}")))?;
        let cq = self
            .alloc(usize::from(cq_n) * CQE)
            .map_err(|e| io(format!("shadow admin CQ: {e}")))?;
        let w = |off: u64, v: u32| {
            f.pwrite(0, off, &v.to_le_bytes())
                .map_err(|e| io(format!("writing register {off:#x}: {e}")))
        };
        w(REG_AQA, self.aqa)?;
        w(REG_ASQ, sq.iova as u32)?;
        w(REG_ASQ + 4, (sq.iova >> 32) as u32)?;
        w(REG_ACQ, cq.iova as u32)?;
        w(REG_ACQ + 4, (cq.iova >> 32) as u32)?;
        self.sqs.insert(
            0,
            Sq {
                guest: self.asq,
                size: sq_n,
                cqid: 0,
                head: 0,
                shadow: sq,
                sh_tail: 0,
                sh_head: 0,
                pending: VecDeque::new(),
            },
        );
        self.cqs.insert(0, new_cq(self.acq, cq_n, 0, cq));
        tracing::info!(sq_n, cq_n, "NVMe admin queues shadowed");
        Ok(())
    }

    /// Drops every queue and command (the controller is reset or being reset). The
    /// namespaces' block sizes are kept: a reset does not change them (the mediator
    /// refuses Format NVM and namespace management), and a guest resumes I/O after a
    /// reset before it identifies its namespaces again.
    pub(crate) fn drop_queues(&mut self) {
        self.sqs.clear();
        self.cqs.clear();
        self.inflight.clear();
        if let Some(a) = &mut self.arena {
            a.free(0, ARENA_PAGES);
        }
    }

    /// The function was reset (VFIO_DEVICE_RESET): as a controller reset.
    pub(crate) fn reset(&mut self) {
        self.drop_queues();
        self.aqa = 0;
        self.asq = 0;
        self.acq = 0;
    }

    // ---- Submission -------------------------------------------------------------

    fn sq_tail(&mut self, f: &PciFunction, g: &mut dyn GuestAccess, qid: u16, tail: u16) {
        let Some(sq) = self.sqs.get(&qid) else {
            tracing::info!(qid, "tail doorbell of a queue that does not exist; ignored");
            return;
        };
        if tail >= sq.size {
            tracing::info!(qid, tail, "SQ tail past the queue; ignored");
            return;
        }
        let (guest, size, mut head) = (sq.guest, sq.size, sq.head);
        if !self.inside(guest, (usize::from(size) * SQE) as u64) {
            tracing::warn!(
                qid,
                "the guest's submission queue is no longer inside the DMA maps; doorbell ignored"
            );
            return;
        }
        // Fetch the new entries, in at most two runs (the queue wraps).
        let n = (usize::from(tail) + usize::from(size) - usize::from(head)) % usize::from(size);
        let mut raw = vec![0u8; n * SQE];
        let mut got = 0;
        while got < n {
            let run = (usize::from(size) - usize::from(head)).min(n - got);
            let iova = guest + (usize::from(head) * SQE) as u64;
            if let Err(e) = g.read(iova, &mut raw[got * SQE..(got + run) * SQE]) {
                tracing::warn!(qid, error = %devlend_fabric::error::chain(&e), "cannot fetch submission entries");
                return;
            }
            got += run;
            head = ((usize::from(head) + run) % usize::from(size)) as u16;
        }
        if let Some(sq) = self.sqs.get_mut(&qid) {
            sq.head = tail;
        }
        for e in raw.chunks_exact(SQE) {
            let mut sqe = [0u8; SQE];
            sqe.copy_from_slice(e);
            match self.prepare(g, qid, sqe) {
                Ok(p) => {
                    if let Some(sq) = self.sqs.get_mut(&qid) {
                        sq.pending.push_back(p);
                    }
                }
                Err(status) => {
                    self.stats.refused += 1;
                    tracing::info!(
                        qid,
                        opcode = sqe[0],
                        sct = status.sct,
                        sc = status.sc,
                        "command refused"
                    );
                    self.complete_now(qid, &sqe, status);
                }
            }
        }
        self.submit_pending(f, qid);
        self.flush_cq_for_sq(g, qid);
    }

    /// Checks one command and fetches what it needs from guest memory.
    fn prepare(
        &mut self,
        g: &mut dyn GuestAccess,
        qid: u16,
        sqe: [u8; SQE],
    ) -> Result<Prepared, Status> {
        let cid = le16(&sqe, 2);
        if self.inflight.contains_key(&(qid, cid))
            || self
                .sqs
                .get(&qid)
                .is_some_and(|s| s.pending.iter().any(|p| le16(&p.sqe, 2) == cid))
        {
            return Err(CID_CONFLICT);
        }
        cmd::check_common(&sqe, qid != 0)?;
        let t = if qid == 0 {
            cmd::admin_transfer(&sqe)?
        } else {
            cmd::io_transfer(&sqe, |ns| self.lba.get(&ns).copied())?
        };
        let post = if qid == 0 {
            self.admin_post(&sqe)?
        } else {
            Post::None
        };
        let max = self.max_transfer();
        let maps = &self.maps;
        let inside = |iova: u64, len: u64| cmd::inside_maps(maps, iova, len);
        let segs = cmd::prp_segments(
            le64(&sqe, 24),
            le64(&sqe, 32),
            t.len,
            max,
            |iova, buf| g.read(iova, buf).map_err(|e| mem_err(&e)),
            inside,
        )?;
        let mut data = Vec::new();
        if t.dir == Dir::ToDevice {
            data = vec![0u8; t.len];
            let mut o = 0;
            for &(iova, n) in &segs {
                g.read(iova, &mut data[o..o + n]).map_err(|e| mem_err(&e))?;
                o += n;
            }
        }
        Ok(Prepared {
            sqe,
            dir: t.dir,
            len: t.len,
            segs,
            data,
            post,
        })
    }

    fn max_transfer(&self) -> usize {
        match self.device_mdts {
            0 => MAX_TRANSFER,
            m => m.min(MAX_TRANSFER),
        }
    }

    /// The queue side of an admin command: checks and shadows of queue creation and
    /// deletion (§5.4 - §5.7), and what Identify needs afterwards.
    fn admin_post(&mut self, sqe: &[u8; SQE]) -> Result<Post, Status> {
        let c10 = cdw(sqe, 10);
        let c11 = cdw(sqe, 11);
        let qid = (c10 & 0xffff) as u16;
        let entries = (c10 >> 16) + 1;
        let prp1 = le64(sqe, 24);
        Ok(match sqe[0] {
            admin::IDENTIFY => match c10 & 0xff {
                0x00 => Post::IdentifyNamespace(le32(sqe, 4)),
                0x01 => Post::IdentifyController,
                _ => Post::None,
            },
            admin::CREATE_CQ | admin::CREATE_SQ => {
                if qid == 0 || qid > MAX_QID {
                    return Err(INVALID_QID);
                }
                let exists = if sqe[0] == admin::CREATE_CQ {
                    self.cqs.contains_key(&qid)
                } else {
                    self.sqs.contains_key(&qid)
                };
                if exists {
                    return Err(INVALID_QID);
                }
                if entries < 2 || entries > self.max_entries {
                    return Err(INVALID_QSIZE);
                }
                // Physically contiguous (PC, CDW11 bit 0) and page-aligned only.
                if c11 & 1 == 0 || !prp1.is_multiple_of(PAGE as u64) {
                    return Err(INVALID_FIELD);
                }
                let es = if sqe[0] == admin::CREATE_CQ { CQE } else { SQE };
                let bytes = entries as usize * es;
                if !self.inside(prp1, bytes as u64) {
                    return Err(DATA_TRANSFER_ERROR);
                }
                let shadow = self.alloc(bytes).map_err(|e| {
                    tracing::warn!(error = %e, "cannot allocate a shadow queue");
                    INTERNAL_ERROR
                })?;
                let entries = entries as u16;
                if sqe[0] == admin::CREATE_CQ {
                    // Interrupts enabled (IEN, bit 1) only: the mediator copies
                    // completions when the controller interrupts.
                    if c11 & 2 == 0 {
                        return Err(INVALID_FIELD);
                    }
                    Post::CreateCq(
                        qid,
                        Box::new(new_cq(prp1, entries, (c11 >> 16) as u16, shadow)),
                    )
                } else {
                    let cqid = (c11 >> 16) as u16;
                    if cqid == 0 || !self.cqs.contains_key(&cqid) {
                        return Err(CQ_INVALID);
                    }
                    Post::CreateSq(
                        qid,
                        Box::new(Sq {
                            guest: prp1,
                            size: entries,
                            cqid,
                            head: 0,
                            shadow,
                            sh_tail: 0,
                            sh_head: 0,
                            pending: VecDeque::new(),
                        }),
                    )
                }
            }
            admin::DELETE_SQ => {
                if qid == 0 || !self.sqs.contains_key(&qid) {
                    return Err(INVALID_QID);
                }
                Post::DeleteSq(qid)
            }
            admin::DELETE_CQ => {
                if qid == 0 || !self.cqs.contains_key(&qid) {
                    return Err(INVALID_QID);
                }
                Post::DeleteCq(qid)
            }
            _ => Post::None,
        })
    }

    /// Submits the pending commands of SQ `qid` that find a shadow slot and bounce
    /// pages, then rings the controller's doorbell once.
    fn submit_pending(&mut self, f: &PciFunction, qid: u16) {
        let stride = self.stride;
        let (Some(sq), Some(arena)) = (self.sqs.get_mut(&qid), self.arena.as_mut()) else {
            return;
        };
        let mut rung = false;
        while let Some(p) = sq.pending.front() {
            if (sq.sh_tail + 1) % sq.size == sq.sh_head {
                break;
            }
            let data_pages = p.len.div_ceil(PAGE);
            let pages = data_pages + usize::from(data_pages > 2);
            let first = if pages > 0 {
                match arena.alloc(pages) {
                    Some(i) => Some(i),
                    None => break,
                }
            } else {
                None
            };
            let Some(mut p) = sq.pending.pop_front() else {
                break;
            };
            let mut sqe = p.sqe;
            match (&p.post, first) {
                (Post::CreateSq(_, s), _) => {
                    sqe[24..32].copy_from_slice(&s.shadow.iova.to_le_bytes())
                }
                (Post::CreateCq(_, c), _) => {
                    sqe[24..32].copy_from_slice(&c.shadow.iova.to_le_bytes())
                }
                (_, Some(i)) => {
                    let base = arena.iova(i);
                    let prp2 = match data_pages {
                        1 => 0,
                        2 => base + PAGE as u64,
                        n => {
                            let list: Vec<u8> = (1..n)
                                .flat_map(|k| (base + (k * PAGE) as u64).to_le_bytes())
                                .collect();
                            arena.buf.write(n * PAGE + i * PAGE, &list);
                            arena.iova(i + n)
                        }
                    };
                    sqe[24..32].copy_from_slice(&base.to_le_bytes());
                    sqe[32..40].copy_from_slice(&prp2.to_le_bytes());
                    if p.dir == Dir::ToDevice {
                        arena.buf.write(i * PAGE, &p.data);
                    }
                }
                (_, None) => {}
            }
            sq.shadow.write(usize::from(sq.sh_tail) * SQE, &sqe);
            sq.sh_tail = (sq.sh_tail + 1) % sq.size;
            rung = true;
            self.stats.submitted += 1;
            let cid = le16(&sqe, 2);
            self.inflight.insert(
                (qid, cid),
                Inflight {
                    bounce: first.map(|i| (i, pages)),
                    dir: p.dir,
                    len: p.len,
                    segs: std::mem::take(&mut p.segs),
                    post: p.post,
                },
            );
        }
        if rung {
            let off = REG_DOORBELLS + 2 * u64::from(qid) * stride;
            if let Err(e) = f.pwrite(0, off, &u32::from(sq.sh_tail).to_le_bytes()) {
                tracing::warn!(qid, error = %e, "cannot ring the controller's SQ doorbell");
            }
        }
    }

    /// Completes a refused command to the guest's CQ (or its backlog).
    fn complete_now(&mut self, sqid: u16, sqe: &[u8; SQE], status: Status) {
        let Some(sq) = self.sqs.get(&sqid) else {
            return;
        };
        let (cqid, head) = (sq.cqid, sq.head);
        let mut e = [0u8; CQE];
        e[8..10].copy_from_slice(&head.to_le_bytes());
        e[10..12].copy_from_slice(&sqid.to_le_bytes());
        e[12..14].copy_from_slice(&sqe[2..4]);
        e[14..16].copy_from_slice(&(status.field() << 1).to_le_bytes());
        if let Some(cq) = self.cqs.get_mut(&cqid) {
            cq.backlog.push_back(e);
        }
    }

    fn flush_cq_for_sq(&mut self, g: &mut dyn GuestAccess, sqid: u16) {
        if let Some(cqid) = self.sqs.get(&sqid).map(|s| s.cqid) {
            if let Err(e) = self.post_backlog(g, cqid, true) {
                tracing::warn!(error = %devlend_fabric::error::chain(&e), "cannot complete to the guest");
            }
        }
    }

    /// Writes the backlog of CQ `cqid` to the guest's queue as far as it has room, then
    /// raises its interrupt when anything was written and `irq`.
    fn post_backlog(
        &mut self,
        g: &mut dyn GuestAccess,
        cqid: u16,
        irq: bool,
    ) -> Result<(), GuestError> {
        let Some(cq) = self.cqs.get(&cqid) else {
            return Ok(());
        };
        let (base, bytes) = (cq.guest, (usize::from(cq.size) * CQE) as u64);
        if !self.inside(base, bytes) {
            // Said only when completions are dropped, not at every idle look.
            if !cq.backlog.is_empty() {
                tracing::warn!(cqid, dropped = cq.backlog.len(), "the guest's completion queue is no longer inside the DMA maps; its completions are dropped");
            }
            if let Some(cq) = self.cqs.get_mut(&cqid) {
                cq.backlog.clear();
            }
            return Ok(());
        }
        let Some(cq) = self.cqs.get_mut(&cqid) else {
            return Ok(());
        };
        let mut out: Vec<(u64, [u8; CQE])> = Vec::new();
        while !cq.full() {
            let Some(mut e) = cq.backlog.pop_front() else {
                break;
            };
            let st = le16(&e, 14) & !1 | u16::from(cq.phase);
            e[14..16].copy_from_slice(&st.to_le_bytes());
            out.push((cq.guest + (usize::from(cq.tail) * CQE) as u64, e));
            cq.tail = (cq.tail + 1) % cq.size;
            if cq.tail == 0 {
                cq.phase = !cq.phase;
            }
        }
        if out.is_empty() {
            return Ok(());
        }
        self.stats.completed += out.len() as u64;
        let vector = cq.vector;
        let pages: Vec<(u64, &[u8])> = out.iter().map(|(i, e)| (*i, &e[..])).collect();
        g.write(&pages)?;
        if irq {
            g.interrupt(u32::from(vector))?;
        }
        Ok(())
    }

    fn cq_head(&mut self, g: &mut dyn GuestAccess, qid: u16, head: u16) {
        let Some(cq) = self.cqs.get_mut(&qid) else {
            tracing::info!(qid, "head doorbell of a queue that does not exist; ignored");
            return;
        };
        if head >= cq.size {
            tracing::info!(qid, head, "CQ head past the queue; ignored");
            return;
        }
        cq.head = head;
        if !cq.backlog.is_empty() {
            if let Err(e) = self.post_backlog(g, qid, true) {
                tracing::warn!(error = %devlend_fabric::error::chain(&e), "cannot complete to the guest");
            }
        }
    }

    // ---- Completion -------------------------------------------------------------

    /// The controller raised interrupt `vector` (`None`: look at every queue, as after
    /// a quiet interval, lest an interrupt was lost while the borrower re-enabled
    /// vectors): drains the shadow CQs of that vector to the guest, and raises the
    /// guest's interrupt for each that got entries.
    pub(crate) fn on_interrupt(
        &mut self,
        f: &PciFunction,
        g: &mut dyn GuestAccess,
        vector: Option<u32>,
    ) {
        let cqids: Vec<u16> = self
            .cqs
            .iter()
            .filter(|(_, c)| vector.is_none_or(|v| u32::from(c.vector) == v))
            .map(|(q, _)| *q)
            .collect();
        for cqid in cqids {
            if vector.is_none()
                && self.cqs.get(&cqid).is_some_and(|c| {
                    let mut e = [0u8; CQE];
                    c.shadow.read(usize::from(c.sh_head) * CQE, &mut e);
                    (le16(&e, 14) & 1 != 0) == c.sh_phase
                })
            {
                tracing::debug!(cqid, "completions found without an interrupt");
            }
            if let Err(e) = self.drain(f, g, cqid) {
                tracing::warn!(cqid, error = %devlend_fabric::error::chain(&e), "cannot complete to the guest");
            }
        }
    }

    fn drain(
        &mut self,
        f: &PciFunction,
        g: &mut dyn GuestAccess,
        cqid: u16,
    ) -> Result<(), GuestError> {
        let mut taken = 0;
        let mut freed_sqs = Vec::new();
        while let Some(cq) = self.cqs.get_mut(&cqid) {
            let mut e = [0u8; CQE];
            cq.shadow.read(usize::from(cq.sh_head) * CQE, &mut e);
            if (le16(&e, 14) & 1 != 0) != cq.sh_phase {
                break;
            }
            cq.sh_head = (cq.sh_head + 1) % cq.size;
            if cq.sh_head == 0 {
                cq.sh_phase = !cq.sh_phase;
            }
            taken += 1;
            let (sqhd, sqid, cid) = (le16(&e, 8), le16(&e, 10), le16(&e, 12));
            let ok = le16(&e, 14) >> 1 == 0;
            if let Some(sq) = self.sqs.get_mut(&sqid) {
                sq.sh_head = sqhd % sq.size;
                freed_sqs.push(sqid);
            }
            let Some(cmd) = self.inflight.remove(&(sqid, cid)) else {
                tracing::warn!(sqid, cid, "completion of no command in flight; dropped");
                continue;
            };
            if !self.complete(g, sqid, cid, cmd, ok)? {
                // Its buffers left the DMA maps while it ran: the data is dropped.
                let st = (DATA_TRANSFER_ERROR.field() << 1) | (le16(&e, 14) & 1);
                e[14..16].copy_from_slice(&st.to_le_bytes());
            }
            let guest_head = self.sqs.get(&sqid).map_or(0, |s| s.head);
            e[8..10].copy_from_slice(&guest_head.to_le_bytes());
            if let Some(cq) = self.cqs.get_mut(&cqid) {
                cq.backlog.push_back(e);
            }
        }
        if taken > 0 {
            if let Some(cq) = self.cqs.get(&cqid) {
                let off = REG_DOORBELLS + (2 * u64::from(cqid) + 1) * self.stride;
                if let Err(e) = f.pwrite(0, off, &u32::from(cq.sh_head).to_le_bytes()) {
                    tracing::warn!(cqid, error = %e, "cannot ring the controller's CQ doorbell");
                }
            }
        }
        self.post_backlog(g, cqid, true)?;
        freed_sqs.sort_unstable();
        freed_sqs.dedup();
        for q in freed_sqs {
            self.submit_pending(f, q);
        }
        Ok(())
    }

    /// One command's completion: its data to guest memory, its queue effects. `false`
    /// when its data could not be pushed because its buffers are no longer inside the
    /// DMA maps.
    fn complete(
        &mut self,
        g: &mut dyn GuestAccess,
        sqid: u16,
        cid: u16,
        cmd: Inflight,
        ok: bool,
    ) -> Result<bool, GuestError> {
        let mut data = Vec::new();
        if let (Some((first, n)), Some(arena)) = (cmd.bounce, self.arena.as_mut()) {
            if ok && cmd.dir == Dir::FromDevice {
                data = vec![0u8; cmd.len];
                arena.buf.read(first * PAGE, &mut data);
            }
            arena.free(first, n);
        }
        match cmd.post {
            Post::IdentifyController if ok => self.fix_identify(&mut data),
            Post::IdentifyNamespace(ns) if ok => match cmd::lba_bytes(&data) {
                Some(b) => {
                    self.lba.insert(ns, b);
                }
                None => {
                    self.lba.remove(&ns);
                }
            },
            Post::CreateSq(q, sq) if ok => {
                tracing::info!(
                    qid = q,
                    entries = sq.size,
                    cqid = sq.cqid,
                    "NVMe I/O submission queue shadowed"
                );
                self.sqs.insert(q, *sq);
            }
            Post::CreateCq(q, cq) if ok => {
                tracing::info!(
                    qid = q,
                    entries = cq.size,
                    vector = cq.vector,
                    "NVMe I/O completion queue shadowed"
                );
                self.cqs.insert(q, *cq);
            }
            Post::DeleteSq(q) if ok => {
                self.sqs.remove(&q);
                self.inflight.retain(|(s, _), _| *s != q);
            }
            Post::DeleteCq(q) if ok => {
                self.cqs.remove(&q);
            }
            _ => {}
        }
        tracing::trace!(sqid, cid, ok, "command completed");
        if !data.is_empty() {
            if !cmd
                .segs
                .iter()
                .all(|&(iova, n)| self.inside(iova, n as u64))
            {
                tracing::info!(sqid, cid, "a command's buffers were unmapped while it ran");
                return Ok(false);
            }
            let mut o = 0;
            let pages: Vec<(u64, &[u8])> = cmd
                .segs
                .iter()
                .map(|&(iova, n)| {
                    let p = (iova, &data[o..o + n]);
                    o += n;
                    p
                })
                .collect();
            g.write(&pages)?;
        }
        Ok(true)
    }

    /// Identify Controller (§5.17.2.1) as the guest sees it: MDTS at most
    /// [`MAX_TRANSFER`]; no optional admin commands (OACS = 0: no Doorbell Buffer
    /// Config, which would have the controller poll guest memory, no namespace
    /// management, format, firmware, security, directives); no host memory buffer
    /// (HMPRE = HMMIN = 0); ONCS limited to Compare, Dataset Management, Write Zeroes,
    /// Save/Select and Timestamp; no fused operations; no SGLs.
    fn fix_identify(&mut self, id: &mut [u8]) {
        if id.len() < PAGE {
            return;
        }
        let mdts = id[77];
        self.device_mdts = if mdts == 0 { 0 } else { PAGE << mdts };
        let ours = (MAX_TRANSFER / PAGE).trailing_zeros() as u8;
        id[77] = if mdts == 0 { ours } else { mdts.min(ours) };
        id[256..258].fill(0);
        id[272..280].fill(0);
        let oncs = le16(id, 520) & (1 | 1 << 2 | 1 << 3 | 1 << 4 | 1 << 6);
        id[520..522].copy_from_slice(&oncs.to_le_bytes());
        id[522..524].fill(0);
        id[536..540].fill(0);
    }
}

fn new_cq(guest: u64, size: u16, vector: u16, shadow: DmaBuf) -> Cq {
    Cq {
        guest,
        size,
        tail: 0,
        phase: true,
        head: 0,
        vector,
        shadow,
        sh_head: 0,
        sh_phase: true,
        backlog: VecDeque::new(),
    }
}
