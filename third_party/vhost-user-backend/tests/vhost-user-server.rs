use std::fs::File;
use std::io::Result;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Barrier, Mutex};
use std::thread;

use uuid::Uuid;
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserInflight, VhostUserProtocolFeatures,
    VhostUserSharedMsg,
};
use vhost::vhost_user::{Backend, Frontend, Listener, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vhost_user_backend::{VhostUserBackendMut, VhostUserDaemon, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{
    Address, Bytes, FileOffset, GuestAddress, GuestAddressSpace, GuestMemoryAtomic,
    GuestMemoryBackend, GuestMemoryMmap,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use vmm_sys_util::eventfd::EventFd;

struct MockVhostBackend {
    events: u64,
    event_idx: bool,
    acked_features: u64,
    // devlend: the guest memory, to complete the chains of a kicked ring.
    mem: Option<GuestMemoryAtomic<GuestMemoryMmap>>,
}

impl MockVhostBackend {
    const SUPPORTED_FEATURES: u64 = 0xffff_ffff_ffff_ffff;

    fn new() -> Self {
        MockVhostBackend {
            events: 0,
            event_idx: false,
            acked_features: 0,
            mem: None,
        }
    }
}

impl VhostUserBackendMut for MockVhostBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        2
    }

    fn max_queue_size(&self) -> usize {
        256
    }

    fn features(&self) -> u64 {
        Self::SUPPORTED_FEATURES
    }

    fn acked_features(&mut self, features: u64) {
        self.acked_features = features;
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        // Exclude REPLY_ACK to test that it is automatically added.
        VhostUserProtocolFeatures::all() - VhostUserProtocolFeatures::REPLY_ACK
    }

    fn reset_device(&mut self) {
        self.events = 0;
        self.event_idx = false;
        self.acked_features = 0;
    }

    fn set_event_idx(&mut self, enabled: bool) {
        self.event_idx = enabled;
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        assert_eq!(offset, 0x200);
        assert_eq!(size, 8);

        vec![0xa5u8; 8]
    }

    fn set_config(&mut self, offset: u32, buf: &[u8]) -> Result<()> {
        // devlend: a read-only field, as a back-end refuses it.
        if offset == 0x300 {
            return Err(std::io::Error::other("read-only"));
        }
        assert_eq!(offset, 0x200);
        assert_eq!(buf, &[0xa5u8; 8]);

        Ok(())
    }

    fn update_memory(&mut self, atomic_mem: GuestMemoryAtomic<GuestMemoryMmap>) -> Result<()> {
        let mem = atomic_mem.memory();
        let region = mem.find_region(GuestAddress(0x100000)).unwrap();
        assert_eq!(region.size(), 0x100000);
        self.mem = Some(atomic_mem.clone());
        Ok(())
    }

    fn set_backend_req_fd(&mut self, _backend: Backend) {}

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> Result<File> {
        let file = tempfile::tempfile().unwrap();
        Ok(file)
    }

    fn check_device_state(&self) -> Result<()> {
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        vec![1, 1]
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        Some(
            new_event_consumer_and_notifier(EventFlag::empty())
                .expect("Failed to create EventConsumer and EventNotifier"),
        )
    }

    fn handle_event(
        &mut self,
        _device_event: u16,
        _evset: EventSet,
        vrings: &[VringRwLock],
        _thread_id: usize,
    ) -> Result<()> {
        self.events += 1;
        // devlend: complete every available chain (0 bytes written), as a device would,
        // so that a test can see where the used entries land.
        if let Some(mem) = &self.mem {
            let mem = mem.memory();
            for vring in vrings {
                let mut state = vring.get_mut();
                let queue = state.get_queue_mut();
                if !queue.ready() {
                    continue;
                }
                let mut heads = Vec::new();
                while let Some(chain) = queue.pop_descriptor_chain(&*mem) {
                    heads.push(chain.head_index());
                }
                for head in heads {
                    queue.add_used(&*mem, head, 0).unwrap();
                }
            }
        }

        Ok(())
    }
}

fn setup_frontend(path: &Path, barrier: Arc<Barrier>) -> Frontend {
    setup_frontend_with_queues(path, barrier, 1)
}

fn setup_frontend_with_queues(path: &Path, barrier: Arc<Barrier>, queues: u64) -> Frontend {
    barrier.wait();
    let mut frontend = Frontend::connect(path, queues).unwrap();
    frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    // Wait before issue service requests.
    barrier.wait();

    // devlend: the back-end refuses requests other than feature negotiation before
    // SET_OWNER.
    frontend.set_owner().unwrap();

    let features = frontend.get_features().unwrap();
    let proto = frontend.get_protocol_features().unwrap();
    frontend.set_features(features).unwrap();
    frontend.set_protocol_features(proto).unwrap();
    assert!(proto.contains(VhostUserProtocolFeatures::REPLY_ACK));

    frontend
}

fn vhost_user_client(path: &Path, barrier: Arc<Barrier>) {
    barrier.wait();
    let mut frontend = Frontend::connect(path, 1).unwrap();
    frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    // Wait before issue service requests.
    barrier.wait();

    // devlend: SET_FEATURES is refused before SET_OWNER.
    frontend.set_owner().unwrap();
    let features = frontend.get_features().unwrap();
    let proto = frontend.get_protocol_features().unwrap();
    frontend.set_features(features).unwrap();
    frontend.set_protocol_features(proto).unwrap();
    assert!(proto.contains(VhostUserProtocolFeatures::REPLY_ACK));

    let queue_num = frontend.get_queue_num().unwrap();
    assert_eq!(queue_num, 2);

    frontend.set_owner().unwrap_err();
    frontend.reset_owner().unwrap();
    frontend.reset_owner().unwrap();
    frontend.set_owner().unwrap();

    frontend.set_features(features).unwrap();
    frontend.set_protocol_features(proto).unwrap();
    assert!(proto.contains(VhostUserProtocolFeatures::REPLY_ACK));

    let memfd = nix::sys::memfd::memfd_create("test", nix::sys::memfd::MFdFlags::empty()).unwrap();
    let file = File::from(memfd);
    file.set_len(0x100000).unwrap();
    let file_offset = FileOffset::new(file, 0);
    let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
        GuestAddress(0x100000),
        0x100000,
        Some(file_offset),
    )])
    .unwrap();
    let addr = mem.get_host_address(GuestAddress(0x100000)).unwrap() as u64;
    let reg = mem.find_region(GuestAddress(0x100000)).unwrap();
    let fd = reg.file_offset().unwrap();
    let regions = [VhostUserMemoryRegionInfo::new(
        0x100000,
        0x100000,
        addr,
        0,
        fd.file().as_raw_fd(),
    )];
    frontend.set_mem_table(&regions).unwrap();

    frontend.set_vring_num(0, 256).unwrap();

    let config = VringConfigData {
        queue_max_size: 256,
        queue_size: 256,
        flags: 0,
        desc_table_addr: addr,
        used_ring_addr: addr + 0x10000,
        avail_ring_addr: addr + 0x20000,
        log_addr: None,
    };
    frontend.set_vring_addr(0, &config).unwrap();

    let eventfd = EventFd::new(0).unwrap();
    frontend.set_vring_kick(0, &eventfd).unwrap();
    frontend.set_vring_call(0, &eventfd).unwrap();
    frontend.set_vring_err(0, &eventfd).unwrap();
    frontend.set_vring_enable(0, true).unwrap();

    let buf = [0u8; 8];
    let (_cfg, data) = frontend
        .get_config(0x200, 8, VhostUserConfigFlags::empty(), &buf)
        .unwrap();
    assert_eq!(&data, &[0xa5u8; 8]);
    frontend
        .set_config(0x200, VhostUserConfigFlags::empty(), &data)
        .unwrap();

    let (tx, _rx) = UnixStream::pair().unwrap();
    frontend.set_backend_request_fd(&tx).unwrap();

    let state = frontend.get_vring_base(0).unwrap();
    frontend.set_vring_base(0, state as u16).unwrap();

    assert_eq!(frontend.get_max_mem_slots().unwrap(), 509);
    let region = VhostUserMemoryRegionInfo::new(0x800000, 0x100000, addr, 0, fd.file().as_raw_fd());
    frontend.add_mem_region(&region).unwrap();
    frontend.remove_mem_region(&region).unwrap();
}

/// Provide a vhost-user back-end for front-end testing.
///
/// Set up a `MockVhostBackend` vhost-user back-end and run `cb` in a thread, passing the
/// vhost-user socket's path and a barrier to await request processing.  `cb` is supposed to run
/// the front-end tests.
///
/// After request processing has begun, run `server_fn`, passing both a reference to the back-end
/// and the same barrier as given to `cb`.  `server_fn` may perform additional back-end tests while
/// `cb` is still run in its thread.
///
/// After `server_fn` is done, await `cb` (joining its thread), and return.
fn vhost_user_server_with_fn<F: FnOnce(Arc<Mutex<MockVhostBackend>>, Arc<Barrier>)>(
    cb: fn(&Path, Arc<Barrier>),
    server_fn: F,
) {
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
    let backend = Arc::new(Mutex::new(MockVhostBackend::new()));
    let mut daemon = VhostUserDaemon::new("test".to_owned(), backend.clone(), mem).unwrap();

    let barrier = Arc::new(Barrier::new(2));
    let tmpdir = tempfile::tempdir().unwrap();
    let mut path = tmpdir.path().to_path_buf();
    path.push("socket");

    let barrier2 = barrier.clone();
    let path1 = path.clone();
    let thread = thread::spawn(move || cb(&path1, barrier2));

    let mut listener = Listener::new(&path, false).unwrap();
    barrier.wait();
    daemon.start(&mut listener).unwrap();
    barrier.wait();

    server_fn(backend, barrier);

    // handle service requests from clients.
    thread.join().unwrap();
}

fn vhost_user_server(cb: fn(&Path, Arc<Barrier>)) {
    vhost_user_server_with_fn(cb, |_, _| {})
}

#[test]
fn test_vhost_user_server() {
    vhost_user_server(vhost_user_client);
}

fn vhost_user_enable(path: &Path, barrier: Arc<Barrier>) {
    let frontend = setup_frontend(path, barrier);
    frontend.set_owner().unwrap_err();
    // devlend: the error was answered; the session goes on.
    frontend.get_features().unwrap();
}

#[test]
fn test_vhost_user_enable() {
    vhost_user_server(vhost_user_enable);
}

fn vhost_user_set_inflight(path: &Path, barrier: Arc<Barrier>) {
    let mut frontend = setup_frontend(path, barrier);
    let eventfd = EventFd::new(0).unwrap();
    // No implementation for inflight_fd yet.
    let inflight = VhostUserInflight {
        mmap_size: 0x100000,
        mmap_offset: 0,
        num_queues: 1,
        queue_size: 256,
    };
    frontend
        .set_inflight_fd(&inflight, eventfd.as_raw_fd())
        .unwrap_err();
}

#[test]
fn test_vhost_user_set_inflight() {
    vhost_user_server(vhost_user_set_inflight);
}

fn vhost_user_get_inflight(path: &Path, barrier: Arc<Barrier>) {
    let mut frontend = setup_frontend(path, barrier);
    // No implementation for inflight_fd yet.
    let inflight = VhostUserInflight {
        mmap_size: 0x100000,
        mmap_offset: 0,
        num_queues: 1,
        queue_size: 256,
    };
    assert!(frontend.get_inflight_fd(&inflight).is_err());
}

#[test]
fn test_vhost_user_get_shared_object() {
    vhost_user_server(vhost_user_get_shared_object);
}

fn vhost_user_get_shared_object(path: &Path, barrier: Arc<Barrier>) {
    let mut frontend = setup_frontend(path, barrier);
    frontend
        .get_shared_object(&VhostUserSharedMsg::default())
        .unwrap_err();
    frontend
        .get_shared_object(&VhostUserSharedMsg {
            uuid: Uuid::new_v4(),
        })
        .unwrap();
}

#[test]
fn test_vhost_user_get_inflight() {
    vhost_user_server(vhost_user_get_inflight);
}

#[cfg(feature = "postcopy")]
fn vhost_user_postcopy_advise(path: &Path, barrier: Arc<Barrier>) {
    let mut frontend = setup_frontend(path, barrier);
    let _uffd_file = frontend.postcopy_advise().unwrap();
}

#[cfg(feature = "postcopy")]
fn vhost_user_postcopy_listen(path: &Path, barrier: Arc<Barrier>) {
    let mut frontend = setup_frontend(path, barrier);
    let _uffd_file = frontend.postcopy_advise().unwrap();
    frontend.postcopy_listen().unwrap();
}

#[cfg(feature = "postcopy")]
fn vhost_user_postcopy_end(path: &Path, barrier: Arc<Barrier>) {
    let mut frontend = setup_frontend(path, barrier);
    let _uffd_file = frontend.postcopy_advise().unwrap();
    frontend.postcopy_listen().unwrap();
    frontend.postcopy_end().unwrap();
}

// These tests need an access to the `/dev/userfaultfd`
// in order to pass.
#[cfg(feature = "postcopy")]
#[test]
fn test_vhost_user_postcopy() {
    vhost_user_server(vhost_user_postcopy_advise);
    vhost_user_server(vhost_user_postcopy_listen);
    vhost_user_server(vhost_user_postcopy_end);
}

fn vhost_user_reset_device(path: &Path, barrier: Arc<Barrier>) {
    let mut frontend = setup_frontend(path, barrier.clone());

    // Signal that we are about to reset
    barrier.wait();
    // Wait until server has checked non-reset state
    barrier.wait();

    frontend.reset_device().unwrap();

    // Signal reset is done
    barrier.wait();
}

#[test]
fn test_vhost_user_reset_device() {
    vhost_user_server_with_fn(vhost_user_reset_device, |backend, barrier| {
        // Wait until `vhost_user_reset_device()` is before reset
        barrier.wait();
        // Check non-reset state
        assert!(backend.lock().unwrap().acked_features == MockVhostBackend::SUPPORTED_FEATURES);
        // Set up some arbitrary internal state
        backend.lock().unwrap().events = 42;

        // Allow reset
        barrier.wait();
        // Wait for reset to be done
        barrier.wait();

        // Check reset state
        assert!(backend.lock().unwrap().acked_features == 0);
        assert!(backend.lock().unwrap().events == 0);
    });
}

fn memfd(size: u64) -> File {
    let memfd = nix::sys::memfd::memfd_create("test", nix::sys::memfd::MFdFlags::empty()).unwrap();
    let file = File::from(memfd);
    file.set_len(size).unwrap();
    file
}

// devlend: the back-end answers invalid requests with an error (REPLY_ACK), keeps its
// state and keeps the session.
fn vhost_user_validate(path: &Path, barrier: Arc<Barrier>) {
    // The front-end would refuse to send an index >= its own queue count.
    let mut frontend = setup_frontend_with_queues(path, barrier, 8);

    let file_offset = FileOffset::new(memfd(0x100000), 0);
    let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
        GuestAddress(0x100000),
        0x100000,
        Some(file_offset),
    )])
    .unwrap();
    let addr = mem.get_host_address(GuestAddress(0x100000)).unwrap() as u64;
    let fd = mem
        .find_region(GuestAddress(0x100000))
        .unwrap()
        .file_offset()
        .unwrap()
        .file()
        .as_raw_fd();
    let region = |gpa: u64, size: u64| VhostUserMemoryRegionInfo::new(gpa, size, addr, 0, fd);
    frontend
        .set_mem_table(&[region(0x100000, 0x100000)])
        .unwrap();

    // Queue sizes: not a power of two, 0, beyond the back-end's maximum (256).
    for num in [3, 100, 0, 65535, 512] {
        assert!(frontend.set_vring_num(0, num).is_err(), "{num} accepted");
    }
    frontend.set_vring_num(0, 256).unwrap();

    // A write the back-end refuses is answered with an error.
    frontend
        .set_config(0x300, VhostUserConfigFlags::WRITABLE, &[0u8; 8])
        .unwrap_err();

    // Refused memory tables: overlapping regions, more than 8 regions without
    // CONFIGURE_MEM_SLOTS... (the mock offers it: 509 slots, so use overlap only).
    frontend
        .set_mem_table(&[region(0x100000, 0x100000), region(0x180000, 0x100000)])
        .unwrap_err();

    // Rings that do not lie in the memory table.
    let ring = |desc: u64, used: u64, avail: u64| VringConfigData {
        queue_max_size: 256,
        queue_size: 256,
        flags: 0,
        desc_table_addr: desc,
        used_ring_addr: used,
        avail_ring_addr: avail,
        log_addr: None,
    };
    let (desc, used, avail) = (addr, addr + 0x10000, addr + 0x20000);
    // the descriptor table (4096 bytes) runs past the end of the region
    let end = addr + 0x100000;
    frontend
        .set_vring_addr(0, &ring(end - 0x800, used, avail))
        .unwrap_err();
    // the used ring (2054 bytes) runs past the end
    frontend
        .set_vring_addr(0, &ring(desc, end - 0x100, avail))
        .unwrap_err();
    // the available ring is not mapped at all
    frontend
        .set_vring_addr(0, &ring(desc, used, end + 0x1000))
        .unwrap_err();
    // The old memory table is still there: the rings in it are accepted.
    frontend
        .set_vring_addr(0, &ring(desc, used, avail))
        .unwrap();

    // Vring indices out of range (the back-end has 2 queues).
    let eventfd = EventFd::new(0).unwrap();
    frontend.set_vring_num(5, 256).unwrap_err();
    frontend.set_vring_base(5, 0).unwrap_err();
    frontend
        .set_vring_addr(5, &ring(desc, used, avail))
        .unwrap_err();
    frontend.set_vring_kick(5, &eventfd).unwrap_err();
    frontend.set_vring_call(5, &eventfd).unwrap_err();
    frontend.set_vring_err(5, &eventfd).unwrap_err();
    frontend.set_vring_enable(5, true).unwrap_err();

    // The session is still up.
    frontend.get_features().unwrap();
    frontend.set_vring_base(0, 0).unwrap();
}

#[test]
fn test_vhost_user_validate() {
    vhost_user_server(vhost_user_validate);
}

// devlend: send a raw request (with need_reply) and return the u64 of its reply.
fn raw_request(sock: &mut UnixStream, code: u32, body: &[u8]) -> u64 {
    use std::io::{Read, Write};
    let mut msg = Vec::new();
    msg.extend_from_slice(&code.to_ne_bytes());
    msg.extend_from_slice(&(0x1u32 | VhostUserHeaderFlag::NEED_REPLY.bits()).to_ne_bytes());
    msg.extend_from_slice(&(body.len() as u32).to_ne_bytes());
    msg.extend_from_slice(body);
    sock.write_all(&msg).unwrap();
    let mut hdr = [0u8; 12];
    sock.read_exact(&mut hdr).unwrap();
    assert_eq!(&hdr[0..4], &code.to_ne_bytes());
    assert_eq!(&hdr[8..12], &8u32.to_ne_bytes());
    let mut value = [0u8; 8];
    sock.read_exact(&mut value).unwrap();
    u64::from_ne_bytes(value)
}

fn vring_state(index: u32, num: u32) -> Vec<u8> {
    [index.to_ne_bytes(), num.to_ne_bytes()].concat()
}

// devlend: requests the front-end API cannot send.
fn vhost_user_raw(path: &Path, barrier: Arc<Barrier>) {
    const GET_FEATURES: u32 = 1;
    const SET_OWNER: u32 = 3;
    const SET_VRING_NUM: u32 = 8;
    const SET_VRING_BASE: u32 = 10;
    const SET_PROTOCOL_FEATURES: u32 = 16;
    const CHECK_DEVICE_STATE: u32 = 43;
    barrier.wait();
    let mut sock = UnixStream::connect(path).unwrap();
    barrier.wait();

    raw_request(&mut sock, GET_FEATURES, &[]);
    let reply_ack = VhostUserProtocolFeatures::REPLY_ACK.bits().to_ne_bytes();
    assert_eq!(raw_request(&mut sock, SET_PROTOCOL_FEATURES, &reply_ack), 0);

    // Before SET_OWNER, a vring request is refused.
    assert_ne!(
        raw_request(&mut sock, SET_VRING_NUM, &vring_state(0, 64)),
        0
    );
    assert_eq!(raw_request(&mut sock, SET_OWNER, &[]), 0);
    assert_eq!(
        raw_request(&mut sock, SET_VRING_NUM, &vring_state(0, 64)),
        0
    );

    // A split queue's base has 16 bits (bits 16-31 are reserved): 0x10000 is not 0.
    assert_ne!(
        raw_request(&mut sock, SET_VRING_BASE, &vring_state(0, 0x1_0000)),
        0
    );
    assert_eq!(
        raw_request(&mut sock, SET_VRING_BASE, &vring_state(0, 5)),
        0
    );

    // DEVICE_STATE was not negotiated: CHECK_DEVICE_STATE answers an error even though
    // the back-end would report success.
    assert_ne!(raw_request(&mut sock, CHECK_DEVICE_STATE, &[]), 0);
}

#[test]
fn test_vhost_user_raw() {
    vhost_user_server(vhost_user_raw);
}

// devlend: a driver rebuilds its ring at the same address (SeaBIOS hands over to Linux:
// GET_VRING_BASE, then SET_VRING_BASE 0 and SET_VRING_ADDR) and leaves a stale used.idx
// in memory. The first completion must go to used slot 0 (next_used comes from
// SET_VRING_BASE), not to the slot the stale index names.
fn vhost_user_ring_reinit(path: &Path, barrier: Arc<Barrier>) {
    const SIZE: u16 = 16;
    const STALE: u16 = 57;
    let mut frontend = setup_frontend(path, barrier);
    let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
        GuestAddress(0x100000),
        0x100000,
        Some(FileOffset::new(memfd(0x100000), 0)),
    )])
    .unwrap();
    let addr = mem.get_host_address(GuestAddress(0x100000)).unwrap() as u64;
    let fd = mem
        .find_region(GuestAddress(0x100000))
        .unwrap()
        .file_offset()
        .unwrap()
        .file()
        .as_raw_fd();
    frontend
        .set_mem_table(&[VhostUserMemoryRegionInfo::new(
            0x100000, 0x100000, addr, 0, fd,
        )])
        .unwrap();

    let (desc, avail, used) = (
        GuestAddress(0x100000),
        GuestAddress(0x110000),
        GuestAddress(0x120000),
    );
    // Descriptor 0: a 16-byte buffer the device writes (VRING_DESC_F_WRITE).
    mem.write_obj(0x180000u64, desc).unwrap();
    mem.write_obj(16u32, desc.unchecked_add(8)).unwrap();
    mem.write_obj(2u16, desc.unchecked_add(12)).unwrap();
    // Offer head 0 as the first entry of a fresh avail ring.
    let offer = || {
        mem.write_slice(&[0u8; 4 + 2 * SIZE as usize], avail)
            .unwrap();
        mem.write_obj(0u16, avail.unchecked_add(4)).unwrap();
        mem.write_obj(1u16, avail.unchecked_add(2)).unwrap();
    };
    let used_idx = || mem.read_obj::<u16>(used.unchecked_add(2)).unwrap();
    let used_id = |slot: u64| {
        mem.read_obj::<u32>(used.unchecked_add(4 + 8 * slot))
            .unwrap()
    };
    let wait_used_idx_not = |old: u16| {
        for _ in 0..500 {
            if used_idx() != old {
                return;
            }
            thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("no completion within 5 s (used.idx still {old})");
    };
    let config = VringConfigData {
        queue_max_size: 256,
        queue_size: SIZE,
        flags: 0,
        desc_table_addr: addr,
        used_ring_addr: addr + 0x20000,
        avail_ring_addr: addr + 0x10000,
        log_addr: None,
    };

    // First driver (SeaBIOS): one request, completed in used slot 0.
    frontend.set_vring_num(0, SIZE).unwrap();
    frontend.set_vring_base(0, 0).unwrap();
    frontend.set_vring_addr(0, &config).unwrap();
    offer();
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    frontend.set_vring_call(0, &call).unwrap();
    frontend.set_vring_kick(0, &kick).unwrap();
    frontend.set_vring_enable(0, true).unwrap();
    wait_used_idx_not(0);
    assert_eq!((used_idx(), used_id(0)), (1, 0));
    assert_eq!(frontend.get_vring_base(0).unwrap(), 1);

    // Second driver (Linux): the same addresses, a fresh avail ring, but a stale used
    // index left in memory; slot 0 holds garbage so that a write to it shows.
    mem.write_obj(0xdeadu32, used.unchecked_add(4)).unwrap();
    mem.write_obj(STALE, used.unchecked_add(2)).unwrap();
    frontend.set_vring_num(0, SIZE).unwrap();
    frontend.set_vring_base(0, 0).unwrap();
    frontend.set_vring_addr(0, &config).unwrap();
    offer();
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    frontend.set_vring_call(0, &call).unwrap();
    frontend.set_vring_kick(0, &kick).unwrap();
    wait_used_idx_not(STALE);
    assert_eq!(
        (used_idx(), used_id(0)),
        (1, 0),
        "the completion went to slot {} (used.idx {})",
        STALE % SIZE,
        used_idx()
    );
}

#[test]
fn test_vhost_user_ring_reinit_stale_used_idx() {
    vhost_user_server(vhost_user_ring_reinit);
}
