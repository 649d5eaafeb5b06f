//! The `devlend` command line as `clap` parses it: every command, whose doc comments
//! are the `--help` text and the man pages.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use devlend_cli::bench::options::{parse_secs, Matrix, Rw};
use devlend_cli::demo::Frontend;
use devlend_cli::output::libvirt_target_dev;
use devlend_compute_agent::api::{RdmaExposure, Transport};
use devlend_compute_agent::DEFAULT_API_SOCKET;
use devlend_fabric::units::parse_size;

/// Lend block devices, NICs and PCIe functions across machines to VMs.
#[derive(Debug, Parser)]
#[command(name = "devlend", version)]
pub(crate) struct Cli {
    /// Control API socket of the local compute agent.
    #[arg(long, global = true, default_value = DEFAULT_API_SOCKET)]
    pub(crate) api: PathBuf,
    #[command(subcommand)]
    pub(crate) command: Cmd,
}

// Parsed once per run: the size of its largest variant (`attach`) costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub(crate) enum Cmd {
    /// Attach a device lent by a device agent on a new socket (vhost-user-blk, or
    /// vhost-user-net for a NIC, or vfio-user with --kind pci): one named with --lender
    /// and --device (direct mode), or one the pool places and leases (--class,
    /// --min-capacity, --trait, --vm).
    Attach(AttachArgs),
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
        /// devlend's adaptive polling maximum in microseconds for --peers, on the
        /// lender (`--poll-us`) and the attachment (0: interrupt-driven; default: each
        /// agent's own, the lender 200 and the attachment 0).
        #[arg(long, requires = "peers")]
        poll_us: Option<u32>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

// `devlend attach`: its about and long help are the doc comment of `Cmd::Attach`.
#[derive(Debug, Args)]
pub(crate) struct AttachArgs {
    /// Lender address, HOST:PORT (direct mode), or CLUSTER/LENDER: a lender named in
    /// a cluster's gateway, reached through the compute agent's gateway. Given again
    /// (HOST:PORT each), more paths to the same lender, e.g. one per NIC: the queues
    /// spread over them and move to another when theirs fails (docs/faults.md, "Paths").
    #[arg(long, required_unless_present_any = ["class", "device"], requires = "device")]
    pub(crate) lender: Vec<String>,
    /// Device name on the lender (direct mode), or a whole device address
    /// CLUSTER/LENDER/DEVICE without --lender.
    #[arg(long, conflicts_with = "class")]
    pub(crate) device: Option<String>,
    /// Lease a device of this resource class from the pool (e.g. BLOCK).
    #[arg(long, conflicts_with = "lender", requires = "vm")]
    pub(crate) class: Option<String>,
    /// With --class: the smallest capacity accepted (e.g. 10G).
    #[arg(long, value_parser = parse_size, default_value = "0", requires = "class")]
    pub(crate) min_capacity: u64,
    /// With --class: a trait the device must have (repeatable), e.g. FABRIC_TCP.
    #[arg(long = "trait", value_name = "TRAIT", requires = "class")]
    pub(crate) traits: Vec<String>,
    /// With --class: prefer devices on this NUMA node (trait NUMA_<n>).
    #[arg(long, requires = "class")]
    pub(crate) numa_node: Option<u32>,
    /// With --kind pci: the VM the function is lent to (1..=64 of letters, digits, `.`,
    /// `_`, `-`). PCIe functions attached with the same --vm on this compute host are one
    /// VM's: the lender lets their DMA reach each other's BARs (peer-to-peer). With
    /// --class: the VM the lease is for (the lease's consumer).
    #[arg(long, value_name = "NAME")]
    pub(crate) vm: Option<String>,
    /// With --class: lease time to live in seconds; the compute agent renews it every
    /// third while attached.
    #[arg(long, default_value_t = 30, requires = "class")]
    pub(crate) lease_ttl: u64,
    /// With --class: limits on the lease, enforced by the lender.
    #[command(flatten)]
    pub(crate) limits: devlend_cli::qos_args::QosArgs,
    /// Device pool URL.
    #[arg(long, env = "DEVLEND_POOL", default_value = "http://127.0.0.1:7400")]
    pub(crate) pool: String,
    /// With --class: the key the lease request is signed with (this compute host's
    /// enrolled key) [default: the compute agent's,
    /// /var/lib/devlend/compute-agent/identity.key, if it exists].
    #[arg(long = "pool-key", env = "DEVLEND_POOL_KEY", value_name = "FILE")]
    pub(crate) pool_key: Option<PathBuf>,
    /// With --class: CA certificates (PEM) the certificate of an https:// pool must
    /// chain to [default: the system's trust store].
    #[arg(long = "pool-ca", env = "DEVLEND_POOL_CA", value_name = "FILE")]
    pub(crate) pool_ca: Option<PathBuf>,
    /// vhost-user socket to create (a relative path is taken from the current
    /// directory).
    #[arg(long)]
    pub(crate) socket: PathBuf,
    /// Number of virtqueues (1..=16).
    #[arg(long, default_value_t = 1)]
    pub(crate) queues: u16,
    /// Virtqueue size to give the VMM (a power of two, 64..=1024).
    #[arg(long, default_value_t = 256)]
    pub(crate) queue_size: u16,
    /// Most microseconds each queue's worker polls before it sleeps, an adaptive
    /// window grown while requests follow each other within it (0: interrupt-driven).
    /// Lower latency for more CPU.
    #[arg(long, default_value_t = 0)]
    pub(crate) poll_us: u32,
    /// Seconds requests wait for a lost fabric session (the lender restarting, the
    /// network dropping it) before they fail with IOERR; meanwhile they are resent.
    #[arg(
        long = "reconnect-deadline",
        default_value_t = 30,
        value_name = "SECONDS"
    )]
    pub(crate) reconnect_deadline_s: u32,
    /// Open the fabric sessions inside TLS 1.3, verifying the lender's certificate
    /// against the compute agent's --tls-ca. Recommended when traffic leaves a rack.
    #[arg(long)]
    pub(crate) tls: bool,
    /// With --tls: the name the lender's certificate must carry [default: the host
    /// part of the lender address].
    #[arg(long, value_name = "NAME", requires = "tls")]
    pub(crate) tls_server_name: Option<String>,
    /// The lender's public key (as it logs it at start): each session must prove it,
    /// or it is refused (direct mode; with --class the lease names the key).
    // A key is unpadded base64url: it may start with `-`.
    #[arg(long, value_name = "KEY", allow_hyphen_values = true)]
    pub(crate) lender_key: Option<String>,
    /// Fabric transport of the queues' sessions: tcp (default) or rdma (rdma_cm, one
    /// RC queue pair per queue, or for --kind pci the function's one session with
    /// the DMA mirror moved by RDMA READ/WRITE; the lender must run with
    /// --transport rdma).
    #[arg(long, default_value = "tcp", value_name = "tcp|rdma", value_parser = parse_transport)]
    pub(crate) transport: Transport,
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
    pub(crate) rdma_exposure: RdmaExposure,
    /// Attachment id, also the device id in the VMM (default: the device name).
    #[arg(long)]
    pub(crate) id: Option<String>,
    /// What the lender lends: `device` (a block device or a NIC, served on
    /// vhost-user) or `pci` (a PCIe function, served on vfio-user).
    #[arg(long, value_enum, default_value = "device", value_name = "device|pci")]
    pub(crate) kind: CliKind,
    /// Hotplug into the running QEMU behind this QMP socket.
    #[arg(long, conflicts_with = "ch_api")]
    pub(crate) qmp: Option<PathBuf>,
    /// Hot-add into the running Cloud Hypervisor behind this API socket.
    #[arg(long)]
    pub(crate) ch_api: Option<PathBuf>,
    /// Which VMM's arguments to print.
    #[arg(long, value_enum, default_value_t = Vmm::Qemu)]
    pub(crate) vmm: Vmm,
    /// The `<target dev=...>` of the printed libvirt `<disk>`: a name not yet used by
    /// the domain's disks (`vd` and letters). The guest does not see it; it finds the
    /// disk by its serial (docs/libvirt.md).
    #[arg(long, default_value = "vdb", value_parser = libvirt_target_dev)]
    pub(crate) libvirt_dev: String,
    /// Print JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

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
pub(crate) enum CliKind {
    /// A block device or a NIC (vhost-user).
    Device,
    /// A PCIe function (vfio-user).
    Pci,
}

/// A VMM whose command-line arguments `attach` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Vmm {
    /// QEMU (`-chardev` + `-device vhost-user-blk-pci`) and libvirt.
    Qemu,
    /// Cloud Hypervisor (`--disk vhost_user=true,...`).
    CloudHypervisor,
}
