//! A borrower of protocol version 2 facing a lender of version 1: the lender refuses the
//! version 2 hello, and the borrower asks again in version 1 and reads the version 1
//! reply into a device description.

use std::net::TcpListener;
use std::time::Duration;

use devlend_fabric::handshake::{BlockGeometry, DeviceDescription};
use devlend_fabric::{tcp, Hello, HelloReply, HelloStatus, SERIAL_LEN};

/// A lender that speaks version 1 only, as a version 1 build answers: a refusal of any
/// other version, else the block device. Returns the versions of the hellos it read.
fn v1_lender(listener: TcpListener, device: BlockGeometry) -> std::thread::JoinHandle<Vec<u16>> {
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        for _ in 0..2 {
            let (mut s, _) = listener.accept().expect("accept");
            let hello = Hello::read_from(&mut s).expect("hello");
            seen.push(hello.version);
            let reply = if hello.version == 1 {
                HelloReply::ok(device.clone())
            } else {
                HelloReply::refuse(
                    HelloStatus::UnsupportedVersion,
                    "protocol version 2 is not supported; this lender speaks version 1",
                )
            };
            reply.for_version(1).write_to(&mut s).expect("reply");
            if hello.version == 1 {
                break;
            }
        }
        seen
    })
}

#[test]
fn a_v1_lender_is_asked_again_in_v1() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let mut serial = [0u8; SERIAL_LEN];
    serial[..3].copy_from_slice(b"old");
    let device = BlockGeometry {
        capacity_sectors: 64,
        block_size: 512,
        max_transfer: 1 << 20,
        flags: 0,
        serial,
        ..BlockGeometry::default()
    };
    let lender = v1_lender(listener, device.clone());
    let (_s, reply) = tcp::connect(&addr, "disk0", 0, Duration::from_secs(5)).expect("connect");
    assert_eq!(lender.join().expect("lender"), vec![2, 1]);
    assert_eq!(reply.version, 1);
    assert_eq!(reply.device, Some(DeviceDescription::Block(device)));
}

#[test]
fn a_v2_lender_is_not_asked_twice() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let lender = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let hello = Hello::read_from(&mut s).expect("hello");
        HelloReply::refuse(HelloStatus::NoSuchDevice, "no such device")
            .for_version(hello.version)
            .write_to(&mut s)
            .expect("reply");
        hello.version
    });
    let e = tcp::connect(&addr, "nope", 0, Duration::from_secs(5)).expect_err("refused");
    assert!(matches!(
        e,
        tcp::ConnectError::Refused {
            status: HelloStatus::NoSuchDevice,
            ..
        }
    ));
    assert_eq!(lender.join().expect("lender"), 2);
}
