//! The `vhost-user-backend` glue for one vhost-user connection.
//!
//! One worker thread per virtqueue (`queues_per_thread`), each with its own fabric
//! connection registered in the worker's epoll set under [`BlkBackend::fabric_event`].
//! The library's vring lock and a per-queue engine mutex are the only locks on the
//! path; each is taken once per batch and only the queue's own worker takes them during
//! I/O (GET_VRING_BASE takes them to drain, after the library stopped the ring).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use devlend_fabric::poll_window::PollWindow;
use vhost::vhost_user::message::{
    VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost_user_backend::{VhostUserBackend, VringT};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{EventConsumer, EventNotifier};

use crate::blk::engine::{QueueEngine, QueueStats};
use crate::blk::inflight::InflightRegion;
use crate::blk::request::DeviceLimits;
use crate::blk::spec::{
    config_field, config_slice, config_space, features, CONFIG_LEN, MAX_QUEUE_SIZE,
};
use crate::guest::{GuestMemory, Vring};
use crate::handover::Handover;
use crate::lender::LenderTarget;
use crate::vhost_glue::{lock, signal_used, FabricWatch, Glue, Handler, RingState, Workers};

/// How long GET_VRING_BASE and detach wait for requests in flight before failing them.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

struct QueueCell {
    engine: QueueEngine,
    vring: Option<Vring>,
    /// The fabric socket as registered in the worker's epoll set.
    watch: FabricWatch,
    /// How long the worker polls after its last work ([`BlkBackend::with_poll`]).
    poll: PollWindow,
    /// When the worker last found work (polling on).
    last_work: Option<Instant>,
}

/// The vhost-user-blk backend of one frontend connection.
pub struct BlkBackend {
    limits: Arc<DeviceLimits>,
    config: [u8; CONFIG_LEN],
    queues: Vec<Mutex<QueueCell>>,
    /// Guest memory, epoll handlers, exit eventfds and a live migration's handover of
    /// the device ([`crate::handover`]); one worker per virtqueue.
    glue: Glue<BlkBackend>,
    stopping: AtomicBool,
}

/// Longest busy-poll in one event handler call: the locks of the queue are then let go.
pub const MAX_POLL_SLICE: Duration = Duration::from_millis(1);

impl BlkBackend {
    /// A backend for `num_queues` virtqueues of attachment `name`; opens one fabric
    /// session per queue (a failed one is retried on the queue's next request).
    pub fn new(
        name: Arc<str>,
        limits: Arc<DeviceLimits>,
        num_queues: u16,
        target: &LenderTarget,
        stats: Arc<QueueStats>,
        reconnect_deadline: Duration,
    ) -> Self {
        let incoming = target.is_successor();
        let queues = (0..num_queues)
            .map(|i| {
                let mut engine = QueueEngine::new(i, target.clone(), limits.clone(), stats.clone())
                    .named(name.clone())
                    .with_deadline(reconnect_deadline);
                // A migration's destination opens its sessions at its VM's first
                // request, so that a source whose VM resumes can take the device back
                // until then ([`crate::handover`]).
                if !incoming {
                    if let Err(e) = engine.connect() {
                        tracing::warn!(queue = i, error = %crate::lender::DisplayChain(&e), "cannot open fabric session yet");
                    }
                }
                Mutex::new(QueueCell {
                    engine,
                    vring: None,
                    watch: FabricWatch::default(),
                    poll: PollWindow::new(Duration::ZERO),
                    last_work: None,
                })
            })
            .collect();
        BlkBackend {
            config: config_space(&limits, num_queues),
            limits,
            queues,
            glue: Glue::new(Workers::new(usize::from(num_queues), 1)),
            stopping: AtomicBool::new(false),
        }
    }

    /// Lets the device go when the frontend stops it while `handover` is asked for, and
    /// takes it back when the frontend starts it again ([`crate::handover`]).
    pub fn with_handover(mut self, handover: Arc<Handover>) -> Self {
        self.glue.set_handover(handover);
        self
    }

    /// Makes each queue's worker busy-poll the guest's ring and the fabric after it
    /// handled an event, before it sleeps again, for an adaptive window of at most
    /// `poll` ([`PollWindow`]: grown while the next work comes within `poll`, dropped
    /// to 0 after a longer wait, so an idle queue polls not at all). Zero: interrupt-
    /// driven, the default. Lower latency, for CPU time.
    pub fn with_poll(mut self, poll: Duration) -> Self {
        for q in &mut self.queues {
            q.get_mut().unwrap_or_else(PoisonError::into_inner).poll = PollWindow::new(poll);
        }
        self
    }

    /// The guest memory map that the daemon must be created with (the library updates
    /// it on SET_MEM_TABLE / ADD_MEM_REG).
    pub fn memory(&self) -> GuestMemoryAtomic<GuestMemory> {
        self.glue.memory()
    }

    /// The epoll event id of the fabric socket in each worker: above every queue index
    /// and the reserved id `num_queues`.
    pub fn fabric_event(&self) -> u16 {
        self.glue.workers().fabric_event() as u16
    }

    /// The epoll event id of each worker's reconnect timer.
    pub fn timer_event(&self) -> u16 {
        self.glue.workers().timer_event() as u16
    }

    /// Takes the daemon's per-worker epoll handlers and registers each queue's fabric
    /// socket in its worker.
    pub fn attach_handlers(&self, handlers: &[Arc<Handler<BlkBackend>>]) {
        self.glue.attach_handlers(handlers);
        for q in 0..self.queues.len() {
            let mut cell = lock(&self.queues[q]);
            self.sync_registration(q, &mut cell, true);
            if let (Some(fd), Some(h)) = (cell.engine.timer_fd(), handlers.get(q)) {
                if let Err(e) = h.register_listener(fd, EventSet::IN, u64::from(self.timer_event()))
                {
                    tracing::error!(queue = q, error = %e, "cannot watch the reconnect timer");
                }
            }
        }
    }

    /// Keeps the worker's epoll set watching the queue's current fabric fd while
    /// `watch` (the queue runs): for readability always, for writability while the
    /// engine has requests that the socket did not take (level-triggered, so only then).
    /// Without `watch`, the fd is not watched at all.
    fn sync_registration(&self, q: usize, cell: &mut QueueCell, watch: bool) {
        let (fd, gen) = cell.engine.fabric_fd();
        let fd = fd.filter(|_| watch);
        let now = (fd, gen, fd.is_some() && cell.engine.wants_write());
        if cell.watch.is(now) {
            return;
        }
        let Some(handler) = self.glue.handler(q) else {
            return;
        };
        let id = self.glue.workers().fabric_event();
        if let Err(e) = cell.watch.update(&*handler, now, id) {
            tracing::error!(queue = q, error = %e, "cannot watch fabric socket");
        }
    }

    /// Stops taking requests from the guest and waits for those in flight to complete
    /// (detach). Used entries are returned and the guest is notified. With `handoff`
    /// (the agent stops to be restarted), requests that cannot complete in time are left
    /// for the next backend instead of failed ([`QueueEngine::set_handoff`]).
    pub fn drain_all(&self, timeout: Duration, handoff: bool) {
        self.stopping.store(true, Ordering::Release);
        for (q, cell) in self.queues.iter().enumerate() {
            let mut cell = lock(cell);
            cell.engine.set_stopping();
            if handoff {
                cell.engine.set_handoff();
            }
            if let Err(e) = self.drain_queue(&mut cell, timeout) {
                tracing::warn!(queue = q, error = %e, "drain failed");
            }
        }
    }

    fn drain_queue(&self, cell: &mut QueueCell, timeout: Duration) -> io::Result<()> {
        if cell.engine.inflight() == 0 {
            return Ok(());
        }
        let Some(vring) = cell.vring.clone() else {
            return Ok(());
        };
        let mem = self.glue.map();
        let mut state = vring.get_mut();
        let used = cell
            .engine
            .drain(state.get_queue_mut(), &mem, timeout)
            .map_err(io::Error::other)?;
        if used {
            state.signal_used_queue()?;
        }
        Ok(())
    }

    /// A live migration's handover lets the device go: the sessions of the queues whose
    /// ring is not started close too. The frontend stops only the rings it started
    /// (GET_VRING_BASE), and a driver may start fewer queues than the device has (a
    /// guest with fewer CPUs than queues): such a queue has no request in flight, and
    /// its session, opened when the frontend connected, would otherwise keep the
    /// device held here, the lender refusing the destination. A started ring closes
    /// its own session when the frontend stops it, after its requests completed.
    fn let_go_unstarted(&self) {
        for (q, cell) in self.queues.iter().enumerate() {
            let mut cell = lock(cell);
            let started = cell
                .vring
                .as_ref()
                .is_some_and(|v| v.get_ref().get_queue().ready());
            if started || cell.engine.fabric_fd().0.is_none() {
                continue;
            }
            cell.engine.let_go();
            self.sync_registration(q, &mut cell, false);
            tracing::debug!(
                queue = q,
                "a queue the guest never started lets the device go too"
            );
        }
    }

    /// Gives each queue its part of the inflight buffer (queues past its end get none).
    fn use_inflight(&self, region: &Arc<InflightRegion>) {
        if usize::from(region.num_queues()) < self.queues.len() {
            tracing::warn!(
                tracked = region.num_queues(),
                queues = self.queues.len(),
                "the inflight buffer covers fewer queues than the device has",
            );
        }
        for (q, cell) in self.queues.iter().enumerate() {
            let log = u16::try_from(q).ok().and_then(|q| region.queue(q));
            lock(cell).engine.set_inflight_log(log);
        }
    }

    /// Closes the exit eventfds that the library's workers leave open; call once the
    /// daemon (and so every worker thread) is gone.
    pub fn close_exit_fds(&self) {
        self.glue.close_exit_fds();
    }
}

impl VhostUserBackend for BlkBackend {
    /// Each region's dirty log, which SET_LOG_BASE points at the frontend's (vhost-user
    /// "Migration"); with `()` the library would panic on SET_LOG_BASE.
    type Bitmap = vhost_user_backend::bitmap::BitmapMmapRegion;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.queues.len()
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        features(&self.limits)
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        // Requests in flight tracked in the frontend's memory, for a restarted backend
        // to resubmit.
        crate::vhost_glue::protocol_features() | VhostUserProtocolFeatures::INFLIGHT_SHMFD
    }

    fn get_inflight_fd(
        &self,
        inflight: &VhostUserInflight,
    ) -> io::Result<(VhostUserInflight, std::fs::File)> {
        let (region, reply, file) =
            InflightRegion::create(inflight.num_queues, inflight.queue_size)?;
        tracing::debug!(
            queues = inflight.num_queues,
            queue_size = inflight.queue_size,
            bytes = reply.mmap_size,
            "GET_INFLIGHT_FD: new inflight buffer",
        );
        self.use_inflight(&region);
        Ok((reply, file))
    }

    fn set_inflight_fd(&self, inflight: &VhostUserInflight, file: std::fs::File) -> io::Result<()> {
        let region = InflightRegion::open(inflight, &file)?;
        tracing::debug!(
            queues = inflight.num_queues,
            queue_size = inflight.queue_size,
            "SET_INFLIGHT_FD: tracking requests in flight in the frontend's buffer",
        );
        self.use_inflight(&region);
        Ok(())
    }

    fn set_event_idx(&self, _enabled: bool) {
        // The library sets EVENT_IDX on each vring; the engine asks the queue.
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        config_slice(&self.config, offset, size)
    }

    /// SET_CONFIG. devlend offers no VIRTIO_BLK_F_CONFIG_WCE, so every field of
    /// `virtio_blk_config` is read-only for the driver (virtio 1.2 §5.2.4): every write
    /// is refused (the frontend gets an error ack and the session goes on). Not logged,
    /// so that a frontend repeating it cannot fill the log.
    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "virtio-blk config space is read-only: write of {} bytes at offset {offset} ({}) refused",
                buf.len(),
                config_field(offset),
            ),
        ))
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMemory>) -> io::Result<()> {
        // The glue's map is the same atomic the library just updated; requests in flight
        // hold the map they were parsed against. Over RDMA each queue registers the new
        // regions now and drops what nobody uses any more.
        let map = mem.memory().into_inner();
        self.glue.memory_changed(&map);
        for cell in &self.queues {
            lock(cell).engine.memory_changed(&map);
        }
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        self.glue.workers().queues_per_thread()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        self.glue.exit_event()
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        let Some((q, cell)) = self
            .glue
            .workers()
            .worker_of(queue_index)
            .and_then(|(q, _)| Some((q, self.queues.get(q)?)))
        else {
            return Ok(());
        };
        let (drained, letting_go) = {
            let mut cell = lock(cell);
            let drained = self.drain_queue(&mut cell, DRAIN_TIMEOUT);
            // The frontend re-initializes the queue after this: a queue the driver broke
            // is served again then.
            cell.engine.reset_broken();
            // The end of a live migration: the requests in flight completed above; the
            // queue's session closes so that the lender can hand the device over.
            let letting_go = self.glue.handover().ring_stopped();
            if letting_go {
                cell.engine.let_go();
                self.sync_registration(q, &mut cell, false);
            }
            (drained, letting_go)
        };
        if letting_go {
            self.let_go_unstarted();
        }
        drained
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        let (Some(cell), Some(vring)) = (self.queues.get(thread_id), vrings.first()) else {
            return Ok(());
        };
        let mut cell = lock(cell);
        if cell.vring.is_none() {
            cell.vring = Some(vring.clone());
        }
        let mem = self.glue.map();
        let mut state = vring.get_mut();
        let queue = state.get_queue_mut();
        if !queue.ready() {
            // A queue the guest has not enabled, or stopped, takes no event: its fabric
            // session is not watched until the queue runs (a lost session is noticed
            // then, at its first request), and a reconnect timer's expiry is read.
            // Level-triggered, a closed socket, a writable one or an expired timer would
            // otherwise wake this worker for ever (a guest with fewer CPUs than the
            // disk's queues never enables the others).
            drop(state);
            if device_event == self.timer_event() {
                cell.engine.clear_timer();
            }
            self.sync_registration(thread_id, &mut cell, false);
            return Ok(());
        }
        // A migration that failed: the VM runs here again.
        self.glue.frontend_runs();
        let result = if device_event == self.fabric_event() {
            cell.engine.process_responses(queue, &mem)
        } else if device_event == self.timer_event() {
            cell.engine.on_timer(queue, &mem)
        } else if device_event == 0 && !self.stopping.load(Ordering::Acquire) {
            cell.engine.process_avail(queue, &mem)
        } else {
            Ok(false)
        };
        // A ring the engine cannot reach in guest memory is the driver's doing: it
        // breaks this queue, not the worker (an error here would end the worker's
        // thread, and with it the other events it serves).
        let mut used = result.unwrap_or_else(|e| {
            cell.engine
                .break_queue(format!("a ring is not in guest memory: {e}"));
            false
        });
        if cell.poll.enabled() {
            let now = Instant::now();
            if let Some(last) = cell.last_work.replace(now) {
                cell.poll.waited(now - last);
            }
            let window = cell.poll.window();
            if !window.is_zero() {
                let QueueCell {
                    engine,
                    last_work,
                    poll,
                    ..
                } = &mut *cell;
                used = match self.busy_poll(engine, &mut state, &mem, used, poll, last_work) {
                    Ok(u) => u,
                    Err(e) => {
                        engine.break_queue(format!("a ring is not in guest memory: {e}"));
                        false
                    }
                };
                poll.end_spell();
            }
        }
        if used {
            signal_used(&mut state, &mem)?;
        }
        if self.glue.memory_lost() {
            cell.engine.break_queue(crate::sigbus::LOST.into());
        }
        if cell.engine.take_newly_broken() {
            // virtio 1.2 §2.1.2: the device needs a reset. vhost-user's way to say so is
            // the vring's error eventfd (SET_VRING_ERR).
            if let Err(e) = state.signal_err() {
                tracing::warn!(queue = thread_id, error = %e, "cannot signal the vring's error eventfd");
            }
        }
        drop(state);
        self.sync_registration(thread_id, &mut cell, true);
        Ok(())
    }
}

impl BlkBackend {
    /// Busy-polls the guest's ring and the fabric socket until nothing happened for
    /// `poll`'s window (at most [`MAX_POLL_SLICE`] per call, so that the vhost-user
    /// message thread gets the locks), recording in `last_work` when work was last
    /// found. Opens a spell of `poll` when a round finds nothing; the caller ends it
    /// ([`PollWindow::end_spell`]), and a preempted one stops the next polling.
    /// Signals the guest as requests complete; returns whether used entries were added
    /// since the last signal.
    fn busy_poll(
        &self,
        engine: &mut QueueEngine,
        state: &mut RingState,
        mem: &crate::guest::GuestMemoryRef,
        mut used: bool,
        poll: &mut PollWindow,
        last_work: &mut Option<Instant>,
    ) -> io::Result<bool> {
        let mut mem = mem.clone();
        let start = Instant::now();
        let mut last = start;
        loop {
            if last.elapsed() >= poll.window()
                || start.elapsed() >= MAX_POLL_SLICE
                || self.stopping.load(Ordering::Acquire)
            {
                break;
            }
            let queue = state.get_queue_mut();
            if used
                && queue
                    .needs_notification(mem.as_ref())
                    .map_err(io::Error::other)?
            {
                state.signal_used_queue()?;
                used = false;
            }
            // The frontend may add memory while this runs (libblkio maps its buffers
            // after starting the queues): parse each batch against the current map.
            mem = self.glue.map();
            let queue = state.get_queue_mut();
            let before = engine.inflight();
            let done = engine
                .process_responses(queue, &mem)
                .map_err(io::Error::other)?;
            let sent = engine
                .process_avail(queue, &mem)
                .map_err(io::Error::other)?;
            if done || sent || engine.inflight() != before {
                used |= done | sent;
                last = Instant::now();
                *last_work = Some(last);
            } else {
                poll.begin_spell();
                std::hint::spin_loop();
            }
        }
        Ok(used)
    }
}

/// Acked-feature helper for tests and status: whether PROTOCOL_FEATURES was offered.
pub fn offers_protocol_features(features: u64) -> bool {
    features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0
}
