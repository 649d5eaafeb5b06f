//! What every borrower of a lent device shares, whatever its kind (disk or NIC):
//!
//! - [`target`]: where the device is lent from and over which transport, and how a
//!   queue's session to it is opened;
//! - [`timer`]: the reconnect timer a queue's worker waits on (when to reconnect is
//!   `devlend_fabric::reconnect`'s);
//! - [`chain`]: an error with its chain of sources, for logs.

pub mod chain;
pub mod target;
pub mod timer;

pub use chain::DisplayChain;
pub use target::{new_borrower_id, LenderTarget, Transport, CONNECT_TIMEOUT};
pub use timer::RetryTimer;
