//! Unit and property tests of the codec: layouts, readers and writers, and arbitrary
//! input that never panics.

use super::*;
use proptest::prelude::*;

crate::layout! {
    /// Every kind of field, 1 + 2 + 4 + 8 + 3 + 2 = 20 bytes.
    struct All [20] {
        a: u8,
        b: u16,
        c: u32,
        d: u64,
        e: [u8; 3],
        zero: [u8; 2],
    }
}

#[test]
fn a_layout_is_its_fields_in_order_little_endian() {
    let v = All {
        a: 0x01,
        b: 0x0302,
        c: 0x0706_0504,
        d: 0x0f0e_0d0c_0b0a_0908,
        e: [0x10, 0x11, 0x12],
        zero: [0; 2],
    };
    let b = v.encode();
    let want: Vec<u8> = (1..=0x12).chain([0, 0]).collect();
    assert_eq!(b.as_slice(), want.as_slice());
    assert_eq!(All::decode(&b), v);
    assert_eq!(All::LEN, 20);
    // In a longer message, at the cursor.
    let mut buf = [0xffu8; 23];
    let mut w = Writer::new(&mut buf);
    w.put_u8(9).unwrap();
    v.write(&mut w).unwrap();
    assert_eq!(w.position(), 21);
    assert!(v.write(&mut w).is_err(), "no room for a second one");
    assert_eq!(w.position(), 21, "a failed write consumes nothing");
    let mut r = Reader::new(&buf);
    assert_eq!(r.u8(), Ok(9));
    assert_eq!(r.get::<All>(), Ok(v), "a layout is a field");
    assert_eq!(r.remaining(), 2);
    assert!(All::read(&mut r).is_err());
    assert_eq!(r.finish(), Err(CodecError::Trailing { extra: 2 }));
}

#[test]
fn reads_past_the_end_are_errors_and_consume_nothing() {
    let mut r = Reader::new(&[1, 2, 3]);
    assert_eq!(
        r.u32(),
        Err(CodecError::Short {
            at: 0,
            need: 4,
            len: 3
        })
    );
    assert_eq!(r.position(), 0);
    assert_eq!(r.u16(), Ok(0x0201));
    assert!(r.bytes(2).is_err());
    assert!(r.bytes(usize::MAX).is_err(), "no overflow of the cursor");
    assert_eq!(r.bytes(1), Ok(&[3][..]));
    assert!(r.is_empty());
    assert_eq!(r.finish(), Ok(()));
    assert_eq!(r.rest(), &[] as &[u8]);
    assert!(r.u8().is_err());
    let mut w = Writer::new(&mut []);
    assert!(w.put_u8(0).is_err());
    assert!(w.put_zeros(usize::MAX).is_err());
    assert_eq!(w.put_bytes(&[]), Ok(()));
}

#[test]
fn reserved_bytes_must_be_zero() {
    assert_eq!(reserved(&[0, 0, 0], "r"), Ok(()));
    assert_eq!(reserved(&[0, 1, 0], "r"), Err(CodecError::NotZero("r")));
    let mut r = Reader::new(&[0, 0, 7]);
    assert_eq!(r.zeros(2, "pad"), Ok(()));
    assert_eq!(r.zeros(1, "pad"), Err(CodecError::NotZero("pad")));
    assert!(matches!(
        WireError::from(CodecError::NotZero("pad")),
        WireError::Invalid("pad")
    ));
    assert!(matches!(
        WireError::from(CodecError::Short {
            at: 4,
            need: 8,
            len: 6
        }),
        WireError::Truncated { got: 6, want: 12 }
    ));
}

proptest! {
    #[test]
    fn layouts_round_trip(a: u8, b: u16, c: u32, d: u64, e: [u8; 3]) {
        let v = All { a, b, c, d, e, zero: [0; 2] };
        prop_assert_eq!(All::decode(&v.encode()), v);
    }

    #[test]
    fn every_array_decodes_and_encodes_back(bytes: [u8; 20]) {
        prop_assert_eq!(All::decode(&bytes).encode(), bytes);
    }

    #[test]
    fn integers_round_trip_through_a_buffer(a: u8, b: u16, c: u32, d: u64, pad in 0usize..8) {
        let mut buf = vec![0u8; 15 + pad];
        let mut w = Writer::new(&mut buf);
        w.put_u8(a).unwrap();
        w.put_u16(b).unwrap();
        w.put_zeros(pad).unwrap();
        w.put_u32(c).unwrap();
        w.put_u64(d).unwrap();
        prop_assert_eq!(w.remaining(), 0);
        let mut r = Reader::new(&buf);
        prop_assert_eq!(r.u8(), Ok(a));
        prop_assert_eq!(r.u16(), Ok(b));
        prop_assert_eq!(r.zeros(pad, "pad"), Ok(()));
        prop_assert_eq!(r.u32(), Ok(c));
        prop_assert_eq!(r.u64(), Ok(d));
        prop_assert!(r.finish().is_ok());
    }

    /// Arbitrary reads on arbitrary bytes: each succeeds exactly when it fits, and
    /// the cursor never passes the end.
    #[test]
    fn arbitrary_reads_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..64),
        ops in proptest::collection::vec(0u8..8, 0..32),
    ) {
        let mut r = Reader::new(&bytes);
        for op in ops {
            let (left, at) = (r.remaining(), r.position());
            let (need, ok) = match op {
                0 => (1, r.u8().is_ok()),
                1 => (2, r.u16().is_ok()),
                2 => (4, r.u32().is_ok()),
                3 => (8, r.u64().is_ok()),
                4 => (5, r.array::<5>().is_ok()),
                5 => (3, r.bytes(3).is_ok()),
                6 => match r.zeros(2, "z") {
                    Err(CodecError::NotZero(_)) => {
                        prop_assert!(bytes[at..at + 2] != [0, 0]);
                        (2, false)
                    }
                    res => (2, res.is_ok()),
                },
                _ => (20, All::read(&mut r).is_ok()),
            };
            prop_assert!(ok || left < need || op == 6);
            prop_assert!(!ok || left >= need);
            prop_assert!(r.position() <= bytes.len());
            if !ok {
                prop_assert_eq!(r.remaining(), left, "a failed read consumed bytes");
            }
        }
    }

    #[test]
    fn arbitrary_writes_never_panic(
        room in 0usize..48,
        ops in proptest::collection::vec((0u8..6, any::<u64>()), 0..24),
    ) {
        let mut buf = vec![0u8; room];
        let mut w = Writer::new(&mut buf);
        for (op, v) in ops {
            let left = w.remaining();
            let (need, ok) = match op {
                0 => (1, w.put_u8(v as u8).is_ok()),
                1 => (2, w.put_u16(v as u16).is_ok()),
                2 => (4, w.put_u32(v as u32).is_ok()),
                3 => (8, w.put_u64(v).is_ok()),
                4 => ((v % 16) as usize, w.put_zeros((v % 16) as usize).is_ok()),
                _ => (20, All::ZERO.write(&mut w).is_ok()),
            };
            prop_assert_eq!(ok, left >= need);
            if !ok {
                prop_assert_eq!(w.remaining(), left, "a failed write wrote bytes");
            }
        }
    }
}
