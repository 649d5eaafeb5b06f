//! Opening a lent device: the backing file or block device, its capacity, and the
//! [`DeviceDescription`] described in the handshake.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;
use std::sync::Arc;

use devlend_fabric::qos::Qos;

use devlend_fabric::handshake::description::NIC_OFFLOADS;
use devlend_fabric::handshake::{DEV_DISCARD, DEV_READ_ONLY, DEV_WRITE_ZEROES};
use devlend_fabric::{BlockGeometry, DeviceDescription, NicLink, SECTOR_SIZE};

use crate::qos::{Group, Store};
use crate::stats::DeviceStats;
use crate::{DeviceSpec, Error, MAX_DISCARD_SECTORS, MAX_TRANSFER_BYTES, MAX_WRITE_ZEROES_SECTORS};

/// `BLKGETSIZE64`: size of a block device in bytes (`u64`).
const BLKGETSIZE64: libc::Ioctl = libc::_IOR::<u64>(0x12, 114);

/// An open, lendable device.
#[derive(Debug)]
pub(crate) struct Device {
    /// The name borrowers ask for.
    pub(crate) name: String,
    /// The backing path.
    pub(crate) path: PathBuf,
    /// The open backing file or block device (`O_RDONLY` when read-only).
    pub(crate) file: File,
    /// Writes, discards and write-zeroes are refused.
    pub(crate) read_only: bool,
    /// Lendable bytes: the backing size rounded down to a multiple of 512.
    pub(crate) capacity_bytes: u64,
    /// What the handshake describes (a NIC's link is read again at each handshake).
    pub(crate) info: DeviceDescription,
    /// The backing file lives in memory (tmpfs, ramfs): its I/O is a memory copy that
    /// never waits for a device.
    pub(crate) memory_backed: bool,
    /// The device's counters.
    pub(crate) stats: DeviceStats,
    /// For a network interface: the interface (frames, not block requests).
    pub(crate) nic: Option<crate::nic::Nic>,
    /// For a PCIe function: the function (regions, interrupts, DMA; not block requests).
    pub(crate) pci: Option<Arc<crate::pci::PciFunction>>,
    /// Who holds the device, and a handover in progress.
    pub(crate) holding: crate::holding::Holding,
    /// The spec it was opened from.
    spec: DeviceSpec,
}

impl Device {
    /// Whether a borrower holds the device (has a session open on it).
    pub(crate) fn is_held(&self) -> bool {
        self.holding.is_held()
    }

    /// The traits configured for the device (beyond the derived ones).
    pub(crate) fn traits(&self) -> &[String] {
        &self.spec.traits
    }

    /// Whether `spec` describes this device as it was opened.
    pub(crate) fn spec_matches(&self, spec: &DeviceSpec) -> bool {
        self.spec == *spec
    }

    /// Whether `borrower` holds the device now (a session of it is open).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn held_by(&self, borrower: [u8; 16]) -> bool {
        self.holding.held_by(borrower)
    }

    /// The limits configured for the device.
    pub(crate) fn qos(&self) -> &Qos {
        &self.spec.qos
    }

    /// The name of the backing store the device sits on, if configured.
    pub(crate) fn store_name(&self) -> Option<&str> {
        self.spec.store.as_deref()
    }

    /// The limits its holder's sessions share now, if it is held (or anonymous
    /// sessions are open).
    pub(crate) fn current_group(&self) -> Option<Arc<Group>> {
        self.holding.current_group()
    }

    /// Lets a session use the device ([`crate::holding::claim`]): one borrower at a
    /// time, and the handover of a live migration.
    pub(crate) fn claim(
        self: &Arc<Self>,
        ask: &crate::holding::Ask<'_>,
        store: Option<Arc<Store>>,
    ) -> Result<crate::holding::Claim, crate::holding::Refusal> {
        crate::holding::claim(self, self.spec.qos, ask, store)
    }

    /// Opens the spec's path (read-write, or read-only for `read_only`) and reads its size
    /// (`fstat` for a regular file, `BLKGETSIZE64` and `BLKSSZGET` for a block device).
    ///
    /// # Errors
    /// [`Error::Open`], [`Error::Size`], [`Error::NotBlock`], [`Error::TooSmall`], and
    /// those of [`DeviceSpec::validate`].
    pub(crate) fn open(spec: &DeviceSpec) -> Result<Device, Error> {
        spec.validate()?;
        if let Some(ifname) = &spec.net {
            return Self::open_net(spec, ifname);
        }
        if let Some(bdf) = &spec.pci {
            return Self::open_pci(spec, bdf);
        }
        let file = OpenOptions::new()
            .read(true)
            .write(!spec.read_only)
            .open(&spec.path)
            .map_err(|source| Error::Open {
                device: spec.name.clone(),
                path: spec.path.clone(),
                source,
            })?;
        let size_err = |source| Error::Size {
            device: spec.name.clone(),
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
                device: spec.name.clone(),
                path: spec.path.clone(),
            });
        };
        let capacity_sectors = capacity_sectors(size);
        if capacity_sectors == 0 {
            return Err(Error::TooSmall {
                device: spec.name.clone(),
                path: spec.path.clone(),
                bytes: size,
            });
        }
        let hidden = size % SECTOR_SIZE;
        if hidden != 0 {
            tracing::info!(
                device = %spec.name,
                path = %spec.path.display(),
                size,
                hidden,
                "size is not a multiple of 512 bytes: the last {hidden} bytes are not lent"
            );
        }
        let memory_backed = kind.is_file() && memory_backed(&file);
        let mut flags = DEV_DISCARD | DEV_WRITE_ZEROES;
        if spec.read_only {
            flags |= DEV_READ_ONLY;
        }
        let info = BlockGeometry {
            capacity_sectors,
            block_size,
            max_transfer: MAX_TRANSFER_BYTES,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_write_zeroes_sectors: MAX_WRITE_ZEROES_SECTORS,
            flags,
            serial: spec.serial_bytes(),
        };
        tracing::info!(
            device = %spec.name,
            path = %spec.path.display(),
            capacity_sectors,
            block_size,
            read_only = spec.read_only,
            "device ready"
        );
        Ok(Device {
            name: spec.name.clone(),
            path: spec.path.clone(),
            file,
            read_only: spec.read_only,
            capacity_bytes: capacity_sectors * SECTOR_SIZE,
            info: info.into(),
            memory_backed,
            stats: DeviceStats::default(),
            nic: None,
            pci: None,
            holding: Default::default(),
            spec: spec.clone(),
        })
    }

    /// A network interface to lend.
    fn open_net(spec: &DeviceSpec, ifname: &str) -> Result<Device, Error> {
        let mac = spec.mac.as_deref().and_then(crate::config::parse_mac);
        let nic = crate::nic::Nic::open(&spec.name, ifname, mac)?;
        let info = NicLink::new(&nic.link(), NIC_OFFLOADS).into();
        // A NIC has no backing file; the block engine never runs for it. /dev/null
        // stands in so that the block fields keep one type.
        let file = File::open("/dev/null").map_err(|source| Error::Open {
            device: spec.name.clone(),
            path: "/dev/null".into(),
            source,
        })?;
        Ok(Device {
            name: spec.name.clone(),
            path: format!("net:{ifname}").into(),
            file,
            read_only: false,
            capacity_bytes: 0,
            info,
            memory_backed: false,
            stats: DeviceStats::default(),
            nic: Some(nic),
            pci: None,
            holding: Default::default(),
            spec: spec.clone(),
        })
    }
}

impl Device {
    /// A PCIe function to lend.
    fn open_pci(spec: &DeviceSpec, bdf: &str) -> Result<Device, Error> {
        let f =
            crate::pci::PciFunction::open(bdf, spec.coherence).map_err(|source| Error::Pci {
                device: spec.name.clone(),
                bdf: bdf.to_owned(),
                source,
            })?;
        // As for a NIC, /dev/null stands in for the backing file.
        let file = File::open("/dev/null").map_err(|source| Error::Open {
            device: spec.name.clone(),
            path: "/dev/null".into(),
            source,
        })?;
        Ok(Device {
            name: spec.name.clone(),
            path: format!("pci:{bdf}").into(),
            file,
            read_only: false,
            capacity_bytes: 0,
            info: f.description().into(),
            memory_backed: false,
            stats: DeviceStats::default(),
            nic: None,
            pci: Some(Arc::new(f)),
            holding: Default::default(),
            spec: spec.clone(),
        })
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
fn block_device_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to a live,
    // writable u64; the fd is open for the duration of the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
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

    fn spec_for(path: &std::path::Path, ro: bool) -> DeviceSpec {
        DeviceSpec {
            name: "t".into(),
            path: path.to_owned(),
            net: None,
            pci: None,
            coherence: None,
            mac: None,
            read_only: ro,
            serial: None,
            traits: Vec::new(),
            qos: Default::default(),
            store: None,
        }
    }

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

    #[test]
    fn a_1000_byte_file_lends_one_sector() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1000).unwrap();
        let d = Device::open(&spec_for(f.path(), false)).unwrap();
        let g = d.info.as_block().unwrap();
        assert_eq!(g.capacity_sectors, 1);
        assert_eq!(d.capacity_bytes, 512);
        assert_eq!(g.block_size, 512);
        assert_eq!(g.flags, DEV_DISCARD | DEV_WRITE_ZEROES);
        assert_eq!(&g.serial[..2], b"t\0");
    }

    #[test]
    fn read_only_flag_and_errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("a.img");
        std::fs::write(&img, vec![0u8; 4096]).unwrap();
        let d = Device::open(&spec_for(&img, true)).unwrap();
        assert!(d.info.as_block().unwrap().read_only());

        let missing = dir.path().join("missing.img");
        let msg = Device::open(&spec_for(&missing, false))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("missing.img") && msg.contains("\"t\""),
            "{msg}"
        );

        let small = dir.path().join("small.img");
        std::fs::write(&small, [0u8; 100]).unwrap();
        assert!(matches!(
            Device::open(&spec_for(&small, false)),
            Err(Error::TooSmall { .. })
        ));

        assert!(matches!(
            Device::open(&spec_for(dir.path(), true)),
            Err(Error::NotBlock { .. })
        ));
    }
}
