//! `devlend-device-agent`: lends block devices and regular files to devlend borrowers.
//! See the crate's README for options and the config file.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use devlend_device_agent::{Cli, Config, Lender};
use tracing_subscriber::filter::{EnvFilter, LevelFilter};

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = init_logging(cli.log_level.as_deref()) {
        eprintln!("devlend-device-agent: {e:#}");
        return ExitCode::from(2);
    }
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devlend-device-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let config = Config::from_cli(cli)?;
    Lender::bind(&config.listen, config.devices)?.run()?;
    Ok(())
}

/// Logs to stderr, filtered by `--log-level`, else RUST_LOG, else `info`.
fn init_logging(level: Option<&str>) -> anyhow::Result<()> {
    let filter = match level {
        Some(l) => {
            EnvFilter::try_new(l).map_err(|e| anyhow::anyhow!("invalid --log-level {l:?}: {e}"))?
        }
        None => EnvFilter::builder()
            .with_default_directive(LevelFilter::INFO.into())
            .from_env_lossy(),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    Ok(())
}
