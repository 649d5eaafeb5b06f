//! The vfio-user server devlend's PCI borrower runs on (the `vfio_user` crate, patched:
//! `third_party/vfio_user/DEVLEND-PATCH.md`), driven by raw messages, as a hostile or
//! buggy VMM would send them. Every malformed request gets an error reply with an
//! errno, and the session (and the next one, and another device) goes on serving; a
//! size that cannot be a message closes only that connection; refusals, however many,
//! make a bounded number of log lines.
//!
//! Two backends: a stand-in (8 bytes of "BAR0", recording every call), to test the
//! server's own checks (what it must refuse before a backend sees it); and the real
//! [`PciBorrower`] against a stand-in lender that answers everything (so that what
//! the borrower must refuse is not refused for it by the lender).
//!
//! Why this file is over 600 lines: a test file: its three tests share one raw vfio-user
//! client (the framing in `call_with` and the request bodies) that splitting would have to
//! export. The test of the real borrower (with its stand-in lender and log capture, about
//! 360 lines) could move to its own file if that client moved into a shared module, and is
//! left here for now.

use std::fs::File;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use devlend_backend::pci::{LinkTarget, PciBorrower, MAX_DMA_MAPS};
use devlend_fabric::pci::{
    Access, IrqInfo as LenderIrq, Message, PciInfo, RegionInfo, FEATURE_PCI, KIND_INFO, KIND_PULL,
    KIND_READ, REPLY,
};
use devlend_fabric::transport::Transport;
use devlend_fabric::{Hello, HelloReply, PciIdentity};
use vfio_bindings::bindings::vfio::vfio_region_info;
use vfio_user::{DmaMapFlags, DmaUnmapFlags, IrqInfo, Server, ServerBackend, ServerRegion};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// What the stand-in backend was asked, in order.
type Calls = Arc<Mutex<Vec<String>>>;

struct Bar {
    data: [u8; 8],
    calls: Calls,
}

impl Bar {
    fn log(&self, c: String) {
        self.calls.lock().unwrap().push(c);
    }
}

impl ServerBackend for Bar {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> std::io::Result<()> {
        self.log(format!("read {region} {offset} {}", data.len()));
        let o = offset as usize;
        let src = o
            .checked_add(data.len())
            .and_then(|end| self.data.get(o..end))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        data.copy_from_slice(src);
        Ok(())
    }
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.log(format!("write {region} {offset} {}", data.len()));
        let o = offset as usize;
        o.checked_add(data.len())
            .and_then(|end| self.data.get_mut(o..end))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?
            .copy_from_slice(data);
        Ok(())
    }
    fn dma_map(
        &mut self,
        _: DmaMapFlags,
        _: u64,
        address: u64,
        _: u64,
        fd: Option<File>,
    ) -> std::io::Result<()> {
        self.log(format!("dma_map {address:#x} fd {}", fd.is_some()));
        Ok(())
    }
    fn dma_unmap(&mut self, _: DmaUnmapFlags, address: u64, _: u64) -> std::io::Result<()> {
        self.log(format!("dma_unmap {address:#x}"));
        Ok(())
    }
    fn reset(&mut self) -> std::io::Result<()> {
        self.log("reset".into());
        Ok(())
    }
    fn set_irqs(
        &mut self,
        index: u32,
        _: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> std::io::Result<()> {
        self.log(format!(
            "set_irqs {index} {start} {count} fds {}",
            fds.len()
        ));
        Ok(())
    }
}

/// A reply: its id, flags, errno and body (after the 16-byte header).
#[derive(Debug)]
struct Reply {
    id: u16,
    flags: u32,
    errno: u32,
    body: Vec<u8>,
}

const ERROR: u32 = 1 << 5;

/// Sends a message (command, header flags, body, fds) and reads the reply.
fn call_with(
    s: &mut UnixStream,
    id: u16,
    cmd: u16,
    flags: u32,
    body: &[u8],
    fds: &[RawFd],
) -> Reply {
    let mut m = Vec::new();
    m.extend_from_slice(&id.to_le_bytes());
    m.extend_from_slice(&cmd.to_le_bytes());
    m.extend_from_slice(&((16 + body.len()) as u32).to_le_bytes());
    m.extend_from_slice(&flags.to_le_bytes());
    m.extend_from_slice(&0u32.to_le_bytes());
    m.extend_from_slice(body);
    if fds.is_empty() {
        s.write_all(&m).expect("send");
    } else {
        let n = s.send_with_fds(&[&m[..]], fds).expect("send with fds");
        s.write_all(&m[n..]).expect("send the rest");
    }
    let mut h = [0u8; 16];
    s.read_exact(&mut h).expect("reply header");
    let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let mut rest = vec![0u8; (word(4) as usize).saturating_sub(16)];
    s.read_exact(&mut rest).expect("reply body");
    Reply {
        id: u16::from_le_bytes([h[0], h[1]]),
        flags: word(8),
        errno: word(12),
        body: rest,
    }
}

/// Sends a command without fds and reads the reply: (id, flags, body).
fn call(s: &mut UnixStream, id: u16, cmd: u16, body: &[u8]) -> (u16, u32, Vec<u8>) {
    let r = call_with(s, id, cmd, 0, body, &[]);
    (r.id, r.flags, r.body)
}

/// Asserts that `r` is an error reply to message `id` with `errno`.
fn refused(r: &Reply, id: u16, errno: i32, what: &str) {
    assert_eq!(
        (r.id, r.flags & ERROR, r.errno),
        (id, ERROR, errno as u32),
        "{what}: {r:?}"
    );
}

fn access(region: u32, offset: u64, count: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&region.to_le_bytes());
    b.extend_from_slice(&count.to_le_bytes());
    b.extend_from_slice(data);
    b
}

fn dma_map_body(offset: u64, iova: u64, size: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&32u32.to_le_bytes());
    b.extend_from_slice(&3u32.to_le_bytes());
    for v in [offset, iova, size] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

fn dma_unmap_body(iova: u64, size: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&24u32.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&iova.to_le_bytes());
    b.extend_from_slice(&size.to_le_bytes());
    b
}

fn set_irqs_body(flags: u32, index: u32, start: u32, count: u32) -> Vec<u8> {
    let mut b = Vec::new();
    for v in [20u32, flags, index, start, count] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

const VERSION: u16 = 1;
const DMA_MAP: u16 = 2;
const DMA_UNMAP: u16 = 3;
const SET_IRQS: u16 = 8;
const REGION_READ: u16 = 9;
const REGION_WRITE: u16 = 10;
/// VFIO_IRQ_SET_DATA_NONE, _EVENTFD; VFIO_IRQ_SET_ACTION_UNMASK, _TRIGGER.
const DATA_NONE: u32 = 1;
const DATA_EVENTFD: u32 = 4;
const ACTION_UNMASK: u32 = 16;
const ACTION_TRIGGER: u32 = 32;

fn version_body() -> Vec<u8> {
    let mut v = vec![0, 0, 1, 0];
    v.extend_from_slice(b"{\"capabilities\":{}}\0");
    v
}

fn region(index: u32, size: u64, flags: u32) -> ServerRegion {
    ServerRegion {
        region_info: vfio_region_info {
            argsz: std::mem::size_of::<vfio_region_info>() as u32,
            flags,
            index,
            cap_offset: 0,
            size,
            offset: 0,
        },
        sparse_areas: Vec::new(),
        mmap_fd: None,
    }
}

fn connect(path: &Path) -> UnixStream {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn eventfd() -> File {
    // SAFETY: a fresh eventfd; we own the fd it returns.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: `fd` is ours alone.
    unsafe { File::from_raw_fd(fd) }
}

fn memfd(len: u64) -> File {
    // SAFETY: a NUL-terminated name and valid flags.
    let fd = unsafe { libc::memfd_create(c"vfio-user-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: `fd` is ours alone.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    f
}

#[test]
fn refused_requests_keep_the_framing_and_bad_sizes_close() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let server = Server::new(&path, true, Vec::new(), vec![region(0, 8, 3)]).unwrap();
    std::thread::spawn(move || {
        let mut bar = Bar {
            data: *b"devlend!",
            calls: Calls::default(),
        };
        loop {
            let _ = server.run(&mut bar);
        }
    });
    let mut s = connect(&path);
    let v = version_body();
    assert_eq!(call(&mut s, 1, VERSION, &v).1 & ERROR, 0, "version");

    // A write to a region out of range, its data not taken for the next header.
    let (id, flags, _) = call(&mut s, 2, REGION_WRITE, &access(7, 0, 24, &[0x11; 24]));
    assert_eq!((id, flags & ERROR), (2, ERROR));
    // An unknown command with a payload, a version without its NUL.
    let (id, flags, _) = call(&mut s, 3, 0x77, &[0xff; 40]);
    assert_eq!((id, flags & ERROR), (3, ERROR));
    let (id, flags, _) = call(&mut s, 4, VERSION, b"\0\0\x01\0{}");
    assert_eq!((id, flags & ERROR), (4, ERROR));
    // A read larger than the advertised transfer size.
    let (id, flags, _) = call(&mut s, 5, REGION_READ, &access(0, 0, 64 << 20, &[]));
    assert_eq!((id, flags & ERROR), (5, ERROR));
    // A write whose count is not its data's length.
    let (id, flags, _) = call(&mut s, 6, REGION_WRITE, &access(0, 0, 8, &[1, 2]));
    assert_eq!((id, flags & ERROR), (6, ERROR));
    // The server goes on.
    let (id, flags, body) = call(&mut s, 7, REGION_READ, &access(0, 0, 8, &[]));
    assert_eq!((id, flags & ERROR), (7, 0));
    assert_eq!(&body[16..], b"devlend!");

    // A message size below the header closes the connection.
    s.write_all(&[9, 0, 9, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
        .unwrap();
    let mut b = [0u8; 1];
    assert!(
        matches!(s.read(&mut b), Ok(0) | Err(_)),
        "the connection is closed"
    );
    // And the next VMM is served.
    let mut s = connect(&path);
    assert_eq!(call(&mut s, 1, VERSION, &v).1 & ERROR, 0, "version");
}

/// The server's own checks: each malformed request is answered EINVAL and never
/// reaches the backend; the session then serves a valid read.
#[test]
fn the_server_refuses_what_no_backend_should_see() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    // Region 0: 8 bytes, read and write; region 1: 8 bytes, read only. Interrupt
    // index 0: 4 vectors.
    let regions = vec![region(0, 8, 3), region(1, 8, 1)];
    let irqs = vec![IrqInfo {
        index: 0,
        flags: 1,
        count: 4,
    }];
    let server = Server::new(&path, true, irqs, regions).unwrap();
    let calls = Calls::default();
    let c = calls.clone();
    std::thread::spawn(move || {
        let mut bar = Bar {
            data: *b"devlend!",
            calls: c,
        };
        loop {
            let _ = server.run(&mut bar);
        }
    });
    let mut s = connect(&path);
    let r = call_with(&mut s, 1, VERSION, 0, &version_body(), &[]);
    assert_eq!(r.flags & ERROR, 0);
    let caps = String::from_utf8_lossy(&r.body[4..]).into_owned();
    assert!(
        caps.contains("\"max_dma_maps\":65535"),
        "the version reply advertises the spec's default max_dma_maps: {caps}"
    );
    let ev = eventfd();
    let mem = memfd(4096);
    let good_read = |s: &mut UnixStream, id: u16, what: &str| {
        let r = call_with(s, id, REGION_READ, 0, &access(0, 0, 8, &[]), &[]);
        assert_eq!((r.id, r.flags & ERROR), (id, 0), "a read after {what}");
        assert_eq!(&r.body[16..], b"devlend!", "after {what}");
    };
    let mut id = 10u16;
    // (what, command, header flags, body, fds)
    type Case = (&'static str, u16, u32, Vec<u8>, Vec<RawFd>);
    let cases: Vec<Case> = vec![
        (
            "a read past the region's end",
            REGION_READ,
            0,
            access(0, 4, 8, &[]),
            vec![],
        ),
        (
            "a read whose end overflows",
            REGION_READ,
            0,
            access(0, u64::MAX - 2, 8, &[]),
            vec![],
        ),
        (
            "a write past the region's end",
            REGION_WRITE,
            0,
            access(0, 6, 4, &[1; 4]),
            vec![],
        ),
        (
            "a write to a read-only region",
            REGION_WRITE,
            0,
            access(1, 0, 4, &[1; 4]),
            vec![],
        ),
        (
            "a reply from the client",
            REGION_READ,
            1,
            access(0, 0, 8, &[]),
            vec![],
        ),
        (
            "an error from the client",
            REGION_READ,
            ERROR,
            access(0, 0, 8, &[]),
            vec![],
        ),
        (
            "a read with a file descriptor",
            REGION_READ,
            0,
            access(0, 0, 8, &[]),
            vec![ev.as_raw_fd()],
        ),
        (
            "an unmap with a file descriptor",
            DMA_UNMAP,
            0,
            dma_unmap_body(0x1000, 0x1000),
            vec![mem.as_raw_fd()],
        ),
        (
            "a map with two file descriptors",
            DMA_MAP,
            0,
            dma_map_body(0, 0x1000, 0x1000),
            vec![mem.as_raw_fd(), mem.as_raw_fd()],
        ),
        (
            "vectors past the index's count",
            SET_IRQS,
            0,
            set_irqs_body(ACTION_TRIGGER | DATA_EVENTFD, 0, 2, 4),
            vec![],
        ),
        (
            "vectors whose end overflows",
            SET_IRQS,
            0,
            set_irqs_body(ACTION_TRIGGER | DATA_NONE, 0, u32::MAX, 2),
            vec![],
        ),
        (
            "an eventfd with DATA_NONE",
            SET_IRQS,
            0,
            set_irqs_body(ACTION_UNMASK | DATA_NONE, 0, 0, 1),
            vec![ev.as_raw_fd()],
        ),
        (
            "one eventfd for two vectors",
            SET_IRQS,
            0,
            set_irqs_body(ACTION_TRIGGER | DATA_EVENTFD, 0, 0, 2),
            vec![ev.as_raw_fd()],
        ),
        (
            "an interrupt index that does not exist",
            SET_IRQS,
            0,
            set_irqs_body(ACTION_TRIGGER | DATA_NONE, 3, 0, 1),
            vec![],
        ),
        (
            "a region that does not exist",
            REGION_READ,
            0,
            access(2, 0, 4, &[]),
            vec![],
        ),
    ];
    for (what, cmd, flags, body, fds) in cases {
        id += 1;
        let r = call_with(&mut s, id, cmd, flags, &body, &fds);
        refused(&r, id, libc::EINVAL, what);
        id += 1;
        good_read(&mut s, id, what);
    }
    // What is well formed reaches the backend.
    id += 1;
    let r = call_with(
        &mut s,
        id,
        SET_IRQS,
        0,
        &set_irqs_body(ACTION_TRIGGER | DATA_EVENTFD, 0, 1, 1),
        &[ev.as_raw_fd()],
    );
    assert_eq!(r.flags & ERROR, 0, "{r:?}");
    id += 1;
    let r = call_with(
        &mut s,
        id,
        DMA_MAP,
        0,
        &dma_map_body(0, 0x1000, 0x1000),
        &[mem.as_raw_fd()],
    );
    assert_eq!(r.flags & ERROR, 0, "{r:?}");
    id += 1;
    let r = call_with(&mut s, id, REGION_READ, 0, &access(1, 4, 4, &[]), &[]);
    assert_eq!(r.flags & ERROR, 0, "a read of the read-only region: {r:?}");
    let calls = calls.lock().unwrap().clone();
    let not_reads: Vec<&String> = calls.iter().filter(|c| *c != "read 0 0 8").collect();
    assert_eq!(
        not_reads,
        [
            "set_irqs 0 1 1 fds 1",
            "dma_map 0x1000 fd true",
            "read 1 4 4"
        ],
        "only the well-formed requests reached the backend"
    );
}

/// Lines the test process logged (`tracing`, and the `log` crate through it).
fn log_lines() -> &'static Mutex<Vec<u8>> {
    static LINES: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();
    LINES.get_or_init(|| {
        struct W;
        impl Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                log_lines().lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let _ = tracing_subscriber::fmt()
            .with_writer(|| W)
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .try_init();
        Mutex::new(Vec::new())
    })
}

fn lines_logged() -> usize {
    log_lines()
        .lock()
        .unwrap()
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
}

/// Size of the stand-in lender's BAR0.
const BAR: u64 = 4096;

/// A lender that answers every request as if it were fine (reads with bytes
/// `offset + i`), and records the region reads it got: what the borrower must refuse
/// is not refused for it here.
fn lender() -> (String, Arc<Mutex<Vec<Access>>>) {
    lender_of(
        PciIdentity {
            bdf: "0000:00:04.0".into(),
            ..PciIdentity::default()
        },
        0,
    )
}

/// As [`lender`], describing the function as `identity` and answering INFO with
/// `info_flags`.
fn lender_of(identity: PciIdentity, info_flags: u32) -> (String, Arc<Mutex<Vec<Access>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let reads = Arc::new(Mutex::new(Vec::new()));
    let r = reads.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let reads = r.clone();
            let identity = identity.clone();
            std::thread::spawn(move || {
                if Hello::read_from(&mut s).is_err() {
                    return;
                }
                let mut reply = HelloReply::ok(identity);
                reply.features = FEATURE_PCI;
                if reply.write_to(&mut s).is_err() {
                    return;
                }
                while let Ok(m) = Message::read_from(&mut s) {
                    let payload = match m.kind {
                        KIND_INFO => PciInfo {
                            regions: vec![RegionInfo {
                                size: BAR,
                                flags: 3,
                            }],
                            irqs: vec![
                                LenderIrq { count: 1, flags: 7 },
                                LenderIrq { count: 4, flags: 1 },
                            ],
                            flags: info_flags,
                        }
                        .encode(),
                        KIND_READ => {
                            let (a, _) = Access::decode(&m.payload, false).unwrap();
                            reads.lock().unwrap().push(a);
                            (0..a.len)
                                .map(|i| (a.offset + u64::from(i)) as u8)
                                .collect()
                        }
                        KIND_PULL => Vec::new(),
                        _ => Vec::new(),
                    };
                    if Message::new(m.kind | REPLY, payload)
                        .write_to(&mut s)
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (addr, reads)
}

/// A borrower of the stand-in lender's function served on `path`.
fn borrower(lender: &str, path: &Path) {
    let mut b = PciBorrower::connect(&target(lender)).unwrap();
    let server = b.listen(path).unwrap();
    std::thread::spawn(move || b.serve(&server));
}

fn target(lender: &str) -> LinkTarget {
    LinkTarget {
        lender: lender.into(),
        device: "fn0".into(),
        borrower: [7; 16],
        token: Vec::new(),
        tls: None,
        timeout: Duration::from_secs(5),
        transport: Transport::Tcp,
        lender_key: None,
        holder: None,
    }
}

/// The coherence mode comes from the lender's description (version 2) and its INFO
/// must agree: a lender that describes a mirrored function but mediates it (or the
/// reverse) is refused, not served in the wrong mode. A version 1 description (no IDs,
/// mirror) leaves the mode to the INFO.
#[test]
fn a_lender_whose_description_and_info_disagree_on_coherence_is_refused() {
    use devlend_fabric::pci::INFO_MEDIATED;
    use devlend_fabric::CoherenceMode;
    let described = |coherence| PciIdentity {
        bdf: "0000:00:04.0".into(),
        vendor_id: 0x1b36,
        device_id: 0x0010,
        coherence,
        ..PciIdentity::default()
    };
    for (identity, flags) in [
        (described(CoherenceMode::Mediated), 0),
        (described(CoherenceMode::Mirror), INFO_MEDIATED),
    ] {
        let want = identity.coherence;
        let (addr, _) = lender_of(identity, flags);
        match PciBorrower::connect(&target(&addr)) {
            Err(devlend_backend::pci::PciError::CoherenceMismatch { described, .. }) => {
                assert_eq!(described, want)
            }
            Err(e) => panic!("{want:?} with INFO flags {flags}: {e}"),
            Ok(_) => panic!("{want:?} with INFO flags {flags} was served"),
        }
    }
    for (identity, flags, mode) in [
        (
            described(CoherenceMode::Mediated),
            INFO_MEDIATED,
            CoherenceMode::Mediated,
        ),
        (described(CoherenceMode::Mirror), 0, CoherenceMode::Mirror),
        (
            PciIdentity {
                bdf: "0000:00:04.0".into(),
                ..PciIdentity::default()
            },
            INFO_MEDIATED,
            CoherenceMode::Mediated,
        ),
    ] {
        let (addr, _) = lender_of(identity, flags);
        let b = PciBorrower::connect(&target(&addr)).expect("an agreeing lender is served");
        assert_eq!(b.handle().coherence(), mode);
    }
}

/// A read of 8 bytes of BAR0 at `offset` works (the lender's pattern).
fn read_ok(s: &mut UnixStream, id: u16, offset: u64, what: &str) {
    let r = call_with(s, id, REGION_READ, 0, &access(0, offset, 8, &[]), &[]);
    assert_eq!(
        (r.id, r.flags & ERROR),
        (id, 0),
        "a read after {what}: {r:?}"
    );
    let want: Vec<u8> = (0..8).map(|i| (offset + i) as u8).collect();
    assert_eq!(&r.body[16..], &want[..], "after {what}");
}

/// The real borrower: malformed accesses, DMA maps and interrupt sets get an error
/// reply with an errno (EINVAL, ENOSPC past `max_dma_maps`), the session goes on, a
/// flood of refusals makes a bounded number of log lines, a bad message size closes
/// only that connection, and another device is served throughout.
#[test]
fn the_borrower_refuses_malformed_requests_and_other_devices_go_on() {
    let _ = log_lines();
    let dir = tempfile::tempdir().unwrap();
    let (addr, reads) = lender();
    let (one, other) = (dir.path().join("one.sock"), dir.path().join("other.sock"));
    borrower(&addr, &one);
    borrower(&addr, &other);
    let mut s = connect(&one);
    let mut o = connect(&other);
    read_ok(&mut o, 1, 0, "nothing");

    let r = call_with(&mut s, 1, VERSION, 0, &version_body(), &[]);
    assert_eq!(r.flags & ERROR, 0);
    let caps = String::from_utf8_lossy(&r.body[4..]).into_owned();
    assert!(
        caps.contains(&format!("\"max_dma_maps\":{MAX_DMA_MAPS}")),
        "the version reply advertises the borrower's limit: {caps}"
    );
    read_ok(&mut s, 2, 0, "VERSION");

    // Region accesses outside BAR0: refused here, never sent to the lender.
    let mut id = 10;
    for (what, body) in [
        ("a read past the BAR", access(0, BAR - 4, 8, &[])),
        (
            "a read whose end overflows",
            access(0, u64::MAX - 3, 8, &[]),
        ),
        ("a write past the BAR", access(0, BAR, 4, &[1; 4])),
    ] {
        id += 1;
        let cmd = if body.len() > 16 {
            REGION_WRITE
        } else {
            REGION_READ
        };
        let r = call_with(&mut s, id, cmd, 0, &body, &[]);
        refused(&r, id, libc::EINVAL, what);
        id += 1;
        read_ok(&mut s, id, 8, what);
    }
    assert!(
        reads
            .lock()
            .unwrap()
            .iter()
            .all(|a| a.offset + u64::from(a.len) <= BAR),
        "the lender got an access outside the BAR: {:?}",
        reads.lock().unwrap()
    );

    // DMA maps.
    let mem = memfd(0x2000);
    let fd = [mem.as_raw_fd()];
    for (what, body, fds) in [
        (
            "a map without a file descriptor",
            dma_map_body(0, 0x10_0000, 0x1000),
            &[][..],
        ),
        ("a map of size 0", dma_map_body(0, 0x10_0000, 0), &fd[..]),
        (
            "an unaligned map",
            dma_map_body(0, 0x10_0800, 0x1000),
            &fd[..],
        ),
        (
            "a map past the file's end",
            dma_map_body(0, 0x10_0000, 0x3000),
            &fd[..],
        ),
    ] {
        id += 1;
        let r = call_with(&mut s, id, DMA_MAP, 0, &body, fds);
        refused(&r, id, libc::EINVAL, what);
        id += 1;
        read_ok(&mut s, id, 0, what);
    }
    id += 1;
    let r = call_with(
        &mut s,
        id,
        DMA_MAP,
        0,
        &dma_map_body(0, 0x10_0000, 0x2000),
        &fd,
    );
    assert_eq!(r.flags & ERROR, 0, "a good map: {r:?}");
    id += 1;
    let r = call_with(
        &mut s,
        id,
        DMA_MAP,
        0,
        &dma_map_body(0, 0x10_1000, 0x1000),
        &fd,
    );
    refused(&r, id, libc::EINVAL, "an overlapping map");
    id += 1;
    let r = call_with(
        &mut s,
        id,
        DMA_UNMAP,
        0,
        &dma_unmap_body(0x20_0000, 0x1000),
        &[],
    );
    refused(&r, id, libc::EINVAL, "an unmap of nothing mapped");
    // Up to the limit, then ENOSPC; one unmapped makes room for one.
    for i in 1..u64::from(MAX_DMA_MAPS) {
        id = id.wrapping_add(1);
        let r = call_with(
            &mut s,
            id,
            DMA_MAP,
            0,
            &dma_map_body(0, 0x100_0000 + i * 0x1000, 0x1000),
            &fd,
        );
        assert_eq!(r.flags & ERROR, 0, "map {i} of {MAX_DMA_MAPS}: {r:?}");
    }
    let past = dma_map_body(0, 0x800_0000, 0x1000);
    id = id.wrapping_add(1);
    let r = call_with(&mut s, id, DMA_MAP, 0, &past, &fd);
    refused(&r, id, libc::ENOSPC, "a map past max_dma_maps");
    id = id.wrapping_add(1);
    let r = call_with(
        &mut s,
        id,
        DMA_UNMAP,
        0,
        &dma_unmap_body(0x100_1000, 0x1000),
        &[],
    );
    assert_eq!(r.flags & ERROR, 0, "{r:?}");
    id = id.wrapping_add(1);
    let r = call_with(&mut s, id, DMA_MAP, 0, &past, &fd);
    assert_eq!(r.flags & ERROR, 0, "a map after an unmap: {r:?}");
    id = id.wrapping_add(1);
    read_ok(&mut s, id, 0, "the DMA maps");

    // Interrupt sets (index 1: MSI, 4 vectors).
    let (e1, e2) = (eventfd(), eventfd());
    for (what, body, fds) in [
        (
            "an interrupt index that does not exist",
            set_irqs_body(ACTION_TRIGGER | DATA_EVENTFD, 9, 0, 1),
            vec![e1.as_raw_fd()],
        ),
        (
            "vectors past the index's count",
            set_irqs_body(ACTION_TRIGGER | DATA_EVENTFD, 1, 3, 2),
            vec![e1.as_raw_fd(), e2.as_raw_fd()],
        ),
        (
            "one eventfd for two vectors",
            set_irqs_body(ACTION_TRIGGER | DATA_EVENTFD, 1, 0, 2),
            vec![e1.as_raw_fd()],
        ),
        (
            "an eventfd with DATA_NONE",
            set_irqs_body(ACTION_UNMASK | DATA_NONE, 0, 0, 1),
            vec![e1.as_raw_fd()],
        ),
    ] {
        id = id.wrapping_add(1);
        let r = call_with(&mut s, id, SET_IRQS, 0, &body, &fds);
        refused(&r, id, libc::EINVAL, what);
        id = id.wrapping_add(1);
        read_ok(&mut s, id, 0, what);
    }
    id = id.wrapping_add(1);
    let r = call_with(
        &mut s,
        id,
        SET_IRQS,
        0,
        &set_irqs_body(ACTION_TRIGGER | DATA_EVENTFD, 1, 0, 2),
        &[e1.as_raw_fd(), e2.as_raw_fd()],
    );
    assert_eq!(r.flags & ERROR, 0, "a good interrupt set: {r:?}");

    // A flood of refusals: a bounded number of log lines.
    let before = lines_logged();
    for _ in 0..2000 {
        id = id.wrapping_add(1);
        let r = call_with(&mut s, id, REGION_READ, 0, &access(5, 0, 4, &[]), &[]);
        assert_eq!(r.flags & ERROR, ERROR);
    }
    let logged = lines_logged() - before;
    assert!(
        logged <= 100,
        "2000 refused requests logged {logged} lines:\n{}",
        String::from_utf8_lossy(&log_lines().lock().unwrap())
    );
    read_ok(&mut o, 2, 16, "the other device's neighbour's flood");

    // A message size that cannot be a message: this connection only is closed.
    s.write_all(&[9, 0, 9, 0, 0xff, 0xff, 0xff, 0x7f, 0, 0, 0, 0, 0, 0, 0, 0])
        .unwrap();
    let mut b = [0u8; 1];
    assert!(
        matches!(s.read(&mut b), Ok(0) | Err(_)),
        "the connection is closed"
    );
    read_ok(
        &mut o,
        3,
        24,
        "the other device's neighbour's closed connection",
    );
    // The next VMM on that socket is served (once the first one's maps are gone).
    let mut s = connect(&one);
    read_ok(&mut s, 1, 32, "a new connection");
    let r = call_with(
        &mut s,
        2,
        DMA_MAP,
        0,
        &dma_map_body(0, 0x10_0000, 0x2000),
        &fd,
    );
    assert_eq!(
        r.flags & ERROR,
        0,
        "the old maps are gone with their VMM: {r:?}"
    );
    let log = String::from_utf8_lossy(&log_lines().lock().unwrap()).into_owned();
    assert!(
        log.contains("vfio-user connection ended") && log.contains("Message size"),
        "the closed connection is logged with its reason:\n{log}"
    );
}
