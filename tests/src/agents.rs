//! Real devlend processes for tests: a lender (`devlend-device-agent`), a borrower
//! (`devlend-compute-agent`) and the `devlend` CLI, all from the same cargo build.

use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// Path of a workspace binary built beside the running test (target/<profile>/NAME).
///
/// # Errors
/// The binary is missing (build the workspace first).
pub fn bin(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .ok_or_else(|| anyhow!("cannot locate the target directory"))?;
    let p = dir.join(name);
    if !p.is_file() {
        bail!(
            "{} is missing: run `cargo build --release --workspace` first",
            p.display()
        );
    }
    Ok(p)
}

/// A child process killed (SIGTERM, then SIGKILL) on drop, its output in a log file.
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    /// Starts `program` with `args`, output to `DIR/NAME.log`.
    ///
    /// # Errors
    /// The program cannot start.
    pub fn spawn(name: &str, program: &Path, args: &[String], dir: &Path) -> Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log)?;
        let child = Command::new(program)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("DEVLEND_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("cannot start {}", program.display()))?;
        Ok(Proc {
            name: name.to_owned(),
            child,
            log,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the process printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Fails if the process has exited.
    ///
    /// # Errors
    /// The process exited (its log is in the error).
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(s) = self.child.try_wait()? {
            bail!("{} exited ({s}):\n{}", self.name, self.log());
        }
        Ok(())
    }

    /// Kills the process with SIGKILL and reaps it.
    pub fn kill_hard(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal` (e.g. `libc::SIGSTOP`) to the process.
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid with a valid signal.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
    }

    /// Sends SIGTERM and waits up to `timeout` for the exit; returns the exit status.
    ///
    /// # Errors
    /// The process did not exit in time (it is then killed).
    pub fn terminate(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        // SAFETY: kill(2) on our own child's pid with a valid signal.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait()? {
                return Ok(s);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                bail!("{} did not exit within {timeout:?} of SIGTERM", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_ready(&mut self, what: &str, mut ready: impl FnMut() -> bool) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready() {
            self.check_alive()?;
            if Instant::now() > deadline {
                bail!("{what} not ready after 20 s:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.terminate(Duration::from_secs(5));
        }
        if std::env::var_os("DEVLEND_TEST_VERBOSE").is_some() {
            eprintln!("--- {} log ---\n{}", self.name, self.log());
        }
    }
}

/// Starts `program` with `args` as [`Proc::spawn`] does, inside network namespace
/// `netns` (`ip netns exec`) when given.
///
/// # Errors
/// The program cannot start.
pub fn spawn_in(
    netns: Option<&str>,
    name: &str,
    program: &Path,
    args: &[String],
    dir: &Path,
) -> Result<Proc> {
    match netns {
        None => Proc::spawn(name, program, args, dir),
        Some(ns) => {
            let mut a = vec![
                "netns".to_owned(),
                "exec".into(),
                ns.into(),
                program.display().to_string(),
            ];
            a.extend(args.iter().cloned());
            Proc::spawn(name, Path::new("ip"), &a, dir)
        }
    }
}

/// Waits up to 20 s until `addr` accepts TCP connections, failing early if `proc`
/// exits.
///
/// # Errors
/// The process exited, or the port never answered.
pub fn wait_listening(proc: &mut Proc, addr: &str) -> Result<()> {
    let what = format!("{} on {addr}", proc.name);
    proc.wait_ready(&what, || TcpStream::connect(addr).is_ok())
}

/// A free TCP port on 127.0.0.1 (racy by nature; fine on a test machine).
///
/// # Errors
/// No port could be bound.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A running lender.
pub struct Lender {
    /// The process.
    pub proc: Proc,
    /// Its `HOST:PORT`.
    pub addr: String,
}

impl Lender {
    /// Starts `devlend-device-agent --listen 127.0.0.1:PORT --device D...` and waits until
    /// it accepts connections.
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn start(dir: &Path, devices: &[String]) -> Result<Self> {
        Self::start_on(dir, &format!("127.0.0.1:{}", free_port()?), devices)
    }

    /// As [`Self::start`], on a given `HOST:PORT` (e.g. to restart a lender in place).
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn start_on(dir: &Path, addr: &str, devices: &[String]) -> Result<Self> {
        Self::start_with(dir, addr, devices, &[])
    }

    /// As [`Self::start_on`], with more arguments (e.g. `--pool URL`).
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn start_with(
        dir: &Path,
        addr: &str,
        devices: &[String],
        extra: &[String],
    ) -> Result<Self> {
        Self::start_in(dir, None, addr, devices, extra)
    }

    /// As [`Self::start_with`], inside network namespace `netns` when given.
    ///
    /// On an address beyond loopback (a namespace's address, a wildcard) a lender with
    /// no pool, no `--auth-key` and no `--tls-client-ca` needs `--insecure` in `extra`,
    /// or it refuses to start.
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn start_in(
        dir: &Path,
        netns: Option<&str>,
        addr: &str,
        devices: &[String],
        extra: &[String],
    ) -> Result<Self> {
        let addr = addr.to_owned();
        let mut args = vec!["--listen".to_owned(), addr.clone()];
        for d in devices {
            args.push("--device".into());
            args.push(d.clone());
        }
        args.extend(extra.iter().cloned());
        let program = bin("devlend-device-agent")?;
        let mut proc = match netns {
            None => Proc::spawn("device-agent", &program, &args, dir)?,
            Some(ns) => {
                let mut a = vec![
                    "netns".to_owned(),
                    "exec".into(),
                    ns.into(),
                    program.display().to_string(),
                ];
                a.extend(args);
                Proc::spawn("device-agent", Path::new("ip"), &a, dir)?
            }
        };
        proc.wait_ready("lender", || TcpStream::connect(&addr).is_ok())?;
        Ok(Lender { proc, addr })
    }
}

/// A running device pool (`devlend pool serve`), SQLite in its own data directory.
pub struct Pool {
    /// The process.
    pub proc: Proc,
    /// Its base URL.
    pub url: String,
    /// The admin key file it made at its start.
    pub admin_key: PathBuf,
    /// The CA its HTTPS certificate chains to, when it serves HTTPS.
    pub ca: Option<PathBuf>,
}

impl Pool {
    /// Starts `devlend pool serve --listen 127.0.0.1:PORT --data-dir DIR/pool` and waits
    /// until it accepts connections.
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn start(dir: &Path) -> Result<Self> {
        Self::start_inner(dir, None)
    }

    /// As [`Self::start`], serving HTTPS with the test certificate `lender.crt` of
    /// `certs` (for 127.0.0.1); [`Self::admin`] then trusts `ca.crt`.
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn start_https(dir: &Path, certs: &crate::certs::Certs) -> Result<Self> {
        Self::start_inner(dir, Some(certs))
    }

    fn start_inner(dir: &Path, certs: Option<&crate::certs::Certs>) -> Result<Self> {
        let addr = format!("127.0.0.1:{}", free_port()?);
        let data = dir.join("pool");
        let mut args = vec![
            "pool".to_owned(),
            "serve".into(),
            "--listen".into(),
            addr.clone(),
            "--data-dir".into(),
            data.display().to_string(),
        ];
        if let Some(c) = certs {
            args.extend([
                "--tls-cert".into(),
                c.path("lender.crt"),
                "--tls-key".into(),
                c.path("lender.key"),
            ]);
        }
        let mut proc = Proc::spawn("pool", &bin("devlend")?, &args, dir)?;
        proc.wait_ready("pool", || TcpStream::connect(&addr).is_ok())?;
        let scheme = if certs.is_some() { "https" } else { "http" };
        Ok(Pool {
            proc,
            url: format!("{scheme}://{addr}"),
            admin_key: data.join("admin.key"),
            ca: certs.map(|c| PathBuf::from(c.path("ca.crt"))),
        })
    }

    /// Starts `devlend pool serve --listen LISTEN --data-dir DATA EXTRA...` (e.g.
    /// `--database postgres://...`), logging to `DIR/NAME.log`, and waits until `url`
    /// (its address as clients reach it, e.g. `http://127.0.0.1:PORT` for a pool on
    /// `0.0.0.0:PORT`) accepts connections. Its admin key is `DATA/admin.key`. Started
    /// again with the same arguments, it is the same pool (a restart).
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn serve(
        dir: &Path,
        name: &str,
        listen: &str,
        url: &str,
        data: &Path,
        extra: &[String],
    ) -> Result<Self> {
        let mut args = vec![
            "pool".to_owned(),
            "serve".into(),
            "--listen".into(),
            listen.to_owned(),
            "--data-dir".into(),
            data.display().to_string(),
        ];
        args.extend(extra.iter().cloned());
        let mut proc = Proc::spawn(name, &bin("devlend")?, &args, dir)?;
        let addr = url
            .split_once("://")
            .map_or(url, |(_, a)| a)
            .trim_end_matches('/')
            .to_owned();
        proc.wait_ready("pool", || TcpStream::connect(&addr).is_ok())?;
        Ok(Pool {
            proc,
            url: url.to_owned(),
            admin_key: data.join("admin.key"),
            ca: None,
        })
    }

    /// A client that signs with the pool's admin key.
    ///
    /// # Errors
    /// The key file cannot be read.
    pub fn admin(&self) -> Result<devlend_pool::PoolClient> {
        let key = devlend_fabric::identity::load(&self.admin_key)?;
        Ok(
            devlend_pool::PoolClient::with_ca(&self.url, self.ca.as_deref())?
                .with_identity(std::sync::Arc::new(key)),
        )
    }

    /// Makes the key file `key` (if it does not exist) and enrolls it as `role` `name`,
    /// as `devlend pool enroll --public-key` does.
    ///
    /// # Errors
    /// The key cannot be made or the pool refuses.
    pub fn enroll(&self, role: devlend_pool::api::Role, name: &str, key: &Path) -> Result<()> {
        let (k, _) = devlend_fabric::identity::load_or_create(key)?;
        self.admin()?.enroll(&devlend_pool::api::EnrollRequest {
            role,
            name: name.to_owned(),
            public_key: Some(k.public_key().to_text()),
            ttl_ms: None,
        })?;
        Ok(())
    }
}

/// A running borrower and the CLI that drives it.
pub struct Borrower {
    /// The process.
    pub proc: Proc,
    /// Its API socket.
    pub api: PathBuf,
}

impl Borrower {
    /// Starts `devlend-compute-agent --api DIR/api.sock` and waits for its API.
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn start(dir: &Path) -> Result<Self> {
        Self::start_with(dir, &[])
    }

    /// The pool key a borrower started in `dir` signs with (made at its start):
    /// `DIR/compute.key`. Give it to `devlend attach --class` as `--pool-key`.
    pub fn pool_key(dir: &Path) -> PathBuf {
        dir.join("compute.key")
    }

    /// As [`Self::start`], with more arguments (e.g. `--auth-key-file F`).
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn start_with(dir: &Path, extra: &[String]) -> Result<Self> {
        Self::start_named(dir, "compute-agent", extra)
    }

    /// As [`Self::start_with`], logging to `DIR/NAME.log` (a restarted agent keeps its
    /// predecessor's log that way). The API socket is `DIR/api.sock` whatever the name,
    /// so its state file is `DIR/api.state.json`.
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn start_named(dir: &Path, name: &str, extra: &[String]) -> Result<Self> {
        Self::start_in(dir, None, name, extra)
    }

    /// As [`Self::start_named`], inside network namespace `netns` when given (the API
    /// socket, a unix socket, is reachable from any namespace).
    ///
    /// # Errors
    /// It cannot start or exits.
    pub fn start_in(dir: &Path, netns: Option<&str>, name: &str, extra: &[String]) -> Result<Self> {
        let api = dir.join("api.sock");
        let mut args = vec!["--api".to_owned(), api.display().to_string()];
        if !extra.iter().any(|a| a == "--pool-key-file") {
            // Each test's compute host has its own pool key (see [`Borrower::pool_key`]).
            args.push("--pool-key-file".into());
            args.push(Self::pool_key(dir).display().to_string());
        }
        args.extend(extra.iter().cloned());
        let mut proc = spawn_in(netns, name, &bin("devlend-compute-agent")?, &args, dir)?;
        let probe = api.clone();
        proc.wait_ready("borrower", || {
            std::os::unix::net::UnixStream::connect(&probe).is_ok()
        })?;
        Ok(Borrower { proc, api })
    }

    /// Runs `devlend --api API ARGS...` and returns its output.
    ///
    /// # Errors
    /// The CLI cannot run.
    pub fn cli(&self, args: &[&str]) -> Result<Output> {
        Ok(Command::new(bin("devlend")?)
            .arg("--api")
            .arg(&self.api)
            .args(args)
            .env_remove("RUST_BACKTRACE")
            .output()?)
    }

    /// Runs a CLI command with `--json` that must succeed and returns its JSON.
    ///
    /// # Errors
    /// The command failed (its stderr is in the error) or printed no JSON.
    pub fn cli_json(&self, args: &[&str]) -> Result<serde_json::Value> {
        let mut a = args.to_vec();
        a.push("--json");
        let out = self.cli(&a)?;
        if !out.status.success() {
            bail!(
                "devlend {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// Attaches `device` of `lender` on `socket` with `queues` queues.
    ///
    /// # Errors
    /// As [`Self::cli_json`].
    pub fn attach(
        &self,
        lender: &str,
        device: &str,
        socket: &Path,
        queues: u16,
    ) -> Result<serde_json::Value> {
        let q = queues.to_string();
        let s = socket.display().to_string();
        self.cli_json(&[
            "attach", "--lender", lender, "--device", device, "--socket", &s, "--queues", &q,
        ])
    }

    /// Attaches a BLOCK device of the pool at `pool_url` by class for VM `vm-1` on
    /// `socket` with `queues` queues, signing with the compute host's pool key of `dir`
    /// ([`Self::pool_key`]).
    ///
    /// # Errors
    /// As [`Self::cli_json`].
    pub fn attach_class(
        &self,
        pool_url: &str,
        dir: &Path,
        socket: &Path,
        queues: u16,
    ) -> Result<serde_json::Value> {
        let key = Self::pool_key(dir).display().to_string();
        let (s, q) = (socket.display().to_string(), queues.to_string());
        self.cli_json(&[
            "attach",
            "--pool",
            pool_url,
            "--pool-key",
            &key,
            "--class",
            "BLOCK",
            "--vm",
            "vm-1",
            "--socket",
            &s,
            "--queues",
            &q,
        ])
    }
}

/// Creates a sparse file of `len` bytes.
///
/// # Errors
/// The file cannot be created.
pub fn sparse_file(path: &Path, len: u64) -> Result<()> {
    File::create(path)?.set_len(len)?;
    Ok(())
}

/// One lent disk, as most guest tests want it: a lender serving a sparse image as
/// `disk0`, and a borrower with it attached on `disk0.sock`, all in one directory.
pub struct LentDisk {
    /// The lender's backing file.
    pub image: PathBuf,
    /// The vhost-user socket the VMM joins.
    pub socket: PathBuf,
    /// The lender.
    pub lender: Lender,
    /// The borrower.
    pub borrower: Borrower,
}

impl LentDisk {
    /// Lends a sparse image of `bytes` from `dir` and attaches it with `queues` queues.
    ///
    /// # Errors
    /// An agent does not start, or the attach fails.
    pub fn start(dir: &Path, bytes: u64, queues: u16) -> Result<Self> {
        let image = dir.join("disk0.img");
        sparse_file(&image, bytes)?;
        let lender = Lender::start(dir, &[format!("disk0={}", image.display())])?;
        let borrower = Borrower::start(dir)?;
        let socket = dir.join("disk0.sock");
        borrower.attach(&lender.addr, "disk0", &socket, queues)?;
        Ok(LentDisk {
            image,
            socket,
            lender,
            borrower,
        })
    }
}
