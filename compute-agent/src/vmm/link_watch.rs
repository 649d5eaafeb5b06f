//! Follows a lent NIC's link into a QEMU guest: when the lender goes away (or its
//! interface loses carrier), the guest's link is set down with QMP `set_link`, and up
//! again once every queue pair is back, so that the guest's stack sees a cable pulled
//! rather than a silent wire.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use devlend_backend::net::NetStats;

use super::qemu;

/// How often the link is looked at.
const PERIOD: Duration = Duration::from_millis(250);

/// A running watcher; stops (within [`PERIOD`]) when dropped.
pub struct LinkWatch {
    stop: Arc<AtomicBool>,
}

impl LinkWatch {
    /// Watches `net` of NIC device `id` in the QEMU behind `qmp`. It acts only once the
    /// link has been seen up (the frontend's first connection opens the queue pairs'
    /// sessions), then follows every change; a QMP failure is logged once per change
    /// and retried.
    ///
    /// # Errors
    /// The thread cannot be started.
    pub fn start(id: String, qmp: PathBuf, net: Arc<NetStats>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::Builder::new()
            .name(format!("link-{id}"))
            .spawn(move || {
                let mut seen_up = false;
                // QEMU's link after device_add, or as a restored VM left it.
                let mut guest_up = true;
                let mut warned = false;
                while !flag.load(Ordering::Acquire) {
                    std::thread::sleep(PERIOD);
                    let up = net.link_up();
                    seen_up |= up;
                    if !seen_up || up == guest_up {
                        continue;
                    }
                    match qemu::set_link(&qmp, &id, up) {
                        Ok(()) => {
                            tracing::info!(id, up, "guest link set to follow the lender");
                            guest_up = up;
                            warned = false;
                        }
                        Err(e) if !warned => {
                            tracing::warn!(id, up, error = %devlend_fabric::error::chain(&e), "cannot set the guest's link");
                            warned = true;
                        }
                        Err(_) => {}
                    }
                }
            })?;
        Ok(LinkWatch { stop })
    }
}

impl Drop for LinkWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}
