//! The three servers of a `--peers` run, on one backing file in /dev/shm:
//!
//! - **devlend**: `devlend-device-agent` lends the file over TCP loopback to
//!   `devlend-compute-agent`, which serves it as a vhost-user-blk socket;
//! - **qsd-local**: `qemu-storage-daemon` exports the file as vhost-user-blk on this
//!   host, with no network hop;
//! - **qsd-nbd-chain**: one `qemu-storage-daemon` exports the file over NBD on TCP
//!   loopback, a second imports it and exports it as vhost-user-blk.
//!
//! Every server uses buffered I/O on the file (tmpfs has no O_DIRECT) and offers the
//! same number of queues. The QEMU daemons use `aio=io_uring` (their better setting
//! here: `aio=threads` is slower for 4 KiB requests) and open the file with
//! `locking=off`, since all three servers hold it open at once (only one does I/O at a
//! time).

use std::fs::File;
use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use devlend_compute_agent::api::AttachRequest;

use super::procstat::Watched;
use crate::api_client::ApiClient;
use crate::demo::rig::{sibling_binary, Daemon};

/// The QEMU storage daemon binary.
pub const QSD: &str = "qemu-storage-daemon";

/// One server under test.
pub struct Target {
    /// `devlend`, `qsd-local` or `qsd-nbd-chain`.
    pub name: &'static str,
    /// Its vhost-user-blk socket.
    pub socket: PathBuf,
    /// The processes whose CPU time and memory count for it.
    pub procs: Vec<Watched>,
    /// Each process's command line, for the report.
    pub commands: Vec<String>,
    /// Stopped in order when dropped: the borrower side first.
    daemons: Vec<Daemon>,
}

impl Target {
    /// Fails, with its log, if one of its processes has exited.
    ///
    /// # Errors
    /// A process exited.
    pub fn check_alive(&mut self) -> Result<()> {
        for d in &mut self.daemons {
            d.check_alive()?;
        }
        Ok(())
    }
}

/// The backing file and the running servers; everything stops when dropped.
pub struct Peers {
    /// Servers, devlend first.
    pub targets: Vec<Target>,
    /// The backing file.
    pub image: PathBuf,
    // Dropped last: removes the work directory (image, sockets, logs).
    _tmp: Option<tempfile::TempDir>,
}

/// How to start the servers.
pub struct Setup<'a> {
    /// Work directory (image, sockets, logs); default: a new one in /dev/shm.
    pub dir: Option<&'a Path>,
    /// Backing file size in bytes (a multiple of 1 MiB).
    pub size: u64,
    /// Queues each server offers.
    pub queues: u16,
    /// devlend's adaptive polling maximum in microseconds, on the lender and the
    /// borrower (0: interrupt-driven); `None`: each agent's default.
    pub poll_us: Option<u32>,
}

impl Peers {
    /// Writes the backing file and starts the three servers.
    ///
    /// # Errors
    /// A binary is missing, a server does not start, the file cannot be written.
    pub fn start(setup: &Setup<'_>, progress: &super::Progress) -> Result<Peers> {
        if setup.size == 0 || !setup.size.is_multiple_of(1 << 20) {
            bail!("--size must be a non-zero multiple of 1 MiB");
        }
        which_qsd()?;
        let (tmp, dir) = match setup.dir {
            Some(d) => {
                std::fs::create_dir_all(d)?;
                (None, d.to_owned())
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("devlend-bench-")
                    .tempdir_in("/dev/shm")
                    .context("cannot create a work directory in /dev/shm")?;
                let d = t.path().to_owned();
                (Some(t), d)
            }
        };
        let image = dir.join("disk.img");
        progress.set(format!(
            "writing the {} MiB backing file {}",
            setup.size >> 20,
            image.display()
        ));
        write_image(&image, setup.size)?;
        progress.set("starting devlend, qsd-local and qsd-nbd-chain".into());
        let targets = vec![
            devlend(&dir, &image, setup)?,
            qsd_local(&dir, &image, setup.queues)?,
            qsd_chain(&dir, &image, setup.queues)?,
        ];
        Ok(Peers {
            targets,
            image,
            _tmp: tmp,
        })
    }
}

/// Fails with what to install if `qemu-storage-daemon` is missing.
fn which_qsd() -> Result<()> {
    match std::process::Command::new(QSD).arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => bail!("{QSD} is needed for --peers: install QEMU 10 (bash qemu/install-deps.sh)"),
    }
}

/// The QEMU version line, for the report.
pub fn qsd_version() -> String {
    std::process::Command::new(QSD)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into())
}

/// Writes the whole file (a non-zero pattern), so that reads hit real pages.
fn write_image(path: &Path, size: u64) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let chunk: Vec<u8> = (0..1usize << 20).map(|i| (i % 251) as u8 | 1).collect();
    for _ in 0..size >> 20 {
        f.write_all(&chunk)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn command_line(bin: &Path, args: &[String]) -> String {
    let mut s = bin
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    for a in args {
        s.push(' ');
        s.push_str(a);
    }
    s
}

fn devlend(dir: &Path, image: &Path, setup: &Setup<'_>) -> Result<Target> {
    let lender_bin = sibling_binary("devlend-device-agent")?;
    let borrower_bin = sibling_binary("devlend-compute-agent")?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let mut largs = vec![
        "--listen".to_owned(),
        addr.clone(),
        "--device".into(),
        format!("disk0={}", image.display()),
    ];
    // Polling on both hops: the lender's sessions too.
    if let Some(us) = setup.poll_us {
        largs.extend(["--poll-us".to_owned(), us.to_string()]);
    }
    let mut lender = Daemon::spawn("bench-device-agent", &lender_bin, &largs, dir)?;
    lender.wait_until("devlend-device-agent", || TcpStream::connect(&addr).is_ok())?;
    let api = dir.join("compute-agent.sock");
    let bargs = vec!["--api".to_owned(), api.display().to_string()];
    let mut borrower = Daemon::spawn("bench-compute-agent", &borrower_bin, &bargs, dir)?;
    let client = ApiClient::new(&api)?;
    borrower.wait_until("devlend-compute-agent", || {
        api.exists() && client.list().is_ok()
    })?;
    let socket = dir.join("devlend.sock");
    client.attach(&AttachRequest {
        id: Some("bench".into()),
        lender: addr,
        paths: Vec::new(),
        device: "disk0".into(),
        socket: socket.clone(),
        queues: setup.queues,
        queue_size: 256,
        poll_us: setup.poll_us.unwrap_or(0),
        reconnect_deadline_s: 30,
        vmm: None,
        lease: None,
        lender_key: None,
        tls: false,
        tls_server_name: None,
        transport: Default::default(),
        rdma_exposure: Default::default(),
        kind: Default::default(),
        vm: None,
        handover_token: None,
    })?;
    let attach = format!(
        "devlend attach --lender 127.0.0.1:PORT --device disk0 --socket {} --queues {}{}",
        socket.display(),
        setup.queues,
        match setup.poll_us {
            Some(us) => format!(" --poll-us {us}"),
            None => String::new(),
        }
    );
    Ok(Target {
        name: "devlend",
        socket,
        procs: vec![
            Watched {
                name: "device-agent".into(),
                pid: lender.pid(),
            },
            Watched {
                name: "compute-agent".into(),
                pid: borrower.pid(),
            },
        ],
        commands: vec![
            command_line(&lender_bin, &largs),
            command_line(&borrower_bin, &bargs),
            attach,
        ],
        daemons: vec![borrower, lender],
    })
}

/// `--blockdev` of the backing file, the same for every QEMU daemon.
fn file_blockdev(image: &Path) -> String {
    format!(
        "driver=file,node-name=f0,filename={},cache.direct=off,aio=io_uring,locking=off",
        image.display()
    )
}

/// `--export` of a vhost-user-blk socket.
fn vhost_export(node: &str, socket: &Path, queues: u16) -> String {
    format!(
        "type=vhost-user-blk,id=e0,node-name={node},addr.type=unix,addr.path={},writable=on,num-queues={queues}",
        socket.display()
    )
}

fn spawn_qsd(name: &'static str, args: &[String], dir: &Path) -> Result<Daemon> {
    Daemon::spawn(name, Path::new(QSD), args, dir)
}

fn qsd_local(dir: &Path, image: &Path, queues: u16) -> Result<Target> {
    let socket = dir.join("qsd-local.sock");
    let args = vec![
        "--blockdev".to_owned(),
        file_blockdev(image),
        "--export".into(),
        vhost_export("f0", &socket, queues),
    ];
    let mut d = spawn_qsd("bench-qsd-local", &args, dir)?;
    d.wait_until("qsd-local", || socket.exists())?;
    Ok(Target {
        name: "qsd-local",
        socket,
        procs: vec![Watched {
            name: "qsd".into(),
            pid: d.pid(),
        }],
        commands: vec![command_line(Path::new(QSD), &args)],
        daemons: vec![d],
    })
}

fn qsd_chain(dir: &Path, image: &Path, queues: u16) -> Result<Target> {
    let port = free_port()?;
    let largs = vec![
        "--blockdev".to_owned(),
        file_blockdev(image),
        "--nbd-server".into(),
        format!("addr.type=inet,addr.host=127.0.0.1,addr.port={port}"),
        "--export".into(),
        "type=nbd,id=n0,node-name=f0,writable=on".into(),
    ];
    let mut lender = spawn_qsd("bench-qsd-nbd-lender", &largs, dir)?;
    lender.wait_until("the NBD lender", || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    })?;
    let socket = dir.join("qsd-chain.sock");
    let bargs = vec![
        "--blockdev".to_owned(),
        format!("driver=nbd,node-name=n0,server.type=inet,server.host=127.0.0.1,server.port={port},export=f0"),
        "--export".into(),
        vhost_export("n0", &socket, queues),
    ];
    let mut borrower = spawn_qsd("bench-qsd-nbd-borrower", &bargs, dir)?;
    borrower.wait_until("the NBD borrower", || socket.exists())?;
    Ok(Target {
        name: "qsd-nbd-chain",
        socket,
        procs: vec![
            Watched {
                name: "qsd-nbd-lender".into(),
                pid: lender.pid(),
            },
            Watched {
                name: "qsd-nbd-borrower".into(),
                pid: borrower.pid(),
            },
        ],
        commands: vec![
            command_line(Path::new(QSD), &largs),
            command_line(Path::new(QSD), &bargs),
        ],
        daemons: vec![borrower, lender],
    })
}
