//! Submission (§3.3): on a guest SQ tail doorbell, the new entries fetched from the
//! guest's queue, checked ([`super::cmd`]), their data fetched when the controller will
//! read it, their PRPs rewritten to bounce buffers, copied into the shadow SQ, and the
//! controller's doorbell rung. A refused command is completed to the guest at once.

use std::time::Instant;

use super::*;

impl Mediator {
    pub(super) fn sq_tail(
        &mut self,
        f: &PciFunction,
        g: &mut dyn GuestAccess,
        qid: u16,
        tail: u16,
    ) {
        let Some(sq) = self.sqs.get(&qid) else {
            devlend_fabric::limited!(
                info,
                qid,
                "tail doorbell of a queue that does not exist; ignored"
            );
            return;
        };
        if tail >= sq.size {
            devlend_fabric::limited!(info, qid, tail, "SQ tail past the queue; ignored");
            return;
        }
        if let Some(sq) = self.sqs.get_mut(&qid) {
            sq.tail = tail;
        }
        self.fetch(f, g, qid);
        // Entries an earlier doorbell left unfetched (the controller was stuck then).
        self.fetch_waiting(f, g);
    }

    /// Fetches the entries of SQ `qid` between its head and the guest's tail, checks
    /// them and queues them for the controller. While the commands waiting hold
    /// [`MAX_PENDING_BYTES`] or more, it first drains the controller's completions to
    /// make room ([`Self::make_room`]: guest memory is read on this thread only, so
    /// the doorbell waits); what it still cannot fetch stays in the guest's queue (the
    /// SQ head the guest is told stops before it) until the next doorbell. Under the
    /// holder's limits ([`super::throttle`]) it also stops at an I/O command the
    /// buckets cannot pay for yet, and reads that queue again when they can.
    pub(super) fn fetch(&mut self, f: &PciFunction, g: &mut dyn GuestAccess, qid: u16) {
        let Some(sq) = self.sqs.get(&qid) else {
            return;
        };
        let (guest, size, first, tail) = (sq.guest, sq.size, sq.head, sq.tail);
        if first == tail {
            return;
        }
        if !self.inside(guest, (usize::from(size) * SQE) as u64) {
            devlend_fabric::limited!(
                warn,
                qid,
                "the guest's submission queue is no longer inside the DMA maps; doorbell ignored"
            );
            return;
        }
        if qid != 0
            && self
                .throttle
                .as_ref()
                .is_some_and(|t| t.waits(qid, Instant::now()))
        {
            // Its first entry waits for the limits: not read again until they can pay.
            self.unfetched = true;
            return;
        }
        let n = (usize::from(tail) + usize::from(size) - usize::from(first)) % usize::from(size);
        // Under limits a fetch may stop at any entry: read a few at a time, not the
        // whole queue at each wake-up.
        let batch = if self.throttle.is_some() {
            THROTTLED_BATCH
        } else {
            n
        };
        let mut done = 0;
        while done < n {
            let m = batch.min(n - done);
            if !self.fetch_run(f, g, qid, m) {
                break;
            }
            done += m;
        }
        self.submit_pending(f, qid);
        self.flush_cq_for_sq(g, qid);
    }

    /// Reads `m` entries of SQ `qid` from its head, checks them and queues them for
    /// the controller; `false` when it stopped before the last (no room, the limits, a
    /// failed read).
    fn fetch_run(&mut self, f: &PciFunction, g: &mut dyn GuestAccess, qid: u16, m: usize) -> bool {
        let Some(sq) = self.sqs.get(&qid) else {
            return false;
        };
        let (guest, size, first) = (sq.guest, usize::from(sq.size), usize::from(sq.head));
        // In at most two runs (the queue wraps): 64 bytes each.
        let mut raw = vec![0u8; m * SQE];
        let (mut got, mut head) = (0, first);
        while got < m {
            let run = (size - head).min(m - got);
            let iova = guest + (head * SQE) as u64;
            if let Err(e) = g.read(iova, &mut raw[got * SQE..(got + run) * SQE]) {
                devlend_fabric::limited!(warn, qid, error = %devlend_fabric::error::chain(&e), "cannot fetch submission entries");
                // Tried again at the next doorbell, of any queue.
                self.unfetched = true;
                return false;
            }
            got += run;
            head = (head + run) % size;
        }
        // What the commands waiting hold, kept up to date here rather than summed over
        // every queue per entry: only draining (in make_room) takes from it.
        let mut waiting = self.pending_bytes();
        for (k, e) in raw.chunks_exact(SQE).enumerate() {
            let at = ((first + k) % size) as u16;
            if waiting >= MAX_PENDING_BYTES {
                if !self.make_room(f, g) {
                    self.unfetched = true;
                    return false;
                }
                if self.sqs.get(&qid).is_none_or(|s| s.head != at) {
                    // Draining deleted or reset the queue meanwhile.
                    return false;
                }
                waiting = self.pending_bytes();
            }
            let mut sqe = [0u8; SQE];
            sqe.copy_from_slice(e);
            if let (Some(t), true) = (self.throttle.as_mut(), qid != 0) {
                let (lba, maps) = (&self.lba, &self.maps);
                let ok = t.admit(
                    qid,
                    at,
                    &sqe,
                    |ns| lba.get(&ns).copied(),
                    |iova| cmd::inside_maps(maps, iova, PAGE as u64),
                    Instant::now(),
                );
                if !ok {
                    // Left in the guest's queue, and the entries behind it, until the
                    // buckets can pay (`fetch_waiting`).
                    self.unfetched = true;
                    return false;
                }
            }
            if let Some(sq) = self.sqs.get_mut(&qid) {
                sq.head = ((first + k + 1) % size) as u16;
            }
            match self.prepare(g, qid, sqe) {
                Ok(p) => {
                    if let Some(sq) = self.sqs.get_mut(&qid) {
                        waiting += p.cost();
                        sq.pending_bytes += p.cost();
                        sq.pending.push_back(p);
                    }
                }
                Err(status) => {
                    self.stats.refused += 1;
                    devlend_fabric::limited!(
                        info,
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
        true
    }

    /// What the commands waiting for the controller hold, all queues together.
    pub(super) fn pending_bytes(&self) -> usize {
        self.sqs.values().map(|s| s.pending_bytes).sum()
    }

    /// Drains the controller's completions until the commands waiting hold less than
    /// [`MAX_PENDING_BYTES`]: they wait for bounce pages or shadow slots, which
    /// completions free. `false` when the controller completes nothing for
    /// [`MAKE_ROOM_FOR`].
    fn make_room(&mut self, f: &PciFunction, g: &mut dyn GuestAccess) -> bool {
        let until = std::time::Instant::now() + MAKE_ROOM_FOR;
        // What was fetched goes to the controller first: with nothing in flight,
        // nothing would complete to make room.
        let waiting: Vec<u16> = self
            .sqs
            .iter()
            .filter(|(_, s)| !s.pending.is_empty())
            .map(|(q, _)| *q)
            .collect();
        for q in waiting {
            self.submit_pending(f, q);
        }
        loop {
            // As after a quiet interval: every shadow CQ drained.
            self.on_interrupt(f, g, None);
            if self.pending_bytes() < MAX_PENDING_BYTES {
                return true;
            }
            if std::time::Instant::now() >= until {
                devlend_fabric::limited!(warn, "the controller completed nothing for 10 s; submission entries left in the guest's queue");
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Fetches what the guest submitted and [`Self::fetch`] left in its queues when the
    /// controller gave no room, or the holder's limits held it back and are due now;
    /// nothing to do (and no scan of the queues) otherwise.
    pub(crate) fn fetch_waiting(&mut self, f: &PciFunction, g: &mut dyn GuestAccess) {
        if !self.unfetched || self.wake_at().is_some_and(|t| t > Instant::now()) {
            return;
        }
        self.unfetched = false;
        let waiting: Vec<u16> = self
            .sqs
            .iter()
            .filter(|(_, s)| s.head != s.tail)
            .map(|(q, _)| *q)
            .collect();
        for q in waiting {
            self.fetch(f, g, q);
        }
    }

    /// Whether the holder's limits apply to this session's commands.
    pub(crate) fn throttled(&self) -> bool {
        self.throttle.is_some()
    }

    /// When the holder's limits can pay for a command they left in a guest's queue: the
    /// session's loop calls [`Self::fetch_waiting`] then (`None`: nothing waits for
    /// them).
    pub(crate) fn wake_at(&self) -> Option<Instant> {
        if self.unfetched {
            self.throttle.as_ref()?.due()
        } else {
            None
        }
    }

    /// Checks one command and fetches what it needs from guest memory.
    pub(super) fn prepare(
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
        let (maps, reach) = (&self.maps, &self.reach);
        // An I/O command's buffers may lie in peers' BARs instead (PRP lists stay in
        // guest memory: they are read through it).
        let in_peer = |iova: u64, len: u64| qid != 0 && reach.translate(iova, len).is_some();
        let inside = |iova: u64, len: u64| cmd::inside_maps(maps, iova, len) || in_peer(iova, len);
        let segs = cmd::prp_segments(
            le64(&sqe, 24),
            le64(&sqe, 32),
            t.len,
            max,
            |iova, buf| g.read(iova, buf).map_err(|e| mem_err(&e)),
            inside,
        )?;
        if let Some(peer) = peer::in_peers(&segs, maps, reach)? {
            return Ok(Prepared {
                sqe,
                dir: t.dir,
                len: t.len,
                segs,
                data: Vec::new(),
                post,
                peer: Some(peer),
            });
        }
        let mut data = Vec::new();
        if t.dir == Dir::ToDevice {
            data = vec![0u8; t.len];
            let mut o = 0;
            for &(iova, n) in &segs {
                g.read(iova, &mut data[o..o + n]).map_err(|e| mem_err(&e))?;
                o += n;
            }
            self.dma.guest_read += t.len as u64;
        }
        Ok(Prepared {
            sqe,
            dir: t.dir,
            len: t.len,
            segs,
            data,
            post,
            peer: None,
        })
    }

    pub(super) fn max_transfer(&self) -> usize {
        match self.device_mdts {
            0 => MAX_TRANSFER,
            m => m.min(MAX_TRANSFER),
        }
    }

    /// The queue side of an admin command: checks and shadows of queue creation and
    /// deletion (§5.4 - §5.7), and what Identify needs afterwards.
    pub(super) fn admin_post(&mut self, sqe: &[u8; SQE]) -> Result<Post, Status> {
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
                let cq = sqe[0] == admin::CREATE_CQ;
                let exists = if cq {
                    self.cqs.contains_key(&qid)
                } else {
                    self.sqs.contains_key(&qid)
                };
                // Nor one being created: its shadow is made when the command is fetched,
                // and a queue of creates of one queue would pin a shadow each (a trial's
                // 4000 creates in one doorbell pinned 500 MiB).
                let creating = |p: &Post| match p {
                    Post::CreateCq(q, _) => cq && *q == qid,
                    Post::CreateSq(q, _) => !cq && *q == qid,
                    _ => false,
                };
                let pending = self
                    .sqs
                    .get(&0)
                    .is_some_and(|a| a.pending.iter().any(|c| creating(&c.post)));
                if exists || pending || self.inflight.values().any(|c| creating(&c.post)) {
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
                    devlend_fabric::limited!(warn, error = %e, "cannot allocate a shadow queue");
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
                            tail: 0,
                            pending_bytes: 0,
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
    pub(super) fn submit_pending(&mut self, f: &PciFunction, qid: u16) {
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
            // A peer's BAR holds the data: only a PRP list is the mediator's, needed when
            // the entries (which follow PRP 1's offset, not the length) are more than 2.
            let pages = match &p.peer {
                Some(segs) => usize::from(peer::prp_pages(segs).len() > 2),
                None => data_pages + usize::from(data_pages > 2),
            };
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
            sq.pending_bytes = sq.pending_bytes.saturating_sub(p.cost());
            let mut sqe = p.sqe;
            match (&p.post, first) {
                _ if p.peer.is_some() => {
                    let pages = peer::prp_pages(p.peer.as_deref().unwrap_or_default());
                    let prp2 = match (pages.len(), first) {
                        (0 | 1, _) => 0,
                        (2, _) => pages[1],
                        (_, Some(i)) => {
                            let list: Vec<u8> =
                                pages[1..].iter().flat_map(|a| a.to_le_bytes()).collect();
                            arena.buf.write(i * PAGE, &list);
                            arena.iova(i)
                        }
                        (_, None) => 0,
                    };
                    sqe[24..32].copy_from_slice(&pages.first().copied().unwrap_or(0).to_le_bytes());
                    sqe[32..40].copy_from_slice(&prp2.to_le_bytes());
                }
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
                    peer: p.peer.is_some(),
                },
            );
        }
        if rung {
            let off = REG_DOORBELLS + 2 * u64::from(qid) * stride;
            if let Err(e) = f.pwrite(0, off, &u32::from(sq.sh_tail).to_le_bytes()) {
                devlend_fabric::limited!(warn, qid, error = %e, "cannot ring the controller's SQ doorbell");
            }
        }
    }

    /// Completes a refused command to the guest's CQ (or its backlog).
    pub(super) fn complete_now(&mut self, sqid: u16, sqe: &[u8; SQE], status: Status) {
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

    pub(super) fn flush_cq_for_sq(&mut self, g: &mut dyn GuestAccess, sqid: u16) {
        if let Some(cqid) = self.sqs.get(&sqid).map(|s| s.cqid) {
            if let Err(e) = self.post_backlog(g, cqid, true) {
                devlend_fabric::limited!(warn, error = %devlend_fabric::error::chain(&e), "cannot complete to the guest");
            }
        }
    }
}
