//! How a lent NIC's link is told: in `devlend attach`'s words and in the LINK column of
//! `devlend status`.

use devlend_compute_agent::api::{AttachmentInfo, NicInfo};

/// A NIC attachment's link as people are told it: the guest's link is up once the
/// lender's is and a VMM runs every queue pair, so a NIC with no VMM yet is not "down"
/// when the lender's link is up.
#[derive(Clone, Copy, PartialEq, Eq)]
enum NicLinkState {
    /// The guest's link is up.
    Up,
    /// The lender's link is up and no VMM has joined the socket yet.
    UpNoVmm,
    /// The lender's link is up, a VMM joined, not every queue pair is connected.
    Connecting,
    /// The lender's link is down.
    Down,
}

fn nic_link_state(n: &NicInfo, connected: bool) -> NicLinkState {
    match (n.link_up, n.lender_link_up, connected) {
        (true, _, _) => NicLinkState::Up,
        (false, true, false) => NicLinkState::UpNoVmm,
        (false, true, true) => NicLinkState::Connecting,
        (false, false, _) => NicLinkState::Down,
    }
}

/// How `devlend attach` words a NIC's link (`connected`: a VMM has joined the socket).
pub fn nic_link_words(n: &NicInfo, connected: bool) -> &'static str {
    match nic_link_state(n, connected) {
        NicLinkState::Up => "link up",
        NicLinkState::UpNoVmm => {
            "link up on the lender (the guest's link follows once a VMM joins the socket)"
        }
        NicLinkState::Connecting => "link up on the lender, queue pairs connecting",
        NicLinkState::Down => "link down on the lender",
    }
}

/// The LINK column of a NIC: `up` when the guest's link is, and, with no VMM joined
/// yet, when the lender's is (STATE says `waiting`); `down` otherwise; `-` while
/// restoring.
pub(super) fn nic_link_column(a: &AttachmentInfo, n: &NicInfo) -> &'static str {
    if a.restoring.is_some() {
        return "-";
    }
    match nic_link_state(n, a.connected) {
        NicLinkState::Up | NicLinkState::UpNoVmm => "up",
        NicLinkState::Connecting | NicLinkState::Down => "down",
    }
}
