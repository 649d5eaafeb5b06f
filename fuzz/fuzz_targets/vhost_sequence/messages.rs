//! The vhost-user message actions (opcodes 0-8 of the table in `main.rs`).

use super::*;

impl<'w> Run<'w> {
    pub(crate) fn negotiate(&mut self, p: u8, v: u8) {
        self.send(msg(req::GET_FEATURES, &[], &[]));
        self.send(msg(req::GET_PROTOCOL_FEATURES, &[], &[]));
        let Some(s) = self.s.as_ref() else { return };
        let mut proto_bits = s.offered_proto;
        for (bit, f) in [
            proto::REPLY_ACK,
            proto::MQ,
            proto::CONFIG,
            proto::CONFIGURE_MEM_SLOTS,
            proto::INFLIGHT_SHMFD,
        ]
        .iter()
        .enumerate()
        {
            if p & (1 << bit) != 0 {
                proto_bits &= !f;
            }
        }
        if p & 0x20 != 0 {
            proto_bits |= 1 << 20;
        }
        let mut features = s.offered_features;
        for (bit, f) in [F_EVENT_IDX, F_INDIRECT, F_VERSION_1, F_PROTOCOL, 0xff_ffff]
            .iter()
            .enumerate()
        {
            if v & (1 << bit) != 0 {
                features &= !f;
            }
        }
        if v & 0x20 != 0 {
            features |= F_RING_PACKED;
        }
        self.send(msg(
            req::SET_PROTOCOL_FEATURES,
            &proto_bits.to_ne_bytes(),
            &[],
        ));
        self.send(msg(req::SET_OWNER, &[], &[]));
        self.send(msg(req::SET_FEATURES, &features.to_ne_bytes(), &[]));
    }

    pub(crate) fn mem_table(&mut self, regions: &[Region], fds: &[RawFd]) -> Option<Outcome> {
        let mut p = Vec::new();
        p.extend_from_slice(&(regions.len() as u32).to_ne_bytes());
        p.extend_from_slice(&0u32.to_ne_bytes());
        for r in regions {
            for v in [r.gpa, r.size, r.user_addr, r.mmap_offset] {
                p.extend_from_slice(&v.to_ne_bytes());
            }
        }
        self.send(msg(req::SET_MEM_TABLE, &p, fds))
    }

    pub(crate) fn good_mem_table(&mut self, layout: u8) {
        let w = self.w;
        let (ram, ram2) = (w.ram.fd(), w.ram2.fd());
        let whole = Region {
            gpa: 0,
            size: RAM_LEN as u64,
            user_addr: UA_RAM,
            mmap_offset: 0,
        };
        let half = RAM_LEN as u64 / 2;
        match layout % 3 {
            0 => self.mem_table(&[whole], &[ram]),
            1 => self.mem_table(
                &[
                    Region {
                        size: half,
                        ..whole
                    },
                    Region {
                        gpa: half,
                        size: half,
                        user_addr: UA_RAM + 0x1000_0000,
                        mmap_offset: half,
                    },
                ],
                &[ram, ram],
            ),
            _ => self.mem_table(
                &[
                    whole,
                    Region {
                        gpa: RAM2_GPA,
                        size: RAM2_LEN as u64,
                        user_addr: UA_RAM2,
                        mmap_offset: 0,
                    },
                ],
                &[ram, ram2],
            ),
        };
    }

    /// The user address of guest physical `gpa` in the good layouts (what SET_VRING_ADDR
    /// names rings by).
    pub(crate) fn ua(gpa: u64) -> u64 {
        // Layout 1 moves the upper half; the rings are in the lower one.
        UA_RAM + gpa
    }

    pub(crate) fn raw_mem_table(&mut self, inp: &mut Input<'_>) {
        let fl = inp.u8();
        let n = inp.u8() % 10;
        let regions: Vec<Region> = (0..n)
            .map(|_| {
                if fl & 1 != 0 {
                    Region {
                        gpa: inp.u64(),
                        size: inp.u64(),
                        user_addr: inp.u64(),
                        mmap_offset: inp.u64(),
                    }
                } else {
                    let gpa = u64::from(inp.u16()) << 12;
                    let size = (u64::from(inp.u16()) << 12) + u64::from(inp.u8());
                    let user_addr = UA_RAM + (u64::from(inp.u16()) << 12);
                    let mmap_offset = u64::from(inp.u16()) << 12;
                    Region {
                        gpa,
                        size,
                        user_addr,
                        mmap_offset,
                    }
                }
            })
            .collect();
        let nfd = usize::from(inp.u8() % 11);
        let kinds = inp.take(nfd.div_ceil(4));
        let w = self.w;
        let fds: Vec<RawFd> = (0..nfd)
            .map(|i| {
                let k = kinds.get(i / 4).copied().unwrap_or(0) >> (2 * (i % 4)) & 3;
                [
                    w.ram.fd(),
                    w.ram2.fd(),
                    w.junk_event.as_raw_fd(),
                    w.junk_pipe.as_raw_fd(),
                ][usize::from(k)]
            })
            .collect();
        show!("  regions {:?}", regions);
        if self.mem_table(&regions, &fds).is_some_and(|o| o.accepted()) {
            self.taint_all();
        }
    }

    pub(crate) fn vring_fd_payload(index: u64, v: u32) -> u64 {
        let mut p = index & 0xff;
        if v & 1 != 0 {
            p |= 0x100;
        }
        if v & 2 != 0 {
            p |= 0x200;
        }
        p
    }

    pub(crate) fn setup_queue(&mut self, q: u8, sz: u8, base: u16, fl: u8) {
        let q = usize::from(q) % usize::from(NQ);
        let size = 1u16 << (sz % 9);
        let w = self.w;
        let r = ring(q, size);
        show!("  setup q{q} size {size} base {base} fl {fl:#x}");
        if fl & 1 == 0 {
            w.ram.write(r.desc, &[0u8; 0x4000]);
            r.set_avail_idx(&w.ram, base);
            // Published to the backend's current epoch whatever it answers next: if
            // SET_VRING_BASE is refused or the session is gone, a live worker may take
            // chains up to `base`.
            self.published(q, base);
            r.set_used_idx(
                &w.ram,
                if fl & 2 != 0 {
                    base.wrapping_add(57)
                } else {
                    base
                },
            );
        }
        self.q[q].size = size;
        self.q[q].next_desc = 0;
        // The guest wrote used.idx itself: not the device's doing.
        self.q[q].used_at_base = r.used_idx(&w.ram);
        let i = q as u32;
        if !self
            .send(msg(req::SET_VRING_NUM, &state(i, u32::from(size)), &[]))
            .is_some_and(|o| o.accepted())
        {
            return;
        }
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
        let ev = &w.events[q];
        for (code, fd) in [
            (req::SET_VRING_CALL, &ev[1]),
            (req::SET_VRING_ERR, &ev[2]),
            (req::SET_VRING_KICK, &ev[0]),
        ] {
            self.send(msg(code, &u64::from(i).to_ne_bytes(), &[fd.as_raw_fd()]));
        }
        self.send(msg(req::SET_VRING_ENABLE, &state(i, 1), &[]));
    }

    pub(crate) fn vring_addr(
        &mut self,
        i: u32,
        desc: u64,
        used: u64,
        avail: u64,
        log: u64,
        flags: u32,
    ) {
        let mut p = Vec::new();
        p.extend_from_slice(&i.to_ne_bytes());
        p.extend_from_slice(&flags.to_ne_bytes());
        for v in [desc, used, avail, log] {
            p.extend_from_slice(&v.to_ne_bytes());
        }
        let accepted = self
            .send(msg(req::SET_VRING_ADDR, &p, &[]))
            .is_some_and(|o| o.accepted());
        if accepted && (i as usize) < self.q.len() {
            let r = ring(i as usize, 256);
            if (desc, used, avail) != (Self::ua(r.desc), Self::ua(r.used), Self::ua(r.avail)) {
                self.q[i as usize].tainted = true;
            }
        }
    }

    pub(crate) fn vring_msg(&mut self, inp: &mut Input<'_>) {
        let code = inp.u8() % 8;
        let qb = inp.u8();
        let v = inp.u32();
        let i = vring_index(qb);
        let qi = usize::from(qb) % usize::from(NQ);
        let known = (i as usize) < self.q.len();
        match code {
            0 => {
                if self
                    .send(msg(req::SET_VRING_NUM, &state(i, v), &[]))
                    .is_some_and(|o| o.accepted())
                    && known
                {
                    if v > 256 {
                        self.q[i as usize].tainted = true;
                    } else if v.is_power_of_two() {
                        self.q[i as usize].size = v as u16;
                    }
                }
            }
            1 => {
                if self
                    .send(msg(req::SET_VRING_BASE, &state(i, v), &[]))
                    .is_some_and(|o| o.accepted())
                    && known
                {
                    self.epoch(i as usize, v as u16);
                }
            }
            2 => self.get_vring_base(i),
            3 => {
                self.send(msg(req::SET_VRING_ENABLE, &state(i, v), &[]));
            }
            4..=6 => {
                let req_code = [req::SET_VRING_KICK, req::SET_VRING_CALL, req::SET_VRING_ERR]
                    [usize::from(code - 4)];
                let w = self.w;
                let own = w.events[qi][usize::from(code - 4)].as_raw_fd();
                let fds: Vec<RawFd> = match v >> 2 & 3 {
                    0 => vec![own],
                    1 => vec![],
                    2 => vec![w.ram2.fd()],
                    _ => vec![own, w.junk_event.as_raw_fd()],
                };
                let p = Self::vring_fd_payload(u64::from(i), v);
                self.send(msg(req_code, &p.to_ne_bytes(), &fds));
            }
            _ => {
                let fl = inp.u8();
                let (d, u, a) = (inp.u16() as i16, inp.u16() as i16, inp.u16() as i16);
                let r = ring(qi, 256);
                let moved = |base: u64, by: i16, scale: i64| {
                    Self::ua(base).wrapping_add_signed(i64::from(by) * scale)
                };
                let mut desc = moved(r.desc, d, 8);
                let mut used = moved(r.used, u, 8);
                let mut avail = moved(r.avail, a, 2);
                if fl & 2 != 0 {
                    desc = inp.u64();
                }
                if fl & 4 != 0 {
                    used = inp.u64();
                }
                if fl & 8 != 0 {
                    avail = inp.u64();
                }
                self.vring_addr(i, desc, used, avail, u64::from(v), u32::from(fl & 1));
            }
        }
    }

    pub(crate) fn get_vring_base(&mut self, i: u32) {
        let out = self.send(Msg {
            flags: VERSION,
            ..msg(req::GET_VRING_BASE, &state(i, 0), &[])
        });
        if let Some(Outcome::Reply(r, _)) = out {
            // No body: refused (an index out of range, before SET_OWNER, ...).
            if r.payload.is_empty() {
                return;
            }
            if r.payload.len() != 8 {
                panic!("GET_VRING_BASE {i}: a reply of {} bytes", r.payload.len());
            }
            let num = u32::from_ne_bytes(r.payload[4..8].try_into().expect("4 bytes"));
            if let Some(m) = self.q.get(i as usize) {
                if !m.tainted && dist(num as u16, m.base) > m.offered {
                    panic!(
                        "GET_VRING_BASE {i}: next avail {num} is {} past the base {} but only {} were made available",
                        dist(num as u16, m.base),
                        m.base,
                        m.offered
                    );
                }
                if num > 0xffff {
                    panic!("GET_VRING_BASE {i}: {num} is not a split queue's index");
                }
            }
        }
    }

    pub(crate) fn simple(&mut self, inp: &mut Input<'_>) {
        let code = [
            req::GET_FEATURES,
            req::SET_FEATURES,
            req::SET_OWNER,
            req::RESET_OWNER,
            req::GET_PROTOCOL_FEATURES,
            req::SET_PROTOCOL_FEATURES,
            req::GET_QUEUE_NUM,
            req::GET_MAX_MEM_SLOTS,
            req::RESET_DEVICE,
        ][usize::from(inp.u8() % 9)];
        let f = inp.u8();
        let v = inp.u64();
        let bytes = v.to_ne_bytes();
        let payload: &[u8] = if matches!(code, req::SET_FEATURES | req::SET_PROTOCOL_FEATURES) {
            &bytes
        } else {
            &[]
        };
        let flags = if f & 1 != 0 {
            VERSION
        } else {
            VERSION | NEED_REPLY
        };
        self.send(Msg {
            flags,
            ..msg(code, payload, &[])
        });
    }

    pub(crate) fn config(&mut self, inp: &mut Input<'_>) {
        let kind = inp.u8();
        let off = u32::from(inp.u16());
        let size = inp.u16();
        let flags = u32::from(inp.u8());
        let mut p = Vec::new();
        let data = if kind & 1 != 0 {
            inp.take(usize::from(size % 64))
        } else {
            vec![0; usize::from(size)]
        };
        let claimed = if kind & 1 != 0 {
            data.len() as u32
        } else {
            u32::from(size)
        };
        for v in [off, claimed, flags] {
            p.extend_from_slice(&v.to_ne_bytes());
        }
        p.extend_from_slice(&data);
        if kind & 2 != 0 {
            p.push(0);
        }
        let code = if kind & 1 != 0 {
            req::SET_CONFIG
        } else {
            req::GET_CONFIG
        };
        if let Some(Outcome::Reply(r, _)) = self.send(msg(code, &p, &[])) {
            // GET_CONFIG: the header again, then `size` bytes, or none (an error).
            let got = r
                .payload
                .get(4..8)
                .map(|b| u32::from_ne_bytes(b.try_into().expect("4")));
            match got {
                Some(n) if r.payload.len() == 12 + n as usize && (n == 0 || n == claimed) => {}
                _ => panic!(
                    "GET_CONFIG({off}, {claimed}): a reply of {} bytes saying {got:?}",
                    r.payload.len()
                ),
            }
        }
    }

    pub(crate) fn inflight_msg(&mut self, inp: &mut Input<'_>) {
        let kind = inp.u8();
        let nq = inp.u16();
        let qs = inp.u16();
        let size = u64::from(inp.u32());
        let off = u64::from(inp.u32());
        if kind & 1 == 0 {
            let p = inflight_payload(size, off, nq, qs);
            let out = self.send(Msg {
                flags: VERSION,
                ..msg(req::GET_INFLIGHT_FD, &p, &[])
            });
            if let Some(Outcome::Reply(r, mut fds)) = out {
                // No body and no fd: refused (without its protocol feature, ...).
                if r.payload.is_empty() && fds.is_empty() {
                    return;
                }
                if r.payload.len() != 24 || fds.len() != 1 {
                    panic!(
                        "GET_INFLIGHT_FD: a reply of {} bytes with {} fds",
                        r.payload.len(),
                        fds.len()
                    );
                }
                let mmap_size = u64::from_ne_bytes(r.payload[0..8].try_into().expect("8"));
                let fd = fds.pop().expect("one fd");
                let len = mmap_size.min(1 << 24) as usize;
                // SAFETY: a new shared mapping of the memfd the backend sent.
                let ptr = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        fd.as_raw_fd(),
                        0,
                    )
                };
                let ptr = if ptr == libc::MAP_FAILED || len == 0 {
                    std::ptr::null_mut()
                } else {
                    ptr.cast()
                };
                self.inflight = Some(Inflight {
                    fd,
                    ptr,
                    len,
                    mmap_size,
                });
                // The engine logs into it now; what a frontend writes there decides what a
                // later backend resubmits, and from which used index.
                self.taint_all();
            }
        } else {
            let size = if kind & 8 != 0 {
                self.inflight.as_ref().map_or(size, |i| i.mmap_size)
            } else {
                size
            };
            let p = inflight_payload(size, off, nq, qs);
            let w = self.w;
            let fds: Vec<RawFd> = match kind >> 1 & 3 {
                0 => self
                    .inflight
                    .as_ref()
                    .map(|i| i.fd.as_raw_fd())
                    .into_iter()
                    .collect(),
                1 => vec![],
                2 => vec![w.ram2.fd()],
                _ => vec![w.ram2.fd(), w.junk_event.as_raw_fd()],
            };
            if self
                .send(msg(req::SET_INFLIGHT_FD, &p, &fds))
                .is_some_and(|o| o.accepted())
            {
                self.taint_all();
            }
        }
    }

    pub(crate) fn raw(&mut self, inp: &mut Input<'_>) {
        let c = inp.u8();
        let hflags = inp.u8();
        let len = inp.u16();
        let nfd = usize::from(inp.u8() % 4);
        let code = if c < 0x30 {
            u32::from(c)
        } else {
            u32::from(c) * 0x0101_0101
        };
        let payload = if hflags & 0x40 != 0 {
            Vec::new()
        } else {
            inp.take(usize::from(len & 0x1ff))
        };
        let fds: Vec<RawFd> = (0..nfd).map(|_| self.w.junk_event.as_raw_fd()).collect();
        let lie = (hflags & 0x40 != 0).then_some(0x1000 + u32::from(len));
        let before = self.q.clone();
        let out = self.send(Msg {
            code,
            flags: u32::from(hflags & 0x3f),
            payload: &payload,
            fds: &fds,
            lie,
        });
        // A raw message may be a good one: the model does not follow what it changed.
        if out.is_some_and(|o| !matches!(o, Outcome::Closed))
            && !matches!(
                code,
                req::GET_FEATURES
                    | req::GET_PROTOCOL_FEATURES
                    | req::GET_CONFIG
                    | req::GET_QUEUE_NUM
                    | req::GET_MAX_MEM_SLOTS
                    | req::SET_OWNER
            )
        {
            self.q = before;
            self.taint_all();
        }
    }
}
