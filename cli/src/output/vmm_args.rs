//! What `devlend attach` prints for the VMM: QEMU arguments, libvirt XML (a disk's or
//! a NIC's), vfio-user arguments for a PCIe function.

use devlend_compute_agent::api::{AttachmentInfo, KindInfo, NicInfo};

/// The QEMU arguments of a lent NIC: `-netdev vhost-user` and `virtio-net-pci`, with
/// the lender's MAC and MTU (`host_mtu`), and multiqueue when it has several pairs. The
/// device's `id` is `devlend-ID`, as the chardev's and netdev's: a migration's
/// destination, prepared with the same attachment id, prints the same ids.
pub fn qemu_net_args(a: &AttachmentInfo, n: &NicInfo) -> String {
    let id = format!("devlend-{}", a.id);
    let (mac, mtu) = (&n.mac, n.mtu);
    let (queues, mq) = if n.queue_pairs > 1 {
        (
            format!(",queues={}", n.queue_pairs),
            format!(",mq=on,vectors={}", 2 * u32::from(n.queue_pairs) + 2),
        )
    } else {
        (String::new(), String::new())
    };
    format!(
        "-object memory-backend-memfd,id=mem,size=<guest RAM>,share=on -numa node,memdev=mem \\\n  \
         -chardev socket,id={id},path={},reconnect-ms=1000 \\\n  \
         -netdev vhost-user,id={id},chardev={id}{queues} \\\n  \
         -device virtio-net-pci,netdev={id},mac={mac},host_mtu={mtu}{mq},rx_queue_size={qs},tx_queue_size={qs},id={id}",
        a.socket.display(),
        qs = n.queue_size,
    )
}

/// A libvirt `<interface type='vhostuser'>` element for a lent NIC. libvirt 9.0 fails to
/// start a domain whose vhostuser interface has an `<mtu>` ("Cannot set interface MTU on
/// '(null)'"): the MTU goes in a comment.
pub fn libvirt_net_xml(a: &AttachmentInfo, n: &NicInfo) -> String {
    let (mac, mtu) = (&n.mac, n.mtu);
    format!(
        "<interface type='vhostuser'>\n  \
         <mac address='{mac}'/>\n  \
         <source type='unix' path='{}' mode='client'>\n    <reconnect enabled='yes' timeout='1'/>\n  </source>\n  \
         <model type='virtio'/>\n  \
         <driver queues='{}' rx_queue_size='{qs}' tx_queue_size='{qs}'/>\n  \
         <!-- the lender's MTU is {mtu}: set it in the guest (libvirt 9.0 refuses <mtu> here) -->\n</interface>\n\
         <!-- the domain needs shared memory: <memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking> -->",
        a.socket.display(),
        n.queue_pairs,
        qs = n.queue_size,
    )
}

/// How Cloud Hypervisor and QEMU 11 join a PCIe function's vfio-user socket (the guest
/// memory must be shareable: the borrower maps it for the DMA mirror).
pub fn vfio_user_args(a: &AttachmentInfo) -> String {
    let sock = a.socket.display();
    format!(
        "Cloud Hypervisor:\n  --memory size=<guest RAM>,shared=on --user-device socket={sock},id=devlend-{id}\n\n\
         QEMU 11:\n  -object memory-backend-memfd,id=mem,size=<guest RAM>,share=on -numa node,memdev=mem \\\n    \
         -device '{{\"driver\":\"vfio-user-pci\",\"id\":\"devlend-{id}\",\"socket\":{{\"path\":\"{sock}\",\"type\":\"unix\"}}}}'",
        id = a.id
    )
}

/// The QEMU arguments that join the attachment's socket (a block device's or a NIC's;
/// a PCIe function's are [`vfio_user_args`]). The chardev and the device are both
/// `devlend-ID`: a migration's destination prepared with the same attachment id
/// (`devlend migrate prepare --id`) prints the same device ids as its source.
pub fn qemu_args(a: &AttachmentInfo) -> String {
    let b = match &a.part {
        KindInfo::Nic(n) => return qemu_net_args(a, n),
        KindInfo::Pci(_) => return vfio_user_args(a),
        KindInfo::Block(b) => b,
    };
    let id = format!("devlend-{}", a.id);
    let mq = if b.queues > 1 {
        format!(",num-queues={}", b.queues)
    } else {
        String::new()
    };
    format!(
        "-object memory-backend-memfd,id=mem,size=<guest RAM>,share=on -numa node,memdev=mem \\\n  \
         -chardev socket,id={id},path={},reconnect-ms=1000 \\\n  \
         -device vhost-user-blk-pci,chardev={id}{mq},queue-size={},id={id}",
        a.socket.display(),
        b.queue_size
    )
}

/// Checks a libvirt `<target dev=...>` name for a virtio disk: `vd` and one to three
/// lower-case letters (libvirt derives the disk's index from them).
///
/// # Errors
/// A message for clap when the name has another shape.
pub fn libvirt_target_dev(s: &str) -> Result<String, String> {
    let letters = s.strip_prefix("vd").unwrap_or("");
    if (1..=3).contains(&letters.len()) && letters.bytes().all(|b| b.is_ascii_lowercase()) {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a virtio disk name: `vd` and one to three letters (vdb, vdc, ...)"
        ))
    }
}

/// A libvirt `<disk type='vhostuser'>` element for the attachment, with target `dev`
/// (an `<interface>` for a NIC). libvirt 9.0 refuses `<serial>` in a vhostuser disk:
/// the guest reads the serial from devlend itself.
pub fn libvirt_xml(a: &AttachmentInfo, dev: &str) -> String {
    let b = match &a.part {
        KindInfo::Nic(n) => return libvirt_net_xml(a, n),
        KindInfo::Block(b) => b,
        // A PCIe function on vfio-user: libvirt has no element for it.
        KindInfo::Pci(_) => return String::new(),
    };
    let ro = if b.read_only { "\n  <readonly/>" } else { "" };
    format!(
        "<disk type='vhostuser' device='disk'>\n  \
         <driver name='qemu' type='raw' queues='{}'/>\n  \
         <source type='unix' path='{}'>\n    <reconnect enabled='yes' timeout='1'/>\n  </source>\n  \
         <target dev='{dev}' bus='virtio'/>{ro}\n  \
         <!-- the guest sees serial {}: /dev/disk/by-id/virtio-{}; target dev is libvirt's name only -->\n</disk>\n\
         <!-- the domain needs shared memory: <memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking> -->",
        b.queues,
        a.socket.display(),
        b.serial,
        b.serial,
    )
}

#[cfg(test)]
mod libvirt_tests {
    use super::libvirt_target_dev;

    #[test]
    fn libvirt_target_names_are_virtio_disk_names() {
        for ok in ["vdb", "vdz", "vdaa", "vdabc"] {
            assert_eq!(libvirt_target_dev(ok).as_deref(), Ok(ok));
        }
        for bad in ["", "vd", "sdb", "vdB", "vd1", "vdabcd", "vdb'/>"] {
            assert!(libvirt_target_dev(bad).is_err(), "{bad:?}");
        }
    }
}
