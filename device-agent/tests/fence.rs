//! The fence (docs/protocol.md, "Fencing a queue's earlier session"): the lender runs
//! the requests of a borrower's new session on a queue only once every earlier session
//! of that borrower and queue has ended, nothing of it in flight and nothing it still
//! had to read run. A spawned lender, real TCP sessions, and a lender whose first write
//! is held back as a slow device would hold it (`Options::hold_first_write`).

mod common;

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::{raw_header, Client, Fixture, IO_TIMEOUT};
use devlend_device_agent::{HoldFirstWrite, Options};
use devlend_fabric::tcp::{self, ConnectError};
use devlend_fabric::{Hello, HelloStatus, Op, Status};

const MIB: u64 = 1 << 20;
const BLOCK: usize = 4096;

/// A block of generation `g`.
fn generation(g: u8) -> Vec<u8> {
    vec![g; BLOCK]
}

fn hello(borrower: [u8; 16], queue: u16) -> Hello {
    let mut h = Hello::new("disk0", queue);
    h.borrower = borrower;
    h
}

fn connect_as(fx: &Fixture, borrower: [u8; 16], queue: u16) -> Result<Client, ConnectError> {
    let (sock, reply) =
        tcp::connect_as(&fx.addr().to_string(), &hello(borrower, queue), IO_TIMEOUT)?;
    sock.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    Ok(Client::from_stream(
        sock,
        reply.block().cloned().expect("a block device"),
    ))
}

/// Sends a write and does not wait for its answer.
fn send_write(c: &mut Client, sector: u64, data: &[u8]) {
    let id = c.id();
    let mut frame = raw_header(Op::Write as u8, 0, data.len() as u32, id, sector).to_vec();
    frame.extend_from_slice(data);
    c.sock.write_all(&frame).expect("send the write");
}

/// [`connect_as`], retried while the lender answers busy, for up to 10 s.
fn connect_retrying_busy(fx: &Fixture, borrower: [u8; 16], queue: u16) -> Client {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        match connect_as(fx, borrower, queue) {
            Ok(c) => return c,
            Err(ConnectError::Refused {
                status: HelloStatus::Busy,
                ..
            }) if Instant::now() < end => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("queue {queue} not admitted: {e}"),
        }
    }
}

fn lender_holding_first_write(hold: Duration) -> Fixture {
    let options = Options {
        hold_first_write: Some(HoldFirstWrite::new(hold)),
        ..Options::default()
    };
    Fixture::with_options(&[("disk0", MIB, false)], options)
}

fn on_file(fx: &Fixture) -> Vec<u8> {
    let f = std::fs::File::open(fx.path("disk0")).expect("image");
    let mut b = vec![0u8; BLOCK];
    f.read_exact_at(&mut b, 0).expect("read image");
    b
}

/// The failover of issue 36 on one queue: the old session's write of generation 1 is
/// still held by the device when the borrower gives the session up, resends that write
/// on a new session and, once it is acknowledged, writes generation 2 to the same
/// sectors. Without the fence the held write lands last and generation 1 is on the
/// disk; with it, the new session is answered only after the old one ended.
#[test]
fn a_held_write_of_the_old_session_never_lands_after_the_resent_ones() {
    let hold = Duration::from_millis(1000);
    let fx = lender_holding_first_write(hold);
    let borrower = [7; 16];
    let mut old = connect_as(&fx, borrower, 0).expect("first session");
    send_write(&mut old, 0, &generation(1));
    // The lender has the write (it holds it): give it a moment to read it.
    std::thread::sleep(Duration::from_millis(200));

    let t = Instant::now();
    let mut new = connect_as(&fx, borrower, 0).expect("the new session is admitted");
    let admitted_after = t.elapsed();
    assert_eq!(new.write(0, &generation(1)), Status::Ok, "the resent write");
    assert_eq!(new.write(0, &generation(2)), Status::Ok, "the newer write");
    // Long past the hold: the held write, had it been left to run, has landed.
    std::thread::sleep(hold + Duration::from_millis(500));
    assert_eq!(
        on_file(&fx)[..16],
        generation(2)[..16],
        "the old session's held write landed after the newer write (no fence)"
    );
    assert!(new.read(0, BLOCK as u32) == (Status::Ok, generation(2)));
    // The new session waited for the old one's write, and the old one was closed
    // without an answer to it: the borrower resent it.
    assert!(
        admitted_after >= Duration::from_millis(500),
        "the new session was admitted after {admitted_after:?}, while the old one still held a write"
    );
    assert!(old.is_closed_by_peer(), "the fenced session is closed");
}

/// An earlier session that does not end within the fence's wait (its device holds a
/// write longer) gets the new session refused as busy, which a borrower retries; once
/// it ended, the next attempt is admitted.
#[test]
fn a_session_that_cannot_be_fenced_in_time_is_answered_busy() {
    let fx = lender_holding_first_write(Duration::from_secs(4));
    let borrower = [9; 16];
    let mut old = connect_as(&fx, borrower, 3).expect("first session");
    send_write(&mut old, 0, &generation(1));
    std::thread::sleep(Duration::from_millis(200));
    match connect_as(&fx, borrower, 3) {
        Err(ConnectError::Refused {
            status, message, ..
        }) => {
            assert_eq!(status, HelloStatus::Busy);
            assert!(message.contains("earlier session"), "{message}");
        }
        Ok(_) => panic!("admitted while the earlier session still holds a write"),
        Err(e) => panic!("expected busy, got {e}"),
    }
    let mut new = connect_retrying_busy(&fx, borrower, 3);
    assert_eq!(new.write(0, &generation(2)), Status::Ok);
    assert_eq!(on_file(&fx)[..16], generation(2)[..16]);
}

/// Only the same borrower's session on the same queue is fenced: its other queues,
/// other borrowers and anonymous sessions (no identity to tell them apart) go on.
#[test]
fn other_queues_borrowers_and_anonymous_sessions_are_not_fenced() {
    let fx = Fixture::new(&[("disk0", MIB, false)]);
    // Anonymous sessions (refused while a borrower holds the device) on one queue both
    // serve.
    {
        let mut anon1 = fx.connect("disk0");
        let mut anon2 = fx.connect("disk0");
        assert_eq!(anon1.flush(), Status::Ok);
        assert_eq!(anon2.flush(), Status::Ok);
        assert_eq!(
            anon1.flush(),
            Status::Ok,
            "the first anonymous session goes on"
        );
    }
    let a = [1; 16];
    // Busy until the anonymous sessions' ends are seen.
    let mut q0 = connect_retrying_busy(&fx, a, 0);
    let mut q1 = connect_as(&fx, a, 1).expect("queue 1");
    for c in [&mut q0, &mut q1] {
        assert_eq!(c.write(8, &generation(3)), Status::Ok);
    }
    // A second session of queue 0 fences the first, not queue 1's.
    let mut q0b = connect_as(&fx, a, 0).expect("queue 0 again");
    assert!(
        q0.is_closed_by_peer(),
        "the earlier session of queue 0 is fenced"
    );
    assert!(q1.read(8, BLOCK as u32) == (Status::Ok, generation(3)));
    assert!(q0b.read(8, BLOCK as u32) == (Status::Ok, generation(3)));
}

/// A lender at its maximum of sessions still admits the reconnect of a borrower's queue:
/// the earlier session it fences (left alive by a silent cut) is one of those counted.
#[test]
fn a_lender_at_its_session_maximum_admits_the_session_that_fences_an_earlier_one() {
    let options = Options {
        max_sessions: 1,
        ..Options::default()
    };
    let fx = Fixture::with_options(&[("disk0", MIB, false)], options);
    let borrower = [5; 16];
    let mut old = connect_as(&fx, borrower, 0).expect("first session");
    assert_eq!(old.write(0, &generation(4)), Status::Ok);
    let mut new = connect_as(&fx, borrower, 0)
        .expect("the reconnect is admitted though the lender serves its maximum");
    assert!(new.read(0, BLOCK as u32) == (Status::Ok, generation(4)));
    assert!(old.is_closed_by_peer(), "the earlier session is fenced");
    // Another borrower's session is still over the maximum.
    match connect_as(&fx, [6; 16], 0) {
        Err(ConnectError::Refused { status, .. }) => assert_eq!(status, HelloStatus::Busy),
        Ok(_) => panic!("a second borrower admitted past the maximum"),
        Err(e) => panic!("expected busy, got {e}"),
    }
}
