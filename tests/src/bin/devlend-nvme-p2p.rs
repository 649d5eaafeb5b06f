//! `devlend-nvme-p2p`: a tiny user-space NVMe driver run as root inside a test guest,
//! to show a peer-to-peer DMA between two lent NVMe controllers. It stands in for
//! SPDK-style user-space drivers because Debian's guest kernels lack
//! `CONFIG_PCI_P2PDMA`: it maps the source controller's BAR0 through sysfs, builds its
//! queues in locked pages (physical addresses from `/proc/self/pagemap`), and issues a
//! Read whose PRPs point at another controller's BAR (its Controller Memory Buffer),
//! which it then reads back through that BAR's sysfs `resourceN` mmap.
//!
//! ```text
//! devlend-nvme-p2p read    SRC_BDF DST_BDF DST_BAR SLBA BYTES
//! devlend-nvme-p2p fill    DST_BDF DST_BAR BYTES BYTEVAL
//! devlend-nvme-p2p dump    DST_BDF DST_BAR BYTES
//! devlend-nvme-p2p read-at SRC_BDF ADDR SLBA BYTES
//! ```
//!
//! Results are `DEVLEND-RESULT key=value` lines; exit 0 on success, 1 on failure, 2 on
//! usage errors. `DEVLEND_P2P_SYSFS` overrides `/sys/bus/pci/devices` (for tests).

use std::fmt::Display;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: devlend-nvme-p2p read SRC_BDF DST_BDF DST_BAR SLBA BYTES
       devlend-nvme-p2p fill DST_BDF DST_BAR BYTES BYTEVAL
       devlend-nvme-p2p dump DST_BDF DST_BAR BYTES
       devlend-nvme-p2p read-at SRC_BDF ADDR SLBA BYTES";
const PAGE: usize = 4096;
const QSIZE: u16 = 16;
const MAX_BYTES: usize = 65536;
const POLL: Duration = Duration::from_millis(1);
const MIN_TIMEOUT: Duration = Duration::from_secs(60);
/// DMA pages, one per structure: queue `q`'s SQ is page 2q and its CQ page 2q + 1.
const IDENT: usize = 4;
const PRPL: usize = 5;
const NPAGES: usize = 6;
/// Controller registers.
const CC: usize = 0x14;
const CSTS: usize = 0x1c;
const AQA: usize = 0x24;
const CC_ENABLE: u32 = 0x0046_0001; // EN, IOSQES 6, IOCQES 4, MPS 0 (4 KiB), CSS 0.

type Res<T> = Result<T, String>;

/// Adds context to an error, as a message.
trait Ctx<T> {
    fn ctx(self, what: impl Display) -> Res<T>;
}

impl<T, E: Display> Ctx<T> for Result<T, E> {
    fn ctx(self, what: impl Display) -> Res<T> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

enum Cmd {
    Read(String, String, u8, u64, usize),
    ReadAt(String, u64, u64, usize),
    Fill(String, u8, usize, u8),
    Dump(String, u8, usize),
}

fn sysfs(bdf: &str, name: &str) -> PathBuf {
    let root = std::env::var("DEVLEND_P2P_SYSFS");
    PathBuf::from(format!(
        "{}/{bdf}/{name}",
        root.as_deref().unwrap_or("/sys/bus/pci/devices")
    ))
}

/// Opens `path` for reading and writing, with extra `flags`.
fn open_rw(path: &PathBuf, flags: i32) -> Res<File> {
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).custom_flags(flags);
    opts.open(path).ctx(path.display())
}

/// A shared or anonymous mapping, accessed 32 bits at a time with volatile accesses.
struct Map {
    ptr: *mut u8,
    len: usize,
}

impl Map {
    fn new(len: usize, flags: i32, fd: i32) -> Res<Map> {
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a fresh mapping at an address of the kernel's choice; aliases nothing.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        Ok(Map { ptr: p.cast(), len })
    }

    /// Maps `resource{bar}` of `bdf`, sized from its line in the `resource` file.
    fn bar(bdf: &str, bar: u8) -> Res<Map> {
        let (_, size) = bar_range(bdf, bar)?;
        let path = sysfs(bdf, &format!("resource{bar}"));
        let file = open_rw(&path, libc::O_SYNC)?;
        let len = usize::try_from(size).ctx("BAR size")?;
        let map = Map::new(
            len.next_multiple_of(PAGE),
            libc::MAP_SHARED,
            file.as_raw_fd(),
        );
        map.ctx(path.display())
    }

    fn at(&self, off: usize) -> *mut u32 {
        let ok = off.is_multiple_of(4) && off + 4 <= self.len;
        assert!(ok, "offset {off:#x} is out of the map");
        // SAFETY: in bounds (asserted), so within the mapping.
        unsafe { self.ptr.add(off).cast() }
    }

    fn r32(&self, off: usize) -> u32 {
        // SAFETY: `at` checked the address is mapped and 4-byte aligned (maps are page-aligned).
        unsafe { self.at(off).read_volatile() }
    }

    fn w32(&self, off: usize, v: u32) {
        // SAFETY: `at` checked the address is mapped and 4-byte aligned (maps are page-aligned).
        unsafe { self.at(off).write_volatile(v) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `Map::new`; no reference outlives it.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Locked anonymous pages and their guest-physical addresses.
fn dma_pages(pages: usize) -> Res<(Map, Vec<u64>)> {
    // SAFETY: sysconf has no memory-safety preconditions.
    if unsafe { libc::sysconf(libc::_SC_PAGESIZE) } != PAGE as libc::c_long {
        return Err("the page size is not 4 KiB".into());
    }
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_LOCKED;
    let map = Map::new(pages * PAGE, flags | libc::MAP_POPULATE, -1).ctx("DMA memory")?;
    // SAFETY: locks the pages of our own mapping, which is `map.len` long.
    if unsafe { libc::mlock(map.ptr.cast(), map.len) } != 0 {
        return Err(format!("mlock: {}", std::io::Error::last_os_error()));
    }
    let pagemap = File::open("/proc/self/pagemap").ctx("pagemap")?;
    let mut phys = Vec::with_capacity(pages);
    for i in 0..pages {
        map.w32(i * PAGE, 0); // Fault the page in.
        let mut b = [0u8; 8];
        let vpn = (map.ptr as usize + i * PAGE) / PAGE;
        pagemap
            .read_exact_at(&mut b, vpn as u64 * 8)
            .ctx("pagemap")?;
        let entry = u64::from_le_bytes(b);
        let pfn = entry & ((1 << 55) - 1);
        if entry >> 63 == 0 || pfn == 0 {
            return Err("pagemap gives no PFN (not root?)".into());
        }
        phys.push(pfn * PAGE as u64);
    }
    Ok((map, phys))
}

/// The state of a queue pair: SQ tail, CQ head, whether the CQ wrapped an odd number
/// of times (the phase to expect is then 0), and the last command id.
#[derive(Default)]
struct Queue {
    tail: u16,
    head: u16,
    odd: bool,
    cid: u16,
}

/// An enabled controller; dropping it disables it (CC.EN = 0), best effort.
struct Ctrl {
    regs: Map,
    dma: Map,
    phys: Vec<u64>,
    stride: usize,
    timeout: Duration,
    queues: [Queue; 2],
}

impl Ctrl {
    fn init(bdf: &str) -> Res<Ctrl> {
        enable(bdf, true)?;
        let regs = Map::bar(bdf, 0)?;
        let (dma, phys) = dma_pages(NPAGES)?;
        let cap = u64::from(regs.r32(0)) | u64::from(regs.r32(4)) << 32;
        if cap == u64::MAX || (cap >> 48) & 0xf != 0 || cap & 0xffff < u64::from(QSIZE - 1) {
            return Err(format!("unsupported CAP {cap:#x} (MPSMIN or MQES)"));
        }
        let stride = 4usize << ((cap >> 32) & 0xf);
        let timeout = Duration::from_millis(((cap >> 24) & 0xff) * 500).max(MIN_TIMEOUT);
        if regs.len < 0x1000 + 4 * stride {
            return Err("BAR0 is too small for the doorbells".into());
        }
        let queues = Default::default();
        let c = Ctrl {
            regs,
            dma,
            phys,
            stride,
            timeout,
            queues,
        };
        if c.regs.r32(CC) & 1 != 0 {
            c.regs.w32(CC, 0);
        }
        c.wait_ready(false)?;
        let q = u32::from(QSIZE - 1);
        c.regs.w32(AQA, q << 16 | q);
        for (reg, page) in [(0x28, 0), (0x30, 1)] {
            c.regs.w32(reg, c.phys[page] as u32);
            c.regs.w32(reg + 4, (c.phys[page] >> 32) as u32);
        }
        c.regs.w32(CC, CC_ENABLE);
        c.wait_ready(true)?;
        Ok(c)
    }

    fn wait_ready(&self, ready: bool) -> Res<()> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let csts = self.regs.r32(CSTS);
            if csts == u32::MAX || (ready && csts & 2 != 0) {
                return Err(format!("controller failed (CSTS {csts:#x})"));
            }
            if (csts & 1 != 0) == ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("timeout waiting for CSTS.RDY={}", u8::from(ready)));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Submits `cmd` on queue `qid` and polls for its completion: the status
    /// (SCT << 8 | SC), or None on timeout.
    fn submit(&mut self, qid: usize, mut cmd: [u32; 16]) -> Res<Option<u16>> {
        let q = &mut self.queues[qid];
        q.cid = q.cid.wrapping_add(1);
        cmd[0] = (cmd[0] & 0xffff) | u32::from(q.cid) << 16;
        let sqe = 2 * qid * PAGE + usize::from(q.tail) * 64;
        let cq = (2 * qid + 1) * PAGE;
        for (i, d) in cmd.iter().enumerate() {
            self.dma.w32(sqe + i * 4, *d);
        }
        q.tail = (q.tail + 1) % QSIZE;
        fence(Ordering::SeqCst);
        let doorbell = 0x1000 + 2 * qid * self.stride;
        self.regs.w32(doorbell, u32::from(q.tail));
        let deadline = Instant::now() + self.timeout;
        loop {
            let dw3 = self.dma.r32(cq + usize::from(q.head) * 16 + 12);
            if (dw3 >> 16 & 1 == 0) == q.odd {
                fence(Ordering::SeqCst);
                q.head = (q.head + 1) % QSIZE;
                q.odd ^= q.head == 0;
                self.regs.w32(doorbell + self.stride, u32::from(q.head));
                let cid = dw3 & 0xffff;
                if cid != u32::from(q.cid) {
                    return Err(format!("completion of command {cid}, not {}", q.cid));
                }
                return Ok(Some((dw3 >> 17 & 0x7fff) as u16));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(POLL);
        }
    }

    /// Runs admin command `op` with PRP1 = DMA page `page` and CDW1, 10 and 11 as given.
    fn admin(&mut self, what: &str, op: u32, page: usize, dw: [u32; 3]) -> Res<()> {
        let p = self.phys[page];
        let mut cmd = [0u32; 16];
        (cmd[0], cmd[1], cmd[6], cmd[7]) = (op, dw[0], p as u32, (p >> 32) as u32);
        (cmd[10], cmd[11]) = (dw[1], dw[2]);
        match self.submit(0, cmd)? {
            Some(0) => Ok(()),
            Some(s) => Err(format!("{what} failed with status {s:#06x}")),
            None => Err(format!("{what} timed out")),
        }
    }

    fn identify(&mut self, nsid: u32, cns: u32) -> Res<Vec<u8>> {
        self.admin("identify", 0x06, IDENT, [nsid, cns, 0])?;
        let words = (0..PAGE / 4).map(|i| self.dma.r32(IDENT * PAGE + i * 4));
        Ok(words.flat_map(u32::to_le_bytes).collect())
    }
}

impl Drop for Ctrl {
    fn drop(&mut self) {
        self.regs.w32(CC, 0);
        let _ = self.wait_ready(false);
    }
}

/// The BAR's start address and size, from line `bar` of the `resource` file.
fn bar_range(bdf: &str, bar: u8) -> Res<(u64, u64)> {
    let path = sysfs(bdf, "resource");
    let text = std::fs::read_to_string(&path).ctx(path.display())?;
    let line = text.lines().nth(usize::from(bar)).unwrap_or_default();
    let f: Vec<u64> = line.split_whitespace().flat_map(parse_num).collect();
    match f[..] {
        [start, end, flags] if start != 0 && end > start && flags & 0x200 != 0 => {
            Ok((start, end - start + 1))
        }
        _ => Err(format!("{bdf} BAR {bar} is not an assigned memory BAR")),
    }
}

/// Enables the function and its memory decode (and bus mastering if `master`).
fn enable(bdf: &str, master: bool) -> Res<()> {
    if let Err(e) = std::fs::write(sysfs(bdf, "enable"), "1") {
        eprintln!("devlend-nvme-p2p: enabling {bdf}: {e} (continuing)");
    }
    let path = sysfs(bdf, "config");
    let cfg = open_rw(&path, 0)?;
    let mut b = [0u8; 2];
    cfg.read_exact_at(&mut b, 4).ctx(path.display())?;
    let old = u16::from_le_bytes(b);
    let new = old | 2 | if master { 4 } else { 0 };
    if new != old {
        let r = cfg.write_all_at(&new.to_le_bytes(), 4);
        r.ctx(path.display())?;
    }
    Ok(())
}

/// The PRP entries after PRP1 for a transfer of `bytes` at page-aligned `target`.
fn prp_list(target: u64, bytes: usize) -> Vec<u64> {
    (1..bytes / PAGE)
        .map(|k| target + (k * PAGE) as u64)
        .collect()
}

/// The LBA size of a namespace, from its Identify Namespace data.
fn lba_size(ns: &[u8]) -> Res<usize> {
    if ns.len() < 192 {
        return Err("short identify namespace data".into());
    }
    let o = 128 + 4 * usize::from(ns[26] & 0xf);
    let lbaf = u32::from_le_bytes([ns[o], ns[o + 1], ns[o + 2], ns[o + 3]]);
    let lbads = lbaf >> 16 & 0xff;
    if ns[26] & 0x10 != 0 && lbaf & 0xffff != 0 {
        return Err("extended-LBA metadata formats are not supported".into());
    }
    if !(9..=16).contains(&lbads) {
        return Err(format!("namespace 1 is inactive or has LBADS {lbads}"));
    }
    Ok(1 << lbads)
}

/// Runs a Read of `bytes` at `slba` of namespace 1 of `src` into `target`, prints
/// its status and returns it (None on timeout); disables the controller afterwards.
fn p2p_read(src: &str, target: u64, slba: u64, bytes: usize) -> Res<Option<u16>> {
    if !target.is_multiple_of(PAGE as u64) {
        return Err(format!("target {target:#x} is not page-aligned"));
    }
    let mut c = Ctrl::init(src)?;
    let lba = lba_size(&c.identify(1, 0)?)?;
    if !bytes.is_multiple_of(lba) {
        return Err(format!("{bytes} bytes are not whole {lba}-byte blocks"));
    }
    let size = u32::from(QSIZE - 1) << 16 | 1;
    c.admin("create I/O CQ", 0x05, 3, [0, size, 0b11])?; // PC, IEN, vector 0.
    c.admin("create I/O SQ", 0x01, 2, [0, size, 1 | 1 << 16])?; // PC, CQ 1.
    let list = prp_list(target, bytes);
    let prp2 = match list[..] {
        [] => 0,
        [one] => one,
        _ => {
            for (i, e) in list.iter().enumerate() {
                c.dma.w32(PRPL * PAGE + i * 8, *e as u32);
                c.dma.w32(PRPL * PAGE + i * 8 + 4, (*e >> 32) as u32);
            }
            c.phys[PRPL]
        }
    };
    let mut cmd = [0u32; 16];
    (cmd[0], cmd[1], cmd[6], cmd[7]) = (0x02, 1, target as u32, (target >> 32) as u32);
    (cmd[8], cmd[9]) = (prp2 as u32, (prp2 >> 32) as u32);
    (cmd[10], cmd[11], cmd[12]) = (slba as u32, (slba >> 32) as u32, (bytes / lba - 1) as u32);
    let status = c.submit(1, cmd)?;
    match status {
        Some(s) => println!("DEVLEND-RESULT p2p_status={s:#06x}"),
        None => println!("DEVLEND-RESULT p2p_status=timeout"),
    }
    Ok(status)
}

/// Maps BAR `bar` of `bdf` (memory decode enabled), checking it holds `bytes`.
fn map_dst(bdf: &str, bar: u8, bytes: usize) -> Res<Map> {
    enable(bdf, false)?;
    let map = Map::bar(bdf, bar)?;
    if map.len < bytes {
        return Err(format!("{bdf} BAR {bar} is smaller than {bytes} bytes"));
    }
    Ok(map)
}

/// Posted BAR writes between two reads of a fill: each is one round trip from the
/// compute agent to the lender (a TCG guest in the tests), so 1,024 of them take well
/// under QEMU's 5 s wait for a read's reply; 16,384 in a row once outlasted it, and the
/// function was reset under the fill (its CMB then read all-ones).
const FLUSH_EVERY: usize = 1024;

/// Waits until the word at `off` of `map` reads `word`, the last of a series of writes.
///
/// BAR writes are posted (QEMU's vfio-user client sends them without waiting for a
/// reply), so some may still be on their way when another controller's DMA lands in
/// the BAR: a read of the same BAR is answered only after all of them, as a driver
/// flushes posted writes on PCIe. Behind thousands of writes the read can outlast the
/// client's wait for a reply, and then reads all-ones: it is read again.
fn flush(map: &Map, off: usize, word: u32) -> Res<()> {
    let deadline = Instant::now() + MIN_TIMEOUT;
    loop {
        let got = map.r32(off);
        if got == word {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the BAR's word at {off:#x} reads {got:#x}, not {word:#x}"
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Reads `bytes` at the start of `map` and prints their hash, head and each page's
/// hash (for a test to name the pages that differ).
fn dump(map: &Map, bytes: usize, key: &str) {
    let words = (0..bytes / 4).map(|i| map.r32(i * 4));
    let data: Vec<u8> = words.flat_map(u32::to_le_bytes).collect();
    println!("DEVLEND-RESULT {key}_hash={:016x}", fnv1a(&data));
    println!("DEVLEND-RESULT {key}_head={}", head(&data));
    println!("DEVLEND-RESULT {key}_pages={}", pages(&data));
}

/// Each page's FNV-1a hash (low 32 bits, hex), comma-separated.
fn pages(data: &[u8]) -> String {
    let hashes: Vec<String> = data
        .chunks(PAGE)
        .map(|p| format!("{:08x}", fnv1a(p) as u32))
        .collect();
    hashes.join(",")
}

fn fnv1a(data: &[u8]) -> u64 {
    let step = |h: u64, b: &u8| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
    data.iter().fold(0xcbf2_9ce4_8422_2325, step)
}

fn head(data: &[u8]) -> String {
    let shown = |b: &u8| {
        if (0x20..0x7f).contains(b) {
            char::from(*b)
        } else {
            '.'
        }
    };
    data.iter().take(32).map(shown).collect()
}

fn run(cmd: Cmd) -> Res<i32> {
    match cmd {
        Cmd::Read(src, dst, bar, slba, bytes) => {
            let (addr, _) = bar_range(&dst, bar)?;
            println!("DEVLEND-RESULT cmb_addr={addr:#x}");
            let map = map_dst(&dst, bar, bytes)?;
            if p2p_read(&src, addr, slba, bytes)? != Some(0) {
                return Ok(1);
            }
            dump(&map, bytes, "p2p");
        }
        Cmd::ReadAt(src, addr, slba, bytes) => {
            if p2p_read(&src, addr, slba, bytes)?.is_none() {
                return Ok(1);
            }
        }
        Cmd::Fill(dst, bar, bytes, val) => {
            let map = map_dst(&dst, bar, bytes)?;
            let word = u32::from_ne_bytes([val; 4]);
            // A read after every FLUSH_EVERY writes: no read waits behind more posted
            // writes than the VMM's wait for a reply covers ([`flush`]).
            for start in (0..bytes / 4).step_by(FLUSH_EVERY) {
                let end = (start + FLUSH_EVERY).min(bytes / 4);
                (start..end).for_each(|i| map.w32(i * 4, word));
                flush(&map, (end - 1) * 4, word)?;
            }
            println!("DEVLEND-RESULT fill=ok");
        }
        Cmd::Dump(dst, bar, bytes) => dump(&map_dst(&dst, bar, bytes)?, bytes, "dump"),
    }
    Ok(0)
}

/// A number in decimal, or in hex with a `0x` prefix.
fn parse_num(s: &str) -> Res<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16).ctx(format!("bad number {s:?}")),
        None => s.parse().ctx(format!("bad number {s:?}")),
    }
}

fn parse(args: &[String]) -> Res<Cmd> {
    let bar = |s: &str| match parse_num(s)? {
        b @ 0..=5 => Ok(b as u8),
        _ => Err(format!("bad BAR {s:?}")),
    };
    let n = |s: &str| match usize::try_from(parse_num(s)?) {
        Ok(b) if b > 0 && b <= MAX_BYTES && b.is_multiple_of(PAGE) => Ok(b),
        _ => Err(format!("BYTES must be a multiple of {PAGE} to {MAX_BYTES}")),
    };
    let num = parse_num;
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    Ok(match a[..] {
        ["read", s, d, b, l, c] => Cmd::Read(s.into(), d.into(), bar(b)?, num(l)?, n(c)?),
        ["read-at", s, addr, l, c] => Cmd::ReadAt(s.into(), num(addr)?, num(l)?, n(c)?),
        ["fill", d, b, c, v] => {
            let val = v.parse().ctx(format!("bad BYTEVAL {v:?}"))?;
            Cmd::Fill(d.into(), bar(b)?, n(c)?, val)
        }
        ["dump", d, b, c] => Cmd::Dump(d.into(), bar(b)?, n(c)?),
        _ => return Err("wrong arguments".into()),
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match parse(&args) {
        Err(e) => {
            eprintln!("devlend-nvme-p2p: {e}\n{USAGE}");
            2
        }
        Ok(cmd) => run(cmd).unwrap_or_else(|e| {
            println!("DEVLEND-RESULT error={e}");
            1
        }),
    };
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_and_head() {
        assert_eq!(fnv1a(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a(b""), 0xcbf29ce484222325);
        assert_eq!(head(b"AB\0\n z\xff"), "AB.. z.");
        let two = [vec![b'a'; PAGE], vec![0; PAGE]].concat();
        let (a, z) = (fnv1a(&two[..PAGE]) as u32, fnv1a(&two[PAGE..]) as u32);
        assert_eq!(pages(&two), format!("{a:08x},{z:08x}"));
    }

    #[test]
    fn prps() {
        assert!(prp_list(0x8000_0000, 4096).is_empty());
        assert_eq!(prp_list(0x8000_0000, 8192), vec![0x8000_1000]);
        let l = prp_list(0xfe00_0000, 65536);
        assert_eq!((l.len(), l[0], l[14]), (15, 0xfe00_1000, 0xfe00_f000));
    }

    #[test]
    fn lba_sizes() {
        let mut ns = vec![0u8; 4096];
        assert!(lba_size(&ns).is_err()); // Inactive namespace: all zeros.
        ns[26] = 1; // FLBAS: format 1.
        ns[128..132].copy_from_slice(&(9u32 << 16).to_le_bytes());
        ns[132..136].copy_from_slice(&(12u32 << 16).to_le_bytes());
        assert_eq!(lba_size(&ns), Ok(4096));
        ns[26] = 0;
        assert_eq!(lba_size(&ns), Ok(512));
        assert!(lba_size(&ns[..100]).is_err());
    }

    #[test]
    fn args() {
        let v = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        let ok = parse(&v("read-at 0000:00:04.0 0xfe000000 8 12288"));
        assert!(matches!(ok, Ok(Cmd::ReadAt(_, 0xfe00_0000, 8, 12288))));
        assert!(parse(&v("dump 0000:00:05.0 2 1000")).is_err());
        assert!(parse(&v("fill 0000:00:05.0 2 4096 256")).is_err());
        assert!(parse(&v("dump 0000:00:05.0 6 4096")).is_err());
    }
}
