//! The guest's side of a queue: a chain popped from the avail ring becomes a request
//! in its slot (or completes at once), and the chains an earlier backend left in flight
//! are taken back from the inflight buffer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::ratelimit::RateLimit;
use virtio_queue::{Queue, QueueT};
use vm_memory::Bytes;

use super::QueueEngine;
use crate::blk::complete::Completer;
use crate::blk::request::{parse, Disposition};
use crate::blk::resubmit::ResubmitRing;
use crate::blk::spec::S_OK;
use crate::blk::table::NewRequest;
use crate::guest::{GuestMemory, GuestMemoryRef};

impl QueueEngine {
    /// Resubmits the chains an earlier backend left in flight, as the inflight buffer
    /// lists them, in the order they were popped; the avail ring then goes on after
    /// them (its index restarts at the used index plus their number). Returns whether
    /// used-ring entries were added.
    pub(super) fn resubmit(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
    ) -> Result<bool, virtio_queue::Error> {
        let guest_used = queue.used_idx(mem.as_ref(), Ordering::Acquire)?.0;
        let heads = self.table.recover_log(guest_used, queue.size());
        if heads.is_empty() {
            return Ok(false);
        }
        queue.set_next_avail(guest_used.wrapping_add(heads.len() as u16));
        queue.set_next_used(guest_used);
        let Some(mut ring) = ResubmitRing::new(mem, queue, &heads) else {
            tracing::error!(
                attachment = %self.name,
                queue = self.index,
                requests = heads.len(),
                "cannot rebuild the chains left in flight; the guest's requests on them stay pending",
            );
            return Ok(false);
        };
        tracing::info!(
            attachment = %self.name,
            queue = self.index,
            requests = heads.len(),
            "resubmitting the requests an earlier backend left in flight",
        );
        self.stats
            .resubmitted
            .fetch_add(heads.len() as u64, Ordering::Relaxed);
        let mut used = false;
        while let Some(chain) = ring.queue.pop_descriptor_chain(&ring.mem) {
            used |= self.take_chain(queue, mem, chain)?;
        }
        used |= self.flush_tx(queue, mem)?;
        Ok(used)
    }

    /// A chain popped from the avail ring: marked in the inflight buffer, parsed, and
    /// either completed at once (invalid, or answered here) or put in its slot to wait
    /// for the session and its credit ([`Self::flush_tx`]).
    pub(super) fn take_chain(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMemoryRef,
        chain: virtio_queue::DescriptorChain<&GuestMemory>,
    ) -> Result<bool, virtio_queue::Error> {
        self.table.popped(chain.head_index());
        let parsed = parse(
            chain,
            mem,
            &self.limits,
            &mut self.scratch,
            &mut self.iov_tmp,
        );
        let head = parsed.head;
        let req = match parsed.disposition {
            Disposition::NoStatus => {
                Completer::new(queue, mem, &self.stats, self.index).put_used(
                    &mut self.table,
                    head,
                    0,
                )?;
                self.stats.local.fetch_add(1, Ordering::Relaxed);
                return Ok(true);
            }
            Disposition::Complete { status, written } => {
                // The status address was checked to be in guest memory by `parse`.
                let _ = mem.write_obj(status, parsed.status_addr);
                Completer::new(queue, mem, &self.stats, self.index).put_used(
                    &mut self.table,
                    head,
                    written + 1,
                )?;
                self.stats.local.fetch_add(1, Ordering::Relaxed);
                if status != S_OK {
                    self.stats.errors_invalid.fetch_add(1, Ordering::Relaxed);
                }
                return Ok(true);
            }
            Disposition::Submit(_) if !self.table.is_free(head) => {
                static REUSED_HEAD: RateLimit = RateLimit::new(5, Duration::from_secs(10));
                if let Some(suppressed) = REUSED_HEAD.check() {
                    tracing::warn!(
                        attachment = %self.name,
                        queue = self.index,
                        head,
                        suppressed,
                        "guest reused a descriptor head still in flight; chain ignored (logged at most every 10 s)",
                    );
                }
                return Ok(false);
            }
            Disposition::Submit(req) => req,
        };
        let new = NewRequest {
            req,
            status_addr: parsed.status_addr,
        };
        self.table
            .insert(head, new, &mut self.iov_tmp, Arc::clone(mem));
        self.stats.inflight.fetch_add(1, Ordering::Relaxed);
        // Waits in its slot until the session and its credit let it go (`flush_tx`),
        // in submission order.
        if self.conn.is_none() {
            self.retry.waiting(Instant::now());
        }
        Ok(false)
    }
}
