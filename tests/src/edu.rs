//! Driving QEMU's `edu` device (PCI 1234:11e8, QEMU `docs/specs/edu.rst`) as a VMM
//! would, through a vfio-user socket with the `vfio_user` crate's `Client`: its
//! registers, its factorial with the MSI it raises, and its DMA engine on "guest
//! memory" (a memfd mapped for DMA). Used by the PCIe lending tests on the host and, as
//! `devlend-edu-vmm`, inside guests.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_PCI_MSI_IRQ_INDEX,
};
use vfio_user::Client;
use vmm_sys_util::eventfd::EventFd;

/// BAR0 register (edu.rst): identification, 0x010000ed.
pub const ID: u64 = 0x00;
/// BAR0 register: factorial computation (write n, read n!).
pub const FACT: u64 = 0x08;
/// BAR0 register: status (0x80: raise an interrupt when the factorial is done).
pub const STATUS: u64 = 0x20;
/// BAR0 register: interrupt status (1: factorial, 0x100: DMA).
pub const IRQ_STATUS: u64 = 0x24;
/// BAR0 register: interrupt acknowledge.
pub const IRQ_ACK: u64 = 0x64;
/// BAR0 register: DMA source address.
pub const DMA_SRC: u64 = 0x80;
/// BAR0 register: DMA destination address.
pub const DMA_DST: u64 = 0x88;
/// BAR0 register: DMA length in bytes.
pub const DMA_COUNT: u64 = 0x90;
/// BAR0 register: DMA command (1 start, 2 card to RAM, 4 interrupt when done).
pub const DMA_CMD: u64 = 0x98;
/// The card's DMA buffer, in its own address space.
pub const EDU_BUF: u64 = 0x40000;
/// IOVA of the guest memory the client maps for DMA (below edu's 28-bit DMA mask).
pub const IOVA: u64 = 0x10_0000;
/// Bytes of that guest memory.
pub const GUEST_MEM: u64 = 0x20_0000;
/// VFIO region index of the config space.
pub const CONFIG: u32 = 7;
/// VFIO region index of BAR0.
pub const BAR0: u32 = 0;

/// "Guest memory": a memfd of [`GUEST_MEM`] bytes, mapped here (the NVMe driver's).
pub use crate::nvme::Memory;

/// The VMM's side: the vfio_user client, its MSI eventfd, its memory.
pub struct Vmm {
    /// The vfio-user client.
    pub client: Client,
    irq: EventFd,
}

impl Vmm {
    /// Joins the vfio-user socket and enables MSI on an eventfd.
    pub fn join(sock: &Path) -> Vmm {
        let mut client = Client::new(sock).expect("vfio-user client");
        let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        client
            .set_irqs(
                VFIO_PCI_MSI_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                1,
                &[irq.as_raw_fd()],
            )
            .expect("enable MSI");
        Vmm { client, irq }
    }

    /// Reads a 32-bit register of `region` at `off`.
    pub fn r32(&mut self, region: u32, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.client.region_read(region, off, &mut b).expect("read");
        u32::from_le_bytes(b)
    }

    /// Writes a 32-bit register of `region` at `off`.
    pub fn w32(&mut self, region: u32, off: u64, v: u32) {
        self.client
            .region_write(region, off, &v.to_le_bytes())
            .expect("write");
    }

    /// Enables memory decoding and bus mastering (the command register).
    pub fn enable_bus_master(&mut self) {
        let mut b = [0u8; 2];
        self.client
            .region_read(CONFIG, 0x04, &mut b)
            .expect("read command");
        let cmd = u16::from_le_bytes(b) | 0x06;
        self.client
            .region_write(CONFIG, 0x04, &cmd.to_le_bytes())
            .expect("write command");
    }

    /// Waits for the MSI eventfd.
    pub fn wait_irq(&self, what: &str) {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            if self.irq.read().is_ok() {
                return;
            }
            assert!(Instant::now() < until, "no interrupt for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Has the card compute `n!` and waits for its interrupt.
    pub fn factorial(&mut self, n: u32) -> u32 {
        self.w32(BAR0, STATUS, 0x80);
        self.w32(BAR0, FACT, n);
        self.wait_irq("the factorial");
        let v = self.r32(BAR0, FACT);
        assert_eq!(
            self.r32(BAR0, IRQ_STATUS) & 1,
            1,
            "the factorial's interrupt bit"
        );
        self.w32(BAR0, IRQ_ACK, 1);
        v
    }

    /// One DMA of `len` bytes, `to_ram` (EDU → RAM) or not, with its interrupt.
    pub fn dma(&mut self, src: u64, dst: u64, len: u32, to_ram: bool) {
        self.w32(BAR0, DMA_SRC, src as u32);
        self.w32(BAR0, DMA_DST, dst as u32);
        self.w32(BAR0, DMA_COUNT, len);
        self.w32(BAR0, DMA_CMD, 0x1 | 0x4 | if to_ram { 0x2 } else { 0 });
        self.wait_irq("the DMA");
        assert_eq!(
            self.r32(BAR0, IRQ_STATUS) & 0x100,
            0x100,
            "the DMA's interrupt bit"
        );
        self.w32(BAR0, IRQ_ACK, 0x100);
    }

    /// RAM → card → RAM through the mirror; checks the bytes read back.
    pub fn dma_round_trip(&mut self, mem: &Memory, seed: u8) {
        let pattern: Vec<u8> = (0..4096u32)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        mem.write(0, &pattern);
        self.dma(IOVA, EDU_BUF, 4096, false);
        self.dma(EDU_BUF, IOVA + 0x8_0000, 4096, true);
        let back = mem.read(0x8_0000, 4096);
        let wrong = back.iter().zip(&pattern).filter(|(a, b)| a != b).count();
        let first = back.iter().zip(&pattern).position(|(a, b)| a != b);
        assert_eq!(
            wrong, 0,
            "the page copied into the card and back: {wrong} bytes differ, the first at {first:?}"
        );
    }

    /// `pages` pages of a pattern written to guest memory at once (one run of changed
    /// pages for the mirror), then each copied into the card and back to guest memory
    /// at +0x80000 and checked; returns the number of bytes that differ.
    pub fn dma_pages(&mut self, mem: &Memory, pages: u32, seed: u8) -> usize {
        let pattern: Vec<u8> = (0..pages * 4096)
            .map(|i| {
                (i as u8)
                    .wrapping_mul(13)
                    .wrapping_add((i >> 12) as u8 ^ seed)
            })
            .collect();
        mem.write(0, &pattern);
        for p in 0..u64::from(pages) {
            self.dma(IOVA + p * 4096, EDU_BUF, 4096, false);
            self.dma(EDU_BUF, IOVA + 0x8_0000 + p * 4096, 4096, true);
        }
        let back = mem.read(0x8_0000, pattern.len());
        back.iter().zip(&pattern).filter(|(a, b)| a != b).count()
    }
}
