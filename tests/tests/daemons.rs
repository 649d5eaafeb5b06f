//! The daemons as systemd runs them: each unit's `ExecStart` line from `contrib/systemd/`
//! is started with a `NOTIFY_SOCKET`, and we check readiness, SIGHUP reloads, SIGTERM
//! drains, and that the metrics endpoints count the I/O done.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_fabric::{tcp::ConnectError, HelloStatus};
use devlend_tests::agents::{bin, free_port, sparse_file};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The unit's ExecStart, split into words, with paths mapped for the test.
fn exec_start(unit: &str, map: &[(&str, &str)]) -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("contrib/systemd").join(unit)).unwrap();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart");
    line.split_whitespace()
        .map(|w| {
            let mut w = w.to_owned();
            for (from, to) in map {
                w = w.replace(from, to);
            }
            w
        })
        .collect()
}

struct Daemon {
    child: Child,
    notify: UnixDatagram,
}

impl Daemon {
    fn start(argv: &[String], dir: &Path, name: &str) -> Daemon {
        let sock = dir.join(format!("{name}.notify"));
        let notify = UnixDatagram::bind(&sock).unwrap();
        notify
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .env("NOTIFY_SOCKET", &sock)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        Daemon { child, notify }
    }

    /// Waits for a notification containing `what`.
    fn expect(&mut self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut buf = [0u8; 512];
        while Instant::now() < deadline {
            if let Ok(n) = self.notify.recv(&mut buf) {
                if String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .any(|l| l == what)
                {
                    return;
                }
            }
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "daemon exited before {what}"
            );
        }
        panic!("no {what} notification");
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
    }

    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "daemon did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn hello(addr: &str, device: &str) -> Result<(), HelloStatus> {
    match devlend_fabric::tcp::connect(addr, device, 0, Duration::from_secs(5)) {
        Ok(_) => Ok(()),
        Err(ConnectError::Refused { status, .. }) => Err(status),
        Err(e) => panic!("{e}"),
    }
}

fn devlend(api: &Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(bin("devlend").unwrap())
        .arg("--api")
        .arg(api)
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "devlend {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn scrape(addr: &str) -> String {
    devlend_tests::scrape_metrics(addr).unwrap()
}

/// The value of the series whose line starts with `series` (name and labels in order).
fn value(text: &str, series: &str) -> f64 {
    devlend_tests::metric_value(text, series)
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

#[test]
fn units_start_reload_drain_and_count() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let target = bin("devlend")
        .unwrap()
        .parent()
        .unwrap()
        .display()
        .to_string()
        + "/";
    for n in ["d1", "d2"] {
        sparse_file(&d.join(format!("{n}.img")), 8 << 20).unwrap();
    }
    let port = free_port().unwrap();
    let lender_addr = format!("127.0.0.1:{port}");
    let lender_metrics = format!("127.0.0.1:{}", free_port().unwrap());
    let lender_cfg = d.join("device-agent.toml");
    let write_lender_cfg = |devices: &[&str], level: &str| {
        let mut t = format!("listen = \"{lender_addr}\"\nlog_level = \"{level}\"\nmetrics_listen = \"{lender_metrics}\"\n");
        for n in devices {
            t += &format!(
                "[[device]]\nname = \"{n}\"\npath = \"{}\"\n",
                d.join(format!("{n}.img")).display()
            );
        }
        std::fs::write(&lender_cfg, t).unwrap();
    };
    write_lender_cfg(&["d1"], "info");
    let borrower_metrics = format!("127.0.0.1:{}", free_port().unwrap());
    std::fs::write(
        d.join("compute-agent.toml"),
        format!("metrics_listen = \"{borrower_metrics}\"\nlog_format = \"json\"\n"),
    )
    .unwrap();
    let api = d.join("run/compute-agent.sock");
    let map = [
        ("/usr/local/bin/", target.as_str()),
        ("/etc/devlend/", &format!("{}/", d.display())),
        ("/run/devlend/compute-agent.sock", api.to_str().unwrap()),
    ];

    let mut lender = Daemon::start(
        &exec_start("devlend-device-agent.service", &map),
        d,
        "lender",
    );
    lender.expect("READY=1");
    let mut borrower = Daemon::start(
        &exec_start("devlend-compute-agent.service", &map),
        d,
        "borrower",
    );
    borrower.expect("READY=1");
    assert_eq!(hello(&lender_addr, "d2"), Err(HelloStatus::NoSuchDevice));

    // d1 attached (held); the file now lends d2 only: a reload adds d2 and keeps d1.
    let s1 = d.join("d1.sock");
    devlend(
        &api,
        &[
            "attach",
            "--lender",
            &lender_addr,
            "--device",
            "d1",
            "--socket",
            s1.to_str().unwrap(),
        ],
    );
    write_lender_cfg(&["d2"], "debug");
    lender.signal(libc::SIGHUP);
    lender.expect("RELOADING=1");
    lender.expect("READY=1");
    assert_eq!(hello(&lender_addr, "d2"), Ok(()));
    assert_eq!(
        hello(&lender_addr, "d1"),
        Err(HelloStatus::Busy),
        "a held device must stay lent"
    );
    devlend(&api, &["detach", "d1"]);
    lender.signal(libc::SIGHUP);
    lender.expect("RELOADING=1");
    lender.expect("READY=1");
    assert_eq!(hello(&lender_addr, "d1"), Err(HelloStatus::NoSuchDevice));
    let log = std::fs::read_to_string(d.join("lender.log")).unwrap();
    assert!(
        log.contains("DEBUG"),
        "the reloaded log level did not apply:\n{log}"
    );

    // Metrics move by the I/O done.
    let s2 = d.join("d2.sock");
    devlend(
        &api,
        &[
            "attach",
            "--lender",
            &lender_addr,
            "--device",
            "d2",
            "--socket",
            s2.to_str().unwrap(),
            "--id",
            "vol2",
        ],
    );
    let mut c = BlkClient::connect(&s2, 1, 1 << 20).unwrap();
    let before_b = scrape(&borrower_metrics);
    let before_l = scrape(&lender_metrics);
    let writes: Vec<BlkOp> = (0..37)
        .map(|i| BlkOp::Write {
            offset: i * 4096,
            buf: 0,
            len: 4096,
        })
        .collect();
    assert!(c.run(0, &writes).unwrap().iter().all(|&r| r == 0));
    let reads: Vec<BlkOp> = (0..11)
        .map(|i| BlkOp::Read {
            offset: i * 8192,
            buf: 0,
            len: 8192,
        })
        .collect();
    assert!(c.run(0, &reads).unwrap().iter().all(|&r| r == 0));
    let after_b = scrape(&borrower_metrics);
    let after_l = scrape(&lender_metrics);
    let lab = "attachment=\"vol2\",device=\"d2\",lender=\"".to_owned() + &lender_addr + "\"";
    let delta = |a: &str, b: &str, s: &str| value(a, s) - value(b, s);
    assert_eq!(
        delta(
            &after_b,
            &before_b,
            &format!("devlend_attachment_requests_total{{{lab},op=\"write\"}}")
        ),
        37.0
    );
    assert_eq!(
        delta(
            &after_b,
            &before_b,
            &format!("devlend_attachment_bytes_total{{{lab},op=\"write\"}}")
        ),
        37.0 * 4096.0
    );
    assert_eq!(
        delta(
            &after_b,
            &before_b,
            &format!("devlend_attachment_requests_total{{{lab},op=\"read\"}}")
        ),
        11.0
    );
    assert_eq!(
        delta(
            &after_b,
            &before_b,
            &format!("devlend_attachment_request_duration_seconds_count{{{lab}}}")
        ),
        48.0
    );
    assert_eq!(
        value(
            &after_b,
            &format!("devlend_attachment_requests_in_flight{{{lab}}}")
        ),
        0.0
    );
    assert_eq!(
        delta(
            &after_l,
            &before_l,
            "devlend_device_requests_total{device=\"d2\",op=\"write\"}"
        ),
        37.0
    );
    assert_eq!(
        delta(
            &after_l,
            &before_l,
            "devlend_device_bytes_total{device=\"d2\",op=\"read\"}"
        ),
        11.0 * 8192.0
    );
    assert!(after_b.contains("# TYPE devlend_attachment_request_duration_seconds histogram"));
    assert_eq!(
        delta(
            &after_l,
            &before_l,
            "devlend_device_request_duration_seconds_count{device=\"d2\"}"
        ),
        48.0
    );
    assert_eq!(
        value(&after_l, "devlend_device_requests_in_flight{device=\"d2\"}"),
        0.0
    );
    drop(c);
    let blog = std::fs::read_to_string(d.join("borrower.log")).unwrap();
    assert!(
        blog.lines()
            .filter(|l| !l.is_empty())
            .all(|l| l.starts_with('{')),
        "JSON log format not applied:\n{blog}"
    );

    // SIGTERM drains and exits cleanly: the borrower stops every attachment (they stay
    // in its state file for the next start) and removes its sockets.
    borrower.signal(libc::SIGTERM);
    borrower.expect("STOPPING=1");
    assert!(borrower.wait_exit().success());
    assert!(!s2.exists() && !api.exists(), "sockets left after SIGTERM");
    lender.signal(libc::SIGTERM);
    lender.expect("STOPPING=1");
    assert!(lender.wait_exit().success());
}
