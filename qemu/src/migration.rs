//! Live migration of harness guests: the destination QEMU of a migration.
//!
//! [`Guest::incoming`] describes a second QEMU with the same machine, kernel, initramfs,
//! memory and devices as a running [`Guest`], started with `-incoming URI`; what may
//! differ per instance (the network namespace it runs in, as on another host, and the
//! device arguments, e.g. another vhost-user socket for the same device) is set on the
//! [`Incoming`]. The destination is a [`Guest`] like any other: its console is read from
//! its start (the guest's output goes on there once the migration completes), QMP is at
//! [`Guest::qmp_socket`], and it can be the source of the next migration. Driving the
//! migration itself (QMP `migrate`, `query-migrate`, `migrate_cancel`) is the test's
//! business; [`join_consoles`] puts the consoles of a guest's successive QEMUs together.

use std::path::Path;

use anyhow::{Context, Result};

use crate::guest::{Guest, GuestBuilder, TimedConsole, TimedLine};

/// The destination QEMU of a migration, as [`Guest::incoming`] describes it.
#[derive(Debug, Clone)]
pub struct Incoming {
    builder: GuestBuilder,
    image: crate::guest::GuestImage,
    source_initrd: std::path::PathBuf,
    uri: String,
}

impl Guest {
    /// A destination for migrating this guest: the same QEMU command line (machine,
    /// kernel, this guest's initramfs, memory, devices, network namespace), listening
    /// for the migration stream on `uri` (`tcp:IP:PORT`, given to `-incoming`). Its name
    /// is this one's with `>` appended until [`Incoming::name`].
    pub fn incoming(&self, uri: impl Into<String>) -> Incoming {
        let label = format!("{}>", self.builder.label());
        Incoming {
            builder: self.builder.clone().name(label),
            image: self.image.clone(),
            source_initrd: self.initrd.clone(),
            uri: uri.into(),
        }
    }
}

impl Incoming {
    /// A label for log lines and error messages.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.builder = self.builder.name(name);
        self
    }

    /// Runs the destination inside network namespace `ns` (another host).
    pub fn netns(mut self, ns: impl Into<String>) -> Self {
        self.builder = self.builder.netns(ns);
        self
    }

    /// Replaces `from` by `to` in every device argument (those given with
    /// [`GuestBuilder::arg`], [`GuestBuilder::args`] and the disk setters), e.g. the path
    /// of a vhost-user socket: the same device, with the same id and options, joined
    /// through the destination host's socket.
    pub fn replace_in_args(mut self, from: &str, to: &str) -> Self {
        for a in self.builder.extra_args_mut() {
            if a.contains(from) {
                *a = a.replace(from, to);
            }
        }
        self
    }

    /// Replaces the device arguments as a whole. They must describe the same devices
    /// in the same order as the source's, or QEMU refuses the migration stream.
    pub fn device_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        *self.builder.extra_args_mut() = args.into_iter().map(Into::into).collect();
        self
    }

    /// Starts the destination QEMU. It listens on the URI once its QMP answers (QMP
    /// `query-status` says `inmigrate`); the guest runs there once the source's
    /// `migrate` completes.
    ///
    /// # Errors
    /// The initramfs cannot be copied, or QEMU cannot be started.
    pub fn start(self) -> Result<Guest> {
        let work_dir = tempfile::Builder::new()
            .prefix("devlend-guest-")
            .tempdir()
            .context("creating the destination's temporary directory")?;
        let initrd = work_dir.path().join("initrd");
        link_or_copy(&self.source_initrd, &initrd)?;
        Guest::launch(
            self.builder,
            self.image,
            work_dir,
            initrd,
            &["-incoming".to_string(), self.uri],
        )
    }
}

/// Hard-links `from` to `to` (the source's work directory may go before this guest
/// does), copying when they are on different filesystems.
fn link_or_copy(from: &Path, to: &Path) -> Result<()> {
    if std::fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    std::fs::copy(from, to)
        .map(|_| ())
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))
}

/// The console of one guest across its successive QEMUs (source, then each
/// destination), in order: a line cut at the end of one QEMU's output (the source stops
/// in the middle of it) is joined with the first line of the next, taking the later
/// time.
pub fn join_consoles(consoles: &[TimedConsole]) -> Vec<TimedLine> {
    let mut out: Vec<TimedLine> = Vec::new();
    let mut carry = String::new();
    for c in consoles {
        let mut lines = c.lines.iter();
        if !carry.is_empty() {
            match lines.next() {
                Some(first) => out.push(TimedLine {
                    at: first.at,
                    text: std::mem::take(&mut carry) + &first.text,
                }),
                None => {
                    carry.push_str(&c.unterminated);
                    continue;
                }
            }
        }
        out.extend(lines.cloned());
        carry.push_str(&c.unterminated);
    }
    if let Some(last) = out.last().map(|l| l.at) {
        if !carry.is_empty() {
            out.push(TimedLine {
                at: last,
                text: carry,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn consoles_join_across_a_cut_line() {
        let t = Instant::now();
        let line = |s: u64, text: &str| TimedLine {
            at: t + Duration::from_secs(s),
            text: text.into(),
        };
        let a = TimedConsole {
            lines: vec![line(1, "a1"), line(2, "a2")],
            unterminated: "DLIO w 1".into(),
        };
        let b = TimedConsole {
            lines: vec![line(5, "2 3.4"), line(6, "b2")],
            unterminated: String::new(),
        };
        let c = TimedConsole {
            lines: vec![line(7, "c1")],
            unterminated: "tail".into(),
        };
        let joined = join_consoles(&[a, b, c]);
        let texts: Vec<&str> = joined.iter().map(|l| l.text.as_str()).collect();
        assert_eq!(texts, ["a1", "a2", "DLIO w 12 3.4", "b2", "c1", "tail"]);
        assert_eq!(joined[2].at, t + Duration::from_secs(5));
    }
}
