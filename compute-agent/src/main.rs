//! `devlend-compute-agent`: the borrower daemon.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use devlend_compute_agent::config::{Cli, Config};
use devlend_compute_agent::metrics::AttachmentMetrics;
use devlend_compute_agent::registry::Registry;
use devlend_compute_agent::server::{self, Reload};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (config, log) = match devlend_daemon::startup(
        "devlend-compute-agent",
        Config::load(&cli),
        cli.print_config,
    ) {
        Ok(x) => x,
        Err(code) => return code,
    };
    match run(cli, config, log) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devlend-compute-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, config: Config, log: devlend_daemon::logging::LogHandle) -> anyhow::Result<()> {
    let registry = Arc::new(Registry::default());
    if let Some(addr) = config.metrics_listen {
        devlend_daemon::metrics::serve(addr, AttachmentMetrics(registry.clone()))?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(server::serve(
        &config.api,
        registry,
        Some(Reload { cli, log }),
    ))
}
