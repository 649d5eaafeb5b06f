//! `devlend`: attach lent devices, detach them, show status, run the local demo, bench.
//!
//! Its parts: [`args`] is the `clap` definition of the commands (their `--help` text),
//! [`attach`] runs `devlend attach`; `run` here dispatches every command.

mod args;
mod attach;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use devlend_cli::api_client::ApiClient;
use devlend_cli::bench::options::{BenchOptions, PeersOptions, Workload};
use devlend_cli::demo::{self, DemoOptions, Frontend};
use devlend_cli::output::{human_bytes, status_table};
use devlend_compute_agent::api::KindInfo;

use args::{Cli, Cmd};

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
        Cmd::Attach(args) => attach::run(&cli.api, args)?,
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
                c.ops.reads,
                c.ops.writes,
                c.ops.flushes,
                c.errors,
                human_bytes(c.ops.bytes_read),
                human_bytes(c.ops.bytes_written)
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
            b.counters.ops.reads, b.counters.ops.writes, b.counters.errors
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
