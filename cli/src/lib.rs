//! The `devlend` command-line tool, as a library for the binary and for tests.
//!
//! - [`blk_client`]: a vhost-user-blk frontend built on the `blkio` crate (libblkio's
//!   `virtio-blk-vhost-user` driver), used by `devlend demo` and by tests;
//! - [`api_client`]: the compute agent's control API over its unix socket;
//! - [`output`]: what attach prints (QEMU arguments, libvirt XML) and status tables;
//! - [`demo`]: the local end-to-end demo (the README's main job);
//! - [`bench`]: `devlend bench`, block performance beside qemu-storage-daemon;
//! - [`placement`]: `devlend attach --class ...`, a device leased from the pool;
//! - [`verify`]: `devlend verify`, a verified workload for tests (e.g. inside a guest);
//! - [`stress`]: `devlend stress`, a matrix of deep workloads that must never stall;
//! - [`pool_cmd`]: `devlend pool serve|devices|leases|providers`.

pub mod api_client;
pub mod bench;
pub mod blk_client;
pub mod demo;
pub mod gateway_cmd;
pub mod migrate_cmd;
pub mod output;
pub mod pattern;
pub mod placement;
pub mod pool_auth;
pub mod pool_cmd;
pub mod qos_args;
pub mod stress;
pub mod verify;
