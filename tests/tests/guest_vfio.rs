//! PCIe lending on real VFIO with a real device model: the lender runs inside a QEMU
//! TCG guest with a virtual IOMMU (intel-iommu) and QEMU's `edu` device (PCI 1234:11e8,
//! QEMU `docs/specs/edu.rst`) bound to vfio-pci; its port is forwarded to the host's
//! loopback. On the host, the borrower (devlend's vfio-user server) joins it, and the
//! `vfio_user` crate's `Client` acts as the VMM:
//! - reads the config space (1234:11e8) and the edu ID register (0x010000ed);
//! - has the card compute 10! with its interrupt (MSI), delivered to an eventfd;
//! - has the DMA engine copy a page from "guest" memory (a memfd mapped with DMA_MAP)
//!   into the card and back to another address, and checks the bytes: that is the
//!   mirror's push before the doorbell and its pull before the interrupt.
//!
//! A lent e1000e (same guest) covers what edu lacks: its port I/O BAR reads the STATUS
//! register as BAR0 does, and an interrupt cause set through ICS arrives on the MSI-X
//! vector its IVAR names (two vectors in turn), and on no other.
//!
//! Then, on the same guest: bad requests are refused and the lender goes on (a region
//! index out of range, an offset past a BAR, a DMA map overlapping a mapped one, at the
//! vfio-user socket and on the fabric; a malformed fabric message closes that session
//! only); a second borrower is refused while the first holds the function; a borrower
//! that disconnects mid-DMA leaves the lender able to lend the function again, which
//! then computes and copies correctly for the next borrower.
//!
//! Why this file is over 600 lines: a test file with one test, so that every check runs on
//! one boot of the lender's QEMU TCG guest (the test waits up to 240 s for it to listen):
//! the e1000e checks (about 120 lines), then `scenario` (about 330 lines) with edu, the bad
//! requests, a second borrower and a borrower that leaves mid-DMA.

use devlend_tests::shared_libraries as libs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use devlend_backend::pci::{
    LinkError, LinkTarget, NoGuestMemory, PciBorrower, PciError, PciHandle, PciLink,
};
use devlend_fabric::pci::{DmaRange, Message, PciStatus, KIND_DMA_MAP, KIND_READ};
use devlend_fabric::HelloStatus;
use devlend_qemu::guest::Guest;
use devlend_tests::edu::{
    Memory, Vmm, BAR0, CONFIG, DMA_CMD, DMA_COUNT, DMA_DST, DMA_SRC, EDU_BUF, GUEST_MEM, ID, IOVA,
};
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_PCI_MSIX_IRQ_INDEX,
};
use vfio_user::Client;
use vmm_sys_util::eventfd::EventFd;

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
  if [ "$(cat $d/vendor)" = 0x1234 ] && [ "$(cat $d/device)" = 0x11e8 ]; then BDF=$(basename $d); fi
done
[ -n "$BDF" ] || { echo "no edu device"; exit 1; }
echo vfio-pci > /sys/bus/pci/devices/$BDF/driver_override
echo $BDF > /sys/bus/pci/drivers_probe
echo "DEVLEND-RESULT bdf=$BDF group=$(basename $(readlink /sys/bus/pci/devices/$BDF/iommu_group))"
NIC=
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/vendor)" = 0x8086 ] && [ "$(cat $d/device)" = 0x10d3 ]; then NIC=$(basename $d); fi
done
[ -n "$NIC" ] || { echo "no e1000e device"; exit 1; }
echo vfio-pci > /sys/bus/pci/devices/$NIC/driver_override
echo $NIC > /sys/bus/pci/drivers_probe
ls /dev/vfio
devlend-device-agent --listen 0.0.0.0:7700 --insecure --device edu=pci:$BDF --device nic0=pci:$NIC --log-level info 2>&1 | sed 's/^/lender: /' &
sleep 100000
"#;

/// A free TCP port on the host's loopback (for the forward).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn boot(port: u16) -> Guest {
    let agent = bin("devlend-device-agent");
    assert!(
        agent.exists(),
        "{} is missing: cargo build --release -p devlend-device-agent",
        agent.display()
    );
    let mut b = Guest::builder()
        .name("vfio")
        .memory_mib(512)
        .kernel_arg("intel_iommu=on iommu=pt")
        .args([
            "-machine".to_string(),
            "kernel-irqchip=split".to_string(),
            "-device".to_string(),
            "intel-iommu,intremap=on,caching-mode=on".to_string(),
            "-device".to_string(),
            "edu".to_string(),
            // MSI-X and a port I/O BAR, which edu has not.
            "-device".to_string(),
            "e1000e,netdev=none0".to_string(),
            "-netdev".to_string(),
            "user,id=none0,restrict=on".to_string(),
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
    b.boot().expect("boot the guest")
}

fn target(port: u16, id: u8) -> LinkTarget {
    LinkTarget {
        lender: format!("127.0.0.1:{port}"),
        device: "edu".into(),
        borrower: [id; 16],
        token: Vec::new(),
        tls: None,
        timeout: Duration::from_secs(10),
        transport: devlend_fabric::transport::Transport::Tcp,
        lender_key: None,
        holder: None,
    }
}

/// Connects a borrower, retrying while the lender is still quiescing the function for
/// the previous one (Busy) or not yet listening.
fn connect(port: u16, id: u8) -> PciBorrower {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        match PciBorrower::connect(&target(port, id)) {
            Ok(b) => return b,
            Err(e) if Instant::now() < until => {
                eprintln!(
                    "borrower {id}: {}; retrying",
                    devlend_fabric::error::chain(&e)
                );
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => panic!("borrower {id}: {}", devlend_fabric::error::chain(&e)),
        }
    }
}

/// A borrower serving vfio-user on `sock` from its own thread.
fn serve(borrower: PciBorrower, sock: &Path) -> PciHandle {
    let _ = std::fs::remove_file(sock);
    let server = borrower.listen(sock).expect("listen");
    let handle = borrower.handle();
    let mut b = borrower;
    std::thread::spawn(move || b.serve(&server));
    handle
}

/// One raw vfio-user connection, for requests the `Client` cannot send or whose
/// refusals it cannot read.
struct Raw {
    s: UnixStream,
    id: u16,
    /// The errno of the last reply (0 when it was not an error).
    errno: u32,
}

impl Raw {
    fn join(sock: &Path) -> Raw {
        let mut r = Raw {
            s: UnixStream::connect(sock).expect("connect"),
            id: 0,
            errno: 0,
        };
        r.s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let json = b"{\"capabilities\":{\"max_msg_fds\":1,\"max_data_xfer_size\":1048576}}\0";
        let mut body = vec![0u8, 0, 1, 0]; // major 0, minor 1
        body.extend_from_slice(json);
        let (h, _) = r.call(1, &body, None);
        assert_eq!(h.3 & 0x20, 0, "version negotiation");
        r
    }

    /// Sends command `cmd` with `body`; returns the reply header (id, cmd, size,
    /// flags, error) and body.
    fn call(
        &mut self,
        cmd: u16,
        body: &[u8],
        fd: Option<RawFd>,
    ) -> ((u16, u16, u32, u32, u32), Vec<u8>) {
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        self.id += 1;
        let mut m = Vec::new();
        m.extend_from_slice(&self.id.to_le_bytes());
        m.extend_from_slice(&cmd.to_le_bytes());
        m.extend_from_slice(&((16 + body.len()) as u32).to_le_bytes());
        m.extend_from_slice(&0u32.to_le_bytes());
        m.extend_from_slice(&0u32.to_le_bytes());
        m.extend_from_slice(body);
        match fd {
            Some(fd) => {
                self.s.send_with_fd(&m[..], fd).expect("send with fd");
            }
            None => self.s.write_all(&m).expect("send"),
        }
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).expect("reply header");
        let u16_at = |o: usize| u16::from_le_bytes([h[o], h[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        let hdr = (u16_at(0), u16_at(2), u32_at(4), u32_at(8), u32_at(12));
        let mut rest = vec![0u8; (hdr.2 as usize).saturating_sub(16)];
        self.s.read_exact(&mut rest).expect("reply body");
        assert_eq!(hdr.0, self.id, "reply id");
        self.errno = if hdr.3 & 0x20 != 0 { hdr.4 } else { 0 };
        (hdr, rest)
    }

    fn region_read(&mut self, region: u32, off: u64, count: u32) -> Result<Vec<u8>, u32> {
        let mut b = Vec::new();
        b.extend_from_slice(&off.to_le_bytes());
        b.extend_from_slice(&region.to_le_bytes());
        b.extend_from_slice(&count.to_le_bytes());
        let (h, body) = self.call(9, &b, None);
        if h.3 & 0x20 != 0 {
            return Err(h.4);
        }
        Ok(body[16..].to_vec())
    }

    fn region_write(&mut self, region: u32, off: u64, data: &[u8]) -> Result<(), u32> {
        let mut b = Vec::new();
        b.extend_from_slice(&off.to_le_bytes());
        b.extend_from_slice(&region.to_le_bytes());
        b.extend_from_slice(&(data.len() as u32).to_le_bytes());
        b.extend_from_slice(data);
        let (h, _) = self.call(10, &b, None);
        if h.3 & 0x20 != 0 {
            return Err(h.4);
        }
        Ok(())
    }

    fn dma_map(&mut self, fd: RawFd, iova: u64, size: u64) -> bool {
        let mut b = Vec::new();
        b.extend_from_slice(&32u32.to_le_bytes()); // argsz
        b.extend_from_slice(&3u32.to_le_bytes()); // read | write
        b.extend_from_slice(&0u64.to_le_bytes()); // offset
        b.extend_from_slice(&iova.to_le_bytes());
        b.extend_from_slice(&size.to_le_bytes());
        let (h, _) = self.call(2, &b, Some(fd));
        h.3 & 0x20 == 0
    }
}

fn vendor_device(raw: &mut Raw) -> u32 {
    let b = raw.region_read(CONFIG, 0, 4).expect("config read");
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

#[test]
fn edu_is_lent_over_vfio_user_with_dma_kept_in_sync() {
    let port = free_port();
    let mut guest = boot(port);
    let dir = tempfile::tempdir().expect("tempdir");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        guest
            .wait_for_text("listening", Duration::from_secs(240))
            .expect("the lender listens in the guest");
        scenario(port, dir.path());
    }));
    let console = guest.console();
    for l in console
        .lines()
        .filter(|l| l.contains("lender: ") || l.contains("DEVLEND-RESULT"))
    {
        eprintln!("{l}");
    }
    guest.kill();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
    assert!(
        console.contains("request refused"),
        "the lender logs the requests it refused"
    );
    assert!(
        console.contains("protocol error"),
        "the lender logs why it closed the malformed session"
    );
    assert!(
        console.contains("function quiesced for the next borrower"),
        "the lender quiesced the function after a borrower left"
    );
}

/// e1000e (82574, QEMU's model): registers (e1000e datasheet §10) for its MSI-X and
/// port I/O checks.
mod e1000e {
    /// BAR0 (MMIO) registers.
    pub const STATUS: u64 = 0x08;
    pub const ICS: u64 = 0xc8;
    pub const IMS: u64 = 0xd0;
    pub const IMC: u64 = 0xd8;
    pub const IVAR: u64 = 0xe4;
    /// The I/O BAR: IOADDR selects a register, IODATA reads or writes it.
    pub const IOADDR: u64 = 0x0;
    pub const IODATA: u64 = 0x4;
    /// The "other" interrupt cause (ICR bit 24).
    pub const ICR_OTHER: u32 = 1 << 24;
    /// IVAR: the "other" cause's vector in bits 18:16, valid bit 19.
    pub fn ivar_other(vector: u32) -> u32 {
        (0x8 | vector) << 16
    }
}

/// Reads every eventfd until none has fired for 300 ms (at most 10 s): what the
/// device still had in flight arrives and is dropped.
fn drain_until_quiet(efds: &[EventFd]) {
    let until = Instant::now() + Duration::from_secs(10);
    let mut quiet_since = Instant::now();
    while Instant::now() < until && quiet_since.elapsed() < Duration::from_millis(300) {
        // Every eventfd is read (`filter`, not `any`, which would stop at the first).
        if efds.iter().filter(|e| e.read().is_ok()).count() > 0 {
            quiet_since = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// MSI-X and port I/O, on a lent e1000e: its I/O BAR reads the same STATUS register as
/// BAR0, and an interrupt cause set through ICS arrives on the MSI-X vector IVAR maps
/// it to, and on no other.
fn e1000e_msix_and_port_io(port: u16, dir: &Path) {
    let mut t = target(port, 11);
    t.device = "nic0".into();
    let b = PciBorrower::connect(&t).expect("borrow the e1000e");
    let info = b.info().clone();
    assert_eq!(info.regions[2].size, 32, "the I/O BAR (BAR2) of 32 bytes");
    let msix = info.irqs.get(2).map(|i| i.count).unwrap_or(0);
    assert!(msix >= 3, "e1000e reports its MSI-X vectors: {msix}");
    let sock = dir.join("nic0.sock");
    let handle = serve(b, &sock);
    let mut c = Client::new(&sock).expect("vfio-user client");
    let r32 = |c: &mut Client, region: u32, off: u64| {
        let mut v = [0u8; 4];
        c.region_read(region, off, &mut v).expect("read");
        u32::from_le_bytes(v)
    };
    let w32 = |c: &mut Client, region: u32, off: u64, v: u32| {
        c.region_write(region, off, &v.to_le_bytes())
            .expect("write")
    };
    assert_eq!(r32(&mut c, CONFIG, 0), 0x10d3_8086, "vendor and device ID");
    // Memory, I/O and bus mastering on (MSI-X messages are bus-master writes).
    let mut cmd = [0u8; 2];
    c.region_read(CONFIG, 4, &mut cmd).expect("command");
    let cmd = u16::from_le_bytes(cmd) | 0x07;
    c.region_write(CONFIG, 4, &cmd.to_le_bytes())
        .expect("command");
    let status = r32(&mut c, BAR0, e1000e::STATUS);
    w32(&mut c, 2, e1000e::IOADDR, e1000e::STATUS as u32);
    assert_eq!(
        r32(&mut c, 2, e1000e::IODATA),
        status,
        "STATUS through the port I/O BAR as through BAR0"
    );
    let efds: Vec<EventFd> = (0..msix)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"))
        .collect();
    let raw: Vec<RawFd> = efds.iter().map(|e| e.as_raw_fd()).collect();
    c.set_irqs(
        VFIO_PCI_MSIX_IRQ_INDEX,
        VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
        0,
        msix,
        &raw,
    )
    .expect("enable MSI-X");
    for (round, vector) in [(0, 2u32), (1, 1)] {
        // A cause can be signalled twice (the IMS write raises a cause already pending
        // in ICR, then the ICS write raises it again), and the second signal can cross
        // the fabric after the round read the first: wait until the vectors are quiet,
        // so a late signal of the round before is not taken for this round's.
        drain_until_quiet(&efds);
        w32(&mut c, BAR0, e1000e::IVAR, e1000e::ivar_other(vector));
        w32(&mut c, BAR0, e1000e::IMS, e1000e::ICR_OTHER);
        w32(&mut c, BAR0, e1000e::ICS, e1000e::ICR_OTHER);
        let until = Instant::now() + Duration::from_secs(20);
        while efds[vector as usize].read().is_err() {
            assert!(
                Instant::now() < until,
                "round {round}: no interrupt on MSI-X vector {vector}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // Give a wrongly routed signal the time to arrive.
        std::thread::sleep(Duration::from_millis(200));
        for (v, e) in efds.iter().enumerate() {
            if v != vector as usize {
                assert!(e.read().is_err(), "round {round}: vector {v} fired too");
            }
        }
        w32(&mut c, BAR0, e1000e::IMC, e1000e::ICR_OTHER);
        // Reading ICR clears it.
        let _ = r32(&mut c, BAR0, 0xc0);
    }
    assert!(
        handle
            .stats()
            .irqs
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2
    );
    drop(c);
    // A VMM that shrinks its memory file under a DMA map: the next BAR write's push must
    // not touch the mapping past the file's end (SIGBUS would kill this borrower, which
    // runs in the test's own process); it is refused with an errno and the borrower goes
    // on. (A raw connection: the `Client` waits for ever on a refused write.)
    let mut raw = Raw::join(&sock);
    let mem = Memory::new();
    assert!(
        raw.dma_map(mem.fd.as_raw_fd(), IOVA, GUEST_MEM),
        "DMA_MAP of the memfd"
    );
    // SAFETY: ftruncate on our own memfd; nothing here touches the mapping after it.
    assert_eq!(unsafe { libc::ftruncate(mem.fd.as_raw_fd(), 0) }, 0);
    assert_eq!(
        raw.region_write(BAR0, e1000e::IMC, &u32::MAX.to_le_bytes()),
        Err(libc::EINVAL as u32),
        "a BAR write whose push would read past the shrunk file"
    );
    assert_eq!(
        vendor_device(&mut raw),
        0x10d3_8086,
        "the borrower goes on after a shrunk memory file"
    );
    drop(raw);
    handle.disconnect();
}

fn scenario(port: u16, dir: &Path) {
    e1000e_msix_and_port_io(port, dir);

    // The first borrower and its VMM: config space, ID, factorial, DMA.
    let sock = dir.join("edu.sock");
    let a = connect(port, 1);
    let info = a.info().clone();
    assert_eq!(info.regions[0].size, 1 << 20, "edu's BAR0 is 1 MiB");
    let a = serve(a, &sock);
    let mut vmm = Vmm::join(&sock);
    assert_eq!(vmm.r32(CONFIG, 0), 0x11e8_1234, "vendor and device ID");
    assert_eq!(vmm.r32(BAR0, ID), 0x0100_00ed, "the edu ID register");
    // BAR sizing is virtual: all ones reads back the size mask, not the host's BAR.
    vmm.w32(CONFIG, 0x10, 0xffff_ffff);
    assert_eq!(
        vmm.r32(CONFIG, 0x10) & 0xffff_fff0,
        0xfff0_0000,
        "BAR0 sizing"
    );
    vmm.w32(CONFIG, 0x10, 0xc000_0000);
    assert_eq!(
        vmm.r32(BAR0, ID),
        0x0100_00ed,
        "BAR0 still answers at the host's address"
    );
    vmm.enable_bus_master();
    assert_eq!(vmm.factorial(10), 3_628_800, "10!");
    assert_eq!(vmm.factorial(5), 120, "5!");
    let mem = Memory::new();
    vmm.client
        .dma_map(0, IOVA, GUEST_MEM, mem.fd.as_raw_fd())
        .expect("DMA_MAP");
    vmm.dma_round_trip(&mem, 7);
    let pushed = a
        .stats()
        .pages_pushed
        .load(std::sync::atomic::Ordering::Relaxed);
    let pulled = a
        .stats()
        .pages_pulled
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        (1..=4).contains(&pushed),
        "pages pushed: {pushed} (only what changed)"
    );
    assert!(
        (1..=4).contains(&pulled),
        "pages pulled: {pulled} (only what changed)"
    );
    vmm.dma_round_trip(&mem, 99);

    // A second borrower is refused while the first holds the function.
    match PciBorrower::connect(&target(port, 2)) {
        Err(PciError::Connect(devlend_fabric::tcp::ConnectError::Refused { status, .. })) => {
            assert_eq!(status, HelloStatus::Busy)
        }
        Err(e) => panic!(
            "second borrower: unexpected {}",
            devlend_fabric::error::chain(&e)
        ),
        Ok(_) => panic!("a second borrower got the function while the first holds it"),
    }

    // So is a second session of the same borrower: one session holds a function.
    match PciBorrower::connect(&target(port, 1)) {
        Err(PciError::Connect(devlend_fabric::tcp::ConnectError::Refused {
            status,
            message,
            ..
        })) => {
            assert_eq!(status, HelloStatus::Busy);
            assert!(message.contains("one at a time"), "{message}");
        }
        Err(e) => panic!(
            "second session: unexpected {}",
            devlend_fabric::error::chain(&e)
        ),
        Ok(_) => panic!("a second session got the function"),
    }

    // Bad vfio-user requests are refused and the server goes on (the VMM leaves first:
    // the socket serves one VMM at a time).
    drop(vmm);
    let mut raw = Raw::join(&sock);
    assert_eq!(vendor_device(&mut raw), 0x11e8_1234);
    assert!(
        raw.region_read(42, 0, 4).is_err(),
        "region index out of range"
    );
    assert!(raw.region_read(8, 0, 4).is_err(), "an absent region (VGA)");
    assert!(
        raw.region_read(BAR0, 1 << 20, 4).is_err(),
        "an offset past BAR0"
    );
    assert!(
        raw.region_read(BAR0, (1 << 20) - 2, 4).is_err(),
        "a read across BAR0's end"
    );
    assert!(
        raw.region_read(CONFIG, 4096, 4).is_err(),
        "an offset past the config space"
    );
    assert!(
        raw.dma_map(mem.fd.as_raw_fd(), IOVA, 0x1_0000),
        "a first DMA map"
    );
    assert!(
        !raw.dma_map(mem.fd.as_raw_fd(), IOVA + 0x8000, 0x1_0000),
        "a DMA map overlapping it"
    );
    // Answered with an errno, never 0: a VMM (QEMU 11) takes `-errno` as the result.
    assert_eq!(raw.errno, libc::EINVAL as u32, "the overlap's errno");
    assert!(
        !raw.dma_map(mem.fd.as_raw_fd(), IOVA + 1, 0x1000),
        "an unaligned DMA map"
    );
    // Past the end of the VMM's file (a shared mapping read past it raises SIGBUS in the
    // compute agent), and past the mirror limit (allocated before anything is checked,
    // it would abort the agent).
    assert!(
        !raw.dma_map(mem.fd.as_raw_fd(), IOVA + 0x1000_0000, 2 * GUEST_MEM),
        "a DMA map longer than its file"
    );
    assert!(
        !raw.dma_map(mem.fd.as_raw_fd(), IOVA + 0x1000_0000, 1 << 40),
        "a DMA map of 1 TiB"
    );
    assert_eq!(raw.errno, libc::EINVAL as u32, "the 1 TiB map's errno");
    // Refused before their payload is looked at: the payload must not be taken for the
    // next header (the patched vfio_user server reads every message whole).
    assert!(
        raw.region_write(42, 0, &[0x11; 24]).is_err(),
        "a write to region 42"
    );
    let (h, _) = raw.call(0x77, &[0xff; 40], None);
    assert_ne!(h.3 & 0x20, 0, "an unknown command is refused");
    assert!(
        raw.region_read(BAR0, 0, 8 << 20).is_err(),
        "a read of 8 MiB"
    );
    assert!(
        raw.region_write(BAR0, 1 << 20, &[0; 4]).is_err(),
        "a write past BAR0"
    );
    assert_eq!(vendor_device(&mut raw), 0x11e8_1234, "the server goes on");
    drop(raw);

    // The first borrower disconnects in the middle of a DMA.
    let mut vmm = Vmm::join(&sock);
    vmm.enable_bus_master();
    vmm.client
        .dma_map(0, IOVA, GUEST_MEM, mem.fd.as_raw_fd())
        .expect("DMA_MAP");
    mem.write(0, &[0x5a; 4096]);
    vmm.w32(BAR0, DMA_SRC, IOVA as u32);
    vmm.w32(BAR0, DMA_DST, EDU_BUF as u32);
    vmm.w32(BAR0, DMA_COUNT, 4096);
    vmm.w32(BAR0, DMA_CMD, 0x1 | 0x4);
    a.disconnect();
    drop(vmm);

    // On the fabric itself: bad requests are refused and the session goes on; a
    // malformed message ends that session only. (The lender may still be quiescing
    // the function for the borrower that left: retry while Busy.)
    let (link, _, _irqs) = {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            match PciLink::connect(&target(port, 3), std::sync::Arc::new(NoGuestMemory)) {
                Ok(l) => break l,
                Err(e) if Instant::now() < until => {
                    eprintln!("fabric client: {}", devlend_fabric::error::chain(&e));
                    std::thread::sleep(Duration::from_millis(300));
                }
                Err(e) => panic!("fabric client: {}", devlend_fabric::error::chain(&e)),
            }
        }
    };
    let map = |iova: u64, size: u64| {
        link.call(Message::new(KIND_DMA_MAP, DmaRange { iova, size }.encode()))
    };
    map(IOVA, 0x1_0000).expect("a first DMA map on the fabric");
    match map(IOVA + 0x4000, 0x1000) {
        Err(LinkError::Refused { status, reason }) => {
            assert_eq!(status, PciStatus::Invalid);
            assert!(reason.contains("overlaps"), "{reason}");
        }
        other => panic!("an overlapping DMA map on the fabric: {other:?}"),
    }
    let read = |region: u32, offset: u64| {
        let a = devlend_fabric::pci::Access {
            region,
            len: 4,
            offset,
        };
        link.call(Message::new(KIND_READ, a.encode()))
    };
    assert!(
        matches!(read(12, 0), Err(LinkError::Refused { .. })),
        "region out of range"
    );
    assert!(
        matches!(read(BAR0, 1 << 20), Err(LinkError::Refused { .. })),
        "offset past BAR0"
    );
    let id = read(BAR0, ID).expect("the session goes on");
    assert_eq!(id[0].payload, 0x0100_00edu32.to_le_bytes());
    // A message of an unknown kind: the lender closes this session.
    link.send(&Message::new(0x7f, Vec::new()))
        .expect("send garbage");
    assert!(
        matches!(read(BAR0, ID), Err(LinkError::Closed | LinkError::Send(_))),
        "a malformed message closes the session"
    );
    drop(link);

    // The function is lent again, and works: to a new borrower, after the reset.
    let sock2 = dir.join("edu2.sock");
    let b = connect(port, 4);
    let b = serve(b, &sock2);
    let mut vmm = Vmm::join(&sock2);
    assert_eq!(vmm.r32(CONFIG, 0), 0x11e8_1234);
    assert_eq!(
        vmm.r32(CONFIG, 0x10) & 0xffff_fff0,
        0,
        "BAR0 back to its reset value"
    );
    vmm.enable_bus_master();
    assert_eq!(vmm.factorial(12), 479_001_600, "12!");
    let mem2 = Memory::new();
    vmm.client
        .dma_map(0, IOVA, GUEST_MEM, mem2.fd.as_raw_fd())
        .expect("DMA_MAP");
    vmm.dma_round_trip(&mem2, 42);
    drop(vmm);
    b.disconnect();

    // The compute agent: `devlend attach --kind pci` serves the function on vfio-user
    // and prints how Cloud Hypervisor and QEMU 11 join it; the VMM's view is the same.
    let agent = devlend_tests::agents::Borrower::start(dir).expect("compute agent");
    let sock3 = dir.join("edu3.sock");
    let s3 = sock3.display().to_string();
    let lender = format!("127.0.0.1:{port}");
    let args = [
        "attach", "--lender", &lender, "--device", "edu", "--socket", &s3, "--kind", "pci",
    ];
    let until = Instant::now() + Duration::from_secs(30);
    let out = loop {
        let out = agent.cli(&args).expect("devlend attach");
        if out.status.success() || Instant::now() > until {
            break out;
        }
        eprintln!("attach: {}", String::from_utf8_lossy(&out.stderr).trim());
        std::thread::sleep(Duration::from_millis(500));
    };
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "devlend attach --kind pci: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        printed.contains(&format!("--user-device socket={s3}")),
        "{printed}"
    );
    assert!(
        printed.contains("\"driver\":\"vfio-user-pci\""),
        "{printed}"
    );
    let status = agent.cli_json(&["status"]).expect("status");
    assert_eq!(status[0]["kind"], "pci", "{status}");
    let mut vmm = Vmm::join(&sock3);
    assert_eq!(vmm.r32(CONFIG, 0), 0x11e8_1234);
    vmm.enable_bus_master();
    assert_eq!(vmm.factorial(7), 5040, "7!");
    let mem3 = Memory::new();
    vmm.client
        .dma_map(0, IOVA, GUEST_MEM, mem3.fd.as_raw_fd())
        .expect("DMA_MAP");
    vmm.dma_round_trip(&mem3, 3);
    drop(vmm);
    // A PCIe function cannot live-migrate (QEMU's vfio-user client cannot): the
    // handover is refused with the reason, and the attachment goes on.
    let out = agent
        .cli(&["migrate", "handover", "edu"])
        .expect("devlend migrate handover");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("a PCIe function cannot migrate"),
        "migrate handover of a PCIe function: {err}"
    );
    let out = agent.cli(&["detach", "edu"]).expect("devlend detach");
    assert!(
        out.status.success(),
        "detach: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Detached: the function is free for another borrower.
    drop(connect(port, 5));

    // A borrower that stalls in the middle of a message does not keep the function:
    // the lender closes its session after the frame timeout (30 s) and lends again.
    let stalled = {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let mut hello = devlend_fabric::Hello::new("edu", 0);
            hello.features = devlend_fabric::pci::FEATURE_PCI;
            hello.borrower = [6; 16];
            match devlend_fabric::tcp::connect_as(&lender, &hello, Duration::from_secs(10)) {
                Ok((s, _)) => break s,
                Err(e) if Instant::now() < until => {
                    eprintln!("stalling borrower: {e}");
                    std::thread::sleep(Duration::from_millis(300));
                }
                Err(e) => panic!("stalling borrower: {e}"),
            }
        }
    };
    let started = Instant::now();
    // A read's header and 4 of its 16 payload bytes.
    let mut partial = vec![KIND_READ, 0, 0, 0, 16, 0, 0, 0];
    partial.extend_from_slice(&[0; 4]);
    (&stalled)
        .write_all(&partial)
        .expect("send a partial message");
    stalled
        .set_read_timeout(Some(Duration::from_secs(90)))
        .unwrap();
    let mut b = [0u8; 16];
    let n = (&stalled).read(&mut b);
    let waited = started.elapsed();
    assert!(matches!(n, Ok(0) | Err(_)), "the lender closes: {n:?}");
    assert!(
        waited >= Duration::from_secs(20) && waited < Duration::from_secs(80),
        "closed after {waited:?}, the frame timeout is 30 s"
    );
    drop(connect(port, 7));
}
