//! The PCI session's decoders on arbitrary bytes (devlend-fabric `pci`): what a lender
//! reads from a borrower and a borrower from a lender; and the NVMe mediator's checks of
//! the commands a guest submits (devlend-device-agent `pci::nvme::cmd`).
//!
//! The first byte picks (mod 2):
//!
//! 0. A PCI session message: `Message::read_from`, then the payload decoder of the
//!    message's kind (`PciInfo`, `Access` of a read or a write, `IrqSet`, `DmaRange`,
//!    the pages of a push or pull, `Irq`, the guest memory reads and writes of a
//!    mediated function; over RDMA the `RemoteDmaRange` of a map and the `Range` lists
//!    of a push or pull). Nothing may panic, and whatever decodes re-encodes to the
//!    bytes it came from (reserved fields must be 0, so each value has one encoding).
//! 1. An NVMe submission queue entry, checked as the mediator does before anything
//!    reaches the controller (see [`nvme_command`] for the layout): `check_common`,
//!    `admin_transfer` or `io_transfer`, then `prp_segments` against a fixed set of DMA
//!    maps, with PRP lists read from guest memory the input writes. Nothing may panic;
//!    a refusal has one of the statuses each check gives; accepted segments cover
//!    exactly the transfer, each inside one DMA map, laid out as PRPs allow, merged
//!    when contiguous inside one map.
//!
//! The mediator's `cmd.rs` and `spec.rs` are compiled in by path (they use only `std`
//! and each other), so that the lender itself (VFIO, io_uring, RDMA) is not built here.
//! `DEVLEND_FUZZ_SHOW=1` prints what each input decodes to.

#![no_main]

use std::sync::LazyLock;

use devlend_fabric::pci::{
    decode_pages, decode_ranges, encode_page, encode_range, Access, DmaRange, Irq, IrqSet, MemRead,
    Message, PciInfo, RemoteDmaRange, KIND_DMA_MAP, KIND_DMA_UNMAP, KIND_INFO, KIND_IRQ,
    KIND_MEM_READ, KIND_MEM_WRITE, KIND_PULL, KIND_PUSH, KIND_READ, KIND_SET_IRQS, KIND_WRITE,
    REPLY,
};
use libfuzzer_sys::fuzz_target;

/// The NVMe specification constants of the mediator, its own source.
#[allow(dead_code)]
#[path = "../../device-agent/src/pci/nvme/spec.rs"]
mod spec;

/// The mediator's command checks, its own source (`super::spec` is [`spec`]).
#[allow(dead_code)]
#[path = "../../device-agent/src/pci/nvme/cmd.rs"]
mod cmd;

/// `DEVLEND_FUZZ_SHOW=1`: print what each input decodes to (to read a reproducer).
static SHOW: LazyLock<bool> = LazyLock::new(|| std::env::var_os("DEVLEND_FUZZ_SHOW").is_some());

fn show(r: &impl std::fmt::Debug) {
    if *SHOW {
        eprintln!("-> {r:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, data)) = data.split_first() else {
        return;
    };
    match which % 2 {
        0 => pci_message(data),
        _ => nvme_command(data),
    }
});

fn pci_message(data: &[u8]) {
    let mut rest = data;
    let r = Message::read_from(&mut rest);
    show(&r);
    let Ok(m) = r else {
        return;
    };
    let wire = &data[..data.len() - rest.len()];
    assert_eq!(m.encode(), wire, "{m:?} does not re-encode");
    let p = &m.payload;
    match m.kind {
        KIND_IRQ => {
            if let Ok(i) = Irq::decode(p) {
                assert_eq!(&i.encode(), p);
            }
        }
        k if k == KIND_INFO | REPLY => {
            if let Ok(i) = PciInfo::decode(p) {
                assert_eq!(&i.encode(), p);
            }
        }
        KIND_READ | KIND_WRITE => {
            if let Ok((a, data)) = Access::decode(p, m.kind == KIND_WRITE) {
                let mut out = a.encode();
                out.extend_from_slice(data);
                assert_eq!(&out, p);
            }
        }
        KIND_SET_IRQS => {
            if let Ok(s) = IrqSet::decode(p) {
                assert_eq!(&s.encode(), p);
            }
        }
        KIND_DMA_MAP | KIND_DMA_UNMAP => {
            if let Ok(r) = DmaRange::decode(p) {
                assert_eq!(&r.encode(), p);
            }
            if let Ok(r) = RemoteDmaRange::decode(p) {
                assert_eq!(&r.encode(), p);
            }
        }
        KIND_MEM_READ => {
            if let Ok(r) = MemRead::decode(p) {
                assert_eq!(&r.encode(), p);
            }
        }
        k if k == KIND_PUSH || k == KIND_PULL | REPLY || k == KIND_MEM_WRITE => {
            if let Ok(pages) = decode_pages(p) {
                let mut out = Vec::new();
                for pg in pages {
                    encode_page(pg.iova, pg.data, &mut out);
                }
                assert_eq!(&out, p);
            }
            if let Ok(ranges) = decode_ranges(p) {
                let mut out = Vec::new();
                for r in ranges {
                    encode_range(r, &mut out);
                }
                assert_eq!(&out, p);
            }
        }
        _ => {}
    }
}

/// The DMA maps the guest's commands are checked against (IOVA, size): 64 KiB, then 16
/// KiB right after it (a range across the two is inside neither), 8 KiB past a hole,
/// and 8 KiB that end one page short of the top of the address space.
const MAPS: [(u64, u64); 4] = [
    (0x1_0000, 0x1_0000),
    (0x2_0000, 0x4000),
    (0x1_0000_0000, 0x2000),
    (0xffff_ffff_ffff_d000, 0x2000),
];
/// The mediator's largest transfer (`nvme::MAX_TRANSFER`), and a controller's smaller
/// MDTS.
const MAX_TRANSFERS: [usize; 2] = [128 << 10, 8 << 10];

/// Bytes per logical block of the namespaces the mediator has seen: 512, 4096, and 4096
/// with 8 bytes of metadata at the end of each block; no other namespace.
fn lba_bytes(nsid: u32) -> Option<usize> {
    match nsid {
        1 => Some(512),
        2 => Some(4096),
        3 => Some(4104),
        _ => None,
    }
}

/// Guest memory behind [`MAPS`].
struct Mem(Vec<Vec<u8>>);

impl Mem {
    /// The map that holds all of `iova..iova + len`, and the offset in it.
    fn find(iova: u64, len: u64) -> Option<(usize, usize)> {
        let end = u128::from(iova) + u128::from(len);
        MAPS.iter()
            .position(|&(i, s)| iova >= i && end <= u128::from(i) + u128::from(s))
            .map(|m| (m, (iova - MAPS[m].0) as usize))
    }

    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), spec::Status> {
        let (m, o) = Self::find(iova, buf.len() as u64).ok_or(spec::DATA_TRANSFER_ERROR)?;
        buf.copy_from_slice(&self.0[m][o..o + buf.len()]);
        Ok(())
    }
}

/// An NVMe command as the guest submits it. Input (missing bytes read as 0):
/// - byte 0: bit 0, an I/O queue's command (else the admin queue's); bit 1, the largest
///   transfer is 8 KiB (else 128 KiB);
/// - 64 bytes: the submission queue entry;
/// - then, until the input ends, writes into guest memory (PRP lists): `map: u8` (mod 4,
///   an index into [`MAPS`]), `offset: u16` (mod the map's size), `len: u16`, then `len`
///   bytes (cut at the map's end).
fn nvme_command(data: &[u8]) {
    use cmd::Dir;
    use spec::{
        le64, DATA_TRANSFER_ERROR, INVALID_FIELD, INVALID_LOG_PAGE, INVALID_NAMESPACE,
        INVALID_OPCODE, PAGE, PRP_OFFSET_INVALID, SQE,
    };
    let (&config, rest) = data.split_first().unwrap_or((&0, &[]));
    let io_queue = config & 1 != 0;
    let max = MAX_TRANSFERS[usize::from(config >> 1 & 1)];
    let mut sqe = [0u8; SQE];
    let n = rest.len().min(SQE);
    sqe[..n].copy_from_slice(&rest[..n]);
    let mut writes = &rest[n..];
    let mut mem = Mem(MAPS.iter().map(|&(_, s)| vec![0u8; s as usize]).collect());
    while !writes.is_empty() {
        let mut head = [0u8; 5];
        let k = writes.len().min(5);
        head[..k].copy_from_slice(&writes[..k]);
        writes = &writes[k..];
        let m = usize::from(head[0]) % MAPS.len();
        let region = &mut mem.0[m];
        let off = usize::from(u16::from_le_bytes([head[1], head[2]])) % region.len();
        let len = usize::from(u16::from_le_bytes([head[3], head[4]])).min(writes.len());
        let (bytes, tail) = writes.split_at(len);
        writes = tail;
        let n = bytes.len().min(region.len() - off);
        region[off..off + n].copy_from_slice(&bytes[..n]);
    }
    if *SHOW {
        eprintln!("io {io_queue}, max {max}, sqe {sqe:02x?}");
    }

    // The maps' own check, against the independent one.
    let (a, l) = (le64(&sqe, 24), le64(&sqe, 32));
    assert_eq!(
        cmd::inside_maps(&MAPS, a, l),
        Mem::find(a, l).is_some(),
        "{a:#x}+{l:#x}"
    );

    // FUSE (CDW0 9:8), PSDT (CDW0 15:14) and, on an I/O queue, MPTR must be 0.
    let common = cmd::check_common(&sqe, io_queue);
    let refused = sqe[1] & 0x03 != 0 || sqe[1] >> 6 != 0 || io_queue && le64(&sqe, 16) != 0;
    assert_eq!(common.is_err(), refused, "check_common: {common:?}");
    if let Err(s) = common {
        assert_eq!(s, INVALID_FIELD);
        return;
    }
    let t = if io_queue {
        cmd::io_transfer(&sqe, lba_bytes)
    } else {
        cmd::admin_transfer(&sqe)
    };
    show(&t);
    let t = match t {
        Ok(t) => t,
        Err(s) => {
            assert!(
                [
                    INVALID_OPCODE,
                    INVALID_FIELD,
                    INVALID_LOG_PAGE,
                    INVALID_NAMESPACE
                ]
                .contains(&s),
                "transfer refused with {s:?}"
            );
            return;
        }
    };
    assert_eq!(t.dir == Dir::None, t.len == 0, "{t:?}");

    let (prp1, prp2) = (le64(&sqe, 24), le64(&sqe, 32));
    let segs = cmd::prp_segments(
        prp1,
        prp2,
        t.len,
        max,
        |iova, buf| mem.read(iova, buf),
        |iova, len| cmd::inside_maps(&MAPS, iova, len),
    );
    show(&segs);
    let segs = match segs {
        Ok(s) => s,
        Err(s) => {
            assert!(
                [PRP_OFFSET_INVALID, DATA_TRANSFER_ERROR, INVALID_FIELD].contains(&s),
                "PRPs refused with {s:?}"
            );
            // Too long is the first check, and the only one that gives INVALID_FIELD.
            assert_eq!(s == INVALID_FIELD, t.len > max, "{t:?}, max {max}: {s:?}");
            return;
        }
    };
    assert!(t.len <= max, "{t:?} over {max}");
    let total: usize = segs.iter().map(|&(_, n)| n).sum();
    assert_eq!(total, t.len, "segments {segs:x?} for {t:?}");
    let page = PAGE as u64;
    for (k, &(iova, n)) in segs.iter().enumerate() {
        assert!(n > 0, "an empty segment in {segs:x?}");
        assert!(
            Mem::find(iova, n as u64).is_some(),
            "{iova:#x}+{n:#x} outside the maps"
        );
        let end = iova + n as u64;
        if k == 0 {
            assert_eq!(iova, prp1, "the first segment is not at PRP 1");
            assert_eq!(prp1 % 4, 0, "PRP 1 not dword-aligned");
        } else {
            assert_eq!(iova % page, 0, "segment {k} of {segs:x?} not page-aligned");
        }
        if k + 1 < segs.len() {
            assert_eq!(end % page, 0, "segment {k} of {segs:x?} ends mid-page");
            // Contiguous segments are merged, unless no one map holds them both.
            let (next, m) = segs[k + 1];
            assert!(
                end != next || Mem::find(iova, (n + m) as u64).is_none(),
                "contiguous segments not merged: {segs:x?}"
            );
        }
    }
    // The mediator then fetches what goes to the device: every byte is readable.
    if t.dir == Dir::ToDevice {
        for &(iova, n) in &segs {
            let mut buf = vec![0u8; n];
            assert!(mem.read(iova, &mut buf).is_ok());
        }
    }
}
