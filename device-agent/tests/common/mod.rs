//! A minimal borrower for the tests: the fabric codecs over a real TcpStream.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use devlend_device_agent::{BlockSpec, DeviceSpec, Lender, LenderHandle, Options};
use devlend_fabric::wire::{RawRequest, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN};
use devlend_fabric::{tcp, BlockGeometry, Op, RequestHeader, ResponseHeader, Status};

/// How long a test waits for any one answer before failing instead of hanging.
pub const IO_TIMEOUT: Duration = Duration::from_secs(20);

/// A lender on 127.0.0.1 serving image files in a temporary directory.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub lender: Option<LenderHandle>,
}

impl Fixture {
    /// Creates each `(name, bytes, read_only)` image (sparse, zero-filled) and lends it.
    pub fn new(images: &[(&str, u64, bool)]) -> Fixture {
        Self::with_options(images, Options::default())
    }

    pub fn with_options(images: &[(&str, u64, bool)], options: Options) -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::in_dir(dir, images, options)
    }

    pub fn in_dir(
        dir: tempfile::TempDir,
        images: &[(&str, u64, bool)],
        options: Options,
    ) -> Fixture {
        let specs = images
            .iter()
            .map(|&(name, size, ro)| {
                let path = dir.path().join(format!("{name}.img"));
                std::fs::File::create(&path)
                    .and_then(|f| f.set_len(size))
                    .expect("image");
                let mut block = BlockSpec::new(path);
                block.read_only = ro;
                DeviceSpec::new(name, block)
            })
            .collect();
        let lender = Lender::bind_with("127.0.0.1:0", specs, options).expect("bind");
        Fixture {
            dir,
            lender: Some(lender.spawn()),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.handle().local_addr()
    }

    pub fn handle(&self) -> &LenderHandle {
        self.lender.as_ref().expect("lender running")
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.img"))
    }

    pub fn stats(&self, name: &str) -> devlend_device_agent::DeviceStatsSnapshot {
        self.handle().stats(name).expect("device exists")
    }

    pub fn connect(&self, device: &str) -> Client {
        Client::connect(self.addr(), device)
    }
}

/// One borrower session.
pub struct Client {
    pub sock: TcpStream,
    pub info: BlockGeometry,
    next_id: u64,
}

impl Client {
    pub fn connect(addr: SocketAddr, device: &str) -> Client {
        let (sock, reply) =
            tcp::connect(&addr.to_string(), device, 0, IO_TIMEOUT).expect("handshake");
        sock.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
        Client {
            sock,
            info: reply.block().cloned().expect("a block device"),
            next_id: 1,
        }
    }

    /// Wraps a stream whose handshake is done.
    pub fn from_stream(sock: TcpStream, info: BlockGeometry) -> Client {
        Client {
            sock,
            info,
            next_id: 1,
        }
    }

    pub fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Sends a header and, for a write, its data.
    pub fn send(&mut self, h: &RequestHeader, data: &[u8]) {
        let mut frame = h.encode().to_vec();
        frame.extend_from_slice(data);
        self.sock.write_all(&frame).expect("send request");
    }

    /// Receives one response and its data.
    pub fn recv(&mut self) -> (ResponseHeader, Vec<u8>) {
        recv_from(&mut self.sock)
    }

    /// Sends one request, its fields as on the wire (whatever they are), and waits for
    /// its response.
    pub fn call(
        &mut self,
        op: Op,
        flags: u8,
        sector: u64,
        len: u32,
        data: &[u8],
    ) -> (Status, Vec<u8>) {
        let id = self.id();
        let mut frame = raw_header(op as u8, flags, len, id, sector).to_vec();
        frame.extend_from_slice(data);
        self.sock.write_all(&frame).expect("send request");
        let (r, d) = self.recv();
        assert_eq!(r.id, id, "response to another request");
        (r.status, d)
    }

    pub fn read(&mut self, sector: u64, len: u32) -> (Status, Vec<u8>) {
        self.call(Op::Read, 0, sector, len, &[])
    }

    pub fn write(&mut self, sector: u64, data: &[u8]) -> Status {
        self.call(Op::Write, 0, sector, data.len() as u32, data).0
    }

    pub fn flush(&mut self) -> Status {
        self.call(Op::Flush, 0, 0, 0, &[]).0
    }

    /// True if the lender closed the connection (EOF or reset) within the read timeout.
    pub fn is_closed_by_peer(&mut self) -> bool {
        let mut b = [0u8; 1];
        match self.sock.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
            ),
        }
    }
}

/// Reads one response (and a read's data) from `r`.
pub fn recv_from(r: &mut impl Read) -> (ResponseHeader, Vec<u8>) {
    let mut h = [0u8; RESPONSE_HEADER_LEN];
    r.read_exact(&mut h).expect("response header");
    let h = ResponseHeader::decode(&h).expect("valid response header");
    let mut data = vec![0u8; h.len.usize()];
    r.read_exact(&mut data).expect("response data");
    (h, data)
}

/// A raw request header (for malformed ones).
pub fn raw_header(op: u8, flags: u8, len: u32, id: u64, sector: u64) -> [u8; REQUEST_HEADER_LEN] {
    RawRequest {
        op,
        flags,
        reserved: [0; 2],
        len,
        id,
        sector,
    }
    .encode()
}

/// Deterministic pseudo-random numbers (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Allocated 512-byte blocks of a file (`st_blocks`).
pub fn allocated_blocks(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).expect("stat").blocks()
}
