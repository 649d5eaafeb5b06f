//! What every borrower of a lent device shares, whatever its kind (disk or NIC):
//!
//! - [`target`]: where the device is lent from and over which transport, and how a
//!   queue's session to it is opened;
//! - `path_cell`: the live state of each path, when there are several, and
//!   [`path_probe`], which finds the paths marked down reachable again;
//! - [`timer`]: the reconnect timer a queue's worker waits on (when to reconnect is
//!   `devlend_fabric::reconnect`'s);
//! - [`chain`]: an error with its chain of sources, for logs.

pub mod chain;
pub(crate) mod path_cell;
pub mod path_probe;
pub mod target;
pub mod timer;

pub use chain::DisplayChain;
pub use target::{new_borrower_id, LenderTarget, Transport, CONNECT_TIMEOUT};
pub use timer::RetryTimer;
