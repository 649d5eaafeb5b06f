//! The compute agent's state file: the attachments to restore when it starts again.
//!
//! A compute agent that restarts (a crash, an upgrade, `systemctl restart`) must not cost
//! a running VM its disks. After every attach and detach the registry writes the file
//! (JSON, mode 0600 since it holds session tokens, replaced atomically by a rename);
//! at start the agent serves each attachment again on the same socket, with the same
//! borrower identity and token, so that the lender admits it, a QEMU started with
//! `reconnect-ms` joins again, and the requests that were in flight are resubmitted
//! from the vhost-user inflight buffer. The VMM plug is remembered, not redone. A PCIe
//! function's VM (the request's `vm`) is saved with its request: restored, it joins its
//! VM's peer group again, under an identity the restarted agent gives that name.
//!
//! By default the file lives beside the API socket (`/run/devlend/compute-agent.state.json`
//! for the default socket): `/run` is emptied at boot, when the VMs are gone too.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::api::{AttachKind, AttachRequest, DeviceKind, VmmPlug};

/// Layout version written in the file.
pub const VERSION: u32 = 1;

/// One attachment as saved.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SavedAttachment {
    /// The attachment id.
    pub id: String,
    /// The request it was made with (its `vmm` is not acted on again at restore; its
    /// `vm`, a PCIe function's VM, is).
    pub request: AttachRequest,
    /// The borrower identity sent in every hello, hex (32 digits).
    pub borrower: String,
    /// The session token sent in every hello (lease or direct-mode token), hex; empty
    /// when none.
    #[serde(default)]
    pub token: String,
    /// Where it was plugged into a VM, if it was.
    #[serde(default)]
    pub plug: Option<VmmPlug>,
    /// What it served (`block`, `nic` or `pci`; shown while it is restoring); absent in
    /// files written before it existed ([`Self::kind`] then infers it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<DeviceKind>,
}

impl SavedAttachment {
    /// What it served: as saved, or for a file from before kinds were saved, a PCIe
    /// function if it was attached as one, else a block device.
    pub fn kind(&self) -> DeviceKind {
        match (self.kind, self.request.kind) {
            (Some(k), _) => k,
            (None, AttachKind::Pci) => DeviceKind::Pci,
            (None, AttachKind::Device) => DeviceKind::Block,
        }
    }
}

/// The whole file.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StateFile {
    /// [`VERSION`].
    pub version: u32,
    /// The attachments, by id.
    pub attachments: Vec<SavedAttachment>,
}

/// Why the state file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Reading or writing failed.
    #[error("state file {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The contents are not a state file of this version.
    #[error("state file {path} is not valid (move it aside to start without its attachments)")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
    /// Another compute agent uses this state file.
    #[error("state file {path} is in use by another compute agent (it holds {path}.lock); give each agent its own --state-file")]
    InUse {
        /// The file.
        path: PathBuf,
    },
    /// The path is not usable as a state file.
    #[error("state file {path}: {reason}")]
    NotUsable {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A version this agent does not know.
    #[error("state file {path} has version {version}; this agent writes version {VERSION}")]
    Version {
        /// The file.
        path: PathBuf,
        /// The version found.
        version: u32,
    },
}

/// Takes the state file for this process: an exclusive `flock` on `PATH.lock`, held
/// while the returned file is open. Refuses a path that is the API socket `api` or an
/// existing file that is not a regular file.
///
/// # Errors
/// [`StateError::InUse`] when another agent holds it; [`StateError::NotUsable`];
/// [`StateError::Io`].
pub fn lock(path: &Path, api: &Path) -> Result<File, StateError> {
    use std::os::unix::fs::OpenOptionsExt;
    let not_usable = |reason: &str| StateError::NotUsable {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    if path == api {
        return Err(not_usable("is the API socket's path"));
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => {
            return Err(not_usable("exists and is not a regular file"))
        }
        _ => {}
    }
    let io = |source| StateError::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(PathBuf::from(name))
        .map_err(io)?;
    // SAFETY: flock on an open file descriptor owned by `f`.
    let rc = unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.kind() == std::io::ErrorKind::WouldBlock {
            StateError::InUse {
                path: path.to_owned(),
            }
        } else {
            io(e)
        });
    }
    Ok(f)
}

/// The default state file for an API socket: `DIR/STEM.state.json` beside it.
pub fn default_path(api: &Path) -> PathBuf {
    let stem = api
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "compute-agent".into());
    api.with_file_name(format!("{stem}.state.json"))
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of a hex string, or `None` if it is not one.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|d| u8::from_str_radix(d, 16).ok()))
        .collect()
}

impl StateFile {
    /// Reads `path`; a missing file is an empty state.
    ///
    /// # Errors
    /// [`StateError`] for a file that cannot be read or parsed, or of another version.
    pub fn load(path: &Path) -> Result<StateFile, StateError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(StateFile::default()),
            Err(source) => {
                return Err(StateError::Io {
                    path: path.to_owned(),
                    source,
                })
            }
        };
        let state: StateFile = serde_json::from_str(&text).map_err(|source| StateError::Parse {
            path: path.to_owned(),
            source,
        })?;
        if state.version != VERSION {
            return Err(StateError::Version {
                path: path.to_owned(),
                version: state.version,
            });
        }
        Ok(state)
    }

    /// Writes the state to `path` atomically (a `0600` temporary file beside it, synced,
    /// then renamed over it); the directory is created if missing.
    ///
    /// # Errors
    /// [`StateError::Io`].
    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        use std::os::unix::fs::OpenOptionsExt;
        let io = |source| StateError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut state = self.clone();
        state.version = VERSION;
        let text = serde_json::to_vec_pretty(&state).map_err(|e| io(std::io::Error::other(e)))?;
        let tmp = path.with_extension("json.tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io)?;
        f.write_all(&text).map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved(id: &str) -> SavedAttachment {
        SavedAttachment {
            id: id.into(),
            request: serde_json::from_str(
                r#"{"lender":"h:1","device":"d","socket":"/run/x.sock","queues":2}"#,
            )
            .expect("request"),
            borrower: to_hex(&[7; 16]),
            token: to_hex(b"tok"),
            plug: None,
            kind: None,
        }
    }

    #[test]
    fn kinds_are_read_from_files_written_before_they_were_typed() {
        // As a compute agent wrote them before the kind was an enum: a string, or absent.
        let file = |kind: &str, request_kind: &str| -> StateFile {
            serde_json::from_str(&format!(
                r#"{{"version":{VERSION},"attachments":[{{"id":"a","borrower":"{}",
                "request":{{"lender":"h:1","device":"d","socket":"/run/x.sock"{request_kind}}}{kind}}}]}}"#,
                to_hex(&[7; 16])
            ))
            .expect("state file")
        };
        for (text, want) in [
            (r#","kind":"block""#, DeviceKind::Block),
            (r#","kind":"nic""#, DeviceKind::Nic),
            (r#","kind":"pci""#, DeviceKind::Pci),
        ] {
            let f = file(text, "");
            assert_eq!(f.attachments[0].kind, Some(want));
            assert_eq!(f.attachments[0].kind(), want);
        }
        assert_eq!(file("", "").attachments[0].kind(), DeviceKind::Block);
        assert_eq!(
            file("", r#","kind":"pci""#).attachments[0].kind(),
            DeviceKind::Pci
        );
        // Written back as the enum's name.
        let mut s = saved("a");
        s.kind = Some(DeviceKind::Nic);
        let v = serde_json::to_value(&s).expect("json");
        assert_eq!(v["kind"], "nic");
        let back: SavedAttachment = serde_json::from_value(v).expect("read back");
        assert_eq!(back, s);
    }

    /// A PCIe function's VM is saved with its request, so that the restored function
    /// joins its VM's peer group again; a request without one writes no key.
    #[test]
    fn a_pci_attachments_vm_is_saved_with_its_request() {
        let mut s = saved("f");
        s.request = serde_json::from_str(
            r#"{"lender":"h:1","device":"fn0","socket":"/run/f.sock","kind":"pci","vm":"vm-1"}"#,
        )
        .expect("request");
        let v = serde_json::to_value(&s).expect("json");
        assert_eq!(v["request"]["vm"], "vm-1");
        let back: SavedAttachment = serde_json::from_value(v).expect("read back");
        assert_eq!(back.request.vm.as_deref(), Some("vm-1"));
        assert_eq!(back.kind(), DeviceKind::Pci);
        let v = serde_json::to_value(saved("a")).expect("json");
        assert!(v["request"].get("vm").is_none(), "{v}");
    }

    #[test]
    fn round_trip_with_private_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/agent.state.json");
        assert_eq!(
            StateFile::load(&path).expect("missing is empty"),
            StateFile::default()
        );
        let s = StateFile {
            version: VERSION,
            attachments: vec![saved("a"), saved("b")],
        };
        s.save(&path).expect("save");
        assert_eq!(StateFile::load(&path).expect("load"), s);
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(from_hex(&s.attachments[0].borrower), Some(vec![7; 16]));
    }

    #[test]
    fn bad_files_are_errors_that_name_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.json");
        std::fs::write(&path, "{not json").expect("write");
        let e = StateFile::load(&path).expect_err("garbage");
        assert!(e.to_string().contains("s.json"), "{e}");
        std::fs::write(&path, r#"{"version":9,"attachments":[]}"#).expect("write");
        assert!(matches!(
            StateFile::load(&path),
            Err(StateError::Version { version: 9, .. })
        ));
    }

    #[test]
    fn one_agent_per_state_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.state.json");
        let api = dir.path().join("api.sock");
        let held = lock(&path, &api).expect("first");
        assert!(matches!(lock(&path, &api), Err(StateError::InUse { .. })));
        drop(held);
        assert!(lock(&path, &api).is_ok());
        assert!(matches!(
            lock(&api, &api),
            Err(StateError::NotUsable { .. })
        ));
        assert!(matches!(
            lock(dir.path(), &api),
            Err(StateError::NotUsable { .. })
        ));
    }

    #[test]
    fn hex_and_default_path() {
        assert_eq!(from_hex("0aff"), Some(vec![10, 255]));
        assert_eq!(from_hex("0g"), None);
        assert_eq!(from_hex("abc"), None);
        assert_eq!(
            default_path(Path::new("/run/devlend/compute-agent.sock")),
            PathBuf::from("/run/devlend/compute-agent.state.json")
        );
    }
}
