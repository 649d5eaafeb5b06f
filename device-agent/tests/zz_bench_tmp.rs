mod common;
use devlend_fabric::{Op, RequestHeader};
use std::io::Write;
use std::time::{Duration, Instant};
#[test]
fn bench() {
    for (bs, qd) in [(4096u32, 128u64), (131072, 32), (1 << 20, 8)] {
        let fx = common::Fixture::new(&[("d", 256 << 20, false)]);
        let c = fx.connect("d");
        let mut w = c.sock.try_clone().unwrap();
        let mut r = c.sock.try_clone().unwrap();
        let secs = (256u64 << 20) / 512;
        let dur = Duration::from_secs(2);
        let t0 = Instant::now();
        let mut rng = common::Rng(42);
        let mut sent = 0u64;
        let mut got = 0u64;
        for op in [Op::Write, Op::Read] {
            let t0 = Instant::now();
            let g0 = got;
            let data = vec![1u8; if op == Op::Write { bs as usize } else { 0 }];
            while t0.elapsed() < dur || sent > got {
                while sent - got < qd && t0.elapsed() < dur {
                    let sector = rng.below(secs / (bs as u64 / 512)) * (bs as u64 / 512);
                    let mut f = RequestHeader {
                        op,
                        flags: 0,
                        len: bs,
                        id: sent,
                        sector,
                    }
                    .encode()
                    .to_vec();
                    f.extend_from_slice(&data);
                    w.write_all(&f).unwrap();
                    sent += 1;
                }
                let _ = common::recv_from(&mut r);
                got += 1;
            }
            let n = got - g0;
            let el = t0.elapsed().as_secs_f64();
            println!(
                "{op:?} bs={bs} qd={qd}: {:.0} IOPS {:.0} MiB/s",
                n as f64 / el,
                n as f64 * bs as f64 / el / 1048576.0
            );
        }
        let _ = t0;
    }
}
