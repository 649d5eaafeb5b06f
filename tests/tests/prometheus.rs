//! A real Prometheus server (Debian's 2.42) scrapes every devlend component once a
//! second: the compute agent, the lender, both gateways of two clusters (the borrower
//! reaches the lender through them) and the pool. During a read workload through the
//! gateways its HTTP API gives `rate()`s of the borrower's and the lender's byte counters
//! that agree with what the workload measured, every target is `up`, and the rules of
//! `contrib/prometheus/` (checked by `promtool check rules` first) load and evaluate.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context, Result};
use devlend_tests::agents::{bin, free_port, wait_listening, Pool, Proc};
use devlend_tests::gateways::Topo;
use serde_json::Value;

const PROMETHEUS: &str = "/usr/bin/prometheus";
const PROMTOOL: &str = "/usr/bin/promtool";
const BENCH_SECONDS: u64 = 8;

fn contrib() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../contrib/prometheus")
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `GET path` from the server at `addr`: the JSON body.
fn get_json(addr: &str, path: &str) -> Result<Value> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let (head, body) = out
        .split_once("\r\n\r\n")
        .with_context(|| format!("no HTTP answer: {out}"))?;
    ensure!(head.contains(" 200 "), "GET {path}: {head}\n{body}");
    serde_json::from_str(body).with_context(|| format!("GET {path}: {body}"))
}

/// The value of a PromQL instant query that gives one series, at unix time `at`.
fn query_one(addr: &str, promql: &str, at: f64) -> Result<f64> {
    let v = get_json(
        addr,
        &format!(
            "/api/v1/query?query={}&time={at:.3}",
            percent_encode(promql)
        ),
    )?;
    let r = &v["data"]["result"];
    ensure!(
        v["status"] == "success" && r.as_array().map(Vec::len) == Some(1),
        "{promql}: {v}"
    );
    r[0]["value"][1]
        .as_str()
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{promql}: {v}"))
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn prometheus_config(dir: &Path, targets: &[(&str, &[String])]) -> Result<PathBuf> {
    let mut t = String::from(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nrule_files:\n",
    );
    for f in ["devlend-rules.yml", "devlend-alerts.yml"] {
        t += &format!("  - {}\n", contrib().join(f).display());
    }
    t += "scrape_configs:\n";
    for (job, addrs) in targets {
        let list: Vec<String> = addrs.iter().map(|a| format!("\"{a}\"")).collect();
        t += &format!(
            "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
            list.join(", ")
        );
    }
    let p = dir.join("prometheus.yml");
    std::fs::write(&p, t)?;
    Ok(p)
}

/// Waits until Prometheus is ready and has scraped every target and found it up; the
/// targets.
fn wait_all_up(addr: &str, want: usize, timeout: Duration) -> Result<Vec<Value>> {
    let deadline = Instant::now() + timeout;
    loop {
        // 503 until the server is ready.
        let v = get_json(addr, "/api/v1/targets?state=active").unwrap_or_default();
        let targets = v["data"]["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if targets.len() == want && targets.iter().all(|t| t["health"] == "up") {
            return Ok(targets);
        }
        if Instant::now() > deadline {
            bail!("not every target is up after {timeout:?}: {v:#}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn a_real_prometheus_scrapes_every_component_and_its_rates_match_the_workload() -> Result<()> {
    for tool in [PROMETHEUS, PROMTOOL] {
        ensure!(
            Path::new(tool).exists(),
            "{tool} is missing: run qemu/install-deps.sh as root (it installs prometheus)"
        );
    }
    let rules = [
        contrib().join("devlend-rules.yml"),
        contrib().join("devlend-alerts.yml"),
    ];
    let check = Command::new(PROMTOOL)
        .args(["check", "rules"])
        .args(&rules)
        .output()?;
    ensure!(
        check.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );

    // The borrower in cluster a reaches the lender of cluster b through both gateways.
    let t = Topo::new(40);
    let pool = Pool::start(t.dir.path())?;
    let pool_addr = pool.url.trim_start_matches("http://").to_owned();
    let [compute, lender, gw_a, gw_b] = t.metrics.clone();
    let dir = tempfile::tempdir()?;
    let config = prometheus_config(
        dir.path(),
        &[
            ("devlend-compute-agent", &[compute]),
            ("devlend-device-agent", &[lender]),
            ("devlend-gateway", &[gw_a, gw_b]),
            ("devlend-pool", &[pool_addr]),
        ],
    )?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let mut prom = Proc::spawn(
        "prometheus",
        Path::new(PROMETHEUS),
        &[
            format!("--config.file={}", config.display()),
            format!("--storage.tsdb.path={}", dir.path().join("data").display()),
            format!("--web.listen-address={addr}"),
        ],
        dir.path(),
    )?;
    wait_listening(&mut prom, &addr)?;
    let targets = wait_all_up(&addr, 5, Duration::from_secs(60))
        .with_context(|| format!("prometheus log:\n{}", prom.log()))?;
    eprintln!("{} targets up", targets.len());

    let sock = t.socket("x.sock");
    let out = t.attach("b/store1/disk0", &sock, 1);
    ensure!(
        out.status.success(),
        "attach: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let start = now();
    let bench = Command::new(bin("devlend")?)
        .args(["bench", "--socket"])
        .arg(&sock)
        .args([
            "--rw",
            "read",
            "--bs",
            "64K",
            "--iodepth",
            "16",
            "--queues",
            "1",
        ])
        .args([
            "--runtime",
            &BENCH_SECONDS.to_string(),
            "--ramp",
            "1",
            "--json",
        ])
        .output()?;
    let end = now();
    ensure!(
        bench.status.success(),
        "bench: {}",
        String::from_utf8_lossy(&bench.stderr)
    );
    let r: Value = serde_json::from_slice(&bench.stdout)?;
    ensure!(r["figures"]["errors"] == 0, "{r}");
    let measured = r["figures"]["mb_per_s"].as_f64().context("mb_per_s")? * 1e6;
    ensure!(measured > 0.0, "{r}");
    // Two more scrapes after the workload, so that the windows below are all stored.
    std::thread::sleep(Duration::from_secs(3));

    // A 4 s window ending a second before the workload did: inside its steady part.
    let at = end - 1.0;
    ensure!(at - 4.0 > start + 1.0, "the workload was too short");
    let plausible = |what: &str, rate: f64| -> Result<()> {
        eprintln!(
            "{what}: {:.1} MB/s (bench: {:.1} MB/s)",
            rate / 1e6,
            measured / 1e6
        );
        ensure!(
            rate > measured * 0.5 && rate < measured * 1.6,
            "{what}: {rate:.0} B/s, the workload measured {measured:.0} B/s"
        );
        Ok(())
    };
    let borrower = query_one(
        &addr,
        "sum(rate(devlend_attachment_bytes_total{op=\"read\"}[4s]))",
        at,
    )?;
    plausible("borrower read rate", borrower)?;
    let lent = query_one(
        &addr,
        "sum(rate(devlend_device_bytes_total{op=\"read\"}[4s]))",
        at,
    )?;
    plausible("lender read rate", lent)?;
    let reqs = query_one(
        &addr,
        "sum(rate(devlend_attachment_requests_total{op=\"read\"}[4s]))",
        at,
    )?;
    plausible("borrower read requests × 64 KiB", reqs * 65536.0)?;
    // Gateway a's link carries the data (and the headers) from b.
    let link = query_one(
        &addr,
        "sum(rate(devlend_gateway_peer_bytes_total{job=\"devlend-gateway\",direction=\"received\"}[4s]))",
        at,
    )?;
    ensure!(link > measured * 0.5, "gateway link rate {link:.0} B/s");
    // The recording rule (1 min window, evaluated every second) saw the reads too.
    let recorded = query_one(&addr, "sum(devlend:attachment_read_bytes:rate1m)", at)?;
    ensure!(recorded > 0.0, "recording rule: {recorded}");
    ensure!(
        query_one(&addr, "count(devlend_pool_providers)", at)? >= 1.0,
        "no pool series"
    );

    // Every target is still up; every rule group loaded and evaluated.
    let up = get_json(&addr, &format!("/api/v1/query?query=up&time={at:.3}"))?;
    let ups = up["data"]["result"].as_array().cloned().unwrap_or_default();
    ensure!(
        ups.len() == 5 && ups.iter().all(|s| s["value"][1] == "1"),
        "up: {up:#}"
    );
    let rules = get_json(&addr, "/api/v1/rules")?;
    let groups = rules["data"]["groups"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(groups.len() == 2, "{rules:#}");
    for g in &groups {
        for rule in g["rules"].as_array().into_iter().flatten() {
            ensure!(rule["health"] == "ok", "rule not healthy: {rule:#}");
        }
    }
    prom.terminate(Duration::from_secs(10))?;
    Ok(())
}
