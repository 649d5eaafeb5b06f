//! The guest's actions (opcodes 9-16 and 18 of the table in `main.rs`): requests
//! laid out and offered, raw descriptors and avail entries, kicks, waits, writes into
//! guest RAM and the inflight buffer, and the SeaBIOS ring rebuild.

use super::*;

impl<'w> Run<'w> {
    pub(crate) fn offer(&mut self, inp: &mut Input<'_>) {
        let q = usize::from(inp.u8()) % usize::from(NQ);
        let kind = inp.u8() % 8;
        let sector = u64::from(inp.u16());
        let n = u32::from(inp.u8() % 17);
        let fl = inp.u8();
        let w = self.w;
        let m = &mut self.q[q];
        if m.size == 0 {
            m.size = 256;
        }
        let size = m.size;
        let slot = m.slot % 16;
        m.slot = m.slot.wrapping_add(1);
        let hdr = HDR_ZONE + (q as u64 * 32 + u64::from(slot)) * 32;
        let status = STATUS_ZONE + q as u64 * 32 + u64::from(slot);
        let data = DATA_ZONE + (q as u64 * 16 + u64::from(slot)) * 0x2000;
        let ty: u32 = [0, 1, 4, 8, 11, 13, 0xff, 0][usize::from(kind)];
        let mut h = Vec::with_capacity(16);
        h.extend_from_slice(&ty.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&sector.to_le_bytes());
        w.ram.write(hdr, &h);
        w.ram.write(status, &[0xee]);
        // (address, length, device-writable)
        let mut chain: Vec<(u64, u32, bool)> = vec![(hdr, 16, false)];
        let len = match ty {
            4 => 0,
            8 => 20,
            11 | 13 => {
                let mut seg = Vec::with_capacity(16);
                seg.extend_from_slice(&sector.to_le_bytes());
                seg.extend_from_slice(&n.to_le_bytes());
                seg.extend_from_slice(&u32::from(ty == 13 && fl & 16 != 0).to_le_bytes());
                w.ram.write(data, &seg);
                16
            }
            _ => n * 512,
        };
        let writable = matches!(ty, 0 | 8 | 0xff);
        if len > 0 {
            if fl & 1 != 0 && len >= 2 {
                chain.push((data, len / 2, writable));
                chain.push((data + u64::from(len / 2), len - len / 2, writable));
            } else {
                chain.push((data, len, writable));
            }
        }
        if fl & 2 == 0 {
            chain.push((status, 1, true));
        }
        let r = ring(q, size);
        let head = m.next_desc % size;
        for (k, &(addr, len, wr)) in chain.iter().enumerate() {
            let i = (m.next_desc.wrapping_add(k as u16)) % size;
            let next = (m.next_desc.wrapping_add(k as u16 + 1)) % size;
            let last = k + 1 == chain.len();
            let flags = if last { 0 } else { DESC_NEXT } | if wr { DESC_WRITE } else { 0 };
            r.set_desc(&w.ram, i, addr, len, flags, if last { 0 } else { next });
        }
        m.next_desc = m.next_desc.wrapping_add(chain.len() as u16);
        show!(
            "  offer q{q} type {ty} sector {sector} len {len} head {head} descs {}",
            chain.len()
        );
        if fl & 4 != 0 {
            let idx = r.avail_idx(&w.ram);
            w.ram
                .write(r.avail + 4 + 2 * u64::from(idx % size), &head.to_le_bytes());
            return;
        }
        r.offer(&w.ram, head);
        let idx = r.avail_idx(&w.ram);
        self.published(q, idx);
        if fl & 8 != 0 {
            kick(&w.events[q][0]);
        }
    }

    pub(crate) fn desc(&mut self, inp: &mut Input<'_>) {
        let qb = inp.u8();
        let q = usize::from(qb) % usize::from(NQ);
        let i = inp.u16() % 256;
        let addr = inp.u32();
        let len = inp.u32();
        let flags = inp.u16();
        let next = inp.u16();
        let addr = if qb & 0x80 != 0 {
            u64::from(addr)
        } else {
            RING_ZONE + u64::from(addr) % (RAM_LEN as u64 - RING_ZONE)
        };
        if flags & DESC_INDIRECT != 0
            || addr < RING_ZONE && len > 0
            || addr.checked_add(u64::from(len)).is_none()
        {
            self.q[q].tainted = true;
        }
        show!("  desc q{q}[{i}] = {addr:#x}+{len} flags {flags:#x} next {next}");
        ring(q, 256).set_desc(&self.w.ram, i, addr, len, flags, next);
    }

    pub(crate) fn avail_entry(&mut self, inp: &mut Input<'_>) {
        let q = usize::from(inp.u8()) % usize::from(NQ);
        let slot = inp.u16();
        let head = inp.u16();
        let size = self.q[q].size.max(1);
        let r = ring(q, size);
        show!("  avail q{q}[{}] = {head}", slot % (size + 1));
        self.w.ram.write(
            r.avail + 4 + 2 * u64::from(slot % (size + 1)),
            &head.to_le_bytes(),
        );
    }

    pub(crate) fn avail_idx(&mut self, inp: &mut Input<'_>) {
        let q = usize::from(inp.u8()) % usize::from(NQ);
        let mode = inp.u8() % 3;
        let v = inp.u16();
        let r = ring(q, 256);
        let ram = &self.w.ram;
        match mode {
            0 | 1 => {
                let idx = if mode == 0 {
                    v
                } else {
                    r.avail_idx(ram).wrapping_add(v)
                };
                show!("  avail.idx q{q} = {idx}");
                r.set_avail_idx(ram, idx);
                self.published(q, idx);
            }
            _ => {
                show!("  avail.flags q{q} = {v:#x}");
                ram.write(r.avail, &v.to_le_bytes());
            }
        }
    }

    pub(crate) fn wait(&self, ms: u8) {
        let ms = ms % 8;
        if ms > 0 {
            std::thread::sleep(Duration::from_millis(u64::from(ms)));
            return;
        }
        let used = || {
            (0..usize::from(NQ))
                .map(|q| ring(q, 256).used_idx(&self.w.ram))
                .collect::<Vec<_>>()
        };
        let end = Instant::now() + Duration::from_millis(30);
        let mut last = used();
        let mut still = Instant::now();
        while Instant::now() < end && still.elapsed() < Duration::from_millis(2) {
            std::thread::sleep(Duration::from_micros(200));
            let now = used();
            if now != last {
                last = now;
                still = Instant::now();
            }
        }
    }

    pub(crate) fn guest_write(&mut self, inp: &mut Input<'_>) {
        let off = inp.u32();
        let len = usize::from(inp.u8());
        let bytes = inp.take(len);
        let span = RAM_LEN as u64 - RING_ZONE;
        let at = RING_ZONE + u64::from(off) % span;
        let n = bytes.len().min((RAM_LEN as u64 - at) as usize);
        self.w.ram.write(at, &bytes[..n]);
    }

    pub(crate) fn inflight_write(&mut self, inp: &mut Input<'_>) {
        let off = usize::from(inp.u16());
        let len = usize::from(inp.u8());
        let bytes = inp.take(len);
        let Some(inf) = self.inflight.as_ref().filter(|i| !i.ptr.is_null()) else {
            return;
        };
        let at = off % inf.len;
        let n = bytes.len().min(inf.len - at);
        // SAFETY: `at + n` is inside the mapping; the backend reads it concurrently, as
        // shared memory between processes: bytes only.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), inf.ptr.add(at), n) };
    }

    pub(crate) fn rebuild(&mut self, q: u8, base: u16) {
        let q = usize::from(q) % usize::from(NQ);
        let i = q as u32;
        let w = self.w;
        self.send(msg(req::SET_VRING_ENABLE, &state(i, 0), &[]));
        self.get_vring_base(i);
        let size = self.q[q].size.max(1);
        let r = ring(q, size);
        r.clear_avail(&w.ram);
        r.set_avail_idx(&w.ram, base);
        // As in setup_queue: published to the current epoch until a SET_VRING_BASE is
        // taken (after a closed session, the old queue's worker may still serve it).
        self.published(q, base);
        self.q[q].next_desc = 0;
        if self
            .send(msg(req::SET_VRING_BASE, &state(i, u32::from(base)), &[]))
            .is_some_and(|o| o.accepted())
        {
            self.epoch(q, base);
        }
        self.vring_addr(
            i,
            Self::ua(r.desc),
            Self::ua(r.used),
            Self::ua(r.avail),
            0,
            0,
        );
        self.send(msg(
            req::SET_VRING_KICK,
            &u64::from(i).to_ne_bytes(),
            &[w.events[q][0].as_raw_fd()],
        ));
        self.send(msg(req::SET_VRING_ENABLE, &state(i, 1), &[]));
    }
}

pub(crate) fn inflight_payload(size: u64, off: u64, nq: u16, qs: u16) -> Vec<u8> {
    let mut p = Vec::with_capacity(24);
    p.extend_from_slice(&size.to_ne_bytes());
    p.extend_from_slice(&off.to_ne_bytes());
    p.extend_from_slice(&nq.to_ne_bytes());
    p.extend_from_slice(&qs.to_ne_bytes());
    p.extend_from_slice(&[0; 4]);
    p
}

pub(crate) fn kick(fd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: an 8-byte write to our own eventfd.
    unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), 8) };
}

pub(crate) fn drain(fd: &OwnedFd) {
    let mut b = [0u8; 8];
    // SAFETY: an 8-byte read from our own non-blocking eventfd.
    unsafe { libc::read(fd.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
}
