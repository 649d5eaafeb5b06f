//! devlend's borrower daemon (the compute agent).
//!
//! It serves each attachment — a block device lent by a device agent — as a vhost-user-blk
//! socket that a VMM joins, and offers a local HTTP/JSON control API on a unix socket
//! ([`api`] types, [`server`] routes) that the `devlend` CLI drives.

pub mod api;
pub mod config;
pub mod lease;
pub mod metrics;
pub mod rates;
pub mod registry;
pub mod restore;
pub mod server;
pub mod state;
pub mod vmm;

/// Default path of the control API socket.
pub const DEFAULT_API_SOCKET: &str = "/run/devlend/compute-agent.sock";
