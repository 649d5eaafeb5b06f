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
#[path = "../../../tests/src/vhost_raw.rs"]
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

mod codes;
mod guest;
mod input;
mod log_count;
mod messages;
mod model;
mod process;
mod run;
mod watchdog;
mod world;

use codes::{ack_form, ack_of, fixed_size, has_reply_body, msg, name, state, takes_fds, Msg};
use guest::{drain, inflight_payload, kick};
use input::{vring_index, Input};
use log_count::{CountingSubscriber, LOGGER, LOG_LINES};
use model::{dist, ring, Inflight, Outcome, QModel, Run, Session};
use process::{check_leaks, check_spin};
use watchdog::{arm, disarm, start_watchdog};
use world::World;

thread_local! {
    static WORLD: RefCell<Option<World>> = const { RefCell::new(None) };
}

impl<'w> Run<'w> {
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
