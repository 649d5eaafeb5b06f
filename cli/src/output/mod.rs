//! What the CLI prints for people: `vmm_args` (what `devlend attach` gives the VMM:
//! QEMU arguments, libvirt XML, vfio-user arguments), `link` (how a NIC's link is
//! worded) and `status` (the `devlend status` tables).

mod link;
mod status;
#[cfg(test)]
mod status_tests;
mod vmm_args;

pub use link::nic_link_words;
pub use status::{disk_table, nic_table, pci_table, status_table};
pub use vmm_args::{
    libvirt_net_xml, libvirt_target_dev, libvirt_xml, qemu_args, qemu_net_args, vfio_user_args,
};

/// Formats a byte count with a binary unit (`1.0 GiB`).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
