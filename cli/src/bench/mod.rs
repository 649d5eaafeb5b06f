//! `devlend bench`: block performance through a vhost-user-blk socket, measured with the
//! `blkio` crate as the frontend, beside `qemu-storage-daemon`.
//!
//! - [`options`]: the workload (`--rw`, `--bs`, `--iodepth`, `--queues`, `--runtime`,
//!   `--ramp`) and the `--peers` matrix;
//! - [`workload`]: the closed loop, one thread per queue;
//! - [`stats`]: latency histograms (hdrhistogram) and the figures of a window;
//! - [`procstat`]: CPU seconds and peak RSS of server processes over the window;
//! - [`peers`]: devlend, qsd-local and qsd-nbd-chain on one backing file;
//! - [`floor`]: one loopback TCP round trip and stream on this machine, the floor;
//! - [`report`]: tables, ratios, targets, JSON.

pub mod floor;
pub mod options;
pub mod peers;
pub mod procstat;
pub mod report;
pub mod stats;
pub mod workload;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, Result};
use serde::Serialize;

use options::{BenchOptions, PeersOptions, Workload};
use procstat::Watched;
use report::{Cell, Machine, PeersReport, RunReport};

/// The progress line on stderr (drawn only on a terminal, and only when asked).
pub struct Progress(indicatif::ProgressBar);

impl Progress {
    /// A progress line, hidden unless `show`.
    pub fn new(show: bool) -> Self {
        if !show {
            return Progress(indicatif::ProgressBar::hidden());
        }
        let pb = indicatif::ProgressBar::new_spinner();
        pb.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        Progress(pb)
    }

    /// Replaces the line.
    pub fn set(&self, msg: String) {
        self.0.set_message(msg);
        self.0.tick();
    }

    /// Prints a line above the progress line.
    pub fn println(&self, msg: String) {
        if self.0.is_hidden() {
            return;
        }
        self.0.println(msg);
    }

    /// Removes the line.
    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// What a bench printed.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Outcome {
    /// One workload on one socket.
    Single(RunReport),
    /// The peer matrix.
    Peers(PeersReport),
}

impl Outcome {
    /// Requests that completed with an error status, over every run.
    pub fn errors(&self) -> u64 {
        match self {
            Outcome::Single(r) => r.figures.errors,
            Outcome::Peers(p) => p
                .cells
                .iter()
                .flat_map(|c| &c.runs)
                .map(|r| r.figures.errors)
                .sum(),
        }
    }

    /// The human-readable table.
    pub fn table(&self) -> String {
        match self {
            Outcome::Single(r) => report::single_table(r),
            Outcome::Peers(p) => report::peers_table(p),
        }
    }
}

/// Runs the bench. `command` is the command line, recorded in a `--peers` report.
///
/// # Errors
/// A server does not start or stalls, a socket cannot be opened, a process vanishes.
pub fn run(opts: &BenchOptions, command: String) -> Result<Outcome> {
    let progress = Progress::new(opts.progress);
    let out = match &opts.peers {
        Some(p) => peers_run(opts, p, command, &progress).map(Outcome::Peers),
        None => single(opts, &progress).map(Outcome::Single),
    };
    progress.finish();
    out
}

fn single(opts: &BenchOptions, progress: &Progress) -> Result<RunReport> {
    let Some(socket) = &opts.socket else {
        bail!("give --socket PATH (a vhost-user-blk socket), or --peers");
    };
    let procs: Vec<Watched> = opts
        .pids
        .iter()
        .map(|&pid| Watched {
            name: procstat::comm(pid).unwrap_or_else(|| format!("pid {pid}")),
            pid,
        })
        .collect();
    let what = socket.display().to_string();
    let m = workload::run(socket, &opts.workload, &procs, progress, &what)?;
    Ok(RunReport::new(&what, &opts.workload, m))
}

fn peers_run(
    opts: &BenchOptions,
    p: &PeersOptions,
    command: String,
    progress: &Progress,
) -> Result<PeersReport> {
    let cells: Vec<Workload> = p.matrix.cells(opts.workload.runtime, opts.workload.ramp);
    let queues = cells.iter().map(|c| c.queues).max().unwrap_or(1) as u16;
    let mut peers = peers::Peers::start(
        &peers::Setup {
            dir: p.dir.as_deref(),
            size: p.size,
            queues,
            poll_us: p.poll_us,
        },
        progress,
    )?;
    let n = peers.targets.len();
    let mut out = Vec::new();
    for (ci, w) in cells.iter().enumerate() {
        let mut runs: Vec<Option<RunReport>> = vec![None; n];
        // Each cell starts with the next server, so drift hits all of them alike.
        for k in 0..n {
            let ti = (ci + k) % n;
            let t = &mut peers.targets[ti];
            t.check_alive()?;
            let what = format!("[{}/{}] {} on {}", ci + 1, cells.len(), w.label(), t.name);
            let m = workload::run(&t.socket, w, &t.procs, progress, &what)?;
            let r = RunReport::new(t.name, w, m);
            progress.println(format!(
                "{what}: {:.0} IOPS, {:.1} MB/s, p50 {:.1} µs",
                r.figures.iops, r.figures.mb_per_s, r.figures.latency.p50_us
            ));
            runs[ti] = Some(r);
        }
        out.push(Cell::new(w.label(), runs.into_iter().flatten().collect()));
    }
    let commands: BTreeMap<String, Vec<String>> = peers
        .targets
        .iter()
        .map(|t| (t.name.to_owned(), t.commands.clone()))
        .collect();
    drop(peers);
    // Measured with the servers gone, for as long as a cell runs (at most 3 s a part).
    let window = opts
        .workload
        .runtime
        .clamp(Duration::from_millis(200), Duration::from_secs(3));
    progress.set("floor: loopback TCP round trips and streams".into());
    let floor = floor::measure(window)?;
    Ok(PeersReport::new(
        Machine::this(peers::qsd_version()),
        command,
        commands,
        out,
        Some(floor),
    ))
}
