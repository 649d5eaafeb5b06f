//! Dirty-page logging negotiated over vhost-user (spec, "Migration"): a frontend (the
//! `vhost` crate's, over a socket pair) sets up a real `BlkBackend` served by the
//! vendored `vhost-user-backend` daemon and gives it a log with SET_LOG_BASE, as QEMU
//! does when a migration starts. Pages are then marked through
//! `devlend_backend::guest::mark_dirty` on the backend's memory map, and read back from
//! the log file.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use devlend_backend::blk::backend::BlkBackend;
use devlend_backend::blk::engine::QueueStats;
use devlend_backend::blk::DeviceLimits;
use devlend_backend::guest::mark_dirty;
use devlend_backend::lender::LenderTarget;
use devlend_fabric::BlockGeometry;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VhostUserMemoryRegionInfo};
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestAddress, GuestAddressSpace};

const MIB: u64 = 1 << 20;
/// The log's page size (vhost-user "Migration": `VHOST_LOG_PAGE`), in bytes.
const PAGE: u64 = 4096;
/// Bytes of the log: one bit per page, enough for 4 MiB of guest memory.
const LOG_LEN: u64 = 128;

struct Rig {
    backend: Arc<BlkBackend>,
    fe: Frontend,
    _daemon: VhostUserDaemon<Arc<BlkBackend>>,
    /// Guest RAM: one file per region (1 MiB each).
    ram: Vec<File>,
    log: File,
    features: u64,
}

impl Rig {
    /// A one-queue block backend (its lender is never reached), a frontend that has
    /// negotiated every feature and protocol feature offered (LOG_ALL and LOG_SHMFD
    /// included), and a memory table of one region at guest address 0.
    fn new() -> Rig {
        let info = BlockGeometry {
            capacity_sectors: 2048,
            block_size: 512,
            max_transfer: 1 << 20,
            ..BlockGeometry::default()
        };
        let target = LenderTarget::direct("127.0.0.1:1", "disk", [1; 16]);
        let backend = Arc::new(BlkBackend::new(
            "dirty-log".into(),
            Arc::new(DeviceLimits::from_device_info(&info)),
            1,
            &target,
            Arc::new(QueueStats::default()),
            Duration::from_secs(1),
        ));
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut daemon =
            VhostUserDaemon::new("dirty-log".into(), backend.clone(), backend.memory()).unwrap();
        daemon.start_stream(theirs).unwrap();
        let fe = Frontend::from_stream(ours, 1);
        fe.set_owner().unwrap();
        let features = fe.get_features().unwrap();
        assert_ne!(
            features & VhostUserVirtioFeatures::LOG_ALL.bits(),
            0,
            "VHOST_F_LOG_ALL not offered"
        );
        fe.set_features(features).unwrap();
        let mut fe = fe;
        let proto = fe.get_protocol_features().unwrap();
        assert!(
            proto.contains(VhostUserProtocolFeatures::LOG_SHMFD),
            "LOG_SHMFD not offered"
        );
        fe.set_protocol_features(proto).unwrap();
        let log = tempfile::tempfile().unwrap();
        log.set_len(LOG_LEN).unwrap();
        let mut rig = Rig {
            backend,
            fe,
            _daemon: daemon,
            ram: Vec::new(),
            log,
            features,
        };
        let r0 = rig.region_file();
        rig.fe.set_mem_table(&[rig.region(0, &r0)]).unwrap();
        rig.ram.push(r0);
        rig
    }

    fn region_file(&self) -> File {
        let f = tempfile::tempfile().unwrap();
        f.set_len(MIB).unwrap();
        f
    }

    fn region(&self, gpa: u64, file: &File) -> VhostUserMemoryRegionInfo {
        VhostUserMemoryRegionInfo {
            guest_phys_addr: gpa,
            memory_size: MIB,
            userspace_addr: 0x7f00_0000_0000 + gpa,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        }
    }

    fn set_log_base(&self, file: &File, len: u64) -> vhost::Result<()> {
        self.fe.set_log_base(
            0,
            Some(VhostUserDirtyLogRegion {
                mmap_size: len,
                mmap_offset: 0,
                mmap_handle: file.as_raw_fd(),
            }),
        )
    }

    /// Waits until the backend has handled every message sent so far (SET_FEATURES is
    /// not acknowledged: a request with a reply, handled in order, is).
    fn sync(&self) {
        self.fe.get_features().unwrap();
    }

    /// Marks one byte at `gpa` as the backend marks what it writes past vm-memory.
    fn mark(&self, gpa: u64) {
        let mem = self.backend.memory().memory().into_inner();
        mark_dirty(&mem, GuestAddress(gpa), 1);
    }

    fn dirty(&self, gpa: u64) -> bool {
        let page = gpa / PAGE;
        let mut b = [0u8];
        self.log.read_exact_at(&mut b, page / 8).unwrap();
        b[0] & (1 << (page % 8)) != 0
    }
}

#[test]
fn set_log_base_logs_what_the_backend_marks() {
    let rig = Rig::new();
    rig.set_log_base(&rig.log, LOG_LEN).unwrap();
    rig.mark(0x3000);
    assert!(rig.dirty(0x3000));
    assert!(!rig.dirty(0x4000));
}

/// QEMU sends no new SET_LOG_BASE with a memory table that its log covers already: the
/// new regions log into the same log (devlend patch of the library's handler).
#[test]
fn regions_of_a_later_memory_table_are_logged_too() {
    let mut rig = Rig::new();
    rig.set_log_base(&rig.log, LOG_LEN).unwrap();
    let r1 = rig.region_file();
    let r2 = rig.region_file();
    rig.fe
        .set_mem_table(&[rig.region(0, &rig.ram[0]), rig.region(MIB, &r1)])
        .unwrap();
    rig.fe.add_mem_region(&rig.region(2 * MIB, &r2)).unwrap();
    rig.sync();
    rig.ram.push(r1);
    rig.ram.push(r2);
    for gpa in [0x1000, MIB + 0x1000, 2 * MIB + 0x2000] {
        rig.mark(gpa);
        assert!(rig.dirty(gpa), "page {gpa:#x} of a later region not logged");
    }
}

/// SET_FEATURES without VHOST_F_LOG_ALL ends the logging (a failed or cancelled
/// migration); a new SET_LOG_BASE starts it again.
#[test]
fn set_features_without_log_all_stops_the_logging() {
    let rig = Rig::new();
    rig.set_log_base(&rig.log, LOG_LEN).unwrap();
    rig.fe
        .set_features(rig.features & !VhostUserVirtioFeatures::LOG_ALL.bits())
        .unwrap();
    rig.sync();
    rig.mark(0x5000);
    assert!(!rig.dirty(0x5000), "marked after LOG_ALL was cleared");
    rig.set_log_base(&rig.log, LOG_LEN).unwrap();
    rig.fe.set_features(rig.features).unwrap();
    rig.sync();
    rig.mark(0x6000);
    assert!(rig.dirty(0x6000), "not marked after a new SET_LOG_BASE");
}

/// A log whose file is shorter than the size given would be a SIGBUS on the first
/// mark past the file's end, killing every device of the process: refused.
#[test]
fn a_log_past_the_end_of_its_file_is_refused() {
    let rig = Rig::new();
    let short = tempfile::tempfile().unwrap();
    short.set_len(8).unwrap();
    assert!(
        rig.set_log_base(&short, 2 * PAGE).is_err(),
        "a log past the end of its file was taken"
    );
}
