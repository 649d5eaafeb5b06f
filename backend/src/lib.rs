//! devlend's vhost-user device backends, run by the compute agent (the borrower).
//!
//! [`blk`] is a vhost-user-blk backend: it pops descriptor chains from the guest's
//! virtqueues, validates them (virtio 1.2 §5.2.6), sends the requests to the lender over
//! one fabric connection per virtqueue, and returns completions to the used ring.
//! Payloads move between the socket and guest memory directly ([`guest`]).
//!
//! [`net`] is a vhost-user-net backend; [`pci`] a vfio-user server for a lent PCIe
//! function. [`attachment`] serves one lent device of any kind on its socket. [`virtq`] holds the checks of a virtqueue the driver may have corrupted;
//! [`budget`] bounds the vhost-user messages a VMM may send an attachment;
//! [`vhost_glue`] is the `vhost-user-backend` glue the block and NIC backends share.

pub mod attachment;
pub mod blk;
pub mod budget;
pub mod guest;
pub mod handover;
pub mod lender;
pub mod net;
pub mod pci;
mod shared_map;
pub mod sigbus;
pub mod vhost_glue;
pub mod virtq;
