//! Sequences of vhost-user messages and guest actions against the real block backend
//! (`devlend_backend::blk::BlkBackend` under the vendored `vhost-user-backend` daemon),
//! in process, as a hostile or buggy VMM and guest driver would send them.
//!
//! Once per process: a real lender (`devlend_device_agent::Lender`, a 1 MiB file on
//! loopback), a vhost-user listening socket, and the frontend's guest RAM (two memfds
//! that this process maps and writes, as a guest does). Each iteration zeroes the RAM,
//! starts a fresh `BlkBackend` (2 queues, each with its fabric session to the lender) and
//! daemon, connects to it with `devlend_tests::vhost_raw::RawFrontend` (compiled in by
//! path), plays the input's actions, and tears the session down.
//!
//! Input: actions until the input ends, each an opcode byte (mod 19) and its fields
//! (little-endian; missing bytes read as 0). `q` bytes name queue `q % 2` for guest actions
//! and macro steps; raw vring messages pick their index from `q` (see [`vring_index`]).
//!
//! | op | fields | what |
//! | --- | --- | --- |
//! | 0 negotiate | `p: u8, v: u8` | GET_FEATURES, GET/SET_PROTOCOL_FEATURES (the offered ones minus those `p` drops: bit 0 REPLY_ACK, 1 MQ, 2 CONFIG, 3 CONFIGURE_MEM_SLOTS, 4 INFLIGHT_SHMFD; bit 5 adds an unoffered one), SET_OWNER, SET_FEATURES (offered minus `v`: bit 0 EVENT_IDX, 1 INDIRECT_DESC, 2 VERSION_1, 3 PROTOCOL_FEATURES, 4 device bits 0-23; bit 5 adds RING_PACKED), each with NEED_REPLY |
//! | 1 mem table | `layout: u8` | SET_MEM_TABLE of a good layout (mod 3): RAM at 0; RAM as two regions; RAM and RAM2 at 1 MiB |
//! | 2 raw mem table | `fl: u8, n: u8`, `n % 10` regions, `nfd: u8`, fd kinds | regions of `gpa, size, user_addr, offset` (fl bit 0: four raw u64 each; else `u16` page counts and a `u8` added to the size, 7 bytes); then `nfd % 11` fds, 2 bits each (RAM, RAM2, an eventfd, a pipe) in `ceil(nfd/4)` bytes |
//! | 3 setup queue | `q: u8, sz: u8, base: u16, fl: u8` | the guest lays out queue q (size `1 << sz % 9`) at its place (fl bit 0: rings left as they are; bit 1: a stale used.idx; else zeroed with avail.idx = base); SET_VRING_NUM, _BASE, _ADDR, _CALL, _ERR, _KICK, _ENABLE 1 |
//! | 4 vring message | `code: u8, q: u8, v: u32` (+ for ADDR `fl: u8, d: i16, u: i16, a: i16` and a raw u64 per fl bit 1-3) | code mod 8: SET_VRING_NUM, _BASE, GET_VRING_BASE, SET_VRING_ENABLE (value v), _KICK, _CALL, _ERR (v bit 0: "no fd" flag; bit 1: an undefined bit; bits 2-3: the queue's eventfd, none, a memfd, two fds), _ADDR (canonical rings moved by `8d, 8u, 2a` bytes, or raw; fl bit 0 LOG flag) |
//! | 5 simple message | `code: u8, f: u8, v: u64` | code mod 9: GET_FEATURES, SET_FEATURES v, SET_OWNER, RESET_OWNER, GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES v, GET_QUEUE_NUM, GET_MAX_MEM_SLOTS, RESET_DEVICE; f bit 0: without NEED_REPLY |
//! | 6 config | `kind: u8, off: u16, size: u16, flags: u8` | kind bit 0: SET_CONFIG of `size % 64` input bytes, else GET_CONFIG of `size` (payload of `size` zeroes); bit 1: one payload byte more than `size` says |
//! | 7 inflight | `kind: u8, nq: u16, qs: u16, size: u32, off: u32` | kind bit 0: SET_INFLIGHT_FD (bits 1-2: the last GET_INFLIGHT_FD memfd, none, a RAM memfd, two fds; bit 3: the size the last reply gave), else GET_INFLIGHT_FD (its memfd is mapped for op 16) |
//! | 8 raw message | `code: u8, hflags: u8, len: u16, nfd: u8` + `len % 512` bytes | any request code (≥ 0x30: repeated in all 4 bytes), header flags `hflags & 0x3f`; hflags bit 6: only a header claiming `0x1000 + len` bytes; `nfd % 4` eventfds |
//! | 9 offer | `q: u8, kind: u8, sector: u16, n: u8, fl: u8` | a virtio-blk request (kind mod 8: IN, OUT, FLUSH, GET_ID, DISCARD, WRITE_ZEROES, type 0xff, IN) of `n % 17` sectors in the next descriptors; fl bit 0: data split in two; 1: no status descriptor; 2: not published; 3: kick; 4: WRITE_ZEROES unmap |
//! | 10 descriptor | `q: u8, i: u16, addr: u32, len: u32, flags: u16, next: u16` | descriptor `i % 256` of queue q (q bit 7: `addr` raw, else inside the buffer area) |
//! | 11 avail entry | `q: u8, slot: u16, head: u16` | avail ring entry `slot % (size + 1)` (the last is used_event) |
//! | 12 avail index | `q: u8, mode: u8, v: u16` | mode mod 3: avail.idx = v; avail.idx += v as i16; avail.flags = v |
//! | 13 kick | `q: u8` | writes the queue's kick eventfd |
//! | 14 wait | `ms: u8` | sleeps `ms % 8` ms; 0: until the used indices stay still for 2 ms (30 ms at most) |
//! | 15 guest write | `off: u32, len: u8` + `len` bytes | into guest RAM past the rings (headers, data, indirect tables) |
//! | 16 inflight write | `off: u16, len: u8` + `len` bytes | into the mapped GET_INFLIGHT_FD buffer |
//! | 17 reconnect | | closes the connection, tears the backend down, starts a fresh one and connects (guest RAM and the inflight memfd are kept, as across a backend restart) |
//! | 18 rebuild | `q: u8, base: u16` | the SeaBIOS-to-kernel handover: SET_VRING_ENABLE 0, GET_VRING_BASE, avail ring zeroed (used left stale), SET_VRING_BASE base, _ADDR, _KICK, _ENABLE 1 |
//!
//! Must hold (a violation panics): nothing in the backend panics; each message is
//! followed by a GET_PROTOCOL_FEATURES barrier, and the backend answers within 2 s (a
//! hang is a crash); a message that must be answered is (GET_FEATURES,
//! GET_PROTOCOL_FEATURES and GET_CONFIG always; requests that have an ack form, well
//! formed, with NEED_REPLY once REPLY_ACK is in effect), never closes the session, and
//! gets one reply at most, to itself; nothing is answered that may not be; on a queue
//! whose rings and buffers only the model touched, used.idx is never more ahead of the
//! base than the avail index was, nor is GET_VRING_BASE's answer; after the sequence no
//! thread spins; the backend tears down within 5 s, leaves no reference to itself, no
//! fd and no thread behind; and the log stays bounded.
//!
//! Why this file is over 600 lines: a fuzz target whose model of the frontend (`Run`, a
//! method per opcode of the table above, about 1100 lines) keeps the session and queue
//! state that every reply is checked against, so its parts belong together. The log
//! counting, the watchdog and the process checks (spinning threads, leaked fds and threads)
//! could move to a module included by `#[path]`, as `vhost_raw` is, and are left here for
//! now.

#![no_main]

use std::cell::RefCell;
use std::fmt::Write as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use devlend_backend::blk::backend::BlkBackend;
use devlend_backend::blk::engine::QueueStats;
use devlend_backend::blk::DeviceLimits;
use devlend_backend::lender::LenderTarget;
use devlend_device_agent::{BlockSpec, DeviceSpec, Lender, LenderHandle};
use libfuzzer_sys::fuzz_target;
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;

#[allow(dead_code, missing_docs)]
#[path = "../../tests/src/vhost_raw.rs"]
mod vhost_raw;

use vhost_raw::{
    proto, req, GuestRam, RawFrontend, Region, Reply, SplitRing, DESC_INDIRECT, DESC_NEXT,
    DESC_WRITE, NEED_REPLY, REPLY, VERSION,
};

/// Queues of the device.
const NQ: u16 = 2;
/// How long the backend may take to answer a message.
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a teardown may take.
const TEARDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Guest RAM (memfd `RAM`, guest physical 0): queue q's rings at q × 16 KiB (descriptors,
/// avail ring at +4 KiB, used ring at +8 KiB: the same places for any size up to 256),
/// then request headers and status bytes, then data buffers, then room for anything.
const RAM_LEN: usize = 0x60000;
const RING_ZONE: u64 = 0x8000;
const HDR_ZONE: u64 = 0x8000;
const STATUS_ZONE: u64 = 0xc000;
const DATA_ZONE: u64 = 0x10000;
/// A second memfd, at guest physical 1 MiB in layout 2.
const RAM2_LEN: usize = 0x10000;
const RAM2_GPA: u64 = 0x10_0000;
/// The frontend's (made-up) virtual addresses of RAM and RAM2.
const UA_RAM: u64 = 0x7f00_0000_0000;
const UA_RAM2: u64 = 0x7f10_0000_0000;

/// virtio feature bits.
const F_INDIRECT: u64 = 1 << 28;
const F_EVENT_IDX: u64 = 1 << 29;
const F_PROTOCOL: u64 = 1 << 30;
const F_VERSION_1: u64 = 1 << 32;
const F_RING_PACKED: u64 = 1 << 34;

static SHOW: LazyLock<bool> = LazyLock::new(|| std::env::var_os("DEVLEND_FUZZ_SHOW").is_some());

macro_rules! show {
    ($($a:tt)*) => { if *SHOW { eprintln!($($a)*); } };
}

// ---------------------------------------------------------------------------------------
// Log counting: every tracing event and `log` record at INFO or above.

static LOG_LINES: AtomicUsize = AtomicUsize::new(0);

struct CountingSubscriber;

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl tracing::Subscriber for CountingSubscriber {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        *m.level() <= tracing::Level::INFO
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::INFO)
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        LOG_LINES.fetch_add(1, Ordering::Relaxed);
        if *SHOW {
            let mut f = Fields(String::new());
            e.record(&mut f);
            eprintln!(
                "  log {} {}:{}",
                e.metadata().level(),
                e.metadata().target(),
                f.0
            );
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

struct CountingLogger;

impl log::Log for CountingLogger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Info
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            LOG_LINES.fetch_add(1, Ordering::Relaxed);
            show!("  log {} {}: {}", r.level(), r.target(), r.args());
        }
    }
    fn flush(&self) {}
}

static LOGGER: CountingLogger = CountingLogger;

// ---------------------------------------------------------------------------------------
// Watchdog: a step that must end in bounded time arms it; past the deadline the process
// aborts (libFuzzer saves the input).

static WATCH: Mutex<Option<(Instant, &'static str)>> = Mutex::new(None);

fn arm(what: &'static str, d: Duration) {
    *WATCH.lock().unwrap() = Some((Instant::now() + d, what));
}

fn disarm() {
    *WATCH.lock().unwrap() = None;
}

fn start_watchdog() {
    std::thread::Builder::new()
        .name("fuzz-watchdog".into())
        .spawn(|| loop {
            std::thread::sleep(Duration::from_millis(50));
            if let Some((deadline, what)) = *WATCH.lock().unwrap() {
                if Instant::now() > deadline {
                    eprintln!("vhost_sequence: hang: {what} did not end in time");
                    std::process::abort();
                }
            }
        })
        .expect("watchdog thread");
}

// ---------------------------------------------------------------------------------------
// The process-wide world.

struct World {
    _lender: LenderHandle,
    _dir: PathBuf,
    sock: PathBuf,
    listener: RefCell<Listener>,
    limits: Arc<DeviceLimits>,
    target: LenderTarget,
    stats: Arc<QueueStats>,
    ram: GuestRam,
    ram2: GuestRam,
    /// An eventfd and a pipe's read end: fds of the wrong kind for a memory table.
    junk_event: OwnedFd,
    junk_pipe: OwnedFd,
    /// Per queue: kick, call, err eventfds.
    events: Vec<[OwnedFd; 3]>,
    /// Fds and threads of the process between iterations, once settled.
    baseline: Option<(usize, usize)>,
    baseline_lists: (Vec<String>, Vec<String>),
    /// What /proc/self/fd shows for `junk_pipe`.
    junk_pipe_name: String,
}

fn eventfd() -> OwnedFd {
    // SAFETY: eventfd with valid flags; the fd is new and owned here.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: as above.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

impl World {
    fn new() -> World {
        // The compute agent runs with SIGPIPE ignored (Rust's runtime does it); libFuzzer's
        // main does not, and a write to a closed socket would kill the process.
        // SAFETY: setting a signal disposition to SIG_IGN.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let _ = tracing::subscriber::set_global_default(CountingSubscriber);
        let _ = log::set_logger(&LOGGER);
        log::set_max_level(log::LevelFilter::Info);
        start_watchdog();

        let dir = std::env::temp_dir().join(format!("devlend-fuzz-vhost-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        // libFuzzer ends the process with exit(): remove the disk image and socket then.
        let _ = TEMP_DIR.set(dir.clone());
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(remove_temp_dir) };
        let disk = dir.join("disk.img");
        std::fs::File::create(&disk)
            .and_then(|f| f.set_len(1 << 20))
            .expect("disk image");
        let mut block = BlockSpec::new(disk);
        block.serial = Some("FUZZ-VHOST-SEQUENCE".into());
        let spec = DeviceSpec::new("disk", block);
        let lender = Lender::bind("127.0.0.1:0", vec![spec])
            .expect("lender")
            .spawn();
        let addr = lender.local_addr().to_string();
        let (_s, reply) =
            devlend_fabric::tcp::connect(&addr, "disk", 0, Duration::from_secs(5)).expect("hello");
        let geometry = reply.block().expect("the lender describes a block device");
        let limits = Arc::new(DeviceLimits::from_device_info(geometry));
        let sock = dir.join("vhost.sock");
        let listener = Listener::new(&sock, true).expect("vhost-user listener");
        let mut pipe = [0; 2];
        // SAFETY: pipe2 fills the two-element array.
        assert_eq!(
            unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) },
            0
        );
        // SAFETY: both ends are new fds owned here; the write end is closed at once.
        let (junk_pipe, _w) =
            unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
        let junk_pipe_name = std::fs::read_link(format!("/proc/self/fd/{}", junk_pipe.as_raw_fd()))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        World {
            junk_pipe_name,
            _lender: lender,
            _dir: dir,
            sock,
            listener: RefCell::new(listener),
            limits,
            target: LenderTarget::direct(addr, "disk", [7; 16]),
            stats: Arc::new(QueueStats::new(NQ)),
            ram: GuestRam::new(0, RAM_LEN).expect("guest RAM"),
            ram2: GuestRam::new(RAM2_GPA, RAM2_LEN).expect("guest RAM2"),
            junk_event: eventfd(),
            junk_pipe,
            events: (0..NQ).map(|_| [eventfd(), eventfd(), eventfd()]).collect(),
            baseline: None,
            baseline_lists: (Vec::new(), Vec::new()),
        }
    }
}

static TEMP_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

extern "C" fn remove_temp_dir() {
    if let Some(d) = TEMP_DIR.get() {
        let _ = std::fs::remove_dir_all(d);
    }
}

thread_local! {
    static WORLD: RefCell<Option<World>> = const { RefCell::new(None) };
}

// ---------------------------------------------------------------------------------------
// Input.

/// Reads the input front to back; past its end every byte is 0.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        let n = N.min(self.0.len());
        b[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        b
    }
    fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
    fn take(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head.to_vec()
    }
}

/// A raw vring message's index from `q`: 0-3 (2 and 3 are past the last queue) for
/// `q < 0x80`, `q & 0x3f` up to 0xbf, else near `u32::MAX`.
fn vring_index(q: u8) -> u32 {
    match q >> 6 {
        0 | 1 => u32::from(q & 3),
        2 => u32::from(q & 0x3f),
        _ => 0xffff_fff0 | u32::from(q & 0xf),
    }
}

// ---------------------------------------------------------------------------------------
// The frontend's model of the session and of each queue.

/// What the backend made of a message.
#[derive(Debug)]
enum Outcome {
    /// No reply, the session goes on (for a request without a reply of its own: done).
    Done,
    /// A REPLY_ACK status.
    Ack(u64),
    /// A reply with a body of its own.
    Reply(Reply, Vec<OwnedFd>),
    /// The backend closed the connection.
    Closed,
}

impl Outcome {
    /// Whether a request without a reply of its own took effect.
    fn accepted(&self) -> bool {
        matches!(self, Outcome::Done | Outcome::Ack(0))
    }
}

/// The frontend's view of one queue. The "epoch" starts at the last SET_VRING_BASE the
/// backend took.
#[derive(Debug, Clone, Default)]
struct QModel {
    /// The size the guest lays the rings out for (a power of two up to 256).
    size: u16,
    base: u16,
    /// used.idx in guest memory when the epoch started (until the device writes it).
    used_at_base: u16,
    /// How far past `base` the avail index has been (forward, within half the range).
    offered: u16,
    /// Something other than the model may have written the used ring (a ring or buffer
    /// laid out where the model did not put it, an inflight buffer, a memory table that
    /// does not map RAM 1:1): the used-index check is off.
    tainted: bool,
    next_desc: u16,
    slot: u16,
    /// SET_VRING_KICK was taken since the last GET_VRING_BASE.
    started: bool,
}

fn dist(a: u16, b: u16) -> u16 {
    a.wrapping_sub(b)
}

fn ring(q: usize, size: u16) -> SplitRing {
    SplitRing::at(q as u64 * 0x4000, size)
}

struct Inflight {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
    mmap_size: u64,
}

impl Drop for Inflight {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: the mapping made when the memfd came, unmapped once.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

struct Session {
    backend: Arc<BlkBackend>,
    daemon: VhostUserDaemon<Arc<BlkBackend>>,
    fe: Option<RawFrontend>,
    /// The backend has served GET_FEATURES (which offers PROTOCOL_FEATURES).
    features_seen: bool,
    /// The protocol features the backend took last.
    proto_acked: u64,
    offered_features: u64,
    offered_proto: u64,
}

impl Session {
    fn reply_ack(&self) -> bool {
        self.features_seen && self.proto_acked & proto::REPLY_ACK != 0
    }
}

/// One iteration's state.
struct Run<'w> {
    w: &'w World,
    s: Option<Session>,
    q: Vec<QModel>,
    inflight: Option<Inflight>,
    messages: usize,
    sessions: usize,
}

/// Request codes that have no reply of their own (a REPLY_ACK status is their reply).
fn ack_form(code: u32) -> bool {
    matches!(
        code,
        req::SET_OWNER
            | req::RESET_OWNER
            | req::SET_FEATURES
            | req::SET_PROTOCOL_FEATURES
            | req::SET_MEM_TABLE
            | req::SET_VRING_NUM
            | req::SET_VRING_ADDR
            | req::SET_VRING_BASE
            | req::SET_VRING_KICK
            | req::SET_VRING_CALL
            | req::SET_VRING_ERR
            | req::SET_VRING_ENABLE
            | req::SET_CONFIG
            | req::SET_INFLIGHT_FD
            | req::RESET_DEVICE
    )
}

/// Request codes answered with a reply of their own.
fn has_reply_body(code: u32) -> bool {
    matches!(
        code,
        req::GET_FEATURES
            | req::GET_PROTOCOL_FEATURES
            | req::GET_VRING_BASE
            | req::GET_QUEUE_NUM
            | req::GET_CONFIG
            | req::GET_INFLIGHT_FD
            | req::GET_MAX_MEM_SLOTS
            // SET_LOG_BASE, POSTCOPY_ADVISE, GET_SHARED_OBJECT, SET_DEVICE_STATE_FD,
            // CHECK_DEVICE_STATE, GET_SHMEM_CONFIG
            | 6 | 28 | 41 | 42 | 43 | 44
    )
}

/// Requests that may carry fds.
fn takes_fds(code: u32) -> bool {
    matches!(
        code,
        req::SET_MEM_TABLE
            | req::SET_VRING_KICK
            | req::SET_VRING_CALL
            | req::SET_VRING_ERR
            | req::SET_INFLIGHT_FD
            | req::ADD_MEM_REG
            | req::REM_MEM_REG
    )
}

/// The payload size of a well-formed request, where fixed.
fn fixed_size(code: u32) -> Option<usize> {
    Some(match code {
        req::SET_OWNER | req::RESET_OWNER | req::RESET_DEVICE => 0,
        req::GET_FEATURES | req::GET_PROTOCOL_FEATURES => 0,
        req::SET_FEATURES | req::SET_PROTOCOL_FEATURES => 8,
        req::SET_VRING_NUM | req::SET_VRING_BASE | req::SET_VRING_ENABLE => 8,
        req::SET_VRING_KICK | req::SET_VRING_CALL | req::SET_VRING_ERR => 8,
        req::SET_VRING_ADDR => 40,
        req::SET_INFLIGHT_FD => 24,
        _ => return None,
    })
}

fn name(code: u32) -> String {
    let n = match code {
        req::GET_FEATURES => "GET_FEATURES",
        req::SET_FEATURES => "SET_FEATURES",
        req::SET_OWNER => "SET_OWNER",
        req::RESET_OWNER => "RESET_OWNER",
        req::SET_MEM_TABLE => "SET_MEM_TABLE",
        req::SET_VRING_NUM => "SET_VRING_NUM",
        req::SET_VRING_ADDR => "SET_VRING_ADDR",
        req::SET_VRING_BASE => "SET_VRING_BASE",
        req::GET_VRING_BASE => "GET_VRING_BASE",
        req::SET_VRING_KICK => "SET_VRING_KICK",
        req::SET_VRING_CALL => "SET_VRING_CALL",
        req::SET_VRING_ERR => "SET_VRING_ERR",
        req::GET_PROTOCOL_FEATURES => "GET_PROTOCOL_FEATURES",
        req::SET_PROTOCOL_FEATURES => "SET_PROTOCOL_FEATURES",
        req::GET_QUEUE_NUM => "GET_QUEUE_NUM",
        req::SET_VRING_ENABLE => "SET_VRING_ENABLE",
        req::GET_CONFIG => "GET_CONFIG",
        req::SET_CONFIG => "SET_CONFIG",
        req::GET_INFLIGHT_FD => "GET_INFLIGHT_FD",
        req::SET_INFLIGHT_FD => "SET_INFLIGHT_FD",
        req::RESET_DEVICE => "RESET_DEVICE",
        req::GET_MAX_MEM_SLOTS => "GET_MAX_MEM_SLOTS",
        req::ADD_MEM_REG => "ADD_MEM_REG",
        req::REM_MEM_REG => "REM_MEM_REG",
        _ => return format!("request {code:#x}"),
    };
    n.to_owned()
}

/// A message as sent.
struct Msg<'a> {
    code: u32,
    flags: u32,
    payload: &'a [u8],
    fds: &'a [RawFd],
    /// A header that claims this size, sent without the payload.
    lie: Option<u32>,
}

fn msg<'a>(code: u32, payload: &'a [u8], fds: &'a [RawFd]) -> Msg<'a> {
    Msg {
        code,
        flags: VERSION | NEED_REPLY,
        payload,
        fds,
        lie: None,
    }
}

fn state(index: u32, num: u32) -> Vec<u8> {
    vhost_raw::vring_state(index, num)
}

fn ack_of(o: &Outcome) -> String {
    match o {
        Outcome::Done => "done".into(),
        Outcome::Ack(v) => format!("ack {v}"),
        Outcome::Reply(r, fds) => format!("reply of {} bytes, {} fds", r.payload.len(), fds.len()),
        Outcome::Closed => "closed".into(),
    }
}

impl<'w> Run<'w> {
    fn open(&self) -> bool {
        self.s.as_ref().is_some_and(|s| s.fe.is_some())
    }

    /// Sends `m`, then a barrier (GET_PROTOCOL_FEATURES, or GET_FEATURES after one),
    /// reads everything up to the barrier's reply, and checks it. `None` if the session
    /// was closed before.
    fn send(&mut self, m: Msg<'_>) -> Option<Outcome> {
        let s = self.s.as_mut()?;
        let reply_ack = s.reply_ack();
        let fe = s.fe.as_mut()?;
        self.messages += 1;
        let code = m.code;
        let what = format!(
            "{}(flags {:#x}, {} bytes{}, {} fds)",
            name(code),
            m.flags,
            m.payload.len(),
            m.lie
                .map(|l| format!(", header says {l}"))
                .unwrap_or_default(),
            m.fds.len()
        );
        let well_formed = m.lie.is_none()
            && m.flags & !NEED_REPLY == VERSION
            && m.payload.len() <= 0x1000
            && (m.fds.is_empty() || takes_fds(code))
            && fixed_size(code).is_none_or(|n| n == m.payload.len());
        // SET_PROTOCOL_FEATURES (always taken when well formed) is acked under the
        // features it sets.
        let reply_ack = if code == req::SET_PROTOCOL_FEATURES && well_formed {
            let v = u64::from_ne_bytes(m.payload.try_into().expect("8 bytes"));
            s.features_seen && v & proto::REPLY_ACK != 0
        } else {
            reply_ack
        };
        let must_reply = well_formed
            && match code {
                req::GET_FEATURES | req::GET_PROTOCOL_FEATURES | req::GET_CONFIG => true,
                req::SET_INFLIGHT_FD => {
                    // num_queues and queue_size (u16 at 16 and 18) must not be 0.
                    m.flags & NEED_REPLY != 0
                        && reply_ack
                        && m.payload[16..18] != [0, 0]
                        && m.payload[18..20] != [0, 0]
                }
                c => ack_form(c) && m.flags & NEED_REPLY != 0 && reply_ack,
            };
        let may_reply =
            must_reply || has_reply_body(code) || m.flags & NEED_REPLY != 0 && reply_ack;

        // The barrier: a request answered whatever the state, of another code than `m`'s.
        let barrier = if code == req::GET_PROTOCOL_FEATURES {
            req::GET_FEATURES
        } else {
            req::GET_PROTOCOL_FEATURES
        };
        let sent = match m.lie {
            Some(size) => fe.send_header(code, m.flags, size),
            None => fe.send(code, m.flags, m.payload, m.fds),
        }
        .and_then(|()| fe.send(barrier, VERSION, &[], &[]));
        let mut replies = Vec::new();
        let mut closed = sent.is_err();
        let mut barrier_reply = None;
        while !closed {
            match fe.recv_with_fds() {
                Ok((r, fds)) if r.request == barrier => {
                    if r.flags & REPLY == 0 || r.payload.len() != 8 || !fds.is_empty() {
                        panic!(
                            "{what}: the barrier was answered with {r:?} and {} fds",
                            fds.len()
                        );
                    }
                    barrier_reply = Some(u64::from_ne_bytes(
                        r.payload.as_slice().try_into().expect("8 bytes"),
                    ));
                    break;
                }
                Ok(reply) => replies.push(reply),
                Err(e) => match e.downcast_ref::<std::io::Error>().map(|e| e.kind()) {
                    Some(std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                        panic!("hang: the backend did not answer within {REPLY_TIMEOUT:?} after {what}")
                    }
                    _ => closed = true,
                },
            }
        }
        if closed {
            s.fe = None;
        }
        if replies.len() > 1 {
            panic!(
                "{what}: {} replies: {:?}",
                replies.len(),
                replies.iter().map(|r| &r.0).collect::<Vec<_>>()
            );
        }
        let reply = replies.pop();
        if let Some((r, _)) = &reply {
            if r.flags & REPLY == 0 || r.request != code {
                panic!("{what}: answered with {r:?}");
            }
            if !may_reply {
                panic!("{what}: answered ({r:?}) though it asked for no reply (REPLY_ACK in effect: {reply_ack})");
            }
        } else if must_reply {
            panic!(
                "{what}: no reply (REPLY_ACK in effect: {reply_ack}; connection closed: {closed})"
            );
        }
        if must_reply && closed {
            panic!("{what}: the backend answered, then closed the session");
        }
        if let Some(v) = barrier_reply {
            if barrier == req::GET_FEATURES {
                s.offered_features = v;
                s.features_seen = v & F_PROTOCOL != 0;
            }
        }
        let out = match reply {
            Some((r, fds)) if !has_reply_body(code) => {
                let v: [u8; 8] = r
                    .payload
                    .as_slice()
                    .try_into()
                    .unwrap_or_else(|_| panic!("{what}: an ack of {} bytes", r.payload.len()));
                assert!(fds.is_empty(), "{what}: an ack with fds");
                Outcome::Ack(u64::from_ne_bytes(v))
            }
            Some((r, fds)) => Outcome::Reply(r, fds),
            None if closed => Outcome::Closed,
            None => Outcome::Done,
        };
        show!("  {what} => {}", ack_of(&out));
        if let (Outcome::Reply(r, _), req::GET_FEATURES) = (&out, code) {
            if let Ok(v) = <[u8; 8]>::try_from(r.payload.as_slice()) {
                let s = self.s.as_mut().expect("session");
                s.offered_features = u64::from_ne_bytes(v);
                s.features_seen = s.offered_features & F_PROTOCOL != 0;
            }
        }
        if let (Outcome::Reply(r, _), req::GET_PROTOCOL_FEATURES) = (&out, code) {
            if let Ok(v) = <[u8; 8]>::try_from(r.payload.as_slice()) {
                self.s.as_mut().expect("session").offered_proto = u64::from_ne_bytes(v);
            }
        }
        // A queue is started by SET_VRING_KICK and stopped by GET_VRING_BASE; a new base
        // while started leaves requests in flight from before, which complete into the
        // new epoch (a frontend's error: the model stops checking that queue).
        if m.lie.is_none() && m.payload.len() >= 4 {
            let q = usize::from(m.payload[0]);
            let rest_zero = m.payload[1..4] == [0, 0, 0];
            if let Some(qm) = self.q.get_mut(q).filter(|_| rest_zero) {
                match (code, &out) {
                    (req::SET_VRING_KICK, o) if o.accepted() => qm.started = true,
                    (req::GET_VRING_BASE, Outcome::Reply(..)) => qm.started = false,
                    _ => {}
                }
            }
        }
        if code == req::SET_PROTOCOL_FEATURES
            && out.accepted()
            && m.payload.len() == 8
            && m.lie.is_none()
        {
            let v = u64::from_ne_bytes(m.payload.try_into().expect("8 bytes"));
            self.s.as_mut().expect("session").proto_acked = v;
        }
        Some(out)
    }

    /// Starts a new epoch of queue q at `base` (the backend took SET_VRING_BASE).
    fn epoch(&mut self, q: usize, base: u16) {
        let r = ring(q, 256);
        let avail = r.avail_idx(&self.w.ram);
        let m = &mut self.q[q];
        if m.started {
            m.tainted = true;
        }
        m.base = base;
        m.used_at_base = r.used_idx(&self.w.ram);
        let d = dist(avail, base);
        m.offered = if d <= 0x8000 { d } else { 0 };
    }

    /// The guest published avail index `idx` on queue q.
    fn published(&mut self, q: usize, idx: u16) {
        let m = &mut self.q[q];
        let d = dist(idx, m.base);
        if d <= 0x8000 {
            m.offered = m.offered.max(d);
        }
    }

    fn taint_all(&mut self) {
        for m in &mut self.q {
            m.tainted = true;
        }
    }

    /// The used-index invariant on every queue the model alone laid out.
    fn check_used(&self, after: &str) {
        for (q, m) in self.q.iter().enumerate() {
            if m.tainted {
                continue;
            }
            let used = ring(q, 256).used_idx(&self.w.ram);
            if used != m.used_at_base && dist(used, m.base) > m.offered {
                panic!(
                    "queue {q}: used.idx {used} is {} past the base {} but only {} were made available (after {after})",
                    dist(used, m.base),
                    m.base,
                    m.offered
                );
            }
        }
    }

    // --- sessions -----------------------------------------------------------------------

    fn start_session(&mut self) {
        let w = self.w;
        arm("session start", TEARDOWN_TIMEOUT);
        let backend = Arc::new(BlkBackend::new(
            Arc::from("fuzz"),
            w.limits.clone(),
            NQ,
            &w.target,
            w.stats.clone(),
            Duration::from_secs(1),
        ));
        let tb = Instant::now();
        let mut daemon =
            VhostUserDaemon::new("fuzz-vhost".into(), backend.clone(), backend.memory())
                .expect("vhost-user daemon");
        backend.attach_handlers(&daemon.get_epoll_handlers());
        let fe = RawFrontend::connect(&w.sock).expect("connect");
        fe.set_timeout(REPLY_TIMEOUT).expect("timeout");
        daemon
            .start(&mut w.listener.borrow_mut())
            .expect("daemon accepts");
        disarm();
        show!("  daemon start {:?}", tb.elapsed());
        self.s = Some(Session {
            backend,
            daemon,
            fe: Some(fe),
            features_seen: false,
            proto_acked: 0,
            offered_features: 0,
            offered_proto: 0,
        });
        self.sessions += 1;
        // A new backend's queues start at 0 until told otherwise.
        for q in 0..usize::from(NQ) {
            self.q[q].started = false;
            self.epoch(q, 0);
        }
    }

    fn end_session(&mut self) {
        let Some(mut s) = self.s.take() else { return };
        if s.fe.is_some() {
            let t = Instant::now();
            check_spin();
            show!("  spin check {:?}", t.elapsed());
        }
        arm("teardown", TEARDOWN_TIMEOUT);
        drop(s.fe.take());
        let r = s.daemon.wait();
        show!("  session ended: {r:?}");
        drop(s.daemon);
        s.backend.close_exit_fds();
        let refs = Arc::strong_count(&s.backend);
        assert_eq!(
            refs, 1,
            "{refs} references to the backend are left after its teardown"
        );
        drop(s.backend);
        disarm();
    }

    // --- actions ------------------------------------------------------------------------

    fn negotiate(&mut self, p: u8, v: u8) {
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

    fn mem_table(&mut self, regions: &[Region], fds: &[RawFd]) -> Option<Outcome> {
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

    fn good_mem_table(&mut self, layout: u8) {
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
    fn ua(gpa: u64) -> u64 {
        // Layout 1 moves the upper half; the rings are in the lower one.
        UA_RAM + gpa
    }

    fn raw_mem_table(&mut self, inp: &mut Input<'_>) {
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

    fn vring_fd_payload(index: u64, v: u32) -> u64 {
        let mut p = index & 0xff;
        if v & 1 != 0 {
            p |= 0x100;
        }
        if v & 2 != 0 {
            p |= 0x200;
        }
        p
    }

    fn setup_queue(&mut self, q: u8, sz: u8, base: u16, fl: u8) {
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

    fn vring_addr(&mut self, i: u32, desc: u64, used: u64, avail: u64, log: u64, flags: u32) {
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

    fn vring_msg(&mut self, inp: &mut Input<'_>) {
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

    fn get_vring_base(&mut self, i: u32) {
        let out = self.send(Msg {
            flags: VERSION,
            ..msg(req::GET_VRING_BASE, &state(i, 0), &[])
        });
        if let Some(Outcome::Reply(r, _)) = out {
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

    fn simple(&mut self, inp: &mut Input<'_>) {
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

    fn config(&mut self, inp: &mut Input<'_>) {
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

    fn inflight_msg(&mut self, inp: &mut Input<'_>) {
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

    fn raw(&mut self, inp: &mut Input<'_>) {
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

    fn offer(&mut self, inp: &mut Input<'_>) {
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

    fn desc(&mut self, inp: &mut Input<'_>) {
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

    fn avail_entry(&mut self, inp: &mut Input<'_>) {
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

    fn avail_idx(&mut self, inp: &mut Input<'_>) {
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

    fn wait(&self, ms: u8) {
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

    fn guest_write(&mut self, inp: &mut Input<'_>) {
        let off = inp.u32();
        let len = usize::from(inp.u8());
        let bytes = inp.take(len);
        let span = RAM_LEN as u64 - RING_ZONE;
        let at = RING_ZONE + u64::from(off) % span;
        let n = bytes.len().min((RAM_LEN as u64 - at) as usize);
        self.w.ram.write(at, &bytes[..n]);
    }

    fn inflight_write(&mut self, inp: &mut Input<'_>) {
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

    fn rebuild(&mut self, q: u8, base: u16) {
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

    fn step(&mut self, inp: &mut Input<'_>) {
        let op = inp.u8() % 19;
        match op {
            0 => {
                let (p, v) = (inp.u8(), inp.u8());
                self.negotiate(p, v);
            }
            1 => {
                let l = inp.u8();
                self.good_mem_table(l);
            }
            2 => self.raw_mem_table(inp),
            3 => {
                let (q, sz, base, fl) = (inp.u8(), inp.u8(), inp.u16(), inp.u8());
                self.setup_queue(q, sz, base, fl);
            }
            4 => self.vring_msg(inp),
            5 => self.simple(inp),
            6 => self.config(inp),
            7 => self.inflight_msg(inp),
            8 => self.raw(inp),
            9 => self.offer(inp),
            10 => self.desc(inp),
            11 => self.avail_entry(inp),
            12 => self.avail_idx(inp),
            13 => {
                let q = usize::from(inp.u8()) % usize::from(NQ);
                show!("  kick q{q}");
                kick(&self.w.events[q][0]);
            }
            14 => {
                let ms = inp.u8();
                self.wait(ms);
            }
            15 => self.guest_write(inp),
            16 => self.inflight_write(inp),
            17 => {
                show!("  reconnect");
                self.end_session();
                self.start_session();
            }
            _ => {
                let (q, base) = (inp.u8(), inp.u16());
                self.rebuild(q, base);
            }
        }
        self.check_used(&format!("op {op}"));
    }
}

fn inflight_payload(size: u64, off: u64, nq: u16, qs: u16) -> Vec<u8> {
    let mut p = Vec::with_capacity(24);
    p.extend_from_slice(&size.to_ne_bytes());
    p.extend_from_slice(&off.to_ne_bytes());
    p.extend_from_slice(&nq.to_ne_bytes());
    p.extend_from_slice(&qs.to_ne_bytes());
    p.extend_from_slice(&[0; 4]);
    p
}

fn kick(fd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: an 8-byte write to our own eventfd.
    unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), 8) };
}

fn drain(fd: &OwnedFd) {
    let mut b = [0u8; 8];
    // SAFETY: an 8-byte read from our own non-blocking eventfd.
    unsafe { libc::read(fd.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
}

// ---------------------------------------------------------------------------------------
// Process checks: spinning threads, leaked fds and threads.

fn gettid() -> i64 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) }
}

/// Every thread of the process but this one: (tid, nanoseconds on a CPU so far).
fn thread_times() -> Vec<(i64, u64)> {
    let me = gettid();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let tid: i64 = e.ok()?.file_name().to_str()?.parse().ok()?;
        if tid == me {
            return None;
        }
        let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
        Some((tid, s.split_whitespace().next()?.parse().ok()?))
    })
    .collect()
}

fn busy(window: Duration) -> Vec<i64> {
    let a = thread_times();
    std::thread::sleep(window);
    let b = thread_times();
    let limit = window.as_nanos() as u64 / 2;
    b.iter()
        .filter(|(t, ns)| {
            a.iter()
                .any(|(u, m)| u == t && ns.saturating_sub(*m) > limit)
        })
        .map(|(t, _)| *t)
        .collect()
}

/// No thread stays busy while the frontend and guest do nothing: a quick look, and if a
/// thread was busy, three longer ones.
fn check_spin() {
    let mut suspects = busy(Duration::from_millis(1));
    for _ in 0..3 {
        if suspects.is_empty() {
            return;
        }
        let now = busy(Duration::from_millis(40));
        suspects.retain(|t| now.contains(t));
    }
    if let Some(t) = suspects.first() {
        let name = std::fs::read_to_string(format!("/proc/self/task/{t}/comm")).unwrap_or_default();
        panic!(
            "thread {t} ({}) is busy while nothing happens: it spins",
            name.trim()
        );
    }
}

/// The process's fds and threads. Pipes other than `junk_pipe` (what the frontend sends)
/// are left out: libFuzzer talks to `llvm-symbolizer` over two it keeps.
fn counts(junk_pipe: &str) -> (usize, usize) {
    let fds = fd_list()
        .iter()
        .filter(|l| !l.contains("pipe:[") || l.ends_with(junk_pipe))
        .count();
    let threads = std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0);
    (fds, threads)
}

fn fd_list() -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(d) = std::fs::read_dir("/proc/self/fd") {
        for e in d.flatten() {
            let target = std::fs::read_link(e.path()).unwrap_or_default();
            out.push(format!(
                "{} -> {}",
                e.file_name().to_string_lossy(),
                target.display()
            ));
        }
    }
    out
}

fn thread_list() -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(d) = std::fs::read_dir("/proc/self/task") {
        for e in d.flatten() {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            out.push(format!(
                "{} {}",
                e.file_name().to_string_lossy(),
                comm.trim()
            ));
        }
    }
    out
}

/// After a teardown the process's fds and threads return to what they were between
/// earlier iterations (the lender's sessions end on their own, a little later).
fn check_leaks(w: &mut World) {
    let Some((fds, threads)) = w.baseline else {
        std::thread::sleep(Duration::from_millis(300));
        w.baseline = Some(counts(&w.junk_pipe_name));
        w.baseline_lists = (fd_list(), thread_list());
        return;
    };
    let end = Instant::now() + Duration::from_secs(2);
    loop {
        let (f, t) = counts(&w.junk_pipe_name);
        if f <= fds && t <= threads {
            return;
        }
        if Instant::now() > end {
            let (bf, bt) = &w.baseline_lists;
            let new_fds: Vec<String> = fd_list()
                .into_iter()
                .filter(|x| !bf.contains(x) && !x.ends_with("/fd"))
                .collect();
            let new_threads: Vec<String> = thread_list()
                .into_iter()
                .filter(|x| !bt.contains(x))
                .collect();
            panic!(
                "leak: {f} fds (baseline {fds}), {t} threads (baseline {threads}) 2 s after the teardown; not there before: {new_fds:?}, threads {new_threads:?}; gone: {:?}",
                bf.iter().filter(|x| !fd_list().contains(x)).collect::<Vec<_>>()
            );
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fuzz_target!(|data: &[u8]| {
    WORLD.with(|cell| {
        let mut slot = cell.borrow_mut();
        let w = slot.get_or_insert_with(World::new);
        w.ram.write(0, &vec![0u8; RAM_LEN]);
        w.ram2.write(RAM2_GPA, &vec![0u8; RAM2_LEN]);
        for ev in w.events.iter().flatten() {
            drain(ev);
        }
        let lines_before = LOG_LINES.load(Ordering::Relaxed);
        {
            let mut run = Run {
                w: &*w,
                s: None,
                q: vec![
                    QModel {
                        size: 256,
                        ..QModel::default()
                    };
                    usize::from(NQ)
                ],
                inflight: None,
                messages: 0,
                sessions: 0,
            };
            let t0 = Instant::now();
            run.start_session();
            let t1 = Instant::now();
            let mut inp = Input(data);
            while !inp.0.is_empty() {
                run.step(&mut inp);
            }
            if run.open() {
                // The session still answers.
                run.send(msg(req::GET_FEATURES, &[], &[]));
            }
            run.check_used("the sequence");
            let t2 = Instant::now();
            run.end_session();
            show!(
                "  times: start {:?}, actions {:?}, end {:?}",
                t1 - t0,
                t2 - t1,
                t2.elapsed()
            );
            let lines = LOG_LINES.load(Ordering::Relaxed) - lines_before;
            let budget = 64 + 4 * run.messages + 16 * run.sessions;
            assert!(
                lines <= budget,
                "{lines} log lines for {} messages in {} sessions (at most {budget})",
                run.messages,
                run.sessions
            );
        }
        let t = Instant::now();
        check_leaks(w);
        show!("  leak check {:?}", t.elapsed());
    });
});
