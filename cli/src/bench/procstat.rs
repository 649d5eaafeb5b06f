//! CPU time and peak resident memory of server processes, from /proc, over a window.
//!
//! CPU time is `utime + stime` of `/proc/PID/stat` (all threads of the process), in
//! clock ticks of `sysconf(_SC_CLK_TCK)`. The peak RSS of the window is `VmHWM` of
//! `/proc/PID/status` read at its end, after resetting it to the current RSS at its
//! start (`echo 5 > /proc/PID/clear_refs`).

use anyhow::{anyhow, Context, Result};
use serde::Serialize;

/// A process to measure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Watched {
    /// What it is (`device-agent`, `qsd-lender`, `pid 1234`).
    pub name: String,
    /// Its process id.
    pub pid: u32,
}

/// A process's figures over one window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcFigures {
    /// What it is.
    pub name: String,
    /// Its process id.
    pub pid: u32,
    /// User + system CPU seconds spent in the window (all threads).
    pub cpu_seconds: f64,
    /// Peak resident set size in the window, in bytes.
    pub peak_rss_bytes: u64,
}

/// The CPU ticks at the start of a window, per process.
#[derive(Debug)]
pub struct Window {
    start: Vec<(Watched, u64)>,
}

impl Window {
    /// Starts a window: resets each process's peak RSS and reads its CPU time.
    ///
    /// # Errors
    /// A process is gone, or its /proc files cannot be read or written.
    pub fn start(procs: &[Watched]) -> Result<Self> {
        let start = procs
            .iter()
            .map(|p| {
                reset_peak_rss(p.pid)?;
                Ok((p.clone(), cpu_ticks(p.pid)?))
            })
            .collect::<Result<_>>()?;
        Ok(Window { start })
    }

    /// Ends the window: CPU seconds since [`Self::start`] and the peak RSS.
    ///
    /// # Errors
    /// A process is gone.
    pub fn end(&self) -> Result<Vec<ProcFigures>> {
        let tck = clock_ticks_per_second() as f64;
        self.start
            .iter()
            .map(|(p, t0)| {
                let t1 = cpu_ticks(p.pid)?;
                Ok(ProcFigures {
                    name: p.name.clone(),
                    pid: p.pid,
                    cpu_seconds: t1.saturating_sub(*t0) as f64 / tck,
                    peak_rss_bytes: peak_rss_bytes(p.pid)?,
                })
            })
            .collect()
    }
}

/// A process's command name (`/proc/PID/comm`, at most 15 bytes).
pub fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// `sysconf(_SC_CLK_TCK)`, the unit of /proc CPU times (100 if unknown).
pub fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf has no memory effects.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(t).ok().filter(|&t| t > 0).unwrap_or(100)
}

/// `utime + stime` of a process, in clock ticks.
///
/// # Errors
/// The process is gone, or its stat line is not as expected.
pub fn cpu_ticks(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/stat");
    let s = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    parse_stat_cpu(&s).ok_or_else(|| anyhow!("unexpected contents of {path}"))
}

/// `utime + stime` from a `/proc/PID/stat` line. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted after its last `)`.
fn parse_stat_cpu(s: &str) -> Option<u64> {
    let rest = &s[s.rfind(')')? + 1..];
    // After the name: field 3 (state) is index 0, so utime (14) is 11 and stime (15) 12.
    let mut f = rest.split_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Resets a process's peak RSS (`VmHWM`) to its current RSS.
///
/// # Errors
/// The file cannot be written (the process is gone or belongs to another user).
pub fn reset_peak_rss(pid: u32) -> Result<()> {
    let path = format!("/proc/{pid}/clear_refs");
    std::fs::write(&path, "5").with_context(|| format!("cannot write {path}"))
}

/// A process's peak RSS (`VmHWM`), in bytes.
///
/// # Errors
/// The process is gone, or its status has no `VmHWM`.
pub fn peak_rss_bytes(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let s = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    parse_kib_field(&s, "VmHWM:").ok_or_else(|| anyhow!("no VmHWM in {path}"))
}

fn parse_kib_field(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_and_status() {
        let stat = "1234 (a) b (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 \
                    250 50 0 0 20 0 3 0 12345 1000000 200";
        assert_eq!(parse_stat_cpu(stat), Some(300));
        assert_eq!(parse_stat_cpu("garbage"), None);
        let status = "Name:\tx\nVmPeak:\t  100 kB\nVmHWM:\t    2048 kB\nVmRSS:\t 1024 kB\n";
        assert_eq!(parse_kib_field(status, "VmHWM:"), Some(2 << 20));
        assert_eq!(parse_kib_field(status, "VmSwap:"), None);
    }

    #[test]
    fn measures_this_process() {
        let me = Watched {
            name: "self".into(),
            pid: std::process::id(),
        };
        let w = Window::start(std::slice::from_ref(&me)).unwrap();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let f = w.end().unwrap();
        assert_eq!(f.len(), 1);
        assert!(f[0].peak_rss_bytes > 0);
        assert!(f[0].cpu_seconds >= 0.0);
    }
}
