//! Quality of service on the lender: the limits of each borrower of a device, and the
//! division of a backing store's capacity by weight (`docs/qos.md`).
//!
//! A device's holder (one borrower, all its sessions) gets one [`Group`] when its first
//! session opens: the device's configured limits and its lease's (from the lease
//! token, [`devlend_fabric::qos`]), the tighter of each, as token buckets
//! ([`bucket`]). Its block sessions draw from the group through the block I/O's
//! `Throttled` (`block/io/throttled.rs`), which holds a request that would overdraw
//! until the buckets allow it, in arrival order, and never fails it; its NIC sessions
//! pace their frames the same way (`nic/pump.rs`).
//!
//! A device may name a [`Store`] (`store = "NAME"`, and a `[[store]]` table with the
//! store's capacity): every holder of a device on that store then also draws from the
//! store's capacity times its share, its weight over the sum of the weights of the
//! holders busy on the store in the last [`group::BUSY_WINDOW`].
//!
//! A leaf module: it depends on nothing of the lender's.

pub(crate) mod bucket;
pub(crate) mod group;

pub(crate) use bucket::Cost;
pub(crate) use group::{Group, Store};
