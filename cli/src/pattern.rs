//! A deterministic data pattern, to write a disk and verify it anywhere.

/// Fills `buf`, which sits at byte `offset` of the device, with the pattern of `seed`.
/// Every 8-byte word depends on its device offset, so misplaced data is caught.
pub fn fill(buf: &mut [u8], offset: u64, seed: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let v = word(offset + 8 * i as u64, seed).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn word(pos: u64, seed: u64) -> u64 {
    let mut x = pos ^ seed.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Returns the first device offset in `buf` (at device `offset`) that differs from the
/// pattern, if any.
pub fn first_mismatch(buf: &[u8], offset: u64, seed: u64) -> Option<u64> {
    for (i, chunk) in buf.chunks(8).enumerate() {
        let v = word(offset + 8 * i as u64, seed).to_le_bytes();
        if chunk != &v[..chunk.len()] {
            return Some(offset + 8 * i as u64);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_detects_misplaced_data() {
        let mut a = vec![0u8; 4096];
        fill(&mut a, 8192, 7);
        assert_eq!(first_mismatch(&a, 8192, 7), None);
        assert_eq!(first_mismatch(&a, 4096, 7), Some(4096));
        assert_eq!(first_mismatch(&a, 8192, 8), Some(8192));
        a[100] ^= 1;
        assert_eq!(first_mismatch(&a, 8192, 7), Some(8192 + 96));
    }
}
