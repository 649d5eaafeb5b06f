//! devlend's lender: serves local block devices and regular files, network interfaces
//! and PCIe functions to borrowers over the fabric.
//!
//! A [`Lender`] opens the devices named by [`DeviceSpec`]s (one [`KindSpec`] each),
//! binds a TCP listener (and, with [`Lender::serve_rdma`], an rdma_cm one) and serves one
//! session per connection, each on its own thread: the handshake of
//! [`devlend_fabric::handshake`], then what the kind serves. A block device's requests
//! ([`devlend_fabric::wire`]) run on the backing file through one device-I/O layer for
//! TCP and RDMA alike: io_uring, or plain system calls for files in memory (see
//! [`IoMode`]), many in flight, answered in completion order. A NIC moves frames
//! ([`devlend_fabric::net`]), a PCIe function its regions, interrupts and DMA
//! ([`pci`]).
//!
//! The modules are layered (server → sessions → lender state → device I/O → the lent
//! device → the kinds → leaves; `docs/architecture.md`, "The lender's modules").
//!
//! Limits (advertised in the handshake, enforced per request):
//! [`MAX_TRANSFER_BYTES`], [`MAX_DISCARD_SECTORS`], [`MAX_WRITE_ZEROES_SECTORS`]; per
//! session at most [`MAX_IN_FLIGHT`] requests and [`MAX_IN_FLIGHT_BYTES`] of data buffers
//! in flight: the credit granted to a borrower that asks for it, beyond which the
//! session of one that does not stops reading its socket (TCP backpressure).
//!
//! Per-device counters ([`DeviceStatsSnapshot`]) are available from [`Lender::stats`] and
//! [`LenderHandle::stats`]; tests use them to check which I/O reached the device.
//!
//! Linux only (io_uring, `fallocate`, block device ioctls).

mod block;
pub mod config;
mod device;
mod device_counters;
pub mod error;
pub mod exposure;
mod holding;
mod kind;
mod kind_view;
pub mod leases;
pub mod metrics;
mod nic;
mod options;
pub mod pci;
pub mod pool_link;
mod qos;
mod server;
mod session;
pub mod stats;

pub use config::IoMode;
pub use config::{
    BlockSpec, Cli, Config, DeviceSpec, KindSpec, NetSpec, PciSpec, PfSpec, StoreSpec,
};
pub use error::Error;
pub use leases::LeaseGuard;
#[doc(hidden)]
pub use options::HoldFirstWrite;
pub use server::{
    DeviceQos, InventoryView, KindCounters, KindView, Lender, LenderHandle, LentDevice,
    NicCounters, Options, ReloadReport, StatsView,
};
pub use stats::DeviceStatsSnapshot;

/// Largest data length of one read or write request, in bytes (4 MiB), advertised as
/// `max_transfer`. Linux guests send at most 1.25 MiB per request by default, so the
/// borrower rarely has to split.
pub const MAX_TRANSFER_BYTES: u32 = 4 << 20;

/// Largest discard, in 512-byte sectors (4 Mi sectors = 2 GiB), advertised as
/// `max_discard_sectors`.
pub const MAX_DISCARD_SECTORS: u32 = 1 << 22;

/// Largest write-zeroes, in 512-byte sectors (4 Mi sectors = 2 GiB), advertised as
/// `max_write_zeroes_sectors`.
pub const MAX_WRITE_ZEROES_SECTORS: u32 = 1 << 22;

/// Most requests in flight on one session; a session that reaches it stops reading its
/// socket until a request completes.
pub const MAX_IN_FLIGHT: usize = 1024;

/// Most bytes of read/write data buffers in flight on one session (64 MiB); a session
/// that reaches it stops reading its socket until a request completes.
pub const MAX_IN_FLIGHT_BYTES: usize = 64 << 20;

/// Largest serial in bytes (virtio-blk's device ID string, 20 bytes).
pub const MAX_SERIAL_LEN: usize = devlend_fabric::SERIAL_LEN;
