//! A running QEMU guest ([`Guest`]): its start, console waits, outcome and end.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::console::{
    describe, find_done, parse_result, spawn_console_reader, spawn_stderr_reader, tail, Console,
    TimedConsole, TimedLine,
};
use super::image::GuestImage;
use super::initrd::write_initrd;
use super::GuestBuilder;
use super::{qemu_binary, verbose, DONE_MARKER, ERROR_TAIL_LINES, EXIT_GRACE, READY_MARKER};

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

    pub(super) fn start(builder: GuestBuilder, image: GuestImage) -> Result<Guest> {
        let work_dir = tempfile::Builder::new()
            .prefix("devlend-guest-")
            .tempdir()
            .context("creating the guest's temporary directory")?;
        let initrd = work_dir.path().join("initrd");
        write_initrd(
            &image.initrd,
            builder.script.as_deref(),
            &builder.files,
            &initrd,
        )?;
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
