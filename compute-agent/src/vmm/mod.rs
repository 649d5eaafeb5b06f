//! VMM glue: live attach and detach into running VMs.
//!
//! - [`qmp`] and [`qemu`]: QEMU, through its QMP socket;
//! - [`cloud_hypervisor`]: Cloud Hypervisor, through its REST API socket;
//! - [`link_watch`]: a lent NIC's link followed into a QEMU guest.

pub mod cloud_hypervisor;
pub mod link_watch;
pub mod qemu;
pub mod qmp;
