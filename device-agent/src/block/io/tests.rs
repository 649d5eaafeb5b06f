//! Both [`DeviceIo`] implementations run the same requests to the same answers, and
//! record the same counters: requests answered, their latency, bytes, errors.

use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::{BlockRequest, Bytes, Op, Sector, Status};

use super::*;
use crate::device::Device;
use crate::DeviceSpec;

fn device(dir: &tempfile::TempDir, bytes: usize) -> Arc<Device> {
    let img = dir.path().join("d.img");
    std::fs::write(&img, vec![0u8; bytes]).expect("image");
    let spec: DeviceSpec = format!("d={}", img.display()).parse().expect("spec");
    Arc::new(Device::open(&spec).expect("open"))
}

/// The block device of `dev`, as the block kind hands it to its device I/O.
fn block(dev: &Device) -> &BlockDevice {
    match &dev.backing {
        crate::device::Backing::Block(b) => b,
        _ => panic!("a block device"),
    }
}

/// A read or a write of `len` bytes at `sector`.
fn request(op: Op, sector: u64, len: u32) -> BlockRequest {
    let (at, len) = (Sector(sector), Bytes(len));
    match op {
        Op::Read => BlockRequest::Read { sector: at, len },
        Op::Write => BlockRequest::Write { sector: at, len },
        _ => panic!("only reads and writes here"),
    }
}

/// Runs one request to its end; returns it done. Its id is its first sector.
fn run(io: &mut impl DeviceIo, op: BlockRequest, data: &[u8]) -> Box<Request> {
    let mut req = Box::new(Request::new());
    req.id = op.sector().0;
    let n = op.data_len().usize();
    req.buffer(n)[..data.len()].copy_from_slice(data);
    let mut events = Vec::new();
    io.start(req, &op, &mut events);
    loop {
        for ev in events.drain(..) {
            match ev {
                Event::Done(r) => return r,
                Event::Lost(_, e) => panic!("lost: {e}"),
                Event::Ready(_) => {}
            }
        }
        io.submit().expect("submit");
        if io.in_flight() > 0 {
            io.wait(Some(Duration::from_secs(5))).expect("wait");
        }
        io.reap(&mut events);
    }
}

fn same_requests_same_counters(mut io: impl DeviceIo, dev: &Device) {
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
    let w = run(&mut io, request(Op::Write, 8, 8192), &data);
    assert_eq!(w.status, Status::Ok);
    let r = run(&mut io, request(Op::Read, 8, 8192), &[]);
    assert_eq!(r.status, Status::Ok);
    assert!(!r.from_file);
    assert_eq!(&r.buf[..8192], &data[..]);
    // Refused without device I/O: beyond the capacity.
    let ops = dev.counters.stats.snapshot().device_ops;
    let beyond = run(&mut io, request(Op::Read, 1 << 20, 4096), &[]);
    assert_eq!(beyond.status, Status::IoErr);
    assert_eq!(dev.counters.stats.snapshot().device_ops, ops);
    // Failed by the device: the file shrank under the lender, a read finds its end.
    block(dev).file.set_len(0).expect("truncate");
    let short = run(&mut io, request(Op::Read, 0, 4096), &[]);
    assert_eq!(short.status, Status::IoErr);
    let s = dev.counters.stats.snapshot();
    assert_eq!(s.ops.bytes_written, 8192);
    assert_eq!(s.ops.bytes_read, 8192);
    assert_eq!(s.request_errors, 2, "{s:?}");
    let lat = dev.counters.stats.latency();
    assert_eq!(
        lat.count, 4,
        "every request answered has its latency recorded"
    );
}

#[test]
fn uring_records_latency_bytes_and_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = device(&dir, 1 << 20);
    let io = Uring::new(Arc::clone(&dev.counters), block(&dev), 64).expect("ring");
    same_requests_same_counters(io, &dev);
}

#[test]
fn inline_records_latency_bytes_and_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = device(&dir, 1 << 20);
    let io = Inline::new(Arc::clone(&dev.counters), block(&dev), false).expect("ring");
    same_requests_same_counters(io, &dev);
}

#[test]
fn inline_leaves_large_reads_to_send_file_only_when_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = device(&dir, 1 << 20);
    let len = inline::SENDFILE_MIN as u32;
    let mut file = Inline::new(Arc::clone(&dev.counters), block(&dev), true).expect("ring");
    let r = run(&mut file, request(Op::Read, 0, len), &[]);
    assert!(r.from_file, "left to send_file");
    assert_eq!((r.offset, r.len), (0, u64::from(len)));
    let mut buffered = Inline::new(Arc::clone(&dev.counters), block(&dev), false).expect("ring");
    let r = run(&mut buffered, request(Op::Read, 0, len), &[]);
    assert!(!r.from_file, "read into its buffer");
    assert_eq!(r.status, Status::Ok);
    assert_eq!(dev.counters.stats.latency().count, 2);
}

#[test]
fn watches_wake_the_wait_with_their_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = device(&dir, 1 << 20);
    let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
    let ios: [SessionIo; 2] = [
        SessionIo::new(
            Arc::clone(&dev.counters),
            block(&dev),
            IoMode::Uring,
            16,
            false,
        )
        .expect("uring"),
        SessionIo::new(
            Arc::clone(&dev.counters),
            block(&dev),
            IoMode::Sync,
            16,
            false,
        )
        .expect("inline"),
    ];
    for io in ios {
        match io {
            SessionIo::Uring(io) => woken(io, &a, &b),
            SessionIo::Inline(io) => woken(io, &a, &b),
        }
    }
}

fn woken(
    mut io: impl DeviceIo,
    a: &std::os::unix::net::UnixStream,
    b: &std::os::unix::net::UnixStream,
) {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    io.watch(b.as_raw_fd(), libc::POLLIN, 3).expect("watch");
    let mut events = Vec::new();
    io.wait(Some(Duration::from_millis(20))).expect("wait");
    io.reap(&mut events);
    assert!(events.is_empty(), "nothing to read yet");
    (&mut &*a).write_all(b"x").expect("write");
    io.wait(Some(Duration::from_secs(5))).expect("wait");
    io.reap(&mut events);
    assert!(matches!(events.as_slice(), [Event::Ready(3)]), "{events:?}");
    let mut buf = [0u8; 1];
    (&mut &*b).read_exact(&mut buf).expect("read");
}
