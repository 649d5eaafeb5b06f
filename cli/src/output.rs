//! What the CLI prints for people.

use devlend_compute_agent::api::{
    AttachmentInfo, BlockInfo, CoherenceMode, HandoverState, KindInfo, NicInfo, PciInfo,
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

/// A NIC attachment's link as people are told it: the guest's link is up once the
/// lender's is and a VMM runs every queue pair, so a NIC with no VMM yet is not "down"
/// when the lender's link is up.
#[derive(Clone, Copy, PartialEq, Eq)]
enum NicLinkState {
    /// The guest's link is up.
    Up,
    /// The lender's link is up and no VMM has joined the socket yet.
    UpNoVmm,
    /// The lender's link is up, a VMM joined, not every queue pair is connected.
    Connecting,
    /// The lender's link is down.
    Down,
}

fn nic_link_state(n: &NicInfo, connected: bool) -> NicLinkState {
    match (n.link_up, n.lender_link_up, connected) {
        (true, _, _) => NicLinkState::Up,
        (false, true, false) => NicLinkState::UpNoVmm,
        (false, true, true) => NicLinkState::Connecting,
        (false, false, _) => NicLinkState::Down,
    }
}

/// How `devlend attach` words a NIC's link (`connected`: a VMM has joined the socket).
pub fn nic_link_words(n: &NicInfo, connected: bool) -> &'static str {
    match nic_link_state(n, connected) {
        NicLinkState::Up => "link up",
        NicLinkState::UpNoVmm => {
            "link up on the lender (the guest's link follows once a VMM joins the socket)"
        }
        NicLinkState::Connecting => "link up on the lender, queue pairs connecting",
        NicLinkState::Down => "link down on the lender",
    }
}

/// The LINK column of a NIC: `up` when the guest's link is, and, with no VMM joined
/// yet, when the lender's is (STATE says `waiting`); `down` otherwise; `-` while
/// restoring.
fn nic_link_column(a: &AttachmentInfo, n: &NicInfo) -> &'static str {
    if a.restoring.is_some() {
        return "-";
    }
    match nic_link_state(n, a.connected) {
        NicLinkState::Up | NicLinkState::UpNoVmm => "up",
        NicLinkState::Connecting | NicLinkState::Down => "down",
    }
}

/// The `devlend status` tables, one per kind, each with that kind's own columns: disks
/// with the rates of the last seconds (IOPS, MB/s read and written, p99 latency upper
/// bound; [`disk_table`]), lent NICs with their frame counters ([`nic_table`]), PCIe
/// functions with their address, IDs and DMA-mapped bytes ([`pci_table`]); then a line
/// per attachment with lease limits or waiting to be restored.
pub fn status_table(list: &[AttachmentInfo]) -> String {
    if list.is_empty() {
        return "no attachments\n".to_owned();
    }
    let (mut disks, mut nics, mut pcis): (Vec<_>, Vec<_>, Vec<_>) = Default::default();
    for a in list {
        match &a.part {
            KindInfo::Block(b) => disks.push((a, b)),
            KindInfo::Nic(n) => nics.push((a, n)),
            KindInfo::Pci(p) => pcis.push((a, p)),
        }
    }
    let tables = [
        (!disks.is_empty()).then(|| disk_table(&disks)),
        (!nics.is_empty()).then(|| nic_table(&nics)),
        (!pcis.is_empty()).then(|| pci_table(&pcis)),
    ];
    let mut out = tables.into_iter().flatten().collect::<Vec<_>>().join("\n");
    if let Some(ms) = list.iter().find_map(|a| a.pool_unreachable_since_ms) {
        out.push_str(&pool_unreachable_line(ms, std::time::SystemTime::now()));
    }
    for a in list {
        let throttled = a
            .block()
            .and_then(|b| b.rates)
            .map_or(0.0, |r| r.throttled_per_s);
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

/// The line `devlend status` prints while the agent cannot reach its device pool.
fn pool_unreachable_line(since_ms: u64, now: std::time::SystemTime) -> String {
    let since = std::time::UNIX_EPOCH + std::time::Duration::from_millis(since_ms);
    let ago = now.duration_since(since).unwrap_or_default().as_secs();
    format!(
        "device pool unreachable since {} ({ago} s): the devices go on; lease renewals are retried\n",
        httpdate::fmt_http_date(since)
    )
}

/// One line per lent NIC: link, queue pairs, frames and bytes each way (RX: to the
/// guest, TX: from it), drops each way, errors.
pub fn nic_table(list: &[(&AttachmentInfo, &NicInfo)]) -> String {
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
    for (a, n) in list {
        let t = &n.counters;
        out.push_str(&format!(
            "{:<14} {:<10} {:<21} {:<4} {:>2} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8} {:>6}  {:<11} {}\n",
            a.id,
            a.device,
            a.lender,
            nic_link_column(a, n),
            n.queue_pairs,
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

/// One line per borrowed PCIe function: its address on the lender, vendor:device IDs,
/// coherence mode, DMA-mapped bytes, region accesses, mirror pages each way and
/// interrupts.
pub fn pci_table(list: &[(&AttachmentInfo, &PciInfo)]) -> String {
    let mut out = format!(
        "{:<14} {:<10} {:<21} {:<9} {:<13} {:<9} {:<8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8}  {:<11} {}\n",
        "PCI",
        "DEVICE",
        "LENDER",
        "TRANSPORT",
        "BDF",
        "ID",
        "MODE",
        "DMA",
        "RD",
        "WR",
        "PUSHED",
        "PULLED",
        "IRQS",
        "STATE",
        "SOCKET"
    );
    for (a, p) in list {
        let c = &p.counters;
        let ids = match (p.vendor_id, p.device_id) {
            (Some(v), Some(d)) => format!("{v:04x}:{d:04x}"),
            _ => "-".to_owned(),
        };
        out.push_str(&format!(
            "{:<14} {:<10} {:<21} {:<9} {:<13} {:<9} {:<8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8}  {:<11} {}\n",
            a.id,
            a.device,
            a.lender,
            transport(a),
            if p.bdf.is_empty() { "-" } else { p.bdf.as_str() },
            ids,
            match p.coherence {
                Some(CoherenceMode::Mirror) => "mirror",
                Some(CoherenceMode::Mediated) => "mediated",
                None => "-",
            },
            human_bytes(p.dma_mapped_bytes),
            c.region_reads,
            c.region_writes,
            c.pages_pushed,
            c.pages_pulled,
            c.irqs,
            state(a),
            a.socket.display()
        ));
    }
    out
}

fn transport(a: &AttachmentInfo) -> &str {
    if a.transport.is_empty() {
        "tcp"
    } else {
        a.transport.as_str()
    }
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

/// One line per disk: transport, size, queues, the rates of the last seconds, errors,
/// requests in flight, state, lease.
pub fn disk_table(list: &[(&AttachmentInfo, &BlockInfo)]) -> String {
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
    for (a, b) in list {
        let c = &b.counters;
        let r = b.rates.unwrap_or_default();
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
            transport(a),
            if a.restoring.is_some() {
                "-".to_owned()
            } else {
                human_bytes(b.capacity_sectors * 512)
            },
            b.queues,
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

#[cfg(test)]
mod status_tests {
    use devlend_compute_agent::api::{
        AttachmentInfo, BlockInfo, CoherenceMode, DeviceKind, IoCounters, KindInfo, NetCounters,
        NicInfo, PciCounters, PciInfo, Rates,
    };

    use super::{nic_link_words, status_table};

    fn info(id: &str, part: KindInfo) -> AttachmentInfo {
        AttachmentInfo {
            id: id.into(),
            lender: "10.0.0.9:7700".into(),
            device: format!("{id}-dev"),
            socket: format!("/run/devlend/{id}.sock").into(),
            connected: true,
            vmm: None,
            lease: None,
            limits: None,
            lease_ended: false,
            pool_unreachable_since_ms: None,
            handover: None,
            lender_lost: false,
            transport: "tcp".into(),
            restoring: None,
            part,
        }
    }

    #[test]
    fn status_says_since_when_the_pool_is_unreachable_and_that_devices_go_on() {
        let since = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000);
        let line = super::pool_unreachable_line(
            1_800_000_000_000,
            since + std::time::Duration::from_secs(42),
        );
        assert_eq!(
            line,
            "device pool unreachable since Fri, 15 Jan 2027 08:00:00 GMT (42 s): the devices go on; lease renewals are retried\n"
        );
        let mut a = info("d1", KindInfo::Block(Default::default()));
        assert!(!status_table(std::slice::from_ref(&a)).contains("unreachable"));
        a.pool_unreachable_since_ms = Some(1_800_000_000_000);
        assert!(status_table(&[a]).contains("device pool unreachable since Fri, 15 Jan 2027"));
    }

    fn block() -> AttachmentInfo {
        info(
            "disk0",
            KindInfo::Block(BlockInfo {
                queues: 2,
                queue_size: 256,
                capacity_sectors: 2 * 1024 * 1024,
                block_size: 512,
                read_only: false,
                serial: "SN1".into(),
                counters: IoCounters {
                    errors: 3,
                    inflight: 4,
                    ..IoCounters::default()
                },
                rates: Some(Rates {
                    iops: 1234.0,
                    ..Rates::default()
                }),
            }),
        )
    }

    fn nic() -> AttachmentInfo {
        info(
            "nic0",
            KindInfo::Nic(NicInfo {
                queue_pairs: 2,
                queue_size: 256,
                mac: "52:54:00:12:34:56".into(),
                mtu: 1500,
                link_up: true,
                lender_link_up: true,
                reconnects: 0,
                counters: NetCounters {
                    rx_packets: 777,
                    tx_packets: 888,
                    ..NetCounters::default()
                },
                pairs: Vec::new(),
            }),
        )
    }

    fn pci() -> AttachmentInfo {
        info(
            "fpga0",
            KindInfo::Pci(PciInfo {
                bdf: "0000:03:00.0".into(),
                vendor_id: Some(0x1234),
                device_id: Some(0x11e8),
                coherence: Some(CoherenceMode::Mirror),
                dma_mapped_bytes: 2 << 20,
                counters: PciCounters {
                    region_reads: 41,
                    region_writes: 42,
                    pages_pushed: 43,
                    pages_pulled: 44,
                    irqs: 45,
                },
            }),
        )
    }

    /// The header line and the attachment's line of the table whose header starts with
    /// `title`, as columns.
    fn table(out: &str, title: &str, id: &str) -> (Vec<String>, Vec<String>) {
        let mut lines = out.lines().skip_while(|l| !l.starts_with(title));
        let head = lines
            .next()
            .unwrap_or_else(|| panic!("no {title} table:\n{out}"));
        let row = lines
            .take_while(|l| !l.is_empty())
            .find(|l| l.starts_with(id))
            .unwrap_or_else(|| panic!("no {id} in the {title} table:\n{out}"));
        let cols = |l: &str| {
            l.split("  ")
                .filter(|c| !c.trim().is_empty())
                .map(|c| c.trim().to_owned())
                .collect()
        };
        (cols(head), cols(row))
    }

    /// Found in a trial (issue 40): a migration's destination needs the source's device
    /// ids, and the printed `-device` had none (only the chardev had one).
    #[test]
    fn the_printed_qemu_devices_carry_their_ids() {
        let blk = super::qemu_args(&block());
        assert!(
            blk.contains(
                "-device vhost-user-blk-pci,chardev=devlend-disk0,num-queues=2,queue-size=256,id=devlend-disk0"
            ),
            "{blk}"
        );
        let net = super::qemu_args(&nic());
        let device = net
            .lines()
            .find(|l| l.contains("-device virtio-net-pci,"))
            .unwrap_or_else(|| panic!("{net}"));
        assert!(device.trim_end().ends_with(",id=devlend-nic0"), "{net}");
    }

    /// Found in a trial: `devlend status` showed LINK `down` for a NIC whose lender's
    /// link was up while no VMM had joined yet.
    #[test]
    fn the_nic_link_column_follows_the_lender_until_a_vmm_joins() {
        let row = |link_up, lender_link_up, connected| {
            let mut a = nic();
            a.connected = connected;
            if let KindInfo::Nic(n) = &mut a.part {
                n.link_up = link_up;
                n.lender_link_up = lender_link_up;
            }
            let out = status_table(&[a]);
            let line = out
                .lines()
                .find(|l| l.starts_with("nic0"))
                .expect("the NIC's row");
            line.split_whitespace().nth(3).expect("LINK").to_owned()
        };
        assert_eq!(row(false, true, false), "up", "no VMM yet, lender up");
        assert_eq!(
            row(false, true, true),
            "down",
            "VMM joined, pairs not connected"
        );
        assert_eq!(row(false, false, false), "down", "lender down");
        assert_eq!(row(true, true, true), "up");
    }

    /// Found in a trial: `devlend attach` of a NIC said "link down" when no VMM had
    /// joined yet, though the lender's link was up.
    #[test]
    fn a_nic_without_a_vmm_is_not_called_down_when_the_lenders_link_is_up() {
        let mut n = match nic().part {
            KindInfo::Nic(n) => n,
            _ => unreachable!(),
        };
        n.link_up = false;
        let words = nic_link_words(&n, false);
        assert!(words.starts_with("link up on the lender"), "{words}");
        assert!(!words.contains("down"), "{words}");
        n.lender_link_up = false;
        assert_eq!(nic_link_words(&n, false), "link down on the lender");
        n.link_up = true;
        n.lender_link_up = true;
        assert_eq!(nic_link_words(&n, true), "link up");
    }

    #[test]
    fn each_kind_has_its_own_table_and_columns() {
        let out = status_table(&[block(), nic(), pci()]);
        // Three tables, each attachment in its kind's only.
        for (title, id, others) in [
            ("ID ", "disk0", ["nic0", "fpga0"]),
            ("NIC ", "nic0", ["disk0", "fpga0"]),
            ("PCI ", "fpga0", ["disk0", "nic0"]),
        ] {
            let section: String = out
                .lines()
                .skip_while(|l| !l.starts_with(title))
                .take_while(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join("\n");
            assert!(section.contains(id), "{out}");
            for o in others {
                assert!(!section.contains(o), "{o} in the {title} table:\n{out}");
            }
        }
        let disk = out.lines().find(|l| l.starts_with("disk0")).unwrap();
        assert!(disk.contains("1.0 GiB"), "{disk}");
        assert!(disk.contains("1234"), "{disk}");
        let (head, _) = table(&out, "ID ", "disk0");
        assert!(head.iter().any(|h| h.contains("IOPS")), "{head:?}");
        assert!(!head
            .iter()
            .any(|h| h.contains("RX PKTS") || h.contains("BDF")));

        let line = out.lines().find(|l| l.starts_with("nic0")).unwrap();
        for want in ["up", "777", "888"] {
            assert!(line.contains(want), "{want} in {line}");
        }
        assert!(!line.contains("GiB"), "{line}");
        let (head, _) = table(&out, "NIC ", "nic0");
        assert!(head.iter().any(|h| h.contains("RX PKTS")), "{head:?}");
        assert!(!head
            .iter()
            .any(|h| h.contains("IOPS") || h.contains("SIZE")));

        let line = out.lines().find(|l| l.starts_with("fpga0")).unwrap();
        for want in [
            "0000:03:00.0",
            "1234:11e8",
            "mirror",
            "2.0 MiB",
            "41",
            "42",
            "43",
            "44",
            "45",
        ] {
            assert!(line.contains(want), "{want} in {line}");
        }
        let (head, _) = table(&out, "PCI ", "fpga0");
        for want in ["BDF", "ID", "MODE", "DMA", "IRQS"] {
            assert!(head.iter().any(|h| h.contains(want)), "{want} in {head:?}");
        }
        assert!(!head
            .iter()
            .any(|h| h.contains("IOPS") || h.contains("SIZE") || h.contains("ERRORS")));
    }

    #[test]
    fn a_restoring_attachment_is_listed_in_its_kind_table() {
        for (kind, title) in [
            (DeviceKind::Block, "ID "),
            (DeviceKind::Nic, "NIC "),
            (DeviceKind::Pci, "PCI "),
        ] {
            let mut a = info("r0", KindInfo::empty(kind));
            a.connected = false;
            a.restoring = Some("lender unreachable".into());
            let out = status_table(&[a]);
            assert!(out.starts_with(title), "{kind}:\n{out}");
            let line = out.lines().nth(1).unwrap();
            assert!(
                line.starts_with("r0") && line.contains("restoring"),
                "{line}"
            );
            assert!(out.contains("r0: saved before a restart"), "{out}");
        }
    }

    #[test]
    fn status_json_has_each_kinds_own_fields() {
        let v = serde_json::to_value([block(), nic(), pci()]).unwrap();
        assert_eq!(v[0]["kind"], "block");
        assert_eq!(v[0]["capacity_sectors"], 2 * 1024 * 1024);
        assert_eq!(v[1]["kind"], "nic");
        assert_eq!(v[1]["mac"], "52:54:00:12:34:56");
        assert!(v[1].get("capacity_sectors").is_none());
        assert_eq!(v[2]["kind"], "pci");
        assert_eq!(v[2]["bdf"], "0000:03:00.0");
        assert_eq!(v[2]["dma_mapped_bytes"], 2 << 20);
        assert!(v[2].get("serial").is_none() && v[2].get("queues").is_none());
    }
}
