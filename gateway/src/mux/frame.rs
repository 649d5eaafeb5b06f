//! The link's frame codec (layouts in [`super`]): the frame header and the HELLO
//! payload, encoded and validated.
//!
//! This file uses nothing but `std` and `devlend_fabric`: the fuzz target `wire_decode`
//! (`fuzz/`) compiles it by path, so that the gateway's decoders are fuzzed without
//! building the gateway's runtime. A decoder's error is the reason of the protocol
//! violation, for [`super::MuxError::Protocol`]. The layouts are declared with the
//! fabric's codec (`devlend_fabric::layout!`).

use devlend_fabric::codec::{self, Reader};
use devlend_fabric::relay::{MAX_RELAY_NAME, REQUEST_FIXED_LEN};

/// Size of a frame header in bytes.
pub const FRAME_HEADER_LEN: usize = 12;
/// Largest DATA payload, in bytes.
pub const MAX_DATA: usize = 256 << 10;
/// Largest RESET reason, in bytes.
pub const MAX_RESET_MSG: usize = 1024;
/// Smallest per-stream window a gateway may grant, in bytes.
pub const MIN_WINDOW: u32 = 64 << 10;
/// Default per-stream window, in bytes (covers 1.6 GB/s at 20 ms RTT).
pub const DEFAULT_WINDOW: u32 = 32 << 20;

pub(crate) const KIND_HELLO: u8 = 1;
pub(crate) const KIND_OPEN: u8 = 2;
pub(crate) const KIND_DATA: u8 = 3;
pub(crate) const KIND_WINDOW: u8 = 4;
pub(crate) const KIND_FIN: u8 = 5;
pub(crate) const KIND_RESET: u8 = 6;
pub(crate) const KIND_PING: u8 = 7;
pub(crate) const KIND_PONG: u8 = 8;
pub(crate) const HELLO_MAGIC: [u8; 4] = *b"DLMX";
pub(crate) const HELLO_FIXED: usize = 12;
pub(crate) const MAX_OPEN: usize = REQUEST_FIXED_LEN + 2 * MAX_RELAY_NAME;

devlend_fabric::layout! {
    /// A frame header as it is on the wire.
    struct RawHeader [FRAME_HEADER_LEN] {
        kind: u8,
        /// Flags (none defined) and reserved bytes: 0.
        reserved: [u8; 3],
        stream: u32,
        len: u32,
    }
}

devlend_fabric::layout! {
    /// The fixed part of a HELLO's payload.
    struct HelloFixed [HELLO_FIXED] {
        magic: [u8; 4],
        version: u8,
        name_len: u8,
        reserved: [u8; 2],
        window: u32,
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: u8,
    pub(crate) stream: u32,
    pub(crate) len: u32,
}

pub(crate) fn encode_header(kind: u8, stream: u32, len: u32) -> [u8; FRAME_HEADER_LEN] {
    RawHeader {
        kind,
        reserved: [0; 3],
        stream,
        len,
    }
    .encode()
}

/// Validates a header: kind, reserved bytes, and the length bounds of its kind.
///
/// # Errors
/// Why the header breaks the framing rules.
pub(crate) fn decode_header(b: &[u8; FRAME_HEADER_LEN]) -> Result<Header, String> {
    let raw = RawHeader::decode(b);
    if codec::reserved(&raw.reserved, "").is_err() {
        return Err("non-zero flags or reserved bytes in a frame header".into());
    }
    let h = Header {
        kind: raw.kind,
        stream: raw.stream,
        len: raw.len,
    };
    let len = h.len as usize;
    let ok = match h.kind {
        KIND_HELLO => h.stream == 0 && (HELLO_FIXED + 1..=HELLO_FIXED + 64).contains(&len),
        KIND_OPEN => h.stream != 0 && (REQUEST_FIXED_LEN..=MAX_OPEN).contains(&len),
        KIND_DATA => h.stream != 0 && (1..=MAX_DATA).contains(&len),
        KIND_WINDOW => h.stream != 0 && len >= 1,
        KIND_FIN => h.stream != 0 && len == 0,
        KIND_RESET => h.stream != 0 && len <= MAX_RESET_MSG,
        KIND_PING | KIND_PONG => h.stream == 0 && len == 8,
        k => return Err(format!("unknown frame kind {k}")),
    };
    if !ok {
        return Err(format!(
            "frame kind {} with stream {} and length {} is out of range",
            h.kind, h.stream, h.len
        ));
    }
    Ok(h)
}

/// What the HELLO of a link says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkHello {
    /// The sender's cluster.
    pub cluster: String,
    /// The per-stream window the sender grants, in bytes.
    pub window: u32,
}

impl LinkHello {
    /// The whole HELLO frame: header, then payload.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let name = self.cluster.as_bytes();
        let mut b = Vec::with_capacity(FRAME_HEADER_LEN + HELLO_FIXED + name.len());
        b.extend_from_slice(&encode_header(
            KIND_HELLO,
            0,
            (HELLO_FIXED + name.len()) as u32,
        ));
        HelloFixed {
            magic: HELLO_MAGIC,
            version: 1,
            name_len: name.len() as u8,
            reserved: [0; 2],
            window: self.window,
        }
        .push(&mut b);
        b.extend_from_slice(name);
        b
    }

    /// Decodes a HELLO's payload `p` (after its header).
    ///
    /// # Errors
    /// Why the HELLO is refused.
    pub(crate) fn decode(p: &[u8]) -> Result<LinkHello, String> {
        let bad = |m: &str| Err(m.to_owned());
        let mut r = Reader::new(p);
        let f = match HelloFixed::read(&mut r) {
            Ok(f) if f.magic == HELLO_MAGIC => f,
            _ => return bad("the link HELLO has a bad magic: not a devlend gateway"),
        };
        if f.version != 1 {
            return bad("the link HELLO has an unsupported version");
        }
        if codec::reserved(&f.reserved, "").is_err() {
            return bad("the link HELLO has non-zero reserved bytes");
        }
        if r.remaining() != usize::from(f.name_len) {
            return bad("the link HELLO's cluster name length does not match");
        }
        let window = f.window;
        if window < MIN_WINDOW {
            return bad("the link HELLO grants a window below 64 KiB");
        }
        let cluster = std::str::from_utf8(r.rest())
            .ok()
            .filter(|c| devlend_fabric::relay::valid_name(c))
            .ok_or_else(|| "the link HELLO's cluster name is invalid".to_owned())?;
        Ok(LinkHello {
            cluster: cluster.to_owned(),
            window,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_validated() {
        assert!(decode_header(&encode_header(KIND_DATA, 1, 10)).is_ok());
        assert!(decode_header(&encode_header(KIND_DATA, 0, 10)).is_err());
        assert!(decode_header(&encode_header(KIND_DATA, 1, 0)).is_err());
        assert!(decode_header(&encode_header(KIND_DATA, 1, MAX_DATA as u32 + 1)).is_err());
        assert!(decode_header(&encode_header(99, 1, 1)).is_err());
        assert!(decode_header(&encode_header(KIND_PING, 0, 7)).is_err());
        let mut h = encode_header(KIND_FIN, 3, 0);
        h[2] = 1;
        assert!(decode_header(&h).is_err());
        let hello = LinkHello {
            cluster: "site-a".into(),
            window: DEFAULT_WINDOW,
        }
        .encode();
        assert_eq!(
            LinkHello::decode(&hello[FRAME_HEADER_LEN..])
                .unwrap()
                .window,
            DEFAULT_WINDOW
        );
        let mut bad = hello.clone();
        bad[FRAME_HEADER_LEN] = b'X';
        assert!(LinkHello::decode(&bad[FRAME_HEADER_LEN..]).is_err());
    }

    /// Captured from the encoder before it was ported to the fabric's codec (commit
    /// d0c6a3b): the bytes on the wire do not change.
    #[test]
    fn golden_vectors() {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let data = encode_header(KIND_DATA, 0x0102_0304, 0x0506_0708);
        assert_eq!(hex(&data), "030000000403020108070605");
        assert!(decode_header(&data).is_err(), "beyond MAX_DATA");
        let data = encode_header(KIND_DATA, 0x0102_0304, 0x0001_0203);
        assert_eq!(hex(&data), "030000000403020103020100");
        assert_eq!(
            decode_header(&data),
            Ok(Header {
                kind: KIND_DATA,
                stream: 0x0102_0304,
                len: 0x0001_0203
            })
        );
        let fin = encode_header(KIND_FIN, 7, 0);
        assert_eq!(hex(&fin), "050000000700000000000000");
        assert_eq!(
            decode_header(&fin).map(|h| (h.kind, h.stream)),
            Ok((KIND_FIN, 7))
        );
        let hello = LinkHello {
            cluster: "site-a".into(),
            window: 0x0102_0304,
        };
        let b = hello.encode();
        assert_eq!(
            hex(&b),
            "010000000000000012000000444c4d580106000004030201736974652d61"
        );
        let h = decode_header(b[..FRAME_HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(
            (h.kind, h.len as usize),
            (KIND_HELLO, b.len() - FRAME_HEADER_LEN)
        );
        assert_eq!(LinkHello::decode(&b[FRAME_HEADER_LEN..]), Ok(hello));
    }
}
