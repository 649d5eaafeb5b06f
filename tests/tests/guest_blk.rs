//! A real QEMU 10 guest (TCG) with a disk lent by devlend: the guest's own virtio-blk
//! driver reads what the lender's file holds and writes data that is then found in it.
//! One guest for the whole file (boots cost seconds under TCG).

use std::fs;
use std::time::Duration;

use anyhow::{Context, Result};
use devlend_tests::agents::{sparse_file, Borrower, Lender};
use devlend_tests::guest::Guest;
use devlend_tests::sha256_hex;

const MIB: usize = 1 << 20;
const DISK_BYTES: u64 = 64 << 20;
const SERIAL: &str = "DEVLEND-GUEST-01";

const SCRIPT: &str = r#"
set -e
devlend-wait-for /dev/vda 30
echo "DEVLEND-RESULT size=$(cat /sys/block/vda/size)"
echo "DEVLEND-RESULT serial=$(cat /sys/block/vda/serial)"
echo "DEVLEND-RESULT ro=$(cat /sys/block/vda/ro)"
echo "DEVLEND-RESULT discard_max=$(cat /sys/block/vda/queue/discard_max_bytes)"
echo "DEVLEND-RESULT lender_sha256=$(dd if=/dev/vda bs=1M count=1 2>/dev/null | sha256sum | cut -d' ' -f1)"
dd if=/dev/urandom of=/tmp/p bs=1M count=2 2>/dev/null
dd if=/tmp/p of=/dev/vda bs=1M seek=4 conv=fsync 2>/dev/null
echo "DEVLEND-RESULT written_sha256=$(sha256sum /tmp/p | cut -d' ' -f1)"
echo 3 > /proc/sys/vm/drop_caches
echo "DEVLEND-RESULT readback_sha256=$(dd if=/dev/vda bs=1M skip=4 count=2 2>/dev/null | sha256sum | cut -d' ' -f1)"
"#;

#[test]
fn a_guest_reads_and_writes_a_lent_disk() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK_BYTES)?;
    // The lender's file starts with known data for the guest to read.
    let head: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8).collect();
    let mut file = fs::read(&img)?;
    file[..MIB].copy_from_slice(&head);
    fs::write(&img, &file)?;

    let lender = Lender::start(
        dir.path(),
        &[format!("disk0={},serial={SERIAL}", img.display())],
    )?;
    let borrower = Borrower::start(dir.path())?;
    let sock = dir.path().join("disk0.sock");
    borrower.attach(&lender.addr, "disk0", &sock, 1)?;

    let mut guest = Guest::builder()
        .name("guest_blk")
        .script(SCRIPT)
        .vhost_user_blk(&sock)
        .boot()?;
    let out = guest.wait_done(Duration::from_secs(240))?;
    out.check_success()?;

    assert_eq!(
        out.result("size"),
        Some((DISK_BYTES / 512).to_string().as_str())
    );
    assert_eq!(out.result("serial"), Some(SERIAL));
    assert_eq!(out.result("ro"), Some("0"));
    assert_ne!(
        out.result("discard_max"),
        Some("0"),
        "discard not offered to the guest"
    );
    assert_eq!(
        out.result("lender_sha256"),
        Some(sha256_hex(&head).as_str()),
        "guest read other data"
    );
    let written = out.result("written_sha256").context("no written_sha256")?;
    assert_eq!(
        out.result("readback_sha256"),
        Some(written),
        "guest read back other data"
    );
    let file = fs::read(&img)?;
    assert_eq!(
        sha256_hex(&file[4 * MIB..6 * MIB]),
        written,
        "the guest's write is not in the lender's file"
    );

    let status = borrower.cli_json(&["status"])?;
    let c = &status[0]["counters"];
    assert!(
        c["writes"].as_u64().unwrap_or(0) > 0 && c["reads"].as_u64().unwrap_or(0) > 0,
        "{status}"
    );
    assert_eq!(c["errors"], 0, "{status}");
    Ok(())
}
