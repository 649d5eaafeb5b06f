//! Throwaway QEMU guests for end-to-end tests.
//!
//! A test describes a guest with [`GuestBuilder`] (memory, vCPUs, extra QEMU
//! arguments, a shell script to run inside), boots it with
//! [`GuestBuilder::boot`], and waits for the outcome with [`Guest::wait_done`].
//! The guest is a Debian kernel with a busybox initramfs built (and cached)
//! by `qemu/build-guest.sh`; QEMU always runs with `-accel tcg`.
//!
//! # The guest contract
//!
//! - The test script runs as `/test.sh` under busybox `sh`, as root, after
//!   `/init` has mounted `/proc`, `/sys`, `/dev` and loaded the virtio
//!   modules. Its stdout and stderr go to the serial console, which the
//!   harness reads.
//! - It reports results by printing lines `DEVLEND-RESULT key=value`; they
//!   end up in [`GuestOutcome::results`] (the last value of a key wins).
//! - When it exits, `/init` prints `DEVLEND-DONE rc=<its exit status>` and
//!   powers the guest off; [`GuestOutcome::rc`] is that status.
//! - To wait for the host in the middle of a test (a hot-plugged disk, say),
//!   the script polls for the device with `devlend-wait-for /dev/vda 30`,
//!   which first prints `DEVLEND-WAIT path=/dev/vda`; the host waits for that
//!   line with [`Guest::wait_for_line`], acts (through QMP, at
//!   [`Guest::qmp_socket`]), and the script goes on once the device appears.
//!   No other host-to-guest channel exists.
//! - Extra kernel modules shipped in the initramfs (RDMA, VFIO, `dummy`) load
//!   with `devlend-modprobe NAME...` in the script, or at boot with
//!   [`GuestBuilder::modules`].
//!
//! Set `DEVLEND_TEST_VERBOSE=1` to echo the console of every guest to the
//! test's stderr as it arrives, each line prefixed with the guest's name.
//!
//! A running guest can be live-migrated: `migration.rs` starts the destination
//! QEMU of a migration from it (same machine, kernel, initramfs, memory and devices,
//! with `-incoming`), whose console is read like this one's.
//!
//! This file holds the guest contract's markers and the harness's settings; the image
//! is in `image.rs`, the builder in `builder.rs`, the running guest in `running.rs`,
//! its console readers in `console.rs` and the initramfs writer in `initrd.rs`.

use std::path::PathBuf;
use std::time::Duration;

mod builder;
mod console;
mod image;
mod initrd;
mod running;

pub use builder::{BootFiles, GuestBuilder};
pub use console::{TimedConsole, TimedLine};
pub use image::{guest_dir, GuestImage};
pub use running::{Guest, GuestOutcome};

/// Printed by the guest's `/init` when `/test.sh` has exited; the exit
/// status follows.
pub const DONE_MARKER: &str = "DEVLEND-DONE rc=";
/// Prefix of a result line printed by a test script: `DEVLEND-RESULT key=value`.
pub const RESULT_MARKER: &str = "DEVLEND-RESULT ";
/// Printed by the guest's `/init` just before it starts `/test.sh`.
pub const READY_MARKER: &str = "DEVLEND-READY";

/// Kernel command line every guest gets (before [`GuestBuilder::kernel_arg`]s).
/// `no_timer_check`: a TCG guest on a loaded host may see its IO-APIC timer tick too
/// late during boot; with interrupt remapping (intel-iommu) the kernel then panics
/// ("timer doesn't work through Interrupt-remapped IO-APIC") instead of falling back.
pub const BASE_CMDLINE: &str = "console=ttyS0 quiet panic=-1 no_timer_check";

/// How long [`Guest::wait_done`] gives QEMU to exit after `DEVLEND-DONE`
/// before killing it.
const EXIT_GRACE: Duration = Duration::from_secs(10);
/// Console lines quoted in error messages.
const ERROR_TAIL_LINES: usize = 40;

/// The QEMU binary: `$DEVLEND_QEMU`, else `qemu-system-x86_64` from `PATH`.
pub fn qemu_binary() -> PathBuf {
    std::env::var_os("DEVLEND_QEMU")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("qemu-system-x86_64"))
}

fn verbose() -> bool {
    std::env::var("DEVLEND_TEST_VERBOSE").is_ok_and(|v| !v.is_empty() && v != "0")
}
