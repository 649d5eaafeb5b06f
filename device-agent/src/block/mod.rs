//! A lent block device or regular file: opening it (its capacity, its logical block
//! size, whether it lives in memory), what the handshake answers for it, and what a
//! hello must ask to be served its block requests. Its sessions ([`session`]) set up
//! their device I/O ([`io`], shared by the TCP and RDMA engines) before
//! the hello reply, then run the kind's own engines: over TCP ([`tcp`]: framing,
//! budget, the engine's loop) or over RDMA (`rdma`), both framing requests and
//! encoding responses the same way ([`wire`]).

#[cfg(test)]
pub(crate) mod fake_io;
pub(crate) mod io;
#[cfg(feature = "rdma")]
pub(crate) mod rdma;
mod session;
mod tcp;
pub(crate) mod wire;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;

use devlend_fabric::handshake::{DEV_DISCARD, DEV_READ_ONLY, DEV_WRITE_ZEROES};
use devlend_fabric::{BlockGeometry, DeviceDescription, Hello, SECTOR_SIZE};

use crate::config::BlockSpec;
use crate::kind::LentKind;
use crate::kind_view::KindView;
use crate::session::open::{Opened, Opening, Refused, TcpSession};
use crate::{
    Error, MAX_DISCARD_SECTORS, MAX_SERIAL_LEN, MAX_TRANSFER_BYTES, MAX_WRITE_ZEROES_SECTORS,
};

/// `BLKGETSIZE64`: size of a block device in bytes (`u64`).
const BLKGETSIZE64: libc::Ioctl = libc::_IOR::<u64>(0x12, 114);

/// An open block device or regular file.
#[derive(Debug)]
pub(crate) struct BlockDevice {
    /// The backing path.
    pub(crate) path: PathBuf,
    /// The open backing file or block device (`O_RDONLY` when read-only).
    pub(crate) file: File,
    /// Writes, discards and write-zeroes are refused.
    pub(crate) read_only: bool,
    /// Lendable bytes: the backing size rounded down to a multiple of 512.
    pub(crate) capacity_bytes: u64,
    /// The logical block size in bytes (512 for a regular file).
    pub(crate) block_size: u32,
    /// The serial the handshake sends, NUL-padded.
    pub(crate) serial: [u8; MAX_SERIAL_LEN],
    /// The backing file lives in memory (tmpfs, ramfs): its I/O is a memory copy that
    /// never waits for a device.
    pub(crate) memory_backed: bool,
}

impl BlockDevice {
    /// Opens `spec.path` for the device `name` (read-write, or read-only for
    /// `read_only`) and reads its size (`fstat` for a regular file, `BLKGETSIZE64` and
    /// `BLKSSZGET` for a block device).
    ///
    /// # Errors
    /// [`Error::Open`], [`Error::Size`], [`Error::NotBlock`], [`Error::TooSmall`].
    pub(crate) fn open(name: &str, spec: &BlockSpec) -> Result<BlockDevice, Error> {
        let file = OpenOptions::new()
            .read(true)
            .write(!spec.read_only)
            .open(&spec.path)
            .map_err(|source| Error::Open {
                device: name.to_owned(),
                path: spec.path.clone(),
                source,
            })?;
        let size_err = |source| Error::Size {
            device: name.to_owned(),
            path: spec.path.clone(),
            source,
        };
        let meta = file.metadata().map_err(size_err)?;
        let kind = meta.file_type();
        let (size, block_size) = if kind.is_file() {
            (meta.len(), SECTOR_SIZE as u32)
        } else if kind.is_block_device() {
            (
                block_device_size(&file).map_err(size_err)?,
                logical_block_size(&file),
            )
        } else {
            return Err(Error::NotBlock {
                device: name.to_owned(),
                path: spec.path.clone(),
            });
        };
        let capacity_sectors = capacity_sectors(size);
        if capacity_sectors == 0 {
            return Err(Error::TooSmall {
                device: name.to_owned(),
                path: spec.path.clone(),
                bytes: size,
            });
        }
        let hidden = size % SECTOR_SIZE;
        if hidden != 0 {
            tracing::info!(
                device = %name,
                path = %spec.path.display(),
                size,
                hidden,
                "size is not a multiple of 512 bytes: the last {hidden} bytes are not lent"
            );
        }
        tracing::info!(
            device = %name,
            path = %spec.path.display(),
            capacity_sectors,
            block_size,
            read_only = spec.read_only,
            "device ready"
        );
        Ok(BlockDevice {
            path: spec.path.clone(),
            memory_backed: kind.is_file() && memory_backed(&file),
            file,
            read_only: spec.read_only,
            capacity_bytes: capacity_sectors * SECTOR_SIZE,
            block_size,
            serial: spec.serial_bytes(name),
        })
    }

    /// What the handshake answers for it: capacity in 512-byte sectors, logical block
    /// size, the request limits, the flags (discard, write-zeroes, read-only) and the
    /// serial.
    pub(crate) fn device_info(&self) -> BlockGeometry {
        let mut flags = DEV_DISCARD | DEV_WRITE_ZEROES;
        if self.read_only {
            flags |= DEV_READ_ONLY;
        }
        BlockGeometry {
            capacity_sectors: self.capacity_bytes / SECTOR_SIZE,
            block_size: self.block_size,
            max_transfer: MAX_TRANSFER_BYTES,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_write_zeroes_sectors: MAX_WRITE_ZEROES_SECTORS,
            flags,
            serial: self.serial,
        }
    }
}

impl LentKind for BlockDevice {
    fn device_info(&self) -> DeviceDescription {
        BlockDevice::device_info(self).into()
    }

    fn check_hello(&self, device: &str, hello: &Hello) -> Result<(), String> {
        if hello.features & devlend_fabric::pci::FEATURE_PCI != 0 {
            return Err(format!(
                "device {device:?} is a block device, not a PCIe function: attach it without --kind pci"
            ));
        }
        Ok(())
    }

    fn open_tcp<'a>(
        &'a self,
        at: &Opening<'a>,
    ) -> Result<Opened<Box<dyn TcpSession + 'a>>, Refused> {
        session::open_tcp(self, at)
    }

    #[cfg(feature = "rdma")]
    fn open_rdma<'a>(
        &'a self,
        at: &Opening<'a>,
        conn: &devlend_fabric::rdma::verbs::Connection,
    ) -> Result<Opened<Box<dyn crate::session::open::RdmaSession + 'a>>, Refused> {
        session::open_rdma(self, at, conn)
    }

    fn resource_class(&self) -> String {
        "BLOCK".into()
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn derived_traits(&self) -> Vec<&'static str> {
        if self.read_only {
            vec!["READ_ONLY"]
        } else {
            vec!["DISCARD", "WRITE_ZEROES"]
        }
    }

    fn counts_block_requests(&self) -> bool {
        true
    }

    fn fences_earlier_sessions(&self) -> bool {
        true
    }

    fn view(&self) -> KindView {
        KindView::Block {
            path: self.path.clone(),
            capacity_bytes: self.capacity_bytes,
            block_size: self.block_size,
            read_only: self.read_only,
        }
    }
}

/// Capacity in 512-byte sectors of a backing store of `size_bytes`: a partial last
/// sector is not lent.
pub(crate) fn capacity_sectors(size_bytes: u64) -> u64 {
    size_bytes / SECTOR_SIZE
}

/// Whether `file` is on a memory file system (tmpfs or ramfs).
fn memory_backed(file: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    // SAFETY: statfs is plain old data; all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open for the duration of the call and `st` is a live, writable
    // statfs.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return false;
    }
    matches!(st.f_type as i64, TMPFS_MAGIC | RAMFS_MAGIC)
}

/// Size of a block device in bytes.
fn block_device_size(file: &File) -> std::io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to a live,
    // writable u64; the fd is open for the duration of the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

/// Logical block size of a block device in bytes; 512 if the ioctl fails or answers a
/// value that is not a power of two in 512..=65536.
fn logical_block_size(file: &File) -> u32 {
    let mut bs: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which points to a live,
    // writable c_int; the fd is open for the duration of the call.
    let rc = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            libc::BLKSSZGET,
            &mut bs as *mut libc::c_int,
        )
    };
    match u32::try_from(bs) {
        Ok(bs) if rc == 0 && bs.is_power_of_two() && (512..=65536).contains(&bs) => bs,
        _ => SECTOR_SIZE as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_in_memory_are_recognised() {
        if let Ok(f) = tempfile::tempfile_in("/dev/shm") {
            assert!(memory_backed(&f));
        }
        if let Ok(f) = File::open("/proc/self/stat") {
            assert!(!memory_backed(&f));
        }
    }

    #[test]
    fn capacity_rounds_down_to_whole_sectors() {
        assert_eq!(capacity_sectors(0), 0);
        assert_eq!(capacity_sectors(511), 0);
        assert_eq!(capacity_sectors(512), 1);
        assert_eq!(capacity_sectors(1000), 1);
        assert_eq!(capacity_sectors(1024), 2);
    }
}
