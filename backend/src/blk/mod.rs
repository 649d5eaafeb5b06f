//! The vhost-user-blk backend.
//!
//! - [`spec`]: virtio-blk constants, feature bits and config space (virtio 1.2 §5.2);
//! - [`request`]: descriptor chain → validated request, or an immediate status;
//! - [`engine`]: one virtqueue's requests in flight over one fabric connection, resent
//!   on a new one when it is lost;
//! - [`timer`]: the reconnect timer a queue's worker waits on;
//! - [`backend`]: the `vhost-user-backend` glue (features, config, workers);
//! - [`attachment`]: a listening vhost-user socket served for one lent device.

pub mod attachment;
pub mod backend;
pub mod engine;
pub mod holder;
pub use devlend_fabric::latency;
pub mod request;
pub mod spec;
mod tcp;
pub mod timer;

pub use attachment::{Attachment, AttachmentConfig, AttachmentError};
pub use engine::{QueueEngine, QueueStats, StatsSnapshot};
pub use request::{DeviceLimits, Disposition, Parsed, Request};
