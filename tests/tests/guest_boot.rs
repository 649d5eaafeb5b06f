//! Proves the guest harness end to end with one TCG guest (one guest per test
//! file: boots cost seconds): the guest reports its kernel release, then
//! writes random data through a vhost-user-blk disk served by the reference
//! backend (`qemu-storage-daemon`), and the host finds those bytes in the
//! image file.
//!
//! Run: `cargo test --release -p devlend-tests --test guest_boot -- --nocapture`
//! (add `DEVLEND_TEST_VERBOSE=1` to see the guest console live).

use std::fs::{self, File};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use devlend_tests::guest::{Guest, GuestImage};
use devlend_tests::storage_daemon::StorageDaemon;
use sha2::{Digest, Sha256};

/// Size of the exported disk image.
const DISK_BYTES: u64 = 16 << 20;
/// The guest writes one MiB of random data at an offset of one MiB.
const PATTERN_OFFSET: usize = 1 << 20;
const PATTERN_BYTES: usize = 1 << 20;
/// Generous: TCG on a busy two-core machine.
const GUEST_TIMEOUT: Duration = Duration::from_secs(240);

const SCRIPT: &str = r#"
set -e
echo "DEVLEND-RESULT kernel=$(uname -r)"
devlend-wait-for /dev/vda 30
echo "DEVLEND-RESULT disk_bytes=$(blockdev --getsize64 /dev/vda)"
dd if=/dev/urandom of=/tmp/pattern bs=1M count=1 2>/dev/null
dd if=/tmp/pattern of=/dev/vda bs=1M seek=1 conv=fsync 2>/dev/null
echo "DEVLEND-RESULT sha256=$(sha256sum /tmp/pattern | cut -d' ' -f1)"
echo 3 > /proc/sys/vm/drop_caches
echo "DEVLEND-RESULT readback_sha256=$(dd if=/dev/vda bs=1M skip=1 count=1 2>/dev/null | sha256sum | cut -d' ' -f1)"
"#;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn guest_boots_and_writes_through_vhost_user_blk() -> Result<()> {
    let start = Instant::now();
    let image = GuestImage::ensure()?;
    let image_ready = start.elapsed();

    let dir = tempfile::tempdir()?;
    let disk = dir.path().join("disk.img");
    File::create(&disk)?.set_len(DISK_BYTES)?;
    let socket = dir.path().join("blk.sock");
    let daemon = StorageDaemon::vhost_user_blk(&disk, &socket)?;

    let boot_start = Instant::now();
    let mut guest = Guest::builder()
        .name("guest_boot")
        .script(SCRIPT)
        .vhost_user_blk(daemon.socket())
        .boot()?;
    assert!(guest.qmp_socket().starts_with(guest.work_dir()));
    let outcome = guest.wait_done(GUEST_TIMEOUT)?;
    let guest_wall = boot_start.elapsed();
    outcome.check_success()?;

    // Check 1: the guest ran our script on the kernel we built.
    assert_eq!(
        outcome.result("kernel"),
        Some(image.kernel_version.as_str())
    );

    // Check 2: the vhost-user-blk disk works both ways.
    assert_eq!(
        outcome.result("disk_bytes"),
        Some(DISK_BYTES.to_string().as_str())
    );
    let written = outcome
        .result("sha256")
        .context("guest printed no sha256")?;
    ensure!(
        written.len() == 64,
        "bad sha256 from the guest: {written:?}"
    );
    assert_eq!(outcome.result("readback_sha256"), Some(written));
    let contents = fs::read(&disk)?;
    let on_host = hex(&Sha256::digest(
        &contents[PATTERN_OFFSET..PATTERN_OFFSET + PATTERN_BYTES],
    ));
    assert_eq!(
        on_host, written,
        "the image file does not hold the guest's bytes"
    );
    ensure!(
        contents[..PATTERN_OFFSET].iter().all(|&b| b == 0)
            && contents[PATTERN_OFFSET + PATTERN_BYTES..]
                .iter()
                .all(|&b| b == 0),
        "the guest wrote outside the pattern's range"
    );
    drop(daemon);

    eprintln!(
        "guest_boot timings: image ready {:.1} s, guest up (DEVLEND-READY) {:.1} s, \
         script done {:.1} s, QEMU start to exit {:.1} s, whole test {:.1} s",
        image_ready.as_secs_f64(),
        outcome.boot_time.unwrap_or_default().as_secs_f64(),
        outcome.elapsed.as_secs_f64(),
        guest_wall.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
