//! QEMU 11 from the Debian 13 chroot (for `-device vfio-user-pci`), and the guest
//! kernel's NVMe modules, which the guest image's initramfs does not ship: what the
//! tests of lent PCIe functions with a real VMM share.
//!
//! The chroot is made once (about 500 MB; `docs/pci.md`, "How it is tested"):
//! `debootstrap --variant=minbase trixie /var/cache/devlend/qemu11-root`, then
//! `qemu-system-x86` from trixie-backports in it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The chroot: `$DEVLEND_QEMU11_ROOT`, default `/var/cache/devlend/qemu11-root`.
/// `None` (after saying so) when it has no QEMU, unless `DEVLEND_REQUIRE_QEMU11` is set:
/// then the test fails.
pub fn root() -> Option<PathBuf> {
    let root = std::env::var_os("DEVLEND_QEMU11_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/devlend/qemu11-root"));
    if root.join("usr/bin/qemu-system-x86_64").exists() {
        return Some(root);
    }
    let msg = format!(
        "no QEMU 11 chroot at {}: see tests/src/qemu11.rs",
        root.display()
    );
    assert!(
        std::env::var_os("DEVLEND_REQUIRE_QEMU11").is_none(),
        "{msg}"
    );
    eprintln!("skipped: {msg}");
    None
}

/// A `qemu-system-x86_64` in `dir` that runs QEMU 11 in `root`, in a mount namespace
/// of its own with `/tmp`, `/dev`, `/proc` and the guest image bound in.
pub fn wrapper(dir: &Path, root: &Path) -> PathBuf {
    let w = dir.join("qemu11");
    let script = format!(
        "#!/bin/sh\nexec unshare -m sh -c 'R={root}; for d in /tmp /dev /var/cache/devlend/guest; do \
         mkdir -p $R$d; mount --bind $d $R$d; done; mount -t proc proc $R/proc; \
         exec chroot $R qemu-system-x86_64 \"$@\"' sh \"$@\"\n",
        root = root.display()
    );
    std::fs::write(&w, script).expect("write the wrapper");
    std::fs::set_permissions(&w, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    w
}

/// The NVMe driver and what it needs, in load order (`modinfo -F depends`, plus the
/// crypto providers that crc-t10dif and crc64-rocksoft look up at run time).
pub const NVME_MODULES: &[&str] = &[
    "crypto/crct10dif_common",
    "crypto/crct10dif_generic",
    "lib/crc-t10dif",
    "lib/crc64",
    "crypto/crc64_rocksoft_generic",
    "lib/crc64-rocksoft",
    "block/t10-pi",
    "drivers/nvme/host/nvme-core",
    "drivers/nvme/host/nvme",
];

/// Loads [`NVME_MODULES`] from `/nvme` in a guest script.
pub const INSMOD_NVME: &str = "for m in crct10dif_common crct10dif_generic crc-t10dif crc64 \
    crc64_rocksoft_generic crc64-rocksoft t10-pi nvme-core nvme; do \
    insmod /nvme/$m.ko || echo \"insmod $m failed\"; done";

/// An igb PF's driver and what it needs, in load order.
pub const IGB_MODULES: &[&str] = &[
    "drivers/dca/dca",
    "drivers/i2c/algos/i2c-algo-bit",
    "drivers/net/ethernet/intel/igb/igb",
];

/// An igb VF's driver.
pub const IGBVF_MODULES: &[&str] = &["drivers/net/ethernet/intel/igbvf/igbvf"];

/// The start of a QEMU 11 guest's script on a lent NVMe: loads the driver (the modules
/// in `/nvme`), waits up to 5 min for `/dev/nvme0n1` (exits 1 without it), and reports
/// `dev` and the namespace's `sectors`.
pub fn nvme_guest_prelude() -> String {
    format!(
        r#"{INSMOD_NVME}
n=0
while [ ! -b /dev/nvme0n1 ] && [ $n -lt 600 ]; do sleep 0.5; n=$((n + 1)); done
if [ ! -b /dev/nvme0n1 ]; then echo "DEVLEND-RESULT dev=no"; dmesg | grep -i nvme; exit 1; fi
echo "DEVLEND-RESULT dev=yes"
echo "DEVLEND-RESULT sectors=$(cat /sys/block/nvme0n1/size)"
"#
    )
}

/// Extracts [`NVME_MODULES`] of the guest kernel's package into `dir`; returns each as
/// (its path in the guest, `/nvme/NAME.ko`; its path on the host), for
/// `GuestBuilder::host_file`.
pub fn nvme_modules(dir: &Path) -> Vec<(String, PathBuf)> {
    kernel_modules(dir, NVME_MODULES, "/nvme")
}

/// Extracts `modules` (paths under the kernel's `kernel/` without `.ko`) of the guest
/// kernel's package into `dir`; returns each as (its path in the guest,
/// `GUEST_DIR/NAME.ko`; its path on the host), for `GuestBuilder::host_file`.
pub fn kernel_modules(dir: &Path, modules: &[&str], guest_dir: &str) -> Vec<(String, PathBuf)> {
    let guest = devlend_qemu::guest::guest_dir();
    let kver = std::fs::read_to_string(guest.join("KERNEL_VERSION")).expect("KERNEL_VERSION");
    let kver = kver.trim();
    let deb = std::fs::read_dir(guest.join("deb"))
        .expect("the kernel package directory")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name().is_some_and(|n| {
                n.to_string_lossy()
                    .starts_with(&format!("linux-image-{kver}"))
            })
        })
        .expect("the kernel package");
    let members: Vec<String> = modules
        .iter()
        .map(|m| format!("./lib/modules/{kver}/kernel/{m}.ko"))
        .collect();
    let tar = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "dpkg-deb --fsys-tarfile '{}' | tar -x -C '{}' {}",
            deb.display(),
            dir.display(),
            members.join(" ")
        ))
        .status()
        .expect("dpkg-deb");
    assert!(tar.success(), "extracting the kernel modules {modules:?}");
    modules
        .iter()
        .zip(&members)
        .map(|(m, p)| {
            let name = m.rsplit('/').next().unwrap_or(m);
            (format!("{guest_dir}/{name}.ko"), dir.join(p))
        })
        .collect()
}

/// The md5 of `bytes` as `md5sum` prints it, to compare with what a guest's script
/// reports, through a file in `dir`.
pub fn md5_hex(dir: &Path, bytes: &[u8]) -> String {
    let p = dir.join("md5-slice");
    std::fs::write(&p, bytes).expect("write the slice");
    let o = Command::new("md5sum").arg(&p).output().expect("md5sum");
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string()
}
