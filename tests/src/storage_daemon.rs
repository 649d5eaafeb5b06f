//! The reference vhost-user-blk backend for tests: `qemu-storage-daemon`
//! exporting an image file on a unix socket.
//!
//! It does locally what devlend's backend does across the fabric, so a test
//! that passes against it checks the harness and the guest; the same test
//! against devlend's backend then checks devlend.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How long [`StorageDaemon::vhost_user_blk`] waits for the socket.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// A running `qemu-storage-daemon`; killed when dropped.
#[derive(Debug)]
pub struct StorageDaemon {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl StorageDaemon {
    /// Exports the raw image file `image` (writable) as a vhost-user-blk
    /// device on the unix socket `socket`, and waits (up to 15 s) until the
    /// socket exists. The daemon's output goes to `<socket>.log`.
    ///
    /// # Errors
    /// When the daemon cannot be started, exits early, or does not create
    /// the socket in time; the error holds its log.
    pub fn vhost_user_blk(image: &Path, socket: &Path) -> Result<StorageDaemon> {
        let log = socket.with_extension("log");
        let log_file = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let log_err = log_file
            .try_clone()
            .with_context(|| format!("duplicating {}", log.display()))?;
        let child = Command::new("qemu-storage-daemon")
            .arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=f0,filename={}",
                image.display()
            ))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path={},writable=on",
                socket.display()
            ))
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(log_err)
            .spawn()
            .context("starting qemu-storage-daemon (run qemu/install-deps.sh)")?;
        let mut daemon = StorageDaemon {
            child,
            socket: socket.to_path_buf(),
            log,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while !socket.exists() {
            if let Some(status) = daemon
                .child
                .try_wait()
                .context("polling qemu-storage-daemon")?
            {
                bail!(
                    "qemu-storage-daemon exited ({status}) before listening:\n{}",
                    daemon.log_text()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "qemu-storage-daemon did not create {} within {:?}:\n{}",
                    socket.display(),
                    START_TIMEOUT,
                    daemon.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(daemon)
    }

    /// The socket the daemon listens on.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the daemon has printed so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for StorageDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
