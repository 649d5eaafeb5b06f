//! Completion: on the controller's interrupt, each shadow CQ of the vector drained: the
//! data the controller wrote pushed to guest memory, then the completion entry (the
//! guest's phase, its SQ head), then the guest's interrupt raised; the guest's CQ head
//! doorbell, and the backlog of a guest queue that was full.

use super::*;

impl Mediator {
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
                devlend_fabric::limited!(warn, cqid, error = %devlend_fabric::error::chain(&e), "cannot complete to the guest");
            }
        }
        self.note_counters(g, vector.is_none());
    }

    pub(super) fn drain(
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
                devlend_fabric::limited!(
                    warn,
                    sqid,
                    cid,
                    "completion of no command in flight; dropped"
                );
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
                    devlend_fabric::limited!(warn, cqid, error = %e, "cannot ring the controller's CQ doorbell");
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
    pub(super) fn complete(
        &mut self,
        g: &mut dyn GuestAccess,
        sqid: u16,
        cid: u16,
        cmd: Inflight,
        ok: bool,
    ) -> Result<bool, GuestError> {
        let mut data = Vec::new();
        if cmd.peer && ok {
            self.dma.peer += cmd.len as u64;
        }
        if let (Some((first, n)), Some(arena)) = (cmd.bounce, self.arena.as_mut()) {
            if ok && cmd.dir == Dir::FromDevice && !cmd.peer {
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
                devlend_fabric::limited!(
                    info,
                    qid = q,
                    entries = sq.size,
                    cqid = sq.cqid,
                    "NVMe I/O submission queue shadowed"
                );
                self.sqs.insert(q, *sq);
            }
            Post::CreateCq(q, cq) if ok => {
                devlend_fabric::limited!(
                    info,
                    qid = q,
                    entries = cq.size,
                    vector = cq.vector,
                    "NVMe I/O completion queue shadowed"
                );
                self.cqs.insert(q, *cq);
            }
            Post::DeleteSq(q) if ok => {
                self.sqs.remove(&q);
                if let Some(t) = &mut self.throttle {
                    t.forget(q);
                }
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
                devlend_fabric::limited!(
                    info,
                    sqid,
                    cid,
                    "a command's buffers were unmapped while it ran"
                );
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
            self.dma.guest_written += data.len() as u64;
        }
        Ok(true)
    }

    /// Identify Controller (§5.17.2.1) as the guest sees it: MDTS at most
    /// [`MAX_TRANSFER`]; no optional admin commands (OACS = 0: no Doorbell Buffer
    /// Config, which would have the controller poll guest memory, no namespace
    /// management, format, firmware, security, directives); no host memory buffer
    /// (HMPRE = HMMIN = 0); ONCS limited to Compare, Dataset Management, Write Zeroes,
    /// Save/Select and Timestamp; no fused operations; no SGLs.
    pub(super) fn fix_identify(&mut self, id: &mut [u8]) {
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

impl Mediator {
    /// Writes the backlog of CQ `cqid` to the guest's queue as far as it has room, then
    /// raises its interrupt when anything was written and `irq`.
    pub(super) fn post_backlog(
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
                devlend_fabric::limited!(warn, cqid, dropped = cq.backlog.len(), "the guest's completion queue is no longer inside the DMA maps; its completions are dropped");
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

    pub(super) fn cq_head(&mut self, g: &mut dyn GuestAccess, qid: u16, head: u16) {
        let Some(cq) = self.cqs.get_mut(&qid) else {
            devlend_fabric::limited!(
                info,
                qid,
                "head doorbell of a queue that does not exist; ignored"
            );
            return;
        };
        if head >= cq.size {
            devlend_fabric::limited!(info, qid, head, "CQ head past the queue; ignored");
            return;
        }
        cq.head = head;
        if !cq.backlog.is_empty() {
            if let Err(e) = self.post_backlog(g, qid, true) {
                devlend_fabric::limited!(warn, error = %devlend_fabric::error::chain(&e), "cannot complete to the guest");
            }
        }
    }
}
