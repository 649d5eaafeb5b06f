//! What every devlend daemon (device agent, compute agent) shares:
//!
//! - [`config`]: one TOML file per daemon (`--config`, default
//!   `/etc/devlend/<daemon>.toml`), unknown keys refused with the file, key and reason;
//! - [`logging`]: tracing to stderr, human or JSON, with a level reloadable on SIGHUP;
//! - [`notify`]: systemd readiness (`Type=notify`) through `sd_notify`;
//! - [`metrics`]: a Prometheus/OpenMetrics endpoint (`--metrics-listen ADDR`);
//! - [`limits`]: the open-files limit raised to the hard one at start.

pub mod config;
pub mod limits;
pub mod logging;
pub mod metrics;
pub mod notify;
pub mod pool_health;

use std::process::ExitCode;

/// What a daemon's configuration offers to [`startup`].
pub trait DaemonConfig {
    /// The configuration as TOML (`--print-config`).
    fn to_toml(&self) -> String;
    /// The log filter and format.
    fn logging(&self) -> (&str, logging::LogFormat);
}

/// The start of every daemon's `main`: a configuration error exits 2 with its causes;
/// `--print-config` prints and exits 0; otherwise logging is installed, the limit of
/// open files raised ([`limits::raise_open_files`]), and the configuration and the log
/// handle are returned.
///
/// # Errors
/// The exit code to return from `main`.
pub fn startup<C: DaemonConfig, E: Into<anyhow::Error>>(
    daemon: &str,
    config: Result<C, E>,
    print_config: bool,
) -> Result<(C, logging::LogHandle), ExitCode> {
    let config = config.map_err(|e| {
        eprintln!("{daemon}: {:#}", e.into());
        ExitCode::from(2)
    })?;
    if print_config {
        print!("{}", config.to_toml());
        return Err(ExitCode::SUCCESS);
    }
    let (level, format) = config.logging();
    let log = logging::init(level, format).map_err(|e| {
        eprintln!("{daemon}: {e}");
        ExitCode::from(2)
    })?;
    if let Some(n) = limits::raise_open_files() {
        tracing::debug!(open_files = n, "limit of open files");
    }
    Ok((config, log))
}

/// This machine's host name (`/proc/sys/kernel/hostname`), or `localhost`: the default
/// provider name of a lender and the compute host of a lease.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}
