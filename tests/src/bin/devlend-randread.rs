//! `devlend-randread DEVICE QD SECONDS`: random 4 KiB reads with O_DIRECT at queue depth
//! QD (QD threads, one read in flight each) over the whole of DEVICE for SECONDS, for
//! the benchmarks that run inside a test guest (which has no fio). Prints
//! `DEVLEND-RESULT iops=N` and `DEVLEND-RESULT errors=N`.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BS: usize = 4096;

/// A 4 KiB buffer aligned for O_DIRECT.
#[repr(C, align(4096))]
struct Block([u8; BS]);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(path), Some(qd), Some(secs)) = (
        args.get(1),
        args.get(2).and_then(|a| a.parse::<u64>().ok()),
        args.get(3).and_then(|a| a.parse::<u64>().ok()),
    ) else {
        eprintln!("usage: devlend-randread DEVICE QD SECONDS");
        std::process::exit(2);
    };
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Arc::new(f),
        Err(e) => {
            eprintln!("{path}: {e}");
            std::process::exit(1);
        }
    };
    let blocks = std::fs::read_to_string(format!(
        "/sys/block/{}/size",
        path.rsplit('/').next().unwrap_or_default()
    ))
    .ok()
    .and_then(|s| s.trim().parse::<u64>().ok())
    .map_or(1, |sectors| (sectors * 512 / BS as u64).max(1));
    let stop = Arc::new(AtomicBool::new(false));
    let (done, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let threads: Vec<_> = (0..qd)
        .map(|t| {
            let (file, stop, done, errors) = (
                Arc::clone(&file),
                Arc::clone(&stop),
                Arc::clone(&done),
                Arc::clone(&errors),
            );
            std::thread::spawn(move || {
                let mut buf = Box::new(Block([0; BS]));
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1).wrapping_mul(0x2545_f491_4f6c_dd1d);
                while !stop.load(Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let at = (x % blocks) * BS as u64;
                    match file.read_exact_at(&mut buf.0, at) {
                        Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                        Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    // One second of warm-up, then the measured window.
    std::thread::sleep(Duration::from_secs(1));
    let (start, t0) = (done.load(Ordering::Relaxed), Instant::now());
    std::thread::sleep(Duration::from_secs(secs));
    let n = done.load(Ordering::Relaxed) - start;
    let iops = n as f64 / t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    println!("DEVLEND-RESULT iops={iops:.0}");
    println!("DEVLEND-RESULT errors={}", errors.load(Ordering::Relaxed));
}
