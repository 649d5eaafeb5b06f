//! Limits per lease, enforced by the lender, for real: a device pool, a lender
//! registered with it, a borrower, `devlend attach --class ... --max-iops/--max-bps/
//! --weight` and `devlend bench` through the vhost-user socket (all real processes on
//! loopback). Each workload is measured by the bench itself and must hold the limit
//! within 10 % with no failed request; the lender's metrics and `devlend status` show
//! the limits and the throttling; a token whose limits were altered is refused; a
//! lender's own limit holds in direct mode whatever the borrower asks; two borrowers
//! with weights 1 and 3 on one backing store share its capacity about 1:3.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use devlend_fabric::lease_token::LeaseToken;
use devlend_fabric::qos::{Lane, Qos};
use devlend_fabric::tcp::{connect_as, ConnectError};
use devlend_fabric::Hello;
use devlend_pool::api::{DeviceQuery, LeaseRequest, Role};
use devlend_pool::client::PoolClient;
use devlend_tests::agents::{bin, free_port, sparse_file, Borrower, Lender, Pool};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const PROVIDER: &str = "qos-lender";
/// The shared store's read capacity, bytes a second.
const STORE_BPS: u64 = 40 * MIB;

struct Rig {
    dir: tempfile::TempDir,
    pool: Pool,
    client: PoolClient,
    lender: Lender,
    metrics: String,
    borrower: Borrower,
}

/// A pool; a lender registered with it that lends `solo` (64 MiB) and `w1`, `w3` (two
/// devices on one backing file, on a store of [`STORE_BPS`] reads a second), each
/// with a trait of its name; a borrower.
fn rig() -> Result<Rig> {
    let dir = tempfile::tempdir()?;
    let pool = Pool::start(dir.path())?;
    let client = pool.admin()?;
    let lender_key = dir.path().join("lender.key");
    pool.enroll(Role::Lender, PROVIDER, &lender_key)?;
    pool.enroll(
        Role::Compute,
        &devlend_daemon::host_name(),
        &Borrower::pool_key(dir.path()),
    )?;
    sparse_file(&dir.path().join("solo.img"), 64 * MIB)?;
    sparse_file(&dir.path().join("shared.img"), 64 * MIB)?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let config = dir.path().join("device-agent.toml");
    std::fs::write(
        &config,
        format!(
            r#"listen = "{addr}"
key_file = "{key}"
metrics_listen = "{metrics}"
[pool]
url = "{url}"
provider = "{PROVIDER}"
heartbeat_interval_ms = 500

[[store]]
name = "shared"
[store.capacity]
bps_read = {STORE_BPS}

[[device]]
name = "solo"
path = "{d}/solo.img"
traits = ["SOLO"]

[[device]]
name = "w1"
path = "{d}/shared.img"
traits = ["W1"]
store = "shared"

[[device]]
name = "w3"
path = "{d}/shared.img"
traits = ["W3"]
store = "shared"
"#,
            url = pool.url,
            d = dir.path().display(),
            key = lender_key.display()
        ),
    )?;
    let lender = Lender::start_with(
        dir.path(),
        &addr,
        &[],
        &["--config".into(), config.display().to_string()],
    )?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while client.devices(&DeviceQuery::default())?.len() < 3 {
        ensure!(Instant::now() < deadline, "devices not registered");
        std::thread::sleep(Duration::from_millis(50));
    }
    let borrower = Borrower::start(dir.path())?;
    Ok(Rig {
        dir,
        pool,
        client,
        lender,
        metrics,
        borrower,
    })
}

impl Rig {
    fn sock(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.sock"))
    }

    /// `devlend attach --class BLOCK --trait TRAIT` with `limits` flags; the socket.
    fn attach(&self, name: &str, trait_: &str, limits: &[&str]) -> Result<PathBuf> {
        let sock = self.sock(name);
        let s = sock.display().to_string();
        let key = Borrower::pool_key(self.dir.path()).display().to_string();
        let mut args = vec![
            "attach",
            "--pool",
            &self.pool.url,
            "--pool-key",
            &key,
            "--class",
            "BLOCK",
            "--trait",
            trait_,
            "--vm",
            name,
            "--socket",
            &s,
            "--id",
            name,
        ];
        args.extend_from_slice(limits);
        let out = self.borrower.cli(&args)?;
        ensure!(
            out.status.success(),
            "attach {name}: {}\nlender log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.lender.proc.log()
        );
        Ok(sock)
    }

    /// The lender's metrics text.
    fn metrics(&self) -> Result<String> {
        let mut s = std::net::TcpStream::connect(&self.metrics)?;
        std::io::Write::write_all(
            &mut s,
            format!("GET /metrics HTTP/1.0\r\nHost: {}\r\n\r\n", self.metrics).as_bytes(),
        )?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    }
}

/// The value of the metric line that starts with `prefix` (name and labels).
fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Starts `devlend bench` on `sock`: `rw`, block size `bs`, queue depth 32, one queue,
/// `secs` measured after a 1 s ramp.
fn bench(sock: &Path, rw: &str, bs: &str, secs: u32) -> Result<std::process::Child> {
    Ok(Command::new(bin("devlend")?)
        .args(["bench", "--socket"])
        .arg(sock)
        .args(["--rw", rw, "--bs", bs, "--iodepth", "32", "--queues", "1"])
        .args(["--runtime", &secs.to_string(), "--ramp", "1", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?)
}

/// The figures of a finished bench, which must have failed no request.
fn figures(child: std::process::Child) -> Result<Value> {
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout)?;
    let f = r["figures"].clone();
    ensure!(f["errors"] == 0, "throttled requests failed: {r}");
    ensure!(f["ios"].as_u64().unwrap_or(0) > 0, "no I/O: {r}");
    Ok(f)
}

fn within(what: &str, got: f64, want: f64, tolerance: f64) -> Result<()> {
    eprintln!("{what}: {got:.1} (limit {want:.1})");
    ensure!(
        (got - want).abs() <= want * tolerance,
        "{what}: measured {got:.1}, the limit is {want:.1} (±{:.0} %)",
        tolerance * 100.0
    );
    Ok(())
}

#[test]
fn an_iops_limit_and_a_bandwidth_limit_hold_within_ten_percent_without_errors() -> Result<()> {
    let r = rig()?;
    let sock = r.attach("vm-iops", "SOLO", &["--max-iops", "2000"])?;
    // What the borrower shows: the lease's limits.
    let status = r.borrower.cli_json(&["status"])?;
    let a = &status.as_array().context("status list")?[0];
    ensure!(a["limits"]["iops_total"] == 2000, "status: {status}");
    let text = String::from_utf8(r.borrower.cli(&["status"])?.stdout)?;
    ensure!(
        text.contains("vm-iops: lease limits iops_total=2000"),
        "{text}"
    );

    let running = bench(&sock, "randread", "4K", 6)?;
    // While it runs, the borrower shows the throttling the lender reports in its
    // responses.
    std::thread::sleep(Duration::from_secs(4));
    let status = r.borrower.cli_json(&["status"])?;
    let now = status[0]["rates"]["throttled_per_s"]
        .as_f64()
        .unwrap_or(0.0);
    ensure!(now > 1000.0, "throttled now {now}: {status}");
    let text = String::from_utf8(r.borrower.cli(&["status"])?.stdout)?;
    ensure!(text.contains("; throttled now: "), "{text}");
    let f = figures(running)?;
    within(
        "4K QD32 random reads under 2000 IOPS",
        f["iops"].as_f64().unwrap_or(0.0),
        2000.0,
        0.10,
    )?;
    let m = r.metrics()?;
    ensure!(
        metric(
            &m,
            "devlend_device_qos_limit{device=\"solo\",lane=\"iops_total\"}"
        ) == Some(2000.0),
        "metrics:\n{m}"
    );
    let throttled = metric(&m, "devlend_device_throttled_total{device=\"solo\"}").unwrap_or(0.0);
    ensure!(throttled > 1000.0, "throttled {throttled}:\n{m}");
    // Every request the lender held back, the borrower was told of.
    let status = r.borrower.cli_json(&["status"])?;
    let counted = status[0]["counters"]["throttled"].as_u64().unwrap_or(0);
    ensure!(
        counted as f64 == throttled,
        "the borrower counted {counted} throttled responses, the lender held back {throttled}"
    );
    ensure!(
        metric(
            &m,
            "devlend_device_throttle_wait_seconds_total{device=\"solo\"}"
        )
        .unwrap_or(0.0)
            > 1.0,
        "metrics:\n{m}"
    );
    ensure!(
        metric(
            &m,
            "devlend_device_errors_total{device=\"solo\",cause=\"request\"}"
        ) == Some(0.0)
    );
    let out = r.borrower.cli(&["detach", "vm-iops"])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The next holder of the same device gets its own lease's limits.
    let sock = r.attach("vm-bps", "SOLO", &["--max-bps", "50M"])?;
    let f = figures(bench(&sock, "read", "128K", 6)?)?;
    let bytes_per_s = f["mb_per_s"].as_f64().unwrap_or(0.0) * 1e6;
    within(
        "128K QD32 reads under 50 MiB/s (MiB/s)",
        bytes_per_s / MIB as f64,
        50.0,
        0.10,
    )?;
    let m = r.metrics()?;
    ensure!(
        metric(
            &m,
            "devlend_device_qos_limit{device=\"solo\",lane=\"bps_total\"}"
        ) == Some((50 * MIB) as f64),
        "metrics:\n{m}"
    );
    Ok(())
}

/// Opens a session on `device` with `token` as `borrower`, proving possession with the
/// compute host's enrolled key `key` (what the pool's tokens name): refused or not.
fn hello(
    addr: &str,
    key: &Path,
    device: &str,
    borrower: [u8; 16],
    token: Vec<u8>,
) -> Result<(), ConnectError> {
    let mut h = Hello::new(device, 0);
    h.borrower = borrower;
    h.token = token;
    let (key, _) = devlend_fabric::identity::load_or_create(key).expect("the compute key");
    h.holder = Some(devlend_fabric::holder_proof::Holder {
        key: devlend_fabric::holder_proof::HolderKey::new(key),
        lender: None,
    });
    connect_as(addr, &h, Duration::from_secs(5)).map(drop)
}

#[test]
fn a_token_whose_limits_were_altered_is_refused() -> Result<()> {
    let r = rig()?;
    let d = r
        .client
        .devices(&DeviceQuery::default())?
        .into_iter()
        .find(|d| d.name == "solo")
        .context("solo")?;
    let grant = r.client.create_lease(&LeaseRequest {
        consumer: "vm-x".into(),
        compute_host: devlend_daemon::host_name(),
        device_id: Some(d.id),
        generation: Some(d.generation),
        qos: Some(Qos::default().with(Lane::IopsTotal, 2000, 0)),
        ..LeaseRequest::default()
    })?;
    ensure!(
        grant
            .lease
            .qos
            .and_then(|q| q.get(Lane::IopsTotal))
            .map(|l| l.per_sec)
            == Some(2000),
        "the lease does not carry its limits: {grant:?}"
    );
    let token = LeaseToken::from_text(&grant.token)?;
    let claims = token.claims_unverified()?;
    ensure!(claims.qos == grant.lease.qos, "{claims:?}");
    let id = *grant.lease.id.as_bytes();
    // The borrower lifts its limit to 2 million: the bytes of the rate change, the
    // signature does not.
    let bytes = token.as_bytes().to_vec();
    let at = bytes
        .windows(8)
        .position(|w| w == 2000u64.to_le_bytes())
        .context("the rate in the token")?;
    let mut lifted = bytes.clone();
    lifted[at..at + 8].copy_from_slice(&2_000_000u64.to_le_bytes());
    match hello(
        &r.lender.addr,
        &Borrower::pool_key(r.dir.path()),
        "solo",
        id,
        lifted,
    ) {
        Err(ConnectError::Refused { message, .. }) => {
            ensure!(message.contains("signature"), "{message}")
        }
        other => anyhow::bail!("an altered token was not refused: {other:?}"),
    }
    // The same lease with its token as signed opens.
    hello(
        &r.lender.addr,
        &Borrower::pool_key(r.dir.path()),
        "solo",
        id,
        bytes,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

#[test]
fn a_lenders_own_limit_holds_in_direct_mode_whatever_the_borrower_asks() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let img = dir.path().join("d.img");
    sparse_file(&img, 64 * MIB)?;
    let lender = Lender::start(
        dir.path(),
        &[format!(
            "d={},iops_read=1000,iops_read_burst=50",
            img.display()
        )],
    )?;
    let borrower = Borrower::start(dir.path())?;
    let sock = dir.path().join("d.sock");
    borrower.attach(&lender.addr, "d", &sock, 2)?;
    // Two queues, two sessions: one limit for the borrower, not one per session.
    let out = Command::new(bin("devlend")?)
        .args(["bench", "--socket"])
        .arg(&sock)
        .args([
            "--rw",
            "randread",
            "--bs",
            "4K",
            "--iodepth",
            "32",
            "--queues",
            "2",
        ])
        .args(["--runtime", "5", "--ramp", "1", "--json"])
        .output()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(r["figures"]["errors"] == 0, "{r}");
    within(
        "reads over two queues under the lender's 1000",
        r["figures"]["iops"].as_f64().unwrap_or(0.0),
        1000.0,
        0.10,
    )?;
    Ok(())
}

#[test]
fn two_borrowers_with_weights_1_and_3_share_their_store_about_1_to_3() -> Result<()> {
    let r = rig()?;
    let s1 = r.attach("vm-w1", "W1", &["--weight", "1"])?;
    let s3 = r.attach("vm-w3", "W3", &["--weight", "3"])?;
    let b1 = bench(&s1, "randread", "64K", 6)?;
    let b3 = bench(&s3, "randread", "64K", 6)?;
    let (f1, f3) = (figures(b1)?, figures(b3)?);
    let (m1, m3) = (
        f1["mb_per_s"].as_f64().unwrap_or(0.0) * 1e6 / MIB as f64,
        f3["mb_per_s"].as_f64().unwrap_or(0.0) * 1e6 / MIB as f64,
    );
    eprintln!("weight 1: {m1:.1} MiB/s, weight 3: {m3:.1} MiB/s");
    within("weight 3 over weight 1", m3 / m1, 3.0, 0.2)?;
    within(
        "the two together (MiB/s)",
        m1 + m3,
        (STORE_BPS / MIB) as f64,
        0.15,
    )?;
    let m = r.metrics()?;
    let share = metric(
        &m,
        "devlend_device_store_share{device=\"w3\",store=\"shared\"}",
    )
    .context("no share of w3")?;
    ensure!(
        (0.7..=0.8).contains(&share) || share == 1.0,
        "share {share}:\n{m}"
    );
    Ok(())
}

/// Requests a lender holds for the limits are dropped when their session ends: never
/// run later (a write the borrower was told failed, or sends again elsewhere, must not
/// land), and the device is free for the next borrower at once.
#[test]
fn requests_held_for_the_limits_end_with_their_session() -> Result<()> {
    use devlend_fabric::{BlockRequest, Bytes, HelloStatus, RequestHeader, Sector};
    use std::io::Write;
    let dir = tempfile::tempdir()?;
    let img = dir.path().join("d.img");
    sparse_file(&img, 16 * MIB)?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let lender = Lender::start_with(
        dir.path(),
        &addr,
        &[format!(
            "d={},iops_write=1,iops_write_burst=1",
            img.display()
        )],
        &["--metrics-listen".into(), metrics.clone()],
    )?;
    let scrape = |name: &str| -> Result<f64> {
        let mut s = std::net::TcpStream::connect(&metrics)?;
        s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {metrics}\r\n\r\n").as_bytes())?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        metric(&out, &format!("{name}{{device=\"d\"}}")).with_context(|| out.clone())
    };
    let mut h = Hello::new("d", 0);
    h.borrower = [7; 16];
    let (mut s, reply) = connect_as(&addr, &h, Duration::from_secs(5))?;
    ensure!(reply.status == HelloStatus::Ok, "{reply:?}");
    let data = vec![0xab_u8; 4096];
    for i in 0..20u64 {
        let req = RequestHeader {
            id: i + 1,
            request: BlockRequest::Write {
                sector: Sector(i * 8),
                len: Bytes(4096),
            },
        };
        s.write_all(&req.encode())?;
        s.write_all(&data)?;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while scrape("devlend_device_throttle_queued")? < 15.0 {
        ensure!(Instant::now() < deadline, "the writes were not held");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The borrower goes away with 15 or more writes held.
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(5);
    while scrape("devlend_device_throttle_queued")? > 0.0 {
        ensure!(
            Instant::now() < deadline,
            "held writes outlive their session:\n{}",
            lender.proc.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The device is free for another borrower now, not after the held writes drain
    // (15 s or more at 1 write/s). The session ends a moment after its held writes are
    // dropped (its writes already started finish first), so the next borrower may be
    // told Busy for that moment: it asks again for up to 2 s.
    let mut other = Hello::new("d", 0);
    other.borrower = [8; 16];
    let deadline = Instant::now() + Duration::from_secs(2);
    let _s2 = loop {
        match connect_as(&addr, &other, Duration::from_secs(5)) {
            Ok((s2, reply)) => {
                ensure!(
                    reply.status == HelloStatus::Ok,
                    "the next borrower: {reply:?}"
                );
                break s2;
            }
            Err(ConnectError::Refused {
                status: HelloStatus::Busy,
                ..
            }) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e.into()),
        }
    };
    // And the dropped writes never land.
    std::thread::sleep(Duration::from_secs(3));
    let file = std::fs::read(&img)?;
    let landed = file[..20 * 4096]
        .chunks(4096)
        .filter(|c| c[0] == 0xab)
        .count();
    ensure!(
        landed <= 5,
        "{landed} of 20 writes landed after their session ended"
    );
    Ok(())
}
