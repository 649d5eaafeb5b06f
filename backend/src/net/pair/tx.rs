//! A queue pair's transmit side: chains from the guest's transmitq become frame
//! messages queued for the lender, written without blocking.

use super::*;

impl PairEngine {
    /// The guest transmitted: frames go to the lender (or are dropped while it is away).
    /// Returns whether used entries were added to the transmitq.
    ///
    /// A ring the driver corrupted (an avail index more than the queue size ahead, a
    /// head out of range, a malformed chain) breaks the transmitq: nothing more is
    /// taken from it until the frontend re-initializes it. A well-formed chain holding a
    /// bad frame (too short, too long, a bad offload header) is dropped, counted, and
    /// returned to the guest.
    ///
    /// # Errors
    /// A guest memory error on the rings (the caller breaks the transmitq).
    pub fn on_tx(
        &mut self,
        txq: &mut Queue,
        mem: &GuestMemory,
    ) -> Result<bool, virtio_queue::Error> {
        let mut used = false;
        if self.tx_broken.is_broken() {
            return Ok(false);
        }
        loop {
            txq.disable_notification(mem)?;
            // A corrupt avail index would make this loop spin (virtio-queue takes no
            // chain, and says more are there).
            if let Some(why) = crate::virtq::avail_violation(txq, mem)? {
                self.break_queue(PairQueue::Tx, why);
                break;
            }
            while self.out.len() < OUT_LIMIT {
                let Some(chain) = txq.pop_descriptor_chain(mem) else {
                    break;
                };
                let head = chain.head_index();
                if let Some(why) = crate::virtq::head_violation(txq, head)
                    .or_else(|| crate::virtq::chain_violation(txq, mem, head))
                {
                    // Not taken: GET_VRING_BASE names this chain as the next.
                    txq.set_next_avail(txq.next_avail().wrapping_sub(1));
                    self.break_queue(PairQueue::Tx, why);
                    break;
                }
                self.take_tx(chain, mem);
                txq.add_used(mem, head, 0)?;
                used = true;
            }
            self.flush();
            if self.tx_broken.is_broken() {
                break;
            }
            if self.out.len() >= OUT_LIMIT {
                // Resumed when the socket drains (the worker watches it for writability).
                break;
            }
            if !txq.enable_notification(mem)? {
                break;
            }
        }
        Ok(used)
    }

    fn take_tx(&mut self, chain: virtio_queue::DescriptorChain<&GuestMemory>, mem: &GuestMemory) {
        let s = &self.stats.pairs[usize::from(self.index)];
        let Ok(mut r) = chain.reader(mem) else {
            s.errors.fetch_add(1, Ordering::Relaxed);
            s.tx_drops.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let total = r.available_bytes();
        let len = total.saturating_sub(NET_HDR_LEN);
        if total < NET_HDR_LEN + net::MIN_FRAME_LEN || len > net::MAX_OFFLOAD_FRAME_LEN {
            s.errors.fetch_add(1, Ordering::Relaxed);
            s.tx_drops.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if self.conn.is_none() {
            s.tx_drops.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut hdr = [0u8; NET_HDR_LEN];
        if r.read_exact(&mut hdr).is_err() {
            s.errors.fetch_add(1, Ordering::Relaxed);
            s.tx_drops.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // The first 10 bytes of virtio_net_hdr_v1 (num_buffers is for receiving):
        // what the guest leaves to the device (virtio 1.2 §5.1.6.2).
        let mut first = [0u8; net::OFFLOAD_LEN];
        first.copy_from_slice(&hdr[..net::OFFLOAD_LEN]);
        let offload = Offload::from_bytes(&first);
        let plain = offload.is_none();
        let refused = if plain {
            len > net::MAX_FRAME_LEN
        } else {
            // Offloads are offered only when the lender grants them; a restarted lender
            // that does not cannot complete this frame.
            !self.offload || offload.validate(len, false).is_err()
        };
        if refused {
            s.errors.fetch_add(1, Ordering::Relaxed);
            s.tx_drops.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let start = self.out.len();
        let data = if plain {
            self.out
                .extend_from_slice(&net::header(net::KIND_FRAME, len as u32));
            start + net::NET_HEADER_LEN
        } else {
            self.out.extend_from_slice(&net::header(
                net::KIND_FRAME_OFFLOAD,
                (net::OFFLOAD_LEN + len) as u32,
            ));
            self.out.extend_from_slice(&first);
            if offload.gso_type != net::GSO_NONE {
                s.tx_gso.fetch_add(1, Ordering::Relaxed);
            }
            start + net::NET_HEADER_LEN + net::OFFLOAD_LEN
        };
        self.out.resize(data + len, 0);
        if r.read_exact(&mut self.out[data..]).is_err() {
            self.out.truncate(start);
            s.errors.fetch_add(1, Ordering::Relaxed);
            s.tx_drops.fetch_add(1, Ordering::Relaxed);
            return;
        }
        s.tx_packets.fetch_add(1, Ordering::Relaxed);
        s.tx_bytes.fetch_add(len as u64, Ordering::Relaxed);
    }

    /// Writes as much queued output as the socket takes now.
    pub fn flush(&mut self) {
        let mut at = 0;
        let mut failed = None;
        if let Some(conn) = self.conn.as_ref() {
            while at < self.out.len() {
                match (&mut &*conn).write(&self.out[at..]) {
                    Ok(0) => {
                        failed = Some("the lender accepts no data".to_owned());
                        break;
                    }
                    Ok(n) => at += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        failed = Some(e.to_string());
                        break;
                    }
                }
            }
        }
        match failed {
            Some(why) => self.lose(&why),
            None => {
                self.out.drain(..at);
            }
        }
    }
}
