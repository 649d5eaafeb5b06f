//! `devlend-nvme-vmm SOCKET IMAGE_BYTES`: a userspace NVMe driver on the vfio-user
//! socket of a lent NVMe controller, for tests that run inside a guest (the RDMA one):
//! enables the controller, IDENTIFY controller (QEMU's vendor 1b36) and namespace (its
//! size must be IMAGE_BYTES), an I/O queue pair, a 16 KiB WRITE through a PRP list and
//! a READ back compared, and a misaligned PRP that must be refused with PRP Offset
//! Invalid (NVMe Base 2.0 §4.1.1). Prints a `DEVLEND-RESULT` line for each step; exits
//! 1 when one is not as expected.

use std::path::PathBuf;

use devlend_tests::nvme::{sqe, DATA, IDENT, IOVA, LIST};

fn main() {
    let mut args = std::env::args_os().skip(1);
    let (Some(sock), Some(size)) = (
        args.next().map(PathBuf::from),
        args.next()
            .and_then(|s| s.to_str().and_then(|s| s.parse::<u64>().ok())),
    ) else {
        eprintln!("usage: devlend-nvme-vmm SOCKET IMAGE_BYTES");
        std::process::exit(2);
    };
    let mut failed = false;
    let mut check = |key: &str, got: String, want: &str| {
        println!("DEVLEND-RESULT {key}={got}");
        if got != want {
            eprintln!("devlend-nvme-vmm: {key} is {got}, not {want}");
            failed = true;
        }
    };
    let mut d = devlend_tests::nvme::start(&sock);
    d.ok(
        false,
        sqe(0x06, 0, IOVA + IDENT, 0, [1, 0, 0, 0, 0, 0]),
        "identify controller",
    );
    let id = d.mem.read(IDENT, 4096);
    check(
        "nvme_vid",
        format!("{:04x}", u16::from_le_bytes([id[0], id[1]])),
        "1b36",
    );
    d.ok(
        false,
        sqe(0x06, 1, IOVA + IDENT, 0, [0, 0, 0, 0, 0, 0]),
        "identify namespace",
    );
    let ns = d.mem.read(IDENT, 4096);
    let nsze = u64::from_le_bytes(ns[0..8].try_into().unwrap_or([0; 8]));
    let lbaf = ns[26] & 0xf;
    let lba = 1u64 << ns[128 + 4 * lbaf as usize + 2];
    check(
        "nvme_namespace_bytes",
        (nsze * lba).to_string(),
        &size.to_string(),
    );
    // WRITE 16 KiB at LBA 8 from four scattered pages (PRP 1 and a PRP list).
    let pattern: Vec<u8> = (0..16384u32)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add((i >> 9) as u8))
        .collect();
    let pages = [DATA, DATA + 0x3000, DATA + 0x1000, DATA + 0x7000];
    for (i, p) in pages.iter().enumerate() {
        d.mem.write(*p, &pattern[i * 4096..(i + 1) * 4096]);
    }
    let list: Vec<u8> = pages[1..]
        .iter()
        .flat_map(|p| (IOVA + p).to_le_bytes())
        .collect();
    d.mem.write(LIST, &list);
    let nlb = (16384 / lba - 1) as u32;
    let w = d.run(
        true,
        sqe(0x01, 1, IOVA + pages[0], IOVA + LIST, [8, 0, nlb, 0, 0, 0]),
    );
    check("nvme_write_status", format!("{:?}", w.sc()), "(0, 0)");
    // READ it back into other pages.
    let rd = [
        DATA + 0x10_000,
        DATA + 0x12_000,
        DATA + 0x11_000,
        DATA + 0x15_000,
    ];
    let list2: Vec<u8> = rd[1..]
        .iter()
        .flat_map(|p| (IOVA + p).to_le_bytes())
        .collect();
    d.mem.write(LIST + 0x100, &list2);
    let r = d.run(
        true,
        sqe(
            0x02,
            1,
            IOVA + rd[0],
            IOVA + LIST + 0x100,
            [8, 0, nlb, 0, 0, 0],
        ),
    );
    check("nvme_read_status", format!("{:?}", r.sc()), "(0, 0)");
    let back: Vec<u8> = rd.iter().flat_map(|p| d.mem.read(*p, 4096)).collect();
    let wrong = back.iter().zip(&pattern).filter(|(a, b)| a != b).count();
    check("nvme_wrong_bytes", wrong.to_string(), "0");
    // Two pages whose PRP 2 is not page-aligned: refused before the controller sees it.
    let two = (8192 / lba - 1) as u32;
    let bad = d.run(
        true,
        sqe(
            0x02,
            1,
            IOVA + rd[0],
            IOVA + rd[1] + 8,
            [8, 0, two, 0, 0, 0],
        ),
    );
    check("nvme_misaligned_prp", format!("{:?}", bad.sc()), "(0, 19)");
    if failed {
        std::process::exit(1);
    }
}
