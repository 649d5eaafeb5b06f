//! `devlend demo`: lend a sparse disk image over TCP on this machine and write and verify
//! it through the vhost-user socket with the `blkio` frontend, then check the lender's
//! file holds the same data.

use std::fs::File;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use devlend_compute_agent::api::{AttachRequest, AttachmentInfo};
use serde::Serialize;

use crate::api_client::ApiClient;
use crate::blk_client::{BlkClient, BlkOp};
use crate::output::human_bytes;
use crate::pattern::{fill, first_mismatch, Checksum};

/// Demo settings.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Disk size in bytes (a multiple of 1 MiB).
    pub size: u64,
    /// Work directory (default: a new temporary directory, removed at the end).
    pub dir: Option<PathBuf>,
    /// Print progress on stderr.
    pub progress: bool,
}

/// What the demo did.
#[derive(Debug, Clone, Serialize)]
pub struct DemoSummary {
    /// Disk size in bytes.
    pub size: u64,
    /// Write throughput through the whole path, MB/s (10^6 bytes).
    pub write_mb_s: f64,
    /// Read throughput, MB/s.
    pub read_mb_s: f64,
    /// Checksum of the disk computed by the frontend while verifying.
    pub checksum_frontend: String,
    /// Checksum of the lender's image file after detach.
    pub checksum_lender: String,
    /// The attachment's final state, with its counters.
    pub attachment: AttachmentInfo,
    /// Wall-clock seconds of the whole demo.
    pub seconds: f64,
}

const CHUNK: usize = 1 << 20;
const DEPTH: usize = 4;
const SEED: u64 = 0x0064_6576_6c65_6e64;

/// Kills the child on drop.
struct Daemon {
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
    fn spawn(name: &'static str, bin: &Path, args: &[String], dir: &Path) -> Result<Self> {
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

    fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            bail!("{} exited ({status}):\n{log}", self.name);
        }
        Ok(())
    }
}

/// Finds a sibling binary of the running executable (both come from `cargo build`).
pub fn sibling_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot locate the devlend executable")?;
    let p = exe
        .parent()
        .map(|d| d.join(name))
        .ok_or_else(|| anyhow!("no parent directory"))?;
    if p.is_file() {
        return Ok(p);
    }
    // Test executables live in target/<profile>/deps.
    let up = exe.parent().and_then(|d| d.parent()).map(|d| d.join(name));
    match up {
        Some(p) if p.is_file() => Ok(p),
        _ => bail!(
            "{name} not found next to {}: build it with `cargo build --release`",
            exe.display()
        ),
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_until(what: &str, daemon: &mut Daemon, mut ready: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready() {
        daemon.check_alive()?;
        if Instant::now() > deadline {
            bail!(
                "{what} did not become ready in 20 s (log: {})",
                daemon.log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn step(progress: bool, msg: &str) {
    if progress {
        eprintln!("==> {msg}");
    }
}

fn bar(progress: bool, len: u64, msg: &'static str) -> indicatif::ProgressBar {
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

/// Runs the demo.
///
/// # Errors
/// Any step failing, with the agents' logs when one of them died; a data mismatch.
pub fn run(opts: &DemoOptions) -> Result<DemoSummary> {
    let t0 = Instant::now();
    if opts.size == 0 || !opts.size.is_multiple_of(CHUNK as u64) {
        bail!("demo size must be a non-zero multiple of 1 MiB");
    }
    let lender_bin = sibling_binary("devlend-device-agent")?;
    let borrower_bin = sibling_binary("devlend-compute-agent")?;
    let tmp;
    let dir = match &opts.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new().prefix("devlend-demo-").tempdir()?;
            tmp.path().to_owned()
        }
    };
    let p = opts.progress;

    let image = dir.join("disk0.img");
    step(
        p,
        &format!(
            "creating a {} sparse image {}",
            human_bytes(opts.size),
            image.display()
        ),
    );
    File::create(&image)?.set_len(opts.size)?;

    let port = free_port()?;
    let lender_addr = format!("127.0.0.1:{port}");
    step(
        p,
        &format!("starting the lender (devlend-device-agent) on {lender_addr}"),
    );
    let mut lender = Daemon::spawn(
        "device-agent",
        &lender_bin,
        &[
            "--listen".into(),
            lender_addr.clone(),
            "--device".into(),
            format!("disk0={},serial=devlend-demo", image.display()),
        ],
        &dir,
    )?;
    wait_until("the lender", &mut lender, || {
        TcpStream::connect(&lender_addr).is_ok()
    })?;

    let api = dir.join("compute-agent.sock");
    step(
        p,
        &format!(
            "starting the borrower (devlend-compute-agent), API {}",
            api.display()
        ),
    );
    let mut borrower = Daemon::spawn(
        "compute-agent",
        &borrower_bin,
        &["--api".into(), api.display().to_string()],
        &dir,
    )?;
    let client = ApiClient::new(&api)?;
    wait_until("the borrower", &mut borrower, || {
        api.exists() && client.list().is_ok()
    })?;

    let socket = dir.join("disk0.vhost.sock");
    step(
        p,
        &format!("attaching disk0 on vhost-user socket {}", socket.display()),
    );
    let info = client.attach(&AttachRequest {
        id: Some("demo".into()),
        lender: lender_addr.clone(),
        device: "disk0".into(),
        socket: socket.clone(),
        queues: 1,
        queue_size: 256,
        vmm: None,
    })?;

    step(
        p,
        "writing a known pattern across the disk through vhost-user (libblkio frontend)",
    );
    let mut blk = BlkClient::connect(&socket, 1, CHUNK * DEPTH)?;
    if blk.capacity() != opts.size {
        bail!(
            "the frontend sees {} bytes, expected {}",
            blk.capacity(),
            opts.size
        );
    }
    let chunks = opts.size / CHUNK as u64;
    let pb = bar(p, opts.size, "write");
    let tw = Instant::now();
    let mut c = 0u64;
    while c < chunks {
        let n = DEPTH.min((chunks - c) as usize);
        let ops: Vec<BlkOp> = (0..n)
            .map(|i| BlkOp::Write {
                offset: (c + i as u64) * CHUNK as u64,
                buf: i * CHUNK,
                len: CHUNK,
            })
            .collect();
        for (i, op) in ops.iter().enumerate() {
            if let BlkOp::Write { offset, .. } = op {
                fill(&mut blk.buffer()[i * CHUNK..(i + 1) * CHUNK], *offset, SEED);
            }
        }
        check(&blk.run(0, &ops)?, "write")?;
        c += n as u64;
        pb.inc((n * CHUNK) as u64);
    }
    check(&blk.run_one(0, BlkOp::Flush).map(|r| vec![r])?, "flush")?;
    let write_s = tw.elapsed().as_secs_f64();
    pb.finish();

    step(p, "reading the disk back and verifying it");
    let pb = bar(p, opts.size, "verify");
    let tr = Instant::now();
    let mut sum = Checksum::default();
    let mut c = 0u64;
    while c < chunks {
        let n = DEPTH.min((chunks - c) as usize);
        let ops: Vec<BlkOp> = (0..n)
            .map(|i| BlkOp::Read {
                offset: (c + i as u64) * CHUNK as u64,
                buf: i * CHUNK,
                len: CHUNK,
            })
            .collect();
        check(&blk.run(0, &ops)?, "read")?;
        for i in 0..n {
            let off = (c + i as u64) * CHUNK as u64;
            let data = &blk.buffer()[i * CHUNK..(i + 1) * CHUNK];
            if let Some(bad) = first_mismatch(data, off, SEED) {
                bail!("data read back differs from what was written at byte {bad}");
            }
            sum.update(data);
        }
        c += n as u64;
        pb.inc((n * CHUNK) as u64);
    }
    let read_s = tr.elapsed().as_secs_f64();
    pb.finish();
    drop(blk);

    step(p, "detaching (requests in flight complete, socket removed)");
    let detached = client.detach("demo", 30)?;
    if socket.exists() {
        bail!("socket {} still exists after detach", socket.display());
    }

    step(p, "checking the lender's image file holds the same data");
    let lender_sum = file_checksum(&image)?;
    if lender_sum.value() != sum.value() {
        bail!(
            "checksum mismatch: frontend {:016x}, lender file {:016x}",
            sum.value(),
            lender_sum.value()
        );
    }
    drop(borrower);
    drop(lender);
    let _ = info;
    let mb = opts.size as f64 / 1e6;
    Ok(DemoSummary {
        size: opts.size,
        write_mb_s: mb / write_s,
        read_mb_s: mb / read_s,
        checksum_frontend: format!("{:016x}", sum.value()),
        checksum_lender: format!("{:016x}", lender_sum.value()),
        attachment: detached,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

fn check(results: &[i32], what: &str) -> Result<()> {
    match results.iter().find(|&&r| r != 0) {
        Some(r) => Err(anyhow!(
            "{what} failed: {}",
            std::io::Error::from_raw_os_error(-r)
        )),
        None => Ok(()),
    }
}

/// Checksum of a whole file, as [`Checksum`] computes it over the device.
///
/// # Errors
/// Reading the file.
pub fn file_checksum(path: &Path) -> Result<Checksum> {
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut buf = vec![0u8; CHUNK];
    let mut sum = Checksum::default();
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        sum.update(&buf[..n]);
    }
    Ok(sum)
}
