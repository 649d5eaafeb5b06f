//! devlend end-to-end test support: real agents, real vhost-user frontends
//! and real QEMU guests.
//!
//! The integration tests live in `tests/tests/*.rs`; this library holds what
//! they share.

pub mod agents;
pub mod netns;
pub use devlend_qemu::guest;
pub mod storage_daemon;
