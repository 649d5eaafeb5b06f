//! The borrower's logic driven through the in-memory link ([`super::fake_link`]): region
//! accesses forwarded and answered, the mirror pushed before a BAR write, refusals and a
//! lost session reported to the VMM as errnos; the VM's peer group joined before any
//! DMA map, and the lender's DMA counters notes.

use std::io;
use std::os::unix::fs::FileExt as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::pci::{
    Access, DmaCounters, Irq, Message, KIND_COUNTERS, KIND_DMA_MAP, KIND_PEER_GROUP, KIND_PUSH,
    KIND_READ, KIND_SET_IRQS, KIND_WRITE, MIRROR_PAGE,
};
use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;
use vfio_user::{DmaMapFlags, ServerBackend};

use super::fake_link::{fake_link, fake_link_with, info, FakeLender};
use super::{guest_mem, LinkError, PciBorrower, PciError};

const CONFIG: u32 = VFIO_PCI_CONFIG_REGION_INDEX;

/// A borrower over a fake link whose accesses are at most `max_access` bytes, its
/// config space starting with `config`.
fn borrower(max_access: u32, config: &[u8]) -> (PciBorrower, Arc<FakeLender>) {
    let (link, lender, irqs) = fake_link(max_access, Default::default());
    lender
        .regions
        .lock()
        .unwrap()
        .insert(CONFIG, config.to_vec());
    let b = PciBorrower::start(
        link,
        info(),
        irqs,
        Arc::new(guest_mem::Maps::default()),
        None,
    )
    .unwrap();
    (b, lender)
}

/// A borrower over a fake link of the VM `vm` (its peer group), or the reason it did
/// not start, with the lender.
fn borrower_of_vm(
    vm: [u8; 16],
    refuse: Option<u8>,
) -> (Result<PciBorrower, PciError>, Arc<FakeLender>) {
    let (link, lender, irqs) = fake_link(64, Default::default());
    *lender.refuse.lock().unwrap() = refuse;
    let b = PciBorrower::start(
        link,
        info(),
        irqs,
        Arc::new(guest_mem::Maps::default()),
        Some(vm),
    );
    (b, lender)
}

fn accesses(lender: &FakeLender, kind: u8) -> Vec<Access> {
    lender
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|m| m.kind == kind)
        .map(|m| Access::decode(&m.payload, kind == KIND_WRITE).unwrap().0)
        .collect()
}

#[test]
fn ids_are_read_from_config_space_when_the_lender_does_not_describe_them() {
    let (b, lender) = borrower(64, &[0x86, 0x80, 0x34, 0x12]);
    let id = b.handle().identity().clone();
    assert_eq!((id.vendor_id, id.device_id), (Some(0x8086), Some(0x1234)));
    assert_eq!(lender.kinds(), vec![KIND_READ]);
}

#[test]
fn a_region_read_is_forwarded_in_pieces_of_the_links_largest_access() {
    let (mut b, lender) = borrower(16, &[]);
    let bar: Vec<u8> = (0..64).collect();
    lender.regions.lock().unwrap().insert(0, bar.clone());
    let mut data = [0u8; 40];
    b.region_read(0, 8, &mut data).unwrap();
    assert_eq!(&data[..], &bar[8..48]);
    let reads: Vec<(u64, u32)> = accesses(&lender, KIND_READ)
        .iter()
        .filter(|a| a.region == 0)
        .map(|a| (a.offset, a.len))
        .collect();
    assert_eq!(reads, vec![(8, 16), (24, 16), (40, 8)]);
    assert_eq!(b.stats().reads.load(Ordering::Relaxed), 1);
}

#[test]
fn a_region_write_reaches_the_lender_in_order() {
    let (mut b, lender) = borrower(4, &[]);
    b.region_write(CONFIG, 4, &[1, 2, 3, 4, 5, 6]).unwrap();
    let writes: Vec<(u64, u32)> = accesses(&lender, KIND_WRITE)
        .iter()
        .map(|a| (a.offset, a.len))
        .collect();
    assert_eq!(writes, vec![(4, 4), (8, 2)]);
    assert_eq!(
        lender.regions.lock().unwrap()[&CONFIG][4..10],
        [1, 2, 3, 4, 5, 6]
    );
}

#[test]
fn a_bar_write_pushes_the_changed_guest_pages_first() {
    let (mut b, lender) = borrower(64, &[1, 0, 1, 0]);
    let page = MIRROR_PAGE as usize;
    let file = tempfile::tempfile().unwrap();
    file.set_len(2 * MIRROR_PAGE).unwrap();
    let guest = file.try_clone().unwrap();
    b.dma_map(
        DmaMapFlags::READ_WRITE,
        0,
        0x10_0000,
        2 * MIRROR_PAGE,
        Some(file),
    )
    .unwrap();
    guest.write_all_at(b"doorbell data", page as u64).unwrap();
    b.region_write(0, 0, &[1]).unwrap();
    // A write to config space may not start DMA: nothing to push.
    b.region_write(CONFIG, 0x10, &[0]).unwrap();
    // Nothing changed since: the next BAR write pushes nothing.
    b.region_write(0, 0, &[2]).unwrap();
    assert_eq!(
        lender.kinds(),
        vec![
            KIND_READ,
            KIND_DMA_MAP,
            KIND_PUSH,
            KIND_WRITE,
            KIND_WRITE,
            KIND_WRITE
        ]
    );
    assert_eq!(b.stats().pages_pushed.load(Ordering::Relaxed), 1);
    assert_eq!(b.handle().dma_mapped_bytes(), 2 * MIRROR_PAGE);
    // Only the bytes the guest wrote move, not their page: the function may have
    // written the rest of it since (a descriptor written back beside the one the driver
    // fills), and a whole page would put the guest's old copy back over that.
    let pushed: Vec<(u64, Vec<u8>)> = lender
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|m| m.kind == KIND_PUSH)
        .flat_map(|m| {
            devlend_fabric::pci::decode_pages(&m.payload)
                .unwrap()
                .into_iter()
                .map(|p| (p.iova, p.data.to_vec()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(pushed, [(0x10_1000, b"doorbell data".to_vec())]);
    guest.write_all_at(b"X", page as u64 + 100).unwrap();
    b.region_write(0, 0, &[3]).unwrap();
    let last = lender
        .log
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|m| m.kind == KIND_PUSH)
        .cloned();
    let pages = last.expect("a second push");
    let pages = devlend_fabric::pci::decode_pages(&pages.payload).unwrap();
    assert_eq!(
        pages.iter().map(|p| (p.iova, p.data)).collect::<Vec<_>>(),
        [(0x10_1064, &b"X"[..])]
    );
}

#[test]
fn a_refusal_is_einval_and_the_session_goes_on() {
    let (mut b, lender) = borrower(64, &[1, 0, 1, 0]);
    *lender.refuse.lock().unwrap() = Some(KIND_WRITE);
    let e = b.region_write(CONFIG, 0, &[0]).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    let mut data = [0u8; 2];
    b.region_read(CONFIG, 0, &mut data).unwrap();
    assert_eq!(data, [1, 0]);
    assert!(!b.handle().session_closed());
}

#[test]
fn a_lost_session_fails_requests_as_a_broken_pipe() {
    let (mut b, lender) = borrower(64, &[1, 0, 1, 0]);
    lender.lose();
    assert!(b.handle().session_closed());
    let mut data = [0u8; 4];
    let e = b.region_read(CONFIG, 0, &mut data).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
    assert!(b.vmm_gone().is_err());
}

#[test]
fn an_interrupt_reaches_the_vmms_eventfd_of_its_vector() {
    use vfio_bindings::bindings::vfio::{VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD};
    let (mut b, lender) = borrower(64, &[1, 0, 1, 0]);
    // A file stands in for the eventfd: each signal writes 8 bytes to it.
    let eventfd = tempfile::tempfile().unwrap();
    let seen = eventfd.try_clone().unwrap();
    let flags = VFIO_IRQ_SET_ACTION_TRIGGER | VFIO_IRQ_SET_DATA_EVENTFD;
    b.set_irqs(0, flags, 1, 1, vec![eventfd]).unwrap();
    assert_eq!(lender.kinds(), vec![KIND_READ, KIND_SET_IRQS]);
    // Vector 0 has no eventfd: dropped; vector 1 is signalled.
    lender.irq(Irq {
        index: 0,
        vector: 0,
    });
    lender.irq(Irq {
        index: 0,
        vector: 1,
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.stats().irqs.load(Ordering::Relaxed) < 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(b.stats().irqs.load(Ordering::Relaxed), 1);
    assert_eq!(seen.metadata().unwrap().len(), 8);
}

#[test]
fn the_vms_peer_group_is_joined_first_and_before_any_dma_map() {
    let vm = *b"vm-identity-0001";
    let (b, lender) = borrower_of_vm(vm, None);
    let mut b = b.unwrap();
    assert_eq!(b.handle().peer_group(), Some(vm));
    let file = tempfile::tempfile().unwrap();
    file.set_len(MIRROR_PAGE).unwrap();
    b.dma_map(
        DmaMapFlags::READ_WRITE,
        0,
        0x10_0000,
        MIRROR_PAGE,
        Some(file),
    )
    .unwrap();
    // The INFO came with the link; the peer group is the first request after it.
    assert_eq!(
        lender.kinds(),
        vec![KIND_PEER_GROUP, KIND_READ, KIND_DMA_MAP]
    );
    let log = lender.log.lock().unwrap();
    let group = devlend_fabric::pci::PeerGroup::decode(&log[0].payload).unwrap();
    assert_eq!(group.vm, vm);
}

#[test]
fn a_borrower_without_a_vm_sends_no_peer_group() {
    let (b, lender) = borrower(64, &[]);
    assert_eq!(b.handle().peer_group(), None);
    assert!(!lender.kinds().contains(&KIND_PEER_GROUP));
}

#[test]
fn a_refused_peer_group_fails_the_borrower_with_the_lenders_reason() {
    let (b, lender) = borrower_of_vm([3; 16], Some(KIND_PEER_GROUP));
    let Err(e) = b else {
        panic!("a borrower the lender kept out of its VM's peer group was started");
    };
    match &e {
        PciError::PeerGroup(LinkError::Refused { reason, .. }) => {
            assert_eq!(reason, "refused by the fake lender")
        }
        other => panic!("{other:?}"),
    }
    let said = devlend_fabric::error::chain(&e);
    assert!(
        said.contains("peer group") && said.contains("refused by the fake lender"),
        "{said}"
    );
    // Nothing else was asked, and the session is given up.
    assert_eq!(lender.kinds(), vec![KIND_PEER_GROUP]);
    assert!(!lender.send_one_way(Message::new(KIND_COUNTERS, DmaCounters::default().encode())));
}

#[test]
fn a_vm_identity_of_zeros_is_refused_before_connecting() {
    let target = super::LinkTarget {
        lender: "127.0.0.1:1".into(),
        device: "fn0".into(),
        borrower: [7; 16],
        token: Vec::new(),
        tls: None,
        timeout: Duration::from_millis(100),
        transport: devlend_fabric::transport::Transport::Tcp,
        lender_key: None,
        holder: None,
    };
    assert!(matches!(
        PciBorrower::connect_in_group(&target, Some([0; 16])),
        Err(PciError::ZeroVm)
    ));
}

fn note(guest_read: u64, guest_written: u64, peer: u64) -> Message {
    let c = DmaCounters {
        guest_read,
        guest_written,
        peer,
    };
    Message::new(KIND_COUNTERS, c.encode())
}

fn lender_counters(b: &PciBorrower) -> (u64, u64, u64) {
    let s = b.stats();
    (
        s.lender_guest_read_bytes.load(Ordering::Relaxed),
        s.lender_guest_written_bytes.load(Ordering::Relaxed),
        s.peer_bytes.load(Ordering::Relaxed),
    )
}

#[test]
fn the_lenders_dma_counters_notes_land_in_the_stats() {
    let (b, lender) = borrower(64, &[]);
    assert!(lender.send_one_way(note(4096, 512, 1 << 20)));
    assert_eq!(lender_counters(&b), (4096, 512, 1 << 20));
    // Totals of the session: the next note replaces them, it does not add to them.
    assert!(lender.send_one_way(note(8192, 512, 3 << 20)));
    assert_eq!(lender_counters(&b), (8192, 512, 3 << 20));
    assert_eq!(
        b.handle().stats().peer_bytes.load(Ordering::Relaxed),
        3 << 20
    );
    assert!(!b.handle().session_closed());
}

#[test]
fn a_malformed_dma_counters_note_ends_the_session() {
    let (b, lender) = borrower(64, &[]);
    assert!(!lender.send_one_way(Message::new(KIND_COUNTERS, vec![1; 23])));
    assert!(b.handle().session_closed());
    assert_eq!(lender_counters(&b), (0, 0, 0));
}

#[test]
fn a_dma_counters_note_not_granted_ends_the_session_as_any_unexpected_message() {
    let (link, lender, irqs) = fake_link_with(64, Default::default(), false);
    let b = PciBorrower::start(
        link,
        info(),
        irqs,
        Arc::new(guest_mem::Maps::default()),
        None,
    )
    .unwrap();
    assert!(!lender.send_one_way(note(1, 2, 3)));
    assert!(b.handle().session_closed());
    assert_eq!(lender_counters(&b), (0, 0, 0));
}
