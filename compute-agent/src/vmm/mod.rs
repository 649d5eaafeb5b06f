//! VMM glue: live attach and detach into running VMs.
//!
//! - [`qmp`] and [`qemu`]: QEMU, through its QMP socket;
//! - [`cloud_hypervisor`]: Cloud Hypervisor, through its REST API socket.

pub mod cloud_hypervisor;
pub mod qemu;
pub mod qmp;
