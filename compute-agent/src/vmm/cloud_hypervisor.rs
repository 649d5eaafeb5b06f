//! Cloud Hypervisor: an attachment's vhost-user-blk socket as a VM disk.
//!
//! Two ways in:
//! - at VM start, [`cli_arg`] gives Cloud Hypervisor's `--disk vhost_user=true,socket=...`
//!   option ([`disk_option`] its value alone, for an argument list or `ch-remote add-disk`);
//! - into a running VM, [`add_disk`] sends [`disk_config`] as `PUT /api/v1/vm.add-disk`
//!   over the VMM's API socket (`--api-socket`), and [`remove_device`] takes the disk out
//!   again with `PUT /api/v1/vm.remove-device`.
//!
//! Either way the VM's memory must be shared (`--memory size=...,shared=on`): a
//! vhost-user backend maps guest memory from the file descriptors the VMM sends it, and
//! Cloud Hypervisor refuses a vhost-user disk in a VM whose memory is private.
//!
//! The request bodies are checked against Cloud Hypervisor's published OpenAPI document
//! (`components/schemas/DiskConfig`, `VmRemoveDevice`, `PciDeviceInfo`) by
//! `compute-agent/tests/cloud_hypervisor/`; see `docs/cloud-hypervisor.md`.
//!
//! The API calls are blocking: make them from a plain thread or from
//! `tokio::task::spawn_blocking`, never from an async task. reqwest's blocking client
//! runs a runtime of its own, which panics when it is created or dropped inside a tokio
//! runtime's async context.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// How long one API call may take, connection included. Hot-adding a vhost-user disk
/// makes the VMM connect to the backend and negotiate with it before it answers.
pub const API_TIMEOUT: Duration = Duration::from_secs(30);

/// How long connecting to the API socket may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Base URL of the API; the host part is not used over a unix socket.
const API_BASE: &str = "http://localhost/api/v1";

/// Longest error-answer body kept in a [`ChError`], in bytes.
const MAX_BODY_IN_ERROR: usize = 4096;

/// The operation `PUT /api/v1/vm.add-disk`.
pub const OP_ADD_DISK: &str = "vm.add-disk";

/// The operation `PUT /api/v1/vm.remove-device`.
pub const OP_REMOVE_DEVICE: &str = "vm.remove-device";

/// `PciDeviceInfo`: where Cloud Hypervisor put a hot-added device (the `200` answer of
/// `vm.add-disk`). Unknown fields are ignored, so that a newer VMM that adds some is
/// still understood.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciDeviceInfo {
    /// Device id: the `id` of the request, or the one the VMM chose when none was given.
    pub id: String,
    /// PCI address in the guest, `SEGMENT:BUS:DEVICE.FUNCTION` (e.g. `0000:00:06.0`).
    pub bdf: String,
}

/// Why a Cloud Hypervisor API call failed. Each names the API socket and the operation
/// ([`OP_ADD_DISK`], [`OP_REMOVE_DEVICE`]).
#[derive(Debug, thiserror::Error)]
pub enum ChError {
    /// The HTTP client could not be set up.
    #[error("cannot set up an HTTP client for Cloud Hypervisor API socket {}", socket.display())]
    Client {
        /// The API socket.
        socket: PathBuf,
        /// reqwest's error.
        #[source]
        source: reqwest::Error,
    },
    /// Nothing accepts connections on the API socket: no such file, nobody listening
    /// (the VMM is gone), or no permission.
    #[error("Cloud Hypervisor API socket {} is unreachable ({operation})", socket.display())]
    Unreachable {
        /// The API socket.
        socket: PathBuf,
        /// The operation tried.
        operation: &'static str,
        /// reqwest's error, with the connect error below it.
        #[source]
        source: reqwest::Error,
    },
    /// No complete answer within [`API_TIMEOUT`].
    #[error("{operation} on Cloud Hypervisor API socket {}: no answer within {} s", socket.display(), after.as_secs())]
    TimedOut {
        /// The API socket.
        socket: PathBuf,
        /// The operation tried.
        operation: &'static str,
        /// The time waited.
        after: Duration,
        /// reqwest's error.
        #[source]
        source: reqwest::Error,
    },
    /// Connected, but the exchange broke (connection closed, malformed HTTP).
    #[error("{operation} on Cloud Hypervisor API socket {}: the exchange failed", socket.display())]
    Transport {
        /// The API socket.
        socket: PathBuf,
        /// The operation tried.
        operation: &'static str,
        /// reqwest's error.
        #[source]
        source: reqwest::Error,
    },
    /// The VMM answered with an error status (4xx, 5xx).
    #[error("{operation} on Cloud Hypervisor API socket {}: refused with HTTP {status}: {body}", socket.display())]
    Refused {
        /// The API socket.
        socket: PathBuf,
        /// The operation tried.
        operation: &'static str,
        /// The HTTP status code.
        status: u16,
        /// The answer's body (what the VMM says went wrong), cut to 4 KiB;
        /// `(empty body)` when there was none.
        body: String,
    },
    /// `vm.add-disk` answered `204`: the VM is created but not booted, so the disk was
    /// added to its configuration and appears when it boots; there is no PCI device yet.
    /// The disk is in the VM's configuration all the same: [`remove_device`] takes it out.
    #[error("{operation} on Cloud Hypervisor API socket {}: the VM is not running; disk {id:?} was added to its configuration only (HTTP 204)", socket.display())]
    ColdAdded {
        /// The API socket.
        socket: PathBuf,
        /// The operation tried.
        operation: &'static str,
        /// The disk id sent (empty if none was).
        id: String,
    },
    /// A success status that this operation does not define.
    #[error("{operation} on Cloud Hypervisor API socket {}: unexpected answer HTTP {status}: {body}", socket.display())]
    UnexpectedStatus {
        /// The API socket.
        socket: PathBuf,
        /// The operation tried.
        operation: &'static str,
        /// The HTTP status code.
        status: u16,
        /// The answer's body, cut to 4 KiB.
        body: String,
    },
    /// The `200` answer of `vm.add-disk` is not a `PciDeviceInfo`.
    #[error("{operation} on Cloud Hypervisor API socket {}: the answer is not a PciDeviceInfo: {body}", socket.display())]
    BadAnswer {
        /// The API socket.
        socket: PathBuf,
        /// The operation tried.
        operation: &'static str,
        /// The answer's body, cut to 4 KiB.
        body: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

impl ChError {
    /// The HTTP status of the VMM's answer, if it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ChError::Refused { status, .. } | ChError::UnexpectedStatus { status, .. } => {
                Some(*status)
            }
            ChError::ColdAdded { .. } => Some(204),
            ChError::BadAnswer { .. } => Some(200),
            _ => None,
        }
    }
}

/// The `DiskConfig` body of `PUT /api/v1/vm.add-disk` for a vhost-user-blk disk served
/// on `socket`:
///
/// ```json
/// {"vhost_user": true, "vhost_socket": "/run/devlend/vol1.sock", "num_queues": 4,
///  "queue_size": 256, "id": "vol1", "readonly": false}
/// ```
///
/// - No `path`: a vhost-user disk has no image path, and Cloud Hypervisor refuses a disk
///   with both `path` and `vhost_socket`. The published schema agrees: `DiskConfig`
///   declares no required property, so `path` may be left out.
/// - `vhost_user` is a boolean in the schema: `true` here (the `--disk` option spells
///   it `vhost_user=true` or `on`).
/// - An empty `id` is left out, and the VMM picks one (returned in [`PciDeviceInfo`]).
/// - `readonly` records intent in the VM's configuration; the guest sees the disk
///   read-only through `VIRTIO_BLK_F_RO`, which devlend's backend offers when the lent
///   device is read-only and enforces in any case.
/// - Cloud Hypervisor refuses more queues than the VM has boot vCPUs.
/// - `socket` must be valid UTF-8 (a JSON string cannot carry other bytes); anything
///   else is replaced lossily.
pub fn disk_config(
    socket: &Path,
    id: &str,
    num_queues: u16,
    queue_size: u16,
    read_only: bool,
) -> Value {
    let mut body = json!({
        "vhost_user": true,
        "vhost_socket": socket.to_string_lossy(),
        "num_queues": num_queues,
        "queue_size": queue_size,
        "readonly": read_only,
    });
    if !id.is_empty() {
        body["id"] = Value::from(id);
    }
    body
}

/// The `VmRemoveDevice` body of `PUT /api/v1/vm.remove-device`: `{"id": ID}`.
pub fn remove_device_body(id: &str) -> Value {
    json!({ "id": id })
}

/// Cloud Hypervisor's `--disk` option for a vhost-user-blk disk served on `socket`, as
/// one line to show people:
/// `--disk vhost_user=true,socket=PATH,num_queues=N,queue_size=N,id=ID`, plus
/// `,readonly=on` when read-only. The value alone is [`disk_option`].
///
/// The VM must be started with shared memory, `--memory size=...,shared=on`, or Cloud
/// Hypervisor refuses vhost-user disks.
pub fn cli_arg(
    socket: &Path,
    id: &str,
    num_queues: u16,
    queue_size: u16,
    read_only: bool,
) -> String {
    format!(
        "--disk {}",
        disk_option(socket, id, num_queues, queue_size, read_only)
    )
}

/// The value of Cloud Hypervisor's `--disk` option for a vhost-user-blk disk served on
/// `socket` (one argument after `--disk` when starting the VMM; also what
/// `ch-remote add-disk` takes): `vhost_user=true,socket=PATH,num_queues=N,queue_size=N,id=ID`,
/// plus `readonly=on` when read-only.
///
/// An empty `id` is left out (the VMM picks one). A socket path or id with a comma is
/// quoted (`socket="/run/a,b.sock"`), as Cloud Hypervisor's option syntax wants (a shell
/// drops such quotes: quote the whole argument there); that syntax cannot carry a `"`
/// and treats `[`/`]` as nesting, so a socket path with those is not usable here
/// (devlend's own socket paths have none). A non-UTF-8 path is replaced lossily.
pub fn disk_option(
    socket: &Path,
    id: &str,
    num_queues: u16,
    queue_size: u16,
    read_only: bool,
) -> String {
    let socket = socket.to_string_lossy();
    let mut arg = format!(
        "vhost_user=true,socket={},num_queues={num_queues},queue_size={queue_size}",
        option_value(&socket)
    );
    if !id.is_empty() {
        arg.push_str(",id=");
        arg.push_str(&option_value(id));
    }
    if read_only {
        arg.push_str(",readonly=on");
    }
    arg
}

/// A value for Cloud Hypervisor's `key=value,...` syntax: quoted if it has a comma.
fn option_value(v: &str) -> Cow<'_, str> {
    if v.contains(',') {
        Cow::Owned(format!("\"{v}\""))
    } else {
        Cow::Borrowed(v)
    }
}

/// `PUT /api/v1/vm.add-disk` (operation [`OP_ADD_DISK`]) on the VMM's API socket with
/// `body` (a [`disk_config`]): hot-adds the disk to the running VM and returns where it
/// went. Blocking, up to [`API_TIMEOUT`]: call from a plain thread or `spawn_blocking`
/// (see the module docs).
///
/// # Errors
/// [`ChError::Unreachable`] when nothing listens on `api_socket`;
/// [`ChError::Refused`] with the VMM's status and message (e.g. `400` for a bad
/// configuration, `409` for a duplicate id, `500` when the device could not be added);
/// [`ChError::ColdAdded`] when the VM is not booted (`204`); [`ChError::BadAnswer`],
/// [`ChError::TimedOut`], [`ChError::Transport`], [`ChError::Client`].
pub fn add_disk(api_socket: &Path, body: &Value) -> Result<PciDeviceInfo, ChError> {
    let operation = OP_ADD_DISK;
    let (status, text) = put(api_socket, operation, body)?;
    match status {
        200 => serde_json::from_str(&text).map_err(|source| ChError::BadAnswer {
            socket: api_socket.to_owned(),
            operation,
            body: shorten(&text),
            source,
        }),
        204 => Err(ChError::ColdAdded {
            socket: api_socket.to_owned(),
            operation,
            id: body
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
        }),
        s => Err(status_error(api_socket, operation, s, &text)),
    }
}

/// `PUT /api/v1/vm.remove-device` (operation [`OP_REMOVE_DEVICE`]) with
/// `{"id": id}`: unplugs the device from the VM (the guest is asked to release it; the
/// VMM then drops its vhost-user connection). Success is `204`. Blocking, up to
/// [`API_TIMEOUT`]: call from a plain thread or `spawn_blocking`.
///
/// # Errors
/// [`ChError::Unreachable`]; [`ChError::Refused`] (`404`: no such device, or no VM);
/// [`ChError::UnexpectedStatus`], [`ChError::TimedOut`], [`ChError::Transport`],
/// [`ChError::Client`].
pub fn remove_device(api_socket: &Path, id: &str) -> Result<(), ChError> {
    let operation = OP_REMOVE_DEVICE;
    let (status, text) = put(api_socket, operation, &remove_device_body(id))?;
    match status {
        204 => Ok(()),
        s => Err(status_error(api_socket, operation, s, &text)),
    }
}

/// Sends `PUT {API_BASE}/{operation}` with a JSON body; returns the status and body.
fn put(api_socket: &Path, operation: &'static str, body: &Value) -> Result<(u16, String), ChError> {
    let client = devlend_pool::https::http_only_builder()
        .unix_socket(api_socket)
        .timeout(API_TIMEOUT)
        .connect_timeout(CONNECT_TIMEOUT)
        .build()
        .map_err(|source| ChError::Client {
            socket: api_socket.to_owned(),
            source,
        })?;
    let transport = |source: reqwest::Error| {
        let socket = api_socket.to_owned();
        if source.is_connect() {
            ChError::Unreachable {
                socket,
                operation,
                source,
            }
        } else if source.is_timeout() {
            ChError::TimedOut {
                socket,
                operation,
                after: API_TIMEOUT,
                source,
            }
        } else {
            ChError::Transport {
                socket,
                operation,
                source,
            }
        }
    };
    let resp = client
        .put(format!("{API_BASE}/{operation}"))
        .json(body)
        .send()
        .map_err(transport)?;
    let status = resp.status().as_u16();
    let text = resp.text().map_err(transport)?;
    Ok((status, text))
}

/// The error for an answer with a status the operation does not take as success.
fn status_error(socket: &Path, operation: &'static str, status: u16, text: &str) -> ChError {
    let body = shorten(text);
    let socket = socket.to_owned();
    if (200..300).contains(&status) {
        ChError::UnexpectedStatus {
            socket,
            operation,
            status,
            body,
        }
    } else {
        ChError::Refused {
            socket,
            operation,
            status,
            body,
        }
    }
}

/// An answer body for an error message: trimmed, at most [`MAX_BODY_IN_ERROR`] bytes
/// (cut on a character boundary), `(empty body)` if empty.
fn shorten(text: &str) -> String {
    let t = text.trim();
    if t.is_empty() {
        return "(empty body)".to_owned();
    }
    devlend_fabric::text::shortened(t, MAX_BODY_IN_ERROR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorten_cuts_on_a_char_boundary() {
        assert_eq!(shorten("  \n"), "(empty body)");
        assert_eq!(shorten(" oops \n"), "oops");
        let long = "é".repeat(MAX_BODY_IN_ERROR);
        let s = shorten(&long);
        assert!(s.ends_with(&format!("... ({} bytes)", long.len())));
        assert!(s.len() < MAX_BODY_IN_ERROR + 32);
    }

    #[test]
    fn empty_id_is_left_out() {
        let b = disk_config(Path::new("/s"), "", 1, 128, false);
        assert!(b.get("id").is_none());
        assert_eq!(
            cli_arg(Path::new("/s"), "", 1, 128, false),
            "--disk vhost_user=true,socket=/s,num_queues=1,queue_size=128"
        );
    }
}
