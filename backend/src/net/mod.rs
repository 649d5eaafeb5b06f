//! The vhost-user-net backend: a lent NIC presented to a guest as virtio-net.
//!
//! - [`spec`]: feature bits and config space (virtio 1.2 §5.1);
//! - [`rx`]: a frame written into the guest's receive buffers, spanning several with
//!   mergeable buffers (`num_buffers`, §5.1.6.4);
//! - [`pair`]: one queue pair (receiveq + transmitq) over one fabric connection: frames
//!   each way, held briefly when the guest has posted no buffer, dropped and counted
//!   when the lender is away, reconnection with backoff;
//! - [`stats`]: the counters of the pairs, and the link as last reported;
//! - [`backend`]: the `vhost-user-backend` glue of a NIC, one worker per queue pair
//!   (what every device shares is [`crate::vhost_glue`]'s), and the serving loop of an
//!   attachment.

pub mod backend;
pub mod pair;
pub mod rx;
pub mod spec;
pub mod stats;

pub use backend::NetBackend;
pub use stats::{NetStats, NetStatsSnapshot};
