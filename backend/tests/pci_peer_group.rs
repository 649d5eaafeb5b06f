//! Peer-to-peer on the borrower's side, over a real TCP session to a stand-in lender:
//! the hello asks for DMA counters notes; the VM's peer group is the first request
//! after the INFO; a refusal fails the connect with the lender's reason; granted notes
//! land in the function's counters; a malformed note, or one the handshake did not
//! grant, ends the session.

use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use devlend_backend::pci::{LinkError, LinkTarget, PciBorrower, PciError, PciHandle};
use devlend_fabric::pci::{
    Access, DmaCounters, Message, PciInfo, PciStatus, PeerGroup, RegionInfo, FEATURE_PCI,
    FEATURE_PCI_COUNTERS, KIND_COUNTERS, KIND_INFO, KIND_PEER_GROUP, KIND_READ, REPLY,
};
use devlend_fabric::transport::Transport;
use devlend_fabric::{Hello, HelloReply, PciIdentity};

/// How the stand-in lender behaves.
#[derive(Clone)]
struct Behaviour {
    /// Grant [`FEATURE_PCI_COUNTERS`] when asked.
    grant_counters: bool,
    /// Refuse the peer group with this reason.
    refuse_group: Option<&'static str>,
    /// One-way messages sent right after the peer group's reply.
    notes: Vec<Message>,
}

/// What the stand-in lender saw: the hello's features, and every message, in order.
#[derive(Default)]
struct Seen {
    features: Option<u64>,
    messages: Vec<Message>,
}

/// A lender of one function on loopback, serving each connection as `b` says.
fn lender(b: Behaviour) -> (String, Arc<Mutex<Seen>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let s = Arc::clone(&seen);
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut conn) = conn else { continue };
            let Ok(hello) = Hello::read_from(&mut conn) else {
                continue;
            };
            s.lock().unwrap().features = Some(hello.features);
            let mut reply = HelloReply::ok(PciIdentity {
                bdf: "0000:00:05.0".into(),
                ..PciIdentity::default()
            });
            reply.features = FEATURE_PCI;
            if b.grant_counters {
                reply.features |= hello.features & FEATURE_PCI_COUNTERS;
            }
            if reply.write_to(&mut conn).is_err() {
                continue;
            }
            while let Ok(m) = Message::read_from(&mut conn) {
                s.lock().unwrap().messages.push(m.clone());
                let answer = match (m.kind, b.refuse_group) {
                    (KIND_INFO, _) => {
                        let rw = RegionInfo {
                            size: 4096,
                            flags: 3,
                        };
                        let mut regions = vec![RegionInfo::default(); 8];
                        regions[0] = rw;
                        regions[7] = rw;
                        let info = PciInfo {
                            regions,
                            irqs: Vec::new(),
                            flags: 0,
                        };
                        Message::new(KIND_INFO | REPLY, info.encode())
                    }
                    (KIND_PEER_GROUP, Some(reason)) => {
                        Message::refusal(KIND_PEER_GROUP, PciStatus::Invalid, reason)
                    }
                    (KIND_READ, _) => {
                        let (a, _) = Access::decode(&m.payload, false).unwrap();
                        Message::new(KIND_READ | REPLY, vec![0; a.len as usize])
                    }
                    (k, _) => Message::new(k | REPLY, Vec::new()),
                };
                if answer.write_to(&mut conn).is_err() {
                    break;
                }
                if m.kind == KIND_PEER_GROUP && b.refuse_group.is_none() {
                    for n in &b.notes {
                        let _ = n.write_to(&mut conn);
                    }
                }
            }
        }
    });
    (addr, seen)
}

fn target(lender: &str) -> LinkTarget {
    LinkTarget {
        lender: lender.into(),
        device: "fn0".into(),
        borrower: [7; 16],
        token: Vec::new(),
        tls: None,
        timeout: Duration::from_secs(5),
        transport: Transport::Tcp,
        lender_key: None,
        holder: None,
    }
}

fn note(guest_read: u64, guest_written: u64, peer: u64) -> Message {
    let c = DmaCounters {
        guest_read,
        guest_written,
        peer,
    };
    Message::new(KIND_COUNTERS, c.encode())
}

/// Waits up to 5 s for `cond`.
fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn lender_counters(h: &PciHandle) -> (u64, u64, u64) {
    let s = h.stats();
    (
        s.lender_guest_read_bytes.load(Ordering::Relaxed),
        s.lender_guest_written_bytes.load(Ordering::Relaxed),
        s.peer_bytes.load(Ordering::Relaxed),
    )
}

#[test]
fn the_peer_group_follows_the_info_and_granted_notes_land_in_the_counters() {
    let vm = *b"\x01vm-of-the-test\x02";
    let (addr, seen) = lender(Behaviour {
        grant_counters: true,
        refuse_group: None,
        notes: vec![note(100, 200, 300), note(150, 200, 1 << 20)],
    });
    let b = PciBorrower::connect_in_group(&target(&addr), Some(vm)).expect("borrowed");
    let h = b.handle();
    assert_eq!(h.peer_group(), Some(vm));
    wait_for("the notes", || lender_counters(&h) == (150, 200, 1 << 20));
    assert!(!h.session_closed());
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.features
            .map(|f| f & (FEATURE_PCI | FEATURE_PCI_COUNTERS)),
        Some(FEATURE_PCI | FEATURE_PCI_COUNTERS),
        "the hello asks for the notes"
    );
    let kinds: Vec<u8> = seen.messages.iter().map(|m| m.kind).collect();
    assert_eq!(&kinds[..2], &[KIND_INFO, KIND_PEER_GROUP], "{kinds:x?}");
    assert_eq!(PeerGroup::decode(&seen.messages[1].payload).unwrap().vm, vm);
}

#[test]
fn without_a_vm_no_peer_group_is_asked() {
    let (addr, seen) = lender(Behaviour {
        grant_counters: true,
        refuse_group: None,
        notes: Vec::new(),
    });
    let b = PciBorrower::connect(&target(&addr)).expect("borrowed");
    assert_eq!(b.handle().peer_group(), None);
    let kinds: Vec<u8> = seen
        .lock()
        .unwrap()
        .messages
        .iter()
        .map(|m| m.kind)
        .collect();
    assert!(!kinds.contains(&KIND_PEER_GROUP), "{kinds:x?}");
}

#[test]
fn a_lender_that_refuses_the_peer_group_fails_the_connect_with_its_reason() {
    let (addr, seen) = lender(Behaviour {
        grant_counters: true,
        refuse_group: Some("the VM's other functions are lent to another borrower"),
        notes: Vec::new(),
    });
    let e = match PciBorrower::connect_in_group(&target(&addr), Some([5; 16])) {
        Err(e) => e,
        Ok(_) => panic!("served though the lender refused the peer group"),
    };
    match &e {
        PciError::PeerGroup(LinkError::Refused { status, reason }) => {
            assert_eq!(*status, PciStatus::Invalid);
            assert_eq!(
                reason,
                "the VM's other functions are lent to another borrower"
            );
        }
        other => panic!("{other:?}"),
    }
    let said = devlend_fabric::error::chain(&e);
    assert!(said.contains("another borrower"), "{said}");
    let kinds: Vec<u8> = seen
        .lock()
        .unwrap()
        .messages
        .iter()
        .map(|m| m.kind)
        .collect();
    assert_eq!(
        kinds,
        [KIND_INFO, KIND_PEER_GROUP],
        "nothing after the refusal"
    );
}

#[test]
fn a_malformed_note_ends_the_session() {
    let (addr, _) = lender(Behaviour {
        grant_counters: true,
        refuse_group: None,
        notes: vec![note(1, 1, 1), Message::new(KIND_COUNTERS, vec![0; 20])],
    });
    let b = PciBorrower::connect_in_group(&target(&addr), Some([9; 16])).expect("borrowed");
    let h = b.handle();
    wait_for("the session to end", || h.session_closed());
    assert_eq!(lender_counters(&h), (1, 1, 1), "the good note counted");
}

#[test]
fn a_note_the_handshake_did_not_grant_ends_the_session() {
    let (addr, _) = lender(Behaviour {
        grant_counters: false,
        refuse_group: None,
        notes: vec![note(1, 2, 3)],
    });
    let b = PciBorrower::connect_in_group(&target(&addr), Some([9; 16])).expect("borrowed");
    let h = b.handle();
    wait_for("the session to end", || h.session_closed());
    assert_eq!(lender_counters(&h), (0, 0, 0));
}
