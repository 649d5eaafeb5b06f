//! Watchdog: a step that must end in bounded time arms it; past the deadline the process
//! aborts (libFuzzer saves the input).

use super::*;

pub(crate) static WATCH: Mutex<Option<(Instant, &'static str)>> = Mutex::new(None);

pub(crate) fn arm(what: &'static str, d: Duration) {
    *WATCH.lock().unwrap() = Some((Instant::now() + d, what));
}

pub(crate) fn disarm() {
    *WATCH.lock().unwrap() = None;
}

pub(crate) fn start_watchdog() {
    std::thread::Builder::new()
        .name("fuzz-watchdog".into())
        .spawn(|| loop {
            std::thread::sleep(Duration::from_millis(50));
            if let Some((deadline, what)) = *WATCH.lock().unwrap() {
                if Instant::now() > deadline {
                    eprintln!("vhost_sequence: hang: {what} did not end in time");
                    std::process::abort();
                }
            }
        })
        .expect("watchdog thread");
}
