//! The handshake of a spawned lender in both protocol versions: a version 2 hello gets
//! the device's kind-tagged description (a block device's geometry, a NIC's link), a
//! version 1 hello the version 1 reply a version 1 borrower reads, and a version the
//! lender does not speak a refusal naming the versions it does.
//!
//! PCIe functions are not covered here: lending one needs a function bound to vfio-pci
//! (the real-QEMU tests in `tests/` do that).

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::{Client, Fixture};
use devlend_device_agent::{DeviceSpec, Lender, MAX_TRANSFER_BYTES};
use devlend_fabric::handshake::description::NIC_OFFLOADS;
use devlend_fabric::handshake::{DeviceDescription, V1_REPLY_FIXED_LEN};
use devlend_fabric::net::FEATURE_NET;
use devlend_fabric::{Hello, HelloReply, HelloStatus, NicLink, Status};

const MIB: u64 = 1 << 20;

/// Sends `hello` on a new connection; returns the reply and the stream.
fn ask(addr: std::net::SocketAddr, hello: &Hello) -> (HelloReply, TcpStream) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    hello.write_to(&mut s).expect("hello");
    let reply = HelloReply::read_from(&mut s).expect("reply");
    (reply, s)
}

#[test]
fn a_v2_hello_gets_the_block_description() {
    let fx = Fixture::new(&[("disk0", 4 * MIB, true)]);
    let (reply, _s) = ask(fx.addr(), &Hello::new("disk0", 0));
    assert_eq!((reply.status, reply.version), (HelloStatus::Ok, 2));
    let Some(DeviceDescription::Block(g)) = &reply.device else {
        panic!("not a block description: {reply:?}");
    };
    assert_eq!(g.capacity_sectors, 4 * MIB / 512);
    assert_eq!(g.block_size, 512);
    assert_eq!(g.max_transfer, MAX_TRANSFER_BYTES);
    assert!(g.read_only());
    assert_eq!(&g.serial[..6], b"disk0\0");
}

#[test]
fn a_v1_hello_gets_a_v1_reply_and_a_working_session() {
    let fx = Fixture::new(&[("disk0", MIB, false)]);
    let mut s = TcpStream::connect(fx.addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    Hello {
        version: 1,
        ..Hello::new("disk0", 0)
    }
    .write_to(&mut s)
    .expect("hello");
    // Exactly the 68 bytes of a version 1 reply (no credit asked, no proof, no message).
    let mut b = [0u8; V1_REPLY_FIXED_LEN];
    s.read_exact(&mut b).expect("v1 reply");
    assert_eq!(&b[4..6], &1u16.to_le_bytes(), "version 1");
    assert_eq!(&b[6..8], &0u16.to_le_bytes(), "status Ok");
    assert_eq!(
        u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
        MIB / 512,
        "capacity_sectors at offset 16"
    );
    let reply = HelloReply::read_from(&mut b.as_slice()).expect("decode");
    assert_eq!(reply.version, 1);
    let g = reply.block().cloned().expect("a block device");
    assert_eq!(g.capacity_sectors, MIB / 512);
    // The session serves requests as a version 2 one does.
    let mut c = Client::from_stream(s, g);
    assert_eq!(c.write(3, &[0x5au8; 512]), Status::Ok);
    assert_eq!(c.read(3, 512), (Status::Ok, vec![0x5au8; 512]));
}

#[test]
fn an_unspoken_version_is_refused_naming_the_versions_spoken() {
    let fx = Fixture::new(&[("disk0", MIB, false)]);
    for (version, reply_version) in [(3u16, 2u16), (0, 2)] {
        let (reply, _s) = ask(
            fx.addr(),
            &Hello {
                version,
                ..Hello::new("disk0", 0)
            },
        );
        assert_eq!(reply.status, HelloStatus::UnsupportedVersion);
        assert_eq!(reply.version, reply_version);
        assert!(
            reply.message.contains("versions 1 to 2"),
            "{}",
            reply.message
        );
    }
    assert_eq!(fx.stats("disk0").sessions_opened, 0);
    // A refusal of a version 1 hello is a version 1 reply.
    let (reply, _s) = ask(
        fx.addr(),
        &Hello {
            version: 1,
            ..Hello::new("nope", 0)
        },
    );
    assert_eq!(
        (reply.status, reply.version),
        (HelloStatus::NoSuchDevice, 1)
    );
}

/// A tap interface that goes away with the test.
struct Tap(&'static str);

impl Tap {
    fn new(name: &'static str, mtu: u32) -> Option<Tap> {
        let ok = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .output()
                .is_ok_and(|o| o.status.success())
        };
        let _ = ok(&["link", "del", name]);
        if !ok(&["tuntap", "add", "dev", name, "mode", "tap"]) {
            return None;
        }
        let tap = Tap(name);
        ok(&["link", "set", name, "mtu", &mtu.to_string()]).then_some(tap)
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", self.0]).output();
    }
}

#[test]
fn a_nic_is_described_by_its_link_in_both_versions() {
    let Some(_tap) = Tap::new("dlwire2v0", 1400) else {
        eprintln!("skipped: cannot create a tap interface (needs CAP_NET_ADMIN and /dev/net/tun)");
        return;
    };
    let spec: DeviceSpec = "nic0=net:dlwire2v0,mac=02:00:00:00:0a:42"
        .parse()
        .expect("spec");
    let lender = Lender::bind("127.0.0.1:0", vec![spec])
        .expect("bind")
        .spawn();
    let mut hello = Hello::new("nic0", 0);
    hello.features = FEATURE_NET;
    let (reply, s) = ask(lender.local_addr(), &hello);
    assert_eq!((reply.status, reply.version), (HelloStatus::Ok, 2));
    assert_eq!(
        reply.device,
        Some(DeviceDescription::Nic(NicLink {
            mac: [2, 0, 0, 0, 0x0a, 0x42],
            mtu: 1400,
            // A tap with no process behind it has no carrier.
            up: false,
            offloads: NIC_OFFLOADS,
        }))
    );
    drop(s);
    // One session at a time: let the lender see the first one end.
    std::thread::sleep(Duration::from_millis(300));

    hello.version = 1;
    let (reply, _s) = ask(lender.local_addr(), &hello);
    assert_eq!((reply.status, reply.version), (HelloStatus::Ok, 1));
    let nic = reply.nic().expect("a NIC");
    assert_eq!((nic.mac, nic.mtu), ([2, 0, 0, 0, 0x0a, 0x42], 1400));
}
