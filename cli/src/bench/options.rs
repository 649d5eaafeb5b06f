//! What `devlend bench` is asked to run: one workload on one socket, or the peer matrix.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use serde::Serialize;

/// The access pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Rw {
    /// Random reads.
    Randread,
    /// Random writes.
    Randwrite,
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads and writes, half each.
    Randrw,
}

impl Rw {
    /// Whether offsets are random (else sequential).
    pub fn random(self) -> bool {
        matches!(self, Rw::Randread | Rw::Randwrite | Rw::Randrw)
    }

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Rw::Randread => "randread",
            Rw::Randwrite => "randwrite",
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::Randrw => "randrw",
        }
    }
}

/// One workload: pattern, block size, depth, queues, and how long.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Workload {
    /// Access pattern.
    pub rw: Rw,
    /// Bytes per request (a multiple of 512).
    pub bs: usize,
    /// Requests kept in flight per queue.
    pub iodepth: usize,
    /// Queues used, one thread each.
    pub queues: usize,
    /// Measured window.
    #[serde(serialize_with = "secs")]
    pub runtime: Duration,
    /// Warm-up before the window (requests run, nothing is recorded).
    #[serde(serialize_with = "secs")]
    pub ramp: Duration,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl Workload {
    /// Checks the values against each other.
    ///
    /// # Errors
    /// A zero or unaligned block size, a zero depth or queue count, a zero runtime.
    pub fn validate(&self) -> Result<()> {
        if self.bs == 0 || !self.bs.is_multiple_of(512) {
            bail!("--bs must be a non-zero multiple of 512 bytes");
        }
        if self.iodepth == 0 || self.iodepth > 1024 {
            bail!("--iodepth must be in 1..=1024");
        }
        if self.queues == 0 || self.queues > 16 {
            bail!("--queues must be in 1..=16");
        }
        if self.runtime.is_zero() {
            bail!("--runtime must be above zero");
        }
        Ok(())
    }

    /// A short name: `4k-randread-qd32-q2`.
    pub fn label(&self) -> String {
        let bs = if self.bs.is_multiple_of(1024) {
            format!("{}k", self.bs / 1024)
        } else {
            format!("{}b", self.bs)
        };
        let q = if self.queues > 1 {
            format!("-q{}", self.queues)
        } else {
            String::new()
        };
        format!("{bs}-{}-qd{}{q}", self.rw.name(), self.iodepth)
    }

    /// Bytes of buffer the workload needs (a request buffer per request in flight).
    pub fn buffer_bytes(&self) -> usize {
        self.bs * self.iodepth * self.queues
    }
}

/// Which cells `--peers` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Matrix {
    /// The seven cells of the performance targets.
    Full,
    /// Two short cells (4K randread QD1 and 4K randwrite QD32): a smoke test.
    Quick,
}

impl Matrix {
    /// The cells, with `runtime` and `ramp` for each.
    pub fn cells(self, runtime: Duration, ramp: Duration) -> Vec<Workload> {
        let w = |rw, bs, iodepth, queues| Workload {
            rw,
            bs,
            iodepth,
            queues,
            runtime,
            ramp,
        };
        match self {
            Matrix::Full => vec![
                w(Rw::Randread, 4096, 1, 1),
                w(Rw::Randread, 4096, 32, 1),
                w(Rw::Randwrite, 4096, 32, 1),
                w(Rw::Read, 128 << 10, 8, 1),
                w(Rw::Write, 128 << 10, 8, 1),
                w(Rw::Randread, 4096, 32, 2),
                w(Rw::Read, 128 << 10, 8, 2),
            ],
            Matrix::Quick => vec![w(Rw::Randread, 4096, 1, 1), w(Rw::Randwrite, 4096, 32, 1)],
        }
    }
}

/// Everything `devlend bench` was asked.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The workload (without `--peers`).
    pub workload: Workload,
    /// vhost-user-blk socket to bench (without `--peers`).
    pub socket: Option<PathBuf>,
    /// Server processes to measure (without `--peers`).
    pub pids: Vec<u32>,
    /// Run devlend and both peers through the matrix.
    pub peers: Option<PeersOptions>,
    /// Print a progress line on stderr.
    pub progress: bool,
}

/// Settings of a `--peers` run.
#[derive(Debug, Clone)]
pub struct PeersOptions {
    /// Cells to run.
    pub matrix: Matrix,
    /// Size in bytes of the backing file in /dev/shm (written fully first).
    pub size: u64,
    /// Work directory for sockets and logs (default: a temporary directory).
    pub dir: Option<PathBuf>,
    /// devlend's adaptive polling maximum on both agents, in microseconds (0:
    /// interrupt-driven); `None`: each agent's default (the lender polls, the compute
    /// agent does not).
    pub poll_us: Option<u32>,
}

/// Parses seconds, fractions allowed (`5`, `0.5`).
///
/// # Errors
/// Not a finite, non-negative number.
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("invalid seconds {s:?}"))?;
    Duration::try_from_secs_f64(v).map_err(|_| format!("invalid seconds {s:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_seconds_and_labels() {
        assert_eq!(parse_secs("0.5"), Ok(Duration::from_millis(500)));
        assert!(parse_secs("-1").is_err());
        let cells = Matrix::Full.cells(Duration::from_secs(5), Duration::from_secs(1));
        let labels: Vec<_> = cells.iter().map(Workload::label).collect();
        assert_eq!(
            labels,
            [
                "4k-randread-qd1",
                "4k-randread-qd32",
                "4k-randwrite-qd32",
                "128k-read-qd8",
                "128k-write-qd8",
                "4k-randread-qd32-q2",
                "128k-read-qd8-q2"
            ]
        );
        assert!(cells.iter().all(|c| c.validate().is_ok()));
    }
}
