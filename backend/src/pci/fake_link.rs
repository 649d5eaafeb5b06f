//! An in-memory [`PciWire`] for tests: a stand-in lender that answers every request at
//! once, from regions it keeps, and records what it was sent, in order; its one-way
//! messages (interrupts, DMA counters notes) go through the link's own dispatch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};

use devlend_fabric::pci::{
    Access, Irq, Message, PciInfo, PciStatus, FLAG_MORE, KIND_READ, KIND_WRITE, REPLY,
};

use super::link::{dispatch, CounterNotes, LinkCounters, LinkError, PciLink, PciWire};
use super::PciStats;

/// The stand-in lender behind a fake link.
pub(super) struct FakeLender {
    /// The regions' bytes by index (a read past the end reads zeros).
    pub regions: Mutex<HashMap<u32, Vec<u8>>>,
    /// Every message sent to the lender, in order.
    pub log: Mutex<Vec<Message>>,
    /// A request kind the lender refuses.
    pub refuse: Mutex<Option<u8>>,
    replies: Mutex<Option<Sender<Message>>>,
    irqs: Mutex<Option<Sender<Irq>>>,
    /// The session's DMA counters notes (granted or not).
    notes: CounterNotes,
    closed: Arc<AtomicBool>,
    max_access: u32,
}

impl FakeLender {
    /// The kinds of the messages sent so far.
    pub fn kinds(&self) -> Vec<u8> {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|m| m.kind)
            .collect()
    }

    /// Raises an interrupt, as the lender's `KIND_IRQ` would.
    pub fn irq(&self, irq: Irq) {
        if let Some(tx) = &*self.irqs.lock().unwrap_or_else(PoisonError::into_inner) {
            let _ = tx.send(irq);
        }
    }

    /// Sends a one-way message `m` as the lender would, through the reader's dispatch:
    /// a message that ends the session loses it; `false` then.
    pub fn send_one_way(&self, m: Message) -> bool {
        let kept = {
            let replies = self.replies.lock().unwrap_or_else(PoisonError::into_inner);
            let irqs = self.irqs.lock().unwrap_or_else(PoisonError::into_inner);
            match (&*replies, &*irqs) {
                (Some(r), Some(i)) => dispatch(m, r, i, &self.notes),
                _ => false,
            }
        };
        if !kept {
            self.lose();
        }
        kept
    }

    /// Loses the session, as a broken network would (the reader ends).
    pub fn lose(&self) {
        self.closed.store(true, Ordering::Release);
        self.replies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        self.irqs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    fn answer(&self, m: &Message) -> Message {
        if *self.refuse.lock().unwrap_or_else(PoisonError::into_inner) == Some(m.kind) {
            return Message::refusal(m.kind, PciStatus::Invalid, "refused by the fake lender");
        }
        let mut regions = self.regions.lock().unwrap_or_else(PoisonError::into_inner);
        match m.kind {
            KIND_READ => {
                let Ok((a, _)) = Access::decode(&m.payload, false) else {
                    return Message::refusal(m.kind, PciStatus::Invalid, "bad access");
                };
                let r = regions.entry(a.region).or_default();
                let out = (0..a.len as usize)
                    .map(|i| r.get(a.offset as usize + i).copied().unwrap_or(0))
                    .collect();
                Message::new(KIND_READ | REPLY, out)
            }
            KIND_WRITE => {
                let Ok((a, data)) = Access::decode(&m.payload, true) else {
                    return Message::refusal(m.kind, PciStatus::Invalid, "bad access");
                };
                let r = regions.entry(a.region).or_default();
                let end = a.offset as usize + data.len();
                if r.len() < end {
                    r.resize(end, 0);
                }
                r[a.offset as usize..end].copy_from_slice(data);
                Message::new(KIND_WRITE | REPLY, Vec::new())
            }
            k => Message::new(k | REPLY, Vec::new()),
        }
    }
}

struct FakeWire(Arc<FakeLender>);

impl PciWire for FakeWire {
    fn send(&self, m: &Message) -> Result<(), LinkError> {
        if self.0.closed.load(Ordering::Acquire) {
            return Err(LinkError::Closed);
        }
        self.0
            .log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(m.clone());
        if m.flags & FLAG_MORE != 0 {
            return Ok(());
        }
        let reply = self.0.answer(m);
        if let Some(tx) = &*self
            .0
            .replies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
        {
            let _ = tx.send(reply);
        }
        Ok(())
    }

    fn shutdown(&self) {
        self.0.lose();
    }

    fn max_access(&self) -> u32 {
        self.0.max_access
    }

    fn name(&self) -> &'static str {
        "fake"
    }
}

/// A link to a fresh stand-in lender whose region accesses are at most `max_access`
/// bytes, describing the function as `lent`, granted DMA counters notes; with the
/// lender and the interrupts.
pub(super) fn fake_link(
    max_access: u32,
    lent: devlend_fabric::handshake::PciIdentity,
) -> (PciLink, Arc<FakeLender>, Receiver<Irq>) {
    fake_link_with(max_access, lent, true)
}

/// As [`fake_link`], with DMA counters notes granted (`counters`) or not.
pub(super) fn fake_link_with(
    max_access: u32,
    lent: devlend_fabric::handshake::PciIdentity,
    counters: bool,
) -> (PciLink, Arc<FakeLender>, Receiver<Irq>) {
    let (reply_tx, reply_rx) = mpsc::channel();
    let (irq_tx, irq_rx) = mpsc::channel();
    let closed = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(PciStats::default());
    let lender = Arc::new(FakeLender {
        regions: Mutex::new(HashMap::new()),
        log: Mutex::new(Vec::new()),
        refuse: Mutex::new(None),
        replies: Mutex::new(Some(reply_tx)),
        irqs: Mutex::new(Some(irq_tx)),
        notes: CounterNotes::new(counters, Arc::clone(&stats)),
        closed: Arc::clone(&closed),
        max_access,
    });
    let link = PciLink::over(
        Box::new(FakeWire(Arc::clone(&lender))),
        lent,
        reply_rx,
        closed,
        Arc::new(LinkCounters::default()),
        stats,
    );
    (link, lender, irq_rx)
}

/// A function with BAR0 and config space (4 KiB each) and one MSI-X index of 4 vectors.
pub(super) fn info() -> PciInfo {
    use devlend_fabric::pci::{IrqInfo, RegionInfo};
    let rw = RegionInfo {
        size: 4096,
        flags: 3,
    };
    let mut regions = vec![RegionInfo::default(); 8];
    regions[0] = rw;
    regions[7] = rw;
    PciInfo {
        regions,
        irqs: vec![IrqInfo { count: 4, flags: 1 }],
        flags: 0,
    }
}
