//! The payloads of the DMA mirror's pushes and pulls: [`Page`]s over TCP, [`Range`]s
//! over RDMA.

use super::requests::AccessHead;
use super::{RangeEntry, PCI_HEADER_LEN};
use crate::codec::{self, Reader};
use crate::WireError;

/// Over RDMA, [`KIND_PUSH`](super::KIND_PUSH) requests and [`KIND_PULL`](super::KIND_PULL) replies carry no page data, only
/// the IOVA ranges the lender moved (pull) or is to move (push) with one-sided RDMA:
/// entries of 16 bytes, `iova: u64, len: u32, reserved: u32 = 0`, at most
/// [`RDMA_MAX_RANGES`] per message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// IOVA of the first byte.
    pub iova: u64,
    /// Length in bytes (> 0).
    pub len: u32,
}

/// Largest encoded message of a PCI session over RDMA, header included (the size of
/// each end's message buffers for the handshake, which PCI sessions keep).
pub const RDMA_MAX_MESSAGE: usize = crate::rdma::MAX_HANDSHAKE_MSG;
/// Largest region read or write in one message over RDMA, in bytes: larger accesses are
/// split by the borrower (a BAR is accessed a register at a time; config space in
/// 4-byte words), and refused by the lender.
pub const RDMA_MAX_ACCESS: u32 = 1024;
/// Most [`Range`]s in one message over RDMA.
pub const RDMA_MAX_RANGES: usize = (RDMA_MAX_MESSAGE - PCI_HEADER_LEN) / 16;

// The largest range list, and the largest access with its header, fit one message.
const _: () = assert!(PCI_HEADER_LEN + RDMA_MAX_RANGES * RangeEntry::LEN <= RDMA_MAX_MESSAGE);
const _: () =
    assert!(PCI_HEADER_LEN + AccessHead::LEN + RDMA_MAX_ACCESS as usize <= RDMA_MAX_MESSAGE);

/// Appends one [`Range`] to a payload.
pub fn encode_range(r: Range, out: &mut Vec<u8>) {
    RangeEntry::new(r.iova, r.len).push(out);
}

/// Splits a payload into its [`Range`]s.
///
/// # Errors
/// [`WireError::Invalid`] for a length that is not a multiple of 16, more than
/// [`RDMA_MAX_RANGES`] entries, an empty range, a reserved field that is not zero, or a
/// range that wraps the IOVA space.
pub fn decode_ranges(p: &[u8]) -> Result<Vec<Range>, WireError> {
    if !p.len().is_multiple_of(RangeEntry::LEN) || p.len() / RangeEntry::LEN > RDMA_MAX_RANGES {
        return Err(WireError::Invalid("range list length"));
    }
    let mut r = Reader::new(p);
    let mut ranges = Vec::with_capacity(p.len() / RangeEntry::LEN);
    while !r.is_empty() {
        let e: RangeEntry = r.get()?;
        if e.len == 0
            || codec::reserved(&e.reserved, "range").is_err()
            || e.iova.checked_add(u64::from(e.len)).is_none()
        {
            return Err(WireError::Invalid("range"));
        }
        ranges.push(Range {
            iova: e.iova,
            len: e.len,
        });
    }
    Ok(ranges)
}

/// One page of mirrored memory in a push or a pull.
///
/// Layout: `iova: u64, len: u32, reserved: u32 = 0`, then `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page<'a> {
    /// IOVA of the first byte.
    pub iova: u64,
    /// The bytes.
    pub data: &'a [u8],
}

/// Calls `out(offset, len)` for each run of bytes where `new` differs from `old` (two
/// copies of one page), exactly: a byte that did not change is in no run.
///
/// Pushes and pulls move these runs, not whole pages: the two ends write the same page
/// at once (a driver fills descriptor `i` while the device writes descriptor `j` back),
/// and a whole page would put back the other end's old bytes over what it wrote since.
pub fn changed_runs(old: &[u8], new: &[u8], mut out: impl FnMut(usize, usize)) {
    let n = old.len().min(new.len());
    let mut i = 0;
    while i < n {
        // Skip equal words quickly, then equal bytes.
        while i + 8 <= n && old[i..i + 8] == new[i..i + 8] {
            i += 8;
        }
        while i < n && old[i] == new[i] {
            i += 1;
        }
        if i == n {
            break;
        }
        let start = i;
        while i < n && old[i] != new[i] {
            i += 1;
        }
        out(start, i - start);
    }
}

/// Appends one [`Page`] to a push or pull payload.
pub fn encode_page(iova: u64, data: &[u8], out: &mut Vec<u8>) {
    RangeEntry::new(iova, data.len() as u32).push(out);
    out.extend_from_slice(data);
}

/// Bytes one page of `len` bytes takes in a payload.
pub const fn page_cost(len: usize) -> usize {
    RangeEntry::LEN + len
}

/// Splits a push or pull payload into its pages.
///
/// # Errors
/// [`WireError::Invalid`] for a truncated page, a reserved field that is not zero, an
/// empty page, or one that wraps the IOVA space.
pub fn decode_pages(p: &[u8]) -> Result<Vec<Page<'_>>, WireError> {
    let mut r = Reader::new(p);
    let mut pages = Vec::new();
    while !r.is_empty() {
        let h: RangeEntry = r
            .get()
            .map_err(|_| WireError::Invalid("mirror page header"))?;
        let bad = || WireError::Invalid("mirror page");
        if h.len == 0 || codec::reserved(&h.reserved, "mirror page").is_err() {
            return Err(bad());
        }
        let data = r.bytes(h.len as usize).map_err(|_| bad())?;
        if h.iova.checked_add(u64::from(h.len)).is_none() {
            return Err(WireError::Invalid("mirror page IOVA"));
        }
        pages.push(Page { iova: h.iova, data });
    }
    Ok(pages)
}

#[cfg(test)]
mod tests {
    use super::changed_runs;

    fn runs(old: &[u8], new: &[u8]) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        changed_runs(old, new, |o, n| v.push((o, n)));
        v
    }

    #[test]
    fn changed_runs_are_exactly_the_changed_bytes() {
        let old = [0u8; 64];
        assert!(runs(&old, &old).is_empty());
        let mut new = old;
        new[0] = 1;
        new[9..12].copy_from_slice(&[1, 1, 1]);
        new[13] = 1;
        new[63] = 1;
        assert_eq!(runs(&old, &new), [(0, 1), (9, 3), (13, 1), (63, 1)]);
        let all = [1u8; 64];
        assert_eq!(runs(&old, &all), [(0, 64)]);
    }
}
