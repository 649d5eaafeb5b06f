//! Throwaway QEMU guests for end-to-end tests.
//!
//! A test describes a guest with [`GuestBuilder`] (memory, vCPUs, extra QEMU
//! arguments, a shell script to run inside), boots it with
//! [`GuestBuilder::boot`], and waits for the outcome with [`Guest::wait_done`].
//! The guest is a Debian kernel with a busybox initramfs built (and cached)
//! by `qemu/build-guest.sh`; QEMU always runs with `-accel tcg`.
//!
//! # The guest contract
//!
//! - The test script runs as `/test.sh` under busybox `sh`, as root, after
//!   `/init` has mounted `/proc`, `/sys`, `/dev` and loaded the virtio
//!   modules. Its stdout and stderr go to the serial console, which the
//!   harness reads.
//! - It reports results by printing lines `DEVLEND-RESULT key=value`; they
//!   end up in [`GuestOutcome::results`] (the last value of a key wins).
//! - When it exits, `/init` prints `DEVLEND-DONE rc=<its exit status>` and
//!   powers the guest off; [`GuestOutcome::rc`] is that status.
//! - To wait for the host in the middle of a test (a hot-plugged disk, say),
//!   the script polls for the device with `devlend-wait-for /dev/vda 30`,
//!   which first prints `DEVLEND-WAIT path=/dev/vda`; the host waits for that
//!   line with [`Guest::wait_for_line`], acts (through QMP, at
//!   [`Guest::qmp_socket`]), and the script goes on once the device appears.
//!   No other host-to-guest channel exists.
//! - Extra kernel modules shipped in the initramfs (RDMA, VFIO, `dummy`) load
//!   with `devlend-modprobe NAME...` in the script, or at boot with
//!   [`GuestBuilder::modules`].
//!
//! Set `DEVLEND_TEST_VERBOSE=1` to echo the console of every guest to the
//! test's stderr as it arrives, each line prefixed with the guest's name.
//!
//! A running guest can be live-migrated: [`crate::migration`] starts the destination
//! QEMU of a migration from it (same machine, kernel, initramfs, memory and devices,
//! with `-incoming`), whose console is read like this one's.
//!
//! Why this file is over 600 lines: it holds a guest's whole life: the image
//! (`GuestImage`), the builder (`GuestBuilder`, about 320 lines, mostly option setters),
//! the running guest with its console readers, and the initramfs writer (`write_initrd`,
//! `CpioWriter`). The image and the initramfs writer could move to modules of their own,
//! and are left here for now; what only migrations need is in [`crate::migration`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// Printed by the guest's `/init` when `/test.sh` has exited; the exit
/// status follows.
pub const DONE_MARKER: &str = "DEVLEND-DONE rc=";
/// Prefix of a result line printed by a test script: `DEVLEND-RESULT key=value`.
pub const RESULT_MARKER: &str = "DEVLEND-RESULT ";
/// Printed by the guest's `/init` just before it starts `/test.sh`.
pub const READY_MARKER: &str = "DEVLEND-READY";

/// Kernel command line every guest gets (before [`GuestBuilder::kernel_arg`]s).
/// `no_timer_check`: a TCG guest on a loaded host may see its IO-APIC timer tick too
/// late during boot; with interrupt remapping (intel-iommu) the kernel then panics
/// ("timer doesn't work through Interrupt-remapped IO-APIC") instead of falling back.
pub const BASE_CMDLINE: &str = "console=ttyS0 quiet panic=-1 no_timer_check";

/// How long [`Guest::wait_done`] gives QEMU to exit after `DEVLEND-DONE`
/// before killing it.
const EXIT_GRACE: Duration = Duration::from_secs(10);
/// Console lines quoted in error messages.
const ERROR_TAIL_LINES: usize = 40;

/// `qemu/build-guest.sh`, embedded so that the `devlend` binary can build guests
/// anywhere.
const BUILD_GUEST_SH: &str = include_str!("../build-guest.sh");
/// `qemu/install-deps.sh`, which `build-guest.sh` runs first.
const INSTALL_DEPS_SH: &str = include_str!("../install-deps.sh");

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

/// The QEMU binary: `$DEVLEND_QEMU`, else `qemu-system-x86_64` from `PATH`.
pub fn qemu_binary() -> PathBuf {
    std::env::var_os("DEVLEND_QEMU")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("qemu-system-x86_64"))
}

fn verbose() -> bool {
    std::env::var("DEVLEND_TEST_VERBOSE").is_ok_and(|v| !v.is_empty() && v != "0")
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

#[derive(Debug, Clone)]
enum FileData {
    Bytes(Vec<u8>),
    Host(PathBuf),
}

#[derive(Debug, Clone)]
struct GuestFile {
    /// Path inside the guest, without the leading `/`.
    path: String,
    data: FileData,
    /// Permission bits; `None`: those of the host file (or 0644 for bytes).
    mode: Option<u32>,
}

/// Describes a guest to boot. Every setter consumes and returns the builder.
///
/// Defaults: 512 MiB of RAM, 1 vCPU, 2 free `pcie-root-port`s (`rp1`,
/// `rp2`) for hot-plug, no test script (the guest powers off at once).
#[derive(Debug, Clone)]
pub struct GuestBuilder {
    name: String,
    memory_mib: u32,
    vcpus: u32,
    root_ports: u32,
    extra_args: Vec<String>,
    kernel_args: Vec<String>,
    modules: Vec<String>,
    script: Option<String>,
    files: Vec<GuestFile>,
    image: Option<GuestImage>,
    next_vhost_user_blk: u32,
    native_pcie_hotplug: bool,
    allow_reset: bool,
    /// Boot through the firmware from the first vhost-user-blk disk, whose backing file
    /// this is ([`GuestBuilder::firmware_boot_from`]).
    firmware_disk: Option<PathBuf>,
    /// Network namespace QEMU runs in (`ip netns exec`), if any.
    netns: Option<String>,
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
    /// in order (a migration's destination replaces some: [`crate::migration`]).
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
    fn cmdline(&self) -> String {
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
        write_initrd(&image.initrd, self, &initrd)?;
        Ok(BootFiles {
            kernel: image.kernel,
            initrd,
            cmdline: self.cmdline(),
        })
    }

    fn qemu_args(&self, image: &GuestImage, initrd: &Path, qmp: &Path) -> Vec<String> {
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

/// A console line with the host's time of arrival ([`Guest::timed_console`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedLine {
    /// When the host read its end.
    pub at: Instant,
    /// The line, without its end.
    pub text: String,
}

/// A guest's console with times ([`Guest::timed_console`]).
#[derive(Debug, Clone, Default)]
pub struct TimedConsole {
    /// Complete lines, in order.
    pub lines: Vec<TimedLine>,
    /// Text after the last newline (empty if none).
    pub unterminated: String,
}

/// One line of console output.
#[derive(Debug, Clone)]
struct Line {
    /// Since QEMU was started.
    at: Duration,
    text: String,
}

#[derive(Debug, Default)]
struct ConsoleState {
    lines: Vec<Line>,
    /// Output after the last newline.
    partial: String,
    /// QEMU closed its stdout (it exited).
    eof: bool,
    /// The last of `lines` was not ended by a newline (QEMU exited after it).
    eof_unterminated: bool,
    qemu_stderr: Vec<String>,
}

#[derive(Debug, Default)]
struct Console {
    state: Mutex<ConsoleState>,
    changed: Condvar,
}

impl Console {
    fn lock(&self) -> MutexGuard<'_, ConsoleState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What a guest's test produced.
#[derive(Debug, Clone)]
pub struct GuestOutcome {
    /// Exit status of `/test.sh` (0 when the guest had none).
    pub rc: i32,
    /// `key=value` pairs from `DEVLEND-RESULT` lines; a repeated key keeps
    /// its last value.
    pub results: BTreeMap<String, String>,
    /// The whole serial console, one line per line.
    pub console: String,
    /// Anything QEMU itself wrote to stderr (warnings).
    pub qemu_stderr: String,
    /// From QEMU's start to `DEVLEND-READY` (the guest is up, the script is
    /// about to start), when seen.
    pub boot_time: Option<Duration>,
    /// From QEMU's start to `DEVLEND-DONE`.
    pub elapsed: Duration,
}

impl GuestOutcome {
    /// The value of result `key`, if the script printed it.
    pub fn result(&self, key: &str) -> Option<&str> {
        self.results.get(key).map(String::as_str)
    }

    /// Ok if the script exited 0.
    ///
    /// # Errors
    /// When `rc` is not 0; the error holds the tail of the console.
    pub fn check_success(&self) -> Result<&Self> {
        if self.rc != 0 {
            bail!(
                "guest test script failed with rc={}; console tail:\n{}",
                self.rc,
                tail(self.console.lines(), ERROR_TAIL_LINES)
            );
        }
        Ok(self)
    }
}

/// A running QEMU guest. QEMU is killed when this is dropped.
pub struct Guest {
    name: String,
    child: Child,
    started: Instant,
    console: Arc<Console>,
    readers: Vec<JoinHandle<()>>,
    /// Index of the first console line [`Guest::wait_for_line`] looks at.
    cursor: Mutex<usize>,
    qmp: PathBuf,
    root_ports: Vec<String>,
    exit_status: Option<ExitStatus>,
    /// What QEMU was started from, for a migration's destination.
    pub(crate) builder: GuestBuilder,
    pub(crate) image: GuestImage,
    /// This guest's initramfs (in `work_dir`).
    pub(crate) initrd: PathBuf,
    // Last: removed after QEMU is gone.
    work_dir: tempfile::TempDir,
}

impl std::fmt::Debug for Guest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guest")
            .field("name", &self.name)
            .field("pid", &self.child.id())
            .field("work_dir", &self.work_dir.path())
            .finish_non_exhaustive()
    }
}

impl Guest {
    /// A new [`GuestBuilder`].
    pub fn builder() -> GuestBuilder {
        GuestBuilder::new()
    }

    fn start(builder: GuestBuilder, image: GuestImage) -> Result<Guest> {
        let work_dir = tempfile::Builder::new()
            .prefix("devlend-guest-")
            .tempdir()
            .context("creating the guest's temporary directory")?;
        let initrd = work_dir.path().join("initrd");
        write_initrd(&image.initrd, &builder, &initrd)?;
        if let Some(disk) = &builder.firmware_disk {
            crate::firmware::write_boot_volume(
                disk,
                work_dir.path(),
                &image.dir.join("vmlinuz"),
                &initrd,
                &builder.cmdline(),
            )
            .context("writing the boot volume")?;
        }
        Guest::launch(builder, image, work_dir, initrd, &[])
    }

    /// Starts QEMU for `builder` with the initramfs `initrd` already written (in
    /// `work_dir`), `more` arguments last (e.g. `-incoming URI`), and the console readers.
    pub(crate) fn launch(
        builder: GuestBuilder,
        image: GuestImage,
        work_dir: tempfile::TempDir,
        initrd: PathBuf,
        more: &[String],
    ) -> Result<Guest> {
        let qmp = work_dir.path().join("qmp.sock");
        let mut args = builder.qemu_args(&image, &initrd, &qmp);
        args.extend(more.iter().cloned());
        let qemu = qemu_binary();
        if verbose() {
            let _ = writeln!(
                std::io::stderr(),
                "[{}] {}{} {}",
                builder.name,
                builder
                    .netns
                    .as_ref()
                    .map(|ns| format!("ip netns exec {ns} "))
                    .unwrap_or_default(),
                qemu.display(),
                args.iter()
                    .map(|a| shell_quote(a))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
        let mut command = match &builder.netns {
            // `ip netns exec` enters the namespace and execs QEMU: the child is QEMU.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns.as_str()]).arg(&qemu);
                c
            }
            None => Command::new(&qemu),
        };
        let started = Instant::now();
        let mut child = command
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (is QEMU installed? run qemu/install-deps.sh)",
                    qemu.display()
                )
            })?;
        let console = Arc::new(Console::default());
        let mut readers = Vec::new();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let spawn_result = (|| -> Result<()> {
            let stdout = stdout.ok_or_else(|| anyhow!("QEMU's stdout was not captured"))?;
            let stderr = stderr.ok_or_else(|| anyhow!("QEMU's stderr was not captured"))?;
            readers.push(spawn_console_reader(
                stdout,
                Arc::clone(&console),
                builder.name.clone(),
                started,
            )?);
            readers.push(spawn_stderr_reader(
                stderr,
                Arc::clone(&console),
                builder.name.clone(),
            )?);
            Ok(())
        })();
        if let Err(e) = spawn_result {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        Ok(Guest {
            name: builder.name.clone(),
            child,
            started,
            console,
            readers,
            cursor: Mutex::new(0),
            qmp,
            root_ports: (1..=builder.root_ports).map(|i| format!("rp{i}")).collect(),
            exit_status: None,
            builder,
            image,
            initrd,
            work_dir,
        })
    }

    /// The guest's label ([`GuestBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Console lines so far, each with the host's time of arrival, then any unfinished
    /// last line (after QEMU exited too: the text after the last newline, say a line cut
    /// by the end of a migration, which the destination's console then goes on with).
    pub fn timed_console(&self) -> TimedConsole {
        let state = self.console.lock();
        let mut lines: Vec<TimedLine> = state
            .lines
            .iter()
            .map(|l| TimedLine {
                at: self.started + l.at,
                text: l.text.clone(),
            })
            .collect();
        let mut unterminated = state.partial.clone();
        if state.eof_unterminated {
            if let Some(last) = lines.pop() {
                unterminated = last.text;
            }
        }
        TimedConsole {
            lines,
            unterminated,
        }
    }

    /// Waits up to `timeout` for QEMU to exit (after a QMP `quit`, say), and returns its
    /// exit status; `None` if it still runs.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let status = self.reap(timeout);
        if status.is_some() {
            self.join_readers();
        }
        status
    }

    /// The QMP socket QEMU listens on (`-qmp unix:PATH,server=on,wait=off`).
    pub fn qmp_socket(&self) -> &Path {
        &self.qmp
    }

    /// Ids of the free `pcie-root-port`s (`rp1`, ...), to use as `bus=` in a
    /// QMP `device_add`.
    pub fn root_ports(&self) -> &[String] {
        &self.root_ports
    }

    /// A temporary directory private to this guest, removed on drop.
    pub fn work_dir(&self) -> &Path {
        self.work_dir.path()
    }

    /// QEMU's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Time since QEMU was started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The console so far (complete lines, then any unfinished one).
    pub fn console(&self) -> String {
        let state = self.console.lock();
        let mut text = String::new();
        for line in &state.lines {
            text.push_str(&line.text);
            text.push('\n');
        }
        text.push_str(&state.partial);
        text
    }

    /// Waits up to `timeout` for a console line for which `matches` is true
    /// and returns it (without the line end).
    ///
    /// Lines are consumed in order: the search starts after the line the
    /// previous successful call returned (at the first line on the first
    /// call), so waiting twice for the same text needs it printed twice. A
    /// failed call consumes nothing.
    ///
    /// # Errors
    /// On timeout, or when QEMU exits first; the error quotes the tail of
    /// the console.
    pub fn wait_for_line(
        &self,
        matches: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> Result<String> {
        let mut cursor = self.cursor.lock().unwrap_or_else(|e| e.into_inner());
        let deadline = Instant::now() + timeout;
        let mut state = self.console.lock();
        let mut scanned = *cursor;
        loop {
            if let Some(offset) = state.lines[scanned..].iter().position(|l| matches(&l.text)) {
                let index = scanned + offset;
                *cursor = index + 1;
                return Ok(state.lines[index].text.clone());
            }
            scanned = state.lines.len();
            if state.eof {
                bail!(
                    "{}: QEMU exited before the awaited console line appeared\n{}",
                    self.name,
                    describe(&state)
                );
            }
            let now = Instant::now();
            if now >= deadline {
                bail!(
                    "{}: timed out after {:.1} s waiting for a console line\n{}",
                    self.name,
                    timeout.as_secs_f64(),
                    describe(&state)
                );
            }
            state = self
                .console
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// [`Guest::wait_for_line`] for a line containing `needle`.
    ///
    /// # Errors
    /// As [`Guest::wait_for_line`].
    pub fn wait_for_text(&self, needle: &str, timeout: Duration) -> Result<String> {
        self.wait_for_line(|line| line.contains(needle), timeout)
            .with_context(|| format!("waiting for {needle:?}"))
    }

    /// Waits up to `timeout` for the test script to finish
    /// (`DEVLEND-DONE`), then up to 10 s for QEMU to exit (killing it
    /// after that), and returns the outcome. A non-zero `rc` is not an
    /// error here: see [`GuestOutcome::check_success`].
    ///
    /// # Errors
    /// On timeout, or when QEMU exits without `DEVLEND-DONE` (a kernel
    /// panic, a QEMU error); the error quotes the tail of the console and
    /// QEMU's stderr.
    pub fn wait_done(&mut self, timeout: Duration) -> Result<GuestOutcome> {
        let deadline = Instant::now() + timeout;
        let console = Arc::clone(&self.console);
        let (rc, done_at) = {
            let mut state = console.lock();
            loop {
                if let Some((rc, at)) = find_done(&state.lines) {
                    break (rc, at);
                }
                if state.eof {
                    drop(state);
                    let status = self.reap(Duration::from_secs(2));
                    let state = console.lock();
                    bail!(
                        "{}: QEMU exited ({}) before {DONE_MARKER}...\n{}",
                        self.name,
                        status.map_or_else(|| "status unknown".to_string(), |s| s.to_string()),
                        describe(&state)
                    );
                }
                let now = Instant::now();
                if now >= deadline {
                    bail!(
                        "{}: timed out after {:.1} s waiting for {DONE_MARKER}...\n{}",
                        self.name,
                        timeout.as_secs_f64(),
                        describe(&state)
                    );
                }
                state = console
                    .changed
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        };
        if self.reap(EXIT_GRACE).is_none() {
            self.kill();
        }
        self.join_readers();
        let state = console.lock();
        let mut results = BTreeMap::new();
        let mut console = String::new();
        let mut boot_time = None;
        for line in &state.lines {
            console.push_str(&line.text);
            console.push('\n');
            if boot_time.is_none() && line.text.contains(READY_MARKER) {
                boot_time = Some(line.at);
            }
            if let Some((key, value)) = parse_result(&line.text) {
                results.insert(key.to_string(), value.to_string());
            }
        }
        console.push_str(&state.partial);
        Ok(GuestOutcome {
            rc,
            results,
            console,
            qemu_stderr: state.qemu_stderr.join("\n"),
            boot_time,
            elapsed: done_at,
        })
    }

    /// Kills QEMU (SIGKILL) if it is still running and reaps it.
    pub fn kill(&mut self) {
        if self.exit_status.is_none() {
            let _ = self.child.kill();
            self.exit_status = self.child.wait().ok();
        }
    }

    /// Waits up to `grace` for QEMU to exit on its own.
    fn reap(&mut self, grace: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + grace;
        while self.exit_status.is_none() {
            match self.child.try_wait() {
                Ok(Some(status)) => self.exit_status = Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) | Err(_) => break,
            }
        }
        self.exit_status
    }

    fn join_readers(&mut self) {
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
        self.join_readers();
    }
}

/// `(rc, when)` of the first `DEVLEND-DONE rc=N` line.
fn find_done(lines: &[Line]) -> Option<(i32, Duration)> {
    lines.iter().find_map(|line| {
        let rest = &line.text[line.text.find(DONE_MARKER)? + DONE_MARKER.len()..];
        let digits: String = rest
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '-')
            .collect();
        digits.parse().ok().map(|rc| (rc, line.at))
    })
}

/// `arg` quoted for a POSIX shell when it needs it (for log lines).
fn shell_quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=,:@+%".contains(c));
    if plain {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// `key=value` of a `DEVLEND-RESULT key=value` line (the marker may follow
/// other output on the same line).
fn parse_result(line: &str) -> Option<(&str, &str)> {
    let rest = &line[line.find(RESULT_MARKER)? + RESULT_MARKER.len()..];
    let (key, value) = rest.split_once('=')?;
    let key = key.trim();
    if key.is_empty() || key.contains(char::is_whitespace) {
        return None;
    }
    Some((key, value.trim_end()))
}

fn tail<'a>(lines: impl DoubleEndedIterator<Item = &'a str>, count: usize) -> String {
    let mut last: Vec<&str> = lines.rev().take(count).collect();
    last.reverse();
    last.join("\n")
}

fn describe(state: &ConsoleState) -> String {
    let mut text = format!("--- console (last {ERROR_TAIL_LINES} lines) ---\n");
    text.push_str(&tail(
        state.lines.iter().map(|l| l.text.as_str()),
        ERROR_TAIL_LINES,
    ));
    if !state.partial.is_empty() {
        text.push('\n');
        text.push_str(&state.partial);
    }
    if !state.qemu_stderr.is_empty() {
        text.push_str("\n--- QEMU stderr ---\n");
        text.push_str(&tail(
            state.qemu_stderr.iter().map(String::as_str),
            ERROR_TAIL_LINES,
        ));
    }
    text
}

/// Where the console reader is in a terminal escape sequence.
#[derive(Clone, Copy)]
enum Escape {
    None,
    /// After ESC.
    Start,
    /// After ESC [, until a final byte.
    Csi,
}

fn spawn_console_reader(
    mut stdout: ChildStdout,
    console: Arc<Console>,
    name: String,
    started: Instant,
) -> Result<JoinHandle<()>> {
    let echo = verbose();
    std::thread::Builder::new()
        .name(format!("{name}-console"))
        .spawn(move || {
            let mut buf = [0u8; 4096];
            let mut escape = Escape::None;
            loop {
                let n = match stdout.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let chunk = String::from_utf8_lossy(&buf[..n]);
                let mut state = console.lock();
                for c in chunk.chars() {
                    // Drop terminal escape sequences (the firmware clears
                    // the screen): ESC [ ... final byte, or ESC + one char.
                    match escape {
                        Escape::None if c == '\x1b' => {
                            escape = Escape::Start;
                            continue;
                        }
                        Escape::None => {}
                        Escape::Start => {
                            escape = if c == '[' { Escape::Csi } else { Escape::None };
                            continue;
                        }
                        Escape::Csi => {
                            if ('\x40'..='\x7e').contains(&c) {
                                escape = Escape::None;
                            }
                            continue;
                        }
                    }
                    match c {
                        '\n' => {
                            let text = std::mem::take(&mut state.partial);
                            if echo {
                                let _ = writeln!(std::io::stderr(), "[{name}] {text}");
                            }
                            state.lines.push(Line {
                                at: started.elapsed(),
                                text,
                            });
                        }
                        '\r' => {}
                        c => state.partial.push(c),
                    }
                }
                drop(state);
                console.changed.notify_all();
            }
            let mut state = console.lock();
            if !state.partial.is_empty() {
                let text = std::mem::take(&mut state.partial);
                state.lines.push(Line {
                    at: started.elapsed(),
                    text,
                });
                state.eof_unterminated = true;
            }
            state.eof = true;
            drop(state);
            console.changed.notify_all();
        })
        .context("spawning the console reader thread")
}

fn spawn_stderr_reader(
    stderr: ChildStderr,
    console: Arc<Console>,
    name: String,
) -> Result<JoinHandle<()>> {
    let echo = verbose();
    std::thread::Builder::new()
        .name(format!("{name}-stderr"))
        .spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if echo {
                    let _ = writeln!(std::io::stderr(), "[{name} qemu] {line}");
                }
                console.lock().qemu_stderr.push(line);
            }
        })
        .context("spawning the QEMU stderr reader thread")
}

/// Writes the per-test initramfs: the base archive, zero padding to a 4-byte
/// boundary, then an uncompressed newc archive with `/test.sh` and the extra
/// files. The kernel unpacks concatenated archives in order, later files
/// replacing earlier ones.
fn write_initrd(base: &Path, builder: &GuestBuilder, out: &Path) -> Result<()> {
    let mut data = fs::read(base).with_context(|| format!("reading {}", base.display()))?;
    data.resize(data.len().next_multiple_of(4), 0);
    let mut cpio = CpioWriter::new(data);
    if let Some(script) = &builder.script {
        cpio.file("test.sh", 0o755, script.as_bytes())?;
    }
    for file in &builder.files {
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
    fn parses_results_and_done() {
        assert_eq!(
            parse_result("DEVLEND-RESULT kernel=6.1.0-57-amd64\r"),
            Some(("kernel", "6.1.0-57-amd64"))
        );
        assert_eq!(
            parse_result("noise DEVLEND-RESULT a=b=c"),
            Some(("a", "b=c"))
        );
        assert_eq!(parse_result("DEVLEND-RESULT novalue"), None);
        let lines = vec![
            Line {
                at: Duration::from_secs(1),
                text: "x".into(),
            },
            Line {
                at: Duration::from_secs(2),
                text: "DEVLEND-DONE rc=3".into(),
            },
        ];
        assert_eq!(find_done(&lines), Some((3, Duration::from_secs(2))));
    }

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
