//! Lending a real block device. Runs only when `DEVLEND_TEST_BLOCKDEV` names a scratch
//! block device whose content may be destroyed (e.g. a loop device:
//! `truncate -s 64M /tmp/b.img && losetup -f --show /tmp/b.img`); skipped otherwise.

mod common;

use devlend_device_agent::{DeviceSpec, Lender};
use devlend_fabric::wire::FLAG_UNMAP;
use devlend_fabric::{Op, Status};

#[test]
fn lends_a_block_device() {
    let Ok(path) = std::env::var("DEVLEND_TEST_BLOCKDEV") else {
        eprintln!("skipped: DEVLEND_TEST_BLOCKDEV is not set");
        return;
    };
    let size = {
        use std::io::{Seek, SeekFrom};
        let mut f = std::fs::File::open(&path).expect("open the block device");
        f.seek(SeekFrom::End(0)).expect("device size")
    };
    let spec = DeviceSpec::block("bd", path);
    let lender = Lender::bind("127.0.0.1:0", vec![spec])
        .expect("lend the device")
        .spawn();
    let mut c = common::Client::connect(lender.local_addr(), "bd");
    assert_eq!(c.info.capacity_sectors, size / 512);
    let bs = c.info.block_size;
    eprintln!(
        "capacity {} sectors, block size {bs}",
        c.info.capacity_sectors
    );
    assert!(bs >= 512 && bs.is_power_of_two());

    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 253) as u8 + 1).collect();
    assert_eq!(c.write(2048, &data), Status::Ok);
    assert_eq!(c.flush(), Status::Ok);
    assert_eq!(c.read(2048, 1 << 20), (Status::Ok, data.clone()));

    // Last sector of the device: in range; one past it: not.
    let last = c.info.capacity_sectors - 1;
    assert_eq!(c.read(last, 512).0, Status::Ok);
    assert_eq!(c.read(last + 1, 512).0, Status::IoErr);

    // Ranges aligned to the logical block size.
    let blk = u64::from(bs / 512);
    let zero = |c: &mut common::Client, flags, sector: u64, sectors: u32| {
        assert_eq!(
            c.call(Op::WriteZeroes, flags, sector, sectors, &[]).0,
            Status::Ok
        );
        let (st, d) = c.read(sector, sectors * 512);
        assert_eq!(st, Status::Ok);
        assert!(d.iter().all(|&b| b == 0), "not zeroed at {sector}");
    };
    zero(&mut c, 0, 2048, (16 * blk) as u32);
    zero(&mut c, FLAG_UNMAP, 2048 + 32 * blk, (16 * blk) as u32);
    let (st, rest) = c.read(2048 + 64 * blk, 4096);
    assert_eq!(st, Status::Ok);
    let off = (64 * blk * 512) as usize;
    assert!(
        rest == data[off..off + 4096],
        "data beside the zeroed ranges changed"
    );
    let discard = c.call(Op::Discard, 0, 4096, 2048, &[]).0;
    assert!(
        matches!(discard, Status::Ok | Status::Unsupp),
        "{discard:?}"
    );
    assert_eq!(lender.stats("bd").expect("stats").request_errors, 1); // the read past the end
}
