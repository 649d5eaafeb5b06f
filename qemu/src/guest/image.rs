//! The guest image: a built kernel and base initramfs, built on demand by the embedded
//! `build-guest.sh` and cached.

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::verbose;

/// `qemu/build-guest.sh`, embedded so that the `devlend` binary can build guests
/// anywhere.
const BUILD_GUEST_SH: &str = include_str!("../../build-guest.sh");
/// `qemu/install-deps.sh`, which `build-guest.sh` runs first.
const INSTALL_DEPS_SH: &str = include_str!("../../install-deps.sh");

/// Writes the embedded scripts into a fresh directory; returns it and the path of
/// `build-guest.sh` in it.
fn write_scripts() -> Result<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::Builder::new().prefix("devlend-qemu-").tempdir()?;
    for (name, text) in [
        ("build-guest.sh", BUILD_GUEST_SH),
        ("install-deps.sh", INSTALL_DEPS_SH),
    ] {
        let p = dir.path().join(name);
        fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
        fs::set_permissions(&p, fs::Permissions::from_mode(0o755))?;
    }
    let script = dir.path().join("build-guest.sh");
    Ok((dir, script))
}

/// A built guest kernel and base initramfs (see `qemu/build-guest.sh`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestImage {
    /// The cache directory the files live in
    /// (`$DEVLEND_GUEST_DIR`, default `/var/cache/devlend/guest`).
    pub dir: PathBuf,
    /// The kernel QEMU boots: the uncompressed PVH `vmlinux` when the build
    /// produced one (much faster under TCG), else the `vmlinuz` bzImage.
    pub kernel: PathBuf,
    /// The base initramfs (gzip'd cpio); per-test files are appended to a copy.
    pub initrd: PathBuf,
    /// The guest's kernel release, as `uname -r` prints it.
    pub kernel_version: String,
}

static ENSURED: Mutex<Option<GuestImage>> = Mutex::new(None);

impl GuestImage {
    /// Builds the guest image if needed and returns it.
    ///
    /// Runs `qemu/build-guest.sh` (embedded in this crate; it first runs
    /// `qemu/install-deps.sh`; both are fast no-ops when everything is in place) once
    /// per process and reuses the answer afterwards.
    ///
    /// # Errors
    /// When the script cannot be run or fails (its output is in the error),
    /// or the built files are missing.
    pub fn ensure() -> Result<GuestImage> {
        let mut cached = ENSURED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(image) = cached.as_ref() {
            return Ok(image.clone());
        }
        let (_scripts, script) = write_scripts()?;
        let started = Instant::now();
        let out = Command::new("bash")
            .arg(&script)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            bail!("{} failed ({}):\n{log}", script.display(), out.status);
        }
        if verbose() {
            let _ = writeln!(
                std::io::stderr(),
                "{log}[harness] guest image ready in {:.1} s",
                started.elapsed().as_secs_f64()
            );
        }
        let image = GuestImage::from_dir(&guest_dir())?;
        *cached = Some(image.clone());
        Ok(image)
    }

    /// The image already built in `dir`, without building anything.
    ///
    /// # Errors
    /// When `dir` lacks the kernel, the initramfs or the `KERNEL_VERSION` stamp.
    pub fn from_dir(dir: &Path) -> Result<GuestImage> {
        let version_file = dir.join("KERNEL_VERSION");
        let kernel_version = fs::read_to_string(&version_file)
            .with_context(|| format!("reading {}", version_file.display()))?
            .trim()
            .to_string();
        let vmlinux = dir.join("vmlinux");
        let kernel = if vmlinux.is_file() {
            vmlinux
        } else {
            dir.join("vmlinuz")
        };
        let initrd = dir.join("initrd.gz");
        for file in [&kernel, &initrd] {
            if !file.is_file() {
                bail!("{} is missing; run qemu/build-guest.sh", file.display());
            }
        }
        Ok(GuestImage {
            dir: dir.to_path_buf(),
            kernel,
            initrd,
            kernel_version,
        })
    }
}

/// The guest cache directory: `$DEVLEND_GUEST_DIR`, default
/// `/var/cache/devlend/guest` (the same rule as `qemu/build-guest.sh`).
pub fn guest_dir() -> PathBuf {
    std::env::var_os("DEVLEND_GUEST_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/devlend/guest"))
}
