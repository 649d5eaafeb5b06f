//! The limits on VFs (`guest_sriov.rs`): the PF's bound its VFs' holders together, a
//! lease's bind its VF, and a function the lender cannot hold to limits (a mirrored
//! one) is not lent under any. A test driver on the compute hosts' vfio-user sockets
//! times bursts of one-block commands sent with one doorbell.

use std::time::{Duration, Instant};

use devlend_tests::nvme;

use super::Lab;

/// The PF's limit, reads a second, that its two VFs' holders share (`iops_read` of
/// `ssd=pci-pf:...`): reads only, so that the writes of the rest of the test do not
/// wait for it.
pub(crate) const PF_READ_IOPS: u32 = 100;
/// A lease's own limit on a VF, operations a second (`--max-iops`): below the PF's.
const LEASE_IOPS: u32 = 40;

/// The limits: the PF's bound the two VFs' holders together, a lease's bind its VF, and
/// a function the lender cannot hold to limits (a mirrored one) is not lent under any.
/// Host A's driver `d` holds VF `vf_of[0]`; host B's attachment is still `ssd.sock`.
pub(crate) fn check(lab: Lab<'_>, d: &mut nvme::Driver, vf_of: &[usize]) {
    let b = &lab.hosts[1];
    let ns = |vf: usize| vf as u32 + 1;
    let rate = |n: u32, t: Duration| f64::from(n) / t.as_secs_f64();
    let cap = f64::from(PF_READ_IOPS);
    // Writes do not draw from iops_read: how fast this machine goes unlimited.
    let writes = rate(200, timed_burst(d, ns(vf_of[0]), 0x01, 200));
    eprintln!("limits: 200 writes at {writes:.0}/s (unlimited)");
    assert!(
        writes > 3.0 * cap,
        "this machine does {writes:.0} writes/s unlimited: too slow to show a limit of {cap}/s"
    );
    // Alone on the PF, host A's reads go at the PF's rate.
    let alone = rate(200, timed_burst(d, ns(vf_of[0]), 0x02, 200));
    eprintln!("limits: 200 reads alone at {alone:.0}/s (PF: {cap}/s)");
    assert!(
        alone <= 1.25 * cap && alone >= 0.5 * cap,
        "{alone:.0} reads/s alone under the PF's {cap}"
    );
    // Host B leases the other VF: the two holders share the PF's rate.
    b.detach(&b.dir.join("ssd.sock"));
    let b_sock = b.dir.join("b2.sock");
    b.attach_vf(lab.pool_port, "vm-e", &b_sock);
    let mut db = nvme::start(&b_sock);
    db.identify_namespace(ns(vf_of[1]));
    let (ta, tb) = std::thread::scope(|s| {
        let other = s.spawn(|| timed_burst(&mut db, ns(vf_of[1]), 0x02, 200));
        let ta = timed_burst(d, ns(vf_of[0]), 0x02, 200);
        (ta, other.join().expect("host B's reads"))
    });
    let (ra, rb) = (rate(200, ta), rate(200, tb));
    let sum = rate(400, ta.max(tb));
    eprintln!("limits: together {ra:.0}/s + {rb:.0}/s, {sum:.0}/s in all (PF: {cap}/s)");
    assert!(
        sum <= 1.25 * cap,
        "two VFs together did {sum:.0} reads/s: the PF's {cap}/s bounds their sum"
    );
    assert!(
        ra.min(rb) >= 0.25 * cap,
        "each holder gets its share: {ra:.0}/s and {rb:.0}/s"
    );
    drop(db);
    b.detach(&b_sock);
    // A lease's own limit, below the PF's, binds its VF.
    let b_sock = b.dir.join("b3.sock");
    let lease = LEASE_IOPS.to_string();
    b.attach(
        lab.pool_port,
        "vm-f",
        &b_sock,
        "PCI_1B36_0010",
        "PF_SSD",
        &["--max-iops", &lease],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut db = nvme::start(&b_sock);
    db.identify_namespace(ns(vf_of[1]));
    let leased = rate(120, timed_burst(&mut db, ns(vf_of[1]), 0x02, 120));
    eprintln!("limits: 120 reads under a lease of {LEASE_IOPS}/s at {leased:.0}/s");
    assert!(
        leased <= 1.3 * f64::from(LEASE_IOPS),
        "{leased:.0} reads/s under a lease of {LEASE_IOPS}/s"
    );
    drop(db);
    b.detach(&b_sock);
    // The igb VF is mirrored: the lender sees none of its DMA, so it cannot hold it to
    // a lease's limits, and says so rather than lend it unlimited.
    let e = b
        .attach(
            lab.pool_port,
            "vm-g",
            &b.dir.join("nic.sock"),
            "PCI_8086_10CA",
            "PF_NIC",
            &["--max-iops", &lease],
        )
        .expect_err("a mirrored VF under limits");
    assert!(e.contains("cannot enforce limits"), "{e}");
}

/// Submits `n` (at most 255) one-block commands of `opcode` (01h write, 02h read) on
/// namespace `nsid` with one doorbell, on an I/O queue pair 2 made for them and
/// deleted after; how long until the last completed.
fn timed_burst(d: &mut nvme::Driver, nsid: u32, opcode: u8, n: u32) -> Duration {
    const ENTRIES: u32 = 256;
    const SQ: u64 = 0x6_0000;
    const CQ: u64 = 0x7_0000;
    assert!(n < ENTRIES);
    d.mem.write(CQ, &[0; ENTRIES as usize * 16]);
    d.create_queue_pair(2, ENTRIES, SQ, CQ);
    for i in 0..n {
        let mut e = nvme::sqe(opcode, nsid, nvme::IOVA + nvme::DATA, 0, [i, 0, 0, 0, 0, 0]);
        e[2..4].copy_from_slice(&(i as u16).to_le_bytes());
        d.mem.write(SQ + u64::from(i) * 64, &e);
    }
    let t0 = Instant::now();
    d.w32(0x1000 + 8 * 2, n);
    let until = t0 + Duration::from_secs(120);
    for i in 0..n {
        loop {
            let c = d.mem.read(CQ + u64::from(i) * 16, 16);
            let st = u16::from_le_bytes([c[14], c[15]]);
            if st & 1 == 1 {
                assert_eq!(st >> 1, 0, "command {i} ({opcode:#x})'s status");
                break;
            }
            assert!(Instant::now() < until, "{i} of {n} commands completed");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let took = t0.elapsed();
    d.w32(0x1000 + 8 * 2 + 4, n);
    d.delete_queue_pair(2);
    took
}
