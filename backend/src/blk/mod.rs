//! The vhost-user-blk backend.
//!
//! - [`spec`]: virtio-blk constants, feature bits and config space (virtio 1.2 §5.2);
//! - [`request`]: descriptor chain → validated request, or an immediate status;
//! - [`engine`]: one virtqueue's requests in flight over one fabric session, resent on
//!   a new one when it is lost; `table`: its table of requests in flight (slots by head,
//!   ids (`request_id`: `(sequence << 16) | head`), the order they go out in, the
//!   session's credit, the inflight-buffer marks);
//!   `pending`: one request's life from pop to used ring; `complete`: returning a chain
//!   to the guest; `stats`: the attachment's counters (where the device is lent from,
//!   the retry timer and the error chain for logs are [`crate::lender`]'s, shared with
//!   [`crate::net`]);
//! - `link`: the session as the engine sees it (a trait; in tests, `fake_link`: an
//!   in-memory lender behind it); `stream`: the stream link (TCP, TLS), with its
//!   receive framing and its non-blocking send queue (`tx`); `rdma` (cargo feature
//!   `rdma`): the RDMA link and the guest memory registered on it; `mr_cache`: which
//!   regions are registered, and until when;
//! - [`probe`]: with several paths to the lender, the thread that finds a path marked
//!   down reachable again, so that its queues move back to it;
//! - [`inflight`]: inflight I/O tracking (INFLIGHT_SHMFD), so that a restarted backend
//!   resubmits what was in flight; [`resubmit`] turns its heads back into chains;
//! - [`backend`]: the `vhost-user-backend` glue of a disk (features, config, its queues'
//!   workers; what every device shares is [`crate::vhost_glue`]'s);
//! - [`attachment`]: re-exports [`crate::attachment`], the attachment of a lent device
//!   of any kind (it moved there: it is not block-only).

/// The attachment moved to [`crate::attachment`]; its old path stays.
pub mod attachment {
    pub use crate::attachment::*;
}
pub mod backend;
mod complete;
pub mod engine;
#[cfg(test)]
mod fake_link;
pub mod holder;
pub mod inflight;
mod pending;
pub use devlend_fabric::latency;
mod link;
#[cfg(any(feature = "rdma", test))]
mod mr_cache;
mod nonblock;
#[cfg(feature = "rdma")]
mod rdma;
pub mod request;
mod request_id;
pub mod resubmit;
pub mod spec;
mod stats;
mod stream;
mod table;
mod tx;

pub use crate::attachment::{Attachment, AttachmentConfig, AttachmentError, Part, Serve};
pub use engine::{QueueEngine, QueueStats, StatsSnapshot};
pub use request::{DeviceLimits, Disposition, Parsed, Request};
