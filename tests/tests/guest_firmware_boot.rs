//! A QEMU guest (TCG) whose firmware boots from a lent disk, several times: no
//! `-kernel`; SeaBIOS reads the boot sector of an unpartitioned FAT32 volume at the start
//! of the lent disk, syslinux reads the kernel and the initramfs from it, all through
//! the borrower's vhost-user-blk device and the firmware's own virtio driver. The kernel
//! then takes the device over (its driver re-initializes the virtqueue after the
//! firmware's: the handover where a stale used index once corrupted other backends'
//! disks), writes a 4 MiB pattern with O_DIRECT and reads it back, counts the boot on
//! the disk and reboots: the next round goes through the firmware and the disk again.
//! Every round's pattern must read back in the guest and be in the lender's file.

use std::time::Duration;

use anyhow::Result;
use devlend_qemu::firmware::BOOT_VOLUME_BYTES;
use devlend_tests::agents::LentDisk;
use devlend_tests::guest::Guest;
use devlend_tests::sha256_hex;

const MIB: usize = 1 << 20;
const DISK_BYTES: u64 = 128 << 20;
/// Boots through the firmware.
const ROUNDS: u32 = 3;

/// Runs at every boot. The boot count lives on the lent disk itself, at MiB 60 (past the
/// boot volume); each round's pattern at MiB 64 + 4 × round.
const SCRIPT: &str = r#"
devlend-wait-for /dev/vda 30
n=$(dd if=/dev/vda bs=512 skip=122880 count=1 iflag=direct 2>/dev/null | head -c 8 | tr -dc 0-9)
[ -n "$n" ] || n=0
n=$((n + 0))
echo "DEVLEND-RESULT boot$n=yes"
dd if=/dev/urandom of=/tmp/p bs=1M count=4 2>/dev/null
dd if=/tmp/p of=/dev/vda bs=1M seek=$((64 + 4 * n)) oflag=direct 2>/tmp/err || echo "DEVLEND-RESULT write_failed$n=$(cat /tmp/err)"
echo 3 > /proc/sys/vm/drop_caches
a=$(sha256sum /tmp/p | cut -d' ' -f1)
b=$(dd if=/dev/vda bs=1M skip=$((64 + 4 * n)) count=4 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ "$a" = "$b" ]; then echo "DEVLEND-RESULT verify$n=ok"; else echo "DEVLEND-RESULT verify$n=differs"; fi
echo "DEVLEND-RESULT pattern$n=$a"
next=$((n + 1))
{ printf '%08d' $next; head -c 504 /dev/zero; } > /tmp/count
dd if=/tmp/count of=/dev/vda bs=512 seek=122880 oflag=direct 2>/dev/null
sync
if [ $next -lt ROUNDS ]; then
  echo "DEVLEND-RESULT rebooting$n=yes"
  reboot -f
  sleep 60
fi
echo "DEVLEND-RESULT rounds=$next"
"#;

#[test]
fn seabios_boots_from_a_lent_disk_and_the_kernel_takes_it_over_round_after_round() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let disk = LentDisk::start(dir.path(), DISK_BYTES, 1)?;
    let (img, sock, borrower) = (&disk.image, &disk.socket, &disk.borrower);
    let script = SCRIPT.replace("ROUNDS", &ROUNDS.to_string());
    // The boot volume goes into the lender's file: the guest can boot only by reading it
    // through the lent disk.
    let mut guest = Guest::builder()
        .name("guest_firmware_boot")
        .memory_mib(512)
        .script(script)
        .vhost_user_blk(sock)
        .firmware_boot_from(img)
        .allow_reset(true)
        .boot()?;
    let out = guest.wait_done(Duration::from_secs(600))?;
    let console = guest.console();
    out.check_success()?;
    assert_eq!(
        out.result("rounds"),
        Some(ROUNDS.to_string().as_str()),
        "{console}"
    );
    let file = std::fs::read(img)?;
    assert_eq!(
        &file[510..512],
        &[0x55, 0xaa],
        "the boot volume's boot sector"
    );
    for n in 0..ROUNDS as usize {
        assert_eq!(out.result(&format!("boot{n}")), Some("yes"), "{console}");
        assert_eq!(out.result(&format!("write_failed{n}")), None, "{console}");
        assert_eq!(
            out.result(&format!("verify{n}")),
            Some("ok"),
            "round {n}: the pattern reads back in the guest\n{console}"
        );
        let at = (64 + 4 * n) * MIB;
        assert_eq!(
            Some(sha256_hex(&file[at..at + 4 * MIB]).as_str()),
            out.result(&format!("pattern{n}")),
            "round {n}: the lender's file holds the pattern"
        );
    }
    assert!(BOOT_VOLUME_BYTES as usize <= 60 * MIB);
    let status = borrower.cli_json(&["status"])?;
    let c = &status[0]["counters"];
    assert_eq!(c["errors"], 0, "{status}");
    // Each boot read the kernel and the initramfs (some MiB) through the lent disk.
    let read = c["bytes_read"].as_u64().unwrap_or(0);
    assert!(
        read > u64::from(ROUNDS) * 8 * MIB as u64,
        "only {read} bytes read: the firmware did not boot from the lent disk?\n{status}"
    );
    Ok(())
}
