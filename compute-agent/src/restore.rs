//! Serving the saved attachments again when the compute agent starts.
//!
//! Each attachment in the state file ([`crate::state`]) is started again on its socket
//! with its borrower identity and token. One whose lender cannot be reached yet is
//! retried, every 1 s doubling to 10 s, and stays in the state file meanwhile; one that
//! can never start (its lease ended, its socket taken, a damaged entry) is dropped with
//! an error in the log.

use std::sync::Arc;
use std::time::Duration;

use crate::registry::{Registry, RegistryError};
use crate::state::SavedAttachment;

const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// Whether a failed restore can succeed later (the lender or the pool being away).
fn retryable(e: &RegistryError) -> bool {
    matches!(
        e,
        RegistryError::Start(_) | RegistryError::Lease(crate::lease::LeaseError::Pool(_))
    )
}

/// Restores `saved` on a new thread (the API serves meanwhile).
///
/// # Errors
/// The thread cannot be started.
pub fn spawn(registry: Arc<Registry>, saved: Vec<SavedAttachment>) -> std::io::Result<()> {
    registry.set_restoring(saved.clone());
    std::thread::Builder::new()
        .name("restore".into())
        .spawn(move || run(&registry, saved))
        .map(|_| ())
}

fn run(registry: &Registry, mut waiting: Vec<SavedAttachment>) {
    tracing::info!(
        attachments = waiting.len(),
        "serving the saved attachments again"
    );
    let mut backoff = RETRY_MIN;
    loop {
        waiting.retain(|s| match registry.restore(s) {
            Ok(_) => {
                registry.restored(&s.id);
                false
            }
            Err(e) if retryable(&e) => {
                tracing::warn!(id = %s.id, error = %e, retry_s = backoff.as_secs(), "cannot serve the saved attachment yet; retrying");
                true
            }
            Err(e) => {
                tracing::error!(id = %s.id, error = %e, "cannot serve the saved attachment again; dropped");
                registry.restored(&s.id);
                false
            }
        });
        if waiting.is_empty() {
            return;
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}
