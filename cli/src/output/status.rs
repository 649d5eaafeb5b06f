//! The `devlend status` tables, one per kind of attachment.

use devlend_compute_agent::api::{
    AttachmentInfo, BlockInfo, CoherenceMode, HandoverState, KindInfo, NicInfo, PathState, PciInfo,
};

use super::human_bytes;
use super::link::nic_link_column;

/// The `devlend status` tables, one per kind, each with that kind's own columns: disks
/// with the rates of the last seconds (IOPS, MB/s read and written, p99 latency upper
/// bound; [`disk_table`]), lent NICs with their frame counters ([`nic_table`]), PCIe
/// functions with their address, IDs, VM, DMA-mapped and peer-to-peer bytes
/// ([`pci_table`]); then a line
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
    for (a, b) in &disks {
        let c = &b.counters;
        out.push_str(&paths_line(
            &a.id,
            &c.paths,
            c.failovers,
            c.last_failover_us,
        ));
    }
    for (a, n) in &nics {
        out.push_str(&paths_line(
            &a.id,
            &n.paths,
            n.failovers,
            n.last_failover_us,
        ));
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

/// The line of a disk or NIC with several paths to its lender: each path's state,
/// the failovers and how long the last one took (`last_failover_us`, µs); empty with
/// one path.
pub(super) fn paths_line(
    id: &str,
    paths: &[PathState],
    failovers: u64,
    last_failover_us: u64,
) -> String {
    if paths.is_empty() {
        return String::new();
    }
    let paths: Vec<String> = paths
        .iter()
        .map(|p| {
            format!(
                "{} {} ({}, {})",
                p.addr,
                if p.up { "up" } else { "DOWN" },
                counted(p.sessions, "session"),
                counted(p.failures, "failure")
            )
        })
        .collect();
    let last = if failovers > 0 {
        format!(", the last took {} ms", last_failover_us.div_ceil(1000))
    } else {
        String::new()
    };
    format!(
        "{id}: paths {}; {}{last}\n",
        paths.join(", "),
        counted(failovers, "failover")
    )
}

/// `n` and `noun`, plural unless `n` is 1.
fn counted(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// The line `devlend status` prints while the agent cannot reach its device pool.
pub(super) fn pool_unreachable_line(since_ms: u64, now: std::time::SystemTime) -> String {
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
/// coherence mode, VM (`-` for none), DMA-mapped bytes, region accesses, mirror pages
/// each way, interrupts, and the bytes it moved peer-to-peer (to or from another
/// function of its VM, as the lender reports them).
pub fn pci_table(list: &[(&AttachmentInfo, &PciInfo)]) -> String {
    let mut out = format!(
        "{:<14} {:<10} {:<21} {:<9} {:<13} {:<9} {:<8} {:<10} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9}  {:<11} {}\n",
        "PCI",
        "DEVICE",
        "LENDER",
        "TRANSPORT",
        "BDF",
        "ID",
        "MODE",
        "VM",
        "DMA",
        "RD",
        "WR",
        "PUSHED",
        "PULLED",
        "IRQS",
        "P2P",
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
            "{:<14} {:<10} {:<21} {:<9} {:<13} {:<9} {:<8} {:<10} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9}  {:<11} {}\n",
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
            p.vm.as_deref().unwrap_or("-"),
            human_bytes(p.dma_mapped_bytes),
            c.region_reads,
            c.region_writes,
            c.pages_pushed,
            c.pages_pulled,
            c.irqs,
            human_bytes(c.peer_bytes),
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
