//! The units of a block request: lengths in bytes, lengths in 512-byte sectors, and
//! sector addresses, each its own type so that one is never taken for another.
//!
//! Every conversion between them is checked: a sector address or count whose byte value
//! does not fit is a [`UnitError`], never a wrapped number.
//!
//! Also the one parser of the sizes and rates operators type ([`parse_size`]): every
//! size and rate flag and config option takes the same K, M, G, T suffixes.

use crate::SECTOR_SIZE;

/// log2 of [`SECTOR_SIZE`].
const SECTOR_SHIFT: u32 = SECTOR_SIZE.trailing_zeros();
const _: () = assert!(1 << SECTOR_SHIFT == SECTOR_SIZE);

/// Why a value in one unit has no value in another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    /// The value in bytes (or the end of a range) does not fit its type.
    #[error("{0}: the value in bytes overflows")]
    Overflow(&'static str),
    /// A byte length or offset that is not a whole number of 512-byte sectors.
    #[error("{0} bytes is not a whole number of 512-byte sectors")]
    NotWholeSectors(u64),
}

/// A length in bytes (the data of a read or a write).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Bytes(pub u32);

/// A count of 512-byte sectors (the range of a discard or a write-zeroes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Sectors(pub u32);

/// The address of a 512-byte sector: byte offset `sector × 512`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Sector(pub u64);

impl Bytes {
    /// No bytes.
    pub const ZERO: Bytes = Bytes(0);

    /// The count, as a `usize` (a buffer length).
    #[inline]
    pub const fn usize(self) -> usize {
        self.0 as usize
    }

    /// The count, as a `u64`.
    #[inline]
    pub const fn u64(self) -> u64 {
        self.0 as u64
    }

    /// Whether the length is a whole number of sectors.
    #[inline]
    pub const fn is_whole_sectors(self) -> bool {
        self.u64().is_multiple_of(SECTOR_SIZE)
    }

    /// The same length in sectors.
    ///
    /// # Errors
    /// [`UnitError::NotWholeSectors`] when it is not a multiple of 512.
    #[inline]
    pub const fn to_sectors(self) -> Result<Sectors, UnitError> {
        if self.is_whole_sectors() {
            Ok(Sectors(self.0 >> SECTOR_SHIFT))
        } else {
            Err(UnitError::NotWholeSectors(self.u64()))
        }
    }
}

impl Sectors {
    /// The length in bytes, as a `u64` (it always fits: at most 2^41 − 512).
    #[inline]
    pub const fn bytes_u64(self) -> u64 {
        (self.0 as u64) << SECTOR_SHIFT
    }

    /// The same length in [`Bytes`].
    ///
    /// # Errors
    /// [`UnitError::Overflow`] from 8388608 sectors (4 GiB) on, which do not fit in a
    /// `u32` of bytes.
    #[inline]
    pub const fn to_bytes(self) -> Result<Bytes, UnitError> {
        let b = self.bytes_u64();
        if b <= u32::MAX as u64 {
            Ok(Bytes(b as u32))
        } else {
            Err(UnitError::Overflow("sector count"))
        }
    }
}

impl Sector {
    /// The byte offset of the sector.
    ///
    /// # Errors
    /// [`UnitError::Overflow`] when `sector × 512` does not fit in a `u64`.
    #[inline]
    pub const fn offset(self) -> Result<u64, UnitError> {
        match self.0.checked_mul(SECTOR_SIZE) {
            Some(o) => Ok(o),
            None => Err(UnitError::Overflow("sector address")),
        }
    }

    /// The sector at byte offset `offset`.
    ///
    /// # Errors
    /// [`UnitError::NotWholeSectors`] when `offset` is not a multiple of 512.
    #[inline]
    pub const fn at_offset(offset: u64) -> Result<Sector, UnitError> {
        if offset.is_multiple_of(SECTOR_SIZE) {
            Ok(Sector(offset >> SECTOR_SHIFT))
        } else {
            Err(UnitError::NotWholeSectors(offset))
        }
    }

    /// The sector `n` sectors after this one (the end of a range of `n`).
    ///
    /// # Errors
    /// [`UnitError::Overflow`] past the last sector address.
    #[inline]
    pub const fn after(self, n: Sectors) -> Result<Sector, UnitError> {
        match self.0.checked_add(n.0 as u64) {
            Some(s) => Ok(Sector(s)),
            None => Err(UnitError::Overflow("end of a sector range")),
        }
    }

    /// The byte range of `len` bytes from this sector: `offset..offset + len`.
    ///
    /// # Errors
    /// [`UnitError::Overflow`] when its start or its end does not fit in a `u64`.
    #[inline]
    pub const fn byte_range(self, len: u64) -> Result<std::ops::Range<u64>, UnitError> {
        let start = match self.offset() {
            Ok(o) => o,
            Err(e) => return Err(e),
        };
        match start.checked_add(len) {
            Some(end) => Ok(start..end),
            None => Err(UnitError::Overflow("end of a byte range")),
        }
    }
}

/// Why a size or rate an operator typed does not parse ([`parse_size`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// A letter other than K, M, G or T at the end.
    #[error("unknown size suffix {0:?} (use K, M, G or T)")]
    UnknownSuffix(char),
    /// Not a whole number before the suffix.
    #[error("invalid size {0:?}")]
    Invalid(String),
    /// The value does not fit in 64 bits.
    #[error("size {0:?} is too large")]
    TooLarge(String),
}

/// Parses a size or rate: a whole number with an optional K, M, G or T suffix, either
/// case, each a power of 1024 (`50M` is 52428800, `1K` is 1024). Used by every size
/// and rate flag and config option (the CLI's sizes and `--qos`, the lender's
/// `--device` limits and `--store` capacities) so they all read the same.
///
/// # Errors
/// [`SizeError`]: not a number, an unknown suffix, or an overflow.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(SizeError::UnknownSuffix(c)),
            };
            (&s[..i], 1u64 << shift)
        }
        _ => (s, 1),
    };
    let n: u64 = num.parse().map_err(|_| SizeError::Invalid(s.to_owned()))?;
    n.checked_mul(mult)
        .ok_or_else(|| SizeError::TooLarge(s.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn conversions_are_exact_or_errors() {
        assert_eq!(Bytes(4096).to_sectors(), Ok(Sectors(8)));
        assert_eq!(Bytes(0).to_sectors(), Ok(Sectors(0)));
        assert_eq!(
            Bytes(4097).to_sectors(),
            Err(UnitError::NotWholeSectors(4097))
        );
        assert_eq!(Sectors(8).to_bytes(), Ok(Bytes(4096)));
        assert_eq!(Sectors(8_388_607).to_bytes(), Ok(Bytes(u32::MAX - 511)));
        assert!(Sectors(8_388_608).to_bytes().is_err(), "4 GiB: not a u32");
        assert_eq!(Sectors(u32::MAX).bytes_u64(), u64::from(u32::MAX) * 512);
        assert_eq!(Sector(3).offset(), Ok(1536));
        assert_eq!(Sector(u64::MAX / 512).offset(), Ok(u64::MAX - 511));
        assert!(Sector(u64::MAX / 512 + 1).offset().is_err(), "no wrap");
        assert!(Sector(u64::MAX).offset().is_err());
        assert_eq!(Sector::at_offset(1024), Ok(Sector(2)));
        assert!(Sector::at_offset(1000).is_err());
        assert_eq!(Sector(1).after(Sectors(2)), Ok(Sector(3)));
        assert!(Sector(u64::MAX).after(Sectors(1)).is_err());
        assert_eq!(Sector(2).byte_range(512), Ok(1024..1536));
        assert!(Sector(u64::MAX / 512).byte_range(512).is_err());
    }

    proptest! {
        #[test]
        fn bytes_and_sectors_agree(n: u32) {
            let b = Bytes(n);
            match b.to_sectors() {
                Ok(s) => {
                    prop_assert_eq!(s.to_bytes(), Ok(b));
                    prop_assert_eq!(s.bytes_u64(), u64::from(n));
                }
                Err(_) => prop_assert!(n % 512 != 0),
            }
            let s = Sectors(n);
            prop_assert_eq!(s.bytes_u64(), u64::from(n) * 512);
            prop_assert_eq!(s.to_bytes().is_ok(), u64::from(n) * 512 <= u64::from(u32::MAX));
        }

        #[test]
        fn offsets_are_checked_never_wrapped(sector: u64, len: u64) {
            let s = Sector(sector);
            prop_assert_eq!(s.offset().ok(), sector.checked_mul(512));
            let want = sector
                .checked_mul(512)
                .and_then(|o| o.checked_add(len).map(|e| o..e));
            prop_assert_eq!(s.byte_range(len).ok(), want);
            if let Ok(o) = s.offset() {
                prop_assert_eq!(Sector::at_offset(o), Ok(s));
            }
        }
    }

    #[test]
    fn sizes_take_binary_suffixes_in_either_case() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("2000"), Ok(2000));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("128k"), Ok(128 << 10));
        assert_eq!(parse_size("50M"), Ok(52_428_800));
        assert_eq!(parse_size(" 1G "), Ok(1 << 30));
        assert_eq!(parse_size("2t"), Ok(2 << 40));
        assert_eq!(parse_size("4Q"), Err(SizeError::UnknownSuffix('Q')));
        assert_eq!(parse_size("M"), Err(SizeError::Invalid("M".into())));
        assert_eq!(parse_size("-1"), Err(SizeError::Invalid("-1".into())));
        assert_eq!(parse_size("1.5M"), Err(SizeError::Invalid("1.5M".into())));
        assert_eq!(
            parse_size("16777216T"),
            Err(SizeError::TooLarge("16777216T".into()))
        );
        assert_eq!(
            parse_size("4Q").unwrap_err().to_string(),
            "unknown size suffix 'Q' (use K, M, G or T)"
        );
        assert_eq!(
            parse_size("1.5").unwrap_err().to_string(),
            "invalid size \"1.5\""
        );
    }
}
