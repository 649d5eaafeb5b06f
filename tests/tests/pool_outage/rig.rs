//! The rig: a pool (SQLite or a private PostgreSQL), a lender registered with it and a
//! compute agent with one disk attached by class, each host in its own network
//! namespace, and the helpers that start, cut and restart them.

use super::*;

/// Network namespaces: the lender in `l`, the compute agent in `c`, each linked to this
/// namespace (the pool's) and to each other directly (`lc`, the data path).
pub(crate) struct Net {
    pub(crate) lc: NsLink,
    pub(crate) c: Netns,
    pub(crate) l: Netns,
}

impl Net {
    pub(crate) fn new(n: u8, k: u8) -> Self {
        let l = Netns::new(n).unwrap();
        let c = Netns::new(n + 1).unwrap();
        let lc = NsLink::new(&l, &c, k).unwrap();
        Net { lc, c, l }
    }
}

#[derive(Default)]
pub(crate) struct Opts {
    pub(crate) postgres: bool,
    /// Namespaces `n`, `n + 1` and link `k`.
    pub(crate) netns: Option<(u8, u8)>,
    /// libfaketime's `FAKETIME` for the lender.
    pub(crate) lender_clock: Option<&'static str>,
    /// A second pool server on the same PostgreSQL; the agents get both URLs.
    pub(crate) two_servers: bool,
}

/// Its fields drop in order: the processes, then the database, the namespaces and the
/// directory.
pub(crate) struct Rig {
    pub(crate) borrower: Borrower,
    pub(crate) borrower_restarts: u32,
    pub(crate) lender: Proc,
    pub(crate) lender_config: PathBuf,
    pub(crate) lender_clock: Option<&'static str>,
    pub(crate) lender_restarts: u32,
    pub(crate) pool: Pool,
    pub(crate) pool_port: u16,
    /// The second server of [`Opts::two_servers`].
    pub(crate) pool2: Option<Pool>,
    pub(crate) admin: PoolClient,
    pub(crate) pg: Option<Postgres>,
    pub(crate) net: Option<Net>,
    pub(crate) sock: PathBuf,
    pub(crate) lease: uuid::Uuid,
    pub(crate) dir: tempfile::TempDir,
    /// One rig at a time, released last: the tests time leases of 3 s, and two rigs
    /// (pools, PostgreSQL, agents, loads) on a 2-core machine made renewals late
    /// enough for leases to expire in full runs, which never happened alone.
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// Held by the [`Rig`] alive.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The lender's config: `listen` (advertised as `advertise`), the pool at `pool_url`,
/// a heartbeat every `heartbeat_ms`, disk0.
pub(crate) fn lender_config(
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
pub(crate) fn start_lender(
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
    pub(crate) fn new(o: Opts) -> Rig {
        // A test that failed poisons it: the next still runs.
        let serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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
            _serial: serial,
        }
    }

    pub(crate) fn d(&self) -> &Path {
        self.dir.path()
    }

    /// Every process's log (restarted ones too), by file name.
    pub(crate) fn logs(&self) -> String {
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

    pub(crate) fn kill_pool(&mut self) {
        self.pool.proc.kill_hard();
    }

    /// Starts the pool again on its port and database.
    pub(crate) fn restart_pool(&mut self) {
        self.pool = start_pool(
            self.dir.path(),
            "pool-again",
            self.pool_port,
            self.net.is_some(),
            self.pg.as_ref(),
        );
    }

    /// Kills the lender with SIGKILL and starts it again (under `clock`).
    pub(crate) fn restart_lender(&mut self, clock: Option<&'static str>) {
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
    pub(crate) fn restart_borrower(&mut self) {
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
    pub(crate) fn lease_state(&self) -> devlend_pool::api::Lease {
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
    pub(crate) fn after_outage(&self, load: Load, what: &str) {
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
pub(crate) fn advertise_of(config: &Path) -> String {
    let text = std::fs::read_to_string(config).unwrap();
    let line = text.lines().find(|l| l.starts_with("listen")).unwrap();
    line.split('"').nth(1).unwrap().to_owned()
}

/// `devlend pool serve` on `port` (all addresses with namespaces, else loopback), on
/// SQLite in `DIR/pool` or on `pg`.
pub(crate) fn start_pool(
    dir: &Path,
    name: &str,
    port: u16,
    all: bool,
    pg: Option<&Postgres>,
) -> Pool {
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
pub(crate) fn attach(
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

pub(crate) fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// I/O goes on through the outage `what` (the I/Os completed meanwhile must be some).
pub(crate) fn through(r: &Rig, load: &Load, what: &str) {
    let n = load.run_for(OUTAGE, what);
    assert!(
        n > 0,
        "{what}: no I/O completed in the outage\n{}",
        r.logs()
    );
}
