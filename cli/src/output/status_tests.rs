//! Tests of the `devlend status` tables and of what `devlend attach` prints.

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
    let line = super::status::pool_unreachable_line(
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
            ..NicInfo::default()
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
            vm: Some("vm-blue".into()),
            counters: PciCounters {
                region_reads: 41,
                region_writes: 42,
                pages_pushed: 43,
                pages_pulled: 44,
                irqs: 45,
                guest_read_bytes: 1 << 10,
                guest_written_bytes: 2 << 10,
                peer_bytes: 3 << 20,
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
        "vm-blue",
        "3.0 MiB",
    ] {
        assert!(line.contains(want), "{want} in {line}");
    }
    let (head, _) = table(&out, "PCI ", "fpga0");
    for want in ["BDF", "ID", "MODE", "VM", "DMA", "IRQS", "P2P"] {
        assert!(head.iter().any(|h| h.contains(want)), "{want} in {head:?}");
    }
    assert!(!head
        .iter()
        .any(|h| h.contains("IOPS") || h.contains("SIZE") || h.contains("ERRORS")));
}

/// A function without a VM shows `-` in the VM column, and no peer-to-peer bytes.
#[test]
fn a_pci_function_without_a_vm_shows_a_dash() {
    let mut a = pci();
    if let KindInfo::Pci(p) = &mut a.part {
        p.vm = None;
        p.counters.peer_bytes = 0;
    }
    let out = status_table(&[a]);
    let head: Vec<&str> = out.lines().next().unwrap().split_whitespace().collect();
    let row: Vec<&str> = out.lines().nth(1).unwrap().split_whitespace().collect();
    let col = |name: &str| head.iter().position(|h| *h == name).unwrap();
    assert_eq!(row[col("VM")], "-", "{out}");
    // The human-readable sizes are two words: the P2P column is counted from the end.
    assert_eq!(row[row.len() - 4..row.len() - 2], ["0", "B"], "{out}");
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
    assert_eq!(v[2]["vm"], "vm-blue");
    assert_eq!(v[2]["counters"]["peer_bytes"], 3 << 20);
    assert_eq!(v[2]["counters"]["guest_read_bytes"], 1 << 10);
    assert_eq!(v[2]["counters"]["guest_written_bytes"], 2 << 10);
    assert!(v[2].get("serial").is_none() && v[2].get("queues").is_none());
}

#[test]
fn a_disk_with_several_paths_shows_each_and_its_failovers() {
    use devlend_fabric::io_counters::PathState;
    let mut a = block();
    let KindInfo::Block(b) = &mut a.part else {
        unreachable!()
    };
    // One path: no line.
    assert_eq!(
        super::status::paths_line("disk0", &b.counters.paths, 0, 0),
        ""
    );
    b.counters.paths = vec![
        PathState {
            addr: "10.0.0.2:7700".into(),
            sessions: 0,
            up: false,
            failures: 2,
        },
        PathState {
            addr: "10.0.1.2:7700".into(),
            sessions: 1,
            up: true,
            failures: 1,
        },
    ];
    b.counters.failovers = 3;
    b.counters.last_failover_us = 1_500;
    let line = super::status::paths_line("disk0", &b.counters.paths, 1, 1_500);
    assert!(line.contains("; 1 failover, the last"), "{line}");
    let out = status_table(&[a]);
    assert!(
        out.contains("disk0: paths 10.0.0.2:7700 DOWN (0 sessions, 2 failures), 10.0.1.2:7700 up (1 session, 1 failure); 3 failovers, the last took 2 ms"),
        "{out}"
    );
}

#[test]
fn a_nic_with_several_paths_shows_each_and_its_failovers() {
    use devlend_fabric::io_counters::PathState;
    let mut a = nic();
    assert!(!status_table(std::slice::from_ref(&a)).contains("paths"));
    let KindInfo::Nic(n) = &mut a.part else {
        unreachable!()
    };
    n.paths = vec![
        PathState {
            addr: "10.0.0.2:7700".into(),
            sessions: 2,
            up: true,
            failures: 1,
        },
        PathState {
            addr: "10.0.1.2:7700".into(),
            sessions: 0,
            up: false,
            failures: 3,
        },
    ];
    n.failovers = 1;
    n.last_failover_us = 420_001;
    let out = status_table(&[a]);
    assert!(
        out.contains("nic0: paths 10.0.0.2:7700 up (2 sessions, 1 failure), 10.0.1.2:7700 DOWN (0 sessions, 3 failures); 1 failover, the last took 421 ms"),
        "{out}"
    );
}
