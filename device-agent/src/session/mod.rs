//! The session layer: one borrower connection, from its hello to its end, whatever its
//! transport and whatever it lends.
//!
//! - [`admit`]: the checks of a hello that every transport shares (version, device,
//!   lease, one borrower per device, the session limit);
//! - [`open`]: how an admitted hello becomes its kind's session (each kind opens its
//!   own through [`crate::kind::LentKind`]);
//! - [`tcp`]: a TCP (or TLS) connection: handshake, then the block engine
//!   (`crate::block::tcp`), a NIC queue pair ([`crate::nic`]) or a PCI session
//!   ([`crate::pci::session::tcp`]);
//! - [`rdma`] (feature `rdma`): an rdma_cm connection: hello, then the block engine
//!   over RDMA (`crate::block::rdma`) or a PCI session ([`crate::pci::session::rdma`]);
//! - [`possession`]: the borrower's proof that it holds its token's key, read between
//!   the hello and its admission;
//! - [`end`]: how a session ended, for the log and the counters.
//!
//! This layer only reads the hello, admits it and answers it; each kind runs its own
//! sessions (the block kind's engines and their device I/O live under `crate::block`).
//! Above it, the server (`server/`) accepts the connections and starts a session each.

pub(crate) mod admit;
pub(crate) mod end;
pub(crate) mod open;
pub(crate) mod possession;
#[cfg(feature = "rdma")]
pub(crate) mod rdma;
pub(crate) mod tcp;
