//! Who may call the pool, and what they may do.
//!
//! Every request but three public ones (`GET /openapi.json`, `GET /metrics`,
//! `GET /v1/signing-key`) must be signed with an Ed25519 key ([`request`]) that the pool
//! has enrolled as a [`Principal`](crate::api::Principal): an admin, a lender (its
//! provider name) or a compute host (its host name). Keys are enrolled by an admin
//! (`POST /v1/principals`), by a one-time join token redeemed with the key
//! (`POST /v1/join`), or, for lenders, at their first registration when the pool was
//! started with trust on first use. `docs/security.md` has the whole model.
//!
//! - [`request`]: the signature format, used by the client too;
//! - [`caller`]: what a request's signer may do, checked by each route;
//! - [`gate`]: the mode, the nonces seen per key, which routes are public; the HTTP
//!   middleware that applies them is `http/authenticate.rs`. Enrollment (pinning
//!   keys, join tokens) is `enroll.rs`, beside the service's other operations.

pub mod request;

#[cfg(feature = "server")]
pub mod caller;
#[cfg(feature = "server")]
pub mod gate;

#[cfg(feature = "server")]
pub use caller::Caller;
#[cfg(feature = "server")]
pub use gate::{AuthMode, Gate};
