//! `devlend bench`, short: against a devlend attachment (JSON fields present and sane),
//! and `--peers --matrix quick` beside qemu-storage-daemon. No timing is asserted:
//! benchmarks are not tests. Also the busy-poll mode, with data checked.

use std::process::Command;

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_tests::agents::{bin, sparse_file, Borrower, Lender};
use serde_json::Value;

const MIB: u64 = 1 << 20;

fn f(v: &Value, path: &[&str]) -> f64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_f64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in {v}"))
}

fn check_run(r: &Value, pids: usize) {
    assert!(f(r, &["figures", "iops"]) > 0.0, "{r}");
    assert!(f(r, &["figures", "mb_per_s"]) > 0.0);
    assert!(f(r, &["figures", "ios"]) > 0.0);
    assert_eq!(f(r, &["figures", "errors"]), 0.0, "{r}");
    let (p50, p99, p999) = (
        f(r, &["figures", "latency", "p50_us"]),
        f(r, &["figures", "latency", "p99_us"]),
        f(r, &["figures", "latency", "p999_us"]),
    );
    assert!(0.0 < p50 && p50 <= p99 && p99 <= p999, "{p50} {p99} {p999}");
    let procs = r["procs"].as_array().expect("procs");
    assert_eq!(procs.len(), pids, "{r}");
    for p in procs {
        assert!(f(p, &["cpu_seconds"]) >= 0.0);
        assert!(f(p, &["peak_rss_bytes"]) > 0.0, "{p}");
        assert!(f(p, &["pid"]) > 0.0);
    }
}

#[test]
fn bench_reports_figures_and_server_processes() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, 64 * MIB).unwrap();
    let lender = Lender::start(dir.path(), &[format!("disk0={}", img.display())]).unwrap();
    let borrower = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("disk0.sock");
    borrower.attach(&lender.addr, "disk0", &sock, 2).unwrap();
    let out = Command::new(bin("devlend").unwrap())
        .args(["bench", "--socket"])
        .arg(&sock)
        .args([
            "--rw",
            "randrw",
            "--bs",
            "4K",
            "--iodepth",
            "8",
            "--queues",
            "2",
        ])
        .args(["--runtime", "1", "--ramp", "0.2", "--json"])
        .args(["--pid", &lender.proc.pid().to_string()])
        .args(["--pid", &borrower.proc.pid().to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    check_run(&r, 2);
    assert_eq!(r["workload"]["rw"], "randrw");
    assert_eq!(f(&r, &["workload", "queues"]), 2.0);
    assert!(f(&r, &["figures", "reads"]) > 0.0 && f(&r, &["figures", "writes"]) > 0.0);
    assert!(f(&r, &["cpu_us_per_io"]) >= 0.0);
}

#[test]
fn peers_quick_matrix_runs_every_server() {
    if Command::new("qemu-storage-daemon")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: qemu-storage-daemon is not installed (qemu/install-deps.sh)");
        return;
    }
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let out = Command::new(bin("devlend").unwrap())
        .args(["bench", "--peers", "--matrix", "quick", "--size", "64M"])
        .args(["--runtime", "0.5", "--ramp", "0.1", "--json", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let cells = r["cells"].as_array().expect("cells");
    assert_eq!(cells.len(), 2, "{r}");
    for c in cells {
        let runs = c["runs"].as_array().expect("runs");
        let names: Vec<_> = runs.iter().map(|r| r["target"].as_str().unwrap()).collect();
        assert_eq!(names, ["devlend", "qsd-local", "qsd-nbd-chain"]);
        for (run, pids) in runs.iter().zip([2, 1, 2]) {
            check_run(run, pids);
        }
        for peer in ["qsd-local", "qsd-nbd-chain"] {
            assert!(f(c, &["ratios", peer, "iops"]) > 0.0, "{c}");
        }
    }
    let checks = r["checks"].as_array().expect("checks");
    assert!(checks
        .iter()
        .any(|c| c["target"].as_str().unwrap().contains("QD1 p50")));
    // The floor of the same run: devlend's QD1 p50 against qsd-local's + a round trip.
    assert!(f(&r, &["floor", "round_trip", "p50_us"]) > 0.0, "{r}");
    assert!(f(&r, &["floor", "one_stream_mb_per_s"]) > 0.0, "{r}");
    assert!(checks.iter().any(|c| c["target"]
        .as_str()
        .unwrap()
        .contains("devlend - qsd-local")));
    assert!(r["machine"]["nproc"].as_u64().unwrap() > 0);
    assert!(r["commands"]["qsd-nbd-chain"].as_array().unwrap().len() == 2);
    // Everything it started is gone: the sockets were in its work directory.
    assert!(!dir.path().join("devlend.sock").exists() || std::fs::read_dir(dir.path()).is_ok());
}

#[test]
fn busy_poll_mode_moves_data_intact() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, 16 * MIB).unwrap();
    let addr = format!("127.0.0.1:{}", devlend_tests::agents::free_port().unwrap());
    let devices = [format!("disk0={}", img.display())];
    let polling = ["--poll-us".to_string(), "200".into()];
    let lender = Lender::start_with(dir.path(), &addr, &devices, &polling).unwrap();
    let borrower = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("disk0.sock");
    let s = sock.display().to_string();
    borrower
        .cli_json(&[
            "attach",
            "--lender",
            &lender.addr,
            "--device",
            "disk0",
            "--socket",
            &s,
            "--poll-us",
            "200",
        ])
        .unwrap();
    let mut c = BlkClient::connect(&sock, 1, 2 * MIB as usize).unwrap();
    for (i, b) in c.buffer()[..MIB as usize].iter_mut().enumerate() {
        *b = (i % 253) as u8;
    }
    let writes: Vec<BlkOp> = (0..16)
        .map(|i| BlkOp::Write {
            offset: i * 65536,
            buf: (i * 65536) as usize,
            len: 65536,
        })
        .collect();
    let res = c.run(0, &writes).unwrap();
    assert!(res.iter().all(|&r| r == 0), "{res:?}");
    let reads: Vec<BlkOp> = (0..16)
        .map(|i| BlkOp::Read {
            offset: i * 65536,
            buf: MIB as usize + (i * 65536) as usize,
            len: 65536,
        })
        .collect();
    assert!(c.run(0, &reads).unwrap().iter().all(|&r| r == 0));
    let (a, b) = c.buffer().split_at(MIB as usize);
    assert!(a == &b[..MIB as usize], "data read back differs");
    // Idle after that work: neither side polls on (the window drops to 0, or runs out
    // with no event to start it again).
    std::thread::sleep(std::time::Duration::from_millis(500));
    let pids = [lender.proc.pid(), borrower.proc.pid()];
    let before: Vec<u64> = pids.iter().map(|&p| cpu_ticks(p)).collect();
    std::thread::sleep(std::time::Duration::from_secs(3));
    let used: Vec<u64> = pids
        .iter()
        .zip(&before)
        .map(|(&p, b)| cpu_ticks(p) - b)
        .collect();
    let hz = 100; // USER_HZ on Linux.
    assert!(
        used.iter().all(|&t| t < hz * 3 / 10),
        "idle for 3 s, the lender and the compute agent used {used:?} ticks of {hz}/s"
    );
    drop(c);
    // Too long a poll is refused.
    let out = borrower
        .cli(&[
            "attach",
            "--lender",
            &lender.addr,
            "--device",
            "disk0",
            "--socket",
            "/tmp/x.sock",
            "--poll-us",
            "5000",
        ])
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("poll"));
}

/// User and system CPU clock ticks of process `pid` so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn bench_fails_when_requests_fail() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, 16 * MIB).unwrap();
    let mut lender = Lender::start(dir.path(), &[format!("disk0={}", img.display())]).unwrap();
    let borrower = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("disk0.sock");
    let s = sock.display().to_string();
    borrower
        .cli_json(&[
            "attach",
            "--lender",
            &lender.addr,
            "--device",
            "disk0",
            "--socket",
            &s,
            "--reconnect-deadline",
            "0",
        ])
        .unwrap();
    // No lender, and no waiting for one: every request fails.
    lender.proc.kill_hard();
    let out = Command::new(bin("devlend").unwrap())
        .args([
            "bench",
            "--socket",
            &s,
            "--rw",
            "randread",
            "--iodepth",
            "1",
        ])
        .args(["--runtime", "0.5", "--ramp", "0", "--json"])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "bench exited 0 with every request failed"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("completed with an error"), "{err}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(f(&r, &["figures", "errors"]) > 0.0, "{r}");
}

/// `bench/ab-bins.sh` with one build on both sides (the after side polling), one short
/// round: each workload's runs are in its TSV, and its table has a line per workload
/// with three ratios.
#[test]
fn ab_bins_alternates_two_builds_and_prints_ratios() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let bins = bin("devlend").unwrap();
    let bins = bins.parent().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tsv = dir.path().join("runs.tsv");
    let out = Command::new("bash")
        .arg(root.join("bench/ab-bins.sh"))
        .args([bins, bins])
        .arg("1")
        .env("AB_RUNTIME", "1")
        .env("AB_SIZE_MIB", "64")
        .env("AB_WORKLOADS", "randread 4K 1,read 128K 8")
        .env("AB_RESULTS", &tsv)
        // The after side polls (lender and attachment): the flags are taken.
        .env("AB_LENDER_ARGS_AFTER", "--poll-us 50")
        .env("AB_ATTACH_ARGS_AFTER", "--poll-us 50")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let runs = std::fs::read_to_string(&tsv).unwrap();
    let runs: Vec<Vec<&str>> = runs.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(runs.len(), 4, "{runs:?}");
    for r in &runs {
        assert_eq!(r.len(), 6, "{r:?}");
        for v in &r[3..] {
            assert!(v.parse::<f64>().is_ok_and(|v| v > 0.0), "{r:?}");
        }
    }
    for w in ["randread 4K QD1", "read 128K QD8"] {
        let line = stdout.lines().find(|l| l.starts_with(w)).expect(w);
        let ratios: Vec<f64> = line
            .split_whitespace()
            .skip(3)
            .filter_map(|v| v.parse().ok())
            .collect();
        assert_eq!(ratios.len(), 9, "{line}");
        assert!(ratios.iter().all(|r| r.is_finite() && *r > 0.0), "{line}");
    }
    let missing = Command::new("bash")
        .arg(root.join("bench/ab-bins.sh"))
        .args([dir.path(), bins])
        .output()
        .unwrap();
    assert_eq!(
        missing.status.code(),
        Some(2),
        "a directory without the builds"
    );
    let not_a_commit = Command::new("bash")
        .arg(root.join("bench/ab.sh"))
        .arg("no-such-revision")
        .output()
        .unwrap();
    assert_eq!(not_a_commit.status.code(), Some(2));
}
