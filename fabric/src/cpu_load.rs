//! How contended the CPUs are, as a polling thread asks before and after it spins
//! ([`crate::poll_window`]): its own involuntary context switches, and how many threads
//! the whole machine has runnable against how many CPUs this process may use.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

/// The calling thread's involuntary context switches so far (`ru_nivcsw` of
/// `getrusage(RUSAGE_THREAD)`): how often the scheduler took its CPU for another
/// thread. 0 if the call fails (it cannot for a valid buffer).
pub fn involuntary_switches() -> u64 {
    // SAFETY: an all-zero `rusage` is a valid value of the plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid, writable `rusage` for the duration of the call.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    if rc == 0 {
        u64::try_from(usage.ru_nivcsw).unwrap_or(0)
    } else {
        0
    }
}

/// The CPUs this process may run on (`sched_getaffinity`, cgroup quotas), read once.
pub fn cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// Threads runnable on the whole machine now, the caller included (the first number of
/// `/proc/loadavg`'s fourth field); `None` if it cannot be read. One descriptor for the
/// process, read with `pread` (a lender with 1,000 sessions holds one, not 1,000).
pub fn runnable_threads() -> Option<usize> {
    static LOADAVG: OnceLock<Option<File>> = OnceLock::new();
    let f = LOADAVG
        .get_or_init(|| File::open("/proc/loadavg").ok())
        .as_ref()?;
    let mut buf = [0u8; 128];
    let n = f.read_at(&mut buf, 0).ok()?;
    parse_running(buf.get(..n)?)
}

/// Whether two threads at least wait for a CPU: more are runnable than this process has
/// CPUs, plus one. One over is not counted: in a chain of threads that wake each other
/// (a client, a compute agent, a lender at QD1), the waker is still runnable for a
/// moment after the woken one starts (with no slack, a QD1 lender counted a quarter of
/// its polling spells contended; with one, 0.05 %). False when it cannot be told.
pub fn cpus_contended() -> bool {
    runnable_threads().is_some_and(|n| n > cpus() + 1)
}

/// The running count of a `/proc/loadavg` line: `"0.20 0.18 0.12 1/80 11206"` → 1.
fn parse_running(line: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(line).ok()?;
    let field = text.split_ascii_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn the_running_count_is_parsed_and_bad_lines_give_none() {
        assert_eq!(parse_running(b"0.20 0.18 0.12 1/80 11206\n"), Some(1));
        assert_eq!(parse_running(b"4.67 4.06 3.03 12/112 24861"), Some(12));
        assert_eq!(parse_running(b"4.67 4.06 3.03"), None);
        assert_eq!(parse_running(b"0 0 0 x/80 1"), None);
        assert_eq!(parse_running(&[0xff, 0xfe]), None);
    }

    /// The caller runs, so it counts itself; spinners added beside it are counted too.
    #[test]
    fn spinning_threads_are_counted_runnable() {
        let alone = runnable_threads().expect("/proc/loadavg");
        assert!(alone >= 1);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinners: Vec<_> = (0..cpus() + 2)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        let mut most = 0;
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(200) {
            most = most.max(runnable_threads().unwrap_or(0));
        }
        let contended = cpus_contended();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for s in spinners {
            s.join().expect("spinner");
        }
        assert!(
            most > cpus(),
            "{} spinners beside this thread, {} CPUs: at most {most} runnable",
            cpus() + 2,
            cpus()
        );
        assert!(contended, "more spinners than CPUs is contended");
    }
}
