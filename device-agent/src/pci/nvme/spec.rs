//! What the mediator needs of the NVMe Base Specification 2.0 (and the NVM Command Set
//! Specification 1.0): controller registers (§3.1), queue entries (§4.2, §4.6), status
//! codes (§4.6.1.2), admin (§5) and NVM (NVM CS §3) opcodes.

/// Controller Capabilities (§3.1.3.1), 8 bytes: MQES 15:0 (entries - 1), DSTRD 35:32.
pub(crate) const REG_CAP: u64 = 0x00;
/// NVM Subsystem Reset (§3.1.3.6).
pub(crate) const REG_NSSR: u64 = 0x20;
/// Controller Configuration (§3.1.3.5): EN bit 0, MPS 10:7, IOSQES 19:16, IOCQES 23:20.
pub(crate) const REG_CC: u64 = 0x14;
/// Admin Queue Attributes (§3.1.3.8): ASQS 11:0, ACQS 27:16 (entries - 1).
pub(crate) const REG_AQA: u64 = 0x24;
/// Admin Submission Queue Base Address (§3.1.3.9), 8 bytes.
pub(crate) const REG_ASQ: u64 = 0x28;
/// Admin Completion Queue Base Address (§3.1.3.10), 8 bytes.
pub(crate) const REG_ACQ: u64 = 0x30;
/// First doorbell (§3.1.3.24): SQ y tail at `0x1000 + 2y * stride`, CQ y head at
/// `0x1000 + (2y + 1) * stride`, `stride = 4 << CAP.DSTRD` bytes.
pub(crate) const REG_DOORBELLS: u64 = 0x1000;

/// CC.EN.
pub(crate) const CC_EN: u32 = 1;
/// CC.MPS mask (memory page size `2 ^ (12 + MPS)`); the mediator requires 0 (4 KiB).
pub(crate) const CC_MPS_MASK: u32 = 0xf << 7;

/// The memory page size the mediator works with (CC.MPS = 0), in bytes.
pub(crate) const PAGE: usize = 4096;
/// Bytes of a submission queue entry (§4.2; CC.IOSQES = 6).
pub(crate) const SQE: usize = 64;
/// Bytes of a completion queue entry (§4.6; CC.IOCQES = 4).
pub(crate) const CQE: usize = 16;

/// Status code type Generic Command Status (§4.6.1.2.1).
pub(crate) const SCT_GENERIC: u16 = 0;
/// Status code type Command Specific Status (§4.6.1.2.2).
pub(crate) const SCT_COMMAND: u16 = 1;

/// An NVMe status: status code type and status code (the completion's Status field,
/// bits 15:1 of DW3 31:16, without the phase bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Status {
    /// Status Code Type (3 bits).
    pub(crate) sct: u16,
    /// Status Code (8 bits).
    pub(crate) sc: u16,
}

impl Status {
    /// The 15-bit status field: SC 7:0, SCT 10:8, DNR (do not retry) 14 set.
    pub(crate) fn field(self) -> u16 {
        self.sc | self.sct << 8 | 1 << 14
    }
}

/// Generic 01h: Invalid Command Opcode.
pub(crate) const INVALID_OPCODE: Status = Status {
    sct: SCT_GENERIC,
    sc: 0x01,
};
/// Generic 02h: Invalid Field in Command.
pub(crate) const INVALID_FIELD: Status = Status {
    sct: SCT_GENERIC,
    sc: 0x02,
};
/// Generic 03h: Command ID Conflict.
pub(crate) const CID_CONFLICT: Status = Status {
    sct: SCT_GENERIC,
    sc: 0x03,
};
/// Generic 04h: Data Transfer Error.
pub(crate) const DATA_TRANSFER_ERROR: Status = Status {
    sct: SCT_GENERIC,
    sc: 0x04,
};
/// Generic 06h: Internal Error.
pub(crate) const INTERNAL_ERROR: Status = Status {
    sct: SCT_GENERIC,
    sc: 0x06,
};
/// Generic 0Bh: Invalid Namespace or Format.
pub(crate) const INVALID_NAMESPACE: Status = Status {
    sct: SCT_GENERIC,
    sc: 0x0b,
};
/// Generic 13h: PRP Offset Invalid.
pub(crate) const PRP_OFFSET_INVALID: Status = Status {
    sct: SCT_GENERIC,
    sc: 0x13,
};
/// Command specific 00h (Create I/O SQ): Completion Queue Invalid.
pub(crate) const CQ_INVALID: Status = Status {
    sct: SCT_COMMAND,
    sc: 0x00,
};
/// Command specific 01h (create/delete queues): Invalid Queue Identifier.
pub(crate) const INVALID_QID: Status = Status {
    sct: SCT_COMMAND,
    sc: 0x01,
};
/// Command specific 02h (create queues): Invalid Queue Size.
pub(crate) const INVALID_QSIZE: Status = Status {
    sct: SCT_COMMAND,
    sc: 0x02,
};
/// Command specific 09h (Get Log Page): Invalid Log Page.
pub(crate) const INVALID_LOG_PAGE: Status = Status {
    sct: SCT_COMMAND,
    sc: 0x09,
};

/// Admin opcodes (§5, figure 138) the mediator knows.
pub(crate) mod admin {
    /// Delete I/O Submission Queue (§5.7).
    pub(crate) const DELETE_SQ: u8 = 0x00;
    /// Create I/O Submission Queue (§5.5).
    pub(crate) const CREATE_SQ: u8 = 0x01;
    /// Get Log Page (§5.16).
    pub(crate) const GET_LOG_PAGE: u8 = 0x02;
    /// Delete I/O Completion Queue (§5.6).
    pub(crate) const DELETE_CQ: u8 = 0x04;
    /// Create I/O Completion Queue (§5.4).
    pub(crate) const CREATE_CQ: u8 = 0x05;
    /// Identify (§5.17).
    pub(crate) const IDENTIFY: u8 = 0x06;
    /// Abort (§5.1).
    pub(crate) const ABORT: u8 = 0x08;
    /// Set Features (§5.27).
    pub(crate) const SET_FEATURES: u8 = 0x09;
    /// Get Features (§5.15).
    pub(crate) const GET_FEATURES: u8 = 0x0a;
    /// Asynchronous Event Request (§5.2).
    pub(crate) const ASYNC_EVENT: u8 = 0x0c;
    /// Keep Alive (§5.20).
    pub(crate) const KEEP_ALIVE: u8 = 0x18;
}

/// NVM command set I/O opcodes (NVM Command Set Specification 1.0, §3) the mediator
/// knows.
pub(crate) mod io {
    /// Flush.
    pub(crate) const FLUSH: u8 = 0x00;
    /// Write.
    pub(crate) const WRITE: u8 = 0x01;
    /// Read.
    pub(crate) const READ: u8 = 0x02;
    /// Compare.
    pub(crate) const COMPARE: u8 = 0x05;
    /// Write Zeroes.
    pub(crate) const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub(crate) const DSM: u8 = 0x09;
}

/// Little-endian u16 at `o`.
pub(crate) fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

/// Little-endian u32 at `o`.
pub(crate) fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// Little-endian u64 at `o`.
pub(crate) fn le64(b: &[u8], o: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(v)
}

/// Command dword `n` (10..=15) of a submission queue entry.
pub(crate) fn cdw(sqe: &[u8; SQE], n: usize) -> u32 {
    le32(sqe, 4 * n)
}
