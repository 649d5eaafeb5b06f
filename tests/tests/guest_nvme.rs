//! An NVMe SSD lent through the NVMe mediator (coherence mode `nvme`, `docs/nvme.md`):
//! the lender runs inside a QEMU TCG guest with intel-iommu and QEMU's emulated `nvme`
//! (backed by an image file on the host) bound to vfio-pci; its port is forwarded to the
//! host's loopback. On the host, devlend's borrower serves vfio-user, and the
//! `vfio_user` crate's `Client` acts as a userspace NVMe driver on "guest memory" (a
//! memfd mapped with DMA_MAP):
//! - enables the controller with admin queues in guest memory (AQA, ASQ, ACQ, CC.EN);
//! - IDENTIFY controller (QEMU's 1b36 vendor, the serial, what the mediator restricts:
//!   MDTS, OACS, SGLS) and namespace (its size is the image's);
//! - creates an I/O completion queue (MSI-X vector 1) and submission queue;
//! - WRITEs 16 KiB through a PRP list of scattered pages, FLUSH, READs it back into
//!   other pages (PRP 1 with an offset and PRP 2), and compares; the interrupt comes
//!   after the completion entry is in guest memory;
//! - has malformed commands refused with their NVMe status, never reaching the
//!   controller: a misaligned PRP 1 and PRP list entry (PRP Offset Invalid), PRPs
//!   outside the DMA maps (Data Transfer Error), a transfer over MDTS (Invalid Field),
//!   unknown admin and I/O opcodes (Invalid Command Opcode); then I/O still works;
//! - counts the fabric messages and bytes per 4 KiB READ and WRITE (docs/performance.md);
//! - refuses an I/O CQ outside the DMA maps and an SQ on a missing CQ, deletes the I/O
//!   queue pair, resets the controller (CC.EN 1 → 0 → 1) and IDENTIFYs again;
//! - and the image file on the host holds the written pattern;
//! - then on the raw fabric: a borrower that refuses the lender's read of a command's
//!   data gets that command failed (Data Transfer Error), one that sends a guest memory
//!   message itself ends its session, and the function, quiesced, works for the next.
//!
//! Why this file is over 600 lines: a test file with one test, so that every check runs on
//! one boot of the lender's QEMU TCG guest (the test waits up to 240 s for it to listen):
//! `scenario` (about 420 lines) as a userspace NVMe driver, then `fabric` on the raw fabric
//! (with `Raw` and `FakeGuest`, about 200 lines).

use devlend_tests::shared_libraries as libs;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use devlend_backend::pci::{GuestMemory, LinkError, LinkTarget, PciBorrower, PciHandle, PciLink};
use devlend_fabric::pci::{
    Access, DmaRange, IrqAction, IrqSet, Message, INFO_MEDIATED, KIND_DMA_MAP, KIND_MEM_WRITE,
    KIND_READ, KIND_SET_IRQS, KIND_WRITE,
};
use devlend_qemu::guest::Guest;
use devlend_tests::nvme::{
    sqe, Driver, ACQ, ASQ, BAR0, CONFIG, DATA, IDENT, IOCQ, IOSQ, IOVA, IO_ENTRIES, LIST,
};
use vfio_bindings::bindings::vfio::VFIO_PCI_MSIX_IRQ_INDEX;

/// The image: 8 MiB.
const IMAGE: u64 = 8 << 20;

fn bin(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/release")
        .join(name)
}

const SCRIPT: &str = r#"
set -e
devlend-modprobe vfio vfio_iommu_type1 vfio_virqfd irqbypass vfio_pci_core vfio_pci
ip link set lo up
ip addr add 10.0.2.15/24 dev eth0
ip link set eth0 up
BDF=
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/class)" = 0x010802 ]; then BDF=$(basename $d); fi
done
[ -n "$BDF" ] || { echo "no NVMe controller"; exit 1; }
echo vfio-pci > /sys/bus/pci/devices/$BDF/driver_override
echo $BDF > /sys/bus/pci/drivers_probe
echo "DEVLEND-RESULT bdf=$BDF"
devlend-device-agent --listen 0.0.0.0:7700 --insecure --device ssd0=pci:$BDF --log-level info 2>&1 | sed 's/^/lender: /' &
sleep 100000
"#;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Boots the lender's guest with an emulated NVMe on `image`.
pub fn boot_lender(port: u16, image: &Path, memory_mib: u32) -> Guest {
    let agent = bin("devlend-device-agent");
    assert!(
        agent.exists(),
        "{} is missing: cargo build --release -p devlend-device-agent",
        agent.display()
    );
    let mut b = Guest::builder()
        .name("nvme-lender")
        .memory_mib(memory_mib)
        .kernel_arg("intel_iommu=on iommu=pt")
        .args([
            "-machine".to_string(),
            "kernel-irqchip=split".to_string(),
            "-device".to_string(),
            "intel-iommu,intremap=on,caching-mode=on".to_string(),
            "-drive".to_string(),
            format!("file={},if=none,id=nv0,format=raw", image.display()),
            "-device".to_string(),
            "nvme,serial=lend0,drive=nv0".to_string(),
            "-nic".to_string(),
            format!("user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:{port}-:7700"),
        ])
        .script(SCRIPT)
        .host_file("/bin/devlend-device-agent", &agent);
    let mut files = libs(&agent);
    files.push("/lib64/ld-linux-x86-64.so.2".into());
    files.sort();
    files.dedup();
    for f in files {
        b = b.host_file(f.clone(), f);
    }
    b.boot().expect("boot the lender's guest")
}

/// Connects a borrower to the lender at `port`, retrying while it starts.
fn connect(port: u16) -> PciBorrower {
    let target = LinkTarget {
        lender: format!("127.0.0.1:{port}"),
        device: "ssd0".into(),
        borrower: [7; 16],
        token: Vec::new(),
        tls: None,
        timeout: Duration::from_secs(10),
        transport: devlend_fabric::transport::Transport::Tcp,
        lender_key: None,
        holder: None,
    };
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        match PciBorrower::connect(&target) {
            Ok(b) => return b,
            Err(e) if Instant::now() < until => {
                eprintln!("borrower: {}; retrying", devlend_fabric::error::chain(&e));
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => panic!("borrower: {}", devlend_fabric::error::chain(&e)),
        }
    }
}

#[test]
fn nvme_is_lent_through_the_mediator_to_a_userspace_driver() {
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("nvme.img");
    std::fs::write(&image, vec![0u8; IMAGE as usize]).expect("the image");
    let port = free_port();
    let mut lender = boot_lender(port, &image, 512);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lender
            .wait_for_text("listening", Duration::from_secs(240))
            .expect("the lender listens");
        scenario(port, dir.path(), &image);
        fabric(port);
    }));
    for l in lender.console().lines().filter(|l| l.contains("lender: ")) {
        eprintln!("{l}");
    }
    lender.kill();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

fn serve(borrower: PciBorrower, sock: &Path) -> PciHandle {
    let server = borrower.listen(sock).expect("listen");
    let handle = borrower.handle();
    let mut b = borrower;
    std::thread::spawn(move || b.serve(&server));
    handle
}

fn scenario(port: u16, dir: &Path, image: &Path) {
    let borrower = connect(port);
    let sock = dir.join("nvme.sock");
    let handle = serve(borrower, &sock);
    assert!(
        handle.mediated(),
        "an NVMe controller is mediated by default"
    );

    let mut d = devlend_tests::nvme::join(&sock);
    let mut b = [0u8; 4];
    d.client.region_read(CONFIG, 0, &mut b).expect("config");
    assert_eq!(
        u16::from_le_bytes([b[0], b[1]]),
        0x1b36,
        "QEMU's NVMe vendor"
    );
    d.client.region_read(CONFIG, 8, &mut b).expect("class");
    assert_eq!(u32::from_le_bytes(b) >> 8, 0x010802, "class code NVMe");

    // Enable (NVMe Base 2.0 §3.5.1).
    let cap_lo = d.r32(0);
    eprintln!("CAP {cap_lo:#x}, VS {:#x}", d.r32(8));
    d.enable();
    assert_eq!(
        d.r32(0x28),
        (IOVA + ASQ) as u32,
        "ASQ reads back as written"
    );

    // IDENTIFY controller and namespace.
    d.ok(
        false,
        sqe(0x06, 0, IOVA + IDENT, 0, [1, 0, 0, 0, 0, 0]),
        "identify controller",
    );
    let id = d.mem.read(IDENT, 4096);
    eprintln!(
        "identify: MDTS {}, OACS {:#x}, ONCS {:#x}",
        id[77],
        u16::from_le_bytes([id[256], id[257]]),
        u16::from_le_bytes([id[520], id[521]])
    );
    assert_eq!(u16::from_le_bytes([id[0], id[1]]), 0x1b36, "Identify VID");
    assert_eq!(&id[4..9], b"lend0", "the serial");
    assert!(
        id[77] != 0 && id[77] <= 5,
        "MDTS at most 128 KiB: {}",
        id[77]
    );
    assert_eq!(u16::from_le_bytes([id[256], id[257]]), 0, "OACS cleared");
    assert_eq!(&id[536..540], &[0; 4], "no SGLs");
    d.ok(
        false,
        sqe(0x06, 1, IOVA + IDENT, 0, [0, 0, 0, 0, 0, 0]),
        "identify namespace",
    );
    let ns = d.mem.read(IDENT, 4096);
    let nsze = u64::from_le_bytes(ns[0..8].try_into().expect("8 bytes"));
    let lbaf = ns[26] & 0xf;
    let lbads = ns[128 + 4 * lbaf as usize + 2];
    let lba = 1u64 << lbads;
    assert_eq!(
        nsze * lba,
        IMAGE,
        "the namespace is the image ({nsze} blocks of {lba})"
    );

    // Number of queues, then an I/O queue pair on vector 1.
    let nq = d.create_io_queue();
    eprintln!("queues granted: {:#x}", nq.dw0);

    // WRITE 16 KiB at LBA 8 from four scattered pages through a PRP list.
    let pattern: Vec<u8> = (0..16384u32)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add((i >> 9) as u8))
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
    let slba = 8u32;
    d.ok(
        true,
        sqe(
            0x01,
            1,
            IOVA + pages[0],
            IOVA + LIST,
            [slba, 0, nlb, 0, 0, 0],
        ),
        "write 16 KiB",
    );
    d.ok(true, sqe(0x00, 1, 0, 0, [0; 6]), "flush");
    // READ it back: 2 KiB, then 14 KiB (PRP 1 at an offset, then a list).
    let rd = DATA + 0x10_000;
    d.mem.write(rd, &vec![0u8; 0x5000]);
    d.ok(
        true,
        sqe(
            0x02,
            1,
            IOVA + rd + 0x800,
            0,
            [slba, 0, (2048 / lba - 1) as u32, 0, 0, 0],
        ),
        "read 2 KiB",
    );
    assert_eq!(
        d.mem.read(rd + 0x800, 2048),
        &pattern[..2048],
        "the first 2 KiB"
    );
    let list2: Vec<u8> = [rd + 0x2000, rd + 0x3000, rd + 0x4000]
        .iter()
        .flat_map(|p| (IOVA + p).to_le_bytes())
        .collect();
    d.mem.write(LIST + 0x100, &list2);
    let slba2 = slba + (2048 / lba) as u32;
    d.ok(
        true,
        sqe(
            0x02,
            1,
            IOVA + rd + 0x1800,
            IOVA + LIST + 0x100,
            [slba2, 0, (14336 / lba - 1) as u32, 0, 0, 0],
        ),
        "read 14 KiB",
    );
    let mut back = d.mem.read(rd + 0x1800, 2048);
    back.extend(d.mem.read(rd + 0x2000, 12288));
    assert!(back == pattern[2048..], "the 14 KiB read back");

    // Malformed commands: refused with their status, never submitted.
    let sub = |d: &mut Driver, e| d.run(true, e).sc();
    let read4k =
        |p1: u64, p2: u64| sqe(0x02, 1, p1, p2, [slba, 0, (4096 / lba - 1) as u32, 0, 0, 0]);
    assert_eq!(
        sub(&mut d, read4k(IOVA + rd + 2, 0)),
        (0, 0x13),
        "misaligned PRP 1"
    );
    assert_eq!(
        sub(&mut d, read4k(IOVA + rd + 0x800, IOVA + rd + 0x2010)),
        (0, 0x13),
        "misaligned PRP 2"
    );
    d.mem.write(LIST + 0x200, &(IOVA + rd + 0x10).to_le_bytes());
    d.mem
        .write(LIST + 0x208, &(IOVA + rd + 0x3000).to_le_bytes());
    assert_eq!(
        sub(
            &mut d,
            sqe(
                0x02,
                1,
                IOVA + rd,
                IOVA + LIST + 0x200,
                [slba, 0, (12288 / lba - 1) as u32, 0, 0, 0]
            )
        ),
        (0, 0x13),
        "a misaligned PRP list entry"
    );
    assert_eq!(
        sub(&mut d, read4k(0x7000_0000, 0)),
        (0, 0x04),
        "PRP 1 outside the DMA maps"
    );
    d.mem.write(LIST + 0x300, &0x7000_0000u64.to_le_bytes());
    d.mem.write(LIST + 0x308, &0x7000_1000u64.to_le_bytes());
    assert_eq!(
        sub(
            &mut d,
            sqe(
                0x02,
                1,
                IOVA + rd,
                IOVA + LIST + 0x300,
                [slba, 0, (12288 / lba - 1) as u32, 0, 0, 0]
            )
        ),
        (0, 0x04),
        "a PRP list pointing outside the DMA maps"
    );
    assert_eq!(
        sub(
            &mut d,
            sqe(
                0x02,
                1,
                IOVA + rd,
                0x7000_0000,
                [slba, 0, (12288 / lba - 1) as u32, 0, 0, 0]
            )
        ),
        (0, 0x04),
        "a PRP list outside the DMA maps"
    );
    assert_eq!(
        sub(
            &mut d,
            sqe(
                0x02,
                1,
                IOVA + rd,
                IOVA + LIST,
                [slba, 0, (256 * 1024 / lba - 1) as u32, 0, 0, 0]
            )
        ),
        (0, 0x02),
        "a transfer over MDTS (a PRP list too long)"
    );
    assert_eq!(
        sub(&mut d, sqe(0x7e, 1, 0, 0, [0; 6])),
        (0, 0x01),
        "an unknown I/O opcode"
    );
    assert_eq!(
        d.run(false, sqe(0x80, 0xffff_ffff, 0, 0, [0; 6])).sc(),
        (0, 0x01),
        "Format NVM is not mediated"
    );
    assert_eq!(
        d.run(false, sqe(0x7c, 0, IOVA, IOVA + 0x1000, [0; 6])).sc(),
        (0, 0x01),
        "Doorbell Buffer Config is not mediated"
    );
    assert_eq!(
        d.run(false, sqe(0x09, 0, 0, 0, [0x0d, 1, 0, 0, 0, 0])).sc(),
        (0, 0x02),
        "a host memory buffer is refused"
    );
    // The refusals did not reach the controller: the SQ head it reports follows the
    // guest's queue, and I/O goes on.
    let done = d.ok(true, read4k(IOVA + rd, 0), "a read after the refusals");
    assert_eq!(done.sqhd, d.io.as_ref().map_or(0, |q| q.tail), "SQ head");
    assert_eq!(d.mem.read(rd, 4096), &pattern[..4096]);

    // Fabric cost per 4 KiB command.
    let c = handle.link_counters();
    let snap = || {
        (
            c.msgs_sent.load(Ordering::Relaxed) + c.msgs_received.load(Ordering::Relaxed),
            c.bytes_sent.load(Ordering::Relaxed) + c.bytes_received.load(Ordering::Relaxed),
        )
    };
    const N: u64 = 8;
    let before = snap();
    for i in 0..N {
        d.mem.write(DATA + 0x8000, &pattern[..4096]);
        d.ok(
            true,
            sqe(
                0x01,
                1,
                IOVA + DATA + 0x8000,
                0,
                [64 + 8 * i as u32, 0, (4096 / lba - 1) as u32, 0, 0, 0],
            ),
            "4 KiB write",
        );
    }
    let mid = snap();
    for i in 0..N {
        d.ok(
            true,
            sqe(
                0x02,
                1,
                IOVA + DATA + 0x9000,
                0,
                [64 + 8 * i as u32, 0, (4096 / lba - 1) as u32, 0, 0, 0],
            ),
            "4 KiB read",
        );
        assert_eq!(d.mem.read(DATA + 0x9000, 4096), &pattern[..4096]);
    }
    let after = snap();
    let per = |a: (u64, u64), b: (u64, u64)| {
        ((b.0 - a.0) as f64 / N as f64, (b.1 - a.1) as f64 / N as f64)
    };
    let (wm, wb) = per(before, mid);
    let (rm, rb) = per(mid, after);
    eprintln!("FABRIC-COST 4k-write msgs={wm} bytes={wb}");
    eprintln!("FABRIC-COST 4k-read msgs={rm} bytes={rb}");
    assert!(
        (4096.0..4096.0 + 512.0).contains(&wb),
        "a 4 KiB write moves its 4 KiB once: {wb}"
    );
    assert!(
        (4096.0..4096.0 + 512.0).contains(&rb),
        "a 4 KiB read moves its 4 KiB once: {rb}"
    );

    // Queue management through the mediator: an I/O CQ outside the DMA maps is
    // refused; the I/O queue pair is deleted (SQ first), and its id can be created
    // again.
    assert_eq!(
        d.run(
            false,
            sqe(
                0x05,
                0,
                0x7000_0000,
                0,
                [u32::from(IO_ENTRIES - 1) << 16 | 2, 1 << 16 | 3, 0, 0, 0, 0]
            )
        )
        .sc(),
        (0, 0x04),
        "an I/O CQ outside the DMA maps"
    );
    assert_eq!(
        d.run(
            false,
            sqe(
                0x01,
                0,
                IOVA + IOSQ + 0x1000,
                0,
                [u32::from(IO_ENTRIES - 1) << 16 | 2, 9 << 16 | 1, 0, 0, 0, 0]
            )
        )
        .sc(),
        (1, 0x00),
        "an I/O SQ on a CQ that does not exist"
    );
    d.ok(
        false,
        sqe(0x00, 0, 0, 0, [1, 0, 0, 0, 0, 0]),
        "delete I/O SQ",
    );
    d.ok(
        false,
        sqe(0x04, 0, 0, 0, [1, 0, 0, 0, 0, 0]),
        "delete I/O CQ",
    );
    assert_eq!(
        d.run(false, sqe(0x00, 0, 0, 0, [1, 0, 0, 0, 0, 0])).sc(),
        (1, 0x01),
        "deleting it twice"
    );

    // Controller reset (CC.EN 1 -> 0 -> 1): the mediator drops its queues and shadows
    // new admin queues; the controller answers again.
    d.w32(0x14, 0);
    d.wait_rdy(false);
    d.mem.write(ACQ, &[0u8; 4096]);
    d.admin.tail = 0;
    d.admin.head = 0;
    d.admin.phase = true;
    let _ = d.admin.irq.read();
    d.w32(0x14, 1 | 6 << 16 | 4 << 20);
    d.wait_rdy(true);
    d.mem.write(IDENT, &[0u8; 4096]);
    d.ok(
        false,
        sqe(0x06, 0, IOVA + IDENT, 0, [1, 0, 0, 0, 0, 0]),
        "identify after a reset",
    );
    assert_eq!(
        &d.mem.read(IDENT + 4, 5),
        b"lend0",
        "the serial after a reset"
    );
    // I/O right after the reset, before the namespace is identified again (Linux's
    // order after a reset): the mediator still knows the namespace's block size.
    d.mem.write(IOCQ, &[0u8; 4096]);
    d.create_io_queue();
    let again = DATA + 0x18_000;
    d.mem.write(again, &[0u8; 4096]);
    d.ok(
        true,
        sqe(
            0x02,
            1,
            IOVA + again,
            0,
            [slba, 0, (4096 / lba - 1) as u32, 0, 0, 0],
        ),
        "read after a reset, before IDENTIFY namespace",
    );
    assert_eq!(
        d.mem.read(again, 4096),
        &pattern[..4096],
        "the data read right after a reset"
    );

    // The image on the lender's side holds the pattern.
    let img = std::fs::read(image).expect("read the image");
    let at = (slba as u64 * lba) as usize;
    assert!(
        img[at..at + 16384] == pattern[..],
        "the image holds the written pattern"
    );
    let at = (64 * lba) as usize;
    assert!(
        img[at..at + 4096] == pattern[..4096],
        "and the 4 KiB writes"
    );
    eprintln!(
        "borrower: region reads {}, writes {}",
        handle.stats().reads.load(Ordering::Relaxed),
        handle.stats().writes.load(Ordering::Relaxed)
    );
    // The VMM leaves, then the borrower: the lender quiesces the function.
    drop(d);
    handle.disconnect();
}

/// Guest memory of a borrower on the raw fabric: 1 MiB at [`IOVA`] with a range whose
/// reads the borrower refuses, as a borrower whose maps changed under the lender would.
struct FakeGuest {
    mem: Mutex<Vec<u8>>,
    refused: std::ops::Range<u64>,
}

impl GuestMemory for FakeGuest {
    fn mediated(&self) -> bool {
        true
    }

    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), String> {
        let end = iova + buf.len() as u64;
        if iova < self.refused.end && self.refused.start < end {
            return Err("refused by the test".into());
        }
        let m = self.mem.lock().expect("memory");
        let o = iova.checked_sub(IOVA).ok_or("below")? as usize;
        buf.copy_from_slice(m.get(o..o + buf.len()).ok_or("past the end")?);
        Ok(())
    }

    fn write(&self, iova: u64, data: &[u8]) -> Result<(), String> {
        let mut m = self.mem.lock().expect("memory");
        let o = iova.checked_sub(IOVA).ok_or("below")? as usize;
        m.get_mut(o..o + data.len())
            .ok_or("past the end")?
            .copy_from_slice(data);
        Ok(())
    }
}

/// A borrower's session on the raw fabric to the mediated controller.
struct Raw {
    link: PciLink,
    irqs: std::sync::mpsc::Receiver<devlend_fabric::pci::Irq>,
    guest: Arc<FakeGuest>,
    tail: u16,
}

impl Raw {
    fn connect(port: u16) -> Raw {
        let guest = Arc::new(FakeGuest {
            mem: Mutex::new(vec![0; 0x10_0000]),
            refused: IOVA + 0x8_0000..IOVA + 0x9_0000,
        });
        let target = LinkTarget {
            lender: format!("127.0.0.1:{port}"),
            device: "ssd0".into(),
            borrower: [8; 16],
            token: Vec::new(),
            tls: None,
            timeout: Duration::from_secs(10),
            transport: devlend_fabric::transport::Transport::Tcp,
            lender_key: None,
            holder: None,
        };
        let until = Instant::now() + Duration::from_secs(60);
        let (link, info, irqs) = loop {
            match PciLink::connect(&target, Arc::clone(&guest) as Arc<dyn GuestMemory>) {
                Ok(l) => break l,
                Err(e) if Instant::now() < until => {
                    eprintln!("raw borrower: {}", devlend_fabric::error::chain(&e));
                    std::thread::sleep(Duration::from_millis(300));
                }
                Err(e) => panic!("raw borrower: {}", devlend_fabric::error::chain(&e)),
            }
        };
        assert_ne!(info.flags & INFO_MEDIATED, 0, "the lender mediates");
        Raw {
            link,
            irqs,
            guest,
            tail: 0,
        }
    }

    fn write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), LinkError> {
        let mut p = Access {
            region,
            len: data.len() as u32,
            offset,
        }
        .encode();
        p.extend_from_slice(data);
        self.link.call(Message::new(KIND_WRITE, p)).map(drop)
    }

    fn r32(&self, offset: u64) -> u32 {
        let a = Access {
            region: BAR0,
            len: 4,
            offset,
        };
        let r = self
            .link
            .call(Message::new(KIND_READ, a.encode()))
            .expect("read");
        u32::from_le_bytes(r[0].payload[..4].try_into().expect("4 bytes"))
    }

    fn w32(&self, offset: u64, v: u32) {
        self.write(BAR0, offset, &v.to_le_bytes()).expect("write");
    }

    fn wait_rdy(&self, rdy: bool) {
        let until = Instant::now() + Duration::from_secs(60);
        while (self.r32(0x1c) & 1 == 1) != rdy {
            assert!(Instant::now() < until, "CSTS.RDY never became {rdy}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Maps the memory, enables MSI-X, bus mastering and the controller.
    fn enable(&mut self) {
        self.link
            .call(Message::new(
                KIND_DMA_MAP,
                DmaRange {
                    iova: IOVA,
                    size: 0x10_0000,
                }
                .encode(),
            ))
            .expect("DMA map");
        let set = IrqSet {
            index: VFIO_PCI_MSIX_IRQ_INDEX,
            action: IrqAction::Enable,
            count: 1,
        };
        self.link
            .call(Message::new(KIND_SET_IRQS, set.encode()))
            .expect("MSI-X");
        self.write(CONFIG, 4, &0x0006u16.to_le_bytes())
            .expect("bus mastering");
        self.w32(0x14, 0);
        self.wait_rdy(false);
        self.w32(0x24, 15 << 16 | 15);
        self.w32(0x28, (IOVA + ASQ) as u32);
        self.w32(0x2c, 0);
        self.w32(0x30, (IOVA + ACQ) as u32);
        self.w32(0x34, 0);
        self.w32(0x14, 1 | 6 << 16 | 4 << 20);
        self.wait_rdy(true);
    }

    /// Runs one admin command; returns its status (SCT, SC). The completion entry is in
    /// guest memory when the interrupt comes.
    fn admin(&mut self, e: [u8; 64]) -> (u16, u16) {
        let slot = self.tail;
        self.guest
            .write(IOVA + ASQ + u64::from(slot) * 64, &e)
            .expect("SQ entry");
        self.tail = (self.tail + 1) % 16;
        self.w32(0x1000, u32::from(self.tail));
        let irq = self
            .irqs
            .recv_timeout(Duration::from_secs(30))
            .expect("an interrupt");
        assert_eq!((irq.index, irq.vector), (VFIO_PCI_MSIX_IRQ_INDEX, 0));
        let mut c = [0u8; 16];
        self.guest
            .read(IOVA + ACQ + u64::from(slot) * 16, &mut c)
            .expect("CQ entry");
        let st = u16::from_le_bytes([c[14], c[15]]);
        assert_eq!(st & 1, 1, "the phase of the first pass");
        self.w32(0x1004, u32::from(self.tail));
        ((st >> 9) & 7, (st >> 1) & 0xff)
    }

    fn identify(&mut self) {
        assert_eq!(
            self.admin(sqe(0x06, 0, IOVA + IDENT, 0, [1, 0, 0, 0, 0, 0])),
            (0, 0),
            "identify"
        );
        let mut id = [0u8; 9];
        self.guest
            .read(IOVA + IDENT, &mut id)
            .expect("identify data");
        assert_eq!(&id[4..9], b"lend0", "the serial");
    }
}

/// The mediator on the raw fabric: a borrower that refuses the lender's read of a
/// command's data gets the command failed (Data Transfer Error); a borrower that
/// sends a guest memory message itself ends its session; the function is then
/// quiesced and lent again, and works.
fn fabric(port: u16) {
    let mut raw = Raw::connect(port);
    raw.enable();
    raw.identify();
    let refused = IOVA + 0x8_0000;
    assert_eq!(
        raw.admin(sqe(0x09, 0, refused, 0, [0x0e, 0, 0, 0, 0, 0])),
        (0, 0x04),
        "Set Features Timestamp whose data the borrower refuses"
    );
    raw.identify();
    let bogus = Message::new(KIND_MEM_WRITE, Vec::new());
    match raw.link.call(bogus) {
        Err(LinkError::Closed | LinkError::Send(_)) => {}
        other => panic!("a guest memory message from the borrower: {other:?}"),
    }
    drop(raw);
    let mut again = Raw::connect(port);
    again.enable();
    again.identify();
}
