//! The `vhost-user-backend` glue of a lent NIC: one worker per queue pair (its
//! receiveq and transmitq, `queues_per_thread`), each with its fabric socket and timer
//! in the worker's epoll set; and the loop that serves an attachment's socket, a fresh
//! backend per frontend connection.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use devlend_fabric::net::LinkState;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringT};
use virtio_bindings::virtio_net::VIRTIO_NET_F_MRG_RXBUF;
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{EventConsumer, EventNotifier};

use crate::guest::{GuestMemory, Vring};
use crate::lender::LenderTarget;
use crate::net::pair::{PairEngine, PairQueue};
use crate::net::spec::{
    config_slice, config_space, features, guest_offloads, CONFIG_LEN, MAX_QUEUE_SIZE,
};
use crate::net::stats::NetStats;
use crate::vhost_glue::{lock, signal_used, FabricWatch, Glue, Handler, Workers};

struct PairCell {
    engine: PairEngine,
    /// The fabric socket as registered in the worker's epoll set.
    watch: FabricWatch,
    timer_registered: bool,
    /// The pair's receiveq and transmitq, from the worker's first event.
    vrings: Option<(Vring, Vring)>,
}

impl PairCell {
    /// Whether the guest uses the pair: its receiveq or transmitq started by the
    /// frontend (and not stopped since) and enabled.
    fn runs(&self) -> bool {
        self.vrings
            .as_ref()
            .is_some_and(|(rx, tx)| ring_runs(rx) || ring_runs(tx))
    }
}

/// Whether the frontend started ring `v` (and has not stopped it) and enabled it.
fn ring_runs(v: &Vring) -> bool {
    let state = v.get_ref();
    state.get_queue().ready() && state.is_enabled()
}

/// The vhost-user-net backend of one frontend connection.
pub struct NetBackend {
    pairs: Vec<Mutex<PairCell>>,
    config: [u8; CONFIG_LEN],
    /// Guest memory, epoll handlers, exit eventfds and a live migration's handover of
    /// the NIC ([`crate::handover`]); one worker per queue pair.
    glue: Glue<NetBackend>,
    acked: std::sync::atomic::AtomicU64,
    offload: bool,
}

impl NetBackend {
    /// A backend for `pairs` queue pairs of attachment `name`.
    ///
    /// # Errors
    /// A timerfd could not be created.
    pub fn new(
        name: Arc<str>,
        target: &LenderTarget,
        pairs: u16,
        link: &LinkState,
        offload: bool,
        stats: Arc<NetStats>,
    ) -> io::Result<Self> {
        // A pair opens its session when the guest first runs it (its rings started and
        // enabled): the lender spreads the frames it receives over the open sessions by
        // flow, and a pair the guest does not use (a VM without multiqueue, a guest with
        // fewer vCPUs than pairs) would get flows the guest never sees, and keep the NIC
        // held at the end of a migration. Once open, a session stays across ring stops
        // (a link down stops the rings; the lender's return brings the link back). A
        // migration's destination so opens its sessions when its VM runs, and a source
        // whose VM resumes can take the NIC back until then.
        stats.new_backend();
        let cells = (0..pairs)
            .map(|i| {
                let mut engine = PairEngine::new(i, name.clone(), target.clone(), stats.clone())?;
                engine.pause();
                Ok(Mutex::new(PairCell {
                    engine,
                    watch: FabricWatch::default(),
                    timer_registered: false,
                    vrings: None,
                }))
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(NetBackend {
            pairs: cells,
            config: config_space(link, pairs),
            glue: Glue::new(Workers::new(usize::from(pairs), 2)),
            acked: std::sync::atomic::AtomicU64::new(0),
            offload,
        })
    }

    /// Lets the NIC go when the frontend stops it while `handover` is asked for, and
    /// takes it back when the frontend starts it again ([`crate::handover`]).
    pub fn with_handover(mut self, handover: Arc<crate::handover::Handover>) -> Self {
        self.glue.set_handover(handover);
        self
    }

    /// The guest memory map the daemon must be created with.
    pub fn memory(&self) -> GuestMemoryAtomic<GuestMemory> {
        self.glue.memory()
    }

    /// Takes the daemon's per-worker handlers, opens each pair's fabric session and
    /// registers its socket and timer.
    pub fn attach_handlers(&self, handlers: &[Arc<Handler<NetBackend>>]) {
        self.glue.attach_handlers(handlers);
        for q in 0..self.pairs.len() {
            let mut cell = lock(&self.pairs[q]);
            cell.engine.start();
            self.sync_registration(q, &mut cell);
        }
    }

    fn sync_registration(&self, q: usize, cell: &mut PairCell) {
        let Some(handler) = self.glue.handler(q) else {
            return;
        };
        let workers = self.glue.workers();
        if !cell.timer_registered {
            if let Err(e) = handler.register_listener(
                cell.engine.timer_fd(),
                EventSet::IN,
                workers.timer_event(),
            ) {
                tracing::error!(pair = q, error = %e, "cannot watch the pair's timer");
            }
            cell.timer_registered = true;
        }
        let now = cell.engine.fabric_fd();
        if let Err(e) = cell.watch.update(&*handler, now, workers.fabric_event()) {
            tracing::error!(pair = q, error = %e, "cannot watch the fabric socket");
        }
    }

    /// Closes the exit eventfds the library's workers leave open; call once the daemon
    /// is gone.
    pub fn close_exit_fds(&self) {
        self.glue.close_exit_fds();
    }
}

impl VhostUserBackend for NetBackend {
    /// Each region's dirty log, which SET_LOG_BASE points at the frontend's (vhost-user
    /// "Migration"); with `()` the library would panic on SET_LOG_BASE.
    type Bitmap = vhost_user_backend::bitmap::BitmapMmapRegion;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.glue.workers().num_queues()
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        features(self.offload)
    }

    fn acked_features(&self, features: u64) {
        self.acked.store(features, Ordering::Relaxed);
        let mrg = features & (1 << VIRTIO_NET_F_MRG_RXBUF) != 0;
        let rx_offloads = guest_offloads(features);
        for cell in &self.pairs {
            let mut c = lock(cell);
            c.engine.set_mergeable(mrg);
            c.engine.set_guest_offloads(rx_offloads);
        }
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        crate::vhost_glue::protocol_features()
    }

    fn set_event_idx(&self, _enabled: bool) {}

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        config_slice(&self.config, offset, size)
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMemory>) -> io::Result<()> {
        self.glue.memory_changed(&mem.memory());
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        self.glue.workers().queues_per_thread()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        self.glue.exit_event()
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        let Some((pair, place)) = self.glue.workers().worker_of(queue_index) else {
            return Ok(());
        };
        // The frontend re-initializes the queue after this: a queue the driver broke is
        // served again then.
        let side = if place == 0 {
            PairQueue::Rx
        } else {
            PairQueue::Tx
        };
        let Some(cell) = self.pairs.get(pair) else {
            return Ok(());
        };
        let letting_go = {
            let mut cell = lock(cell);
            cell.engine.reset_broken(side);
            // The end of a live migration: the pair's session closes so that the lender
            // can hand the NIC over.
            let letting_go = self.glue.handover().ring_stopped();
            if letting_go {
                cell.engine.pause();
                self.sync_registration(pair, &mut cell);
            }
            letting_go
        };
        if letting_go {
            // The frontend stops only the rings it started: a pair the guest does not
            // run gets no stop. It has a session only if the guest ran it before (a
            // pair opens its session when first run), and that session would keep the
            // NIC held here, the lender refusing the destination. It has nothing in
            // flight of the guest's.
            for (q, cell) in self.pairs.iter().enumerate() {
                let mut cell = lock(cell);
                if !cell.runs() && !cell.engine.is_paused() {
                    cell.engine.pause();
                    self.sync_registration(q, &mut cell);
                    tracing::debug!(
                        pair = q,
                        "a queue pair the guest does not run lets the NIC go too"
                    );
                }
            }
        }
        Ok(())
    }

    fn reset_device(&self) {
        for cell in &self.pairs {
            let mut c = lock(cell);
            c.engine.reset_broken(PairQueue::Rx);
            c.engine.reset_broken(PairQueue::Tx);
        }
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        let (Some(cell), Some(rx), Some(tx)) =
            (self.pairs.get(thread_id), vrings.first(), vrings.get(1))
        else {
            return Ok(());
        };
        let mut cell = lock(cell);
        if cell.vrings.is_none() {
            cell.vrings = Some((rx.clone(), tx.clone()));
        }
        let mem = self.glue.map();
        let mut rxs = rx.get_mut();
        let mut txs = tx.get_mut();
        let (mut rx_used, mut tx_used) = (false, false);
        let rx_ready = rxs.get_queue().ready();
        let tx_ready = txs.get_queue().ready();
        if (rx_ready && rxs.is_enabled()) || (tx_ready && txs.is_enabled()) {
            // The VM runs (again): a NIC let go for a migration that failed is taken
            // back; the pair's session opens (a destination's too).
            self.glue.frontend_runs();
            cell.engine.resume();
        }
        let ev = u64::from(device_event);
        let workers = self.glue.workers();
        // An error here is the guest's (its rings are not in its memory): it breaks
        // that virtqueue, and the worker goes on; returning it would end the worker and
        // with it the NIC.
        if ev == workers.fabric_event() {
            if evset.contains(EventSet::OUT) {
                cell.engine.flush();
                if tx_ready {
                    let r = cell.engine.on_tx(txs.get_queue_mut(), &mem);
                    tx_used |= cell.engine.ring_result(PairQueue::Tx, r);
                }
            }
            let q = rx_ready.then(|| rxs.get_queue_mut());
            let r = cell.engine.on_fabric(q, &mem);
            rx_used |= cell.engine.ring_result(PairQueue::Rx, r);
        } else if ev == workers.timer_event() {
            let q = rx_ready.then(|| rxs.get_queue_mut());
            let r = cell.engine.on_timer(q, &mem);
            rx_used |= cell.engine.ring_result(PairQueue::Rx, r);
        } else if device_event == 0 && rx_ready {
            let r = cell.engine.deliver_held(rxs.get_queue_mut(), &mem);
            rx_used |= cell.engine.ring_result(PairQueue::Rx, r);
        } else if device_event == 1 && tx_ready {
            let r = cell.engine.on_tx(txs.get_queue_mut(), &mem);
            tx_used |= cell.engine.ring_result(PairQueue::Tx, r);
        }
        if self.glue.memory_lost() {
            for q in [PairQueue::Rx, PairQueue::Tx] {
                cell.engine.break_queue(q, crate::sigbus::LOST.into());
            }
        }
        // A used ring that cannot be read for its event index: signal (the guest's
        // loss, not the worker's).
        if rx_used {
            signal_used(&mut rxs, &mem)?;
        }
        if tx_used {
            signal_used(&mut txs, &mem)?;
        }
        // virtio 1.2 §2.1.2: the device needs a reset. vhost-user's way to say so is
        // the vring's error eventfd (SET_VRING_ERR).
        for (q, state) in [(PairQueue::Rx, &rxs), (PairQueue::Tx, &txs)] {
            if cell.engine.take_newly_broken(q) {
                if let Err(e) = state.signal_err() {
                    devlend_fabric::limited!(warn, pair = thread_id, error = %e, "cannot signal the vring's error eventfd");
                }
            }
        }
        drop((rxs, txs));
        self.sync_registration(thread_id, &mut cell);
        Ok(())
    }
}
