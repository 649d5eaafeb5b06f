//! systemd readiness (`Type=notify`): a no-op when not started by systemd
//! (`NOTIFY_SOCKET` unset).

use sd_notify::NotifyState;

fn send(states: &[NotifyState]) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!(error = %e, "cannot notify systemd");
    }
}

/// `READY=1` with a status line: the daemon serves.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// `RELOADING=1`: a SIGHUP reload starts (follow with [`ready`]).
pub fn reloading() {
    send(&[
        NotifyState::Reloading,
        NotifyState::monotonic_usec_now().unwrap_or(NotifyState::Reloading),
    ]);
}

/// `STOPPING=1`: shutdown (draining) starts.
pub fn stopping() {
    send(&[NotifyState::Stopping]);
}
