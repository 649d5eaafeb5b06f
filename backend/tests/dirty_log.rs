//! Dirty-page logging for live migration (vhost-user spec, "Migration", "Dirty pages
//! logging"): with a log set on the guest memory's regions as SET_LOG_BASE sets it, every
//! page the backend writes must be marked, including those written past vm-memory (a
//! read's data received from the lender straight into the guest's buffers).
//!
//! The block tests drive the real queue engine on `virtio_queue::mock::MockSplitQueue`
//! against a real lender (the device agent, in process) over TCP loopback; the NIC test
//! writes a frame into the guest's receive buffers as a queue pair does.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_backend::blk::engine::{QueueEngine, QueueStats};
use devlend_backend::blk::spec::{S_OK, T_IN};
use devlend_backend::blk::DeviceLimits;
use devlend_backend::guest::GuestMemory;
use devlend_backend::lender::LenderTarget;
use devlend_backend::net::rx::{deliver, Delivery};
use devlend_device_agent::{DeviceSpec, Lender, LenderHandle};
use vhost_user_backend::bitmap::{AtomicBitmapMmap, BitmapReplace, MemRegionBitmap, MmapLogReg};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

const MIB: u64 = 1 << 20;
/// The log's page size (vhost-user "Migration": `VHOST_LOG_PAGE`), in bytes.
const PAGE: u64 = 4096;
/// Bytes of the log file: one bit per page, far more than 2 MiB of guest memory needs.
const LOG_LEN: u64 = 4096;
const QSIZE: u16 = 256;
/// A read request's header (device-readable), status byte, and data buffer: 4 pages
/// across the boundary of the two regions.
const HEADER: u64 = 0x10000;
const STATUS: u64 = 0x8000;
const DATA: u64 = MIB - 2 * PAGE;
const DATA_LEN: u32 = 4 * PAGE as u32;
/// A page nobody writes.
const UNTOUCHED: u64 = 0x40000;

/// The frontend's dirty log, set on every region of a memory map as the library's
/// SET_LOG_BASE does (`MmapLogReg` + `AtomicBitmapMmap` per region).
struct Log {
    file: File,
}

impl Log {
    fn on(mem: &GuestMemory) -> Log {
        let file = tempfile::tempfile().unwrap();
        file.set_len(LOG_LEN).unwrap();
        let map = Arc::new(MmapLogReg::from_file(file.as_fd(), 0, LOG_LEN).unwrap());
        for region in mem.iter() {
            let bitmap = AtomicBitmapMmap::new(region, Arc::clone(&map)).unwrap();
            // The region's own bitmap (the trait's `bitmap()` is a slice of it).
            vm_memory::MmapRegion::<vhost_user_backend::bitmap::BitmapMmapRegion>::bitmap(region)
                .replace(bitmap);
        }
        Log { file }
    }

    /// As the frontend does when it has read the log.
    fn clear(&self) {
        self.file.write_all_at(&[0; LOG_LEN as usize], 0).unwrap();
    }

    fn dirty(&self, gpa: u64) -> bool {
        let page = gpa / PAGE;
        let mut b = [0u8];
        self.file.read_exact_at(&mut b, page / 8).unwrap();
        b[0] & (1 << (page % 8)) != 0
    }
}

struct Rig {
    mem: Arc<GuestMemory>,
    _lender: LenderHandle,
    _dir: tempfile::TempDir,
    engine: QueueEngine,
}

impl Rig {
    /// A lender of a 2 MiB disk whose bytes are their offset mod 251; a queue engine
    /// connected to it; guest memory of two 1 MiB regions.
    fn new() -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let file: PathBuf = dir.path().join("disk.img");
        let bytes: Vec<u8> = (0..2 * MIB).map(|i| (i % 251) as u8).collect();
        std::fs::write(&file, bytes).unwrap();
        let spec = DeviceSpec::block("disk", file);
        let lender = Lender::bind("127.0.0.1:0", vec![spec]).unwrap().spawn();
        let addr = lender.local_addr().to_string();
        let (_s, reply) =
            devlend_fabric::tcp::connect(&addr, "disk", 0, Duration::from_secs(5)).unwrap();
        let limits = Arc::new(DeviceLimits::from_device_info(
            reply.block().expect("a block device"),
        ));
        let target = LenderTarget::direct(&addr, "disk", [1; 16]);
        let mut engine = QueueEngine::new(0, target, limits, Arc::new(QueueStats::default()))
            .with_deadline(Duration::from_secs(2));
        engine.connect().unwrap();
        let mem = Arc::new(
            GuestMemory::from_ranges(&[
                (GuestAddress(0), MIB as usize),
                (GuestAddress(MIB), MIB as usize),
            ])
            .unwrap(),
        );
        Rig {
            mem,
            _lender: lender,
            _dir: dir,
            engine,
        }
    }
}

/// Places a read of [`DATA_LEN`] bytes from sector 8 into [`DATA`] on a new queue.
fn read_chain(mem: &GuestMemory) -> (MockSplitQueue<'_, GuestMemory>, Queue) {
    let mock = MockSplitQueue::create(mem, GuestAddress(0), QSIZE);
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&T_IN.to_le_bytes());
    h[8..].copy_from_slice(&8u64.to_le_bytes());
    mem.write_slice(&h, GuestAddress(HEADER)).unwrap();
    mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    let next = VRING_DESC_F_NEXT as u16;
    let write = VRING_DESC_F_WRITE as u16;
    let descs = [
        RawDescriptor::from(Descriptor::new(HEADER, 16, next, 1)),
        RawDescriptor::from(Descriptor::new(DATA, DATA_LEN, next | write, 2)),
        RawDescriptor::from(Descriptor::new(STATUS, 1, write, 0)),
    ];
    mock.add_desc_chains(&descs, 0).unwrap();
    let queue: Queue = mock.create_queue().unwrap();
    (mock, queue)
}

/// The read landed and every page the backend wrote is in the log, and nothing else.
fn check_read_logged(rig: &Rig, mock: &MockSplitQueue<'_, GuestMemory>, log: &Log) {
    assert_eq!(mock.used().idx().load(), 1, "the read did not complete");
    assert_eq!(rig.mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap(), S_OK);
    let mut data = vec![0u8; DATA_LEN as usize];
    rig.mem.read_slice(&mut data, GuestAddress(DATA)).unwrap();
    let want: Vec<u8> = (8 * 512..8 * 512 + u64::from(DATA_LEN))
        .map(|i| (i % 251) as u8)
        .collect();
    assert!(data == want, "the read's data is not in guest memory");
    for page in 0..u64::from(DATA_LEN) / PAGE {
        let gpa = DATA + page * PAGE;
        assert!(log.dirty(gpa), "data page {gpa:#x} not logged");
    }
    assert!(log.dirty(STATUS), "the status byte's page is not logged");
    let used = mock.used_addr().0;
    assert!(
        log.dirty(used),
        "the used ring's page {used:#x} is not logged"
    );
    for clean in [HEADER, UNTOUCHED, DATA - PAGE, DATA + u64::from(DATA_LEN)] {
        assert!(!log.dirty(clean), "page {clean:#x} logged but not written");
    }
}

#[test]
fn a_read_over_tcp_logs_its_data_pages_status_byte_and_used_ring() {
    let mut rig = Rig::new();
    let mem = rig.mem.clone();
    let (mock, mut queue) = read_chain(&mem);
    let log = Log::on(&mem);
    log.clear();
    rig.engine.process_avail(&mut queue, &mem).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while mock.used().idx().load() < 1 {
        assert!(Instant::now() < deadline, "request did not complete");
        std::thread::sleep(Duration::from_millis(1));
        rig.engine.process_responses(&mut queue, &mem).unwrap();
    }
    check_read_logged(&rig, &mock, &log);
}

/// GET_VRING_BASE drains the requests in flight before it answers (`DRAIN_TIMEOUT`);
/// what completes then is logged too.
#[test]
fn a_read_completed_by_the_drain_at_get_vring_base_is_logged() {
    let mut rig = Rig::new();
    let mem = rig.mem.clone();
    let (mock, mut queue) = read_chain(&mem);
    let log = Log::on(&mem);
    log.clear();
    rig.engine.process_avail(&mut queue, &mem).unwrap();
    assert_eq!(mock.used().idx().load(), 0, "completed before the drain");
    rig.engine
        .drain(&mut queue, &mem, Duration::from_secs(5))
        .unwrap();
    check_read_logged(&rig, &mock, &log);
}

/// A frame received for the guest is logged: the pages of the receive buffers it and
/// its virtio-net header went into, and the used ring's.
#[test]
fn a_received_frame_logs_its_buffer_pages() {
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 2 * MIB as usize)]).unwrap();
    let mock = MockSplitQueue::create(&mem, GuestAddress(0), 16);
    // Two receive buffers of 2 pages each, a page apart.
    let bufs = [0x10_0000u64, 0x10_3000];
    let write = VRING_DESC_F_WRITE as u16;
    let descs: Vec<RawDescriptor> = bufs
        .iter()
        .map(|&a| RawDescriptor::from(Descriptor::new(a, 2 * PAGE as u32, write, 0)))
        .collect();
    mock.add_desc_chains(&descs, 0).unwrap();
    let mut queue: Queue = mock.create_queue().unwrap();
    let log = Log::on(&mem);
    log.clear();
    // 12-byte header + 9000 bytes: both buffers (mergeable), the second one's first
    // page only (820 bytes).
    let frame: Vec<u8> = (0..9000u32).map(|i| i as u8).collect();
    assert_eq!(
        deliver(&mut queue, &mem, &frame, None, true).unwrap(),
        Delivery::Done(2)
    );
    for gpa in [0x10_0000, 0x10_1000, 0x10_3000] {
        assert!(log.dirty(gpa), "receive buffer page {gpa:#x} not logged");
    }
    assert!(log.dirty(mock.used_addr().0), "the used ring is not logged");
    for clean in [0x10_2000, 0x10_4000, UNTOUCHED] {
        assert!(!log.dirty(clean), "page {clean:#x} logged but not written");
    }
}
