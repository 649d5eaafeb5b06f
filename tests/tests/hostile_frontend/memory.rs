//! Memory the frontend shares and then shrinks under the agent: the inflight buffer,
//! sealable guest RAM, guest RAM that cannot be sealed.

use super::*;

/// A frontend that truncates the inflight buffer under the agent (GET_INFLIGHT_FD,
/// SET_INFLIGHT_FD, ftruncate 0) made the next request a SIGBUS that killed the whole
/// agent. The buffer the agent returns is now sealed against resizing, and a buffer
/// that cannot be sealed against shrinking is refused: the truncation fails (EPERM),
/// the queue goes on serving and so does the other attachment.
#[test]
fn an_inflight_buffer_cannot_be_shrunk_under_the_agent() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = RawFrontend::connect(&rig.sock).unwrap();
    fe.negotiate(0, proto::MQ | proto::CONFIG | proto::INFLIGHT_SHMFD)
        .unwrap();
    assert_eq!(fe.set_mem_table(&[ram.region()], &[ram.fd()]).unwrap(), 0);
    let log = rig.log_len();
    let mut ask = Vec::new();
    ask.extend_from_slice(&0u64.to_ne_bytes());
    ask.extend_from_slice(&0u64.to_ne_bytes());
    ask.extend_from_slice(&2u16.to_ne_bytes());
    ask.extend_from_slice(&QUEUE_SIZE.to_ne_bytes());
    ask.extend_from_slice(&[0; 4]);
    fe.send(req::GET_INFLIGHT_FD, VERSION, &ask, &[]).unwrap();
    let (reply, fds) = fe.recv_with_fds().unwrap();
    assert_eq!(reply.request, req::GET_INFLIGHT_FD);
    let buffer = fds.into_iter().next().expect("GET_INFLIGHT_FD sent no fd");
    let size = u64::from_ne_bytes(reply.payload[..8].try_into().unwrap());

    // A buffer that cannot be sealed against shrinking is refused; the session goes on.
    // SAFETY: a NUL-terminated name and valid flags.
    let raw = unsafe { libc::memfd_create(c"unsealable".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0);
    // SAFETY: a fresh fd that nothing else owns.
    let unsealable = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    // SAFETY: ftruncate of our own memfd.
    assert_eq!(unsafe { libc::ftruncate(raw, size as libc::off_t) }, 0);
    assert_ne!(
        fe.ack(
            req::SET_INFLIGHT_FD,
            &reply.payload,
            &[unsealable.as_raw_fd()]
        )
        .unwrap(),
        0,
        "an inflight buffer that can shrink was taken"
    );
    alive(&mut fe);

    assert_eq!(
        fe.ack(req::SET_INFLIGHT_FD, &reply.payload, &[buffer.as_raw_fd()])
            .unwrap(),
        0
    );
    let mut q0 = Queue::new(0);
    let mut q1 = Queue::new(1);
    q0.start(&mut fe, &ram);
    q1.start(&mut fe, &ram);
    q0.read_ok(&ram);
    // SAFETY: ftruncate of an fd the test owns.
    let truncated = unsafe { libc::ftruncate(buffer.as_raw_fd(), 0) };
    let errno = std::io::Error::last_os_error().raw_os_error();
    q1.read_ok(&ram);
    q0.read_ok(&ram);
    rig.borrower.proc.check_alive().unwrap();
    assert_eq!(
        (truncated, errno),
        (-1, Some(libc::EPERM)),
        "the inflight buffer could be truncated"
    );
    alive(&mut fe);
    rig.check_cost(log, "inflight buffer truncated");
}

/// Guest RAM in a memfd made with MFD_ALLOW_SEALING (as QEMU's memory-backend-memfd
/// makes it, less its seals): the agent seals it against shrinking when it takes the
/// memory table, so a frontend's later ftruncate fails (EPERM) instead of turning the
/// agent's next access into a SIGBUS.
#[test]
fn sealable_guest_ram_is_sealed_against_shrinking() {
    let mut rig = rig();
    let ram = GuestRam::sealable(0, RAM_LEN).unwrap();
    let mut fe = rig.session(&ram);
    let log = rig.log_len();
    let mut q = Queue::new(0);
    q.start(&mut fe, &ram);
    q.read_ok(&ram);
    // SAFETY: ftruncate of an fd the test owns.
    let truncated = unsafe { libc::ftruncate(ram.fd(), 0) };
    let errno = std::io::Error::last_os_error().raw_os_error();
    assert_eq!(
        (truncated, errno),
        (-1, Some(libc::EPERM)),
        "guest RAM could be truncated under the agent"
    );
    q.read_ok(&ram);
    alive(&mut fe);
    rig.check_cost(log, "guest RAM truncated");
}

/// Guest RAM whose file cannot be sealed (a memfd made without MFD_ALLOW_SEALING, as a
/// file in /dev/shm or hugetlbfs cannot be) truncated by the frontend under the agent:
/// the agent's next read of the rings there was a SIGBUS that killed it, with every
/// attachment it served. Now the fault is turned into a zero page: the agent lives, the
/// queue stops with NEEDS_RESET (its error eventfd), and the other attachment serves.
/// Without `backend/src/sigbus.rs` the agent dies at the kick.
#[test]
fn guest_ram_truncated_under_the_agent_costs_only_that_device() {
    let mut rig = rig();
    let ram = ram();
    let mut fe = rig.session(&ram);
    let mut q0 = Queue::new(0);
    q0.start(&mut fe, &ram);
    q0.read_ok(&ram);
    let log = rig.log_len();
    // SAFETY: ftruncate of an fd the test owns; the test does not touch its own
    // mapping of the lost range afterwards.
    assert_eq!(unsafe { libc::ftruncate(ram.fd(), 0) }, 0, "not truncated");
    q0.kick.write(1).unwrap();
    let mut pfd = libc::pollfd {
        fd: q0.err.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, 5000) };
    rig.borrower
        .proc
        .check_alive()
        .expect("the agent died of the truncated guest RAM");
    assert_eq!(n, 1, "the queue on lost guest RAM was not stopped");
    alive(&mut fe);
    rig.check_cost(log, "guest RAM truncated under the agent");
}
