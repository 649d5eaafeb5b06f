//! [`GuestBuilder`]: what a test asks of its guest (memory, vCPUs, QEMU arguments,
//! files, script), and the QEMU command line and boot files made from it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Result;

use super::image::GuestImage;
use super::initrd::{write_initrd, FileData, GuestFile};
use super::running::Guest;
use super::BASE_CMDLINE;

/// Describes a guest to boot. Every setter consumes and returns the builder.
///
/// Defaults: 512 MiB of RAM, 1 vCPU, 2 free `pcie-root-port`s (`rp1`,
/// `rp2`) for hot-plug, no test script (the guest powers off at once).
#[derive(Debug, Clone)]
pub struct GuestBuilder {
    pub(super) name: String,
    pub(super) memory_mib: u32,
    pub(super) vcpus: u32,
    pub(super) root_ports: u32,
    pub(super) extra_args: Vec<String>,
    pub(super) kernel_args: Vec<String>,
    pub(super) modules: Vec<String>,
    pub(super) script: Option<String>,
    pub(super) files: Vec<GuestFile>,
    pub(super) image: Option<GuestImage>,
    pub(super) next_vhost_user_blk: u32,
    pub(super) native_pcie_hotplug: bool,
    pub(super) allow_reset: bool,
    /// Boot through the firmware from the first vhost-user-blk disk, whose backing file
    /// this is ([`GuestBuilder::firmware_boot_from`]).
    pub(super) firmware_disk: Option<PathBuf>,
    /// Network namespace QEMU runs in (`ip netns exec`), if any.
    pub(super) netns: Option<String>,
}

impl Default for GuestBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl GuestBuilder {
    /// A builder with the defaults above.
    pub fn new() -> Self {
        GuestBuilder {
            name: "guest".to_string(),
            memory_mib: 512,
            vcpus: 1,
            root_ports: 2,
            extra_args: Vec::new(),
            kernel_args: Vec::new(),
            modules: Vec::new(),
            script: None,
            files: Vec::new(),
            image: None,
            next_vhost_user_blk: 0,
            native_pcie_hotplug: false,
            allow_reset: false,
            firmware_disk: None,
            netns: None,
        }
    }

    /// Runs QEMU inside network namespace `ns` (`ip netns exec NS qemu ...`), as on
    /// another host; unix sockets (QMP, vhost-user) are reachable from any namespace.
    /// Default: this process's namespace.
    pub fn netns(mut self, ns: impl Into<String>) -> Self {
        self.netns = Some(ns.into());
        self
    }

    /// The QEMU arguments added with [`Self::arg`], [`Self::args`] and the disk setters,
    /// in order (a migration's destination replaces some: `migration.rs`).
    pub(crate) fn extra_args_mut(&mut self) -> &mut Vec<String> {
        &mut self.extra_args
    }

    /// The guest's label ([`Self::name`]).
    pub(crate) fn label(&self) -> &str {
        &self.name
    }

    /// Boots through the firmware (SeaBIOS) from the first vhost-user-blk disk instead
    /// of QEMU's direct kernel boot: before QEMU starts, a syslinux boot volume holding
    /// the kernel and this guest's initramfs is written over the first
    /// [`crate::firmware::BOOT_VOLUME_BYTES`] of `disk_image` (that disk's backing file,
    /// e.g. the lender's image), and the disk gets `bootindex=0`. With
    /// [`Self::allow_reset`], a reboot inside the guest goes through the firmware and the
    /// disk again.
    pub fn firmware_boot_from(mut self, disk_image: impl Into<PathBuf>) -> Self {
        self.firmware_disk = Some(disk_image.into());
        self
    }

    /// The kernel command line.
    pub(super) fn cmdline(&self) -> String {
        let mut cmdline = BASE_CMDLINE.to_string();
        if !self.modules.is_empty() {
            let _ = write!(cmdline, " devlend.modules={}", self.modules.join(","));
        }
        for arg in &self.kernel_args {
            cmdline.push(' ');
            cmdline.push_str(arg);
        }
        cmdline
    }

    /// Let a guest reset (QMP `system_reset`, a reboot from inside) restart the guest
    /// instead of ending QEMU (`-no-reboot` is dropped). The test script then runs
    /// again at the next boot. Default: off.
    pub fn allow_reset(mut self, allow: bool) -> Self {
        self.allow_reset = allow;
        self
    }

    /// A short label for log lines and error messages (default `guest`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Guest RAM in MiB (default 512). It is a shared memfd, as vhost-user
    /// backends need to map it.
    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.memory_mib = mib;
        self
    }

    /// Number of vCPUs (default 1).
    pub fn vcpus(mut self, vcpus: u32) -> Self {
        self.vcpus = vcpus;
        self
    }

    /// Number of free `pcie-root-port`s for hot-plug (default 2), with ids
    /// `rp1`, `rp2`, ... (slot and chassis numbers 1, 2, ...). Extra
    /// arguments must not reuse those ids.
    pub fn root_ports(mut self, count: u32) -> Self {
        self.root_ports = count;
        self
    }

    /// Hand PCIe hot-plug of the root ports to the guest's native driver
    /// (`pciehp`) instead of QEMU's default for q35, ACPI hot-plug
    /// (`acpiphp`). Both see a device plugged in within ~0.2 s; on unplug
    /// `pciehp` waits out the 5 s attention-button delay (~6 s in all)
    /// where ACPI takes ~0.1 s. Default: off.
    pub fn native_pcie_hotplug(mut self, native: bool) -> Self {
        self.native_pcie_hotplug = native;
        self
    }

    /// Appends one argument to QEMU's command line.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// Appends arguments to QEMU's command line.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra_args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Appends an argument to the kernel command line (after
    /// [`BASE_CMDLINE`]).
    pub fn kernel_arg(mut self, arg: impl Into<String>) -> Self {
        self.kernel_args.push(arg.into());
        self
    }

    /// Kernel modules from the initramfs for `/init` to load (with their
    /// dependencies) before the script runs, e.g. `["rdma_rxe", "rdma_ucm"]`.
    pub fn modules<I, S>(mut self, modules: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.modules.extend(modules.into_iter().map(Into::into));
        self
    }

    /// The shell script to run as `/test.sh` (busybox `sh`).
    pub fn script(mut self, script: impl Into<String>) -> Self {
        self.script = Some(script.into());
        self
    }

    /// Adds a file with the given contents and permission bits at
    /// `guest_path` (absolute, e.g. `/usr/bin/tool`); parent directories are
    /// created.
    pub fn file(
        mut self,
        guest_path: impl AsRef<str>,
        contents: impl Into<Vec<u8>>,
        mode: u32,
    ) -> Self {
        self.files.push(GuestFile {
            path: guest_path.as_ref().to_string(),
            data: FileData::Bytes(contents.into()),
            mode: Some(mode),
        });
        self
    }

    /// Copies the host file `host_path` (read at boot, permission bits
    /// kept) to `guest_path` in the guest, e.g. a test binary and the
    /// shared libraries `ldd` lists for it.
    pub fn host_file(mut self, guest_path: impl AsRef<str>, host_path: impl Into<PathBuf>) -> Self {
        self.files.push(GuestFile {
            path: guest_path.as_ref().to_string(),
            data: FileData::Host(host_path.into()),
            mode: None,
        });
        self
    }

    /// Attaches a vhost-user-blk disk whose backend listens on the unix
    /// socket `socket` (it must be listening before [`GuestBuilder::boot`]).
    /// Disks appear in the guest as `/dev/vda`, `/dev/vdb`, ... in the
    /// order added. QEMU ids are `vub0`, `vub1`, ...
    pub fn vhost_user_blk(self, socket: impl AsRef<Path>) -> Self {
        self.vhost_user_blk_with(socket, None)
    }

    /// As [`GuestBuilder::vhost_user_blk`], with QEMU joining the socket again
    /// `reconnect_ms` milliseconds after the backend goes away (`reconnect-ms` on
    /// the chardev), as it should when the backend may restart.
    pub fn vhost_user_blk_with(
        mut self,
        socket: impl AsRef<Path>,
        reconnect_ms: Option<u32>,
    ) -> Self {
        let id = format!("vub{}", self.next_vhost_user_blk);
        self.next_vhost_user_blk += 1;
        let socket = socket.as_ref().display().to_string();
        let reconnect = reconnect_ms
            .map(|ms| format!(",reconnect-ms={ms}"))
            .unwrap_or_default();
        self.extra_args.extend([
            "-chardev".to_string(),
            format!("socket,id={id},path={socket}{reconnect}"),
            "-device".to_string(),
            format!("vhost-user-blk-pci,chardev={id},id={id}"),
        ]);
        self
    }

    /// Boots from `image` instead of [`GuestImage::ensure`]'s.
    pub fn image(mut self, image: GuestImage) -> Self {
        self.image = Some(image);
        self
    }

    /// Boots the guest: builds the per-test initramfs, starts QEMU and a
    /// thread reading its console. Returns once QEMU is started, not when
    /// the guest is up.
    ///
    /// # Errors
    /// When the guest image cannot be built, a host file cannot be read, or
    /// QEMU cannot be started.
    pub fn boot(self) -> Result<Guest> {
        let image = match self.image.clone() {
            Some(image) => image,
            None => GuestImage::ensure()?,
        };
        Guest::start(self, image)
    }

    /// The files of a direct kernel boot for a VMM the harness does not start itself
    /// (libvirt, say): the kernel, this guest's initramfs written into `dir`, and the
    /// kernel command line. The guest contract is the same; its console is wherever
    /// that VMM puts the first serial port.
    ///
    /// # Errors
    /// As [`GuestBuilder::boot`], or the initramfs cannot be written.
    pub fn boot_files(&self, dir: &Path) -> Result<BootFiles> {
        let image = match self.image.clone() {
            Some(image) => image,
            None => GuestImage::ensure()?,
        };
        let initrd = dir.join(format!("{}.initrd", self.name));
        write_initrd(&image.initrd, self.script.as_deref(), &self.files, &initrd)?;
        Ok(BootFiles {
            kernel: image.kernel,
            initrd,
            cmdline: self.cmdline(),
        })
    }

    pub(super) fn qemu_args(&self, image: &GuestImage, initrd: &Path, qmp: &Path) -> Vec<String> {
        let mem = self.memory_mib;
        let mut args: Vec<String> = [
            "-machine",
            "q35",
            "-accel",
            "tcg",
            "-nodefaults",
            "-no-user-config",
            "-nographic",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if !self.allow_reset {
            args.push("-no-reboot".into());
        }
        args.extend([
            "-m".into(),
            format!("{mem}M"),
            "-smp".into(),
            self.vcpus.to_string(),
            "-object".into(),
            format!("memory-backend-memfd,id=mem,size={mem}M,share=on"),
            "-numa".into(),
            "node,memdev=mem".into(),
            "-chardev".into(),
            "stdio,id=con0,signal=off".into(),
            "-serial".into(),
            "chardev:con0".into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", qmp.display()),
        ]);
        if self.native_pcie_hotplug {
            args.push("-global".into());
            args.push("ICH9-LPC.acpi-pci-hotplug-with-bridge-support=off".into());
        }
        for i in 1..=self.root_ports {
            args.push("-device".into());
            args.push(format!("pcie-root-port,id=rp{i},slot={i},chassis={i}"));
        }
        if self.firmware_disk.is_none() {
            args.extend([
                "-kernel".into(),
                image.kernel.display().to_string(),
                "-initrd".into(),
                initrd.display().to_string(),
                "-append".into(),
                self.cmdline(),
            ]);
        }
        for a in &self.extra_args {
            if self.firmware_disk.is_some() && a == "vhost-user-blk-pci,chardev=vub0,id=vub0" {
                args.push(format!("{a},bootindex=0"));
            } else {
                args.push(a.clone());
            }
        }
        args
    }
}

/// What [`GuestBuilder::boot_files`] gives another VMM to boot the guest.
#[derive(Debug, Clone)]
pub struct BootFiles {
    /// The kernel.
    pub kernel: PathBuf,
    /// The guest's initramfs (base image plus the test's files).
    pub initrd: PathBuf,
    /// The kernel command line.
    pub cmdline: String,
}
