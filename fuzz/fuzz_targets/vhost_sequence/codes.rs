//! What each vhost-user request code is: whether it has an ack form or a reply of its
//! own, whether it may carry fds, its payload size; and a message as sent.

use super::*;

/// Request codes that have no reply of their own (a REPLY_ACK status is their reply).
pub(crate) fn ack_form(code: u32) -> bool {
    matches!(
        code,
        req::SET_OWNER
            | req::RESET_OWNER
            | req::SET_FEATURES
            | req::SET_PROTOCOL_FEATURES
            | req::SET_MEM_TABLE
            | req::SET_VRING_NUM
            | req::SET_VRING_ADDR
            | req::SET_VRING_BASE
            | req::SET_VRING_KICK
            | req::SET_VRING_CALL
            | req::SET_VRING_ERR
            | req::SET_VRING_ENABLE
            | req::SET_CONFIG
            | req::SET_INFLIGHT_FD
            | req::RESET_DEVICE
    )
}

/// Request codes answered with a reply of their own.
pub(crate) fn has_reply_body(code: u32) -> bool {
    matches!(
        code,
        req::GET_FEATURES
            | req::GET_PROTOCOL_FEATURES
            | req::GET_VRING_BASE
            | req::GET_QUEUE_NUM
            | req::GET_CONFIG
            | req::GET_INFLIGHT_FD
            | req::GET_MAX_MEM_SLOTS
            // SET_LOG_BASE, POSTCOPY_ADVISE, GET_SHARED_OBJECT, SET_DEVICE_STATE_FD,
            // CHECK_DEVICE_STATE, GET_SHMEM_CONFIG
            | 6 | 28 | 41 | 42 | 43 | 44
    )
}

/// Requests that may carry fds.
pub(crate) fn takes_fds(code: u32) -> bool {
    matches!(
        code,
        req::SET_MEM_TABLE
            | req::SET_VRING_KICK
            | req::SET_VRING_CALL
            | req::SET_VRING_ERR
            | req::SET_INFLIGHT_FD
            | req::ADD_MEM_REG
            | req::REM_MEM_REG
    )
}

/// The payload size of a well-formed request, where fixed.
pub(crate) fn fixed_size(code: u32) -> Option<usize> {
    Some(match code {
        req::SET_OWNER | req::RESET_OWNER | req::RESET_DEVICE => 0,
        req::GET_FEATURES | req::GET_PROTOCOL_FEATURES => 0,
        req::SET_FEATURES | req::SET_PROTOCOL_FEATURES => 8,
        req::SET_VRING_NUM | req::SET_VRING_BASE | req::SET_VRING_ENABLE => 8,
        req::SET_VRING_KICK | req::SET_VRING_CALL | req::SET_VRING_ERR => 8,
        req::SET_VRING_ADDR => 40,
        req::SET_INFLIGHT_FD => 24,
        _ => return None,
    })
}

pub(crate) fn name(code: u32) -> String {
    let n = match code {
        req::GET_FEATURES => "GET_FEATURES",
        req::SET_FEATURES => "SET_FEATURES",
        req::SET_OWNER => "SET_OWNER",
        req::RESET_OWNER => "RESET_OWNER",
        req::SET_MEM_TABLE => "SET_MEM_TABLE",
        req::SET_VRING_NUM => "SET_VRING_NUM",
        req::SET_VRING_ADDR => "SET_VRING_ADDR",
        req::SET_VRING_BASE => "SET_VRING_BASE",
        req::GET_VRING_BASE => "GET_VRING_BASE",
        req::SET_VRING_KICK => "SET_VRING_KICK",
        req::SET_VRING_CALL => "SET_VRING_CALL",
        req::SET_VRING_ERR => "SET_VRING_ERR",
        req::GET_PROTOCOL_FEATURES => "GET_PROTOCOL_FEATURES",
        req::SET_PROTOCOL_FEATURES => "SET_PROTOCOL_FEATURES",
        req::GET_QUEUE_NUM => "GET_QUEUE_NUM",
        req::SET_VRING_ENABLE => "SET_VRING_ENABLE",
        req::GET_CONFIG => "GET_CONFIG",
        req::SET_CONFIG => "SET_CONFIG",
        req::GET_INFLIGHT_FD => "GET_INFLIGHT_FD",
        req::SET_INFLIGHT_FD => "SET_INFLIGHT_FD",
        req::RESET_DEVICE => "RESET_DEVICE",
        req::GET_MAX_MEM_SLOTS => "GET_MAX_MEM_SLOTS",
        req::ADD_MEM_REG => "ADD_MEM_REG",
        req::REM_MEM_REG => "REM_MEM_REG",
        _ => return format!("request {code:#x}"),
    };
    n.to_owned()
}

/// A message as sent.
pub(crate) struct Msg<'a> {
    pub(crate) code: u32,
    pub(crate) flags: u32,
    pub(crate) payload: &'a [u8],
    pub(crate) fds: &'a [RawFd],
    /// A header that claims this size, sent without the payload.
    pub(crate) lie: Option<u32>,
}

pub(crate) fn msg<'a>(code: u32, payload: &'a [u8], fds: &'a [RawFd]) -> Msg<'a> {
    Msg {
        code,
        flags: VERSION | NEED_REPLY,
        payload,
        fds,
        lie: None,
    }
}

pub(crate) fn state(index: u32, num: u32) -> Vec<u8> {
    vhost_raw::vring_state(index, num)
}

pub(crate) fn ack_of(o: &Outcome) -> String {
    match o {
        Outcome::Done => "done".into(),
        Outcome::Ack(v) => format!("ack {v}"),
        Outcome::Reply(r, fds) => format!("reply of {} bytes, {} fds", r.payload.len(), fds.len()),
        Outcome::Closed => "closed".into(),
    }
}
