//! The PCI sysfs attributes SR-IOV is driven through (Linux
//! `Documentation/ABI/testing/sysfs-bus-pci`): `sriov_totalvfs`, `sriov_numvfs`,
//! `sriov_drivers_autoprobe` and `virtfnN` of a PF, `driver_override` and `driver` of a
//! VF, and the bus's `drivers_probe`. Rooted at `/sys/bus/pci`, or at a directory that
//! looks like it in tests.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::SriovError;

/// The PCI bus in sysfs.
#[derive(Debug, Clone)]
pub(crate) struct Sysfs {
    /// `/sys/bus/pci`.
    root: PathBuf,
    /// How long a VF may take to bind to vfio-pci, or a PF to come back from a reset.
    pub(crate) settle: Duration,
}

impl Default for Sysfs {
    fn default() -> Sysfs {
        Sysfs::at("/sys/bus/pci")
    }
}

impl Sysfs {
    /// The bus rooted at `root`.
    pub(crate) fn at(root: impl Into<PathBuf>) -> Sysfs {
        Sysfs {
            root: root.into(),
            settle: Duration::from_secs(10),
        }
    }

    /// The function's directory.
    pub(crate) fn device(&self, bdf: &str) -> PathBuf {
        self.root.join("devices").join(bdf)
    }

    fn io_err(path: &Path, source: io::Error) -> SriovError {
        SriovError::Sysfs {
            path: path.to_path_buf(),
            source,
        }
    }

    /// Reads attribute `attr` of `bdf`, trimmed.
    pub(crate) fn read(&self, bdf: &str, attr: &str) -> Result<String, SriovError> {
        let p = self.device(bdf).join(attr);
        std::fs::read_to_string(&p)
            .map(|s| s.trim().to_owned())
            .map_err(|e| Self::io_err(&p, e))
    }

    /// Reads a decimal attribute (`sriov_totalvfs`, `sriov_numvfs`).
    pub(crate) fn read_number(&self, bdf: &str, attr: &str) -> Result<u16, SriovError> {
        let v = self.read(bdf, attr)?;
        v.parse().map_err(|_| {
            Self::io_err(
                &self.device(bdf).join(attr),
                io::Error::new(io::ErrorKind::InvalidData, format!("not a number: {v:?}")),
            )
        })
    }

    /// Writes `value` to attribute `attr` of `bdf`.
    pub(crate) fn write(&self, bdf: &str, attr: &str, value: &str) -> Result<(), SriovError> {
        let p = self.device(bdf).join(attr);
        std::fs::write(&p, value).map_err(|e| Self::io_err(&p, e))
    }

    /// Whether the function has an SR-IOV capability (a `sriov_totalvfs`).
    pub(crate) fn has_sriov(&self, bdf: &str) -> bool {
        self.device(bdf).join("sriov_totalvfs").exists()
    }

    /// The driver `bdf` is bound to, `None` if unbound.
    pub(crate) fn driver(&self, bdf: &str) -> Option<String> {
        std::fs::read_link(self.device(bdf).join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    }

    /// The class code, `0x010802` for an NVMe controller.
    pub(crate) fn class(&self, bdf: &str) -> Result<u32, SriovError> {
        let v = self.read(bdf, "class")?;
        u32::from_str_radix(v.trim_start_matches("0x"), 16).map_err(|_| {
            Self::io_err(
                &self.device(bdf).join("class"),
                io::Error::new(io::ErrorKind::InvalidData, format!("not a class: {v:?}")),
            )
        })
    }

    /// The address of VF `index` (0 for the first) of `pf`, from its `virtfnN` link.
    pub(crate) fn vf(&self, pf: &str, index: u16) -> Result<String, SriovError> {
        let p = self.device(pf).join(format!("virtfn{index}"));
        let target = std::fs::read_link(&p).map_err(|e| Self::io_err(&p, e))?;
        target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| Self::io_err(&p, io::Error::from(io::ErrorKind::InvalidData)))
    }

    /// The kernel's NVMe character device of an NVMe PF bound to `nvme`
    /// (`/dev/nvmeN`, from the function's `nvme/` directory).
    pub(crate) fn nvme_char_dev(&self, bdf: &str) -> Result<PathBuf, SriovError> {
        let dir = self.device(bdf).join("nvme");
        let name = std::fs::read_dir(&dir)
            .map_err(|e| Self::io_err(&dir, e))?
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| n.starts_with("nvme"))
            .ok_or_else(|| Self::io_err(&dir, io::Error::from(io::ErrorKind::NotFound)))?;
        Ok(PathBuf::from("/dev").join(name))
    }

    /// Binds `vf` to vfio-pci (through `driver_override` and `drivers_probe`, unbinding
    /// it from another driver first), and waits for the binding.
    pub(crate) fn bind_vfio(&self, vf: &str) -> Result<(), SriovError> {
        match self.driver(vf).as_deref() {
            Some("vfio-pci") => return Ok(()),
            Some(_) => self.write(vf, "driver/unbind", vf)?,
            None => {}
        }
        self.write(vf, "driver_override", "vfio-pci")?;
        let probe = self.root.join("drivers_probe");
        std::fs::write(&probe, vf).map_err(|e| Self::io_err(&probe, e))?;
        let until = Instant::now() + self.settle;
        loop {
            let driver = self.driver(vf);
            if driver.as_deref() == Some("vfio-pci") {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(SriovError::NotBound {
                    vf: vf.to_owned(),
                    driver: driver.unwrap_or_else(|| "none".into()),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
