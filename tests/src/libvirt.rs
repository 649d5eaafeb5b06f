//! A real libvirt (Debian 12's libvirt 9.0, QEMU driver) for tests: [`ensure_daemons`]
//! configures it and starts `virtlogd` and `libvirtd` when they are not running, and a
//! [`Domain`] is a transient domain destroyed on drop.
//!
//! The setup is the one `docs/libvirt.md` describes for a host without systemd: QEMU runs
//! as root with no security driver, no mount namespace and no cgroups (`qemu.conf`), and
//! the `libvirt-qemu` user and group exist (libvirt 9.0 resolves its built-in default
//! user before it reads `qemu.conf`, and refuses to start without them). The packages come
//! from `qemu/install-deps.sh`; without them the helper fails, it never skips.

use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The connection URI every call uses.
pub const URI: &str = "qemu:///system";
const QEMU_CONF: &str = "/etc/libvirt/qemu.conf";
const LIBVIRTD_SOCK: &str = "/run/libvirt/libvirt-sock";
const VIRTLOGD_SOCK: &str = "/run/libvirt/virtlogd-sock";
const LIBVIRTD_PID: &str = "/run/libvirtd.pid";

/// The `qemu.conf` settings devlend's tests (and `docs/libvirt.md`) need.
pub const QEMU_CONF_SETTINGS: [(&str, &str); 5] = [
    ("user", "\"root\""),
    ("group", "\"root\""),
    ("security_driver", "\"none\""),
    ("namespaces", "[]"),
    ("cgroup_controllers", "[]"),
];

static SETUP: Mutex<bool> = Mutex::new(false);

/// Runs `virsh -c qemu:///system ARGS...`.
///
/// # Errors
/// `virsh` cannot run (libvirt-clients missing).
pub fn virsh(args: &[&str]) -> Result<Output> {
    Command::new("virsh")
        .arg("-c")
        .arg(URI)
        .args(args)
        .output()
        .context("cannot run virsh: libvirt is missing (run qemu/install-deps.sh as root)")
}

/// As [`virsh`], failing with its stderr unless it succeeds; returns its stdout.
///
/// # Errors
/// `virsh` fails.
pub fn virsh_ok(args: &[&str]) -> Result<String> {
    let out = virsh(args)?;
    if !out.status.success() {
        bail!(
            "virsh {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `text` (a `qemu.conf`) with each of `settings` set: uncommented lines that set one of
/// the keys to something else are dropped, missing settings appended. `None` when `text`
/// already has them all.
pub fn configured_qemu_conf(text: &str, settings: &[(&str, &str)]) -> Option<String> {
    let key_of = |line: &str| -> Option<String> {
        let t = line.trim_start();
        if t.starts_with('#') {
            return None;
        }
        t.split_once('=').map(|(k, _)| k.trim().to_owned())
    };
    let wanted = |line: &str| {
        settings.iter().any(|(k, v)| {
            key_of(line).as_deref() == Some(*k) && line.trim() == format!("{k} = {v}")
        })
    };
    let mut lines: Vec<String> = Vec::new();
    let mut changed = false;
    for line in text.lines() {
        let ours = key_of(line).is_some_and(|k| settings.iter().any(|(s, _)| *s == k));
        if ours && !wanted(line) {
            changed = true;
            continue;
        }
        lines.push(line.to_owned());
    }
    for (k, v) in settings {
        let want = format!("{k} = {v}");
        if !lines.iter().any(|l| l.trim() == want) {
            if !changed {
                lines.push("# Set by devlend's tests (docs/libvirt.md).".into());
            }
            lines.push(want);
            changed = true;
        }
    }
    changed.then(|| lines.join("\n") + "\n")
}

fn answers(sock: &str) -> bool {
    UnixStream::connect(sock)
        .map(|s| {
            let _ = s.shutdown(Shutdown::Both);
        })
        .is_ok()
}

fn run(program: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(program).args(args).output().with_context(|| {
        format!("cannot run {program}: libvirt is missing (run qemu/install-deps.sh as root)")
    })?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn ensure_account() -> Result<()> {
    let has = |db: &str| {
        Command::new("getent")
            .args([db, "libvirt-qemu"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !has("group") {
        run("groupadd", &["--system", "libvirt-qemu"])?;
    }
    if !has("passwd") {
        run(
            "useradd",
            &[
                "--system",
                "--no-create-home",
                "--home-dir",
                "/var/lib/libvirt",
                "--shell",
                "/usr/sbin/nologin",
                "--gid",
                "libvirt-qemu",
                "libvirt-qemu",
            ],
        )?;
    }
    Ok(())
}

fn wait_until(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !ok() {
        if Instant::now() > deadline {
            bail!("{what} after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Configures libvirt for these machines and starts its daemons if they are not running;
/// once per process. A `libvirtd` that was running before `qemu.conf` had to change is
/// restarted, so that it reads the new settings.
///
/// # Errors
/// libvirt is not installed, or a daemon does not come up.
pub fn ensure_daemons() -> Result<()> {
    let mut done = SETUP.lock().unwrap_or_else(|e| e.into_inner());
    if *done {
        return Ok(());
    }
    for bin in ["/usr/sbin/libvirtd", "/usr/sbin/virtlogd", "/usr/bin/virsh"] {
        if !Path::new(bin).exists() {
            bail!(
                "{bin} is missing: libvirt is not installed (run qemu/install-deps.sh as root; \
                 it installs libvirt-daemon, libvirt-daemon-driver-qemu and libvirt-clients)"
            );
        }
    }
    ensure_account()?;
    for d in [
        "/etc/libvirt",
        "/var/log/libvirt",
        "/var/lib/libvirt/qemu",
        "/run/libvirt",
    ] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {d}"))?;
    }
    let old = std::fs::read_to_string(QEMU_CONF).unwrap_or_default();
    let changed = configured_qemu_conf(&old, &QEMU_CONF_SETTINGS);
    if let Some(new) = &changed {
        let tmp = format!("{QEMU_CONF}.devlend-tmp");
        std::fs::write(&tmp, new).with_context(|| format!("writing {tmp}"))?;
        std::fs::rename(&tmp, QEMU_CONF).with_context(|| format!("writing {QEMU_CONF}"))?;
    }
    if !answers(VIRTLOGD_SOCK) {
        run("virtlogd", &["-d"])?;
        wait_until("virtlogd not listening", Duration::from_secs(20), || {
            answers(VIRTLOGD_SOCK)
        })?;
    }
    if changed.is_some() && answers(LIBVIRTD_SOCK) {
        restart_libvirtd()?;
    }
    if !answers(LIBVIRTD_SOCK) {
        run("libvirtd", &["-d"])?;
        wait_until(
            "libvirtd not listening (is the libvirt-qemu user there? see docs/libvirt.md)",
            Duration::from_secs(30),
            || answers(LIBVIRTD_SOCK),
        )?;
    }
    virsh_ok(&["version"]).context("libvirtd runs but its QEMU driver does not answer")?;
    *done = true;
    Ok(())
}

fn restart_libvirtd() -> Result<()> {
    let pid: libc::pid_t = std::fs::read_to_string(LIBVIRTD_PID)
        .context("libvirtd runs with an old qemu.conf and has no pid file: restart it by hand")?
        .trim()
        .parse()
        .context("libvirtd's pid file")?;
    // SAFETY: kill(2) with a pid read from libvirtd's own pid file and a valid signal.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    wait_until("libvirtd did not stop", Duration::from_secs(20), || {
        !answers(LIBVIRTD_SOCK)
    })
}

/// A transient libvirt domain (`virsh create`), destroyed on drop.
pub struct Domain {
    /// Its name.
    pub name: String,
    /// The file its first serial port writes to.
    pub console: PathBuf,
}

impl Domain {
    /// Writes `xml` to `dir/NAME.xml` and creates the domain from it.
    ///
    /// # Errors
    /// libvirt refuses the domain (its message is in the error).
    pub fn create(dir: &Path, name: &str, xml: &str, console: PathBuf) -> Result<Self> {
        ensure_daemons()?;
        // A leftover of an earlier, killed run of the same test.
        let _ = virsh(&["destroy", name]);
        let path = dir.join(format!("{name}.xml"));
        std::fs::write(&path, xml)?;
        let p = path.display().to_string();
        virsh_ok(&["create", &p]).with_context(|| format!("domain XML:\n{xml}"))?;
        Ok(Domain {
            name: name.to_owned(),
            console,
        })
    }

    /// What the guest wrote to its serial console so far.
    pub fn console_text(&self) -> String {
        std::fs::read(&self.console)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Waits until the console has a line containing `needle`.
    ///
    /// # Errors
    /// Not within `timeout` (the console is in the error), or the guest finished first.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let text = self.console_text();
            if text.lines().any(|l| l.contains(needle)) {
                return Ok(text);
            }
            if text.contains(crate::guest::DONE_MARKER) || Instant::now() > deadline {
                bail!("the guest did not print {needle:?}; console:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Attaches (`live`: `attach-device --live`) or detaches the device of `xml` (a file
    /// in the console's directory).
    ///
    /// # Errors
    /// virsh fails.
    pub fn device(&self, verb: &str, xml: &str) -> Result<String> {
        let dir = self.console.parent().unwrap_or(Path::new("/tmp"));
        let path = dir.join(format!("{}-{verb}.xml", self.name));
        std::fs::write(&path, xml)?;
        let p = path.display().to_string();
        virsh_ok(&[verb, &self.name, &p, "--live"])
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        let _ = virsh(&["destroy", &self.name]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_conf_is_set_once() {
        let first = configured_qemu_conf(
            "# user = \"x\"\nuser = \"libvirt-qemu\"\nvnc_listen = \"0.0.0.0\"\n",
            &QEMU_CONF_SETTINGS,
        )
        .unwrap();
        assert!(first.contains("# user = \"x\"\n"), "{first}");
        assert!(!first.contains("user = \"libvirt-qemu\""), "{first}");
        assert!(first.contains("vnc_listen"), "{first}");
        for (k, v) in QEMU_CONF_SETTINGS {
            assert!(first.contains(&format!("\n{k} = {v}\n")), "{first}");
        }
        assert_eq!(configured_qemu_conf(&first, &QEMU_CONF_SETTINGS), None);
    }
}
