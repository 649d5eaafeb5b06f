//! A hostile or buggy VMM on a real attachment: the test speaks vhost-user itself
//! (`devlend_tests::vhost_raw`) over the socket of a 2-queue attachment of a real
//! compute agent, with guest memory it maps and rings it lays out, and sends what no
//! good VMM sends. Each refusal must be an error reply that keeps the session (the next
//! valid request works), and must cost that device at most: the agent's CPU stays idle
//! afterwards, its log grows by a few KiB at most, and a second attachment of the same
//! agent keeps serving verified I/O (libblkio) throughout.
//!
//! The rig is in `rig.rs`; the tests, by what the frontend does wrong, in `messages.rs`,
//! `rings.rs`, `memory.rs` and `floods.rs`.

use std::os::fd::{AsRawFd, FromRawFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_tests::agents::{sparse_file, Borrower, Lender};
use devlend_tests::vhost_raw::{
    proto, req, vring_state, GuestRam, RawFrontend, Region, SplitRing, DESC_NEXT, DESC_WRITE,
    F_PROTOCOL_FEATURES, F_VERSION_1, VERSION,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const MIB: u64 = 1 << 20;
/// Size of the hostile frontend's queues.
const QUEUE_SIZE: u16 = 256;
/// The guest RAM the hostile frontend maps: rings at 0 (queue q at q × 64 KiB), request
/// buffers from 1 MiB (queue q at (1 + q) MiB).
const RAM_LEN: usize = 4 << 20;
/// How much the agent's log may grow over one test's hostile messages.
const LOG_BUDGET: usize = 4096;
/// The CPU share of one core the agent may use while idle after them.
const CPU_BUDGET: f64 = 0.05;
/// virtio-blk request type VIRTIO_BLK_T_IN and status VIRTIO_BLK_S_OK.
const T_IN: u32 = 0;
const S_OK: u8 = 0;

mod rig;
use rig::{alive, ram, rig, Queue};

mod floods;
mod memory;
mod messages;
mod rings;
