//! The rig every test runs on: a lender with two disks, a compute agent attaching one
//! to the hostile frontend (2 queues) and the other to libblkio, what a test's hostile
//! messages may cost, and a queue the hostile frontend sets up and drives.

use super::*;

pub(crate) struct Rig {
    pub(crate) _dir: tempfile::TempDir,
    pub(crate) _lender: Lender,
    pub(crate) borrower: Borrower,
    /// The hostile frontend's attachment (2 queues).
    pub(crate) sock: PathBuf,
    /// The other attachment, driven by libblkio.
    pub(crate) other: BlkClient,
    pub(crate) round: u64,
}

/// A lender with two disks, a borrower attaching `a` with 2 queues (for the hostile
/// frontend) and `b` with 1 queue (libblkio, verified I/O).
pub(crate) fn rig() -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let mut specs = Vec::new();
    for name in ["a", "b"] {
        let img = dir.path().join(format!("{name}.img"));
        sparse_file(&img, 16 * MIB).unwrap();
        specs.push(format!("{name}={}", img.display()));
    }
    let lender = Lender::start(dir.path(), &specs).unwrap();
    let borrower = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("a.sock");
    borrower.attach(&lender.addr, "a", &sock, 2).unwrap();
    let other_sock = dir.path().join("b.sock");
    borrower.attach(&lender.addr, "b", &other_sock, 1).unwrap();
    let other = BlkClient::connect(&other_sock, 1, MIB as usize).unwrap();
    let mut rig = Rig {
        _dir: dir,
        _lender: lender,
        borrower,
        sock,
        other,
        round: 0,
    };
    rig.other_io();
    rig
}

impl Rig {
    /// A raw connection to the hostile attachment, features negotiated (REPLY_ACK, MQ,
    /// CONFIG; not CONFIGURE_MEM_SLOTS), SET_OWNER sent, `ram` as the memory table.
    pub(crate) fn session(&self, ram: &GuestRam) -> RawFrontend {
        let mut fe = RawFrontend::connect(&self.sock).unwrap();
        fe.negotiate(0, proto::MQ | proto::CONFIG).unwrap();
        assert_eq!(fe.set_mem_table(&[ram.region()], &[ram.fd()]).unwrap(), 0);
        fe
    }

    /// Verified I/O on the other attachment: 64 KiB of a fresh pattern written at a
    /// fresh offset, read back and compared.
    pub(crate) fn other_io(&mut self) {
        self.round += 1;
        let len = 64 * 1024;
        let offset = (self.round * len as u64) % (16 * MIB);
        let seed = self.round as u8;
        let buf = self.other.buffer();
        for (i, b) in buf[..len].iter_mut().enumerate() {
            *b = seed.wrapping_mul(31).wrapping_add(i as u8);
        }
        let expect = buf[..len].to_vec();
        let w = self
            .other
            .run_one(
                0,
                BlkOp::Write {
                    offset,
                    buf: 0,
                    len,
                },
            )
            .unwrap();
        assert_eq!(w, 0, "the other attachment's write failed");
        self.other.buffer()[len..2 * len].fill(0);
        let r = self
            .other
            .run_one(
                0,
                BlkOp::Read {
                    offset,
                    buf: len,
                    len,
                },
            )
            .unwrap();
        assert_eq!(r, 0, "the other attachment's read failed");
        assert!(
            self.other.buffer()[len..2 * len] == expect[..],
            "the other attachment read back other data"
        );
    }

    pub(crate) fn log_len(&self) -> usize {
        self.borrower.proc.log().len()
    }

    /// The agent's CPU time (user + system) in clock ticks.
    pub(crate) fn cpu_ticks(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.borrower.proc.pid()))
            .expect("the compute agent's /proc stat");
        // Fields after "(comm) ": state is field 3; utime and stime are fields 14, 15.
        let rest = &stat[stat.rfind(')').expect("comm") + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }

    /// What the hostile messages since `log_before` cost: the agent idles (under
    /// [`CPU_BUDGET`] over 2 s), its log grew at most [`LOG_BUDGET`], it is alive, and
    /// the other attachment still serves verified I/O.
    pub(crate) fn check_cost(&mut self, log_before: usize, what: &str) {
        // SAFETY: sysconf with a valid name.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let t0 = self.cpu_ticks();
        let start = Instant::now();
        std::thread::sleep(Duration::from_secs(2));
        let share = (self.cpu_ticks() - t0) as f64 / hz / start.elapsed().as_secs_f64();
        assert!(
            share < CPU_BUDGET,
            "{what}: the compute agent used {:.0}% of a core while idle",
            share * 100.0
        );
        let log = self.borrower.proc.log();
        let grown = log.len().saturating_sub(log_before);
        eprintln!(
            "{what}: agent CPU {:.1}% of a core over 2 s, log +{grown} bytes",
            share * 100.0
        );
        assert!(
            grown <= LOG_BUDGET,
            "{what}: the agent's log grew by {grown} bytes:\n{}",
            &log[log_before.min(log.len())..]
        );
        self.borrower.proc.check_alive().unwrap();
        self.other_io();
    }
}

/// A queue the hostile frontend set up: its rings, eventfds and the next head to use.
pub(crate) struct Queue {
    pub(crate) index: u32,
    pub(crate) ring: SplitRing,
    pub(crate) kick: EventFd,
    pub(crate) call: EventFd,
    pub(crate) err: EventFd,
    pub(crate) next: u16,
}

impl Queue {
    pub(crate) fn new(index: u32) -> Self {
        let ev = || EventFd::new(EFD_NONBLOCK).unwrap();
        Queue {
            index,
            ring: SplitRing::at(u64::from(index) * 0x10000, QUEUE_SIZE),
            kick: ev(),
            call: ev(),
            err: ev(),
            next: 0,
        }
    }

    /// SET_VRING_NUM, _BASE 0, _ADDR, _CALL, _ERR, _KICK, _ENABLE, each acked 0.
    pub(crate) fn start(&self, fe: &mut RawFrontend, ram: &GuestRam) {
        let i = self.index;
        assert_eq!(fe.set_vring_num(i, u32::from(QUEUE_SIZE)).unwrap(), 0);
        assert_eq!(fe.set_vring_base(i, 0).unwrap(), 0);
        self.set_addr(fe, ram);
        self.set_fds(fe);
        assert_eq!(fe.set_vring_enable(i, true).unwrap(), 0);
    }

    pub(crate) fn set_addr(&self, fe: &mut RawFrontend, ram: &GuestRam) {
        let r = self.ring;
        let ack = fe
            .set_vring_addr(
                self.index,
                ram.user_addr(r.desc),
                ram.user_addr(r.used),
                ram.user_addr(r.avail),
            )
            .unwrap();
        assert_eq!(ack, 0, "SET_VRING_ADDR {} refused", self.index);
    }

    /// SET_VRING_CALL, _ERR and _KICK (GET_VRING_BASE forgets kick and call).
    pub(crate) fn set_fds(&self, fe: &mut RawFrontend) {
        let i = u64::from(self.index);
        for (r, fd) in [
            (req::SET_VRING_CALL, &self.call),
            (req::SET_VRING_ERR, &self.err),
            (req::SET_VRING_KICK, &self.kick),
        ] {
            assert_eq!(fe.set_vring_fd(r, i, Some(fd.as_raw_fd())).unwrap(), 0);
        }
    }

    /// Lays out a 4 KiB READ of sector 0 and offers it, without kicking; returns its head.
    pub(crate) fn offer_read(&mut self, ram: &GuestRam) -> u16 {
        let head = self.lay_out_read(ram);
        self.ring.offer(ram, head);
        head
    }

    /// Lays out a 4 KiB READ of sector 0 (header, data, status descriptors) without
    /// offering it (a test may corrupt it first: once offered, the worker may take it at
    /// any moment); returns its head.
    pub(crate) fn lay_out_read(&mut self, ram: &GuestRam) -> u16 {
        let head = self.next;
        self.next = (self.next + 3) % (QUEUE_SIZE - QUEUE_SIZE % 3);
        let base = (1 + u64::from(self.index)) * MIB + u64::from(head / 3) * 0x2000;
        let (hdr, status, data) = (base, base + 0x100, base + 0x1000);
        let mut h = Vec::new();
        h.extend_from_slice(&T_IN.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&0u64.to_le_bytes());
        ram.write(hdr, &h);
        ram.write(status, &[0xff]);
        let r = self.ring;
        r.set_desc(ram, head, hdr, 16, DESC_NEXT, head + 1);
        r.set_desc(ram, head + 1, data, 4096, DESC_NEXT | DESC_WRITE, head + 2);
        r.set_desc(ram, head + 2, status, 1, DESC_WRITE, 0);
        head
    }

    pub(crate) fn status_of(&self, ram: &GuestRam, head: u16) -> u8 {
        let base = (1 + u64::from(self.index)) * MIB + u64::from(head / 3) * 0x2000;
        ram.read(base + 0x100, 1)[0]
    }

    /// Offers a READ, kicks, and checks that it completes OK in the next used slot.
    pub(crate) fn read_ok(&mut self, ram: &GuestRam) {
        let before = self.ring.used_idx(ram);
        let head = self.offer_read(ram);
        self.kick.write(1).unwrap();
        let now = self
            .ring
            .wait_used_change(ram, before, Duration::from_secs(5))
            .unwrap_or_else(|| panic!("queue {}: the READ did not complete", self.index));
        assert_eq!(now, before.wrapping_add(1));
        assert_eq!(self.ring.used_elem(ram, before).0, u32::from(head));
        assert_eq!(self.status_of(ram, head), S_OK);
    }
}

pub(crate) fn ram() -> GuestRam {
    GuestRam::new(0, RAM_LEN).unwrap()
}

/// The features the backend offers; the session answers it (a request that works).
pub(crate) fn alive(fe: &mut RawFrontend) {
    let f = fe.get_u64(req::GET_FEATURES).unwrap();
    assert_ne!(f & F_PROTOCOL_FEATURES, 0);
    assert_ne!(f & F_VERSION_1, 0);
}
