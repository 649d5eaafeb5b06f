//! The holding session with several paths: it opens on the first path that answers,
//! and when that session drops it is opened again from the path after the one it was
//! on, not from the path after the first.

use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

use devlend_backend::blk::holder::{self, Holder};
use devlend_backend::lender::LenderTarget;
use devlend_fabric::handshake::{Hello, DEV_DISCARD};
use devlend_fabric::{BlockGeometry, HelloReply};

fn info() -> BlockGeometry {
    BlockGeometry {
        capacity_sectors: 2048,
        block_size: 512,
        max_transfer: 1 << 20,
        max_discard_sectors: 1024,
        max_write_zeroes_sectors: 0,
        flags: DEV_DISCARD,
        serial: [0; 20],
    }
}

/// A lender path that answers every hello; each session it takes is reported on
/// `sessions` as `(path, n)` and handed to `keep` (which may drop it).
fn path(
    name: usize,
    sessions: mpsc::Sender<(usize, usize)>,
    keep: impl Fn(usize, TcpStream) + Send + 'static,
) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for (n, s) in l.incoming().enumerate() {
            let mut s = s.unwrap();
            if Hello::read_from(&mut s).is_err() {
                continue;
            }
            HelloReply::ok(info()).write_to(&mut s).unwrap();
            let _ = sessions.send((name, n));
            keep(n, s);
        }
    });
    addr
}

#[test]
fn a_lost_holding_session_reopens_from_the_path_after_its_own() {
    let (tx, rx) = mpsc::channel();
    // Path 0: nothing listens. Path 1 takes the first session and then drops it.
    // Path 2 takes sessions.
    let dead = TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap().to_string();
    drop(dead);
    let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let one = {
        let held = held.clone();
        path(1, tx.clone(), move |n, s| {
            if n > 0 {
                held.lock().unwrap().push(s);
            }
        })
    };
    let two = {
        let held = held.clone();
        path(2, tx, move |_, s| held.lock().unwrap().push(s))
    };
    let mut target = LenderTarget::direct(dead_addr, "disk0", [7; 16]);
    target.alt_addrs = vec![one, two];
    let (stream, _, on) = holder::open(&target).expect("path 1 answers");
    assert_eq!(on, 1, "opened on the first path that answers");
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), (1, 0));
    let _holder = Holder::start("disk0", target, stream, on).expect("holder");
    // Path 1 dropped that session (its handler let the stream go): the next one opens
    // on path 2, the path after it.
    let next = rx.recv_timeout(Duration::from_secs(10)).expect("reopened");
    assert_eq!(next.0, 2, "reopened on path {} first", next.0);
}

/// A lender that fences an earlier session of the queue answers the hello only once
/// that ended (up to 2 s): with several paths the session still opens, and its path
/// is not given up after the shorter connect timeout of a path.
#[test]
fn a_path_waits_for_a_hello_answered_late() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let mut s = s.unwrap();
            if Hello::read_from(&mut s).is_err() {
                continue;
            }
            std::thread::sleep(Duration::from_millis(1_600));
            HelloReply::ok(info()).write_to(&mut s).unwrap();
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    let mut target = LenderTarget::direct(addr, "disk0", [7; 16]);
    target.alt_addrs = vec!["127.0.0.1:9".into()];
    target
        .open(&target.hello(0))
        .expect("the late answer is waited for");
}
