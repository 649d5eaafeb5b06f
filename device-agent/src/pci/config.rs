//! The borrower's view of a lent function's config space, as a VMM virtualizes it.
//!
//! Every byte is one of three kinds:
//! - **emulated**: served from the lender's copy, never written to the function: the
//!   BARs and the expansion ROM BAR (with the sizing protocol of PCI 3.0 §6.2.5.1: the
//!   borrower writes all ones and reads back the size mask), the interrupt line, cache
//!   line size and latency timer, and the MSI (PCI 3.0 §6.8.1) and MSI-X (§6.8.2)
//!   capabilities, whose address and data mean nothing on the lender's host: the
//!   borrower's VMM enables interrupts with [`devlend_fabric::pci::KIND_SET_IRQS`];
//! - **forwarded**: read from and written to the function through VFIO (whose own
//!   config filter applies on top): the command register's I/O, memory, bus master,
//!   parity, SERR and INTx-disable bits, the status register's write-1-to-clear bits,
//!   and the capabilities other than MSI and MSI-X;
//! - **read-only**: read from the function, writes dropped: the rest of the standard
//!   header (IDs, class, header type, BIST, capability pointer, ...).

/// Offset of the first BAR (PCI 3.0 §6.2.5).
const BAR0: usize = 0x10;
/// Offset of the expansion ROM BAR for a type 0 header.
const ROM: usize = 0x30;
/// Capability ID of MSI.
const CAP_MSI: u8 = 0x05;
/// Capability ID of MSI-X.
const CAP_MSIX: u8 = 0x11;

/// How the function looks at the time it is opened.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// Size in bytes of each BAR (0 if absent), by BAR index 0..6, and of the ROM.
    pub(crate) bar_sizes: [u64; 7],
    /// The function's config space as read through VFIO at open.
    pub(crate) initial: Vec<u8>,
}

/// The BARs (by index) that hold a function's MSI-X table or pending bit array (PCI
/// 3.0 §6.8.2.4, .5: the BIR of the table and PBA offset registers), from its config
/// space `initial`: the lender virtualizes MSI-X, so no peer may reach them.
pub(crate) fn msix_bars(initial: &[u8]) -> Vec<usize> {
    let b = |o: usize| initial.get(o).copied().unwrap_or(0);
    let mut out = Vec::new();
    if b(0x06) & 0x10 == 0 {
        return out;
    }
    let mut p = usize::from(b(0x34) & !3);
    let mut hops = 0;
    while p >= 0x40 && p + 12 <= initial.len() && hops < 48 {
        if b(p) == CAP_MSIX {
            out.push(usize::from(b(p + 4) & 7));
            out.push(usize::from(b(p + 8) & 7));
        }
        p = usize::from(b(p + 1) & !3);
        hops += 1;
    }
    out
}

/// The virtual config space of one lending.
#[derive(Debug, Clone)]
pub(crate) struct VirtConfig {
    /// Values of the emulated bytes.
    emul: Vec<u8>,
    /// Bits served from `emul` (1) or from the function (0).
    emul_mask: Vec<u8>,
    /// Emulated bits the borrower may change.
    write_mask: Vec<u8>,
    /// Bits whose writes are forwarded to the function.
    forward_mask: Vec<u8>,
    /// Per BAR dword (6 BARs and the ROM): address bits the borrower may set, and the
    /// read-only low bits (type, prefetchable, or the ROM's none).
    bars: [(u32, u32); 7],
    /// Offset of the MSI capability's message control (low byte), if it has one.
    msi_control: Option<usize>,
}

impl VirtConfig {
    /// The virtual config space of a function laid out as `layout`, as at reset: BARs
    /// at address 0, MSI and MSI-X disabled.
    pub(crate) fn new(layout: &Layout) -> VirtConfig {
        let n = layout.initial.len().max(64);
        let mut c = VirtConfig {
            emul: vec![0; n],
            emul_mask: vec![0; n],
            write_mask: vec![0; n],
            forward_mask: vec![0; n],
            bars: [(0, 0); 7],
            msi_control: None,
        };
        let init = |o: usize| layout.initial.get(o).copied().unwrap_or(0);
        // Beyond the standard header: forwarded, except MSI/MSI-X below.
        for o in 0x40..n {
            c.forward_mask[o] = 0xff;
        }
        c.forward_mask[0x04] = 0x47; // I/O, memory, bus master, parity error response
        c.forward_mask[0x05] = 0x05; // SERR#, INTx disable
        c.forward_mask[0x07] = 0xf9; // write-1-to-clear status bits
        for o in [0x0c, 0x0d, 0x3c] {
            c.emulate(o, 1, init(o), 0xff);
        }
        // BARs: 64-bit ones span two dwords.
        let mut i = 0;
        while i < 6 {
            let o = BAR0 + 4 * i;
            let low = u32::from_le_bytes([init(o), init(o + 1), init(o + 2), init(o + 3)]);
            let size = layout.bar_sizes[i];
            let io = low & 1 == 1;
            let is64 = !io && (low >> 1) & 3 == 2;
            let flags = if size == 0 {
                0
            } else if io {
                low & 0x3
            } else {
                low & 0xf
            };
            let mask = if size == 0 {
                0
            } else {
                !(size.next_power_of_two() - 1)
            };
            let low_mask = (mask as u32) & if io { !0x3 } else { !0xf };
            c.bars[i] = (low_mask, flags);
            c.emulate(o, 4, 0, 0xff);
            c.set_dword(o, flags);
            if is64 && i + 1 < 6 {
                c.bars[i + 1] = ((mask >> 32) as u32, 0);
                c.emulate(o + 4, 4, 0, 0xff);
                i += 1;
            }
            i += 1;
        }
        let rom_size = layout.bar_sizes[6];
        let rom_mask = if rom_size == 0 {
            0
        } else {
            (!(rom_size.next_power_of_two() - 1) as u32 & !0x7ff) | 1
        };
        c.bars[6] = (rom_mask, 0);
        c.emulate(ROM, 4, 0, 0xff);
        // The capability list (status bit 4), walked at most 48 times (loops).
        if init(0x06) & 0x10 != 0 {
            let mut p = (init(0x34) & !3) as usize;
            let mut hops = 0;
            while p >= 0x40 && p + 4 <= n && hops < 48 {
                let id = init(p);
                let ctrl = u16::from_le_bytes([init(p + 2), init(p + 3)]);
                match id {
                    CAP_MSI => {
                        let is64 = ctrl & (1 << 7) != 0;
                        let masking = ctrl & (1 << 8) != 0;
                        let len = 10 + if is64 { 4 } else { 0 } + if masking { 10 } else { 0 };
                        let len = len.min(n - p);
                        c.emulate(p, len, 0, 0xff);
                        c.copy_initial(p, len, &layout.initial);
                        // ID and next pointer read-only; control: enable and multiple
                        // message enable only; the rest (address, data, mask) writable.
                        c.write_mask[p] = 0;
                        c.write_mask[p + 1] = 0;
                        c.write_mask[p + 2] = 0x71;
                        c.write_mask[p + 3] = 0;
                        c.emul[p + 2] &= !0x71;
                        c.msi_control = Some(p + 2);
                    }
                    CAP_MSIX => {
                        let len = 12.min(n - p);
                        c.emulate(p, len, 0, 0);
                        c.copy_initial(p, len, &layout.initial);
                        // Enable and function mask.
                        c.write_mask[p + 3] = 0xc0;
                        c.emul[p + 3] &= !0xc0;
                    }
                    _ => {}
                }
                p = (init(p + 1) & !3) as usize;
                hops += 1;
            }
        }
        c
    }

    fn emulate(&mut self, o: usize, len: usize, value: u8, write: u8) {
        for b in o..(o + len).min(self.emul.len()) {
            self.emul[b] = value;
            self.emul_mask[b] = 0xff;
            self.write_mask[b] = write;
            self.forward_mask[b] = 0;
        }
    }

    fn copy_initial(&mut self, o: usize, len: usize, initial: &[u8]) {
        for b in o..(o + len).min(self.emul.len()) {
            self.emul[b] = initial.get(b).copied().unwrap_or(0);
        }
    }

    fn set_dword(&mut self, o: usize, v: u32) {
        self.emul[o..o + 4].copy_from_slice(&v.to_le_bytes());
    }

    /// Size in bytes of the virtual config space.
    pub(crate) fn len(&self) -> usize {
        self.emul.len()
    }

    /// Merges what the function returned for `off..off + data.len()` with the emulated
    /// bytes; the range must lie within [`VirtConfig::len`].
    pub(crate) fn overlay_read(&self, off: usize, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            let o = off + i;
            let m = self.emul_mask[o];
            *b = (*b & !m) | (self.emul[o] & m);
        }
    }

    /// Where the borrower placed each memory BAR (by BAR index 0..6): its address, or
    /// `None` for a BAR that is absent, an I/O BAR, the upper half of a 64-bit one, at
    /// address 0, or being sized (every address bit set).
    pub(crate) fn bar_addresses(&self) -> [Option<u64>; 6] {
        let dword = |o: usize| {
            u32::from_le_bytes([
                self.emul[o],
                self.emul[o + 1],
                self.emul[o + 2],
                self.emul[o + 3],
            ])
        };
        let mut out = [None; 6];
        let mut i = 0;
        while i < 6 {
            let (mask, flags) = self.bars[i];
            let is64 = (flags >> 1) & 3 == 2;
            if mask == 0 || flags & 1 == 1 {
                i += 1;
                continue;
            }
            let (hi_mask, hi) = if is64 && i + 1 < 6 {
                (self.bars[i + 1].0, dword(BAR0 + 4 * (i + 1)))
            } else {
                (0, 0)
            };
            let lo = dword(BAR0 + 4 * i) & mask;
            let addr = u64::from(lo) | (u64::from(hi & hi_mask) << 32);
            let sizing = lo == mask && hi & hi_mask == hi_mask;
            if addr != 0 && !sizing {
                out[i] = Some(addr);
            }
            i += if is64 { 2 } else { 1 };
        }
        out
    }

    /// Applies a borrower's write of `data` at `off` to the emulated bytes, and returns
    /// what to write to the function: for each byte, `Some(value)` when it has forwarded
    /// bits (the value holds only those bits), else `None`. The range must lie within
    /// [`VirtConfig::len`].
    pub(crate) fn write(&mut self, off: usize, data: &[u8]) -> Vec<Option<u8>> {
        let mut fwd = Vec::with_capacity(data.len());
        for (i, &v) in data.iter().enumerate() {
            let o = off + i;
            let w = self.write_mask[o] & self.emul_mask[o];
            self.emul[o] = (self.emul[o] & !w) | (v & w);
            let f = self.forward_mask[o];
            fwd.push((f != 0).then_some(v & f));
        }
        // BAR dwords touched: keep only the address bits the size allows, and the flags.
        for (bar, (mask, flags)) in self.bars.into_iter().enumerate() {
            let o = if bar == 6 { ROM } else { BAR0 + 4 * bar };
            if off < o + 4 && o < off + data.len() {
                let cur = u32::from_le_bytes([
                    self.emul[o],
                    self.emul[o + 1],
                    self.emul[o + 2],
                    self.emul[o + 3],
                ]);
                self.set_dword(o, (cur & mask) | flags);
            }
        }
        // MSI: Multiple Message Enable (bits 6:4) at most Multiple Message Capable
        // (bits 3:1), as the function advertises (PCI 3.0 §6.8.1.3).
        if let Some(o) = self
            .msi_control
            .filter(|&o| off <= o && o < off + data.len())
        {
            let ctrl = self.emul[o];
            let capable = (ctrl >> 1) & 0x7;
            if (ctrl >> 4) & 0x7 > capable {
                self.emul[o] = (ctrl & !0x70) | (capable << 4);
            }
        }
        fwd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A function like QEMU's edu: a 1 MiB 32-bit memory BAR0, an MSI capability at 0x40.
    fn edu() -> Layout {
        let mut cfg = vec![0u8; 256];
        cfg[0..4].copy_from_slice(&0x11e8_1234u32.to_le_bytes());
        cfg[0x06] = 0x10;
        cfg[0x10..0x14].copy_from_slice(&0xfea0_0000u32.to_le_bytes());
        cfg[0x34] = 0x40;
        cfg[0x40] = CAP_MSI;
        cfg[0x41] = 0x00;
        cfg[0x42] = 0x80; // 64-bit
        let mut bar_sizes = [0; 7];
        bar_sizes[0] = 1 << 20;
        Layout {
            bar_sizes,
            initial: cfg,
        }
    }

    fn read(c: &VirtConfig, dev: &[u8], off: usize, len: usize) -> u32 {
        let mut b = dev[off..off + len].to_vec();
        c.overlay_read(off, &mut b);
        b.resize(4, 0);
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    #[test]
    fn bars_are_sized_and_never_reach_the_function() {
        let l = edu();
        let mut c = VirtConfig::new(&l);
        assert_eq!(read(&c, &l.initial, 0, 4), 0x11e8_1234);
        assert_eq!(
            read(&c, &l.initial, 0x10, 4),
            0,
            "the host's address is hidden"
        );
        let fwd = c.write(0x10, &0xffff_ffffu32.to_le_bytes());
        assert!(fwd.iter().all(Option::is_none));
        assert_eq!(read(&c, &l.initial, 0x10, 4), 0xfff0_0000);
        c.write(0x10, &0xc000_1234u32.to_le_bytes());
        assert_eq!(read(&c, &l.initial, 0x10, 4), 0xc000_0000);
        // An absent BAR reads 0 whatever is written.
        c.write(0x14, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(read(&c, &l.initial, 0x14, 4), 0);
        // The IDs are read-only, the command register forwarded in part.
        assert!(c.write(0x00, &[0xff, 0xff]).iter().all(Option::is_none));
        assert_eq!(c.write(0x04, &[0xff, 0xff]), vec![Some(0x47), Some(0x05)]);
    }

    #[test]
    fn msi_is_virtualized() {
        let l = edu();
        let mut c = VirtConfig::new(&l);
        assert_eq!(read(&c, &l.initial, 0x40, 4) & 0xffff, 0x0005);
        let fwd = c.write(0x42, &[0xff, 0xff]);
        assert!(fwd.iter().all(Option::is_none), "MSI control stays here");
        // Enabled, with one message: edu is capable of one (MMC 0), so MME 7 is cut.
        assert_eq!(read(&c, &l.initial, 0x42, 2), 0x80 | 0x01);
        c.write(0x44, &0xfee0_0000u32.to_le_bytes());
        assert_eq!(read(&c, &l.initial, 0x44, 4), 0xfee0_0000);
        // A capability the lender does not virtualize is forwarded.
        assert_eq!(c.write(0x60, &[0xaa]), vec![Some(0xaa)]);
    }

    #[test]
    fn msi_multiple_message_enable_is_cut_to_what_is_capable() {
        let mut l = edu();
        l.initial[0x42] |= 2 << 1; // capable of 4 messages
        let mut c = VirtConfig::new(&l);
        c.write(0x42, &[0x21]); // 4 enabled: allowed
        assert_eq!(read(&c, &l.initial, 0x42, 1) & 0x70, 0x20);
        c.write(0x42, &[0x71]); // 128 asked
        assert_eq!(read(&c, &l.initial, 0x42, 1) & 0x70, 0x20, "cut to 4");
    }

    #[test]
    fn msix_table_and_pba_bars_are_found_through_the_capability_list() {
        let mut cfg = vec![0u8; 256];
        cfg[0x06] = 0x10;
        cfg[0x34] = 0x40;
        cfg[0x40] = CAP_MSI;
        cfg[0x41] = 0x60;
        cfg[0x60] = CAP_MSIX;
        cfg[0x64..0x68].copy_from_slice(&0x2000_0003u32.to_le_bytes());
        cfg[0x68..0x6c].copy_from_slice(&0x3000_0004u32.to_le_bytes());
        assert_eq!(msix_bars(&cfg), vec![3, 4]);
        cfg[0x06] = 0;
        assert_eq!(msix_bars(&cfg), Vec::<usize>::new(), "no capability list");
        let mut looped = vec![0u8; 256];
        looped[0x06] = 0x10;
        looped[0x34] = 0x40;
        looped[0x41] = 0x40;
        assert_eq!(msix_bars(&looped), Vec::<usize>::new(), "a loop ends");
    }

    #[test]
    fn bar_addresses_are_what_the_borrower_placed_and_not_while_sized() {
        let mut cfg = vec![0u8; 256];
        // BAR0: 64-bit memory, 16 KiB; BAR2: 64-bit prefetchable, 1 MiB; BAR4: I/O.
        cfg[0x10..0x14].copy_from_slice(&0x4u32.to_le_bytes());
        cfg[0x18..0x1c].copy_from_slice(&0xcu32.to_le_bytes());
        cfg[0x20..0x24].copy_from_slice(&0x1u32.to_le_bytes());
        let l = Layout {
            bar_sizes: [16 << 10, 0, 1 << 20, 0, 256, 0, 0],
            initial: cfg,
        };
        let mut c = VirtConfig::new(&l);
        assert_eq!(c.bar_addresses(), [None; 6], "at reset every BAR is at 0");
        c.write(0x10, &0xfebf_0000u32.to_le_bytes());
        c.write(0x18, &0xffff_ffffu32.to_le_bytes());
        c.write(0x1c, &0xffff_ffffu32.to_le_bytes());
        c.write(0x20, &0xc000u32.to_le_bytes());
        let a = c.bar_addresses();
        assert_eq!(a[0], Some(0xfebf_0000));
        assert_eq!(a[2], None, "being sized");
        assert_eq!(a[4], None, "an I/O BAR");
        c.write(0x18, &0x0000_0000u32.to_le_bytes());
        c.write(0x1c, &0x0000_0008u32.to_le_bytes());
        assert_eq!(c.bar_addresses()[2], Some(0x8_0000_0000));
        c.write(0x18, &0x1234_5678u32.to_le_bytes());
        assert_eq!(
            c.bar_addresses()[2],
            Some(0x8_1230_0000),
            "only the address bits the size allows"
        );
    }

    #[test]
    fn sixty_four_bit_bars_size_both_halves() {
        let mut l = edu();
        l.initial[0x10..0x14].copy_from_slice(&0x0000_000cu32.to_le_bytes());
        l.bar_sizes[0] = 1 << 33;
        let mut c = VirtConfig::new(&l);
        c.write(0x10, &[0xff; 8]);
        assert_eq!(read(&c, &l.initial, 0x10, 4), 0x0000_000c);
        assert_eq!(read(&c, &l.initial, 0x14, 4), 0xffff_fffe);
    }

    #[test]
    fn a_hostile_capability_list_does_not_panic() {
        let mut l = edu();
        // A capability at the very end, whose next pointer loops to itself.
        l.initial[0x34] = 0xfc;
        l.initial[0xfc] = CAP_MSIX;
        l.initial[0xfd] = 0xfc;
        let c = VirtConfig::new(&l);
        assert_eq!(read(&c, &l.initial, 0xfc, 4) & 0xff, u32::from(CAP_MSIX));
        // A truncated config space.
        l.initial.truncate(0x20);
        let mut c = VirtConfig::new(&l);
        c.write(0x10, &[0xff; 4]);
        assert_eq!(c.len(), 64);
    }
}
