//! The relay preamble: how a session asks a cluster gateway (`devlend-gateway`) to carry
//! it to a lender in another cluster.
//!
//! A borrower whose device is addressed `CLUSTER/LENDER/DEVICE`, with `CLUSTER` not its
//! own, connects to its local gateway and sends a [`RelayRequest`] first; the gateway
//! answers a [`RelayReply`]. On [`RelayStatus::Ok`] the connection is from then on a
//! plain byte pipe to the lender, and the devlend handshake ([`crate::handshake`]) runs
//! end to end through it, optionally inside TLS between borrower and lender. The
//! gateways parse nothing after the preamble. Every integer is little-endian; the layout
//! is specified in `docs/gateway.md`.
//!
//! The same request travels between the gateways as the first message of a relayed
//! stream, with `ttl` decreased by one at each gateway that forwards it: a routing loop
//! ends with [`RelayStatus::TtlExceeded`].

use std::io::{Read, Write};

use crate::codec;
use crate::io_util::read_exact_or_eof;
use crate::WireError;

/// Magic bytes of both preamble messages: `"DLGW"`.
pub const RELAY_MAGIC: [u8; 4] = *b"DLGW";
/// Version of the preamble spoken by this build.
pub const RELAY_VERSION: u8 = 1;
/// Size in bytes of the fixed part of a [`RelayRequest`].
pub const REQUEST_FIXED_LEN: usize = 12;
/// Size in bytes of the fixed part of a [`RelayReply`].
pub const REPLY_FIXED_LEN: usize = 8;
/// Longest cluster or lender name, in bytes.
pub const MAX_RELAY_NAME: usize = 64;
/// Longest reply message, in bytes.
pub const MAX_RELAY_MESSAGE: usize = 1024;
/// Hop budget a borrower gives a session: gateways it may cross before it is refused.
pub const DEFAULT_TTL: u8 = 8;

crate::layout! {
    /// The fixed part of a [`RelayRequest`].
    struct RequestFixed [REQUEST_FIXED_LEN] {
        magic: [u8; 4],
        version: u8,
        ttl: u8,
        cluster_len: u8,
        lender_len: u8,
        reserved: [u8; 4],
    }
}

crate::layout! {
    /// The fixed part of a [`RelayReply`].
    struct ReplyFixed [REPLY_FIXED_LEN] {
        magic: [u8; 4],
        version: u8,
        status: u8,
        msg_len: u16,
    }
}

/// Whether `s` is a valid cluster or lender name: 1..=64 bytes of ASCII letters, digits,
/// `-`, `_`, `.` (no `/`, which separates the parts of a device address).
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_RELAY_NAME
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Where a relayed session goes: a lender, by its name in a cluster's gateway
/// configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayRequest {
    /// Hops left: a gateway that would forward a request with `ttl` 0 refuses it.
    pub ttl: u8,
    /// Destination cluster ([`valid_name`]).
    pub cluster: String,
    /// Lender name in that cluster ([`valid_name`]).
    pub lender: String,
}

/// The lengths the fixed part of a [`RelayRequest`] announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestPrefix {
    /// Hops left.
    pub ttl: u8,
    /// Bytes of cluster name that follow.
    pub cluster_len: usize,
    /// Bytes of lender name after the cluster name.
    pub lender_len: usize,
}

impl RequestPrefix {
    /// Bytes that follow the fixed part.
    pub fn rest_len(&self) -> usize {
        self.cluster_len + self.lender_len
    }
}

impl RelayRequest {
    /// A request for `lender` in `cluster` with the [`DEFAULT_TTL`].
    pub fn new(cluster: &str, lender: &str) -> Self {
        RelayRequest {
            ttl: DEFAULT_TTL,
            cluster: cluster.to_owned(),
            lender: lender.to_owned(),
        }
    }

    /// Encodes: `magic "DLGW", version: u8 = 1, ttl: u8, cluster_len: u8, lender_len:
    /// u8, reserved: u32 = 0, cluster, lender`.
    ///
    /// # Errors
    /// [`WireError::Invalid`] when a name is not [`valid_name`].
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        if !valid_name(&self.cluster) {
            return Err(WireError::Invalid("relay cluster name"));
        }
        if !valid_name(&self.lender) {
            return Err(WireError::Invalid("relay lender name"));
        }
        let mut b = Vec::with_capacity(REQUEST_FIXED_LEN + self.cluster.len() + self.lender.len());
        RequestFixed {
            magic: RELAY_MAGIC,
            version: RELAY_VERSION,
            ttl: self.ttl,
            cluster_len: self.cluster.len() as u8,
            lender_len: self.lender.len() as u8,
            reserved: [0; 4],
        }
        .push(&mut b);
        b.extend_from_slice(self.cluster.as_bytes());
        b.extend_from_slice(self.lender.as_bytes());
        Ok(b)
    }

    /// Decodes the fixed part.
    ///
    /// # Errors
    /// [`WireError::BadMagic`], [`WireError::UnsupportedVersion`],
    /// [`WireError::Invalid`] (reserved bytes, an empty name), [`WireError::TooLong`].
    pub fn decode_prefix(b: &[u8; REQUEST_FIXED_LEN]) -> Result<RequestPrefix, WireError> {
        let f = RequestFixed::decode(b);
        if f.magic != RELAY_MAGIC {
            return Err(WireError::BadMagic(f.magic));
        }
        if f.version != RELAY_VERSION {
            return Err(WireError::UnsupportedVersion(u16::from(f.version)));
        }
        codec::reserved(&f.reserved, "reserved bytes of relay request")?;
        let (cluster_len, lender_len) = (usize::from(f.cluster_len), usize::from(f.lender_len));
        for (what, len) in [
            ("relay cluster name", cluster_len),
            ("relay lender name", lender_len),
        ] {
            if len == 0 {
                return Err(WireError::Invalid("empty name in relay request"));
            }
            if len > MAX_RELAY_NAME {
                return Err(WireError::TooLong {
                    what,
                    len: len as u64,
                    limit: MAX_RELAY_NAME as u64,
                });
            }
        }
        Ok(RequestPrefix {
            ttl: f.ttl,
            cluster_len,
            lender_len,
        })
    }

    /// Completes a request from its prefix and the `prefix.rest_len()` bytes after it.
    ///
    /// # Errors
    /// [`WireError::Invalid`] for a name that is not [`valid_name`] or a wrong length.
    pub fn decode_rest(prefix: RequestPrefix, rest: &[u8]) -> Result<Self, WireError> {
        if rest.len() != prefix.rest_len() {
            return Err(WireError::Invalid("relay request length"));
        }
        let (c, l) = rest.split_at(prefix.cluster_len);
        let cluster = std::str::from_utf8(c)
            .ok()
            .filter(|s| valid_name(s))
            .ok_or(WireError::Invalid("relay cluster name"))?;
        let lender = std::str::from_utf8(l)
            .ok()
            .filter(|s| valid_name(s))
            .ok_or(WireError::Invalid("relay lender name"))?;
        Ok(RelayRequest {
            ttl: prefix.ttl,
            cluster: cluster.to_owned(),
            lender: lender.to_owned(),
        })
    }

    /// Decodes a whole request that arrived as one message (the OPEN of a relayed
    /// stream between gateways): the fixed part and exactly the names it announces.
    ///
    /// # Errors
    /// As [`Self::decode_prefix`] and [`Self::decode_rest`]; a message shorter than the
    /// fixed part, or longer or shorter than it announces, is [`WireError::Invalid`].
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let Some((fixed, rest)) = b.split_first_chunk::<REQUEST_FIXED_LEN>() else {
            return Err(WireError::Invalid(
                "relay request shorter than its fixed part",
            ));
        };
        Self::decode_rest(Self::decode_prefix(fixed)?, rest)
    }

    /// Reads and validates a request from a blocking reader.
    ///
    /// # Errors
    /// As [`Self::decode_prefix`] and [`Self::decode_rest`]; [`WireError::Closed`],
    /// [`WireError::Truncated`], [`WireError::Io`].
    pub fn read_from(r: &mut impl Read) -> Result<Self, WireError> {
        let mut b = [0u8; REQUEST_FIXED_LEN];
        read_exact_or_eof(r, &mut b)?;
        let p = Self::decode_prefix(&b)?;
        let mut rest = vec![0u8; p.rest_len()];
        read_exact_or_eof(r, &mut rest)?;
        Self::decode_rest(p, &rest)
    }
}

/// The outcome a gateway reports for a [`RelayRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RelayStatus {
    /// The lender is connected: the devlend handshake may start.
    Ok = 0,
    /// No route to that cluster in the gateway's table.
    UnknownCluster = 1,
    /// The destination cluster's gateway does not know that lender.
    UnknownLender = 2,
    /// The next gateway, or the lender, cannot be reached now (may be transient).
    Unreachable = 3,
    /// The hop budget ran out: a routing loop, or a path longer than the TTL.
    TtlExceeded = 4,
    /// The request was malformed.
    BadRequest = 5,
}

impl RelayStatus {
    /// Decodes a status byte.
    ///
    /// # Errors
    /// [`WireError::UnknownStatus`].
    pub fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            0 => RelayStatus::Ok,
            1 => RelayStatus::UnknownCluster,
            2 => RelayStatus::UnknownLender,
            3 => RelayStatus::Unreachable,
            4 => RelayStatus::TtlExceeded,
            5 => RelayStatus::BadRequest,
            other => return Err(WireError::UnknownStatus(other)),
        })
    }

    /// Whether a retry of the same request may succeed without a configuration change
    /// ([`RelayStatus::Unreachable`] only).
    pub fn is_transient(self) -> bool {
        self == RelayStatus::Unreachable
    }
}

/// A gateway's answer to a [`RelayRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayReply {
    /// The outcome.
    pub status: RelayStatus,
    /// Why, for people (empty on success), at most [`MAX_RELAY_MESSAGE`] bytes.
    pub message: String,
}

impl RelayReply {
    /// A success.
    pub fn ok() -> Self {
        RelayReply {
            status: RelayStatus::Ok,
            message: String::new(),
        }
    }

    /// A refusal with a message (truncated to [`MAX_RELAY_MESSAGE`] bytes on a character
    /// boundary).
    pub fn refuse(status: RelayStatus, message: &str) -> Self {
        RelayReply {
            status,
            message: crate::text::prefix(message, MAX_RELAY_MESSAGE).to_owned(),
        }
    }

    /// Encodes: `magic "DLGW", version: u8 = 1, status: u8, msg_len: u16, message`.
    pub fn encode(&self) -> Vec<u8> {
        let msg = &self.message.as_bytes()[..self.message.len().min(MAX_RELAY_MESSAGE)];
        let mut b = Vec::with_capacity(REPLY_FIXED_LEN + msg.len());
        ReplyFixed {
            magic: RELAY_MAGIC,
            version: RELAY_VERSION,
            status: self.status as u8,
            msg_len: msg.len() as u16,
        }
        .push(&mut b);
        b.extend_from_slice(msg);
        b
    }

    /// Reads and validates a reply from a blocking reader.
    ///
    /// # Errors
    /// [`WireError::BadMagic`], [`WireError::UnsupportedVersion`],
    /// [`WireError::UnknownStatus`], [`WireError::TooLong`], [`WireError::Closed`],
    /// [`WireError::Truncated`], [`WireError::Io`].
    pub fn read_from(r: &mut impl Read) -> Result<Self, WireError> {
        let mut b = [0u8; REPLY_FIXED_LEN];
        read_exact_or_eof(r, &mut b)?;
        let f = ReplyFixed::decode(&b);
        if f.magic != RELAY_MAGIC {
            return Err(WireError::BadMagic(f.magic));
        }
        if f.version != RELAY_VERSION {
            return Err(WireError::UnsupportedVersion(u16::from(f.version)));
        }
        let status = RelayStatus::from_u8(f.status)?;
        let len = usize::from(f.msg_len);
        if len > MAX_RELAY_MESSAGE {
            return Err(WireError::TooLong {
                what: "relay reply message",
                len: len as u64,
                limit: MAX_RELAY_MESSAGE as u64,
            });
        }
        let mut msg = vec![0u8; len];
        read_exact_or_eof(r, &mut msg)?;
        Ok(RelayReply {
            status,
            message: String::from_utf8_lossy(&msg).into_owned(),
        })
    }

    /// Writes the reply in one `write_all`.
    ///
    /// # Errors
    /// [`WireError::Io`].
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), WireError> {
        w.write_all(&self.encode())?;
        Ok(())
    }
}

/// How a borrower reaches a lender in another cluster: through the gateway at the
/// target's address, asking it for `lender` in `cluster`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Destination cluster.
    pub cluster: String,
    /// Lender name in that cluster.
    pub lender: String,
}

/// A device address `CLUSTER/LENDER/DEVICE`, split.
///
/// # Errors
/// A message saying which part is missing or invalid.
pub fn parse_device_address(s: &str) -> Result<(String, String, String), String> {
    let mut parts = s.splitn(3, '/');
    let (Some(c), Some(l), Some(d)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(format!(
            "{s:?} is not a device address CLUSTER/LENDER/DEVICE"
        ));
    };
    if !valid_name(c) {
        return Err(format!(
            "{c:?} is not a valid cluster name (letters, digits, -, _, .)"
        ));
    }
    if !valid_name(l) {
        return Err(format!(
            "{l:?} is not a valid lender name (letters, digits, -, _, .)"
        ));
    }
    if d.is_empty() || d.contains('/') {
        return Err(format!("{d:?} is not a valid device name"));
    }
    Ok((c.to_owned(), l.to_owned(), d.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_rejects_bad_input() {
        let r = RelayRequest::new("site-b", "lender1");
        let b = r.encode().unwrap();
        assert_eq!(b.len(), 12 + 6 + 7);
        assert_eq!(RelayRequest::read_from(&mut b.as_slice()).unwrap(), r);
        let mut bad = b.clone();
        bad[0] = b'X';
        assert!(matches!(
            RelayRequest::read_from(&mut bad.as_slice()),
            Err(WireError::BadMagic(_))
        ));
        let mut bad = b.clone();
        bad[4] = 9;
        assert!(matches!(
            RelayRequest::read_from(&mut bad.as_slice()),
            Err(WireError::UnsupportedVersion(9))
        ));
        let mut bad = b.clone();
        bad[9] = 1;
        assert!(RelayRequest::read_from(&mut bad.as_slice()).is_err());
        let mut bad = b.clone();
        bad[6] = 200;
        assert!(matches!(
            RelayRequest::read_from(&mut bad.as_slice()),
            Err(WireError::TooLong { .. })
        ));
        let mut bad = b.clone();
        bad[12] = b'/';
        assert!(RelayRequest::read_from(&mut bad.as_slice()).is_err());
        let cut = &b[..b.len() - 1];
        assert!(RelayRequest::read_from(&mut &cut[..]).is_err());
        assert!(RelayRequest::new("a/b", "x").encode().is_err());
        // One whole message: exactly the announced names, no more, no less.
        assert_eq!(RelayRequest::decode(&b).unwrap(), r);
        assert!(matches!(
            RelayRequest::decode(&b[..REQUEST_FIXED_LEN - 1]),
            Err(WireError::Invalid(_))
        ));
        assert!(RelayRequest::decode(&b[..b.len() - 1]).is_err());
        let mut long = b.clone();
        long.push(b'x');
        assert!(RelayRequest::decode(&long).is_err());
        assert!(RelayRequest::new("a", "").encode().is_err());
    }

    #[test]
    fn reply_round_trips() {
        let r = RelayReply::refuse(RelayStatus::UnknownCluster, "no route to cluster \"zz\"");
        let b = r.encode();
        assert_eq!(RelayReply::read_from(&mut b.as_slice()).unwrap(), r);
        let mut bad = b.clone();
        bad[5] = 77;
        assert!(RelayReply::read_from(&mut bad.as_slice()).is_err());
        let long = RelayReply::refuse(RelayStatus::BadRequest, &"é".repeat(2000));
        assert!(long.message.len() <= MAX_RELAY_MESSAGE);
        let ok = RelayReply::ok().encode();
        assert_eq!(ok.len(), REPLY_FIXED_LEN);
    }

    #[test]
    fn random_bytes_never_panic_the_decoders() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..50_000 {
            let n = (next() % 200) as usize;
            let mut b: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            if n >= 5 && next() % 2 == 0 {
                b[..4].copy_from_slice(&RELAY_MAGIC);
                b[4] = RELAY_VERSION;
            }
            let _ = RelayRequest::read_from(&mut b.as_slice());
            let _ = RelayReply::read_from(&mut b.as_slice());
            let _ = parse_device_address(&String::from_utf8_lossy(&b));
        }
    }

    #[test]
    fn device_addresses_split() {
        assert_eq!(
            parse_device_address("b/l1/disk0").unwrap(),
            ("b".into(), "l1".into(), "disk0".into())
        );
        assert!(parse_device_address("b/l1").is_err());
        assert!(parse_device_address("/l1/d").is_err());
        assert!(parse_device_address("b/l1/d/e").is_err());
    }
}
