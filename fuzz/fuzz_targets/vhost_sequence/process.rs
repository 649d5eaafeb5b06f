//! Process checks: spinning threads, leaked fds and threads.

use super::*;

pub(crate) fn gettid() -> i64 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) }
}

/// Every thread of the process but this one: (tid, nanoseconds on a CPU so far).
pub(crate) fn thread_times() -> Vec<(i64, u64)> {
    let me = gettid();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let tid: i64 = e.ok()?.file_name().to_str()?.parse().ok()?;
        if tid == me {
            return None;
        }
        let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
        Some((tid, s.split_whitespace().next()?.parse().ok()?))
    })
    .collect()
}

pub(crate) fn busy(window: Duration) -> Vec<i64> {
    let a = thread_times();
    std::thread::sleep(window);
    let b = thread_times();
    let limit = window.as_nanos() as u64 / 2;
    b.iter()
        .filter(|(t, ns)| {
            a.iter()
                .any(|(u, m)| u == t && ns.saturating_sub(*m) > limit)
        })
        .map(|(t, _)| *t)
        .collect()
}

/// No thread stays busy while the frontend and guest do nothing: a quick look, and if a
/// thread was busy, three longer ones.
pub(crate) fn check_spin() {
    let mut suspects = busy(Duration::from_millis(1));
    for _ in 0..3 {
        if suspects.is_empty() {
            return;
        }
        let now = busy(Duration::from_millis(40));
        suspects.retain(|t| now.contains(t));
    }
    if let Some(t) = suspects.first() {
        let name = std::fs::read_to_string(format!("/proc/self/task/{t}/comm")).unwrap_or_default();
        panic!(
            "thread {t} ({}) is busy while nothing happens: it spins",
            name.trim()
        );
    }
}

/// The process's fds and threads. Pipes other than `junk_pipe` (what the frontend sends)
/// are left out: libFuzzer talks to `llvm-symbolizer` over two it keeps.
pub(crate) fn counts(junk_pipe: &str) -> (usize, usize) {
    let fds = fd_list()
        .iter()
        .filter(|l| !l.contains("pipe:[") || l.ends_with(junk_pipe))
        .count();
    let threads = std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0);
    (fds, threads)
}

pub(crate) fn fd_list() -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(d) = std::fs::read_dir("/proc/self/fd") {
        for e in d.flatten() {
            let target = std::fs::read_link(e.path()).unwrap_or_default();
            out.push(format!(
                "{} -> {}",
                e.file_name().to_string_lossy(),
                target.display()
            ));
        }
    }
    out
}

pub(crate) fn thread_list() -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(d) = std::fs::read_dir("/proc/self/task") {
        for e in d.flatten() {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            out.push(format!(
                "{} {}",
                e.file_name().to_string_lossy(),
                comm.trim()
            ));
        }
    }
    out
}

/// After a teardown the process's fds and threads return to what they were between
/// earlier iterations (the lender's sessions end on their own, a little later).
pub(crate) fn check_leaks(w: &mut World) {
    let Some((fds, threads)) = w.baseline else {
        // The polling check keeps one `/proc/loadavg` descriptor for the life of the
        // process, opened by the first spell; open it now so that an iteration that
        // polls first is not taken for a leak.
        let _ = devlend_fabric::cpu_load::runnable_threads();
        std::thread::sleep(Duration::from_millis(300));
        w.baseline = Some(counts(&w.junk_pipe_name));
        w.baseline_lists = (fd_list(), thread_list());
        return;
    };
    let end = Instant::now() + Duration::from_secs(2);
    loop {
        let (f, t) = counts(&w.junk_pipe_name);
        if f <= fds && t <= threads {
            return;
        }
        if Instant::now() > end {
            let (bf, bt) = &w.baseline_lists;
            let new_fds: Vec<String> = fd_list()
                .into_iter()
                .filter(|x| !bf.contains(x) && !x.ends_with("/fd"))
                .collect();
            let new_threads: Vec<String> = thread_list()
                .into_iter()
                .filter(|x| !bt.contains(x))
                .collect();
            panic!(
                "leak: {f} fds (baseline {fds}), {t} threads (baseline {threads}) 2 s after the teardown; not there before: {new_fds:?}, threads {new_threads:?}; gone: {:?}",
                bf.iter().filter(|x| !fd_list().contains(x)).collect::<Vec<_>>()
            );
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}
