//! The `vhost-user-backend` glue that the block and the NIC backends share, once: the
//! protocol features every devlend device offers, how a device's virtqueues are spread
//! over the library's worker threads and the epoll ids above them, the state a backend
//! keeps of its connection (the guest memory map and its guard, the workers' epoll
//! handlers, their exit eventfds, a live migration's handover), keeping a worker's epoll
//! set watching a queue's fabric socket, and signalling the guest of used entries.
//!
//! What a device does with its queues stays in its own backend (`blk::backend`,
//! `net::backend`), as in rust-vmm's vhost-device crates.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringEpollHandler, VringState};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::guest::{GuestMemory, GuestMemoryRef};
use crate::handover::Handover;
use crate::sigbus::MemoryGuard;

/// A worker thread's epoll handler, as the daemon hands it out.
pub type Handler<B> = VringEpollHandler<Arc<B>>;

/// The state of one vring as the library keeps it, over [`GuestMemory`].
pub type RingState = VringState<GuestMemoryAtomic<GuestMemory>>;

/// Locks `m`, going on with the data of a thread that panicked holding it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The vhost-user protocol features every devlend device offers: its config space, its
/// queue count, acknowledged messages, memory added region by region, and dirty-page
/// logging for live migration (vhost-user "Migration": the log comes as a shared-memory
/// fd with SET_LOG_BASE). A device adds its own (the block device: INFLIGHT_SHMFD).
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::LOG_SHMFD
}

/// How a device's virtqueues are spread over the library's worker threads: worker `w`
/// serves the `per_worker` consecutive virtqueues from `w * per_worker` (a disk: one
/// virtqueue each; a NIC: one queue pair, its receiveq then its transmitq).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workers {
    count: usize,
    per_worker: usize,
}

impl Workers {
    /// `count` workers of `per_worker` virtqueues each.
    pub fn new(count: usize, per_worker: usize) -> Self {
        Workers { count, per_worker }
    }

    /// The number of workers.
    pub fn count(self) -> usize {
        self.count
    }

    /// The device's virtqueues, all workers together.
    pub fn num_queues(self) -> usize {
        self.count * self.per_worker
    }

    /// The library's `queues_per_thread`: the mask of each worker's virtqueues.
    pub fn queues_per_thread(self) -> Vec<u64> {
        let mask = (1u64 << self.per_worker) - 1;
        (0..self.count)
            .map(|w| mask << (self.per_worker * w))
            .collect()
    }

    /// The worker that serves virtqueue `queue_index`, and the queue's place among that
    /// worker's queues (0 for a disk's queue or a NIC's receiveq, 1 for a transmitq);
    /// none for an index past the device's virtqueues (a frontend's to refuse).
    pub fn worker_of(self, queue_index: u32) -> Option<(usize, usize)> {
        let q = usize::try_from(queue_index).ok()?;
        (q < self.num_queues()).then(|| (q / self.per_worker, q % self.per_worker))
    }

    /// The epoll event id of each worker's fabric socket: above every virtqueue index
    /// and the id `num_queues`, which the library reserves (its exit event).
    pub fn fabric_event(self) -> u64 {
        self.num_queues() as u64 + 1
    }

    /// The epoll event id of each worker's timer (reconnection, held frames).
    pub fn timer_event(self) -> u64 {
        self.num_queues() as u64 + 2
    }
}

/// What a backend keeps of its frontend connection, whatever the device: the guest
/// memory map the library updates, its guard against truncation by the VMM, the
/// workers' epoll handlers, the exit eventfds the library leaves open, and a live
/// migration's handover of the device ([`crate::handover`]).
pub struct Glue<B: VhostUserBackend> {
    workers: Workers,
    mem: GuestMemoryAtomic<GuestMemory>,
    handlers: Mutex<Vec<Weak<Handler<B>>>>,
    exit_fds: Mutex<Vec<(EventNotifier, RawFd)>>,
    /// The guest memory's host ranges, guarded against truncation by the VMM (the
    /// queues stay stopped from a fault there until a new memory table comes).
    memory_guard: MemoryGuard,
    handover: Arc<Handover>,
}

impl<B: VhostUserBackend> Glue<B> {
    /// The glue of a device whose virtqueues `workers` serve, with no guest memory yet
    /// and no handover asked for.
    pub fn new(workers: Workers) -> Self {
        Glue {
            workers,
            mem: GuestMemoryAtomic::new(GuestMemory::new()),
            handlers: Mutex::new(Vec::new()),
            exit_fds: Mutex::new(Vec::new()),
            memory_guard: MemoryGuard::default(),
            handover: Arc::default(),
        }
    }

    /// The device's workers.
    pub fn workers(&self) -> Workers {
        self.workers
    }

    /// Lets the device go when the frontend stops it while `handover` is asked for.
    pub fn set_handover(&mut self, handover: Arc<Handover>) {
        self.handover = handover;
    }

    /// The device's handover.
    pub fn handover(&self) -> &Handover {
        &self.handover
    }

    /// The frontend uses the device (again): a device let go for a migration that
    /// failed is taken back (the VM runs here again).
    pub fn frontend_runs(&self) {
        if self.handover.is_let_go() {
            self.handover.resume();
        }
    }

    /// The guest memory map that the daemon must be created with (the library updates
    /// it on SET_MEM_TABLE / ADD_MEM_REG).
    pub fn memory(&self) -> GuestMemoryAtomic<GuestMemory> {
        self.mem.clone()
    }

    /// The guest memory map now.
    pub fn map(&self) -> GuestMemoryRef {
        self.mem.memory().into_inner()
    }

    /// The library changed the guest memory map to `map`: the guard watches its ranges.
    pub fn memory_changed(&self, map: &GuestMemory) {
        self.memory_guard.set_memory(map);
    }

    /// Whether the VMM truncated the file behind guest memory since last asked.
    pub fn memory_lost(&self) -> bool {
        self.memory_guard.lost()
    }

    /// Takes the daemon's per-worker epoll handlers (weakly: the daemon owns them).
    pub fn attach_handlers(&self, handlers: &[Arc<Handler<B>>]) {
        *lock(&self.handlers) = handlers.iter().map(Arc::downgrade).collect();
    }

    /// The epoll handler of worker `worker`, while the daemon has it.
    pub fn handler(&self, worker: usize) -> Option<Arc<Handler<B>>> {
        lock(&self.handlers).get(worker).and_then(Weak::upgrade)
    }

    /// The library's `exit_event`: a fresh eventfd, whose consumer end is kept to be
    /// closed by [`Self::close_exit_fds`].
    pub fn exit_event(&self) -> Option<(EventConsumer, EventNotifier)> {
        let (consumer, notifier) = new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()?;
        let keep = notifier.try_clone().ok()?;
        lock(&self.exit_fds).push((keep, consumer.as_raw_fd()));
        Some((consumer, notifier))
    }

    /// Closes the exit eventfds that the library's workers leave open; call once the
    /// daemon (and so every worker thread) is gone.
    pub fn close_exit_fds(&self) {
        for (_notifier, fd) in lock(&self.exit_fds).drain(..) {
            // SAFETY: `fd` is the consumer end handed to the library in `exit_event`,
            // which registered it in a worker's epoll set (now closed with the worker)
            // and never closes it; nothing else refers to it.
            unsafe { libc::close(fd) };
        }
    }
}

/// Signals the guest that used entries were added to the ring of `state`, unless its
/// event index says the driver does not want to know yet. A used ring that cannot be
/// read for its event index is signalled (the guest's loss, not the worker's).
///
/// # Errors
/// The vring's call eventfd could not be written.
pub fn signal_used(state: &mut RingState, mem: &GuestMemoryRef) -> io::Result<()> {
    if state
        .get_queue_mut()
        .needs_notification(mem.as_ref())
        .unwrap_or(true)
    {
        state.signal_used_queue()?;
    }
    Ok(())
}

/// An epoll set that fds are added to and removed from under an event id: a worker's
/// [`Handler`] (a recording one in tests).
pub trait Listeners {
    /// Adds `fd` for `events` under `id`.
    ///
    /// # Errors
    /// The epoll set refused it.
    fn register(&self, fd: RawFd, events: EventSet, id: u64) -> io::Result<()>;
    /// Removes `fd`, registered under `id`.
    ///
    /// # Errors
    /// The epoll set refused it.
    fn unregister(&self, fd: RawFd, events: EventSet, id: u64) -> io::Result<()>;
}

impl<T: VhostUserBackend> Listeners for VringEpollHandler<T> {
    fn register(&self, fd: RawFd, events: EventSet, id: u64) -> io::Result<()> {
        self.register_listener(fd, events, id)
    }

    fn unregister(&self, fd: RawFd, events: EventSet, id: u64) -> io::Result<()> {
        self.unregister_listener(fd, events, id)
    }
}

/// A queue's fabric socket as a worker's epoll set should watch it: its fd (none: not
/// watched), its session's generation (a new session may reuse the old one's fd
/// number), and whether for writability too (level-triggered, so only while requests
/// wait for room in the socket).
pub type Watch = (Option<RawFd>, u64, bool);

/// A queue's fabric socket as registered in its worker's epoll set.
#[derive(Debug, Default)]
pub struct FabricWatch {
    registered: Watch,
}

impl FabricWatch {
    /// Whether the epoll set watches `now` already.
    pub fn is(&self, now: Watch) -> bool {
        self.registered == now
    }

    /// Makes `epoll` watch `now` under `id`, in place of what it watched: nothing
    /// happens when it watches `now` already. `now` counts as registered even when the
    /// epoll set refused it (the error is returned, for the caller to log).
    ///
    /// # Errors
    /// The epoll set refused the new fd.
    pub fn update(&mut self, epoll: &impl Listeners, now: Watch, id: u64) -> io::Result<()> {
        if self.is(now) {
            return Ok(());
        }
        if let Some(old) = self.registered.0 {
            // The old socket is closed already (epoll dropped it then) or its number was
            // reused by the new one; either way a failure here is expected and harmless.
            let _ = epoll.unregister(old, events(self.registered.2), id);
        }
        self.registered = now;
        match now.0 {
            Some(fd) => epoll.register(fd, events(now.2), id),
            None => Ok(()),
        }
    }
}

/// Readability, and writability too when `out`.
fn events(out: bool) -> EventSet {
    if out {
        EventSet::IN | EventSet::OUT
    } else {
        EventSet::IN
    }
}

#[cfg(test)]
mod tests;
