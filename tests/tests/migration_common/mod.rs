//! What the live-migration test files share: the workload's sizes, one guest test at a
//! time, and [`migrate_chain`], which runs a chain of migrations under the verifying
//! workload and measures the pauses.

#![allow(dead_code)]

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use devlend_tests::guest::{Guest, GuestOutcome};
use devlend_tests::migration::{self, longest_pause, ms, Chain, Params, Pause};
use devlend_tests::migration_lab::{label, to_host, Hosts};

pub static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

pub const DISK_BYTES: u64 = 16 << 20;
/// The workload's region: 64 chunks of 64 KiB.
pub const CHUNKS: u32 = 64;
/// Guest RAM: small, so that each migration copies little under TCG.
pub const MEMORY_MIB: u32 = 256;
/// Seconds of guest time the workload runs: long enough for three migrations (each a
/// destination's start, a second or two of copy, a settling second) on a busy machine.
pub const WORKLOAD_SECS: u32 = 40;
/// Migrations per run: A→B→A→B.
pub const MIGRATIONS: usize = 3;
pub const MIGRATION_TIMEOUT: Duration = Duration::from_secs(60);
/// The reconnect deadline of the attachments of the tests that finish a migration late
/// (`--reconnect-deadline`): requests waiting longer for their session fail with IOERR.
pub const RECONNECT_DEADLINE_S: u32 = 4;
/// How long after QEMU's `completed` such a test runs `devlend migrate finish`: past
/// [`RECONNECT_DEADLINE_S`], so that a destination whose I/O waited for `finish` would
/// have failed the guest's requests.
pub const LATE_FINISH: Duration = Duration::from_secs(RECONNECT_DEADLINE_S as u64 + 2);

/// A migration finished late: the destination's guest must do I/O before `devlend
/// migrate finish`, within the reconnect deadline of QEMU's `completed`; returns once
/// [`LATE_FINISH`] has passed since then, for the caller to run `finish`.
pub fn io_before_late_finish(variant: &str, chain: &Chain) -> Result<()> {
    let sw = chain.switches.last().context("no migration yet")?;
    let deadline = sw.completed + Duration::from_secs(u64::from(RECONNECT_DEADLINE_S));
    // Half a second after the switch: no line the source printed before it stopped.
    let settled = sw.completed + Duration::from_millis(500);
    let io = |l: &devlend_tests::guest::TimedLine| l.at > settled && l.text.contains("DLIO r ");
    while !chain.lines().iter().any(io) {
        ensure!(
            Instant::now() < deadline,
            "{variant} {}: the destination's guest did no I/O within the reconnect deadline \
             ({RECONNECT_DEADLINE_S} s) of the switch, before `devlend migrate finish` on the \
             source:\n{}",
            sw.label,
            chain.console()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "[{variant}] {}: the destination does I/O {} ms after the switch, finish not run yet",
        sw.label,
        ms(Instant::now() - sw.completed)
    );
    if let Some(left) = (sw.completed + LATE_FINISH).checked_duration_since(Instant::now()) {
        std::thread::sleep(left);
    }
    Ok(())
}

/// Waits until the guest's workload has started and made some progress.
pub fn wait_workload(chain: &Chain) -> Result<()> {
    chain
        .current
        .wait_for_text("workload=started", Duration::from_secs(240))?;
    chain
        .current
        .wait_for_text("DLIO r 3 ", Duration::from_secs(60))?;
    Ok(())
}

/// What one run measured.
pub struct Run {
    pub variant: &'static str,
    pub pauses: Vec<(String, Pause, migration::MigrationInfo)>,
}

impl Run {
    pub fn print(&self) {
        for (label, p, info) in &self.pauses {
            println!(
                "MIGRATION-PAUSE variant={} switch={label} pause_ms={} guest_clock_ms={} \
                 typical_gap_ms={} qemu_downtime_ms={} qemu_total_ms={} ram_bytes={}",
                self.variant,
                ms(p.host),
                ms(p.guest),
                ms(p.typical),
                info.downtime_ms.unwrap_or(0),
                info.total_ms.unwrap_or(0),
                info.ram_transferred.unwrap_or(0),
            );
        }
    }

    pub fn longest(&self) -> Duration {
        self.pauses
            .iter()
            .map(|(_, p, _)| p.host)
            .max()
            .unwrap_or_default()
    }
}

/// Runs the migrations of `chain` (whose workload is under way): for each, `dest`
/// starts the destination QEMU (given the migration's number, its host and URI),
/// then `done` runs after the switch (e.g. `devlend migrate finish`; given the chain,
/// whose last switch is this one), then the source QEMU quits. At the end waits for
/// the workload, checks it, and measures the pauses.
pub fn migrate_chain(
    variant: &'static str,
    chain: &mut Chain,
    hosts: &Hosts,
    mut dest: impl FnMut(usize, &Guest, &str, &str) -> Result<Guest>,
    mut done: impl FnMut(usize, &Chain) -> Result<()>,
) -> Result<(Run, GuestOutcome, String)> {
    wait_workload(chain)?;
    for k in 0..MIGRATIONS {
        let (ns, uri) = hosts.dest(to_host(k), k);
        let d = dest(k, &chain.current, ns, &uri)?;
        // The source QEMU stays until `done` ran, as `docs/migration.md` has it
        // (`devlend migrate finish`, then quit the source QEMU).
        let sw = chain.migrate_keeping_source(
            &label(k),
            d,
            &uri,
            Params::default(),
            MIGRATION_TIMEOUT,
        )?;
        eprintln!(
            "[{variant}] {}: completed in {} ms (QEMU downtime {:?} ms)",
            sw.label,
            ms(sw.completed - sw.started),
            sw.info.downtime_ms
        );
        done(k, chain)?;
        chain.quit_source()?;
        // The guest goes on in its new QEMU before the next migration.
        let seen = chain.lines().len();
        let end = Instant::now() + Duration::from_secs(30);
        while !chain.lines()[seen..]
            .iter()
            .any(|l| l.text.contains("DLIO r "))
        {
            ensure!(
                Instant::now() < end,
                "{variant}: no I/O after {}:\n{}",
                label(k),
                chain.console()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(1000));
    }
    let last_switch = chain.switches.last().map(|s| s.completed);
    let outcome = chain
        .current
        .wait_done(Duration::from_secs(240))
        .with_context(|| format!("{variant}: the workload did not end"))?;
    let console = chain.console();
    outcome.check_success()?;
    let lines = chain.lines();
    let (ticks, errors) = migration::ticks(&lines)?;
    ensure!(
        errors.is_empty(),
        "{variant}: the guest saw I/O errors: {errors:?}"
    );
    ensure!(
        !console.contains("I/O error") && !console.contains("blk_update_request"),
        "{variant}: the guest kernel logged I/O errors:\n{console}"
    );
    let r = |k: &str| outcome.result(k).unwrap_or("").to_owned();
    ensure!(r("errors") == "0", "{variant}: errors={}", r("errors"));
    ensure!(
        r("verified") == r("written") && r("written") == CHUNKS.to_string(),
        "{variant}: verified {} of {} chunks (want {CHUNKS})",
        r("verified"),
        r("written")
    );
    ensure!(
        ticks.last().is_some_and(|t| Some(t.at) > last_switch),
        "{variant}: the workload ended before the last migration: raise WORKLOAD_SECS"
    );
    let mut run = Run {
        variant,
        pauses: Vec::new(),
    };
    for sw in &chain.switches {
        let p = longest_pause(
            &ticks,
            sw.started,
            sw.completed + Duration::from_millis(1500),
        )
        .with_context(|| format!("{variant} {}", sw.label))?;
        run.pauses.push((sw.label.clone(), p, sw.info.clone()));
    }
    eprintln!(
        "[{variant}] {} I/Os ({} chunks verified), {} migrations",
        r("ios"),
        r("verified"),
        chain.switches.len()
    );
    Ok((run, outcome, console))
}
