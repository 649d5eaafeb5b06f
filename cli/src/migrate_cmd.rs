//! `devlend migrate`: the compute agents' side of a VM's live migration
//! (`docs/migration.md`).
//!
//! 1. On the source: `devlend migrate handover ID` prints a handover token; from then on
//!    the source agent lets the device go when QEMU stops it at the end of the
//!    migration.
//! 2. On the destination: `devlend migrate prepare --handover-token TOKEN --lender ...
//!    --device ... --socket ...` attaches, standing by for the device, and prints the
//!    QEMU arguments to start the destination with (`-incoming`).
//! 3. QEMU migrates (QMP `migrate` on the source).
//! 4. On the source: `devlend migrate finish ID` once QEMU says `completed`, or `devlend
//!    migrate cancel ID` if it failed or was cancelled (the source keeps its device; on
//!    the destination, `devlend detach ID`).

use std::path::{Path, PathBuf};

use anyhow::Result;
use devlend_compute_agent::api::{AttachRequest, AttachmentInfo, KindInfo};

use crate::api_client::ApiClient;

/// `devlend migrate` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum MigrateCmd {
    /// On the source host: issue the handover token of attachment ID for the destination.
    /// The device is let go when the VM stops at the end of the migration (or taken back
    /// if the VM resumes here).
    Handover {
        /// Attachment id.
        id: String,
        /// Under a pool lease: the destination compute host, as enrolled with the pool
        /// (the pool grants it a lease that takes the device over).
        #[arg(long, value_name = "HOST")]
        to: Option<String>,
        /// In direct mode: the destination compute agent's public key (its
        /// `--auth-key-file`'s, as `devlend keygen` printed it). The token names it as
        /// its holder, so only the destination can present it; without it, the token
        /// names this agent's own key (hosts that share one key file).
        #[arg(long, value_name = "KEY")]
        to_key: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// On the destination host: attach the device for the incoming VM with the source's
    /// handover token, and print the QEMU arguments of the destination.
    Prepare {
        /// The token `devlend migrate handover` printed on the source.
        #[arg(long, value_name = "TOKEN")]
        handover_token: String,
        /// Lender address, HOST:PORT (as on the source). Given again, more paths to the
        /// same lender, as the source's `--lender`s (the handover prints them all).
        #[arg(long, required = true)]
        lender: Vec<String>,
        /// Device name on the lender.
        #[arg(long)]
        device: String,
        /// vhost-user socket to create for the destination QEMU.
        #[arg(long)]
        socket: PathBuf,
        /// Attachment id (default: the device name).
        #[arg(long)]
        id: Option<String>,
        /// Number of virtqueues: as on the source.
        #[arg(long, default_value_t = 1)]
        queues: u16,
        /// Virtqueue size: as on the source.
        #[arg(long, default_value_t = 256)]
        queue_size: u16,
        /// Seconds requests wait for a lost fabric session before they fail with IOERR
        /// (as `devlend attach --reconnect-deadline`; give the source's).
        #[arg(
            long = "reconnect-deadline",
            default_value_t = 30,
            value_name = "SECONDS"
        )]
        reconnect_deadline_s: u32,
        /// The lender's public key (as it logs it at start), as on the source: every
        /// session must prove it. A token from a source attached with `--lender-key`
        /// (direct mode) or under a lease naming a key (pool mode) carries that key, and
        /// the destination checks it even without this option; given too, it must be
        /// the same. With neither, the destination does not check the lender's key.
        #[arg(long, value_name = "KEY", allow_hyphen_values = true)]
        lender_key: Option<String>,
        /// Where the destination QEMU listens for the migration stream, printed as its
        /// `-incoming` argument.
        #[arg(long, default_value = "tcp:0.0.0.0:4444", value_name = "URI")]
        incoming: String,
        /// The pool that granted the token (a pool-mode handover: the token is the
        /// destination's lease, which its compute agent binds and renews).
        #[arg(long, env = "DEVLEND_POOL", default_value = "http://127.0.0.1:7400")]
        pool: String,
        /// Print JSON (the attachment, with `qemu_args`).
        #[arg(long)]
        json: bool,
    },
    /// On the source host, after QEMU's migration completed: remove attachment ID
    /// without unplugging it from the VM (which runs on the destination now).
    Finish {
        /// Attachment id.
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// On the source host, after a failed or cancelled migration: attachment ID keeps its
    /// device (and takes it back if it let it go).
    Cancel {
        /// Attachment id.
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// The QEMU arguments of a migration's destination: the attachment's, then
/// `-incoming URI`.
pub fn incoming_args(a: &AttachmentInfo, incoming: &str) -> String {
    format!("{} \\\n  -incoming {incoming}", crate::output::qemu_args(a))
}

/// Runs a `devlend migrate` subcommand against the compute agent at `api`.
///
/// # Errors
/// The agent's refusal, or it cannot be reached.
pub fn run(api: &Path, cmd: MigrateCmd) -> Result<()> {
    let client = ApiClient::new(api)?;
    match cmd {
        MigrateCmd::Handover {
            id,
            to,
            to_key,
            json,
        } => {
            let h = client.handover(&id, to.as_deref(), to_key.as_deref())?;
            if json {
                return print_json(&h);
            }
            println!(
                "attachment {id} ({} on {}) will let the device go when its VM stops at the end of the migration",
                h.device, h.lender
            );
            let pool = h
                .pool
                .as_ref()
                .map(|p| format!(" --pool {p}"))
                .unwrap_or_default();
            // The attachment's queues, which the destination's must match (a listing
            // that fails leaves them out: the token is what matters).
            let queues = client
                .list()
                .ok()
                .and_then(|all| all.into_iter().find(|a| a.id == id))
                .map(|a| match a.part {
                    KindInfo::Block(b) => {
                        format!(" --queues {} --queue-size {}", b.queues, b.queue_size)
                    }
                    KindInfo::Nic(n) => {
                        format!(" --queues {} --queue-size {}", n.queue_pairs, n.queue_size)
                    }
                    KindInfo::Pci(_) => String::new(),
                })
                .unwrap_or_default();
            let lenders: String = std::iter::once(&h.lender)
                .chain(&h.paths)
                .map(|l| format!(" --lender {l}"))
                .collect();
            println!("on the destination (and --lender-key, --reconnect-deadline as on this host):\n  devlend migrate prepare --handover-token {}{lenders} --device {}{pool} --id {id}{queues} --socket <path>", h.handover_token, h.device);
        }
        MigrateCmd::Prepare {
            handover_token,
            lender,
            device,
            socket,
            id,
            queues,
            queue_size,
            reconnect_deadline_s,
            lender_key,
            incoming,
            pool,
            json,
        } => {
            let socket = std::path::absolute(&socket)?;
            // A pool's token is the destination's lease; the agent's own is a bare
            // handover token.
            let claims = devlend_fabric::lease_token::LeaseToken::from_text(handover_token.trim())
                .and_then(|t| t.claims_unverified())
                .map_err(|e| anyhow::anyhow!("--handover-token: {e}"))?;
            let (lease, handover_token) = if claims.provider.is_empty() {
                (None, Some(handover_token))
            } else {
                (
                    Some(devlend_compute_agent::api::LeaseRef {
                        pool,
                        id: uuid::Uuid::from_bytes(claims.lease_id),
                        token: handover_token,
                    }),
                    None,
                )
            };
            let mut lender = lender.into_iter();
            let a = client.attach(&AttachRequest {
                id,
                lender: lender.next().unwrap_or_default(),
                paths: lender.collect(),
                device,
                socket,
                queues,
                queue_size,
                poll_us: 0,
                reconnect_deadline_s,
                vmm: None,
                lease,
                lender_key,
                tls: false,
                tls_server_name: None,
                transport: Default::default(),
                rdma_exposure: Default::default(),
                kind: Default::default(),
                vm: None,
                handover_token,
            })?;
            let args = incoming_args(&a, &incoming);
            if json {
                let mut v = serde_json::to_value(&a)?;
                v["qemu_args"] = serde_json::Value::String(args);
                return print_json(&v);
            }
            println!(
                "attachment {} stands by for {} on {}; it takes the device when the source lets it go",
                a.id, a.device, a.lender
            );
            println!("start the destination QEMU with the source's arguments and:\n  {args}");
        }
        MigrateCmd::Finish { id, json } => {
            let a = client.finish_handover(&id)?;
            if json {
                return print_json(&a);
            }
            println!(
                "attachment {id} handed over and removed; socket {} removed",
                a.socket.display()
            );
        }
        MigrateCmd::Cancel { id, json } => {
            let a = client.cancel_handover(&id)?;
            if json {
                return print_json(&a);
            }
            println!("attachment {id} keeps its device");
        }
    }
    Ok(())
}
