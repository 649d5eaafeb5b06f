//! The one little-endian codec of every wire format in this crate (and the gateway's
//! link frames): checked readers and writers over byte slices, and [`layout!`](crate::layout!), which
//! declares a fixed layout once, as its fields in wire order.
//!
//! - [`Reader`] and [`Writer`] move a cursor over a slice. A read or write past its end
//!   is a [`CodecError::Short`], never a panic and never a partial value. A message
//!   built in a `Vec` appends its fields with [`push`].
//! - [`Field`] is what a layout is made of: `u8`, `u16`, `u32`, `u64` (little-endian)
//!   and byte arrays `[u8; N]`, each with its size on the wire.
//! - [`layout!`](crate::layout!) turns a list of fields into a struct with `read`/`write` (in a larger
//!   message) and `decode`/`encode` (a fixed array of exactly its length), and asserts
//!   at compile time that the sizes of its fields add up to the length the protocol
//!   declares for it. No offset is written by hand anywhere: a field's place is the sum
//!   of the sizes before it.
//! - Reserved fields are declared as byte arrays and checked by [`reserved`] (or read
//!   with [`Reader::zeros`]): a reserved byte that is not zero is a
//!   [`CodecError::NotZero`] naming the field.
//!
//! On the hot path (every block request and response header) `decode` and `encode` of a
//! fixed array inline to plain loads and stores: every bound is known at compile time,
//! so the checks fold away.

use crate::WireError;

/// A read or write outside the buffer, a reserved field that is not zero, or bytes left
/// over after a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// `need` bytes at offset `at` do not fit a buffer of `len` bytes.
    #[error("{need} bytes at offset {at} do not fit in {len}")]
    Short {
        /// Where the access started.
        at: usize,
        /// Bytes it needed.
        need: usize,
        /// Bytes in the buffer.
        len: usize,
    },
    /// A reserved field that must be zero was not.
    #[error("{0} not zero")]
    NotZero(&'static str),
    /// A message was longer than its fields.
    #[error("{extra} bytes after the end of a message")]
    Trailing {
        /// Bytes left over.
        extra: usize,
    },
}

impl From<CodecError> for WireError {
    fn from(e: CodecError) -> Self {
        match e {
            CodecError::Short { at, need, len } => WireError::Truncated {
                got: len,
                want: at.saturating_add(need),
            },
            CodecError::NotZero(what) => WireError::Invalid(what),
            CodecError::Trailing { .. } => WireError::Invalid("bytes after the end of a message"),
        }
    }
}

/// Checks that a reserved field is all zero.
///
/// # Errors
/// [`CodecError::NotZero`] with `what` (e.g. `"reserved bytes of a request header"`).
#[inline]
pub fn reserved(bytes: &[u8], what: &'static str) -> Result<(), CodecError> {
    if bytes.iter().all(|&b| b == 0) {
        Ok(())
    } else {
        Err(CodecError::NotZero(what))
    }
}

/// A cursor over bytes to decode, front to back.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `buf`.
    #[inline]
    pub const fn new(buf: &'a [u8]) -> Self {
        Reader { buf, at: 0 }
    }

    /// Bytes read so far.
    #[inline]
    pub const fn position(&self) -> usize {
        self.at
    }

    /// Bytes left.
    #[inline]
    pub const fn remaining(&self) -> usize {
        self.buf.len() - self.at
    }

    /// Whether every byte was read.
    #[inline]
    pub const fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    #[inline]
    fn short(&self, need: usize) -> CodecError {
        CodecError::Short {
            at: self.at,
            need,
            len: self.buf.len(),
        }
    }

    /// Checks that `n` bytes are left, consuming nothing.
    ///
    /// # Errors
    /// [`CodecError::Short`] when fewer are.
    #[inline]
    pub fn ensure(&self, n: usize) -> Result<(), CodecError> {
        if self.remaining() >= n {
            Ok(())
        } else {
            Err(self.short(n))
        }
    }

    /// The next `n` bytes, borrowed from the input.
    ///
    /// # Errors
    /// [`CodecError::Short`] when fewer than `n` are left (nothing is consumed).
    #[inline]
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self.at.checked_add(n).ok_or_else(|| self.short(n))?;
        let s = self.buf.get(self.at..end).ok_or_else(|| self.short(n))?;
        self.at = end;
        Ok(s)
    }

    /// The next `N` bytes as an array.
    ///
    /// # Errors
    /// [`CodecError::Short`] when fewer than `N` are left (nothing is consumed).
    #[inline]
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], CodecError> {
        let a = self
            .buf
            .get(self.at..)
            .and_then(|rest| rest.first_chunk::<N>())
            .ok_or_else(|| self.short(N))?;
        self.at += N;
        Ok(*a)
    }

    /// The next field.
    ///
    /// # Errors
    /// [`CodecError::Short`] when the field does not fit in what is left.
    #[inline]
    pub fn get<T: Field>(&mut self) -> Result<T, CodecError> {
        T::read(self)
    }

    /// A `u8`.
    ///
    /// # Errors
    /// [`CodecError::Short`].
    #[inline]
    pub fn u8(&mut self) -> Result<u8, CodecError> {
        self.get()
    }

    /// A little-endian `u16`.
    ///
    /// # Errors
    /// [`CodecError::Short`].
    #[inline]
    pub fn u16(&mut self) -> Result<u16, CodecError> {
        self.get()
    }

    /// A little-endian `u32`.
    ///
    /// # Errors
    /// [`CodecError::Short`].
    #[inline]
    pub fn u32(&mut self) -> Result<u32, CodecError> {
        self.get()
    }

    /// A little-endian `u64`.
    ///
    /// # Errors
    /// [`CodecError::Short`].
    #[inline]
    pub fn u64(&mut self) -> Result<u64, CodecError> {
        self.get()
    }

    /// `n` reserved bytes, which must be zero.
    ///
    /// # Errors
    /// [`CodecError::Short`], or [`CodecError::NotZero`] with `what` (nothing is
    /// consumed).
    #[inline]
    pub fn zeros(&mut self, n: usize, what: &'static str) -> Result<(), CodecError> {
        let mut ahead = self.clone();
        reserved(ahead.bytes(n)?, what)?;
        *self = ahead;
        Ok(())
    }

    /// Everything left, borrowed from the input.
    #[inline]
    pub fn rest(&mut self) -> &'a [u8] {
        let s = self.buf.get(self.at..).unwrap_or_default();
        self.at = self.buf.len();
        s
    }

    /// Checks that every byte was read.
    ///
    /// # Errors
    /// [`CodecError::Trailing`] with the count of bytes left.
    #[inline]
    pub fn finish(&self) -> Result<(), CodecError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(CodecError::Trailing { extra }),
        }
    }
}

/// Decodes a field (or a [`layout!`](crate::layout!)) that must take all of `bytes`.
///
/// # Errors
/// [`CodecError::Short`] when `bytes` is shorter, [`CodecError::Trailing`] when longer.
#[inline]
pub fn exact<T: Field>(bytes: &[u8]) -> Result<T, CodecError> {
    let mut r = Reader::new(bytes);
    let v = r.get()?;
    r.finish()?;
    Ok(v)
}

/// Appends a field to `out` (for messages built in a `Vec`).
#[inline]
pub fn push<T: Field>(out: &mut Vec<u8>, v: T) {
    v.push(out);
}

/// A cursor over a buffer to encode into, front to back.
#[derive(Debug)]
pub struct Writer<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl<'a> Writer<'a> {
    /// A writer at the start of `buf`.
    #[inline]
    pub fn new(buf: &'a mut [u8]) -> Self {
        Writer { buf, at: 0 }
    }

    /// Bytes written so far.
    #[inline]
    pub const fn position(&self) -> usize {
        self.at
    }

    /// Room left.
    #[inline]
    pub const fn remaining(&self) -> usize {
        self.buf.len() - self.at
    }

    /// Checks that there is room for `n` bytes, writing nothing.
    ///
    /// # Errors
    /// [`CodecError::Short`] when there is not.
    #[inline]
    pub fn ensure(&self, n: usize) -> Result<(), CodecError> {
        if self.remaining() >= n {
            Ok(())
        } else {
            Err(CodecError::Short {
                at: self.at,
                need: n,
                len: self.buf.len(),
            })
        }
    }

    #[inline]
    fn room(&mut self, n: usize) -> Result<&mut [u8], CodecError> {
        let short = CodecError::Short {
            at: self.at,
            need: n,
            len: self.buf.len(),
        };
        let end = self.at.checked_add(n).ok_or(short)?;
        let s = self.buf.get_mut(self.at..end).ok_or(short)?;
        self.at = end;
        Ok(s)
    }

    /// Writes `b`.
    ///
    /// # Errors
    /// [`CodecError::Short`] when it does not fit (nothing is written).
    #[inline]
    pub fn put_bytes(&mut self, b: &[u8]) -> Result<(), CodecError> {
        self.room(b.len())?.copy_from_slice(b);
        Ok(())
    }

    /// Writes `n` zero bytes (a reserved field).
    ///
    /// # Errors
    /// [`CodecError::Short`] when they do not fit (nothing is written).
    #[inline]
    pub fn put_zeros(&mut self, n: usize) -> Result<(), CodecError> {
        self.room(n)?.fill(0);
        Ok(())
    }

    /// Writes a field.
    ///
    /// # Errors
    /// [`CodecError::Short`] when it does not fit (nothing is written).
    #[inline]
    pub fn put<T: Field>(&mut self, v: T) -> Result<(), CodecError> {
        v.write(self)
    }

    /// Writes a `u8`.
    ///
    /// # Errors
    /// [`CodecError::Short`].
    #[inline]
    pub fn put_u8(&mut self, v: u8) -> Result<(), CodecError> {
        self.put(v)
    }

    /// Writes a little-endian `u16`.
    ///
    /// # Errors
    /// [`CodecError::Short`].
    #[inline]
    pub fn put_u16(&mut self, v: u16) -> Result<(), CodecError> {
        self.put(v)
    }

    /// Writes a little-endian `u32`.
    ///
    /// # Errors
    /// [`CodecError::Short`].
    #[inline]
    pub fn put_u32(&mut self, v: u32) -> Result<(), CodecError> {
        self.put(v)
    }

    /// Writes a little-endian `u64`.
    ///
    /// # Errors
    /// [`CodecError::Short`].
    #[inline]
    pub fn put_u64(&mut self, v: u64) -> Result<(), CodecError> {
        self.put(v)
    }
}

/// A field of a wire layout: its size and its little-endian encoding.
pub trait Field: Copy {
    /// Bytes on the wire.
    const SIZE: usize;
    /// The all-zero value.
    const ZERO: Self;
    /// Reads the field.
    ///
    /// # Errors
    /// [`CodecError::Short`].
    fn read(r: &mut Reader<'_>) -> Result<Self, CodecError>;
    /// Writes the field.
    ///
    /// # Errors
    /// [`CodecError::Short`].
    fn write(self, w: &mut Writer<'_>) -> Result<(), CodecError>;
    /// Appends the field to `out`.
    fn push(self, out: &mut Vec<u8>);
}

macro_rules! int_field {
    ($($t:ty),*) => {$(
        impl Field for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            const ZERO: Self = 0;
            #[inline]
            fn read(r: &mut Reader<'_>) -> Result<Self, CodecError> {
                r.array().map(<$t>::from_le_bytes)
            }
            #[inline]
            fn write(self, w: &mut Writer<'_>) -> Result<(), CodecError> {
                w.put_bytes(&self.to_le_bytes())
            }
            #[inline]
            fn push(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}

int_field!(u8, u16, u32, u64);

impl<const N: usize> Field for [u8; N] {
    const SIZE: usize = N;
    const ZERO: Self = [0; N];
    #[inline]
    fn read(r: &mut Reader<'_>) -> Result<Self, CodecError> {
        r.array()
    }
    #[inline]
    fn write(self, w: &mut Writer<'_>) -> Result<(), CodecError> {
        w.put_bytes(&self)
    }
    #[inline]
    fn push(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self);
    }
}

/// Declares a fixed wire layout: a struct of [`Field`]s in wire order, its length, and
/// the codec between them.
///
/// ```
/// devlend_fabric::layout! {
///     /// A made-up 8-byte header.
///     pub struct Example [8] {
///         /// The kind.
///         pub kind: u8,
///         /// Zero.
///         pub reserved: [u8; 3],
///         /// Bytes that follow.
///         pub len: u32,
///     }
/// }
/// let b = Example { kind: 1, reserved: [0; 3], len: 0x0102 }.encode();
/// assert_eq!(b, [1, 0, 0, 0, 2, 1, 0, 0]);
/// assert_eq!(Example::decode(&b).len, 0x0102);
/// ```
///
/// The struct gets `LEN` (the sum of its fields' sizes, asserted at compile time to be
/// the declared length; a layout is itself a [`Field`], so layouts nest), `read`/`write` (at a [`Reader`]'s or [`Writer`]'s position, in
/// a longer message), `decode`/`encode` (exactly `[u8; LEN]`, which cannot fail) and
/// `push` (appended to a `Vec`). The
/// values are not checked: that is the caller's, who turns this raw layout into its
/// typed message (reserved fields with [`reserved`], enums, limits).
#[macro_export]
macro_rules! layout {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident [$len:expr] {
            $( $(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis struct $name {
            $( $(#[$fmeta])* $fvis $field: $ty, )+
        }

        #[allow(dead_code)]
        impl $name {
            /// Bytes on the wire: the sum of the fields' sizes.
            pub const LEN: usize = 0 $( + <$ty as $crate::codec::Field>::SIZE )+;

            /// Every field zero.
            pub const ZERO: Self = Self {
                $( $field: <$ty as $crate::codec::Field>::ZERO, )+
            };

            /// Reads the fields in wire order at the reader's position.
            ///
            /// # Errors
            /// [`CodecError::Short`]($crate::codec::CodecError::Short) when fewer than
            /// [`Self::LEN`] bytes are left (nothing is consumed).
            #[inline]
            pub fn read(
                r: &mut $crate::codec::Reader<'_>,
            ) -> ::core::result::Result<Self, $crate::codec::CodecError> {
                r.ensure(Self::LEN)?;
                // Fields are evaluated in the order written: wire order.
                Ok(Self { $( $field: r.get()?, )+ })
            }

            /// Writes the fields in wire order at the writer's position.
            ///
            /// # Errors
            /// [`CodecError::Short`]($crate::codec::CodecError::Short) when fewer than
            /// [`Self::LEN`] bytes of room are left (nothing is written).
            #[inline]
            pub fn write(
                &self,
                w: &mut $crate::codec::Writer<'_>,
            ) -> ::core::result::Result<(), $crate::codec::CodecError> {
                w.ensure(Self::LEN)?;
                $( w.put(self.$field)?; )+
                Ok(())
            }

            /// Decodes exactly [`Self::LEN`] bytes.
            #[inline]
            pub fn decode(b: &[u8; $len]) -> Self {
                // Cannot fail: the fields take exactly LEN bytes (asserted below).
                Self::read(&mut $crate::codec::Reader::new(b)).unwrap_or(Self::ZERO)
            }

            /// Appends the [`Self::LEN`] bytes to `out`.
            #[inline]
            pub fn push(&self, out: &mut ::std::vec::Vec<u8>) {
                out.extend_from_slice(&self.encode());
            }

            /// Encodes into exactly [`Self::LEN`] bytes.
            #[inline]
            pub fn encode(&self) -> [u8; $len] {
                let mut b = [0u8; $len];
                // Cannot fail: the fields take exactly LEN bytes (asserted below).
                let _ = self.write(&mut $crate::codec::Writer::new(&mut b));
                b
            }
        }

        impl $crate::codec::Field for $name {
            const SIZE: usize = Self::LEN;
            const ZERO: Self = Self::ZERO;
            #[inline]
            fn read(
                r: &mut $crate::codec::Reader<'_>,
            ) -> ::core::result::Result<Self, $crate::codec::CodecError> {
                Self::read(r)
            }
            #[inline]
            fn write(
                self,
                w: &mut $crate::codec::Writer<'_>,
            ) -> ::core::result::Result<(), $crate::codec::CodecError> {
                Self::write(&self, w)
            }
            #[inline]
            fn push(self, out: &mut ::std::vec::Vec<u8>) {
                Self::push(&self, out)
            }
        }

        const _: () = assert!(
            $name::LEN == $len,
            concat!("the fields of ", stringify!($name), " do not add up to its length"),
        );
    };
}

#[cfg(test)]
mod tests;
