//! `devlend`: attach lent devices, detach them, show status, run the local demo, bench.
//!
//! Why this file is over 600 lines: about 270 lines are the `clap` definition of the
//! commands, whose doc comments are the `--help` text, and `run` dispatches every command.
//! The `attach` arm of `run` (about 180 lines) could move to its own module, as `pool_cmd`
//! and `gateway_cmd` did, and is left here for now.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use devlend_cli::api_client::ApiClient;
use devlend_cli::bench::options::{parse_secs, BenchOptions, Matrix, PeersOptions, Rw, Workload};
use devlend_cli::demo::{self, DemoOptions, Frontend};
use devlend_cli::output::{
    human_bytes, libvirt_target_dev, libvirt_xml, nic_link_words, qemu_args, status_table,
};
use devlend_cli::placement;
use devlend_compute_agent::api::{AttachRequest, KindInfo, RdmaExposure, Transport, VmmTarget};
use devlend_compute_agent::vmm::cloud_hypervisor;
use devlend_compute_agent::DEFAULT_API_SOCKET;
use devlend_fabric::units::parse_size;

/// Lend block devices, NICs and PCIe functions across machines to VMs.
#[derive(Debug, Parser)]
#[command(name = "devlend", version)]
struct Cli {
    /// Control API socket of the local compute agent.
    #[arg(long, global = true, default_value = DEFAULT_API_SOCKET)]
    api: PathBuf,
    #[command(subcommand)]
    command: Cmd,
}

// Parsed once per run: the size of its largest variant (`attach`) costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Cmd {
    /// Attach a device lent by a device agent on a new socket (vhost-user-blk, or
    /// vhost-user-net for a NIC, or vfio-user with --kind pci): one named with --lender
    /// and --device (direct mode), or one the pool places and leases (--class,
    /// --min-capacity, --trait, --vm).
    Attach {
        /// Lender address, HOST:PORT (direct mode), or CLUSTER/LENDER: a lender named in
        /// a cluster's gateway, reached through the compute agent's gateway.
        #[arg(long, required_unless_present_any = ["class", "device"], requires = "device")]
        lender: Option<String>,
        /// Device name on the lender (direct mode), or a whole device address
        /// CLUSTER/LENDER/DEVICE without --lender.
        #[arg(long, conflicts_with = "class")]
        device: Option<String>,
        /// Lease a device of this resource class from the pool (e.g. BLOCK).
        #[arg(long, conflicts_with = "lender", requires = "vm")]
        class: Option<String>,
        /// With --class: the smallest capacity accepted (e.g. 10G).
        #[arg(long, value_parser = parse_size, default_value = "0", requires = "class")]
        min_capacity: u64,
        /// With --class: a trait the device must have (repeatable), e.g. FABRIC_TCP.
        #[arg(long = "trait", value_name = "TRAIT", requires = "class")]
        traits: Vec<String>,
        /// With --class: prefer devices on this NUMA node (trait NUMA_<n>).
        #[arg(long, requires = "class")]
        numa_node: Option<u32>,
        /// With --class: the VM the lease is for (the lease's consumer).
        #[arg(long, value_name = "NAME")]
        vm: Option<String>,
        /// With --class: lease time to live in seconds; the compute agent renews it every
        /// third while attached.
        #[arg(long, default_value_t = 30, requires = "class")]
        lease_ttl: u64,
        /// With --class: limits on the lease, enforced by the lender.
        #[command(flatten)]
        limits: devlend_cli::qos_args::QosArgs,
        /// Device pool URL.
        #[arg(long, env = "DEVLEND_POOL", default_value = "http://127.0.0.1:7400")]
        pool: String,
        /// With --class: the key the lease request is signed with (this compute host's
        /// enrolled key) [default: the compute agent's,
        /// /var/lib/devlend/compute-agent/identity.key, if it exists].
        #[arg(long = "pool-key", env = "DEVLEND_POOL_KEY", value_name = "FILE")]
        pool_key: Option<PathBuf>,
        /// With --class: CA certificates (PEM) the certificate of an https:// pool must
        /// chain to [default: the system's trust store].
        #[arg(long = "pool-ca", env = "DEVLEND_POOL_CA", value_name = "FILE")]
        pool_ca: Option<PathBuf>,
        /// vhost-user socket to create (a relative path is taken from the current
        /// directory).
        #[arg(long)]
        socket: PathBuf,
        /// Number of virtqueues (1..=16).
        #[arg(long, default_value_t = 1)]
        queues: u16,
        /// Virtqueue size to give the VMM (a power of two, 64..=1024).
        #[arg(long, default_value_t = 256)]
        queue_size: u16,
        /// Busy-poll budget in microseconds of each queue's worker before it sleeps
        /// (0: interrupt-driven). Lower latency for more CPU.
        #[arg(long, default_value_t = 0)]
        poll_us: u32,
        /// Seconds requests wait for a lost fabric session (the lender restarting, the
        /// network dropping it) before they fail with IOERR; meanwhile they are resent.
        #[arg(
            long = "reconnect-deadline",
            default_value_t = 30,
            value_name = "SECONDS"
        )]
        reconnect_deadline_s: u32,
        /// Open the fabric sessions inside TLS 1.3, verifying the lender's certificate
        /// against the compute agent's --tls-ca. Recommended when traffic leaves a rack.
        #[arg(long)]
        tls: bool,
        /// With --tls: the name the lender's certificate must carry [default: the host
        /// part of the lender address].
        #[arg(long, value_name = "NAME", requires = "tls")]
        tls_server_name: Option<String>,
        /// The lender's public key (as it logs it at start): each session must prove it,
        /// or it is refused (direct mode; with --class the lease names the key).
        // A key is unpadded base64url: it may start with `-`.
        #[arg(long, value_name = "KEY", allow_hyphen_values = true)]
        lender_key: Option<String>,
        /// Fabric transport of the queues' sessions: tcp (default) or rdma (rdma_cm, one
        /// RC queue pair per queue, or for --kind pci the function's one session with
        /// the DMA mirror moved by RDMA READ/WRITE; the lender must run with
        /// --transport rdma).
        #[arg(long, default_value = "tcp", value_name = "tcp|rdma", value_parser = parse_transport)]
        transport: Transport,
        /// With --transport rdma, what of the guest's memory the lender can reach:
        /// request (each request's buffers, for that request alone) or guest-memory
        /// (all of the guest's RAM while a session is open; fewer verbs calls per
        /// request, for a lender trusted as much as this host). docs/rdma.md.
        #[arg(
            long,
            default_value = "request",
            value_name = "request|guest-memory",
            value_parser = parse_rdma_exposure
        )]
        rdma_exposure: RdmaExposure,
        /// Attachment id, also the device id in the VMM (default: the device name).
        #[arg(long)]
        id: Option<String>,
        /// What the lender lends: `device` (a block device or a NIC, served on
        /// vhost-user) or `pci` (a PCIe function, served on vfio-user).
        #[arg(long, value_enum, default_value = "device", value_name = "device|pci")]
        kind: CliKind,
        /// Hotplug into the running QEMU behind this QMP socket.
        #[arg(long, conflicts_with = "ch_api")]
        qmp: Option<PathBuf>,
        /// Hot-add into the running Cloud Hypervisor behind this API socket.
        #[arg(long)]
        ch_api: Option<PathBuf>,
        /// Which VMM's arguments to print.
        #[arg(long, value_enum, default_value_t = Vmm::Qemu)]
        vmm: Vmm,
        /// The `<target dev=...>` of the printed libvirt `<disk>`: a name not yet used by
        /// the domain's disks (`vd` and letters). The guest does not see it; it finds the
        /// disk by its serial (docs/libvirt.md).
        #[arg(long, default_value = "vdb", value_parser = libvirt_target_dev)]
        libvirt_dev: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Detach: complete the requests in flight, then remove the socket.
    Detach {
        /// Attachment id or socket path.
        target: String,
        /// Seconds the guest gets to release a live-plugged device.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List attachments: size, queues, recent IOPS, MB/s and p99 latency, errors, state.
    Status {
        /// Refresh every SECS seconds until interrupted.
        #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
        watch: Option<u64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Make a key pair for direct-mode authentication: the private key goes to FILE
    /// (mode 0600) for the compute agent's --auth-key-file; the public key is printed,
    /// for the lenders' --auth-key.
    Keygen {
        /// File to write the private key to; refuses to overwrite one.
        #[arg(long)]
        out: PathBuf,
    },
    /// Write man pages for devlend, devlend-device-agent, devlend-compute-agent and
    /// devlend-gateway.
    Man {
        /// Directory to write `devlend.1`, `devlend-device-agent.8`, ... into.
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
    /// Print a shell completion script for devlend.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Lend a sparse disk image on this machine to a QEMU guest, live, and write and
    /// verify it end to end.
    Demo {
        /// Disk size (bytes, or with a K, M, G or T suffix; a multiple of 1 MiB).
        #[arg(long, default_value = "128M", value_parser = parse_size)]
        size: u64,
        /// Who drives the disk: a QEMU guest (`vm`) or the libblkio frontend (`blkio`).
        #[arg(long, value_enum, default_value_t = Frontend::Vm)]
        frontend: Frontend,
        /// Work directory (default: a temporary directory, removed afterwards).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Live-migrate a VM's lent disks and NICs with it (docs/migration.md): a handover
    /// token on the source, an incoming attachment on the destination, then finish or
    /// cancel on the source.
    Migrate {
        #[command(subcommand)]
        cmd: devlend_cli::migrate_cmd::MigrateCmd,
    },
    /// A cluster gateway (devlend-gateway): its peers, sessions, bytes and RTTs.
    Gateway {
        #[command(subcommand)]
        cmd: devlend_cli::gateway_cmd::GatewayCmd,
    },
    /// The device pool: run it, list its devices, leases and providers, enroll keys.
    Pool {
        #[command(subcommand)]
        cmd: Box<devlend_cli::pool_cmd::PoolCmd>,
    },
    /// Verified I/O through a vhost-user-blk socket, for tests: random writes on every
    /// queue read back and compared, flush, discard, write-zeroes; writes what the
    /// device's first SPAN bytes must hold to --out.
    #[command(hide = true)]
    Verify {
        #[arg(long)]
        socket: PathBuf,
        #[arg(long, default_value_t = 2)]
        queues: usize,
        #[arg(long, default_value = "4M", value_parser = parse_size)]
        span: u64,
        #[arg(long, default_value_t = 4)]
        rounds: usize,
        /// Go on with more rounds until this many seconds have passed (at least
        /// --rounds are run): for tests that inject a fault during the workload.
        #[arg(long, default_value_t = 0)]
        min_seconds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Map the buffer as two memory regions back to back and run a write and a read
        /// whose buffer crosses them.
        #[arg(long)]
        split_regions: bool,
        #[arg(long)]
        out: PathBuf,
    },
    /// A matrix of deep closed-loop workloads through a vhost-user-blk socket, for
    /// tests: every cell must keep completing (no queue without a completion for
    /// --stall-ms), with no failed request, and verify after it.
    #[command(hide = true)]
    Stress {
        #[arg(long)]
        socket: PathBuf,
        #[arg(long, value_delimiter = ',', default_value = "1,2")]
        queues: Vec<usize>,
        #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M", value_parser = parse_size)]
        sizes: Vec<u64>,
        #[arg(long, value_delimiter = ',', default_value = "read,write,mixed")]
        mixes: Vec<devlend_cli::stress::Mix>,
        #[arg(long, value_delimiter = ',', default_value = "32,128,256")]
        depths: Vec<usize>,
        #[arg(long, default_value_t = 1024)]
        queue_size: usize,
        /// How long each cell runs, in ms.
        #[arg(long, default_value_t = 1000)]
        cell_ms: u64,
        /// Longest a queue may go without a completion, in ms.
        #[arg(long, default_value_t = 5000)]
        stall_ms: u64,
    },
    /// Measure block performance through a vhost-user-blk socket (libblkio frontend):
    /// IOPS, MB/s, completion latency, and the CPU time and peak RSS of the servers.
    /// With --peers, run devlend, qemu-storage-daemon locally and a qemu-storage-daemon
    /// NBD chain through a matrix of workloads and print the ratios.
    Bench {
        /// vhost-user-blk socket to bench (without --peers).
        #[arg(long, required_unless_present = "peers", conflicts_with = "peers")]
        socket: Option<PathBuf>,
        /// A server process to measure (repeatable; without --peers).
        #[arg(long = "pid", conflicts_with = "peers")]
        pids: Vec<u32>,
        /// Access pattern.
        #[arg(long, value_enum, default_value_t = Rw::Randread)]
        rw: Rw,
        /// Request size (bytes, or with K, M suffix; a multiple of 512).
        #[arg(long, default_value = "4K", value_parser = parse_size)]
        bs: u64,
        /// Requests in flight per queue.
        #[arg(long, default_value_t = 32)]
        iodepth: usize,
        /// Queues, one thread each.
        #[arg(long, default_value_t = 1)]
        queues: usize,
        /// Seconds measured (per run; per cell and server with --peers).
        #[arg(long, default_value = "5", value_parser = parse_secs)]
        runtime: Duration,
        /// Seconds of warm-up before each measured window.
        #[arg(long, default_value = "1", value_parser = parse_secs)]
        ramp: Duration,
        /// Start devlend and both qemu-storage-daemon peers and run the matrix on each.
        #[arg(long)]
        peers: bool,
        /// Cells of the --peers matrix.
        #[arg(long, value_enum, default_value_t = Matrix::Full, requires = "peers")]
        matrix: Matrix,
        /// Size of the backing file in /dev/shm for --peers (written fully first).
        #[arg(long, default_value = "1G", value_parser = parse_size, requires = "peers")]
        size: u64,
        /// Work directory for --peers (default: a temporary one in /dev/shm).
        #[arg(long, requires = "peers")]
        dir: Option<PathBuf>,
        /// devlend's busy-poll budget in microseconds for --peers (0: interrupt-driven).
        #[arg(long, default_value_t = 0, requires = "peers")]
        poll_us: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// A VMM whose command-line arguments `attach` prints.
/// `devlend attach --transport` (`tcp`, `rdma`).
fn parse_transport(s: &str) -> Result<Transport, String> {
    s.parse()
}

/// `devlend attach --rdma-exposure` (`request`, `guest-memory`).
fn parse_rdma_exposure(s: &str) -> Result<RdmaExposure, String> {
    s.parse()
}

/// `devlend attach --kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CliKind {
    /// A block device or a NIC (vhost-user).
    Device,
    /// A PCIe function (vfio-user).
    Pci,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Vmm {
    /// QEMU (`-chardev` + `-device vhost-user-blk-pci`) and libvirt.
    Qemu,
    /// Cloud Hypervisor (`--disk vhost_user=true,...`).
    CloudHypervisor,
}

fn absolute(p: PathBuf) -> Result<PathBuf> {
    // Lexically absolute, with `.` components removed, so that `./x.sock` and `x.sock`
    // name the same attachment.
    Ok(std::path::absolute(&p)?)
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn main() -> std::process::ExitCode {
    // Die quietly on a closed pipe (`devlend status | head`), as command-line tools do.
    // SAFETY: setting a signal disposition to the default before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devlend: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Cmd::Attach {
            lender,
            device,
            class,
            min_capacity,
            traits,
            numa_node,
            vm,
            lease_ttl,
            limits,
            pool,
            pool_key,
            pool_ca,
            socket,
            queues,
            queue_size,
            poll_us,
            reconnect_deadline_s,
            tls,
            tls_server_name,
            lender_key,
            transport,
            rdma_exposure,
            id,
            kind,
            qmp,
            ch_api,
            vmm,
            libvirt_dev,
            json,
        } => {
            let socket = if socket.is_absolute() {
                socket
            } else {
                std::env::current_dir()?.join(socket)
            };
            if class.is_none() && limits.to_qos()?.is_some() {
                bail!(
                    "--max-iops, --max-bps, --weight and --qos are a lease's limits: they need --class (a pool lease); in direct mode the lender sets limits on its device (docs/qos.md)"
                );
            }
            // Checked before a lease is taken.
            if !rdma_exposure.is_request() && transport != Transport::Rdma {
                bail!("--rdma-exposure guest-memory applies to --transport rdma only");
            }
            let api = ApiClient::new(&cli.api)?;
            let (lender, device, claimed) = match (lender, device, class) {
                (Some(l), Some(d), _) => (l, d, None),
                (None, Some(d), None) if d.contains('/') => (String::new(), d, None),
                (None, Some(_), None) => {
                    bail!(
                        "--device without --lender must be a device address CLUSTER/LENDER/DEVICE"
                    )
                }
                (_, _, Some(class)) => {
                    if !(1..=86_400).contains(&lease_ttl) {
                        bail!("--lease-ttl {lease_ttl} must be 1..=86400 seconds");
                    }
                    if !(1..=16).contains(&queues) || reconnect_deadline_s > 3600 {
                        bail!("--queues must be 1..=16 and --reconnect-deadline at most 3600 s");
                    }
                    let key = devlend_cli::pool_auth::PoolKey {
                        file: pool_key,
                        ca: pool_ca,
                    };
                    let client = key.client(
                        &pool,
                        std::path::Path::new(devlend_cli::pool_auth::COMPUTE_KEY_FILE),
                    )?;
                    let c = placement::claim(
                        client,
                        &placement::Wanted {
                            class,
                            min_capacity_bytes: min_capacity,
                            traits,
                            numa_node,
                            vm: vm.unwrap_or_default(),
                            ttl_ms: lease_ttl.saturating_mul(1000),
                            qos: limits.to_qos()?,
                        },
                    )?;
                    if !json {
                        println!(
                            "leased {} on {} ({}), lease {}",
                            c.grant.lease.device,
                            c.grant.lease.provider,
                            c.grant.lease.fabric_address,
                            c.grant.lease.id
                        );
                    }
                    (
                        c.grant.lease.fabric_address.clone(),
                        c.grant.lease.device.clone(),
                        Some(c),
                    )
                }
                _ => bail!("give --lender and --device, or --class and --vm"),
            };
            let lease = claimed.as_ref().map(|c| c.lease.clone());
            let attached = api.attach(&AttachRequest {
                id,
                lender,
                device,
                socket,
                queues,
                queue_size,
                poll_us,
                reconnect_deadline_s,
                vmm: match (qmp, ch_api) {
                    (Some(qmp), _) => Some(VmmTarget::Qemu {
                        qmp: absolute(qmp)?,
                    }),
                    (None, Some(api)) => Some(VmmTarget::CloudHypervisor {
                        api: absolute(api)?,
                    }),
                    (None, None) => None,
                },
                lease,
                lender_key,
                tls,
                tls_server_name,
                transport,
                rdma_exposure,
                kind: match kind {
                    CliKind::Device => devlend_compute_agent::api::AttachKind::Device,
                    CliKind::Pci => devlend_compute_agent::api::AttachKind::Pci,
                },
                handover_token: None,
            });
            let a = match attached {
                Ok(a) => a,
                Err(e) => {
                    if let Some(c) = claimed {
                        c.release();
                    }
                    return Err(e);
                }
            };
            if json {
                return print_json(&a);
            }
            match &a.part {
                KindInfo::Pci(p) => {
                    println!(
                        "attached PCIe function {} ({}) as {}",
                        a.device,
                        if p.bdf.is_empty() {
                            "-"
                        } else {
                            p.bdf.as_str()
                        },
                        a.id
                    );
                    println!("vfio-user socket: {}\n", a.socket.display());
                    println!("{}", devlend_cli::output::vfio_user_args(&a));
                    return Ok(());
                }
                KindInfo::Nic(n) => {
                    println!(
                        "attached NIC {} as {}: MAC {}, MTU {}, {} queue pair(s), {}",
                        a.device,
                        a.id,
                        n.mac,
                        n.mtu,
                        n.queue_pairs,
                        nic_link_words(n, a.connected)
                    );
                }
                KindInfo::Block(b) => {
                    println!(
                        "attached {} as {}: {} ({} sectors of 512 bytes), serial {:?}{}",
                        a.device,
                        a.id,
                        human_bytes(b.capacity_sectors * 512),
                        b.capacity_sectors,
                        b.serial,
                        if b.read_only { ", read-only" } else { "" }
                    );
                }
            }
            println!("vhost-user socket: {}", a.socket.display());
            if let Some(p) = &a.vmm {
                println!(
                    "plugged into the running VM as device {:?} at {}",
                    p.device_id, p.location
                );
                return Ok(());
            }
            println!();
            match (vmm, &a.part) {
                (Vmm::Qemu, _) => {
                    println!("QEMU:\n  {}\n", qemu_args(&a));
                    println!("libvirt:\n{}", libvirt_xml(&a, &libvirt_dev));
                }
                (Vmm::CloudHypervisor, KindInfo::Nic(n)) => {
                    println!(
                        "Cloud Hypervisor:\n  --memory size=<guest RAM>,shared=on --net vhost_user=true,socket={},num_queues={},queue_size={},mac={}",
                        a.socket.display(),
                        2 * u32::from(n.queue_pairs),
                        n.queue_size,
                        n.mac
                    );
                }
                (Vmm::CloudHypervisor, KindInfo::Block(b)) => {
                    let arg = cloud_hypervisor::cli_arg(
                        &a.socket,
                        &a.id,
                        b.queues,
                        b.queue_size,
                        b.read_only,
                    );
                    println!("Cloud Hypervisor:\n  --memory size=<guest RAM>,shared=on {arg}");
                }
                // Printed above, with the vfio-user arguments.
                (Vmm::CloudHypervisor, KindInfo::Pci(_)) => {}
            }
        }
        Cmd::Detach {
            target,
            timeout,
            json,
        } => {
            // A path (it has a slash, or names an existing file) is a socket path.
            let target = if target.contains('/') || std::path::Path::new(&target).exists() {
                absolute(PathBuf::from(&target))?.display().to_string()
            } else {
                target
            };
            let a = ApiClient::new(&cli.api)?.detach(&target, timeout)?;
            if json {
                return print_json(&a);
            }
            println!(
                "detached {} ({}); socket {} removed",
                a.id,
                final_counters(&a),
                a.socket.display()
            );
            if let Some(lease) = a.lease {
                println!("lease {lease} released");
            }
        }
        Cmd::Keygen { out } => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let signer = devlend_fabric::lease_token::TokenSigner::generate()?;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&out)
                .with_context(|| format!("cannot create {}", out.display()))?;
            writeln!(f, "{}", signer.seed_text())?;
            println!("{}", signer.public_key().to_text());
        }
        Cmd::Man { out } => {
            use clap::CommandFactory;
            std::fs::create_dir_all(&out)?;
            let pages = [
                (Cli::command(), "1"),
                (devlend_device_agent::Cli::command(), "8"),
                (devlend_compute_agent::config::Cli::command(), "8"),
                (devlend_gateway::config::Cli::command(), "8"),
            ];
            let top = Cli::command();
            let subpages: Vec<(clap::Command, &str)> = top
                .get_subcommands()
                .filter(|c| c.get_name() != "help")
                .map(|c| {
                    // clap names are 'static; this one-shot command leaks a few bytes.
                    let name: &'static str =
                        Box::leak(format!("devlend-{}", c.get_name()).into_boxed_str());
                    (c.clone().name(name), "1")
                })
                .collect();
            for (cmd, section) in pages.into_iter().chain(subpages) {
                let cmd = cmd.version(env!("CARGO_PKG_VERSION"));
                let path = out.join(format!("{}.{section}", cmd.get_name()));
                let mut buf = Vec::new();
                clap_mangen::Man::new(cmd)
                    .section(section)
                    .render(&mut buf)?;
                std::fs::write(&path, buf)?;
                println!("{}", path.display());
            }
        }
        Cmd::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "devlend",
                &mut std::io::stdout(),
            );
        }
        Cmd::Status { watch, json } => {
            let client = ApiClient::new(&cli.api)?;
            loop {
                let list = client.list()?;
                if json {
                    print_json(&list)?;
                } else {
                    if watch.is_some() {
                        // Clear the screen and go home, as watch(1) does.
                        print!("\x1b[2J\x1b[H");
                    }
                    print!("{}", status_table(&list));
                }
                match watch {
                    Some(secs) => std::thread::sleep(std::time::Duration::from_secs(secs.max(1))),
                    None => break,
                }
            }
        }
        Cmd::Verify {
            socket,
            queues,
            span,
            rounds,
            min_seconds,
            seed,
            split_regions,
            out,
        } => {
            let n = devlend_cli::verify::run(
                &socket,
                queues,
                span,
                devlend_cli::verify::Rounds {
                    at_least: rounds,
                    min_duration: std::time::Duration::from_secs(min_seconds),
                },
                seed,
                split_regions,
                &out,
            )?;
            println!("verified {n} requests on {queues} queues");
        }
        Cmd::Stress {
            socket,
            queues,
            sizes,
            mixes,
            depths,
            queue_size,
            cell_ms,
            stall_ms,
        } => {
            let m = devlend_cli::stress::Matrix {
                queues,
                sizes: sizes.into_iter().map(|s| s as usize).collect(),
                mixes,
                depths,
                queue_size,
                cell: std::time::Duration::from_millis(cell_ms),
                stall: std::time::Duration::from_millis(stall_ms),
            };
            let mut cells = 0;
            devlend_cli::stress::run(&socket, &m, |c| {
                cells += 1;
                println!("{c}");
            })?;
            println!("stress: {cells} cells passed");
        }
        Cmd::Bench {
            socket,
            pids,
            rw,
            bs,
            iodepth,
            queues,
            runtime,
            ramp,
            peers,
            matrix,
            size,
            dir,
            poll_us,
            json,
        } => {
            let opts = BenchOptions {
                workload: Workload {
                    rw,
                    bs: usize::try_from(bs)?,
                    iodepth,
                    queues,
                    runtime,
                    ramp,
                },
                socket,
                pids,
                peers: peers.then_some(PeersOptions {
                    matrix,
                    size,
                    dir,
                    poll_us,
                }),
                progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
            };
            let command = std::env::args().collect::<Vec<_>>().join(" ");
            let out = devlend_cli::bench::run(&opts, command)?;
            if json {
                print_json(&out)?;
            } else {
                print!("{}", out.table());
            }
            // A measurement with failed requests is not one: say so in the exit status.
            if out.errors() > 0 {
                bail!(
                    "{} requests completed with an error: the figures above are not valid",
                    out.errors()
                );
            }
        }
        Cmd::Pool { cmd } => devlend_cli::pool_cmd::run(*cmd)?,
        Cmd::Gateway { cmd } => devlend_cli::gateway_cmd::run(cmd)?,
        Cmd::Migrate { cmd } => devlend_cli::migrate_cmd::run(&cli.api, cmd)?,
        Cmd::Demo {
            size,
            dir,
            frontend,
            json,
        } => {
            let s = demo::run(&DemoOptions {
                size,
                dir,
                progress: !json,
                frontend,
            })?;
            if json {
                return print_json(&s);
            }
            if s.checksum_frontend != s.checksum_lender {
                bail!("checksums differ");
            }
            let who = match frontend {
                Frontend::Vm => "a QEMU guest's virtio-blk driver (attached and detached live)",
                Frontend::Blkio => "the libblkio vhost-user-blk frontend",
            };
            println!("\ndevlend demo: OK in {:.1} s", s.seconds);
            println!(
                "  lent:      {} sparse image over TCP loopback, to {who}",
                human_bytes(s.size)
            );
            let phases: Vec<String> = s
                .phases
                .iter()
                .map(|(n, t)| format!("{n} {t:.1} s"))
                .collect();
            println!("  phases:    {}", phases.join(", "));
            println!(
                "  checksum:  {} (sha256, written and verified by the frontend)",
                s.checksum_frontend
            );
            println!(
                "  lender:    {} (its file after detach: match)",
                s.checksum_lender
            );
            let c = s
                .attachment
                .block()
                .map(|b| b.counters.clone())
                .unwrap_or_default();
            println!(
                "  counters:  {} reads, {} writes, {} flushes, {} errors, {} read, {} written",
                c.reads,
                c.writes,
                c.flushes,
                c.errors,
                human_bytes(c.bytes_read),
                human_bytes(c.bytes_written)
            );
        }
    }
    Ok(())
}

/// What `detach` prints of an attachment's final counters, in its kind's terms.
fn final_counters(a: &devlend_compute_agent::api::AttachmentInfo) -> String {
    match &a.part {
        KindInfo::Block(b) => format!(
            "{} reads, {} writes, {} errors",
            b.counters.reads, b.counters.writes, b.counters.errors
        ),
        KindInfo::Nic(n) => format!(
            "{} frames received, {} sent, {} errors",
            n.counters.rx_packets, n.counters.tx_packets, n.counters.errors
        ),
        KindInfo::Pci(p) => format!(
            "{} region reads, {} region writes, {} interrupts",
            p.counters.region_reads, p.counters.region_writes, p.counters.irqs
        ),
    }
}
