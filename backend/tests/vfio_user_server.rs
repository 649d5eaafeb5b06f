//! The vfio-user server devlend's PCI borrower runs on (the `vfio_user` crate, patched:
//! `third_party/vfio_user/DEVLEND-PATCH.md`), driven by raw messages: refused and
//! malformed requests are answered with an error and the server goes on, with its
//! framing intact; a size that cannot be a message closes the connection. The backend
//! here is a stand-in (8 bytes of "BAR0"): this tests the server, not devlend's lending.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use vfio_bindings::bindings::vfio::vfio_region_info;
use vfio_user::{DmaMapFlags, DmaUnmapFlags, Server, ServerBackend, ServerRegion};

struct Bar([u8; 8]);

impl ServerBackend for Bar {
    fn region_read(&mut self, _region: u32, offset: u64, data: &mut [u8]) -> std::io::Result<()> {
        let o = offset as usize;
        let src = self
            .0
            .get(o..o + data.len())
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        data.copy_from_slice(src);
        Ok(())
    }
    fn region_write(&mut self, _region: u32, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let o = offset as usize;
        self.0
            .get_mut(o..o + data.len())
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?
            .copy_from_slice(data);
        Ok(())
    }
    fn dma_map(
        &mut self,
        _: DmaMapFlags,
        _: u64,
        _: u64,
        _: u64,
        _: Option<File>,
    ) -> std::io::Result<()> {
        Ok(())
    }
    fn dma_unmap(&mut self, _: DmaUnmapFlags, _: u64, _: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn reset(&mut self) -> std::io::Result<()> {
        Ok(())
    }
    fn set_irqs(&mut self, _: u32, _: u32, _: u32, _: u32, _: Vec<File>) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sends a message (command, body) and reads the reply: (id, flags, body).
fn call(s: &mut UnixStream, id: u16, cmd: u16, body: &[u8]) -> (u16, u32, Vec<u8>) {
    let mut m = Vec::new();
    m.extend_from_slice(&id.to_le_bytes());
    m.extend_from_slice(&cmd.to_le_bytes());
    m.extend_from_slice(&((16 + body.len()) as u32).to_le_bytes());
    m.extend_from_slice(&[0; 8]);
    m.extend_from_slice(body);
    s.write_all(&m).expect("send");
    let mut h = [0u8; 16];
    s.read_exact(&mut h).expect("reply header");
    let size = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
    let mut rest = vec![0u8; size.saturating_sub(16)];
    s.read_exact(&mut rest).expect("reply body");
    (
        u16::from_le_bytes([h[0], h[1]]),
        u32::from_le_bytes([h[8], h[9], h[10], h[11]]),
        rest,
    )
}

fn access(region: u32, offset: u64, count: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&region.to_le_bytes());
    b.extend_from_slice(&count.to_le_bytes());
    b.extend_from_slice(data);
    b
}

const ERROR: u32 = 1 << 5;

#[test]
fn refused_requests_keep_the_framing_and_bad_sizes_close() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let region = ServerRegion {
        region_info: vfio_region_info {
            argsz: std::mem::size_of::<vfio_region_info>() as u32,
            flags: 3,
            index: 0,
            cap_offset: 0,
            size: 8,
            offset: 0,
        },
        sparse_areas: Vec::new(),
        mmap_fd: None,
    };
    let server = Server::new(&path, true, Vec::new(), vec![region]).unwrap();
    std::thread::spawn(move || {
        let mut bar = Bar(*b"devlend!");
        loop {
            let _ = server.run(&mut bar);
        }
    });
    let mut s = UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut v = vec![0, 0, 1, 0];
    v.extend_from_slice(b"{\"capabilities\":{}}\0");
    assert_eq!(call(&mut s, 1, 1, &v).1 & ERROR, 0, "version");

    // A write to a region out of range, its data not taken for the next header.
    let (id, flags, _) = call(&mut s, 2, 10, &access(7, 0, 24, &[0x11; 24]));
    assert_eq!((id, flags & ERROR), (2, ERROR));
    // An unknown command with a payload, a version without its NUL.
    let (id, flags, _) = call(&mut s, 3, 0x77, &[0xff; 40]);
    assert_eq!((id, flags & ERROR), (3, ERROR));
    let (id, flags, _) = call(&mut s, 4, 1, b"\0\0\x01\0{}");
    assert_eq!((id, flags & ERROR), (4, ERROR));
    // A read larger than the advertised transfer size.
    let (id, flags, _) = call(&mut s, 5, 9, &access(0, 0, 64 << 20, &[]));
    assert_eq!((id, flags & ERROR), (5, ERROR));
    // A write whose count is not its data's length.
    let (id, flags, _) = call(&mut s, 6, 10, &access(0, 0, 8, &[1, 2]));
    assert_eq!((id, flags & ERROR), (6, ERROR));
    // The server goes on.
    let (id, flags, body) = call(&mut s, 7, 9, &access(0, 0, 8, &[]));
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
    let mut s = UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(call(&mut s, 1, 1, &v).1 & ERROR, 0, "version");
}
