//! `devlend attach --class ...`: ask the pool for a device that matches, lease it, and
//! hand the lease to the compute agent.

use anyhow::{Context, Result};
use devlend_compute_agent::api::LeaseRef;
use devlend_pool::api::{LeaseGrant, LeaseRequest};
use devlend_pool::client::PoolClient;

/// What the borrower asks the pool for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// Resource class, e.g. `BLOCK`.
    pub class: String,
    /// Smallest capacity accepted, in bytes.
    pub min_capacity_bytes: u64,
    /// Traits the device must all have.
    pub traits: Vec<String>,
    /// Prefer devices with trait `NUMA_<n>`.
    pub numa_node: Option<u32>,
    /// The consumer (the VM's name or id).
    pub vm: String,
    /// Lease time to live in milliseconds; the compute agent renews it every third.
    pub ttl_ms: u64,
    /// Limits on the lease, enforced by the lender.
    pub qos: Option<devlend_fabric::qos::Qos>,
}

/// A lease granted for an attach, to release if the attach fails.
#[derive(Debug)]
pub struct Claimed {
    client: PoolClient,
    /// The grant: the lease and its token.
    pub grant: LeaseGrant,
    /// The reference the compute agent gets.
    pub lease: LeaseRef,
}

/// Places and leases a device at the pool `client` talks to (signed with its key).
///
/// # Errors
/// The pool is unreachable, or nothing matches: the message is the pool's reason (no
/// device of that class, all leased, none with those traits, ...).
pub fn claim(client: PoolClient, w: &Wanted) -> Result<Claimed> {
    // Every server of the pool, as given: the compute agent renews the lease at any of
    // them (not only the one that answered this claim).
    let pool_url = client.pool_url();
    let grant = client
        .create_lease(&LeaseRequest {
            consumer: w.vm.clone(),
            compute_host: devlend_daemon::host_name(),
            ttl_ms: Some(w.ttl_ms),
            class: Some(w.class.clone()),
            min_capacity_bytes: Some(w.min_capacity_bytes),
            traits: w.traits.clone(),
            numa_node: w.numa_node,
            device_id: None,
            generation: None,
            qos: w.qos,
        })
        .with_context(|| format!("no lease from the pool at {pool_url}"))?;
    let lease = LeaseRef {
        pool: pool_url.to_owned(),
        id: grant.lease.id,
        token: grant.token.clone(),
    };
    Ok(Claimed {
        client,
        grant,
        lease,
    })
}

impl Claimed {
    /// Gives the lease back (the attach failed).
    pub fn release(self) {
        let id = self.grant.lease.id;
        if let Err(e) = self.client.release_current(id) {
            eprintln!("devlend: could not release lease {id} ({e}); it lapses at its expiry");
        }
    }
}
