//! The per-test initramfs: the base archive followed by a `newc` cpio archive of the
//! test's script and files.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Where an extra file's contents come from.
#[derive(Debug, Clone)]
pub(super) enum FileData {
    Bytes(Vec<u8>),
    Host(PathBuf),
}

/// A file the guest finds in its initramfs.
#[derive(Debug, Clone)]
pub(super) struct GuestFile {
    /// Path inside the guest, without the leading `/`.
    pub(super) path: String,
    pub(super) data: FileData,
    /// Permission bits; `None`: those of the host file (or 0644 for bytes).
    pub(super) mode: Option<u32>,
}

/// Writes the per-test initramfs: the base archive, zero padding to a 4-byte
/// boundary, then an uncompressed newc archive with `/test.sh` and the extra
/// files. The kernel unpacks concatenated archives in order, later files
/// replacing earlier ones.
pub(super) fn write_initrd(
    base: &Path,
    script: Option<&str>,
    files: &[GuestFile],
    out: &Path,
) -> Result<()> {
    let mut data = fs::read(base).with_context(|| format!("reading {}", base.display()))?;
    data.resize(data.len().next_multiple_of(4), 0);
    let mut cpio = CpioWriter::new(data);
    if let Some(script) = script {
        cpio.file("test.sh", 0o755, script.as_bytes())?;
    }
    for file in files {
        let path = guest_relative_path(&file.path)?;
        let (contents, host_mode) = match &file.data {
            FileData::Bytes(bytes) => (bytes.clone(), 0o644),
            FileData::Host(host) => {
                let contents = without_debug_info(host)?;
                let mode = fs::metadata(host)
                    .with_context(|| format!("reading {}", host.display()))?
                    .permissions()
                    .mode();
                (contents, mode & 0o7777)
            }
        };
        cpio.file(&path, file.mode.unwrap_or(host_mode), &contents)?;
    }
    let data = cpio.finish()?;
    fs::write(out, data).with_context(|| format!("writing {}", out.display()))
}

/// The contents of host file `host`; for an ELF file, without its debug sections
/// (`objcopy --strip-debug`, symbols kept): the release binaries carry hundreds of MB
/// of debug info, which the guest unpacks into its RAM and would run out of room for.
/// When objcopy is missing or fails, the file as it is.
fn without_debug_info(host: &Path) -> Result<Vec<u8>> {
    let contents = fs::read(host).with_context(|| format!("reading {}", host.display()))?;
    if !contents.starts_with(b"\x7fELF") {
        return Ok(contents);
    }
    let Ok(tmp) = tempfile::NamedTempFile::new() else {
        return Ok(contents);
    };
    let stripped = std::process::Command::new("objcopy")
        .arg("--strip-debug")
        .arg(host)
        .arg(tmp.path())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    match stripped.then(|| fs::read(tmp.path())) {
        Some(Ok(small)) if !small.is_empty() => Ok(small),
        _ => Ok(contents),
    }
}

/// `/usr/bin/x` -> `usr/bin/x`; rejects empty paths and `..`.
fn guest_relative_path(path: &str) -> Result<String> {
    let parts: Vec<&str> = path
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    if parts.is_empty() || parts.contains(&"..") {
        bail!("bad guest path {path:?}: want an absolute path without '..'");
    }
    Ok(parts.join("/"))
}

/// A minimal writer of the `newc` cpio format the kernel unpacks.
struct CpioWriter {
    out: Vec<u8>,
    ino: u32,
    dirs: std::collections::BTreeSet<String>,
}

impl CpioWriter {
    const S_IFREG: u32 = 0o100_000;
    const S_IFDIR: u32 = 0o040_000;

    fn new(out: Vec<u8>) -> Self {
        CpioWriter {
            out,
            ino: 0x00de_0000,
            dirs: Default::default(),
        }
    }

    fn file(&mut self, path: &str, mode: u32, contents: &[u8]) -> Result<()> {
        let mut parent = String::new();
        let components: Vec<&str> = path.split('/').collect();
        for dir in &components[..components.len() - 1] {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(dir);
            if self.dirs.insert(parent.clone()) {
                let dir_path = parent.clone();
                self.entry(&dir_path, Self::S_IFDIR | 0o755, &[])?;
            }
        }
        self.entry(path, Self::S_IFREG | (mode & 0o7777), contents)
    }

    fn entry(&mut self, name: &str, mode: u32, contents: &[u8]) -> Result<()> {
        let size = u32::try_from(contents.len())
            .with_context(|| format!("{name} is too large for cpio (over 4 GiB)"))?;
        let name_size = u32::try_from(name.len() + 1).context("cpio name too long")?;
        self.ino += 1;
        let nlink = if mode & Self::S_IFDIR != 0 { 2 } else { 1 };
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino, mode, 0, 0, nlink, 0, size, 0, 0, 0, 0, name_size, 0
        );
        self.out.extend_from_slice(header.as_bytes());
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(contents);
        self.pad();
        Ok(())
    }

    fn pad(&mut self) {
        let len = self.out.len().next_multiple_of(4);
        self.out.resize(len, 0);
    }

    fn finish(mut self) -> Result<Vec<u8>> {
        self.entry("TRAILER!!!", 0, &[])?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_paths() {
        assert_eq!(guest_relative_path("/usr/bin/x").unwrap(), "usr/bin/x");
        assert!(guest_relative_path("/a/../b").is_err());
        assert!(guest_relative_path("/").is_err());
    }

    #[test]
    fn cpio_layout() {
        let mut w = CpioWriter::new(vec![1, 2, 3, 0]);
        w.file("usr/bin/x", 0o755, b"hello").unwrap();
        let out = w.finish().unwrap();
        assert_eq!(&out[4..10], b"070701");
        assert_eq!(out.len() % 4, 0);
        let text = String::from_utf8_lossy(&out);
        assert!(
            text.contains("usr\0")
                && text.contains("usr/bin\0")
                && text.contains("usr/bin/x\0hello")
        );
        assert!(text.contains("TRAILER!!!\0"));
    }
}
