//! How much of the borrower a VMM's vhost-user socket may use: one message budget per
//! attachment (disk or NIC), shared by every connection to its socket.
//!
//! A VMM that sends valid messages as fast as it can (stopping and restarting a queue in
//! a loop, reconnecting over and over) would otherwise cost the compute agent as much
//! CPU as it likes: each message is cheap alone, but a queue's stop and restart (eight
//! messages) takes some 0.5 ms of the agent's time. Past a burst that covers what QEMU sends to set up or
//! reset a device with many queues, the connection's thread sleeps before it reads the
//! next message, and the VMM's writes wait in the socket buffer in turn.

use std::sync::atomic::AtomicBool;

use vhost_user_backend::MessageBudget;

/// Messages a VMM may send at once, from an idle budget. QEMU sets up a 16-queue device
/// in about 150 and resets it in about 130; a guest reboot, a memory hot-plug or a
/// migration's start stay well inside it.
pub const BURST: u32 = 2048;

/// Messages a second once the burst is spent. A queue stopped and restarted in a loop
/// costs the agent about 60 µs a message (measured: 108 320 messages in 4 s took 68 % of
/// a core without a budget), so at most some 3 % of a core.
pub const PER_SECOND: u32 = 500;

/// What a new connection to the socket costs in messages: accepting it sets up a
/// backend (a fabric session per queue), so a VMM that connects and closes in a loop is
/// slowed as one that floods messages is.
pub const CONNECT_COST: u32 = 64;

/// A fresh budget for one attachment.
pub fn for_attachment() -> MessageBudget {
    MessageBudget::new(BURST, PER_SECOND)
}

/// Draws a new connection's cost from `budget`, sleeping until it is there (or `stop`
/// is set).
pub fn charge_connect(budget: &MessageBudget, stop: &AtomicBool) {
    budget.wait(CONNECT_COST, stop);
}
