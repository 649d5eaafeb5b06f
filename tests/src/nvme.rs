//! A userspace NVMe driver on a vfio-user socket (the `vfio_user` crate's `Client` as
//! the VMM), for the tests of a lent NVMe controller: "guest memory" is a memfd mapped
//! for DMA at [`IOVA`]; queues and data live at fixed offsets in it. The driver waits
//! for each command's interrupt and checks that its completion entry is already in
//! guest memory then (NVMe Base 2.0 §3.3, §4.6).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_PCI_MSIX_IRQ_INDEX,
};
use vfio_user::Client;
use vmm_sys_util::eventfd::EventFd;

/// VFIO region index of the config space.
pub const CONFIG: u32 = 7;
/// VFIO region index of BAR0 (the controller registers).
pub const BAR0: u32 = 0;
/// IOVA of guest memory.
pub const IOVA: u64 = 0x10_0000;
/// Bytes of guest memory.
pub const GUEST_MEM: u64 = 0x20_0000;
/// Layout of guest memory (offsets from IOVA).
/// Admin submission queue.
pub const ASQ: u64 = 0x0000;
/// Admin completion queue.
pub const ACQ: u64 = 0x1000;
/// IDENTIFY data.
pub const IDENT: u64 = 0x2000;
/// I/O completion queue.
pub const IOCQ: u64 = 0x4000;
/// I/O submission queue.
pub const IOSQ: u64 = 0x5000;
/// PRP lists.
pub const LIST: u64 = 0x6000;
/// Data pages.
pub const DATA: u64 = 0x2_0000;
/// Entries of the admin queues.
pub const ADMIN_ENTRIES: u16 = 32;
/// Entries of the I/O queues.
pub const IO_ENTRIES: u16 = 16;
/// "Guest memory": a memfd mapped here.
pub struct Memory {
    /// The memfd, for DMA_MAP.
    pub fd: OwnedFd,
    ptr: *mut u8,
}

// SAFETY: the mapping is the Memory's own until it is dropped, and every access to it
// is a volatile byte copy through `&self`: moving it to another thread (a second
// driver running beside the first) shares nothing.
unsafe impl Send for Memory {}

impl Default for Memory {
    fn default() -> Self {
        Self::new()
    }
}

impl Memory {
    /// A zeroed memfd of [`GUEST_MEM`] bytes, mapped shared.
    pub fn new() -> Memory {
        // SAFETY: memfd_create with a NUL-terminated name; the fd is checked.
        let fd = unsafe { libc::memfd_create(c"guest".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create");
        // SAFETY: a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: the fd is open.
        let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), GUEST_MEM as i64) };
        assert_eq!(rc, 0, "ftruncate");
        // SAFETY: a new shared mapping of our memfd.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                GUEST_MEM as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        Memory {
            fd,
            ptr: ptr.cast(),
        }
    }

    /// Writes `data` at offset `off` (volatile).
    pub fn write(&self, off: u64, data: &[u8]) {
        assert!(off as usize + data.len() <= GUEST_MEM as usize);
        // SAFETY: in bounds of our mapping; volatile, since the borrower writes it too.
        unsafe {
            for (i, b) in data.iter().enumerate() {
                std::ptr::write_volatile(self.ptr.add(off as usize + i), *b);
            }
        }
    }

    /// Reads `len` bytes at offset `off` (volatile).
    pub fn read(&self, off: u64, len: usize) -> Vec<u8> {
        assert!(off as usize + len <= GUEST_MEM as usize);
        // SAFETY: as in `write`.
        unsafe {
            (0..len)
                .map(|i| std::ptr::read_volatile(self.ptr.add(off as usize + i)))
                .collect()
        }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe {
            libc::munmap(self.ptr.cast(), GUEST_MEM as usize);
        }
    }
}

/// One submission queue and its completion queue, as a driver keeps them.
pub struct Queue {
    /// Queue identifier.
    pub qid: u16,
    /// Offset of the submission queue in guest memory (IOVA - [`IOVA`]).
    pub sq: u64,
    /// Offset of the completion queue.
    pub cq: u64,
    /// Entries of each.
    pub entries: u16,
    /// The driver's SQ tail.
    pub tail: u16,
    /// The driver's CQ head.
    pub head: u16,
    /// The phase tag expected next.
    pub phase: bool,
    /// The queue's MSI-X eventfd.
    pub irq: EventFd,
}

/// A completion: DW0, SQ head, status field (without the phase).
#[derive(Debug, Clone, Copy)]
pub struct Done {
    /// Command specific DW0.
    pub dw0: u32,
    /// SQ head pointer.
    pub sqhd: u16,
    /// Status field, without the phase tag.
    pub status: u16,
}

impl Done {
    /// Status code type and status code.
    pub fn sc(&self) -> (u16, u16) {
        ((self.status >> 8) & 7, self.status & 0xff)
    }
}

/// A userspace NVMe driver on the vfio-user client.
pub struct Driver {
    /// The vfio-user client.
    pub client: Client,
    /// Guest memory.
    pub mem: Memory,
    /// The admin queue pair.
    pub admin: Queue,
    /// The I/O queue pair, once created.
    pub io: Option<Queue>,
    /// The I/O vector's eventfd until the I/O queue pair is created.
    pub io_irq: Option<EventFd>,
    /// The last command identifier used.
    pub cid: u16,
}

/// A submission queue entry: opcode, NSID, PRP1, PRP2, CDW10..15.
pub fn sqe(opcode: u8, nsid: u32, prp1: u64, prp2: u64, cdw: [u32; 6]) -> [u8; 64] {
    let mut e = [0u8; 64];
    e[0] = opcode;
    e[4..8].copy_from_slice(&nsid.to_le_bytes());
    e[24..32].copy_from_slice(&prp1.to_le_bytes());
    e[32..40].copy_from_slice(&prp2.to_le_bytes());
    for (i, d) in cdw.iter().enumerate() {
        e[40 + 4 * i..44 + 4 * i].copy_from_slice(&d.to_le_bytes());
    }
    e
}

impl Driver {
    /// Reads a controller register.
    pub fn r32(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.client
            .region_read(BAR0, off, &mut b)
            .expect("BAR0 read");
        u32::from_le_bytes(b)
    }

    /// Writes a controller register.
    pub fn w32(&mut self, off: u64, v: u32) {
        self.client
            .region_write(BAR0, off, &v.to_le_bytes())
            .expect("BAR0 write");
    }

    /// Waits for CSTS.RDY to be `rdy`.
    pub fn wait_rdy(&mut self, rdy: bool) {
        let until = Instant::now() + Duration::from_secs(60);
        while (self.r32(0x1c) & 1 == 1) != rdy {
            assert!(Instant::now() < until, "CSTS.RDY never became {rdy}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Submits `e` on the admin queue (`io` false) or the I/O queue, and waits for its
    /// completion: the interrupt first, then the entry, which must be there already.
    pub fn run(&mut self, io: bool, mut e: [u8; 64]) -> Done {
        self.cid = self.cid.wrapping_add(1);
        let cid = self.cid;
        e[2..4].copy_from_slice(&cid.to_le_bytes());
        let q = if io {
            self.io.as_mut().expect("the I/O queue")
        } else {
            &mut self.admin
        };
        let (sq, tail) = (q.sq, q.tail);
        q.tail = (q.tail + 1) % q.entries;
        let (qid, new_tail) = (q.qid, q.tail);
        self.mem.write(sq + u64::from(tail) * 64, &e);
        self.w32(0x1000 + 8 * u64::from(qid), u32::from(new_tail));
        let q = if io {
            self.io.as_mut().expect("the I/O queue")
        } else {
            &mut self.admin
        };
        let until = Instant::now() + Duration::from_secs(60);
        while q.irq.read().is_err() {
            assert!(
                Instant::now() < until,
                "no interrupt for command {:#x} on queue {qid}",
                e[0]
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        let c = self.mem.read(q.cq + u64::from(q.head) * 16, 16);
        let st = u16::from_le_bytes([c[14], c[15]]);
        assert_eq!(
            st & 1 == 1,
            q.phase,
            "the completion entry is in guest memory when the interrupt comes"
        );
        assert_eq!(u16::from_le_bytes([c[12], c[13]]), cid, "the command id");
        assert_eq!(u16::from_le_bytes([c[10], c[11]]), qid, "the SQ id");
        q.head = (q.head + 1) % q.entries;
        if q.head == 0 {
            q.phase = !q.phase;
        }
        let head = q.head;
        self.w32(0x1000 + 8 * u64::from(qid) + 4, u32::from(head));
        Done {
            dw0: u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            sqhd: u16::from_le_bytes([c[8], c[9]]),
            status: st >> 1,
        }
    }

    /// [`Self::run`], and the command must succeed.
    pub fn ok(&mut self, io: bool, e: [u8; 64], what: &str) -> Done {
        let d = self.run(io, e);
        assert_eq!(d.status, 0, "{what}: status {:?}", d.sc());
        d
    }
}

/// A driver joined to `sock`, before anything is enabled: bus mastering on, guest
/// memory mapped for DMA, two MSI-X vectors (admin, I/O).
pub fn join(sock: &Path) -> Driver {
    let mut client = Client::new(sock).expect("vfio-user client");
    let mut cmd = [0u8; 2];
    client.region_read(CONFIG, 4, &mut cmd).expect("command");
    let c = u16::from_le_bytes(cmd) | 0x06;
    client
        .region_write(CONFIG, 4, &c.to_le_bytes())
        .expect("bus mastering");
    let mem = Memory::new();
    client
        .dma_map(0, IOVA, GUEST_MEM, mem.fd.as_raw_fd())
        .expect("DMA map");
    let irqs = [
        EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
        EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
    ];
    client
        .set_irqs(
            VFIO_PCI_MSIX_IRQ_INDEX,
            VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
            0,
            2,
            &[irqs[0].as_raw_fd(), irqs[1].as_raw_fd()],
        )
        .expect("enable MSI-X");
    let [irq0, irq1] = irqs;
    Driver {
        client,
        mem,
        admin: Queue {
            qid: 0,
            sq: ASQ,
            cq: ACQ,
            entries: ADMIN_ENTRIES,
            tail: 0,
            head: 0,
            phase: true,
            irq: irq0,
        },
        io: None,
        io_irq: Some(irq1),
        cid: 0,
    }
}

/// [`join`], then [`Driver::enable`] and [`Driver::create_io_queue`].
pub fn start(sock: &Path) -> Driver {
    let mut d = join(sock);
    d.enable();
    d.create_io_queue();
    d
}

impl Driver {
    /// Enables the controller with the admin queues in guest memory (NVMe Base 2.0
    /// §3.5.1): CC.EN 0, AQA/ASQ/ACQ, CC.EN 1 with 4 KiB pages.
    pub fn enable(&mut self) {
        self.w32(0x14, 0);
        self.wait_rdy(false);
        let aqa = u32::from(ADMIN_ENTRIES - 1) << 16 | u32::from(ADMIN_ENTRIES - 1);
        self.w32(0x24, aqa);
        self.w32(0x28, (IOVA + ASQ) as u32);
        self.w32(0x2c, 0);
        self.w32(0x30, (IOVA + ACQ) as u32);
        self.w32(0x34, 0);
        self.w32(0x14, 1 | 6 << 16 | 4 << 20);
        self.wait_rdy(true);
    }

    /// Asks for queues (SET FEATURES, Number of Queues), then creates I/O queue pair 1
    /// on MSI-X vector 1; returns the SET FEATURES completion.
    pub fn create_io_queue(&mut self) -> Done {
        let nq = self.ok(
            false,
            sqe(0x09, 0, 0, 0, [0x07, 0, 0, 0, 0, 0]),
            "set features: queues",
        );
        let qs = u32::from(IO_ENTRIES - 1) << 16 | 1;
        self.ok(
            false,
            sqe(0x05, 0, IOVA + IOCQ, 0, [qs, 1 << 16 | 3, 0, 0, 0, 0]),
            "create I/O CQ",
        );
        self.ok(
            false,
            sqe(0x01, 0, IOVA + IOSQ, 0, [qs, 1 << 16 | 1, 0, 0, 0, 0]),
            "create I/O SQ",
        );
        let irq = self
            .io_irq
            .take()
            .or_else(|| self.io.take().map(|q| q.irq))
            .expect("the I/O vector's eventfd");
        self.io = Some(Queue {
            qid: 1,
            sq: IOSQ,
            cq: IOCQ,
            entries: IO_ENTRIES,
            tail: 0,
            head: 0,
            phase: true,
            irq,
        });
        nq
    }

    /// Identify Namespace `nsid` into [`IDENT`] (the mediator learns its block size).
    pub fn identify_namespace(&mut self, nsid: u32) -> Done {
        self.ok(
            false,
            sqe(0x06, nsid, IOVA + IDENT, 0, [0; 6]),
            "Identify Namespace",
        )
    }

    /// Creates I/O queue pair `qid` of `entries` entries, its SQ at `sq` and its CQ at
    /// `cq` of guest memory, the CQ on MSI-X vector 1; the caller writes the entries and
    /// rings the doorbells itself.
    pub fn create_queue_pair(&mut self, qid: u16, entries: u32, sq: u64, cq: u64) {
        let qs = (entries - 1) << 16 | u32::from(qid);
        self.ok(
            false,
            sqe(0x05, 0, IOVA + cq, 0, [qs, 1 << 16 | 3, 0, 0, 0, 0]),
            "create I/O CQ",
        );
        self.ok(
            false,
            sqe(
                0x01,
                0,
                IOVA + sq,
                0,
                [qs, u32::from(qid) << 16 | 1, 0, 0, 0, 0],
            ),
            "create I/O SQ",
        );
    }

    /// Deletes I/O queue pair `qid` (its SQ, then its CQ).
    pub fn delete_queue_pair(&mut self, qid: u16) {
        let q = u32::from(qid);
        self.ok(
            false,
            sqe(0x00, 0, 0, 0, [q, 0, 0, 0, 0, 0]),
            "delete I/O SQ",
        );
        self.ok(
            false,
            sqe(0x04, 0, 0, 0, [q, 0, 0, 0, 0, 0]),
            "delete I/O CQ",
        );
    }
}
