//! `devlend`: attach lent devices, detach them, show status, run the local demo.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use devlend_cli::api_client::ApiClient;
use devlend_cli::demo::{self, DemoOptions, Frontend};
use devlend_cli::output::{human_bytes, libvirt_xml, qemu_args, status_table};
use devlend_compute_agent::api::{AttachRequest, VmmTarget};
use devlend_compute_agent::vmm::cloud_hypervisor;
use devlend_compute_agent::DEFAULT_API_SOCKET;

/// Lend block devices across machines to VMs.
#[derive(Debug, Parser)]
#[command(name = "devlend", version)]
struct Cli {
    /// Control API socket of the local compute agent.
    #[arg(long, global = true, default_value = DEFAULT_API_SOCKET)]
    api: PathBuf,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Attach a device lent by a device agent on a new vhost-user-blk socket.
    Attach {
        /// Lender address, HOST:PORT.
        #[arg(long)]
        lender: String,
        /// Device name on the lender.
        #[arg(long)]
        device: String,
        /// vhost-user socket to create (an absolute path).
        #[arg(long)]
        socket: PathBuf,
        /// Number of virtqueues (1..=16).
        #[arg(long, default_value_t = 1)]
        queues: u16,
        /// Virtqueue size to give the VMM (a power of two, 64..=1024).
        #[arg(long, default_value_t = 256)]
        queue_size: u16,
        /// Attachment id, also the device id in the VMM (default: the device name).
        #[arg(long)]
        id: Option<String>,
        /// Hotplug into the running QEMU behind this QMP socket.
        #[arg(long, conflicts_with = "ch_api")]
        qmp: Option<PathBuf>,
        /// Hot-add into the running Cloud Hypervisor behind this API socket.
        #[arg(long)]
        ch_api: Option<PathBuf>,
        /// Which VMM's arguments to print.
        #[arg(long, value_enum, default_value_t = Vmm::Qemu)]
        vmm: Vmm,
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
    /// List attachments with their I/O counters.
    Status {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Lend a sparse disk image on this machine to a QEMU guest, live, and write and
    /// verify it end to end.
    Demo {
        /// Disk size (bytes, or with K, M, G suffix; a multiple of 1 MiB).
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
}

/// A VMM whose command-line arguments `attach` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Vmm {
    /// QEMU (`-chardev` + `-device vhost-user-blk-pci`) and libvirt.
    Qemu,
    /// Cloud Hypervisor (`--disk vhost_user=true,...`).
    CloudHypervisor,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("unknown size suffix {c:?} (use K, M, G or T)")),
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    let n: u64 = num.parse().map_err(|_| format!("invalid size {s:?}"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

fn absolute(p: PathBuf) -> Result<PathBuf> {
    Ok(if p.is_absolute() {
        p
    } else {
        std::env::current_dir()?.join(p)
    })
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn main() -> std::process::ExitCode {
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
            socket,
            queues,
            queue_size,
            id,
            qmp,
            ch_api,
            vmm,
            json,
        } => {
            let socket = if socket.is_absolute() {
                socket
            } else {
                std::env::current_dir()?.join(socket)
            };
            let a = ApiClient::new(&cli.api)?.attach(&AttachRequest {
                id,
                lender,
                device,
                socket,
                queues,
                queue_size,
                vmm: match (qmp, ch_api) {
                    (Some(qmp), _) => Some(VmmTarget::Qemu {
                        qmp: absolute(qmp)?,
                    }),
                    (None, Some(api)) => Some(VmmTarget::CloudHypervisor {
                        api: absolute(api)?,
                    }),
                    (None, None) => None,
                },
            })?;
            if json {
                return print_json(&a);
            }
            println!(
                "attached {} as {}: {} ({} sectors of 512 bytes), serial {:?}{}",
                a.device,
                a.id,
                human_bytes(a.capacity_sectors * 512),
                a.capacity_sectors,
                a.serial,
                if a.read_only { ", read-only" } else { "" }
            );
            println!("vhost-user socket: {}", a.socket.display());
            if let Some(p) = &a.vmm {
                println!(
                    "plugged into the running VM as device {:?} at {}",
                    p.device_id, p.location
                );
                return Ok(());
            }
            println!();
            match vmm {
                Vmm::Qemu => {
                    println!("QEMU:\n  {}\n", qemu_args(&a));
                    println!("libvirt:\n{}", libvirt_xml(&a));
                }
                Vmm::CloudHypervisor => {
                    let arg = cloud_hypervisor::cli_arg(
                        &a.socket,
                        &a.id,
                        a.queues,
                        a.queue_size,
                        a.read_only,
                    );
                    println!("Cloud Hypervisor:\n  --memory size=<guest RAM>,shared=on {arg}");
                }
            }
        }
        Cmd::Detach {
            target,
            timeout,
            json,
        } => {
            let a = ApiClient::new(&cli.api)?.detach(&target, timeout)?;
            if json {
                return print_json(&a);
            }
            println!(
                "detached {} ({} reads, {} writes, {} errors); socket {} removed",
                a.id,
                a.counters.reads,
                a.counters.writes,
                a.counters.errors,
                a.socket.display()
            );
        }
        Cmd::Status { json } => {
            let list = ApiClient::new(&cli.api)?.list()?;
            if json {
                return print_json(&list);
            }
            print!("{}", status_table(&list));
        }
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
            let c = &s.attachment.counters;
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
