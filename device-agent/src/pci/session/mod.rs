//! A PCI session per transport: the message loop around a [`crate::pci::lending`].
//!
//! - [`tcp`]: over TCP (or TLS): requests read from the stream, interrupts sent by a
//!   second thread; pushes carry the pages' data, a pull answers with them;
//! - [`rdma`] (feature `rdma`): over RDMA: one thread for messages and interrupts,
//!   the mirrors kept in sync one-sided.

#[cfg(feature = "rdma")]
pub(crate) mod rdma;
pub(crate) mod tcp;
