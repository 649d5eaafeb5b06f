//! The authentication state every request passes: the pool's [`AuthMode`], the nonces
//! seen per key within the signature window ([`Gate`]), and which routes an unenrolled
//! or unsigned caller may reach. The HTTP middleware that applies it is
//! `http/authenticate.rs`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use super::request::MAX_SKEW_MS;

/// How the pool treats requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMode {
    /// Signed requests by enrolled keys (the default). With `trust_first_use`, a
    /// lender's first registration pins its key to a provider name nobody holds yet.
    Signed {
        /// Pin a new lender's key at its first registration.
        trust_first_use: bool,
    },
    /// `--insecure-open-api`: no authentication at all, as before enrollment existed.
    Open,
}

/// Most nonces remembered per enrolled key within the time window (a request every
/// 12 ms for 10 minutes); past that, that key's requests are refused with 429 until its
/// old ones expire. Other keys are not affected.
pub const MAX_NONCES_PER_KEY: usize = 50_000;

/// The gate's state: its mode and the nonces seen within the time window, per key (the
/// nonces of requests that change something are also kept in the database).
#[derive(Debug, Clone)]
pub struct Gate {
    mode: AuthMode,
    nonces: Arc<Mutex<NonceTable>>,
}

/// Per key, the nonces seen and until when they can pass the time check.
type NonceTable = HashMap<String, HashMap<[u8; 16], u64>>;

/// Why a nonce was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NonceRefusal {
    /// Seen before: a replay.
    Seen,
    /// This key has [`MAX_NONCES_PER_KEY`] requests in the window.
    TooMany,
}

/// The routes anyone may `GET`: the API's description, the metrics, and the public key
/// lease tokens are signed with.
pub const PUBLIC: [&str; 3] = ["/openapi.json", "/metrics", "/v1/signing-key"];

impl Gate {
    /// A gate in `mode`.
    pub fn new(mode: AuthMode) -> Gate {
        Gate {
            mode,
            nonces: Arc::default(),
        }
    }

    /// Its mode.
    pub fn mode(&self) -> AuthMode {
        self.mode
    }

    /// Records `key`'s `nonce` (of a request signed at `ts_ms`) until the request can
    /// no longer pass the time check.
    pub fn take_nonce(
        &self,
        key: &str,
        nonce: [u8; 16],
        ts_ms: u64,
        now: u64,
    ) -> Result<(), NonceRefusal> {
        let mut all = self.nonces.lock().unwrap_or_else(PoisonError::into_inner);
        let seen = all.entry(key.to_string()).or_default();
        if seen.len() >= MAX_NONCES_PER_KEY / 2 {
            seen.retain(|_, until| *until > now);
        }
        if seen.contains_key(&nonce) {
            return Err(NonceRefusal::Seen);
        }
        if seen.len() >= MAX_NONCES_PER_KEY {
            return Err(NonceRefusal::TooMany);
        }
        seen.insert(nonce, ts_ms.saturating_add(MAX_SKEW_MS));
        Ok(())
    }
}

/// What a key that is not enrolled may ask: to redeem a join token, and under trust on
/// first use to register a provider.
pub fn unenrolled_may_call(mode: AuthMode, method: &str, path: &str) -> bool {
    path == "/v1/join"
        || (mode
            == AuthMode::Signed {
                trust_first_use: true,
            }
            && method == "PUT"
            && path.starts_with("/v1/providers/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nonce_passes_once_and_a_busy_key_does_not_block_the_others() {
        let g = Gate::new(AuthMode::Signed {
            trust_first_use: false,
        });
        assert_eq!(g.take_nonce("a", [1; 16], 1000, 1000), Ok(()));
        assert_eq!(
            g.take_nonce("a", [1; 16], 1000, 2000),
            Err(NonceRefusal::Seen)
        );
        assert_eq!(g.take_nonce("b", [1; 16], 1000, 2000), Ok(()));
        for i in 0..MAX_NONCES_PER_KEY as u64 {
            let mut n = [0u8; 16];
            n[..8].copy_from_slice(&i.to_le_bytes());
            n[15] = 9;
            let _ = g.take_nonce("flood", n, 3000, 3000);
        }
        assert_eq!(
            g.take_nonce("flood", [7; 16], 3000, 3000),
            Err(NonceRefusal::TooMany)
        );
        assert_eq!(g.take_nonce("b", [2; 16], 3000, 3000), Ok(()));
        // Once the window has passed, the flooding key's nonces are dropped.
        let later = 3000 + MAX_SKEW_MS + 1;
        assert_eq!(g.take_nonce("flood", [7; 16], later, later), Ok(()));
    }
}
