//! `devlend demo`: the whole path on one machine, with embedded defaults.
//!
//! A sparse disk image is lent by a device agent on loopback and attached by a compute
//! agent. Then, by default ([`vm`]), a QEMU guest (TCG) gets the disk live over QMP,
//! writes a known pattern across it and verifies it, printing a checksum; the disk is
//! detached live and the lender's file must hold the same checksum. Without a VM
//! ([`blkio`]), the `blkio` frontend does the writing and verifying.

pub mod blkio;
pub mod rig;
pub mod vm;

use std::path::PathBuf;

use anyhow::Result;
use devlend_compute_agent::api::AttachmentInfo;
use serde::Serialize;

/// Who drives the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Frontend {
    /// A QEMU guest's own virtio-blk driver, attached and detached live.
    Vm,
    /// The libblkio vhost-user-blk frontend (no VM needed).
    Blkio,
}

/// Demo settings.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Disk size in bytes (a multiple of 1 MiB).
    pub size: u64,
    /// Work directory (default: a new temporary directory, removed at the end).
    pub dir: Option<PathBuf>,
    /// Print progress on stderr.
    pub progress: bool,
    /// Who drives the disk.
    pub frontend: Frontend,
}

/// What the demo did.
#[derive(Debug, Clone, Serialize)]
pub struct DemoSummary {
    /// Who drove the disk.
    pub frontend: String,
    /// Disk size in bytes.
    pub size: u64,
    /// Seconds per phase, in order (e.g. `boot`, `attach`, `write+verify`, `detach`).
    pub phases: Vec<(String, f64)>,
    /// Checksum of the disk as the frontend computed it after writing and verifying.
    pub checksum_frontend: String,
    /// The same checksum over the lender's image file after detach.
    pub checksum_lender: String,
    /// The attachment's final state, with its counters.
    pub attachment: AttachmentInfo,
    /// Wall-clock seconds of the whole demo.
    pub seconds: f64,
}

/// Runs the demo.
///
/// # Errors
/// Any step failing (with the agents' logs when one of them died), a data mismatch, or
/// QEMU missing (with what to install).
pub fn run(opts: &DemoOptions) -> Result<DemoSummary> {
    match opts.frontend {
        Frontend::Vm => vm::run(opts),
        Frontend::Blkio => blkio::run(opts),
    }
}
