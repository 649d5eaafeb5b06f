//! Serving the saved attachments again when the compute agent starts.
//!
//! Each attachment in the state file ([`crate::state`]) is started again on its socket
//! with its borrower identity and token. One that cannot start yet (its lender or pool
//! unreachable, its socket held by another process, this agent started without the TLS
//! trust anchors it needs, ...) is retried, every 1 s doubling to 10 s: meanwhile it
//! stays in the state file, `status` lists it with the reason, its id and socket stay
//! reserved, and `detach` gives it up. Only one that can never start again is dropped,
//! with an error in the log: its lease has ended or its token is malformed, or its entry
//! is damaged.

use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::reconnect::{Attempt, Policy, Reconnector, SystemClock};

use crate::registry::{Registry, RegistryError};
use crate::state::SavedAttachment;

/// A round of attempts every 1 s doubling to 10 s, for as long as an attachment waits
/// (each is given up on its own, when hopeless).
const RETRY: Policy = Policy::backoff(Duration::from_secs(1), Duration::from_secs(10));

/// Whether a failed restore can never succeed: retrying it is pointless.
fn hopeless(e: &RegistryError) -> bool {
    matches!(
        e,
        RegistryError::Cancelled(_)
            | RegistryError::BadSaved(_)
            | RegistryError::Lease(
                crate::lease::LeaseError::Ended { .. } | crate::lease::LeaseError::Bad(_)
            )
    )
}

/// Restores `saved` on a new thread (the API serves meanwhile).
///
/// # Errors
/// The thread cannot be started.
/// `saved` must have been given to [`Registry::set_restoring`] first (which reserves
/// their ids and sockets and keeps them in the state file).
pub fn spawn(registry: Arc<Registry>, saved: Vec<SavedAttachment>) -> std::io::Result<()> {
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
    let round = |r: &Reconnector| {
        waiting.retain(|s| match registry.restore(s) {
            Ok(_) => {
                registry.restored(&s.id);
                false
            }
            Err(RegistryError::Cancelled(_)) => false,
            Err(e) if hopeless(&e) => {
                tracing::error!(id = %s.id, error = %e, "cannot serve the saved attachment again; dropped");
                registry.restored(&s.id);
                false
            }
            Err(e) => {
                let reason = e.to_string();
                tracing::warn!(id = %s.id, error = %reason, retry_s = r.next_wait().as_secs(), "cannot serve the saved attachment yet; retrying");
                registry.restore_failed(&s.id, &reason);
                true
            }
        });
        if waiting.is_empty() {
            Attempt::Done(())
        } else {
            Attempt::Failed(())
        }
    };
    // No deadline and no refusal for the round: it ends once every attachment is served
    // or dropped.
    let _ = Reconnector::new(RETRY).run(&SystemClock, round);
}
