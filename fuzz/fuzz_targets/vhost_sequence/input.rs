//! The fuzzer's input, read field by field (missing bytes read as 0).

/// Reads the input front to back; past its end every byte is 0.
pub(crate) struct Input<'a>(pub(crate) &'a [u8]);

impl Input<'_> {
    pub(crate) fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        let n = N.min(self.0.len());
        b[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        b
    }
    pub(crate) fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }
    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }
    pub(crate) fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    pub(crate) fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
    pub(crate) fn take(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head.to_vec()
    }
}

/// A raw vring message's index from `q`: 0-3 (2 and 3 are past the last queue) for
/// `q < 0x80`, `q & 0x3f` up to 0xbf, else near `u32::MAX`.
pub(crate) fn vring_index(q: u8) -> u32 {
    match q >> 6 {
        0 | 1 => u32::from(q & 3),
        2 => u32::from(q & 0x3f),
        _ => 0xffff_fff0 | u32::from(q & 0xf),
    }
}
