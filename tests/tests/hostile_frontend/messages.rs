//! Messages no good VMM sends, one at a time: vring sizes, indices and addresses out
//! of range, config space reads and writes, memory tables, requests before SET_OWNER,
//! malformed bodies and unknown codes, a kick fd that is not an eventfd.

use super::*;

#[test]
fn vring_sizes_that_are_not_powers_of_two_or_out_of_range_are_refused() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let log = rig.log_len();
    for num in [3, 100, 65535, 0] {
        let ack = fe.set_vring_num(0, num).unwrap();
        assert_ne!(ack, 0, "SET_VRING_NUM {num} accepted");
        assert_eq!(fe.set_vring_num(0, 256).unwrap(), 0, "after {num}");
    }
    // A power of two above the device's largest queue (1024), sent again and again:
    // refused each time, and the log must not grow with every one.
    for _ in 0..500 {
        assert_ne!(
            fe.set_vring_num(0, 2048).unwrap(),
            0,
            "SET_VRING_NUM 2048 accepted"
        );
    }
    assert_eq!(fe.set_vring_num(0, 256).unwrap(), 0, "after 2048");
    // The queue works at the size accepted.
    let mut q = Queue::new(0);
    q.start(&mut fe, &ram);
    q.read_ok(&ram);
    rig.check_cost(log, "SET_VRING_NUM");
    q.read_ok(&ram);
}

#[test]
fn invalid_get_config_gets_an_empty_reply() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let (size, good) = fe.get_config(0, 60).unwrap();
    assert_eq!((size, good.len()), (60, 60));
    assert_eq!(
        u64::from_le_bytes(good[..8].try_into().unwrap()),
        16 * MIB / 512,
        "capacity"
    );
    let log = rig.log_len();
    for (offset, size, what) in [
        (0, 0, "size 0"),
        (0xffff_fff0, 0x20, "offset + size overflowing u32"),
        (0x0ffc, 8, "past the 4 KiB config space"),
        (0x1000, 4, "at the end of the config space"),
    ] {
        let (got, data) = fe.get_config(offset, size).unwrap();
        assert_eq!((got, data.len()), (0, 0), "GET_CONFIG {what}");
        let (got, data) = fe.get_config(0, 60).unwrap();
        assert_eq!((got, &data), (60, &good), "GET_CONFIG after {what}");
    }
    rig.check_cost(log, "GET_CONFIG");
}

#[test]
fn writes_to_the_read_only_config_space_are_refused() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let (_, before) = fe.get_config(0, 60).unwrap();
    let log = rig.log_len();
    // capacity (offset 0), writeback (32: read-only without CONFIG_WCE), num_queues.
    for (offset, data) in [
        (0u32, (1u64 << 40).to_le_bytes().to_vec()),
        (32, vec![1]),
        (34, 8u16.to_le_bytes().to_vec()),
    ] {
        for flags in [0u32, 1] {
            let ack = fe.set_config(offset, flags, &data).unwrap();
            assert_ne!(ack, 0, "SET_CONFIG at {offset} (flags {flags}) accepted");
            let (_, now) = fe.get_config(0, 60).unwrap();
            assert_eq!(now, before, "the config space changed");
        }
    }
    let mut q = Queue::new(0);
    q.start(&mut fe, &ram);
    q.read_ok(&ram);
    rig.check_cost(log, "SET_CONFIG");
}

#[test]
fn refused_memory_tables_keep_the_old_one() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let mut q = Queue::new(0);
    q.start(&mut fe, &ram);
    q.read_ok(&ram);
    let log = rig.log_len();
    let small = |i: u64| Region {
        gpa: 0x1000_0000 + i * 0x10000,
        size: 0x10000,
        user_addr: ram.user_addr(0),
        mmap_offset: 0,
    };
    // 9 regions without CONFIGURE_MEM_SLOTS (at most 8).
    let nine: Vec<Region> = (0..9).map(small).collect();
    let fds = [ram.fd(); 9];
    assert_ne!(fe.set_mem_table(&nine, &fds).unwrap(), 0, "9 regions");
    alive(&mut fe);
    // Fewer fds than regions.
    let two = [small(0), small(1)];
    assert_ne!(fe.set_mem_table(&two, &[ram.fd()]).unwrap(), 0, "1 fd");
    alive(&mut fe);
    // Overlapping regions.
    let mut overlap = ram.region();
    overlap.gpa = ram.region().size / 2;
    assert_ne!(
        fe.set_mem_table(&[ram.region(), overlap], &[ram.fd(), ram.fd()])
            .unwrap(),
        0,
        "overlapping regions"
    );
    alive(&mut fe);
    // A region one page longer than its memfd: mapped, its last page would be a SIGBUS
    // in the agent at the first access (found by fuzz target vhost_sequence).
    let mut long = ram.region();
    long.size += 0x1000;
    assert_ne!(
        fe.set_mem_table(&[long], &[ram.fd()]).unwrap(),
        0,
        "a region past the end of its file"
    );
    alive(&mut fe);
    // The old table is in force: the rings and buffers in it still work.
    q.read_ok(&ram);
    rig.check_cost(log, "SET_MEM_TABLE");
    q.read_ok(&ram);
}

#[test]
fn rings_outside_the_memory_table_are_refused() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let q = Queue::new(0);
    assert_eq!(fe.set_vring_num(0, u32::from(QUEUE_SIZE)).unwrap(), 0);
    let r = q.ring;
    let (desc, used, avail) = (
        ram.user_addr(r.desc),
        ram.user_addr(r.used),
        ram.user_addr(r.avail),
    );
    let end = ram.user_addr(0) + RAM_LEN as u64;
    let log = rig.log_len();
    for (d, u, a, what) in [
        (end + 0x10000, used, avail, "descriptor table unmapped"),
        (end - 0x800, used, avail, "descriptor table past the end"),
        (desc, end - 0x100, avail, "used ring past the end"),
        (desc, used, end, "avail ring at the end"),
        (desc, used, 0x1000, "avail ring at a low address"),
        (u64::MAX - 0xfff, used, avail, "descriptor table at the top"),
    ] {
        let ack = fe.set_vring_addr(0, d, u, a).unwrap();
        assert_ne!(ack, 0, "SET_VRING_ADDR with {what} accepted");
        alive(&mut fe);
    }
    let mut q = q;
    q.start(&mut fe, &ram);
    q.read_ok(&ram);
    rig.check_cost(log, "SET_VRING_ADDR");
}

#[test]
fn vring_indices_out_of_range_are_refused() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let log = rig.log_len();
    let ev = EventFd::new(EFD_NONBLOCK).unwrap();
    // The attachment has 2 queues: 2, 16 and 255 are out of range; for the fd
    // requests, bits 9..63 are not an index at all.
    for i in [2u32, 16, 255, 0x1_0000] {
        assert_ne!(fe.set_vring_num(i, 256).unwrap(), 0, "NUM {i}");
        assert_ne!(fe.set_vring_base(i, 0).unwrap(), 0, "BASE {i}");
        assert_ne!(
            fe.set_vring_addr(
                i,
                ram.user_addr(0),
                ram.user_addr(0x2000),
                ram.user_addr(0x1000)
            )
            .unwrap(),
            0,
            "ADDR {i}"
        );
        assert_ne!(fe.set_vring_enable(i, true).unwrap(), 0, "ENABLE {i}");
        for r in [req::SET_VRING_KICK, req::SET_VRING_CALL, req::SET_VRING_ERR] {
            let ack = fe
                .set_vring_fd(r, u64::from(i), Some(ev.as_raw_fd()))
                .unwrap();
            assert_ne!(ack, 0, "request {r} index {i}");
        }
        assert_eq!(fe.set_vring_num(1, 256).unwrap(), 0, "after {i}");
    }
    // Both real queues work.
    for i in 0..2 {
        let mut q = Queue::new(i);
        q.start(&mut fe, &ram);
        q.read_ok(&ram);
    }
    rig.check_cost(log, "vring indices");
}

#[test]
fn requests_before_set_owner_are_refused() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = RawFrontend::connect(&rig.sock).unwrap();
    let log = rig.log_len();
    fe.negotiate_protocol(proto::MQ | proto::CONFIG).unwrap();
    let features = (F_PROTOCOL_FEATURES | F_VERSION_1).to_ne_bytes();
    let ev = EventFd::new(EFD_NONBLOCK).unwrap();
    assert_ne!(fe.ack(req::SET_FEATURES, &features, &[]).unwrap(), 0);
    assert_ne!(fe.set_mem_table(&[ram.region()], &[ram.fd()]).unwrap(), 0);
    assert_ne!(fe.set_vring_num(0, 256).unwrap(), 0);
    assert_ne!(fe.set_vring_base(0, 0).unwrap(), 0);
    assert_ne!(
        fe.set_vring_fd(req::SET_VRING_KICK, 0, Some(ev.as_raw_fd()))
            .unwrap(),
        0
    );
    assert_ne!(fe.set_vring_enable(0, true).unwrap(), 0);
    assert_eq!(fe.get_config(0, 60).unwrap(), (0, Vec::new()));
    alive(&mut fe);
    // Then a proper session on the same connection.
    assert_eq!(fe.ack(req::SET_OWNER, &[], &[]).unwrap(), 0);
    assert_eq!(fe.ack(req::SET_FEATURES, &features, &[]).unwrap(), 0);
    assert_eq!(fe.set_mem_table(&[ram.region()], &[ram.fd()]).unwrap(), 0);
    assert_eq!(fe.get_config(0, 60).unwrap().0, 60);
    assert_eq!(fe.get_u64(req::GET_QUEUE_NUM).unwrap(), 2);
    let mut q = Queue::new(0);
    q.start(&mut fe, &ram);
    q.read_ok(&ram);
    rig.check_cost(log, "before SET_OWNER");
}

/// The raw frontend's message layout agrees with the backend: a GET_VRING_BASE after
/// one request and a SET_VRING_BASE with the reserved bits set (refused).
#[test]
fn vring_base_round_trips() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let log = rig.log_len();
    let mut q = Queue::new(1);
    q.start(&mut fe, &ram);
    q.read_ok(&ram);
    q.read_ok(&ram);
    assert_eq!(fe.get_vring_base(1).unwrap(), 2);
    assert_ne!(
        fe.ack(req::SET_VRING_BASE, &vring_state(1, 0x1_0000), &[])
            .unwrap(),
        0
    );
    alive(&mut fe);
    rig.check_cost(log, "vring base");
}

/// A request body of the wrong size, fds on a request that takes none, and a request
/// code the agent does not know: each is read whole, so the stream stays framed, and
/// each gets a failed REPLY_ACK with the session kept. Before, each closed the session
/// without a reply.
#[test]
fn malformed_bodies_and_unknown_codes_get_an_error_ack() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let log = rig.log_len();
    // SET_VRING_NUM and SET_VRING_ADDR 4 bytes short.
    assert_ne!(fe.ack(req::SET_VRING_NUM, &[0u8; 4], &[]).unwrap(), 0);
    assert_ne!(fe.ack(req::SET_VRING_ADDR, &[0u8; 36], &[]).unwrap(), 0);
    // SET_VRING_NUM with an fd it does not take.
    let ev = EventFd::new(EFD_NONBLOCK).unwrap();
    assert_ne!(
        fe.ack(req::SET_VRING_NUM, &vring_state(0, 128), &[ev.as_raw_fd()])
            .unwrap(),
        0
    );
    // A code no vhost-user version has, asking for an ack.
    assert_ne!(fe.ack(0x7ff, &[0u8; 8], &[]).unwrap(), 0);
    alive(&mut fe);
    // The session works on: a queue starts and serves.
    let mut q0 = Queue::new(0);
    q0.start(&mut fe, &ram);
    q0.read_ok(&ram);
    rig.check_cost(log, "malformed bodies and unknown codes");
}

/// A kick fd that is not an eventfd: a socket whose peer is gone stays readable for
/// ever (the queue's worker would spin on it), a regular file cannot be polled. Both
/// are refused with an error ack; an eventfd then works.
#[test]
fn a_kick_fd_that_is_not_an_eventfd_is_refused() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let log = rig.log_len();
    let q0 = Queue::new(0);
    assert_eq!(fe.set_vring_num(0, u32::from(QUEUE_SIZE)).unwrap(), 0);
    assert_eq!(fe.set_vring_base(0, 0).unwrap(), 0);
    q0.set_addr(&mut fe, &ram);
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    drop(b);
    let file = tempfile::tempfile().unwrap();
    for (what, fd) in [("socket", a.as_raw_fd()), ("file", file.as_raw_fd())] {
        assert_ne!(
            fe.set_vring_fd(req::SET_VRING_KICK, 0, Some(fd)).unwrap(),
            0,
            "a {what} taken as a kick fd"
        );
    }
    alive(&mut fe);
    let mut q0 = q0;
    q0.start(&mut fe, &ram);
    q0.read_ok(&ram);
    rig.check_cost(log, "kick fds that are not eventfds");
}

/// Every request that asks for a reply gets one, whatever order it comes in (issue 39):
/// GET_VRING_BASE and GET_INFLIGHT_FD before SET_OWNER, GET_VRING_BASE of a queue the
/// attachment does not have, GET_INFLIGHT_FD without its protocol feature: each has
/// no error form in the vhost-user spec, and each gets its reply without a body (the
/// front-end fails that request); the session goes on and serves. Before, each closed
/// the session without a reply.
#[test]
fn requests_with_a_reply_of_their_own_are_answered_in_any_order() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = RawFrontend::connect(&rig.sock).unwrap();
    let log = rig.log_len();
    fe.negotiate_protocol(proto::MQ | proto::CONFIG).unwrap();
    // Before SET_OWNER.
    for (code, body) in [
        (req::GET_VRING_BASE, vring_state(0, 0)),
        (req::GET_INFLIGHT_FD, vec![0u8; 24]),
    ] {
        let r = fe.call(code, &body, &[]).unwrap();
        assert!(
            r.payload.is_empty(),
            "request {code} before SET_OWNER: {r:?}"
        );
    }
    alive(&mut fe);
    assert_eq!(fe.ack(req::SET_OWNER, &[], &[]).unwrap(), 0);
    let features = (F_PROTOCOL_FEATURES | F_VERSION_1).to_ne_bytes();
    assert_eq!(fe.ack(req::SET_FEATURES, &features, &[]).unwrap(), 0);
    assert_eq!(fe.set_mem_table(&[ram.region()], &[ram.fd()]).unwrap(), 0);
    // A queue it does not have; a request of a protocol feature not negotiated.
    let r = fe
        .call(req::GET_VRING_BASE, &vring_state(7, 0), &[])
        .unwrap();
    assert!(r.payload.is_empty(), "GET_VRING_BASE of queue 7: {r:?}");
    let r = fe.call(req::GET_INFLIGHT_FD, &[0u8; 24], &[]).unwrap();
    assert!(
        r.payload.is_empty(),
        "GET_INFLIGHT_FD without its feature: {r:?}"
    );
    alive(&mut fe);
    let mut q = Queue::new(0);
    q.start(&mut fe, &ram);
    q.read_ok(&ram);
    rig.check_cost(log, "requests with a reply, out of order");
}
