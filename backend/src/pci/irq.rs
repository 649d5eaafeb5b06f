//! Interrupts: the vectors the VMM sets up (vfio-user's SET_IRQS), enabled on the
//! lender, and the lender's interrupts delivered to the VMM's eventfds.

use std::fs::File;
use std::io::{self, Write as _};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::PoisonError;

use devlend_fabric::pci::{Irq, IrqAction, IrqSet, Message, INFO_MEDIATED, KIND_SET_IRQS};
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_TYPE_MASK, VFIO_IRQ_SET_ACTION_UNMASK,
    VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE, VFIO_IRQ_SET_DATA_TYPE_MASK,
};

use super::mirror::pull;
use super::{einval, link_err, Borrowed, PciBorrower};

impl PciBorrower {
    /// Sets the VMM's eventfds of vectors `start..start + count` of `index`, and the
    /// vectors enabled on the lender (vfio-user's SET_IRQS).
    pub(super) fn set_vmm_irqs(
        &self,
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
                let have = self.lender_count(index);
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

    /// Has the lender signal vectors `0..need` of `index` (none: disabled). It enables
    /// whole ranges from vector 0 (as VFIO does), so a range that grows is disabled and
    /// enabled again; it shrinks only to nothing (the borrower drops an interrupt whose
    /// vector has no eventfd).
    fn lender_vectors(&self, index: u32, need: u32) -> io::Result<()> {
        let have = self.lender_count(index);
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

    /// How many vectors of `index` the lender signals (0: disabled).
    fn lender_count(&self, index: u32) -> u32 {
        self.shared
            .lender_irqs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&index)
            .copied()
            .unwrap_or(0)
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

    pub(super) fn irq_action(&self, index: u32, action: IrqAction, count: u32) -> io::Result<()> {
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
}

/// Delivers the lender's interrupts: pull what the function wrote, then signal the
/// VMM's eventfd. Ends with the fabric session.
pub(super) fn irq_loop(shared: &Borrowed, irqs: Receiver<Irq>) {
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
