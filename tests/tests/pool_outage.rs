//! The pool is the control plane: its outage must not stop a leased device (issue 42).
//! Real processes: a pool (`devlend pool serve`, SQLite or a private PostgreSQL), a
//! lender registered with it (heartbeat every 500 ms), a compute agent with one disk
//! attached by class under a 3 s lease, and the libblkio frontend doing verified I/O
//! (four 16 KiB writes at QD4, read back and compared) without a pause. Each outage
//! lasts three lease TTLs; the I/O must go on during it with no error, go on after it,
//! and the lease must still be live at the pool after it. The lender and the compute
//! host are cut from the pool in network namespaces (each with its own link to the
//! pool, which is in this namespace, and a direct link between them). A lender 5
//! minutes off the others' clocks runs under libfaketime. The safety tests: a compute
//! host killed for good gives its device to another one, whose newer lease fences the
//! first host's agent when it comes back although the lender could not reach the pool;
//! two pool servers on one PostgreSQL, one killed. One QEMU guest goes through a pool
//! stop, a pool kill and restart and a compute host cut with its O_DIRECT workload.
//!
//! Why this file is over 600 lines: a test file: its eleven scenarios share one rig
//! and one I/O load, each its own test so that they run in parallel.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_pool::api::{LeaseState, Role};
use devlend_pool::PoolClient;
use devlend_tests::agents::{bin, free_port, sparse_file, spawn_in, wait_listening};
use devlend_tests::agents::{Borrower, Pool, Proc};
use devlend_tests::netns::{Netns, NsLink};
use devlend_tests::postgres::Postgres;

const MIB: u64 = 1 << 20;
const DISK: u64 = 64 * MIB;
const PROVIDER: &str = "lender-o";
/// The lease's TTL (s): `devlend attach --lease-ttl`.
const TTL_S: u64 = 3;
/// Every outage lasts three TTLs.
const OUTAGE: Duration = Duration::from_secs(3 * TTL_S);
const HEARTBEAT_MS: u64 = 500;
const LENDER_PORT: u16 = 7700;
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// Connects the libblkio frontend to `sock`, retrying for up to 30 s: a restarted
/// agent listens once it has set its attachment up again (its old socket file may be
/// there before).
fn connect_retry(sock: &Path) -> Result<BlkClient, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match BlkClient::connect(sock, 1, MIB as usize) {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() > deadline => return Err(format!("{e:#}")),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

// ---- verified I/O without a pause -------------------------------------------------

/// What a load saw when it stopped.
#[derive(Debug)]
struct LoadEnd {
    ops: u64,
    errors: Vec<String>,
    longest: Duration,
}

/// A thread doing verified I/O on a vhost-user-blk socket until told to stop: rounds of
/// four 16 KiB writes at QD4 to slots of its region, then the four read back at QD4 and
/// compared with what was written.
struct Load {
    stop: Arc<AtomicBool>,
    ops: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    /// The first failures, as they happen.
    seen: Arc<std::sync::Mutex<Vec<String>>>,
    handle: Option<JoinHandle<LoadEnd>>,
}

impl Load {
    fn start(sock: &Path, region: u64, seed: u8) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (s, o, f, seen2) = (stop.clone(), ops.clone(), failed.clone(), seen.clone());
        let sock = sock.to_path_buf();
        let handle = std::thread::spawn(move || {
            let mut end = LoadEnd {
                ops: 0,
                errors: Vec::new(),
                longest: Duration::ZERO,
            };
            let mut c = match connect_retry(&sock) {
                Ok(c) => c,
                Err(e) => {
                    end.errors.push(format!("connect: {e}"));
                    f.fetch_add(1, Ordering::Relaxed);
                    return end;
                }
            };
            const LEN: usize = 16 << 10;
            let mut round = 0u64;
            while !s.load(Ordering::Relaxed) {
                let t = Instant::now();
                let slot = round % 64;
                let pattern = seed.wrapping_add(round as u8);
                for (i, b) in c.buffer()[..4 * LEN].iter_mut().enumerate() {
                    *b = pattern.wrapping_add((i % 253) as u8);
                }
                let at = |i: usize| region + (slot * 4 + i as u64) * LEN as u64;
                let writes: Vec<BlkOp> = (0..4)
                    .map(|i| BlkOp::Write {
                        offset: at(i),
                        buf: i * LEN,
                        len: LEN,
                    })
                    .collect();
                let reads: Vec<BlkOp> = (0..4)
                    .map(|i| BlkOp::Read {
                        offset: at(i),
                        buf: 4 * LEN + i * LEN,
                        len: LEN,
                    })
                    .collect();
                let mut bad = Vec::new();
                for (what, batch) in [("write", &writes), ("read", &reads)] {
                    match c.run(0, batch) {
                        Ok(r) if r.iter().all(|&x| x == 0) => {}
                        Ok(r) => bad.push(format!("round {round}: {what} statuses {r:?}")),
                        Err(e) => bad.push(format!("round {round}: {what}: {e:#}")),
                    }
                }
                if bad.is_empty() {
                    let b = c.buffer();
                    if b[..4 * LEN] != b[4 * LEN..8 * LEN] {
                        bad.push(format!("round {round}: read back differs"));
                    }
                }
                end.longest = end.longest.max(t.elapsed());
                if !bad.is_empty() {
                    if let Ok(mut v) = seen2.lock() {
                        v.extend(bad.iter().cloned());
                    }
                    f.fetch_add(bad.len() as u64, Ordering::Relaxed);
                    end.errors.extend(bad);
                    if end.errors.len() > 20 {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                } else {
                    end.ops += 8;
                    o.fetch_add(8, Ordering::Relaxed);
                }
                round += 1;
            }
            end
        });
        Load {
            stop,
            ops,
            failed,
            seen,
            handle: Some(handle),
        }
    }

    /// Waits `d`; the I/Os completed meanwhile. Panics on a failed I/O.
    fn run_for(&self, d: Duration, what: &str) -> u64 {
        let before = self.ops.load(Ordering::Relaxed);
        let end = Instant::now() + d;
        while Instant::now() < end {
            if self.failed.load(Ordering::Relaxed) != 0 {
                std::thread::sleep(Duration::from_millis(300));
                panic!(
                    "{what}: a leased I/O failed: {:?}",
                    self.seen.lock().map(|v| v.clone()).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.ops.load(Ordering::Relaxed) - before
    }

    /// Stops the load (waiting up to 40 s for its last round) and what it saw.
    fn finish(mut self) -> LoadEnd {
        self.stop.store(true, Ordering::Relaxed);
        let h = self.handle.take().expect("finished once");
        let deadline = Instant::now() + Duration::from_secs(40);
        while !h.is_finished() {
            assert!(
                Instant::now() < deadline,
                "the I/O stalled: a request is pending for over 40 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        h.join().expect("the load thread")
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

// ---- the rig -----------------------------------------------------------------------

/// Network namespaces: the lender in `l`, the compute agent in `c`, each linked to this
/// namespace (the pool's) and to each other directly (`lc`, the data path).
struct Net {
    lc: NsLink,
    c: Netns,
    l: Netns,
}

impl Net {
    fn new(n: u8, k: u8) -> Self {
        let l = Netns::new(n).unwrap();
        let c = Netns::new(n + 1).unwrap();
        let lc = NsLink::new(&l, &c, k).unwrap();
        Net { lc, c, l }
    }
}

#[derive(Default)]
struct Opts {
    postgres: bool,
    /// Namespaces `n`, `n + 1` and link `k`.
    netns: Option<(u8, u8)>,
    /// libfaketime's `FAKETIME` for the lender.
    lender_clock: Option<&'static str>,
    /// A second pool server on the same PostgreSQL; the agents get both URLs.
    two_servers: bool,
}

/// Its fields drop in order: the processes, then the database, the namespaces and the
/// directory.
struct Rig {
    borrower: Borrower,
    borrower_restarts: u32,
    lender: Proc,
    lender_config: PathBuf,
    lender_clock: Option<&'static str>,
    lender_restarts: u32,
    pool: Pool,
    pool_port: u16,
    /// The second server of [`Opts::two_servers`].
    pool2: Option<Pool>,
    admin: PoolClient,
    pg: Option<Postgres>,
    net: Option<Net>,
    sock: PathBuf,
    lease: uuid::Uuid,
    dir: tempfile::TempDir,
}

/// The lender's config: `listen` (advertised as `advertise`), the pool at `pool_url`,
/// a heartbeat every `heartbeat_ms`, disk0.
fn lender_config(
    dir: &Path,
    listen: &str,
    advertise: &str,
    pool_url: &str,
    heartbeat_ms: u64,
) -> PathBuf {
    let config = dir.join("device-agent.toml");
    std::fs::write(
        &config,
        format!(
            r#"listen = "{listen}"
key_file = "{key}"
[pool]
url = "{pool_url}"
provider = "{PROVIDER}"
advertise = "{advertise}"
heartbeat_interval_ms = {heartbeat_ms}

[[device]]
name = "disk0"
path = "{img}"
"#,
            key = dir.join("lender.key").display(),
            img = dir.join("disk0.img").display(),
        ),
    )
    .unwrap();
    config
}

/// Starts the lender of `config` (in `netns`, under libfaketime's `clock`), waiting
/// until `probe` accepts connections.
fn start_lender(
    dir: &Path,
    name: &str,
    netns: Option<&str>,
    config: &Path,
    clock: Option<&str>,
    probe: &str,
) -> Proc {
    let agent = bin("devlend-device-agent").unwrap();
    let mut args = vec!["--config".to_owned(), config.display().to_string()];
    let program = match clock {
        None => agent,
        Some(offset) => {
            assert!(
                Path::new(LIBFAKETIME).exists(),
                "{LIBFAKETIME} is missing: run `bash qemu/install-deps.sh` (package faketime)"
            );
            let mut a = vec![
                format!("LD_PRELOAD={LIBFAKETIME}"),
                format!("FAKETIME={offset}"),
                agent.display().to_string(),
            ];
            a.append(&mut args);
            args = a;
            PathBuf::from("/usr/bin/env")
        }
    };
    let mut p = spawn_in(netns, name, &program, &args, dir).unwrap();
    wait_listening(&mut p, probe).unwrap();
    p
}

impl Rig {
    fn new(o: Opts) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let net = o.netns.map(|(n, k)| Net::new(n, k));
        let pg = (o.postgres || o.two_servers).then(|| Postgres::new().unwrap());
        let pool_port = free_port().unwrap();
        let pool = start_pool(d, "pool", pool_port, net.is_some(), pg.as_ref());
        let pool2 = o.two_servers.then(|| {
            let port = free_port().unwrap();
            let url = format!("http://127.0.0.1:{port}");
            let pg = pg.as_ref().unwrap();
            Pool::serve(
                d,
                "pool-2",
                &format!("127.0.0.1:{port}"),
                &url,
                &d.join("pool-2"),
                &["--database".into(), pg.url()],
            )
            .unwrap()
        });
        let admin = pool.admin().unwrap();
        pool.enroll(Role::Lender, PROVIDER, &d.join("lender.key"))
            .unwrap();
        pool.enroll(
            Role::Compute,
            &devlend_daemon::host_name(),
            &Borrower::pool_key(d),
        )
        .unwrap();
        sparse_file(&d.join("disk0.img"), DISK).unwrap();
        let urls = match &pool2 {
            None => pool.url.clone(),
            Some(p2) => format!("{},{}", pool.url, p2.url),
        };
        let (listen, advertise, lender_pool, compute_pool, probe) = match &net {
            None => {
                let a = format!("127.0.0.1:{}", free_port().unwrap());
                (a.clone(), a.clone(), urls.clone(), urls, a)
            }
            Some(n) => (
                format!("0.0.0.0:{LENDER_PORT}"),
                format!("{}:{LENDER_PORT}", n.lc.a_ip),
                format!("http://{}:{pool_port}", n.l.host_ip),
                format!("http://{}:{pool_port}", n.c.host_ip),
                format!("{}:{LENDER_PORT}", n.l.ns_ip),
            ),
        };
        let lender_config = lender_config(d, &listen, &advertise, &lender_pool, HEARTBEAT_MS);
        let lender = start_lender(
            d,
            "device-agent",
            net.as_ref().map(|n| n.l.name.as_str()),
            &lender_config,
            o.lender_clock,
            &probe,
        );
        let borrower = Borrower::start_in(
            d,
            net.as_ref().map(|n| n.c.name.as_str()),
            "compute-agent",
            &[],
        )
        .unwrap();
        wait_until("disk0 registered and available", || {
            admin
                .devices(&Default::default())
                .unwrap_or_default()
                .iter()
                .any(|x| x.state == devlend_pool::api::DeviceState::Available)
        });
        let sock = d.join("disk0.sock");
        let lease = attach(
            &borrower,
            &compute_pool,
            &Borrower::pool_key(d),
            &sock,
            None,
        )
        .unwrap_or_else(|e| {
            panic!(
                "{e}\nlender:\n{}\nborrower:\n{}",
                lender.log(),
                borrower.proc.log()
            )
        });
        Rig {
            net,
            pg,
            dir,
            pool,
            pool_port,
            pool2,
            admin,
            lender,
            lender_config,
            lender_clock: o.lender_clock,
            lender_restarts: 0,
            borrower,
            borrower_restarts: 0,
            sock,
            lease,
        }
    }

    fn d(&self) -> &Path {
        self.dir.path()
    }

    /// Every process's log (restarted ones too), by file name.
    fn logs(&self) -> String {
        let mut files: Vec<PathBuf> = std::fs::read_dir(self.d())
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default();
        files.retain(|f| f.extension().is_some_and(|x| x == "log"));
        files.sort();
        let mut out = String::new();
        for f in files {
            let name = f.file_name().unwrap_or_default().to_string_lossy();
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            out.push_str(&format!("--- {name} ---\n{text}\n"));
        }
        out
    }

    fn kill_pool(&mut self) {
        self.pool.proc.kill_hard();
    }

    /// Starts the pool again on its port and database.
    fn restart_pool(&mut self) {
        self.pool = start_pool(
            self.dir.path(),
            "pool-again",
            self.pool_port,
            self.net.is_some(),
            self.pg.as_ref(),
        );
    }

    /// Kills the lender with SIGKILL and starts it again (under `clock`).
    fn restart_lender(&mut self, clock: Option<&'static str>) {
        self.lender.kill_hard();
        self.lender_restarts += 1;
        self.lender_clock = clock;
        let (netns, probe) = match &self.net {
            None => (None, advertise_of(&self.lender_config)),
            Some(n) => (
                Some(n.l.name.clone()),
                format!("{}:{LENDER_PORT}", n.l.ns_ip),
            ),
        };
        self.lender = start_lender(
            self.dir.path(),
            &format!("device-agent-{}", self.lender_restarts),
            netns.as_deref(),
            &self.lender_config,
            clock,
            &probe,
        );
    }

    /// Kills the compute agent with SIGKILL and starts it again on its state file;
    /// waits until its attachment is restored.
    fn restart_borrower(&mut self) {
        self.borrower.proc.kill_hard();
        self.borrower_restarts += 1;
        self.borrower = Borrower::start_in(
            self.dir.path(),
            self.net.as_ref().map(|n| n.c.name.as_str()),
            &format!("compute-agent-{}", self.borrower_restarts),
            &[],
        )
        .unwrap();
        let b = &self.borrower;
        wait_until("the attachment restored", || {
            b.cli_json(&["status"])
                .ok()
                .and_then(|s| s.as_array().map(|a| a.len() == 1))
                .unwrap_or(false)
                && self.sock.exists()
        });
    }

    /// The lease as the pool has it now (retried while the pool comes back; from the
    /// second server when there is one).
    fn lease_state(&self) -> devlend_pool::api::Lease {
        let deadline = Instant::now() + Duration::from_secs(20);
        let admin = match &self.pool2 {
            Some(p) => p.admin().unwrap(),
            None => self.admin.clone(),
        };
        loop {
            match admin.lease(self.lease) {
                Ok(l) => return l,
                Err(e) => assert!(
                    Instant::now() < deadline,
                    "the pool does not answer: {e}\n{}",
                    self.logs()
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// After an outage: two more TTLs of I/O (it goes on), the lease still live at the
    /// pool and renewed, no I/O error over the whole run, the agent not told the lease
    /// ended.
    fn after_outage(&self, load: Load, what: &str) {
        let n = load.run_for(Duration::from_secs(2 * TTL_S), what);
        assert!(n > 0, "{what}: no I/O after the outage\n{}", self.logs());
        let l = self.lease_state();
        assert_eq!(
            l.state,
            LeaseState::Bound,
            "{what}: the lease did not outlive the outage: {l:?}\n{}",
            self.logs()
        );
        let end = load.finish();
        assert!(
            end.errors.is_empty(),
            "{what}: leased I/O failed: {:?}\n{}",
            end.errors,
            self.logs()
        );
        let s = self.borrower.cli_json(&["status"]).unwrap();
        assert_eq!(s[0]["lease_ended"], false, "{what}: {s}");
        assert_eq!(s[0]["counters"]["errors"], 0, "{what}: {s}");
        eprintln!(
            "{what}: {} verified I/Os, longest round {:?}",
            end.ops, end.longest
        );
    }
}

impl Drop for Rig {
    /// A failed test shows every process's log.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
    }
}

/// The lender's `listen` from its config file (where it takes connections).
fn advertise_of(config: &Path) -> String {
    let text = std::fs::read_to_string(config).unwrap();
    let line = text.lines().find(|l| l.starts_with("listen")).unwrap();
    line.split('"').nth(1).unwrap().to_owned()
}

/// `devlend pool serve` on `port` (all addresses with namespaces, else loopback), on
/// SQLite in `DIR/pool` or on `pg`.
fn start_pool(dir: &Path, name: &str, port: u16, all: bool, pg: Option<&Postgres>) -> Pool {
    let listen = if all {
        format!("0.0.0.0:{port}")
    } else {
        format!("127.0.0.1:{port}")
    };
    let extra: Vec<String> = pg
        .map(|p| vec!["--database".to_owned(), p.url()])
        .unwrap_or_default();
    Pool::serve(
        dir,
        name,
        &listen,
        &format!("http://127.0.0.1:{port}"),
        &dir.join("pool"),
        &extra,
    )
    .unwrap()
}

/// `devlend attach --class BLOCK --lease-ttl 3` on `b` at `pool_url`, signed with `key`;
/// the lease id. `hostname`: the compute host's name when it is not this machine's (the
/// CLI runs in a UTS namespace of that name, as it would on that host).
fn attach(
    b: &Borrower,
    pool_url: &str,
    key: &Path,
    sock: &Path,
    hostname: Option<&str>,
) -> Result<uuid::Uuid, String> {
    let ttl = TTL_S.to_string();
    let mut cmd = match hostname {
        None => std::process::Command::new(bin("devlend").unwrap()),
        Some(h) => {
            let mut c = std::process::Command::new("unshare");
            c.args([
                "--uts",
                "sh",
                "-c",
                &format!("hostname {h} && exec \"$0\" \"$@\""),
            ])
            .arg(bin("devlend").unwrap());
            c
        }
    };
    let out = cmd
        .arg("--api")
        .arg(&b.api)
        .args([
            "attach", "--class", "BLOCK", "--vm", "vm-1", "--pool", pool_url,
        ])
        .arg("--pool-key")
        .arg(key)
        .arg("--socket")
        .arg(sock)
        .args(["--lease-ttl", &ttl, "--json"])
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(format!(
            "attach failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    Ok(v["lease"]
        .as_str()
        .expect("the attachment has a lease")
        .parse()
        .unwrap())
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// I/O goes on through the outage `what` (the I/Os completed meanwhile must be some).
fn through(r: &Rig, load: &Load, what: &str) {
    let n = load.run_for(OUTAGE, what);
    assert!(
        n > 0,
        "{what}: no I/O completed in the outage\n{}",
        r.logs()
    );
}

// ---- the outages -------------------------------------------------------------------

#[test]
fn the_pool_stopped_for_three_ttls() {
    let r = Rig::new(Opts::default());
    let load = Load::start(&r.sock, 0, 1);
    load.run_for(Duration::from_secs(1), "before");
    r.pool.proc.signal(libc::SIGSTOP);
    through(&r, &load, "pool stopped");
    r.pool.proc.signal(libc::SIGCONT);
    r.after_outage(load, "pool stopped");
}

#[test]
fn the_pool_killed_and_restarted_after_three_ttls() {
    let mut r = Rig::new(Opts::default());
    let load = Load::start(&r.sock, 0, 2);
    load.run_for(Duration::from_secs(1), "before");
    r.kill_pool();
    through(&r, &load, "pool killed");
    r.restart_pool();
    r.after_outage(load, "pool killed and restarted");
}

#[test]
fn postgresql_stopped_under_the_pool_for_three_ttls() {
    let mut r = Rig::new(Opts {
        postgres: true,
        ..Opts::default()
    });
    let load = Load::start(&r.sock, 0, 3);
    load.run_for(Duration::from_secs(1), "before");
    r.pg.as_mut().unwrap().stop(libc::SIGINT).unwrap();
    through(&r, &load, "PostgreSQL stopped");
    r.pg.as_mut().unwrap().start().unwrap();
    r.after_outage(load, "PostgreSQL stopped");
}

#[test]
fn the_lender_cut_from_the_pool_for_three_ttls() {
    let r = Rig::new(Opts {
        netns: Some((0, 0)),
        ..Opts::default()
    });
    let load = Load::start(&r.sock, 0, 4);
    load.run_for(Duration::from_secs(1), "before");
    let net = r.net.as_ref().unwrap();
    net.l.set_link(false).unwrap();
    through(&r, &load, "lender cut from the pool");
    net.l.set_link(true).unwrap();
    r.after_outage(load, "lender cut from the pool");
}

#[test]
fn the_compute_host_cut_from_the_pool_for_three_ttls() {
    let r = Rig::new(Opts {
        netns: Some((2, 1)),
        ..Opts::default()
    });
    let load = Load::start(&r.sock, 0, 5);
    load.run_for(Duration::from_secs(1), "before");
    let net = r.net.as_ref().unwrap();
    net.c.set_link(false).unwrap();
    through(&r, &load, "compute host cut from the pool");
    // The agent shows since when it could not renew (once a renewal timed out: the
    // pool client's 10 s).
    let t = Instant::now();
    loop {
        let s = r.borrower.cli_json(&["status"]).unwrap();
        if s[0]["pool_unreachable_since_ms"].as_u64().unwrap_or(0) > 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "status 3 TTLs + 15 s into the cut: {s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(load.failed.load(Ordering::Relaxed), 0);
    let table = String::from_utf8(r.borrower.cli(&["status"]).unwrap().stdout).unwrap();
    assert!(table.contains("device pool unreachable since"), "{table}");
    net.c.set_link(true).unwrap();
    r.after_outage(load, "compute host cut from the pool");
    let s = r.borrower.cli_json(&["status"]).unwrap();
    assert!(
        s[0]["pool_unreachable_since_ms"].as_u64().unwrap_or(0) == 0,
        "status after the cut: {s}"
    );
}

#[test]
fn the_lender_restarted_while_the_pool_is_down() {
    let mut r = Rig::new(Opts::default());
    let load = Load::start(&r.sock, 0, 6);
    load.run_for(Duration::from_secs(1), "before");
    r.kill_pool();
    let t = Instant::now();
    load.run_for(Duration::from_secs(TTL_S), "pool down");
    r.restart_lender(None);
    // The restarted lender serves at once, from the pool key and fences it kept.
    let n = load.run_for(OUTAGE.saturating_sub(t.elapsed()), "lender restarted");
    assert!(n > 0, "no I/O after the lender's restart\n{}", r.logs());
    assert!(t.elapsed() >= OUTAGE);
    r.restart_pool();
    r.after_outage(load, "lender restarted while the pool is down");
}

#[test]
fn the_compute_agent_restarted_while_the_pool_is_down() {
    let mut r = Rig::new(Opts::default());
    let load = Load::start(&r.sock, 0, 7);
    load.run_for(Duration::from_secs(1), "before");
    let end = load.finish();
    assert!(end.errors.is_empty(), "{:?}", end.errors);
    // A marker the restarted agent must serve back.
    let mut c = BlkClient::connect(&r.sock, 1, MIB as usize).unwrap();
    c.buffer()[..65536].fill(0x5a);
    let w = c.run(
        0,
        &[BlkOp::Write {
            offset: 32 * MIB,
            buf: 0,
            len: 65536,
        }],
    );
    assert_eq!(w.unwrap(), vec![0]);
    drop(c);
    r.kill_pool();
    let t = Instant::now();
    r.restart_borrower();
    let mut c = connect_retry(&r.sock).unwrap_or_else(|e| panic!("{e}\n{}", r.logs()));
    let got = c.run(
        0,
        &[BlkOp::Read {
            offset: 32 * MIB,
            buf: 65536,
            len: 65536,
        }],
    );
    assert_eq!(got.unwrap(), vec![0], "{}", r.logs());
    assert!(c.buffer()[65536..131072].iter().all(|&b| b == 0x5a));
    drop(c);
    let load = Load::start(&r.sock, 0, 8);
    through(&r, &load, "compute agent restarted, pool down");
    assert!(t.elapsed() >= OUTAGE);
    r.restart_pool();
    r.after_outage(load, "compute agent restarted while the pool is down");
}

#[test]
fn the_lenders_clock_five_minutes_ahead_then_behind() {
    let mut r = Rig::new(Opts {
        lender_clock: Some("+5m"),
        ..Opts::default()
    });
    let load = Load::start(&r.sock, 0, 9);
    let n = load.run_for(OUTAGE, "lender 5 minutes ahead");
    assert!(n > 0, "{}", r.logs());
    r.restart_lender(Some("-5m"));
    let n = load.run_for(OUTAGE, "lender 5 minutes behind");
    assert!(n > 0, "{}", r.logs());
    assert_eq!(r.lender_clock, Some("-5m"));
    r.after_outage(load, "lender 5 minutes off");
    // The lender ran with the clock it was given: its log's timestamps say so.
    for (log, sign) in [
        (r.d().join("device-agent.log"), 1i64),
        (r.d().join("device-agent-1.log"), -1),
    ] {
        let off = log_clock_offset_s(&std::fs::read_to_string(&log).unwrap());
        assert!(
            (sign * off - 300).abs() < 60,
            "{}: the lender's clock is {off} s off, not {} s",
            log.display(),
            sign * 300
        );
    }
}

/// How far (s) the first timestamp (`...THH:MM:SS`) of a log is from the time now.
fn log_clock_offset_s(log: &str) -> i64 {
    let line = log
        .lines()
        .find(|l| l.len() > 19 && l.as_bytes()[10] == b'T')
        .expect("a timestamped log line");
    let hms: Vec<i64> = line[11..19]
        .split(':')
        .map(|x| x.parse().unwrap())
        .collect();
    let then = hms[0] * 3600 + hms[1] * 60 + hms[2];
    let now = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 86400) as i64;
    let mut off = then - now;
    if off > 43200 {
        off -= 86400;
    } else if off < -43200 {
        off += 86400;
    }
    off
}

#[test]
fn two_pool_servers_on_one_postgresql_one_killed() {
    let mut r = Rig::new(Opts {
        two_servers: true,
        ..Opts::default()
    });
    let load = Load::start(&r.sock, 0, 10);
    load.run_for(Duration::from_secs(1), "before");
    r.kill_pool();
    load.run_for(Duration::from_secs(TTL_S), "first server killed");
    // Renewals go to the second server: the lease's expiry moves on there.
    let e0 = r.lease_state().expires_at_ms;
    through(&r, &load, "first server killed");
    let l = r.lease_state();
    assert_eq!(l.state, LeaseState::Bound, "{l:?}\n{}", r.logs());
    assert!(
        l.expires_at_ms >= e0 + 2 * TTL_S * 1000,
        "the lease was not renewed at the second server: expiry {} then {}\n{}",
        e0,
        l.expires_at_ms,
        r.logs()
    );
    // The compute agent itself renews at the second server (its lease names both): it
    // does not show the pool unreachable. (A lease naming only the first server stays
    // live through the lender's reports, but its holder's renewals fail: a trial saw
    // that when `attach --class` kept only the server that answered.)
    let s = r.borrower.cli_json(&["status"]).unwrap();
    assert!(
        s[0]["pool_unreachable_since_ms"].as_u64().unwrap_or(0) == 0,
        "the compute agent does not reach the second server: {s}\n{}",
        r.logs()
    );
    r.after_outage(load, "first of two pool servers killed");
}

// ---- safety ------------------------------------------------------------------------

/// Writes 64 KiB of `byte` at offset 0 through `sock` and reads it back: the statuses
/// (or the client's error).
fn write_byte(sock: &Path, byte: u8) -> Result<Vec<i32>, String> {
    let mut c = connect_retry(sock)?;
    c.buffer()[..65536].fill(byte);
    let mut r = c
        .run(
            0,
            &[BlkOp::Write {
                offset: 0,
                buf: 0,
                len: 65536,
            }],
        )
        .map_err(|e| format!("{e:#}"))?;
    r.extend(
        c.run(
            0,
            &[BlkOp::Read {
                offset: 0,
                buf: 65536,
                len: 65536,
            }],
        )
        .map_err(|e| format!("{e:#}"))?,
    );
    if r.iter().all(|&x| x == 0) && c.buffer()[65536..131072].iter().any(|&b| b != byte) {
        return Err("read back differs".into());
    }
    Ok(r)
}

/// Compute host A dies for good (its agent killed with SIGKILL, its link to the pool
/// gone); its lease expires at the pool after the TTL and the device goes to host B.
/// The lender is cut from the pool before B comes, so it learns of B's lease only from
/// B's token. Then A's agent comes back on its old state file, still cut from the pool:
/// the lender refuses its sessions (B's lease is newer), no I/O of A is served, and
/// B's data is intact.
#[test]
fn a_dead_compute_hosts_device_goes_to_another_and_the_newer_lease_fences_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (da, db) = (d.join("a"), d.join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let l = Netns::new(4).unwrap();
    let ca = Netns::new(5).unwrap();
    let cb = Netns::new(6).unwrap();
    let la = NsLink::new(&l, &ca, 2).unwrap();
    let lb = NsLink::new(&l, &cb, 3).unwrap();
    // The lender is advertised at its address on A's link; B reaches it through its own.
    devlend_tests::netns::ip(&[
        "-n",
        &cb.name,
        "route",
        "add",
        &format!("{}/32", la.a_ip),
        "via",
        &lb.a_ip,
    ])
    .unwrap();
    let port = free_port().unwrap();
    let pool = start_pool(d, "pool", port, true, None);
    let admin = pool.admin().unwrap();
    pool.enroll(Role::Lender, PROVIDER, &d.join("lender.key"))
        .unwrap();
    let host_a = devlend_daemon::host_name();
    pool.enroll(Role::Compute, &host_a, &Borrower::pool_key(&da))
        .unwrap();
    pool.enroll(Role::Compute, "host-b", &Borrower::pool_key(&db))
        .unwrap();
    sparse_file(&d.join("disk0.img"), DISK).unwrap();
    // Heartbeats every 4 s: the pool keeps the device available (three missed
    // heartbeats) while the lender is cut, long enough for B to lease it.
    let config = lender_config(
        d,
        &format!("0.0.0.0:{LENDER_PORT}"),
        &format!("{}:{LENDER_PORT}", la.a_ip),
        &format!("http://{}:{port}", l.host_ip),
        4000,
    );
    let lender = start_lender(
        d,
        "device-agent",
        Some(&l.name),
        &config,
        None,
        &format!("{}:{LENDER_PORT}", l.ns_ip),
    );
    let mut a = Borrower::start_in(&da, Some(&ca.name), "compute-agent", &[]).unwrap();
    let b = Borrower::start_in(&db, Some(&cb.name), "compute-agent", &[]).unwrap();
    let logs = |a: &Borrower| {
        format!(
            "--- pool ---\n{}\n--- lender ---\n{}\n--- A ---\n{}\n--- B ---\n{}",
            pool.proc.log(),
            lender.log(),
            a.proc.log(),
            b.proc.log()
        )
    };
    wait_until("disk0 available", || {
        admin
            .devices(&Default::default())
            .unwrap_or_default()
            .iter()
            .any(|x| x.state == devlend_pool::api::DeviceState::Available)
    });
    let sock_a = da.join("disk0.sock");
    let lease_a = attach(
        &a,
        &format!("http://{}:{port}", ca.host_ip),
        &Borrower::pool_key(&da),
        &sock_a,
        None,
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&a)));
    assert_eq!(write_byte(&sock_a, 0x11), Ok(vec![0, 0]));

    // A dies: its agent killed, its host gone from the network to the pool; the lender
    // is cut from the pool at once, before it can hear that A's lease ends.
    a.proc.kill_hard();
    ca.set_link(false).unwrap();
    l.set_link(false).unwrap();
    let t = Instant::now();
    wait_until("A's lease expired at the pool", || {
        admin
            .lease(lease_a)
            .is_ok_and(|x| x.state == LeaseState::Expired)
    });
    eprintln!("A's lease expired {:?} after A died", t.elapsed());

    // The device goes to B (its lease from the pool; the lender still cut).
    let sock_b = db.join("disk0.sock");
    let lease_b = attach(
        &b,
        &format!("http://{}:{port}", cb.host_ip),
        &Borrower::pool_key(&db),
        &sock_b,
        Some("host-b"),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&a)));
    assert_ne!(lease_a, lease_b);
    let at_pool = admin.lease(lease_b).unwrap();
    assert_eq!(at_pool.compute_host, "host-b");
    assert_eq!(write_byte(&sock_b, 0x22), Ok(vec![0, 0]), "{}", logs(&a));

    // A's agent comes back on its old state file, cut from the pool: only the lender's
    // fence stands between it and the device.
    a = Borrower::start_in(&da, Some(&ca.name), "compute-agent-again", &[]).unwrap();
    wait_until("A's attachment restored", || {
        a.cli_json(&["status"])
            .ok()
            .and_then(|s| s.as_array().map(|v| v.len() == 1))
            .unwrap_or(false)
            && sock_a.exists()
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let s = sock_a.clone();
    std::thread::spawn(move || {
        let _ = tx.send(write_byte(&s, 0xaa));
    });
    match rx.recv_timeout(Duration::from_secs(40)) {
        Ok(Ok(r)) => assert!(
            r.iter().any(|&x| x != 0),
            "the fenced host's I/O was served: {r:?}\n{}",
            logs(&a)
        ),
        Ok(Err(e)) => eprintln!("the fenced host's I/O failed: {e}"),
        Err(_) => eprintln!("the fenced host's I/O is not served after 40 s"),
    }
    // B's data is intact, and B goes on.
    assert_eq!(write_byte(&sock_b, 0x33), Ok(vec![0, 0]), "{}", logs(&a));
    // It is the lender that refused A: B's lease is newer.
    assert!(
        lender.log().contains("leased again"),
        "the lender did not refuse A's older lease:\n{}",
        logs(&a)
    );
    let img = std::fs::read(d.join("disk0.img")).unwrap();
    assert!(
        img[..65536].iter().all(|&x| x == 0x33),
        "the disk does not hold B's data"
    );

    // Back on the network: A's lease is over, B's holds the device.
    l.set_link(true).unwrap();
    ca.set_link(true).unwrap();
    wait_until("B's lease live and A's ended", || {
        admin.lease(lease_b).is_ok_and(|x| x.state.is_live())
            && admin.lease(lease_a).is_ok_and(|x| !x.state.is_live())
    });
    std::thread::sleep(Duration::from_secs(TTL_S));
    assert!(admin.lease(lease_b).unwrap().state.is_live());
    assert!(!admin.lease(lease_a).unwrap().state.is_live());
    let live = admin
        .leases(devlend_pool::api::LeaseFilter::Active)
        .unwrap();
    assert_eq!(live.len(), 1, "{live:?}");
    assert_eq!(live[0].id, lease_b);
    assert_eq!(write_byte(&sock_b, 0x44), Ok(vec![0, 0]), "{}", logs(&a));
    // A's agent, back in touch with the pool, is told its lease is over: it drops the
    // attachment for good.
    wait_until("A's attachment dropped", || {
        a.cli_json(&["status"])
            .is_ok_and(|s| s.as_array().is_some_and(|v| v.is_empty()))
    });
    assert!(!sock_a.exists());
    drop((la, lb));
}

// ---- a QEMU guest ------------------------------------------------------------------

fn dlio_writes(console: &str) -> usize {
    console.lines().filter(|l| l.contains("DLIO w ")).count()
}

/// A QEMU guest (TCG) writing and verifying its leased disk with O_DIRECT through a
/// pool stop, a pool kill and restart, and its compute host cut from the pool, each
/// three TTLs: no I/O error in the guest, I/O during each outage and after them.
#[test]
fn a_guest_goes_on_through_pool_outages() {
    let mut r = Rig::new(Opts {
        netns: Some((8, 5)),
        ..Opts::default()
    });
    let mut guest = devlend_tests::guest::Guest::builder()
        .name("pool-outage")
        .memory_mib(256)
        .script(devlend_tests::migration::workload_script(60, 64))
        .vhost_user_blk_with(&r.sock, Some(1000))
        .boot()
        .unwrap();
    guest
        .wait_for_text("DEVLEND-RESULT workload=started", Duration::from_secs(120))
        .unwrap();
    let mut mark = dlio_writes(&guest.console());
    let mut during = |guest: &devlend_tests::guest::Guest, what: &str, r: &Rig| {
        std::thread::sleep(OUTAGE);
        let now = dlio_writes(&guest.console());
        assert!(
            now > mark,
            "{what}: the guest did no I/O in the outage\n{}\n{}",
            guest.console(),
            r.logs()
        );
        assert!(
            !guest.console().contains("DLIO-ERR"),
            "{what}: {}",
            guest.console()
        );
        mark = now;
    };
    r.pool.proc.signal(libc::SIGSTOP);
    during(&guest, "pool stopped", &r);
    r.pool.proc.signal(libc::SIGCONT);
    std::thread::sleep(Duration::from_secs(2));
    r.kill_pool();
    during(&guest, "pool killed", &r);
    r.restart_pool();
    std::thread::sleep(Duration::from_secs(2));
    r.net.as_ref().unwrap().c.set_link(false).unwrap();
    during(&guest, "compute host cut from the pool", &r);
    r.net.as_ref().unwrap().c.set_link(true).unwrap();
    let end_of_outages = dlio_writes(&guest.console());
    assert!(
        !guest.console().contains("workload=done"),
        "the workload ended before the last outage did: raise its seconds"
    );
    let out = guest.wait_done(Duration::from_secs(120)).unwrap();
    assert!(
        dlio_writes(&out.console) > end_of_outages,
        "no guest I/O after the outages"
    );
    assert!(!out.console.contains("DLIO-ERR"), "{}", out.console);
    assert_eq!(out.result("errors"), Some("0"), "{}", out.console);
    assert_eq!(out.result("verified"), out.result("written"));
    assert_eq!(r.lease_state().state, LeaseState::Bound, "{}", r.logs());
    let s = r.borrower.cli_json(&["status"]).unwrap();
    assert_eq!(s[0]["counters"]["errors"], 0, "{s}");
    assert_eq!(s[0]["lease_ended"], false, "{s}");
}
