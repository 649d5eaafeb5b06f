//! Live migration in tests: QMP `migrate` and its polling on the source, the
//! destination's state, a guest workload that writes and verifies a disk while printing
//! a line per I/O, and the longest pause in that workload across each switch-over.
//!
//! A migration chain ([`Chain`]) holds the QEMU that runs the guest now; each
//! [`Chain::migrate`] moves the guest to a destination started with
//! [`devlend_qemu::migration::Incoming`], checks that the source is left `postmigrate`
//! and the destination `running`, quits the source and keeps its console, so that the
//! workload's lines can be read across every QEMU the guest ran in.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use devlend_compute_agent::vmm::qmp::Qmp;
use devlend_qemu::guest::{Guest, TimedConsole, TimedLine};
use devlend_qemu::migration::join_consoles;
use serde_json::{json, Value};

/// Connects to `guest`'s QMP socket, retrying for up to `timeout` (QEMU creates it
/// shortly after it starts).
///
/// # Errors
/// The socket did not answer in time, or QEMU exited.
pub fn qmp(guest: &Guest, timeout: Duration) -> Result<Qmp> {
    let end = Instant::now() + timeout;
    loop {
        match Qmp::connect(guest.qmp_socket()) {
            Ok(q) => return Ok(q),
            Err(e) if Instant::now() > end => {
                return Err(anyhow!(e)).with_context(|| {
                    format!(
                        "QMP of {} after {timeout:?}:\n{}",
                        guest.name(),
                        guest.console()
                    )
                })
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// QMP `query-status`: `running`, `inmigrate`, `postmigrate`, `paused`, ...
///
/// # Errors
/// QMP fails.
pub fn run_state(q: &mut Qmp) -> Result<String> {
    let r = q.execute("query-status", json!({}))?;
    Ok(r["status"].as_str().unwrap_or_default().to_owned())
}

/// Waits up to `timeout` for `query-status` to say `want`; returns the last state seen.
///
/// # Errors
/// QMP fails, or the state is still another one at the end.
pub fn wait_state(q: &mut Qmp, want: &str, timeout: Duration) -> Result<()> {
    let end = Instant::now() + timeout;
    loop {
        let s = run_state(q)?;
        if s == want {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("QEMU state is {s:?}, not {want:?}, after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Migration parameters set on the source before each `migrate`.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// `downtime-limit`, ms: the longest stop QEMU plans for the last pass.
    pub downtime_limit_ms: u64,
    /// `max-bandwidth`, bytes per second.
    pub max_bandwidth: u64,
}

impl Default for Params {
    /// QEMU's own default downtime limit (300 ms) and 1 GiB/s (a veth is faster than
    /// QEMU's default of 128 MiB/s, which would only stretch the pre-copy).
    fn default() -> Self {
        Params {
            downtime_limit_ms: 300,
            max_bandwidth: 1 << 30,
        }
    }
}

/// Sets `params` and starts `migrate` to `uri` (`tcp:IP:PORT`) on the source `q`.
///
/// # Errors
/// QEMU refuses (a migration blocker, say: its description is in the error).
pub fn start_migration(q: &mut Qmp, uri: &str, params: Params) -> Result<()> {
    q.execute(
        "migrate-set-parameters",
        json!({
            "downtime-limit": params.downtime_limit_ms,
            "max-bandwidth": params.max_bandwidth,
        }),
    )?;
    q.execute("migrate", json!({ "uri": uri }))
        .context("QMP migrate")?;
    Ok(())
}

/// Lowers or raises `max-bandwidth` of a migration under way (bytes per second).
///
/// # Errors
/// QMP fails.
pub fn set_bandwidth(q: &mut Qmp, bytes_per_second: u64) -> Result<()> {
    q.execute(
        "migrate-set-parameters",
        json!({ "max-bandwidth": bytes_per_second }),
    )?;
    Ok(())
}

/// QMP `migrate_cancel` on the source.
///
/// # Errors
/// QMP fails.
pub fn cancel_migration(q: &mut Qmp) -> Result<()> {
    q.execute("migrate_cancel", json!({}))?;
    Ok(())
}

/// What `query-migrate` said at the end of a migration.
#[derive(Debug, Clone)]
pub struct MigrationInfo {
    /// `completed`, `failed` or `cancelled`.
    pub status: String,
    /// QEMU's `total-time` (ms), when given.
    pub total_ms: Option<u64>,
    /// QEMU's `downtime` (ms, its own measure of the stop), when given.
    pub downtime_ms: Option<u64>,
    /// QEMU's `setup-time` (ms), when given.
    pub setup_ms: Option<u64>,
    /// RAM bytes sent.
    pub ram_transferred: Option<u64>,
    /// The error QEMU gives for a failed migration.
    pub error: Option<String>,
    /// The whole last answer.
    pub raw: Value,
}

/// `query-migrate` now.
///
/// # Errors
/// QMP fails.
pub fn query_migrate(q: &mut Qmp) -> Result<Value> {
    Ok(q.execute("query-migrate", json!({}))?)
}

/// Polls `query-migrate` on the source until it says `completed`, `failed` or
/// `cancelled` (every 10 ms), and returns that answer.
///
/// # Errors
/// QMP fails, or the migration still runs after `timeout`.
pub fn wait_migration(q: &mut Qmp, timeout: Duration) -> Result<MigrationInfo> {
    let end = Instant::now() + timeout;
    loop {
        let r = query_migrate(q)?;
        let status = r["status"].as_str().unwrap_or_default().to_owned();
        if matches!(status.as_str(), "completed" | "failed" | "cancelled") {
            return Ok(MigrationInfo {
                status,
                total_ms: r["total-time"].as_u64(),
                downtime_ms: r["downtime"].as_u64(),
                setup_ms: r["setup-time"].as_u64(),
                ram_transferred: r["ram"]["transferred"].as_u64(),
                error: r["error-desc"].as_str().map(str::to_owned),
                raw: r,
            });
        }
        if Instant::now() > end {
            bail!("migration not done after {timeout:?}: {r}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One migration of a [`Chain`], as the host saw it.
#[derive(Debug, Clone)]
pub struct Switch {
    /// A label, e.g. `A>B`.
    pub label: String,
    /// When `migrate` was sent.
    pub started: Instant,
    /// When `query-migrate` first said `completed`.
    pub completed: Instant,
    /// QEMU's account of it.
    pub info: MigrationInfo,
}

/// A guest and the QEMUs it has run in, for a series of migrations.
pub struct Chain {
    /// The QEMU that runs the guest now.
    pub current: Guest,
    /// Consoles of the QEMUs the guest left, in order.
    pub previous: Vec<TimedConsole>,
    /// The migrations done.
    pub switches: Vec<Switch>,
    /// The source of the last migration, left in `postmigrate` by
    /// [`Chain::migrate_keeping_source`] until [`Chain::quit_source`].
    pub left: Option<Guest>,
}

impl Chain {
    /// A chain starting with `guest`.
    pub fn new(guest: Guest) -> Self {
        Chain {
            current: guest,
            previous: Vec::new(),
            switches: Vec::new(),
            left: None,
        }
    }

    /// As [`Chain::migrate`], but the source QEMU stays (`postmigrate`, its vhost-user
    /// connections open) until [`Chain::quit_source`]: the order `docs/migration.md`
    /// gives, `devlend migrate finish` on the source before quitting its QEMU.
    ///
    /// # Errors
    /// As [`Chain::migrate`].
    pub fn migrate_keeping_source(
        &mut self,
        label: &str,
        dest: Guest,
        uri: &str,
        params: Params,
        timeout: Duration,
    ) -> Result<&Switch> {
        self.quit_source()?;
        self.switch(label, dest, uri, params, timeout, false)
    }

    /// Quits the source QEMU [`Chain::migrate_keeping_source`] left, if any.
    ///
    /// # Errors
    /// It does not quit.
    pub fn quit_source(&mut self) -> Result<()> {
        let Some(mut source) = self.left.take() else {
            return Ok(());
        };
        if let Ok(mut sq) = qmp(&source, Duration::from_secs(5)) {
            let _ = sq.execute("quit", json!({}));
        }
        if source.wait_exit(Duration::from_secs(10)).is_none() {
            source.kill();
            bail!("the source QEMU did not quit");
        }
        if let Some(last) = self.previous.last_mut() {
            *last = source.timed_console();
        }
        Ok(())
    }

    /// Migrates the guest to `dest` (started with `-incoming uri`): waits until `dest`
    /// listens (`inmigrate`), runs `migrate`, waits up to `timeout` for `completed`,
    /// checks the source is `postmigrate` and `dest` becomes `running`, quits the source
    /// (keeping its console) and makes `dest` the current QEMU.
    ///
    /// # Errors
    /// Any step fails; a failed migration's error holds QEMU's reason and the tails
    /// of both consoles. The source keeps the guest then, and `dest` is dropped.
    pub fn migrate(
        &mut self,
        label: &str,
        dest: Guest,
        uri: &str,
        params: Params,
        timeout: Duration,
    ) -> Result<&Switch> {
        self.quit_source()?;
        self.switch(label, dest, uri, params, timeout, true)
    }

    fn switch(
        &mut self,
        label: &str,
        dest: Guest,
        uri: &str,
        params: Params,
        timeout: Duration,
        quit: bool,
    ) -> Result<&Switch> {
        let mut dq = qmp(&dest, Duration::from_secs(20))?;
        wait_state(&mut dq, "inmigrate", Duration::from_secs(20))
            .with_context(|| format!("{label}: the destination is not waiting"))?;
        let mut sq = qmp(&self.current, Duration::from_secs(5))?;
        let started = Instant::now();
        start_migration(&mut sq, uri, params).with_context(|| format!("{label}: migrate"))?;
        let info = wait_migration(&mut sq, timeout).with_context(|| label.to_owned())?;
        let completed = Instant::now();
        if info.status != "completed" {
            bail!(
                "{label}: migration {} ({}): {}\n--- source ---\n{}\n--- destination ---\n{}",
                info.status,
                info.error.as_deref().unwrap_or("no error given"),
                info.raw,
                tail(&self.current.console(), 15),
                tail(&dest.console(), 15),
            );
        }
        wait_state(&mut dq, "running", Duration::from_secs(20))
            .with_context(|| format!("{label}: the destination does not run"))?;
        let source_state = run_state(&mut sq)?;
        if source_state != "postmigrate" {
            bail!("{label}: the source is {source_state:?} after the migration, not postmigrate");
        }
        let mut source = std::mem::replace(&mut self.current, dest);
        if quit {
            let _ = sq.execute("quit", json!({}));
            drop(sq);
            if source.wait_exit(Duration::from_secs(10)).is_none() {
                source.kill();
                bail!("{label}: the source QEMU did not quit");
            }
            self.previous.push(source.timed_console());
        } else {
            drop(sq);
            self.previous.push(source.timed_console());
            self.left = Some(source);
        }
        self.switches.push(Switch {
            label: label.to_owned(),
            started,
            completed,
            info,
        });
        Ok(self.switches.last().expect("just pushed"))
    }

    /// Every console line the guest printed so far, across its QEMUs.
    pub fn lines(&self) -> Vec<TimedLine> {
        let mut all = self.previous.clone();
        all.push(self.current.timed_console());
        join_consoles(&all)
    }

    /// The console across all QEMUs, as text.
    pub fn console(&self) -> String {
        let mut s = String::new();
        for l in self.lines() {
            s.push_str(&l.text);
            s.push('\n');
        }
        s
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Size of the workload's chunks (each one `dd` with O_DIRECT).
pub const CHUNK_BYTES: u64 = 64 << 10;

/// The guest's workload on `/dev/vda`: for `SECS` seconds of guest time, writes a fresh
/// random 64 KiB chunk with O_DIRECT to chunk `seq % CHUNKS` and reads it back with
/// O_DIRECT, comparing sha256; prints `DLIO w SEQ UPTIME` after each write and
/// `DLIO r SEQ UPTIME` after each read (UPTIME from `/proc/uptime`, the guest's clock),
/// and `DLIO-ERR ...` for each failure. Then it reads every chunk written once more
/// against its last sha256 and prints results: `ios`, `errors` (failed or differing
/// I/Os), `verified` and `written` (chunks), `region_sha256` (of the first
/// CHUNKS × 64 KiB of the disk).
const WORKLOAD: &str = r#"
devlend-wait-for /dev/vda 30
read t0 rest < /proc/uptime; t0=${t0%.*}
echo "DEVLEND-RESULT workload=started"
seq=0; bad=0
while :; do
  read up rest < /proc/uptime
  [ $(( ${up%.*} - t0 )) -ge SECS ] && break
  i=$((seq % CHUNKS))
  dd if=/dev/urandom of=/tmp/c bs=64k count=1 2>/dev/null
  if ! dd if=/tmp/c of=/dev/vda bs=64k seek=$i oflag=direct 2>/tmp/err; then
    echo "DLIO-ERR write $seq $(cat /tmp/err)"; bad=$((bad+1))
  fi
  read up rest < /proc/uptime; echo "DLIO w $seq $up"
  a=$(sha256sum /tmp/c); a=${a%% *}; echo $a > /tmp/sha$i
  b=$(dd if=/dev/vda bs=64k skip=$i count=1 iflag=direct 2>/tmp/err | sha256sum); b=${b%% *}
  [ "$a" = "$b" ] || { echo "DLIO-ERR verify $seq $(cat /tmp/err)"; bad=$((bad+1)); }
  read up rest < /proc/uptime; echo "DLIO r $seq $up"
  seq=$((seq+1))
done
echo "DEVLEND-RESULT workload=done"
written=$seq; [ $written -gt CHUNKS ] && written=CHUNKS
i=0; ok=0
while [ $i -lt $written ]; do
  b=$(dd if=/dev/vda bs=64k skip=$i count=1 iflag=direct 2>/dev/null | sha256sum); b=${b%% *}
  if [ "$b" = "$(cat /tmp/sha$i)" ]; then ok=$((ok+1)); else echo "DLIO-ERR final $i"; bad=$((bad+1)); fi
  i=$((i+1))
done
echo "DEVLEND-RESULT ios=$seq"
echo "DEVLEND-RESULT errors=$bad"
echo "DEVLEND-RESULT written=$written"
echo "DEVLEND-RESULT verified=$ok"
r=$(dd if=/dev/vda bs=64k count=CHUNKS iflag=direct 2>/dev/null | sha256sum)
echo "DEVLEND-RESULT region_sha256=${r%% *}"
"#;

/// [`WORKLOAD`] running for `secs` seconds of guest time over `chunks` chunks.
pub fn workload_script(secs: u32, chunks: u32) -> String {
    WORKLOAD
        .replace("SECS", &secs.to_string())
        .replace("CHUNKS", &chunks.to_string())
}

/// One `DLIO` line of the workload.
#[derive(Debug, Clone, Copy)]
pub struct Tick {
    /// When the host read it.
    pub at: Instant,
    /// The guest's clock (s) when it printed it.
    pub guest_s: f64,
    /// I/O number.
    pub seq: u64,
    /// `true`: after the write; `false`: after the read.
    pub write: bool,
}

/// The workload's ticks in `lines`, checked to be in order (`w 0`, `r 0`, `w 1`, ...,
/// none missing or doubled), and the `DLIO-ERR` lines.
///
/// # Errors
/// A tick is missing, doubled or out of order.
pub fn ticks(lines: &[TimedLine]) -> Result<(Vec<Tick>, Vec<String>)> {
    let mut out: Vec<Tick> = Vec::new();
    let mut errors = Vec::new();
    for l in lines {
        if let Some(at) = l.text.find("DLIO-ERR") {
            errors.push(l.text[at..].to_owned());
            continue;
        }
        let Some(at) = l.text.find("DLIO ") else {
            continue;
        };
        let f: Vec<&str> = l.text[at + 5..].split_whitespace().collect();
        let (Some(kind), Some(seq), Some(up)) = (f.first(), f.get(1), f.get(2)) else {
            bail!("bad workload line {:?}", l.text);
        };
        let tick = Tick {
            at: l.at,
            guest_s: up.parse().with_context(|| format!("line {:?}", l.text))?,
            seq: seq.parse().with_context(|| format!("line {:?}", l.text))?,
            write: *kind == "w",
        };
        let expected = match out.last() {
            None => (0, true),
            Some(p) if p.write => (p.seq, false),
            Some(p) => (p.seq + 1, true),
        };
        if (tick.seq, tick.write) != expected {
            bail!(
                "workload line {:?} where {} {} was due",
                l.text,
                if expected.1 { "w" } else { "r" },
                expected.0
            );
        }
        out.push(tick);
    }
    Ok((out, errors))
}

/// The longest stretch without workload progress around a switch-over.
#[derive(Debug, Clone, Copy)]
pub struct Pause {
    /// Host time between the two ticks (what a user of the VM waits).
    pub host: Duration,
    /// Guest time between them (the guest's clock stops while the VM is stopped).
    pub guest: Duration,
    /// The usual gap: the median of all gaps between ticks in the run.
    pub typical: Duration,
}

/// The longest host-time gap between consecutive ticks whose second tick arrived
/// between `from` and `to` (e.g. from `migrate` to one second after `completed`).
///
/// # Errors
/// No tick in that window (the workload stopped).
pub fn longest_pause(ticks: &[Tick], from: Instant, to: Instant) -> Result<Pause> {
    let mut gaps: Vec<Duration> = ticks.windows(2).map(|w| w[1].at - w[0].at).collect();
    gaps.sort();
    let typical = gaps.get(gaps.len() / 2).copied().unwrap_or_default();
    ticks
        .windows(2)
        .filter(|w| w[1].at >= from && w[1].at <= to)
        .max_by_key(|w| w[1].at - w[0].at)
        .map(|w| Pause {
            host: w[1].at - w[0].at,
            guest: Duration::from_secs_f64((w[1].guest_s - w[0].guest_s).max(0.0)),
            typical,
        })
        .ok_or_else(|| anyhow!("no workload progress in the window"))
}

/// Whole milliseconds, for reports.
pub fn ms(d: Duration) -> u128 {
    d.as_millis()
}
