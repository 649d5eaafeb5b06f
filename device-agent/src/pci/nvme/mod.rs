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
//!
//! Files: here the mediator's state and the DMA maps it checks against; [`regs`],
//! [`submit`] and [`complete`] the three parts above; [`cmd`] and [`spec`] the checks
//! and the specification's constants (std only: the fuzz target `pci_decode` compiles
//! them by path); [`dma`] the lender memory the controller reaches; [`throttle`] the
//! holder's limits, which leave I/O commands in the guest's queues until they may go;
//! [`peer`] commands whose buffers lie in peers' BARs.

pub(crate) mod cmd;
mod complete;
pub(crate) mod dma;
mod peer;
mod regs;
pub(crate) mod spec;
mod submit;
pub(crate) mod throttle;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use devlend_fabric::pci::{DmaCounters, PciStatus};
use vfio_ioctls::VfioContainer;

use self::cmd::{Dir, Segment};
use self::dma::{Arena, DmaBuf};
use self::spec::{
    admin, cdw, le16, le32, le64, Status, CC_EN, CC_MPS_MASK, CID_CONFLICT, CQE, CQ_INVALID,
    DATA_TRANSFER_ERROR, INTERNAL_ERROR, INVALID_FIELD, INVALID_QID, INVALID_QSIZE, PAGE, REG_ACQ,
    REG_AQA, REG_ASQ, REG_CAP, REG_CC, REG_DOORBELLS, REG_NSSR, SQE,
};
use super::PciFunction;
use crate::pci::guest::{GuestAccess, GuestError};

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
/// Most bytes of commands fetched from the guest and waiting for the controller
/// (`Sq::pending`), all queues together (16 MiB, as the bounce buffers): past it, new
/// entries stay in the guest's SQ, unfetched, until completions make room. Without it
/// a guest could make the lender hold a full queue's writes per queue (64 queues of
/// 4096 entries of 128 KiB).
pub(crate) const MAX_PENDING_BYTES: usize = 16 << 20;
/// How long a doorbell waits for the controller to make room under
/// [`MAX_PENDING_BYTES`] before it leaves the rest in the guest's queue.
const MAKE_ROOM_FOR: std::time::Duration = std::time::Duration::from_secs(10);
/// Entries a fetch reads at a time under limits (4 KiB): it may stop at any of them.
const THROTTLED_BATCH: usize = 64;
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
    /// The guest's last tail doorbell: entries from `head` up to it are submitted but
    /// not fetched yet.
    tail: u16,
    shadow: DmaBuf,
    /// Next free shadow slot.
    sh_tail: u16,
    /// The controller's SQ head, from its completions.
    sh_head: u16,
    /// Commands checked and fetched, waiting for a shadow slot or bounce pages.
    pending: VecDeque<Prepared>,
    /// What `pending` holds, bytes ([`Prepared::cost`]).
    pending_bytes: usize,
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
    /// Its buffers lie in peers' BARs (`crate::pci::peer`): their IOVAs in the
    /// function's domain, given to the controller as they are (nothing bounced).
    peer: Option<Vec<Segment>>,
}

impl Prepared {
    /// The bytes it holds while it waits: its entry and the data fetched for it.
    fn cost(&self) -> usize {
        SQE + self.data.len()
    }
}

/// A command at the controller.
struct Inflight {
    /// Bounce pages: first and count (data pages, plus a PRP list page when > 2).
    bounce: Option<(usize, usize)>,
    dir: Dir,
    len: usize,
    segs: Vec<Segment>,
    post: Post,
    /// Its buffers lie in peers' BARs: nothing to push to guest memory.
    peer: bool,
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
    /// A fetch left submitted entries in a guest's queue because the controller gave no
    /// room (`Mediator::fetch_waiting` retries them at the next doorbell).
    unfetched: bool,
    /// The holder's limits, if any limit applies.
    throttle: Option<throttle::Throttle>,
    pub(crate) stats: NvmeStats,
    /// The peers' BARs this lending reaches (`crate::pci::peer`).
    reach: Arc<crate::pci::peer::Reach>,
    /// What the mediator moved for the function's DMA, and what the borrower was last
    /// told of it (when it reads [`devlend_fabric::pci::KIND_COUNTERS`] notes).
    pub(crate) dma: DmaCounters,
    noted: Option<DmaCounters>,
    /// When the borrower was last told (`noted`): notes go at most every
    /// [`NOTE_INTERVAL`] while interrupts come, and on the next quiet look after.
    noted_at: Option<std::time::Instant>,
}

/// Shortest time between two counter notes while the function's interrupts come: a
/// note is a fabric message, which a completion per interrupt would otherwise pay.
const NOTE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

fn mem_err(e: &GuestError) -> Status {
    devlend_fabric::limited!(warn, error = %devlend_fabric::error::chain(e), "guest memory access failed");
    DATA_TRANSFER_ERROR
}

impl Mediator {
    /// A mediator for `f`, reading its CAP, under the holder's limits `throttle`; it
    /// notes its DMA counters to the borrower when `notes`.
    ///
    /// # Errors
    /// When CAP cannot be read.
    pub(crate) fn new(
        f: &PciFunction,
        throttle: Option<throttle::Throttle>,
        notes: bool,
    ) -> std::io::Result<Mediator> {
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
            unfetched: false,
            throttle,
            stats: NvmeStats::default(),
            reach: Arc::clone(&f.reach),
            dma: DmaCounters::default(),
            noted: notes.then(DmaCounters::default),
            noted_at: None,
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

    /// Tells the borrower what moved, when it changed since it was last told and the
    /// borrower reads such notes: on a `quiet` look (no interrupt: the session's idle
    /// poll), or when [`NOTE_INTERVAL`] passed since the last note.
    fn note_counters(&mut self, g: &mut dyn GuestAccess, quiet: bool) {
        if !self.noted.is_some_and(|n| n != self.dma) {
            return;
        }
        let now = std::time::Instant::now();
        if !quiet
            && self
                .noted_at
                .is_some_and(|t| now.duration_since(t) < NOTE_INTERVAL)
        {
            return;
        }
        if let Err(e) = g.counters(&self.dma) {
            devlend_fabric::limited!(debug, error = %devlend_fabric::error::chain(&e), "cannot send the DMA counters");
            return;
        }
        self.noted = Some(self.dma);
        self.noted_at = Some(now);
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
