//! The link's frame codec (layouts in [`super`]): the frame header and the HELLO
//! payload, encoded and validated.
//!
//! This file uses nothing but `std` and `devlend_fabric`: the fuzz target `wire_decode`
//! (`fuzz/`) compiles it by path, so that the gateway's decoders are fuzzed without
//! building the gateway's runtime. A decoder's error is the reason of the protocol
//! violation, for [`super::MuxError::Protocol`].

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

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: u8,
    pub(crate) stream: u32,
    pub(crate) len: u32,
}

pub(crate) fn encode_header(kind: u8, stream: u32, len: u32) -> [u8; FRAME_HEADER_LEN] {
    let mut b = [0u8; FRAME_HEADER_LEN];
    b[0] = kind;
    b[4..8].copy_from_slice(&stream.to_le_bytes());
    b[8..12].copy_from_slice(&len.to_le_bytes());
    b
}

/// Validates a header: kind, reserved bytes, and the length bounds of its kind.
///
/// # Errors
/// Why the header breaks the framing rules.
pub(crate) fn decode_header(b: &[u8; FRAME_HEADER_LEN]) -> Result<Header, String> {
    if b[1] != 0 || b[2] != 0 || b[3] != 0 {
        return Err("non-zero flags or reserved bytes in a frame header".into());
    }
    let h = Header {
        kind: b[0],
        stream: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        len: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
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
        b.extend_from_slice(&HELLO_MAGIC);
        b.push(1);
        b.push(name.len() as u8);
        b.extend_from_slice(&[0, 0]);
        b.extend_from_slice(&self.window.to_le_bytes());
        b.extend_from_slice(name);
        b
    }

    /// Decodes a HELLO's payload `p` (after its header).
    ///
    /// # Errors
    /// Why the HELLO is refused.
    pub(crate) fn decode(p: &[u8]) -> Result<LinkHello, String> {
        let bad = |m: &str| Err(m.to_owned());
        if p.len() < HELLO_FIXED || p[..4] != HELLO_MAGIC {
            return bad("the link HELLO has a bad magic: not a devlend gateway");
        }
        if p[4] != 1 {
            return bad("the link HELLO has an unsupported version");
        }
        if p[6] != 0 || p[7] != 0 {
            return bad("the link HELLO has non-zero reserved bytes");
        }
        let name_len = p[5] as usize;
        if p.len() != HELLO_FIXED + name_len {
            return bad("the link HELLO's cluster name length does not match");
        }
        let window = u32::from_le_bytes([p[8], p[9], p[10], p[11]]);
        if window < MIN_WINDOW {
            return bad("the link HELLO grants a window below 64 KiB");
        }
        let cluster = std::str::from_utf8(&p[HELLO_FIXED..])
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
}
