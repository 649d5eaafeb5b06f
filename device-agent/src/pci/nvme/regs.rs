//! The mediator's BAR0 registers (NVMe Base 2.0 §3.1): the guest's AQA, ASQ and ACQ
//! kept here, doorbells taken, CC.EN 0 → 1 setting up the shadow admin queues, 1 → 0
//! (or a function reset) dropping every queue; other registers pass.

use super::*;

impl Mediator {
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
    pub(super) fn doorbell(&self, off: u64) -> Option<(u16, bool)> {
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
                devlend_fabric::limited!(info, "NVM subsystem reset by the guest ignored");
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

    pub(super) fn write_cc(&mut self, f: &PciFunction, cc: u32) -> Result<(), Refusal> {
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
            devlend_fabric::limited!(
                info,
                "NVMe controller disabled by the guest; queues dropped"
            );
        }
        Ok(())
    }

    /// Allocates `bytes` (rounded to pages) of lender memory for the function.
    pub(super) fn alloc(&mut self, bytes: usize) -> Result<DmaBuf, String> {
        let size = bytes.div_ceil(PAGE) * PAGE;
        let iova = self.next_iova;
        let b = DmaBuf::new(&self.container, iova, size).map_err(|e| e.to_string())?;
        self.next_iova += size as u64;
        Ok(b)
    }

    pub(super) fn setup_admin(&mut self, f: &PciFunction) -> Result<(), Refusal> {
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
                tail: 0,
                pending_bytes: 0,
            },
        );
        self.cqs.insert(0, new_cq(self.acq, cq_n, 0, cq));
        devlend_fabric::limited!(info, sq_n, cq_n, "NVMe admin queues shadowed");
        Ok(())
    }

    /// Drops every queue and command (the controller is reset or being reset). The
    /// namespaces' block sizes are kept: a reset does not change them (the mediator
    /// refuses Format NVM and namespace management), and a guest resumes I/O after a
    /// reset before it identifies its namespaces again.
    pub(crate) fn drop_queues(&mut self) {
        self.sqs.clear();
        if let Some(t) = &mut self.throttle {
            t.forget_all();
        }
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
}
