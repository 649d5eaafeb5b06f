//! Logs: tracing to stderr, human-readable by default, JSON with `--log-format json`;
//! the level can be changed at run time (SIGHUP reload).

use std::io::IsTerminal;

use serde::{Deserialize, Serialize};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Registry};

/// The log line format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Human,
    /// One JSON object per line, with the event's fields and its spans.
    Json,
}

/// Changes the level of the installed subscriber.
#[derive(Clone)]
pub struct LogHandle(reload::Handle<EnvFilter, Registry>);

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The level is not a valid filter.
    #[error("invalid log level {level:?}: {reason}")]
    Level {
        /// What was given.
        level: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The level could not be changed.
    #[error("cannot change the log level: {0}")]
    Reload(String),
}

fn filter(level: &str) -> Result<EnvFilter, LogError> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    // A bare word would be taken as a target name and silence everything else.
    let known = level.split(',').all(|d| {
        let d = d.trim();
        !d.is_empty() && (d.contains('=') || LEVELS.contains(&d.to_ascii_lowercase().as_str()))
    });
    if !known {
        return Err(LogError::Level {
            level: level.to_owned(),
            reason: "expected off, error, warn, info, debug, trace, or target=level directives"
                .into(),
        });
    }
    // vfio-ioctls warns about every region and interrupt index a function lacks (ROM,
    // VGA, ERR...) when it is opened: normal, not faults. Quieted unless the filter
    // names it.
    let level = if level.contains("vfio_ioctls") {
        level.to_owned()
    } else {
        format!("{level},vfio_ioctls=error")
    };
    EnvFilter::try_new(&level).map_err(|e| LogError::Level {
        level: level.clone(),
        reason: e.to_string(),
    })
}

/// Installs the global subscriber: `level` is a tracing filter (`info`, `debug`,
/// `devlend_backend=trace,info`, ...).
///
/// # Errors
/// [`LogError::Level`] for an invalid filter.
pub fn init(level: &str, format: LogFormat) -> Result<LogHandle, LogError> {
    let (filter, handle) = reload::Layer::new(filter(level)?);
    let registry = tracing_subscriber::registry().with(filter);
    let ansi = std::io::stderr().is_terminal();
    match format {
        LogFormat::Human => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(ansi),
            )
            .init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_span_list(true)
                    .with_writer(std::io::stderr),
            )
            .init(),
    }
    Ok(LogHandle(handle))
}

/// Checks a log filter without applying it.
///
/// # Errors
/// [`LogError::Level`] for an invalid filter.
pub fn check_level(level: &str) -> Result<(), LogError> {
    filter(level).map(|_| ())
}

impl LogHandle {
    /// Replaces the filter.
    ///
    /// # Errors
    /// An invalid filter (the old one stays).
    pub fn set_level(&self, level: &str) -> Result<(), LogError> {
        let f = filter(level)?;
        self.0
            .reload(f)
            .map_err(|e| LogError::Reload(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_checked() {
        for ok in [
            "info",
            "DEBUG",
            "warn,devlend_backend=trace",
            "devlend_device_agent=debug",
        ] {
            assert!(filter(ok).is_ok(), "{ok}");
        }
        for bad in ["bogus", "", "info,,", "verbose", "foo::bar"] {
            assert!(filter(bad).is_err(), "{bad}");
        }
    }
}
