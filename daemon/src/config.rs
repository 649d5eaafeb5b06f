//! Loading a daemon's TOML config file, and the flags every daemon takes for it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

/// The flags the compute and device agents share: the config file, logging, metrics and
/// `--print-config`. Flattened into each daemon's flags (`#[command(flatten)]`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CommonFlags {
    /// Config file (TOML); default /etc/devlend/<daemon>.toml when it exists.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log filter: error, warn, info, debug, trace, or a tracing filter (e.g.
    /// `devlend_device_agent=trace`) [default: info].
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Log line format [default: human].
    #[arg(long, value_enum)]
    pub log_format: Option<crate::logging::LogFormat>,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_listen: Option<SocketAddr>,
    /// Print the merged configuration (file, then flags) as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// The logging and metrics settings both agents resolve the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommonSettings {
    /// The log filter.
    pub log_level: String,
    /// The log line format.
    pub log_format: crate::logging::LogFormat,
    /// Where Prometheus metrics are served, if anywhere.
    pub metrics_listen: Option<SocketAddr>,
}

impl CommonFlags {
    /// Each setting from its flag, else from the config file's key (the arguments), else
    /// its default: `info`, human lines, no metrics endpoint.
    pub fn resolve(
        &self,
        log_level: Option<String>,
        log_format: Option<crate::logging::LogFormat>,
        metrics_listen: Option<SocketAddr>,
    ) -> CommonSettings {
        CommonSettings {
            log_level: self
                .log_level
                .clone()
                .or(log_level)
                .unwrap_or_else(|| "info".into()),
            log_format: self.log_format.or(log_format).unwrap_or_default(),
            metrics_listen: self.metrics_listen.or(metrics_listen),
        }
    }
}

/// The directory of the default config files.
pub const CONFIG_DIR: &str = "/etc/devlend";

/// The default config file of `daemon` (e.g. `device-agent`): `/etc/devlend/<daemon>.toml`.
pub fn default_path(daemon: &str) -> PathBuf {
    Path::new(CONFIG_DIR).join(format!("{daemon}.toml"))
}

/// Why a config file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML for this daemon (bad syntax, an unknown key, a bad
    /// value); toml's message names the key, the line and the reason.
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What and where.
        message: String,
    },
}

/// Reads the config file: `explicit` if given (it must exist), else the default path of
/// `daemon` if that file exists, else `T::default()`. Returns the file used, if any.
///
/// # Errors
/// [`ConfigError`], naming the file, the key and the reason.
pub fn load<T: DeserializeOwned + Default>(
    daemon: &str,
    explicit: Option<&Path>,
) -> Result<(T, Option<PathBuf>), ConfigError> {
    let path = match explicit {
        Some(p) => p.to_owned(),
        None => {
            let p = default_path(daemon);
            if !p.exists() {
                return Ok((T::default(), None));
            }
            p
        }
    };
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
        path: path.clone(),
        source,
    })?;
    let value = parse(&path, &text)?;
    Ok((value, Some(path)))
}

/// Parses config text, naming `path` in errors.
///
/// # Errors
/// [`ConfigError::Parse`].
pub fn parse<T: DeserializeOwned>(path: &Path, text: &str) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.to_owned(),
        message: e.to_string().trim().replace('\n', " "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct C {
        listen: Option<String>,
        queues: Option<u16>,
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_file_and_key() {
        let p = Path::new("/etc/devlend/x.toml");
        let e = parse::<C>(p, "listen = \"a\"\nqueuez = 3\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/etc/devlend/x.toml") && e.contains("queuez"),
            "{e}"
        );
        let e = parse::<C>(p, "queues = -1\n").unwrap_err().to_string();
        assert!(e.contains("queues"), "{e}");
        assert_eq!(
            parse::<C>(p, "queues = 2").unwrap(),
            C {
                listen: None,
                queues: Some(2)
            }
        );
    }

    #[test]
    fn an_explicit_file_must_exist() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.toml");
        assert!(matches!(
            load::<C>("x", Some(&missing)),
            Err(ConfigError::Read { .. })
        ));
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "listen = \"0.0.0.0:1\"").unwrap();
        let (c, used) = load::<C>("x", Some(&f)).unwrap();
        assert_eq!(c.listen.as_deref(), Some("0.0.0.0:1"));
        assert_eq!(used.as_deref(), Some(f.as_path()));
    }
}
