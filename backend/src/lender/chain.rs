//! An error with its chain of sources, for logs: the fabric's formatter, the
//! workspace's only one.

pub use devlend_fabric::error::DisplayChain;
