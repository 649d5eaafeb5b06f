//! What the CLI prints for people.

use devlend_compute_agent::api::{AttachmentInfo, HandoverState};

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

/// The QEMU arguments of a lent NIC: `-netdev vhost-user` and `virtio-net-pci`, with
/// the lender's MAC and MTU (`host_mtu`), and multiqueue when it has several pairs.
pub fn qemu_net_args(a: &AttachmentInfo) -> String {
    let id = format!("devlend-{}", a.id);
    let (mac, mtu) = a
        .net
        .as_ref()
        .map_or((String::new(), 1500), |n| (n.mac.clone(), n.mtu));
    let (queues, mq) = if a.queues > 1 {
        (
            format!(",queues={}", a.queues),
            format!(",mq=on,vectors={}", 2 * u32::from(a.queues) + 2),
        )
    } else {
        (String::new(), String::new())
    };
    format!(
        "-object memory-backend-memfd,id=mem,size=<guest RAM>,share=on -numa node,memdev=mem \\\n  \
         -chardev socket,id={id},path={},reconnect-ms=1000 \\\n  \
         -netdev vhost-user,id={id},chardev={id}{queues} \\\n  \
         -device virtio-net-pci,netdev={id},mac={mac},host_mtu={mtu}{mq},rx_queue_size={qs},tx_queue_size={qs}",
        a.socket.display(),
        qs = a.queue_size,
    )
}

/// A libvirt `<interface type='vhostuser'>` element for a lent NIC. libvirt 9.0 fails to
/// start a domain whose vhostuser interface has an `<mtu>` ("Cannot set interface MTU on
/// '(null)'"): the MTU goes in a comment.
pub fn libvirt_net_xml(a: &AttachmentInfo) -> String {
    let (mac, mtu) = a
        .net
        .as_ref()
        .map_or((String::new(), 1500), |n| (n.mac.clone(), n.mtu));
    format!(
        "<interface type='vhostuser'>\n  \
         <mac address='{mac}'/>\n  \
         <source type='unix' path='{}' mode='client'>\n    <reconnect enabled='yes' timeout='1'/>\n  </source>\n  \
         <model type='virtio'/>\n  \
         <driver queues='{}' rx_queue_size='{qs}' tx_queue_size='{qs}'/>\n  \
         <!-- the lender's MTU is {mtu}: set it in the guest (libvirt 9.0 refuses <mtu> here) -->\n</interface>\n\
         <!-- the domain needs shared memory: <memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking> -->",
        a.socket.display(),
        a.queues,
        qs = a.queue_size,
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

/// The QEMU arguments that join the attachment's socket.
pub fn qemu_args(a: &AttachmentInfo) -> String {
    if a.kind == "nic" {
        return qemu_net_args(a);
    }
    let id = format!("devlend-{}", a.id);
    let mq = if a.queues > 1 {
        format!(",num-queues={}", a.queues)
    } else {
        String::new()
    };
    format!(
        "-object memory-backend-memfd,id=mem,size=<guest RAM>,share=on -numa node,memdev=mem \\\n  \
         -chardev socket,id={id},path={},reconnect-ms=1000 \\\n  \
         -device vhost-user-blk-pci,chardev={id}{mq},queue-size={}",
        a.socket.display(),
        a.queue_size
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
    if a.kind == "nic" {
        return libvirt_net_xml(a);
    }
    let ro = if a.read_only { "\n  <readonly/>" } else { "" };
    format!(
        "<disk type='vhostuser' device='disk'>\n  \
         <driver name='qemu' type='raw' queues='{}'/>\n  \
         <source type='unix' path='{}'>\n    <reconnect enabled='yes' timeout='1'/>\n  </source>\n  \
         <target dev='{dev}' bus='virtio'/>{ro}\n  \
         <!-- the guest sees serial {}: /dev/disk/by-id/virtio-{}; target dev is libvirt's name only -->\n</disk>\n\
         <!-- the domain needs shared memory: <memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking> -->",
        a.queues,
        a.socket.display(),
        a.serial,
        a.serial,
    )
}

/// The `devlend status` tables: one line per disk, with the rates of the last seconds
/// (IOPS, MB/s read and written, p99 latency upper bound), then one line per lent NIC
/// with its frame counters ([`nic_table`]).
pub fn status_table(list: &[AttachmentInfo]) -> String {
    if list.is_empty() {
        return "no attachments\n".to_owned();
    }
    let (nics, disks): (Vec<&AttachmentInfo>, Vec<&AttachmentInfo>) = list
        .iter()
        .partition(|a| a.kind == "nic" && a.net.is_some());
    let mut out = if disks.is_empty() {
        String::new()
    } else {
        disk_table(&disks)
    };
    if !nics.is_empty() {
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(&nic_table(&nics));
    }
    for a in list {
        let throttled = a.rates.as_ref().map_or(0.0, |r| r.throttled_per_s);
        match (&a.limits, throttled > 0.0) {
            (Some(q), _) => out.push_str(&format!(
                "{}: lease limits {q} (enforced by the lender); throttled now: {throttled:.0} requests/s\n",
                a.id
            )),
            (None, true) => out.push_str(&format!(
                "{}: the lender's limits throttle {throttled:.0} requests/s\n",
                a.id
            )),
            (None, false) => {}
        }
        if let Some(why) = &a.restoring {
            out.push_str(&format!(
                "{}: saved before a restart, not served yet (retrying): {why}\n",
                a.id
            ));
        }
    }
    out
}

/// One line per lent NIC: link, queue pairs, frames and bytes each way (RX: to the
/// guest, TX: from it), drops each way, errors.
pub fn nic_table(list: &[&AttachmentInfo]) -> String {
    let mut out = format!(
        "{:<14} {:<10} {:<21} {:<4} {:>2} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8} {:>6}  {:<11} {}\n",
        "NIC",
        "DEVICE",
        "LENDER",
        "LINK",
        "Q",
        "RX PKTS",
        "RX BYTES",
        "TX PKTS",
        "TX BYTES",
        "RX DROP",
        "TX DROP",
        "ERRORS",
        "STATE",
        "SOCKET"
    );
    for a in list {
        let Some(n) = &a.net else { continue };
        let t = &n.total;
        out.push_str(&format!(
            "{:<14} {:<10} {:<21} {:<4} {:>2} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8} {:>6}  {:<11} {}\n",
            a.id,
            a.device,
            a.lender,
            if n.link_up { "up" } else { "down" },
            a.queues,
            t.rx_packets,
            human_bytes(t.rx_bytes),
            t.tx_packets,
            human_bytes(t.tx_bytes),
            t.rx_drops,
            t.tx_drops,
            t.errors,
            state(a),
            a.socket.display()
        ));
    }
    out
}

fn state(a: &AttachmentInfo) -> &'static str {
    match (&a.vmm, a.connected) {
        _ if a.restoring.is_some() => "restoring",
        _ if a.lease_ended => "lease-ended",
        _ if a.lender_lost => "lender-lost",
        // A live migration's source (docs/migration.md).
        _ if a.handover == Some(HandoverState::LetGo) => "handed-over",
        _ if a.handover == Some(HandoverState::Asked) => "handing-over",
        (_, true) => "connected",
        (Some(_), false) => "unplugged",
        (None, false) => "waiting",
    }
}

fn disk_table(list: &[&AttachmentInfo]) -> String {
    let mut out = format!(
        "{:<14} {:<10} {:<21} {:<9} {:>8} {:>2} {:>8} {:>8} {:>8} {:>8} {:>6} {:>4}  {:<11} {:<8} {}\n",
        "ID",
        "DEVICE",
        "LENDER",
        "TRANSPORT",
        "SIZE",
        "Q",
        "IOPS",
        "RD MB/s",
        "WR MB/s",
        "P99",
        "ERRORS",
        "INFL",
        "STATE",
        "LEASE",
        "SOCKET"
    );
    for a in list {
        let c = &a.counters;
        let r = a.rates.unwrap_or_default();
        let p99 = match r.p99_us {
            Some(us) if us >= 1000 => format!("{}ms", us / 1000),
            Some(us) => format!("{us}us"),
            None => "-".to_owned(),
        };
        let state = state(a);
        out.push_str(&format!(
            "{:<14} {:<10} {:<21} {:<9} {:>8} {:>2} {:>8.0} {:>8.1} {:>8.1} {:>8} {:>6} {:>4}  {:<11} {:<8} {}\n",
            a.id,
            a.device,
            a.lender,
            if a.transport.is_empty() {
                "tcp"
            } else {
                a.transport.as_str()
            },
            if a.restoring.is_some() {
                "-".to_owned()
            } else {
                human_bytes(a.capacity_sectors * 512)
            },
            a.queues,
            r.iops,
            r.read_mb_s,
            r.write_mb_s,
            p99,
            c.errors,
            c.inflight,
            state,
            a.lease
                .map(|l| l.to_string()[..8].to_owned())
                .unwrap_or_else(|| "-".into()),
            a.socket.display()
        ));
    }
    out
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
