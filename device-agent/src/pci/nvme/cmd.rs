//! Command validation: what each known command moves (explicit lists of admin and NVM
//! opcodes, of features and of log pages) and the walk of its PRPs (NVMe Base 2.0
//! §4.1.1, memory page size 4 KiB), checked against the guest's DMA maps.
//!
//! SGLs (PSDT ≠ 0), fused commands and separate metadata (MPTR ≠ 0) are refused; the
//! mediator clears SGLS and FUSES in Identify Controller so that a driver does not use
//! them.
//!
//! This file and [`super::spec`] use nothing but each other and `std`: the fuzz target
//! `pci_decode` (`fuzz/`) compiles the two by path, to run the checks on arbitrary
//! commands without the rest of the lender.

use super::spec::{
    admin, cdw, io, le16, le32, le64, Status, DATA_TRANSFER_ERROR, INVALID_FIELD, INVALID_LOG_PAGE,
    INVALID_NAMESPACE, INVALID_OPCODE, PAGE, PRP_OFFSET_INVALID, SQE,
};

/// Which way a command's data goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    /// No data.
    None,
    /// Host memory to the controller (writes, admin payloads): fetched before submit.
    ToDevice,
    /// Controller to host memory (reads, Identify, log pages): pushed at completion.
    FromDevice,
}

/// What a command moves: the direction and the length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Transfer {
    /// The direction.
    pub(crate) dir: Dir,
    /// Bytes (0 with [`Dir::None`]).
    pub(crate) len: usize,
}

const NONE: Transfer = Transfer {
    dir: Dir::None,
    len: 0,
};

fn to_dev(len: usize) -> Transfer {
    Transfer {
        dir: Dir::ToDevice,
        len,
    }
}

fn from_dev(len: usize) -> Transfer {
    Transfer {
        dir: Dir::FromDevice,
        len,
    }
}

/// The features (§5.27.1, figure 271) the mediator lets through Get and Set Features,
/// with the bytes of data each moves: Arbitration 01h, Power Management 02h,
/// Temperature Threshold 04h, Volatile Write Cache 06h, Number of Queues 07h, Interrupt
/// Coalescing 08h, Interrupt Vector Configuration 09h, Write Atomicity 0Ah,
/// Asynchronous Event Configuration 0Bh (no data); Autonomous Power State Transition
/// 0Ch (256 bytes), Timestamp 0Eh (8 bytes), Host Behavior Support 16h (512 bytes).
/// Host Memory Buffer 0Dh is refused: its descriptor list would have the controller
/// DMA into guest memory the mediator does not see.
fn feature_data(fid: u8) -> Option<usize> {
    match fid {
        0x01 | 0x02 | 0x04 | 0x06..=0x0b => Some(0),
        0x0c => Some(256),
        0x0e => Some(8),
        0x16 => Some(512),
        _ => None,
    }
}

/// The log pages (§5.16.1, figure 202) Get Log Page may read: Supported Log Pages 00h,
/// Error Information 01h, SMART / Health 02h, Firmware Slot 03h, Changed Namespace List
/// 04h, Commands Supported and Effects 05h, Asymmetric Namespace Access 0Ch.
fn log_page_known(lid: u8) -> bool {
    matches!(lid, 0x00..=0x05 | 0x0c)
}

/// What admin command `sqe` moves, or the status it is refused with. Known opcodes:
/// Delete I/O SQ 00h, Create I/O SQ 01h, Get Log Page 02h, Delete I/O CQ 04h, Create
/// I/O CQ 05h, Identify 06h (4096 bytes), Abort 08h, Set Features 09h, Get Features
/// 0Ah, Asynchronous Event Request 0Ch, Keep Alive 18h. The queue commands' PRP 1 is a
/// queue, not data: the caller handles it.
///
/// # Errors
/// [`INVALID_OPCODE`] for any other opcode; [`INVALID_FIELD`] for an unknown feature;
/// [`INVALID_LOG_PAGE`] for an unknown log page.
pub(crate) fn admin_transfer(sqe: &[u8; SQE]) -> Result<Transfer, Status> {
    let c10 = cdw(sqe, 10);
    Ok(match sqe[0] {
        admin::DELETE_SQ
        | admin::CREATE_SQ
        | admin::DELETE_CQ
        | admin::CREATE_CQ
        | admin::ABORT
        | admin::ASYNC_EVENT
        | admin::KEEP_ALIVE => NONE,
        admin::IDENTIFY => from_dev(PAGE),
        admin::GET_LOG_PAGE => {
            if !log_page_known(c10 as u8) {
                return Err(INVALID_LOG_PAGE);
            }
            // NUMD (dwords - 1): NUMDL in CDW10 31:16, NUMDU in CDW11 15:0.
            let numd = (u64::from(cdw(sqe, 11) & 0xffff) << 16 | u64::from(c10 >> 16)) + 1;
            from_dev((numd * 4) as usize)
        }
        admin::SET_FEATURES => match feature_data(c10 as u8) {
            Some(0) => NONE,
            Some(n) => to_dev(n),
            None => return Err(INVALID_FIELD),
        },
        admin::GET_FEATURES => match feature_data(c10 as u8) {
            Some(0) => NONE,
            Some(n) => from_dev(n),
            None => return Err(INVALID_FIELD),
        },
        _ => return Err(INVALID_OPCODE),
    })
}

/// What NVM command `sqe` moves, given the bytes per logical block of its namespace
/// (`lba_bytes(nsid)`, known from Identify Namespace). Known opcodes: Flush 00h, Write
/// 01h, Read 02h, Compare 05h ((NLB + 1) blocks), Write Zeroes 08h (no data), Dataset
/// Management 09h ((NR + 1) ranges of 16 bytes).
///
/// # Errors
/// [`INVALID_OPCODE`] for any other opcode; [`INVALID_NAMESPACE`] for a namespace whose
/// format the mediator has not seen.
pub(crate) fn io_transfer(
    sqe: &[u8; SQE],
    lba_bytes: impl Fn(u32) -> Option<usize>,
) -> Result<Transfer, Status> {
    let nsid = le32(sqe, 4);
    let blocks = || -> Result<usize, Status> {
        let lba = lba_bytes(nsid).ok_or(INVALID_NAMESPACE)?;
        Ok(((cdw(sqe, 12) & 0xffff) as usize + 1) * lba)
    };
    Ok(match sqe[0] {
        io::FLUSH | io::WRITE_ZEROES => NONE,
        io::WRITE | io::COMPARE => to_dev(blocks()?),
        io::READ => from_dev(blocks()?),
        io::DSM => to_dev(((cdw(sqe, 10) & 0xff) as usize + 1) * 16),
        _ => return Err(INVALID_OPCODE),
    })
}

/// Checks the fields every command shares: no fused operation (FUSE, CDW0 9:8), PRPs
/// (PSDT, CDW0 15:14, = 0), and no separate metadata pointer.
///
/// # Errors
/// [`INVALID_FIELD`].
pub(crate) fn check_common(sqe: &[u8; SQE], io_queue: bool) -> Result<(), Status> {
    if sqe[1] & 0x03 != 0 || sqe[1] >> 6 != 0 {
        return Err(INVALID_FIELD);
    }
    if io_queue && le64(sqe, 16) != 0 {
        return Err(INVALID_FIELD);
    }
    Ok(())
}

/// One contiguous run of guest memory: IOVA and bytes.
pub(crate) type Segment = (u64, usize);

/// Whether `iova..iova + len` lies inside one of the DMA `maps` (IOVA and size each; a
/// range that wraps the address space is inside none).
pub(crate) fn inside_maps(maps: &[(u64, u64)], iova: u64, len: u64) -> bool {
    iova.checked_add(len)
        .is_some_and(|end| maps.iter().any(|&(i, s)| iova >= i && end <= i + s))
}

/// Walks the PRPs of a transfer of `len` bytes (§4.1.1, 4 KiB pages): PRP 1 (an offset
/// that is a multiple of 4), then PRP 2 as a second page or as a PRP list (8-byte
/// aligned; the last entry of each full list page points to the next one), whose
/// entries must be page-aligned. `read` fetches list pages from guest memory; `inside`
/// says whether a range lies inside the guest's DMA maps. Adjacent pages are merged
/// into one segment while the run stays inside one map (`inside` of the whole run), so
/// that every segment is a range the maps hold: the mediator checks each again when it
/// moves the data.
///
/// # Errors
/// [`PRP_OFFSET_INVALID`] for a misaligned PRP or list; [`DATA_TRANSFER_ERROR`] for a
/// list or a data page outside the DMA maps, or a list that could not be read;
/// [`INVALID_FIELD`] for a length over `max_len`.
pub(crate) fn prp_segments(
    prp1: u64,
    prp2: u64,
    len: usize,
    max_len: usize,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<(), Status>,
    inside: impl Fn(u64, u64) -> bool,
) -> Result<Vec<Segment>, Status> {
    if len > max_len {
        return Err(INVALID_FIELD);
    }
    if len == 0 {
        return Ok(Vec::new());
    }
    if prp1 & 3 != 0 {
        return Err(PRP_OFFSET_INVALID);
    }
    let page = PAGE as u64;
    let first = len.min(PAGE - (prp1 % page) as usize);
    let mut pages: Vec<Segment> = vec![(prp1, first)];
    let mut rem = len - first;
    if rem > 0 && rem <= PAGE {
        if !prp2.is_multiple_of(page) {
            return Err(PRP_OFFSET_INVALID);
        }
        pages.push((prp2, rem));
        rem = 0;
    }
    let mut list = prp2;
    while rem > 0 {
        if list & 7 != 0 {
            return Err(PRP_OFFSET_INVALID);
        }
        let needed = rem.div_ceil(PAGE);
        let room = (PAGE - (list % page) as usize) / 8;
        let take = needed.min(room);
        if !inside(list, (take * 8) as u64) {
            return Err(DATA_TRANSFER_ERROR);
        }
        let mut raw = vec![0u8; take * 8];
        read(list, &mut raw)?;
        let chained = needed > room;
        let data_entries = if chained { take - 1 } else { take };
        for i in 0..data_entries {
            let e = le64(&raw, i * 8);
            if !e.is_multiple_of(page) {
                return Err(PRP_OFFSET_INVALID);
            }
            let n = rem.min(PAGE);
            pages.push((e, n));
            rem -= n;
        }
        if chained {
            list = le64(&raw, (take - 1) * 8);
            if !list.is_multiple_of(page) {
                return Err(PRP_OFFSET_INVALID);
            }
        }
    }
    let mut segs: Vec<Segment> = Vec::new();
    for (iova, n) in pages {
        if iova.checked_add(n as u64).is_none() || !inside(iova, n as u64) {
            return Err(DATA_TRANSFER_ERROR);
        }
        match segs.last_mut() {
            Some((a, l)) if *a + *l as u64 == iova && inside(*a, (*l + n) as u64) => *l += n,
            _ => segs.push((iova, n)),
        }
    }
    Ok(segs)
}

/// Bytes per logical block of a namespace, from its Identify Namespace data (§5.17.2.1,
/// NVM CS §4.1.5.1): LBADS of the format FLBAS selects, plus the metadata size when
/// metadata is transferred at the end of each block (FLBAS bit 4).
pub(crate) fn lba_bytes(id_ns: &[u8]) -> Option<usize> {
    if id_ns.len() < 384 {
        return None;
    }
    let flbas = id_ns[26];
    let index = usize::from(flbas & 0x0f) | usize::from((flbas >> 5) & 0x03) << 4;
    let lbaf = le32(id_ns, 128 + 4 * index);
    let lbads = (lbaf >> 16) & 0xff;
    if !(9..=16).contains(&lbads) {
        return None;
    }
    let ms = if flbas & 0x10 != 0 {
        usize::from(le16(id_ns, 128 + 4 * index))
    } else {
        0
    };
    Some((1usize << lbads) + ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guest memory of 64 KiB at IOVA 0x10000.
    struct Mem(Vec<u8>);

    impl Mem {
        fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), Status> {
            let o = (iova - 0x10000) as usize;
            buf.copy_from_slice(&self.0[o..o + buf.len()]);
            Ok(())
        }

        fn put(&mut self, iova: u64, v: u64) {
            let o = (iova - 0x10000) as usize;
            self.0[o..o + 8].copy_from_slice(&v.to_le_bytes());
        }
    }

    fn inside(iova: u64, len: u64) -> bool {
        iova >= 0x10000 && iova + len <= 0x20000
    }

    #[test]
    fn prps_of_one_two_and_many_pages() {
        let mut m = Mem(vec![0; 0x10000]);
        let walk =
            |m: &Mem, p1, p2, len| prp_segments(p1, p2, len, 0x8000, |i, b| m.read(i, b), inside);
        assert_eq!(walk(&m, 0x11000, 0, 4096), Ok(vec![(0x11000, 4096)]));
        assert_eq!(walk(&m, 0x11800, 0, 2048), Ok(vec![(0x11800, 2048)]));
        assert_eq!(
            walk(&m, 0x11800, 0x15000, 4096),
            Ok(vec![(0x11800, 2048), (0x15000, 2048)])
        );
        // Contiguous pages merge.
        assert_eq!(walk(&m, 0x11000, 0x12000, 8192), Ok(vec![(0x11000, 8192)]));
        // A list of three pages at 0x1f000.
        m.put(0x1f000, 0x13000);
        m.put(0x1f008, 0x14000);
        m.put(0x1f010, 0x18000);
        assert_eq!(
            walk(&m, 0x12000, 0x1f000, 4 * 4096 - 100),
            Ok(vec![(0x12000, 3 * 4096), (0x18000, 4096 - 100)])
        );
        // A list that reaches the end of its page chains to the next list page: here
        // one data entry at 0x1eff0, then the pointer to the list at 0x1f000.
        m.put(0x1eff0, 0x1c000);
        m.put(0x1eff8, 0x1f000);
        assert_eq!(
            walk(&m, 0x12000, 0x1eff0, 4 * 4096),
            Ok(vec![(0x12000, 4096), (0x1c000, 4096), (0x13000, 8192)])
        );
        // A chain pointer that is not page-aligned.
        m.put(0x1eff8, 0x1f008);
        assert_eq!(
            walk(&m, 0x12000, 0x1eff0, 4 * 4096),
            Err(PRP_OFFSET_INVALID)
        );
    }

    /// Found by the fuzz target pci_decode (its reproducer is
    /// `fuzz/regressions/pci_decode/prp-pages-in-two-adjacent-maps`): two pages of one
    /// command in two adjacent DMA maps were merged into one segment that lies inside
    /// neither, which the completion then refused as unmapped.
    #[test]
    fn pages_in_two_adjacent_maps_stay_two_segments() {
        let maps = [(0x1_0000, 0x1_0000), (0x2_0000, 0x4000)];
        let m = Mem(vec![0; 0x10000]);
        let walk = |p1, p2, len| {
            prp_segments(
                p1,
                p2,
                len,
                0x8000,
                |i, b| m.read(i, b),
                |i, l| inside_maps(&maps, i, l),
            )
        };
        let segs = walk(0x1fa00, 0x2_0000, 4096);
        assert_eq!(segs, Ok(vec![(0x1fa00, 0x600), (0x2_0000, 0xa00)]));
        let segs = segs.unwrap();
        assert!(segs.iter().all(|&(i, n)| inside_maps(&maps, i, n as u64)));
        // Inside one map, the same layout is still one segment.
        assert_eq!(walk(0x1ea00, 0x1f000, 4096), Ok(vec![(0x1ea00, 4096)]));
    }

    #[test]
    fn bad_prps_are_refused_with_their_status() {
        let mut m = Mem(vec![0; 0x10000]);
        let walk =
            |m: &Mem, p1, p2, len| prp_segments(p1, p2, len, 0x8000, |i, b| m.read(i, b), inside);
        assert_eq!(walk(&m, 0x11002, 0, 512), Err(PRP_OFFSET_INVALID));
        assert_eq!(walk(&m, 0x11000, 0x12010, 8192), Err(PRP_OFFSET_INVALID));
        assert_eq!(
            walk(&m, 0x11000, 0x1f004, 3 * 4096),
            Err(PRP_OFFSET_INVALID)
        );
        m.put(0x1f000, 0x13010);
        m.put(0x1f008, 0x14000);
        assert_eq!(
            walk(&m, 0x11000, 0x1f000, 3 * 4096),
            Err(PRP_OFFSET_INVALID)
        );
        // Outside the maps: data, and the list itself.
        assert_eq!(walk(&m, 0x40000, 0, 4096), Err(DATA_TRANSFER_ERROR));
        assert_eq!(walk(&m, 0x11000, 0x90000, 8192), Err(DATA_TRANSFER_ERROR));
        assert_eq!(
            walk(&m, 0x11000, 0x90000, 3 * 4096),
            Err(DATA_TRANSFER_ERROR)
        );
        m.put(0x1f000, 0x13000);
        m.put(0x1f008, 0x7000_0000);
        assert_eq!(
            walk(&m, 0x11000, 0x1f000, 3 * 4096),
            Err(DATA_TRANSFER_ERROR)
        );
        // Too long.
        assert_eq!(walk(&m, 0x11000, 0x1f000, 0x8001), Err(INVALID_FIELD));
    }

    #[test]
    fn opcodes_outside_the_lists_are_refused() {
        let mut sqe = [0u8; SQE];
        sqe[0] = 0x80; // Format NVM
        assert_eq!(admin_transfer(&sqe), Err(INVALID_OPCODE));
        sqe[0] = admin::IDENTIFY;
        assert_eq!(admin_transfer(&sqe), Ok(from_dev(4096)));
        sqe[0] = admin::SET_FEATURES;
        sqe[40] = 0x0d; // Host Memory Buffer
        assert_eq!(admin_transfer(&sqe), Err(INVALID_FIELD));
        sqe[40] = 0x07;
        assert_eq!(admin_transfer(&sqe), Ok(NONE));
        sqe[0] = admin::GET_LOG_PAGE;
        sqe[40] = 0x02;
        sqe[42..44].copy_from_slice(&127u16.to_le_bytes());
        assert_eq!(admin_transfer(&sqe), Ok(from_dev(512)));
        sqe[40] = 0x70;
        assert_eq!(admin_transfer(&sqe), Err(INVALID_LOG_PAGE));
        let mut io_sqe = [0u8; SQE];
        io_sqe[0] = io::READ;
        io_sqe[4] = 1;
        io_sqe[48] = 7; // NLB 7: 8 blocks
        assert_eq!(io_transfer(&io_sqe, |_| Some(512)), Ok(from_dev(4096)));
        assert_eq!(io_transfer(&io_sqe, |_| None), Err(INVALID_NAMESPACE));
        io_sqe[0] = 0x7f;
        assert_eq!(io_transfer(&io_sqe, |_| Some(512)), Err(INVALID_OPCODE));
        let mut fused = [0u8; SQE];
        fused[1] = 1;
        assert_eq!(check_common(&fused, false), Err(INVALID_FIELD));
        fused[1] = 0x40; // SGL
        assert_eq!(check_common(&fused, false), Err(INVALID_FIELD));
    }

    #[test]
    fn lba_size_from_identify_namespace() {
        let mut id = vec![0u8; 4096];
        id[26] = 1;
        id[128 + 4 + 2] = 12; // LBAF1: 4096 bytes
        id[128 + 2] = 9;
        assert_eq!(lba_bytes(&id), Some(4096));
        id[26] = 0;
        assert_eq!(lba_bytes(&id), Some(512));
    }
}
