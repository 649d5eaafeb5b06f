//! What every devlend daemon (device agent, compute agent) shares:
//!
//! - [`config`]: one TOML file per daemon (`--config`, default
//!   `/etc/devlend/<daemon>.toml`), unknown keys refused with the file, key and reason;
//! - [`logging`]: tracing to stderr, human or JSON, with a level reloadable on SIGHUP;
//! - [`notify`]: systemd readiness (`Type=notify`) through `sd_notify`;
//! - [`metrics`]: a Prometheus/OpenMetrics endpoint (`--metrics-listen ADDR`).

pub mod config;
pub mod logging;
pub mod metrics;
pub mod notify;
