//! A private PostgreSQL server for one test, that the test may stop and start again
//! (a database outage under a pool). Adapted from `pool/tests/support`'s per-binary
//! server: Debian's packages (`/usr/lib/postgresql/*/bin`), initdb and postgres run as
//! the `postgres` system user (postgres refuses root) in a temporary directory,
//! listening on 127.0.0.1 on a free port, `fsync=off`. Killed and removed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::agents::free_port;

/// A running (or stopped) private PostgreSQL server.
pub struct Postgres {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
}

/// The newest `/usr/lib/postgresql/N/bin` holding `initdb` and `postgres`.
fn bin_dir() -> Option<PathBuf> {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").exists() && bin.join("postgres").exists()).then_some((v, bin))
        })
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, b)| b)
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd
        .output()
        .with_context(|| format!("{what}: cannot run"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

impl Postgres {
    /// initdb in a new temporary directory, then [`Self::start`].
    ///
    /// # Errors
    /// PostgreSQL is not installed (`bash qemu/install-deps.sh`), or does not start.
    pub fn new() -> Result<Self> {
        let bin = bin_dir().context(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/{initdb,postgres}): \
             run `bash qemu/install-deps.sh`",
        )?;
        let dir = tempfile::Builder::new()
            .prefix("devlend-test-pg-")
            .tempdir()?
            .keep();
        std::fs::create_dir_all(dir.join("sock"))?;
        run(
            Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir),
            "chown the PostgreSQL directory to user postgres",
        )?;
        run(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(bin.join("initdb"))
                .arg("-D")
                .arg(dir.join("data"))
                .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"]),
            "initdb",
        )?;
        let mut pg = Postgres {
            dir,
            bin,
            port: free_port()?,
            child: None,
        };
        pg.start()?;
        Ok(pg)
    }

    /// The URL of its `postgres` database (superuser, no password).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The server's directory (its log is `postgres.log` there).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts the server (again) on its data directory and port; waits until it
    /// accepts queries (`pg_isready`).
    ///
    /// # Errors
    /// It does not start within 60 s.
    pub fn start(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("postgres.log"))?;
        let child = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("postgres"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .arg("-k")
            .arg(self.dir.join("sock"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-c", "fsync=off", "-c", "synchronous_commit=off"])
            .args(["-c", "full_page_writes=off", "-c", "max_connections=300"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("cannot start postgres")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = Command::new(self.bin.join("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return Ok(());
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                bail!(
                    "PostgreSQL did not start:\n{}",
                    std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The postmaster's pid (first line of `postmaster.pid`; runuser sits between us
    /// and it).
    fn postmaster(&self) -> Option<i32> {
        std::fs::read_to_string(self.dir.join("data/postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// Stops the server: `signal` to the postmaster (SIGINT: fast shutdown, clients
    /// disconnected; SIGQUIT: immediate), and waits up to 20 s for it to exit.
    ///
    /// # Errors
    /// It did not exit in time.
    pub fn stop(&mut self, signal: libc::c_int) -> Result<()> {
        if let Some(pid) = self.postmaster() {
            // SAFETY: kill(2) with a pid read from the server's own pid file.
            unsafe { libc::kill(pid, signal) };
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        if let Some(mut c) = self.child.take() {
            loop {
                if c.try_wait()?.is_some() {
                    break;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    bail!("PostgreSQL did not stop within 20 s");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.stop(libc::SIGQUIT);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
