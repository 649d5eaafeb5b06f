//! The virtio-blk request parser (`devlend_backend::blk::request::parse`) on a descriptor
//! chain and guest memory that the input decides, as a guest driver would.
//!
//! Input layout (missing bytes read as 0):
//! - byte 0: the device (see [`limits`]);
//! - byte 1: head descriptor index (mod [`QSIZE`]);
//! - byte 2: `n`, how many descriptors follow (mod `QSIZE + 1`);
//! - `n` × 16 bytes: descriptor table entries 0..n in virtio layout (`addr: u64, len:
//!   u32, flags: u16, next: u16`, little-endian): any address, length, flag (NEXT,
//!   WRITE, INDIRECT) and next index;
//! - then, until the input ends, writes into guest memory: `addr: u32, len: u16`, then
//!   `len` bytes: request headers, data, discard segments, indirect tables.
//!
//! Guest memory is two adjacent regions (a buffer may cross them) and one more past a
//! hole; the split queue's rings sit at guest address 0. The parser must never panic and
//! every [`Disposition`] must keep the parser's promises (see [`check`]).

#![no_main]

use std::sync::LazyLock;

use devlend_backend::blk::request::{parse, Scratch};
use devlend_backend::blk::spec::{S_IOERR, S_OK, S_UNSUPP};
use devlend_backend::blk::{DeviceLimits, Disposition, Parsed, Request};
use devlend_backend::guest::{GuestMemory, HostIov};
use devlend_fabric::{Sector, Sectors, SERIAL_LEN};
use libfuzzer_sys::fuzz_target;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

/// Queue size: small, so that `next` indices often land in (and out of) the table.
const QSIZE: u16 = 16;
/// Guest memory: `[0, 64K)` and `[64K, 128K)` (adjacent), `[256K, 260K)`.
const REGIONS: [(u64, usize); 3] = [(0, 0x1_0000), (0x1_0000, 0x1_0000), (0x4_0000, 0x1000)];

/// `DEVLEND_FUZZ_SHOW=1`: print each chain and its disposition (to read a reproducer).
static SHOW: LazyLock<bool> = LazyLock::new(|| std::env::var_os("DEVLEND_FUZZ_SHOW").is_some());

static ZEROES: [u8; 0x1_0000] = [0; 0x1_0000];

static MEM: LazyLock<GuestMemory> = LazyLock::new(|| {
    let ranges: Vec<_> = REGIONS.iter().map(|&(a, l)| (GuestAddress(a), l)).collect();
    GuestMemory::from_ranges(&ranges).expect("guest memory")
});

/// Reads the input front to back; past its end every byte is 0.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        let n = N.min(self.0.len());
        b[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        b
    }
    fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head
    }
}

/// The device, from one byte: bit 0 read-only, bit 1 discard, bit 2 write-zeroes,
/// bits 3-4 capacity, bits 5-6 largest transfer, bit 7 largest discard/write-zeroes.
fn limits(b: u8) -> DeviceLimits {
    let capacity = [0, 8, 2048, u64::MAX][usize::from(b >> 3 & 3)];
    let max_transfer = [0, 4096, 1 << 20, u32::MAX][usize::from(b >> 5 & 3)];
    let max_sectors = if b & 0x80 != 0 { u32::MAX } else { 8 };
    let mut serial = [0u8; SERIAL_LEN];
    serial[..6].copy_from_slice(b"FUZZ01");
    DeviceLimits {
        capacity_sectors: capacity,
        block_size: 512,
        max_transfer,
        max_discard_sectors: if b & 2 != 0 { max_sectors } else { 0 },
        max_write_zeroes_sectors: if b & 4 != 0 { max_sectors } else { 0 },
        read_only: b & 1 != 0,
        serial,
    }
}

fuzz_target!(|data: &[u8]| {
    let mem: &GuestMemory = &MEM;
    for &(addr, len) in &REGIONS {
        mem.write_slice(&ZEROES[..len], GuestAddress(addr))
            .expect("region reset");
    }
    let mut input = Input(data);
    let limits = limits(input.u8());
    let head = u16::from(input.u8()) % QSIZE;
    let n = u16::from(input.u8()) % (QSIZE + 1);
    let descs: Vec<Descriptor> = (0..n)
        .map(|_| Descriptor::new(input.u64(), input.u32(), input.u16(), input.u16()))
        .collect();
    while !input.0.is_empty() {
        let addr = input.u32();
        let len = input.u16();
        let bytes = input.take(usize::from(len));
        // Out of guest memory: the fuzzer learns not to.
        let _ = mem.write_slice(bytes, GuestAddress(u64::from(addr)));
    }

    // The queue goes in last, so that the writes above cannot undo it.
    let vq = MockSplitQueue::create(mem, GuestAddress(0), QSIZE);
    for (i, d) in descs.iter().enumerate() {
        vq.desc_table()
            .store(i as u16, RawDescriptor::from(*d))
            .expect("descriptor slot");
    }
    vq.avail().ring().ref_at(0).expect("avail slot").store(head);
    vq.avail().idx().store(1);
    let mut queue: Queue = vq.create_queue().expect("queue");
    let Some(chain) = queue.pop_descriptor_chain(mem) else {
        return;
    };
    // What the chain says, walked independently of the parser.
    let walked: Vec<Descriptor> = chain.clone().collect();

    let mut scratch = Scratch::default();
    let mut iovs = Vec::new();
    let parsed = parse(chain.clone(), mem, &limits, &mut scratch, &mut iovs);
    if *SHOW {
        eprintln!("{limits:?}\nchain {walked:?}\n-> {parsed:?}, iovecs {iovs:?}");
    }
    check(mem, &limits, head, &walked, &parsed, &iovs);

    // The scratch space carries nothing from one chain to the next. (Unless the request
    // was completed locally: GET_ID may have written its answer, or part of it before a
    // later buffer failed, into memory the guest also pointed its header or descriptor
    // table at, so the chain itself changed.)
    if matches!(parsed.disposition, Disposition::Complete { .. }) {
        return;
    }
    let mut again = Vec::new();
    let reparsed = parse(chain, mem, &limits, &mut scratch, &mut again);
    assert_eq!(parsed, reparsed, "a second parse of the same chain differs");
    assert_eq!(iov_list(&iovs), iov_list(&again));
});

fn iov_list(iovs: &[HostIov]) -> Vec<(usize, usize)> {
    iovs.iter().map(|v| (v.ptr as usize, v.len)).collect()
}

/// The guest range a host iovec covers, if it lies inside one guest memory region.
fn guest_range(mem: &GuestMemory, iov: &HostIov) -> Option<(u64, u64)> {
    let p = iov.ptr as usize;
    mem.iter().find_map(|r| {
        let base = r.get_host_address(MemoryRegionAddress(0)).ok()? as usize;
        let len = r.len() as usize;
        (p >= base && iov.len <= len && p - base <= len - iov.len).then(|| {
            let start = r.start_addr().0 + (p - base) as u64;
            (start, start + iov.len as u64)
        })
    })
}

/// Checks `parsed` against what `parse` promises for the chain `walked`.
fn check(
    mem: &GuestMemory,
    limits: &DeviceLimits,
    head: u16,
    walked: &[Descriptor],
    parsed: &Parsed,
    iovs: &[HostIov],
) {
    assert_eq!(parsed.head, head, "wrong head");
    let writable: Vec<&Descriptor> = walked.iter().filter(|d| d.is_write_only()).collect();
    // The status byte is the last byte of the last device-writable descriptor.
    let status = writable
        .last()
        .filter(|d| d.len() > 0)
        .and_then(|d| d.addr().0.checked_add(u64::from(d.len()) - 1))
        .filter(|&a| mem.get_slice(GuestAddress(a), 1).is_ok());
    let Some(status) = status else {
        assert_eq!(parsed.disposition, Disposition::NoStatus, "{walked:?}");
        assert!(iovs.is_empty(), "iovecs without a status byte");
        return;
    };
    assert_eq!(parsed.status_addr, GuestAddress(status), "status address");
    // Readable bytes, and writable bytes before the status byte.
    let in_len: u64 = writable.iter().map(|d| u64::from(d.len())).sum::<u64>() - 1;
    let in_range = |sector: u64, sectors: u64| {
        sector
            .checked_add(sectors)
            .is_some_and(|end| end <= limits.capacity_sectors)
    };
    // Each iovec lies in guest memory, inside a descriptor of the right direction.
    let iovs_inside = |write: bool| {
        for iov in iovs {
            let (start, end) = guest_range(mem, iov)
                .unwrap_or_else(|| panic!("iovec {iov:?} outside guest memory"));
            assert!(
                walked.iter().any(|d| d.is_write_only() == write
                    && d.addr().0 <= start
                    && u128::from(end) <= u128::from(d.addr().0) + u128::from(d.len())),
                "iovec {start:#x}..{end:#x} is in no {} descriptor of {walked:?}",
                if write {
                    "device-writable"
                } else {
                    "device-readable"
                }
            );
        }
    };
    let iov_total: u64 = iovs.iter().map(|v| v.len as u64).sum();
    match parsed.disposition {
        Disposition::NoStatus => panic!("NoStatus for a chain with a status byte: {walked:?}"),
        Disposition::Complete { status, written } => {
            assert!(
                [S_OK, S_IOERR, S_UNSUPP].contains(&status),
                "status {status}"
            );
            assert!(status == S_OK || written == 0, "an error wrote data");
            assert!(written as usize <= SERIAL_LEN && u64::from(written) <= in_len);
            assert!(iovs.is_empty(), "iovecs for a completed request");
        }
        Disposition::Submit(req) => match req {
            Request::Read {
                sector: Sector(sector),
                len: devlend_fabric::Bytes(len),
            }
            | Request::Write {
                sector: Sector(sector),
                len: devlend_fabric::Bytes(len),
            } => {
                let write = matches!(req, Request::Write { .. });
                assert!(!(write && limits.read_only), "write to a read-only device");
                assert!(len > 0 && len % 512 == 0, "{req:?}");
                assert!(len <= limits.max_transfer, "{req:?} over max_transfer");
                assert!(
                    in_range(sector, u64::from(len / 512)),
                    "{req:?} past the end"
                );
                assert_eq!(
                    iov_total,
                    u64::from(len),
                    "{req:?}: iovecs of {iov_total} bytes"
                );
                // A read fills device-writable buffers; a write takes device-readable ones.
                iovs_inside(!write);
            }
            Request::Flush => assert!(iovs.is_empty()),
            Request::Discard {
                sector: Sector(sector),
                sectors: Sectors(sectors),
            }
            | Request::WriteZeroes {
                sector: Sector(sector),
                sectors: Sectors(sectors),
                ..
            } => {
                let max = if matches!(req, Request::Discard { .. }) {
                    limits.max_discard_sectors
                } else {
                    limits.max_write_zeroes_sectors
                };
                assert!(!limits.read_only, "{req:?} on a read-only device");
                assert!(sectors >= 1 && sectors <= max, "{req:?}, max {max}");
                assert!(in_range(sector, u64::from(sectors)), "{req:?} past the end");
                assert!(iovs.is_empty());
            }
        },
    }
}
