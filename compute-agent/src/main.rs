//! `devlend-compute-agent`: the borrower daemon.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use devlend_compute_agent::{registry::Registry, server, DEFAULT_API_SOCKET};

/// Serves block devices lent by device agents to VMs as vhost-user-blk sockets.
#[derive(Debug, Parser)]
#[command(name = "devlend-compute-agent", version)]
struct Args {
    /// Path of the control API unix socket (used by `devlend`).
    #[arg(long, default_value = DEFAULT_API_SOCKET)]
    api: PathBuf,
    /// Log filter (error, warn, info, debug, trace, or a tracing filter); RUST_LOG wins.
    #[arg(long, default_value = "info")]
    log_level: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&args.log_level))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(server::serve(&args.api, Arc::new(Registry::default())))
}
