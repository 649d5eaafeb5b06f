//! devlend's lend protocol: what a borrower (compute agent) and a lender (device agent)
//! say to each other over one fabric connection.
//!
//! One connection carries one virtqueue. It starts with a handshake ([`handshake`]) and
//! then carries block requests and their responses ([`wire`]), many in flight at once,
//! completed in any order. The byte layout is specified in `docs/protocol.md`; the
//! constants and codecs here are the single source of truth for it. Every format is
//! declared and encoded with one checked little-endian codec ([`codec`]); the units of a
//! block request (bytes, 512-byte sectors) are types of their own ([`units`]).
//!
//! Transports: [`tcp`] (the default), optionally inside TLS 1.3 ([`tls`], bridged to the
//! engines through [`conn::Stream`]). RDMA comes behind a cargo feature.
//!
//! [`reconnect`] says when a borrower tries a lost session again, and when it stops.

pub mod codec;
pub mod conn;
pub mod cpu_load;
pub mod error;
pub mod handshake;
pub mod holder_proof;
pub mod identity;
pub mod io_counters;
pub mod io_util;
pub mod kind;
pub mod latency;
pub mod lease_token;
pub mod lender_proof;
pub mod net;
pub mod pci;
pub mod poll_window;
pub mod qos;
pub mod ratelimit;
pub mod rdma;
pub mod reconnect;
pub mod relay;
pub mod tcp;
pub mod text;
pub mod tls;
pub mod transport;
pub mod units;
pub mod wire;

pub use error::WireError;
pub use handshake::{
    BlockGeometry, CoherenceMode, Credit, DeviceDescription, Hello, HelloReply, HelloStatus,
    NicLink, PciIdentity, PciRegion, FEATURE_CREDIT,
};
pub use kind::DeviceKind;
pub use units::{Bytes, Sector, Sectors, UnitError};
pub use wire::{
    BlockRequest, Op, RequestHeader, ResponseHeader, Status, FEATURE_HEARTBEAT,
    FEATURE_THROTTLE_NOTE, HEARTBEAT_FRAME, RESPONSE_THROTTLED,
};

/// Protocol version spoken by this build (the handshake's `version` field). Version 2
/// describes the device in the hello reply by kind ([`DeviceDescription`]); a lender of
/// this build still answers a version 1 hello, and a borrower still reads a version 1
/// reply ([`handshake::v1`], [`handshake::MIN_PROTOCOL_VERSION`]).
pub const PROTOCOL_VERSION: u16 = 2;

/// Size of a logical sector in bytes: every `sector` field on the wire counts these
/// (virtio 1.2 §5.2.6: sectors are 512 bytes regardless of `blk_size`).
pub const SECTOR_SIZE: u64 = 512;

/// Length of a virtio-blk device ID string in bytes (virtio 1.2 §5.2.6, VIRTIO_BLK_T_GET_ID).
pub const SERIAL_LEN: usize = 20;
