//! An agent's own key pair: the Ed25519 key a lender or a compute agent proves who it
//! is with (to the pool, and in the fabric handshake).
//!
//! The key file holds the 32-byte seed as unpadded base64url and a newline, as
//! `devlend keygen` writes it. [`load_or_create`] makes it at first start: the directory
//! 0700, the file 0600, written with `O_EXCL` so that two agents starting at once end up
//! with one key. A key file readable by group or others is refused, as ssh refuses a
//! private key that others can read.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::lease_token::{TokenError, TokenSigner};

/// Why a key file could not be read or made.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The file or its directory could not be read, created or written.
    #[error("key file {path}: {what}")]
    Io {
        /// The key file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// Group or others may read or write the file.
    #[error("key file {path} has mode {mode:o}: group and others must have no access (chmod 600)")]
    Exposed {
        /// The key file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The file does not hold a key.
    #[error("key file {path} does not hold a key")]
    Malformed {
        /// The key file.
        path: PathBuf,
        /// Why.
        #[source]
        source: TokenError,
    },
}

/// Reads the key at `path`; the file must exist, be mode 0600 or stricter, and hold a
/// seed.
///
/// # Errors
/// [`IdentityError`].
pub fn load(path: &Path) -> Result<TokenSigner, IdentityError> {
    let io = |what, source| IdentityError::Io {
        path: path.to_owned(),
        what,
        source,
    };
    let meta = std::fs::metadata(path).map_err(|e| io("cannot read", e))?;
    let mode = meta.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(IdentityError::Exposed {
            path: path.to_owned(),
            mode,
        });
    }
    let text = std::fs::read_to_string(path).map_err(|e| io("cannot read", e))?;
    TokenSigner::from_seed_text(&text).map_err(|source| IdentityError::Malformed {
        path: path.to_owned(),
        source,
    })
}

/// Reads the key at `path`, or makes a new one there when there is no file yet (its
/// directory 0700 and the file 0600). The second value says whether it was made now.
///
/// # Errors
/// [`IdentityError`]; [`IdentityError::Malformed`] with [`TokenError::Random`] when the
/// system has no randomness.
pub fn load_or_create(path: &Path) -> Result<(TokenSigner, bool), IdentityError> {
    let io = |what, source| IdentityError::Io {
        path: path.to_owned(),
        what,
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(_) => return load(path).map(|k| (k, false)),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io("cannot read", e)),
        Err(_) => {}
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| io("cannot create its directory", e))?;
    }
    let signer = TokenSigner::generate().map_err(|source| IdentityError::Malformed {
        path: path.to_owned(),
        source,
    })?;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path);
    let mut file = match file {
        Ok(f) => f,
        // Another process made it first: use its key.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return load(path).map(|k| (k, false))
        }
        Err(e) => return Err(io("cannot create", e)),
    };
    writeln!(file, "{}", signer.seed_text())
        .and_then(|()| file.sync_all())
        .map_err(|e| io("cannot write", e))?;
    Ok((signer, true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_key_is_made_once_then_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/identity.key");
        let (a, made) = load_or_create(&path).unwrap();
        assert!(made);
        let (b, made) = load_or_create(&path).unwrap();
        assert!(!made);
        assert_eq!(a.public_key(), b.public_key());
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        let dmeta = std::fs::metadata(path.parent().unwrap()).unwrap();
        assert_eq!(dmeta.mode() & 0o777, 0o700);
    }

    #[test]
    fn an_exposed_or_garbled_key_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        load_or_create(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(load(&path), Err(IdentityError::Exposed { .. })));
        std::fs::write(&path, "not a key\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(
            load_or_create(&path),
            Err(IdentityError::Malformed { .. })
        ));
    }
}
