//! What every demo needs: a work directory, a sparse image, a device pool (embedded,
//! SQLite in the work directory), a lender registered with it, and a borrower.

use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use devlend_pool::api::{EnrollRequest, Role};

use crate::api_client::ApiClient;
use crate::output::human_bytes;
use crate::placement::{self, Claimed, Wanted};

/// A child process stopped (SIGTERM, then SIGKILL) on drop; its output goes to a log.
pub struct Daemon {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid, with a valid signal number.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// Starts `bin` with `args`, its output to `DIR/NAME.log`.
    ///
    /// # Errors
    /// The log cannot be created or the program cannot start.
    pub fn spawn(name: &'static str, bin: &Path, args: &[String], dir: &Path) -> Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        Ok(Daemon { name, child, log })
    }

    /// Fails, with the daemon's log, if it has exited.
    ///
    /// # Errors
    /// The daemon exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            bail!("{} exited ({status}):\n{log}", self.name);
        }
        Ok(())
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to 20 s until `ready` holds.
    ///
    /// # Errors
    /// The daemon exited (with its log), or 20 s passed.
    pub fn wait_until(&mut self, what: &str, mut ready: impl FnMut() -> bool) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready() {
            self.check_alive()?;
            if Instant::now() > deadline {
                bail!(
                    "{what} did not become ready in 20 s (log: {})",
                    self.log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

/// Finds a sibling binary of the running executable (both come from `cargo build`).
///
/// # Errors
/// The binary is not there.
pub fn sibling_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot locate the devlend executable")?;
    let dir = exe.parent().ok_or_else(|| anyhow!("no parent directory"))?;
    for d in [Some(dir), dir.parent()].into_iter().flatten() {
        let p = d.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "{name} not found next to {}: build it with `cargo build --release --workspace`",
        exe.display()
    )
}

/// Prints a progress step.
pub fn step(progress: bool, msg: &str) {
    if progress {
        eprintln!("==> {msg}");
    }
}

/// A byte progress bar (hidden when `progress` is off).
pub fn bar(progress: bool, len: u64, msg: &'static str) -> indicatif::ProgressBar {
    if !progress {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "    {msg:<8} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_message(msg);
    pb
}

/// The pool, the lender, the borrower and the image.
pub struct Rig {
    /// Work directory.
    pub dir: PathBuf,
    /// The lent image file.
    pub image: PathBuf,
    /// The lender's `HOST:PORT`.
    pub lender_addr: String,
    /// The borrower's API.
    pub client: ApiClient,
    /// The embedded pool's URL.
    pub pool_url: String,
    /// The compute host's enrolled key, which leases are asked for with.
    compute_id: Arc<devlend_fabric::lease_token::TokenSigner>,
    // Dropped after the client: borrower first, then lender, then the pool.
    _borrower: Daemon,
    _lender: Daemon,
    _pool: devlend_pool::PoolServer,
    _tmp: Option<tempfile::TempDir>,
}

impl Rig {
    /// Creates the work directory and a sparse image of `size` bytes, starts a lender
    /// lending it as `disk0` on a free loopback port and a borrower.
    ///
    /// # Errors
    /// A binary is missing or a daemon does not start.
    pub fn start(dir: Option<&Path>, size: u64, progress: bool) -> Result<Rig> {
        let lender_bin = sibling_binary("devlend-device-agent")?;
        let borrower_bin = sibling_binary("devlend-compute-agent")?;
        let (tmp, dir) = match dir {
            Some(d) => {
                std::fs::create_dir_all(d)?;
                (None, d.to_owned())
            }
            None => {
                let t = tempfile::Builder::new().prefix("devlend-demo-").tempdir()?;
                let d = t.path().to_owned();
                (Some(t), d)
            }
        };
        let image = dir.join("disk0.img");
        step(
            progress,
            &format!(
                "creating a {} sparse image {}",
                human_bytes(size),
                image.display()
            ),
        );
        if image.exists() {
            bail!(
                "{} already exists; the demo will not overwrite it (use another --dir)",
                image.display()
            );
        }
        File::create(&image)?.set_len(size)?;

        let pool = devlend_pool::PoolServer::start(devlend_pool::ServerConfig {
            listen: "127.0.0.1:0".parse()?,
            database: None,
            data_dir: dir.join("pool"),
            ..Default::default()
        })
        .context("cannot start the embedded device pool")?;
        let pool_url = pool.url();
        // The pool's admin enrolls the lender's and the compute host's keys, as an
        // operator does with `devlend pool enroll --public-key`.
        let admin_key = dir.join("pool").join(devlend_pool::server::ADMIN_KEY_FILE);
        let admin = devlend_pool::PoolClient::new(&pool_url)?
            .with_identity(Arc::new(devlend_fabric::identity::load(&admin_key)?));
        let lender_key = dir.join("lender.key");
        let compute_key = dir.join("compute.key");
        let (lender_id, _) = devlend_fabric::identity::load_or_create(&lender_key)?;
        let (compute_id, _) = devlend_fabric::identity::load_or_create(&compute_key)?;
        let compute_id = Arc::new(compute_id);
        for (role, name, key) in [
            (
                Role::Lender,
                "demo-lender".to_string(),
                lender_id.public_key(),
            ),
            (
                Role::Compute,
                devlend_daemon::host_name(),
                compute_id.public_key(),
            ),
        ] {
            admin.enroll(&EnrollRequest {
                role,
                name,
                public_key: Some(key.to_text()),
                ttl_ms: None,
            })?;
        }
        step(
            progress,
            &format!(
                "device pool on {pool_url} (SQLite in {})",
                dir.join("pool").display()
            ),
        );
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let lender_addr = format!("127.0.0.1:{port}");
        step(
            progress,
            &format!("starting the lender (devlend-device-agent) on {lender_addr}, registered with the pool"),
        );
        let mut lender = Daemon::spawn(
            "device-agent",
            &lender_bin,
            &[
                "--listen".into(),
                lender_addr.clone(),
                "--device".into(),
                format!("disk0={},serial=devlend-demo", image.display()),
                "--pool".into(),
                pool_url.clone(),
                "--provider".into(),
                "demo-lender".into(),
                "--key-file".into(),
                lender_key.display().to_string(),
            ],
            &dir,
        )?;
        lender.wait_until("the lender", || TcpStream::connect(&lender_addr).is_ok())?;
        lender.wait_until("the lender's registration", || {
            admin
                .devices(&devlend_pool::api::DeviceQuery::default())
                .is_ok_and(|d| !d.is_empty())
        })?;

        let api = dir.join("compute-agent.sock");
        step(
            progress,
            &format!(
                "starting the borrower (devlend-compute-agent), API {}",
                api.display()
            ),
        );
        let mut borrower = Daemon::spawn(
            "compute-agent",
            &borrower_bin,
            &[
                "--api".into(),
                api.display().to_string(),
                "--pool-key-file".into(),
                compute_key.display().to_string(),
            ],
            &dir,
        )?;
        let client = ApiClient::new(&api)?;
        borrower.wait_until("the borrower", || api.exists() && client.list().is_ok())?;
        Ok(Rig {
            dir,
            image,
            lender_addr,
            client,
            pool_url,
            compute_id,
            _borrower: borrower,
            _lender: lender,
            _pool: pool,
            _tmp: tmp,
        })
    }

    /// Leases a block device of at least `min_bytes` for `vm` from the pool (placement
    /// picks the demo's disk0), as `devlend attach --class BLOCK` does.
    ///
    /// # Errors
    /// The pool refuses (nothing matches) or cannot be reached.
    pub fn lease(&self, vm: &str, min_bytes: u64, progress: bool) -> Result<Claimed> {
        let client = devlend_pool::PoolClient::new(&self.pool_url)?
            .with_identity(Arc::clone(&self.compute_id));
        let c = placement::claim(
            client,
            &Wanted {
                class: "BLOCK".into(),
                min_capacity_bytes: min_bytes,
                traits: vec!["FABRIC_TCP".into()],
                numa_node: None,
                vm: vm.into(),
                ttl_ms: 30_000,
                qos: None,
            },
        )?;
        step(
            progress,
            &format!(
                "leased {} on {} from the pool (lease {})",
                c.grant.lease.device, c.grant.lease.provider, c.grant.lease.id
            ),
        );
        Ok(c)
    }
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a whole file, in hex.
///
/// # Errors
/// Reading the file.
pub fn file_sha256(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut h = Sha256::new();
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}
