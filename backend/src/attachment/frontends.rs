//! One vhost-user attachment's serving loop, for a disk and a NIC alike: wait for a
//! frontend (the VMM) on the attachment's socket, admit it under the attachment's
//! message budget, give it a fresh backend and daemon (a daemon cannot serve twice),
//! serve it to its end, then close what the library's workers left open and wait for
//! the next. What differs by kind is the backend ([`Served`]) and what the attachment
//! keeps of the connection (`current`).

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use vhost::vhost_user::Listener;
use vhost_user_backend::bitmap::BitmapMmapRegion;
use vhost_user_backend::{ShutdownHandle, VhostUserBackend, VhostUserDaemon};
use vm_memory::GuestMemoryAtomic;

use super::Serving;
use crate::blk::backend::{BlkBackend, DRAIN_TIMEOUT};
use crate::guest::{GuestMemory, Vring};
use crate::net::NetBackend;
use crate::vhost_glue::Handler;

/// A device backend one frontend connection is served with.
pub(super) trait Served:
    VhostUserBackend<Bitmap = BitmapMmapRegion, Vring = Vring> + Sized + Send + Sync + 'static
{
    /// The guest memory map the daemon is created with.
    fn memory(&self) -> GuestMemoryAtomic<GuestMemory>;
    /// Takes the daemon's workers' epoll handlers (and watches the fabric with them).
    fn attach_handlers(&self, handlers: &[Arc<Handler<Self>>]);
    /// Closes the exit eventfds the library's workers leave open.
    fn close_exit_fds(&self);
    /// The attachment is stopping as the frontend connects: what to finish first.
    fn stopping(&self) {}
}

impl Served for BlkBackend {
    fn memory(&self) -> GuestMemoryAtomic<GuestMemory> {
        BlkBackend::memory(self)
    }

    fn attach_handlers(&self, handlers: &[Arc<Handler<Self>>]) {
        BlkBackend::attach_handlers(self, handlers);
    }

    fn close_exit_fds(&self) {
        BlkBackend::close_exit_fds(self);
    }

    /// The requests in flight are answered (or fail at the drain's deadline).
    fn stopping(&self) {
        self.drain_all(DRAIN_TIMEOUT, false);
    }
}

impl Served for NetBackend {
    fn memory(&self) -> GuestMemoryAtomic<GuestMemory> {
        NetBackend::memory(self)
    }

    fn attach_handlers(&self, handlers: &[Arc<Handler<Self>>]) {
        NetBackend::attach_handlers(self, handlers);
    }

    fn close_exit_fds(&self) {
        NetBackend::close_exit_fds(self);
    }
}

/// What one attachment's loop serves, and where.
pub(super) struct Frontends<'a> {
    /// The attachment's id, for the log.
    pub(super) id: &'a str,
    /// Its socket, for the log.
    pub(super) socket: &'a Path,
    /// The daemon's name (`devlend-blk-DEVICE`, `devlend-net-DEVICE`).
    pub(super) name: String,
    pub(super) shared: &'a Serving,
}

impl Frontends<'_> {
    /// Serves `listener` until stop is asked: `wait` blocks until a client is pending
    /// (true) or stop is asked (false); `backend` makes each connection's backend (an
    /// error is logged, and the connection is dropped after 200 ms); `current` is told
    /// of the backend before the connection starts (no handle yet), once it runs (with
    /// the daemon's shutdown handle), and `None` when it ended.
    pub(super) fn serve<B: Served>(
        &self,
        listener: Listener,
        wait: impl Fn(&Listener) -> bool,
        mut backend: impl FnMut() -> Result<Arc<B>, String>,
        mut current: impl FnMut(Option<(Arc<B>, Option<ShutdownHandle>)>),
    ) {
        let (id, shared) = (self.id, self.shared);
        let socket = self.socket.display();
        let budget = crate::budget::for_attachment();
        while wait(&listener) {
            let Some(stream) = crate::budget::accept_admitted(&listener, &budget, &shared.stop, id)
            else {
                continue;
            };
            let backend = match backend() {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(attachment = %id, error = %e, "cannot create the backend");
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            };
            let mut daemon = match VhostUserDaemon::new(
                self.name.clone(),
                backend.clone(),
                backend.memory(),
            ) {
                Ok(d) => d,
                Err(e) => {
                    tracing::error!(attachment = %id, error = %e, "cannot create vhost-user daemon");
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            };
            daemon.set_message_budget(budget.clone());
            backend.attach_handlers(&daemon.get_epoll_handlers());
            current(Some((backend.clone(), None)));
            if let Err(e) = daemon.start_stream(stream) {
                devlend_fabric::limited!(warn, attachment = %id, error = %e, "vhost-user connection failed to start");
            } else {
                current(Some((backend.clone(), daemon.shutdown_handle())));
                shared.connected.store(true, Ordering::Release);
                devlend_fabric::limited!(info, attachment = %id, %socket, "frontend connected");
                if shared.stop.load(Ordering::Acquire) {
                    backend.stopping();
                    daemon.request_shutdown();
                }
                match daemon.wait() {
                    // A VMM that closes its socket (the VM stopped, QEMU quit) ends it
                    // this way: not an error.
                    Ok(())
                    | Err(vhost_user_backend::Error::HandleRequest(
                        vhost::vhost_user::Error::Disconnected,
                    )) => {
                        devlend_fabric::limited!(info, attachment = %id, %socket, "frontend disconnected")
                    }
                    Err(e) => {
                        devlend_fabric::limited!(info, attachment = %id, %socket, error = %e, "frontend connection ended")
                    }
                }
                shared.connected.store(false, Ordering::Release);
            }
            current(None);
            drop(daemon);
            backend.close_exit_fds();
        }
    }
}
