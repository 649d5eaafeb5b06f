//! How much of the borrower a VMM's vhost-user socket may use: one message budget per
//! attachment (disk or NIC), shared by every connection to its socket.
//!
//! A VMM that sends valid messages as fast as it can (stopping and restarting a queue in
//! a loop, reconnecting over and over) would otherwise cost the compute agent as much
//! CPU as it likes: each message is cheap alone, but a queue's stop and restart (eight
//! messages) takes some 0.5 ms of the agent's time. Past a burst that covers what QEMU sends to set up or
//! reset a device with many queues, the connection's thread sleeps before it reads the
//! next message, and the VMM's writes wait in the socket buffer in turn.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use vhost::vhost_user::Listener;
use vhost_user_backend::MessageBudget;

/// Messages a VMM may send at once, from an idle budget. QEMU sets up a 16-queue device
/// in about 150 and resets it in about 130; a guest reboot, a memory hot-plug or a
/// migration's start stay well inside it.
pub const BURST: u32 = 2048;

/// Messages a second once the burst is spent. A queue stopped and restarted in a loop
/// costs the agent about 60 µs a message (measured: 108 320 messages in 4 s took 68 % of
/// a core without a budget), so at most some 3 % of a core.
pub const PER_SECOND: u32 = 500;

/// What a new connection to the socket costs in messages: serving it sets up a backend
/// (a fabric session per queue), so a VMM that connects in a loop is slowed as one that
/// floods messages is. A connection whose peer has gone by its turn costs nothing
/// ([`admit_connection`]): a flood of connections closed at once is drained at accept
/// speed and does not keep the next VMM waiting.
pub const CONNECT_COST: u32 = 64;

/// A fresh budget for one attachment.
pub fn for_attachment() -> MessageBudget {
    MessageBudget::new(BURST, PER_SECOND)
}

/// Accepts the connection pending on `listener` (a disk's or a NIC's vhost-user socket,
/// attachment `id`) and returns it if [`admit_connection`] admits it: `None` if it went
/// away before it was accepted or before its turn, or the accept failed (logged under a
/// rate limit).
pub fn accept_admitted(
    listener: &Listener,
    budget: &MessageBudget,
    stop: &AtomicBool,
    id: &str,
) -> Option<UnixStream> {
    let stream = match listener.accept() {
        Ok(stream) => stream?,
        Err(e) => {
            devlend_fabric::limited!(warn, attachment = %id, error = %e, "cannot accept a vhost-user connection");
            std::thread::sleep(Duration::from_millis(100));
            return None;
        }
    };
    admit_connection(budget, &stream, stop).then_some(stream)
}

/// Whether to serve `stream`, a connection just accepted: waits until `budget` holds a
/// connection's cost, then takes it if the peer is still there. False (nothing taken)
/// for a peer that has gone, or once `stop` is set.
pub fn admit_connection(budget: &MessageBudget, stream: &UnixStream, stop: &AtomicBool) -> bool {
    budget.admit(CONNECT_COST, stop, || peer_is_there(stream))
}

/// Whether the other end of `stream` is still connected (it has not closed or shut its
/// writing side down).
fn peer_is_there(stream: &UnixStream) -> bool {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call; no wait.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n >= 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_left_is_not_admitted_and_costs_nothing() {
        let budget = MessageBudget::new(BURST, PER_SECOND);
        let stop = AtomicBool::new(false);
        for _ in 0..1000 {
            let (a, b) = UnixStream::pair().unwrap();
            drop(b);
            assert!(!admit_connection(&budget, &a, &stop));
        }
        let (a, _b) = UnixStream::pair().unwrap();
        let t = std::time::Instant::now();
        assert!(admit_connection(&budget, &a, &stop));
        assert!(t.elapsed() < std::time::Duration::from_millis(50));
        assert_eq!(budget.throttled(), 0);
    }
}
