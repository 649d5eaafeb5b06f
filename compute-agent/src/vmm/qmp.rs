//! A small typed QMP client (QEMU Machine Protocol, `docs/interop/qmp-spec.rst` of QEMU).
//!
//! Line-delimited JSON over a unix socket: the server greets, the client enters command
//! mode with `qmp_capabilities`, then each command gets a `return` or an `error`, with
//! asynchronous events interleaved; events read while waiting for a reply are kept for
//! [`Qmp::wait_event`].

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A QMP failure.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The QMP socket could not be reached.
    #[error("QMP socket {path} is unreachable")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Reading or writing the socket failed (including timeouts).
    #[error("QMP I/O failed")]
    Io(#[source] io::Error),
    /// The server sent something that is not QMP.
    #[error("unexpected QMP message: {0}")]
    Protocol(String),
    /// A command failed.
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        /// The command.
        command: String,
        /// QMP error class (e.g. `GenericError`, `DeviceNotFound`).
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// An awaited event did not come.
    #[error("no {event} event within {timeout:?}")]
    Timeout {
        /// The event name.
        event: String,
        /// How long was waited.
        timeout: Duration,
    },
}

/// A QMP connection in command mode.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    events: VecDeque<Value>,
    next_id: u64,
}

/// Time allowed for the greeting and for each command's reply.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

impl Qmp {
    /// Connects, reads the greeting and negotiates capabilities.
    ///
    /// # Errors
    /// [`QmpError::Connect`] when the socket is unreachable; others on a bad greeting.
    pub fn connect(path: &Path) -> Result<Qmp, QmpError> {
        let stream = UnixStream::connect(path).map_err(|source| QmpError::Connect {
            path: path.to_owned(),
            source,
        })?;
        stream
            .set_read_timeout(Some(COMMAND_TIMEOUT))
            .map_err(QmpError::Io)?;
        let writer = stream.try_clone().map_err(QmpError::Io)?;
        let mut q = Qmp {
            reader: BufReader::new(stream),
            writer,
            events: VecDeque::new(),
            next_id: 1,
        };
        let greeting = q.read_message()?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!(
                "expected a greeting, got {greeting}"
            )));
        }
        q.execute("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.reader.read_line(&mut line).map_err(QmpError::Io)?;
            if n == 0 {
                return Err(QmpError::Io(io::Error::from(io::ErrorKind::UnexpectedEof)));
            }
            if !line.trim().is_empty() {
                return serde_json::from_str(&line)
                    .map_err(|e| QmpError::Protocol(format!("{e}: {}", line.trim())));
            }
        }
    }

    /// Runs `command` with `arguments` and returns its `return` value.
    ///
    /// # Errors
    /// [`QmpError::Command`] with QEMU's error class and description.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({ "execute": command, "id": id });
        if arguments.as_object().is_some_and(|o| !o.is_empty()) {
            msg["arguments"] = arguments;
        }
        let mut line = msg.to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .map_err(QmpError::Io)?;
        loop {
            let m = self.read_message()?;
            if m.get("event").is_some() {
                self.events.push_back(m);
                continue;
            }
            if m.get("id").and_then(Value::as_u64) != Some(id) {
                continue;
            }
            if let Some(r) = m.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = m.get("error") {
                let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
                return Err(QmpError::Command {
                    command: command.to_owned(),
                    class: s("class"),
                    desc: s("desc"),
                });
            }
            return Err(QmpError::Protocol(format!(
                "reply without return or error: {m}"
            )));
        }
    }

    /// Waits up to `timeout` for an event named `event` whose `data` satisfies `matches`
    /// (events that arrived during earlier commands count).
    ///
    /// # Errors
    /// [`QmpError::Timeout`]; I/O errors.
    pub fn wait_event(
        &mut self,
        event: &str,
        timeout: Duration,
        matches: impl Fn(&Value) -> bool,
    ) -> Result<Value, QmpError> {
        let is_it = |m: &Value| {
            m.get("event").and_then(Value::as_str) == Some(event)
                && matches(m.get("data").unwrap_or(&Value::Null))
        };
        if let Some(pos) = self.events.iter().position(is_it) {
            return Ok(self.events.remove(pos).unwrap_or(Value::Null));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(QmpError::Timeout {
                    event: event.to_owned(),
                    timeout,
                });
            }
            self.reader
                .get_ref()
                .set_read_timeout(Some(left))
                .map_err(QmpError::Io)?;
            let m = match self.read_message() {
                Ok(m) => m,
                Err(QmpError::Io(e))
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(QmpError::Timeout {
                        event: event.to_owned(),
                        timeout,
                    });
                }
                Err(e) => return Err(e),
            };
            if is_it(&m) {
                self.reader
                    .get_ref()
                    .set_read_timeout(Some(COMMAND_TIMEOUT))
                    .map_err(QmpError::Io)?;
                return Ok(m);
            }
            if m.get("event").is_some() {
                self.events.push_back(m);
            }
        }
    }
}
