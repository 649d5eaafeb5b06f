//! A bootable volume for guests whose firmware boots from a disk: an unpartitioned
//! FAT32 volume holding syslinux, the guest kernel and the test's initramfs, written at
//! the start of a disk image. SeaBIOS reads the volume's boot sector and syslinux loads
//! the kernel: every byte of the boot goes through the disk's virtio-blk device, in the
//! firmware's driver first and the kernel's after, as a VM booting from a lent disk does.
//!
//! Needs Debian's `syslinux`, `mtools` and `dosfstools` (`qemu/install-deps.sh`).

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// Size of the boot volume at the start of the disk (48 MiB: FAT32's smallest useful
/// size holds the kernel and an initramfs of some tens of MiB).
pub const BOOT_VOLUME_BYTES: u64 = 48 << 20;

fn run(cmd: &mut Command) -> Result<()> {
    let what = format!("{cmd:?}");
    let out = cmd.output().with_context(|| {
        format!("running {what} (install syslinux, mtools, dosfstools: qemu/install-deps.sh)")
    })?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Writes a boot volume that starts `kernel` (a bzImage) with `initrd` and `cmdline`
/// over the first [`BOOT_VOLUME_BYTES`] of the disk image `disk` (the rest of the disk
/// is left as it is). `scratch` is a directory for the volume while it is built.
///
/// # Errors
/// A missing tool, a disk smaller than the volume, or I/O.
pub fn write_boot_volume(
    disk: &Path,
    scratch: &Path,
    kernel: &Path,
    initrd: &Path,
    cmdline: &str,
) -> Result<()> {
    let disk_len = std::fs::metadata(disk)
        .with_context(|| format!("the disk image {}", disk.display()))?
        .len();
    if disk_len < BOOT_VOLUME_BYTES {
        bail!(
            "the disk image {} ({disk_len} bytes) is smaller than the boot volume",
            disk.display()
        );
    }
    let vol = scratch.join("boot.vfat");
    let _ = std::fs::remove_file(&vol);
    run(Command::new("mkfs.vfat")
        .args(["-F", "32", "-n", "DEVLEND", "-C"])
        .arg(&vol)
        .arg((BOOT_VOLUME_BYTES / 1024).to_string()))?;
    let cfg = scratch.join("syslinux.cfg");
    std::fs::write(
        &cfg,
        format!("DEFAULT linux\nPROMPT 0\nTIMEOUT 0\nLABEL linux\n  KERNEL vmlinuz\n  INITRD initrd.gz\n  APPEND {cmdline}\n"),
    )?;
    run(Command::new("syslinux").arg("--install").arg(&vol))?;
    for (src, name) in [
        (kernel, "vmlinuz"),
        (initrd, "initrd.gz"),
        (cfg.as_path(), "syslinux.cfg"),
    ] {
        run(Command::new("mcopy")
            .arg("-i")
            .arg(&vol)
            .arg(src)
            .arg(format!("::{name}")))?;
    }
    let bytes = std::fs::read(&vol)?;
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new().write(true).open(disk)?;
    f.seek(SeekFrom::Start(0))?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    let _ = std::fs::remove_file(&vol);
    Ok(())
}
