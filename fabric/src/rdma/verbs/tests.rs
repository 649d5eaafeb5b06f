//! What of the verbs layer runs without an RDMA device: addresses turned into the
//! socket addresses rdma_cm takes, the readiness wait on a completion descriptor, and
//! the lender's queue pair shape (its send queue must hold every work request the
//! block engine can post at once). The connection itself runs on Soft-RoCE in the
//! `guest_rdma` and `guest_vfio_rdma` tests.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::setup::to_sockaddr;
use super::*;

#[test]
fn addresses_become_the_socket_addresses_rdma_cm_takes() {
    let (sa, ss) = to_sockaddr("10.1.2.3:4791").expect("v4");
    assert_eq!(sa.to_string(), "10.1.2.3:4791");
    // SAFETY: to_sockaddr filled a sockaddr_in for a V4 address.
    let sin = unsafe { &*(&ss as *const _ as *const libc::sockaddr_in) };
    assert_eq!(i32::from(sin.sin_family), libc::AF_INET);
    assert_eq!(u16::from_be(sin.sin_port), 4791);
    assert_eq!(u32::from_be(sin.sin_addr.s_addr), 0x0a01_0203);

    let (_, ss) = to_sockaddr("[fd00::7]:18515").expect("v6");
    // SAFETY: as above, a sockaddr_in6 for a V6 address.
    let sin6 = unsafe { &*(&ss as *const _ as *const libc::sockaddr_in6) };
    assert_eq!(i32::from(sin6.sin6_family), libc::AF_INET6);
    assert_eq!(u16::from_be(sin6.sin6_port), 18515);
    assert_eq!(sin6.sin6_addr.s6_addr[15], 7);
    assert_eq!(sin6.sin6_addr.s6_addr[0], 0xfd);

    for bad in ["10.1.2.3", "not an address", "10.1.2.3:99999", ""] {
        match to_sockaddr(bad) {
            Err(RdmaError::BadAddress { addr }) => assert_eq!(addr, bad),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

#[test]
fn the_readiness_wait_returns_when_readable_or_after_its_timeout() {
    let (mut a, b) = UnixStream::pair().expect("pair");
    let start = Instant::now();
    assert!(!wait_fd(b.as_raw_fd(), Duration::from_millis(50)));
    assert!(
        start.elapsed() >= Duration::from_millis(45),
        "waited its timeout"
    );
    a.write_all(b"x").expect("write");
    let start = Instant::now();
    assert!(wait_fd(b.as_raw_fd(), Duration::from_secs(5)));
    assert!(start.elapsed() < Duration::from_secs(1), "woke at once");
}

#[test]
fn set_nonblocking_sets_o_nonblock() {
    let (_a, b) = UnixStream::pair().expect("pair");
    set_nonblocking(b.as_raw_fd()).expect("fcntl");
    // SAFETY: fcntl on a live descriptor, no memory passed.
    let flags = unsafe { libc::fcntl(b.as_raw_fd(), libc::F_GETFL) };
    assert_ne!(flags & libc::O_NONBLOCK, 0);
    assert!(
        set_nonblocking(-1).is_err(),
        "a closed descriptor is an error"
    );
}

#[test]
fn the_lenders_send_queue_holds_every_work_request_of_its_io_slots() {
    for slots in [1, 16, 64] {
        let shape = lender_shape(slots);
        // Per slot at once: an RDMA READ or WRITE per segment, then the response SEND;
        // and the handshake's reply besides.
        let worst = slots * (crate::rdma::MAX_SEGMENTS + 1) + 1;
        assert!(
            shape.send_wr >= worst,
            "{slots} slots: {} < {worst}",
            shape.send_wr
        );
        assert!(shape.recv.0 >= crate::rdma::RECV_DEPTH);
        assert!(shape.recv.1 >= crate::rdma::MAX_REQUEST_MSG);
    }
}
