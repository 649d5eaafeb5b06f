//! The PCI session's decoders on arbitrary bytes (devlend-fabric `pci`): what a lender
//! reads from a borrower and a borrower from a lender.
//!
//! `Message::read_from`, then the payload decoder of the message's kind (`PciInfo`,
//! `Access` of a read or a write, `IrqSet`, `DmaRange`, the pages of a push or pull,
//! `Irq`, the guest memory reads and writes of a mediated function; over RDMA the
//! `RemoteDmaRange` of a map and the `Range` lists of a push or pull). Nothing may
//! panic, and whatever decodes re-encodes to the bytes it came
//! from (reserved fields must be 0, so each value has one encoding).

#![no_main]

use devlend_fabric::pci::{
    decode_pages, decode_ranges, encode_page, encode_range, Access, DmaRange, Irq, IrqSet,
    MemRead, Message, PciInfo, RemoteDmaRange, KIND_DMA_MAP, KIND_DMA_UNMAP, KIND_INFO,
    KIND_IRQ, KIND_MEM_READ, KIND_MEM_WRITE, KIND_PULL, KIND_PUSH, KIND_READ, KIND_SET_IRQS,
    KIND_WRITE, REPLY,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    let Ok(m) = Message::read_from(&mut rest) else {
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
});
