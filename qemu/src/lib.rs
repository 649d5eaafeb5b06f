//! devlend's QEMU guests, for the end-to-end tests and `devlend demo`.
//!
//! [`guest`] builds (through the embedded `build-guest.sh`, cached under
//! `/var/cache/devlend/guest`) and boots TCG guests, feeds them a test script and reads
//! their results from the serial console; [`firmware`] makes a disk that the guest's
//! firmware boots from; [`migration`] starts the destination QEMU of a live migration.
//! Live attach over QMP lives in the compute agent (`devlend_compute_agent::vmm`).

pub mod firmware;
pub mod guest;
pub mod migration;
