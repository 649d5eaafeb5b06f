//! No unauthenticated lender beyond loopback: a real `devlend-device-agent` with no
//! pool, no auth key and no client certificates refuses to start on a wildcard address
//! (TCP and `--transport rdma`, flag and config file) and names the ways out; with
//! `--insecure` (or `insecure = true`) it serves as before, and so does a lender on
//! 127.0.0.1 without the flag, or one given an auth key.

use std::fs::File;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use devlend_tests::agents::{bin, free_port, sparse_file, wait_listening, Borrower, Lender, Proc};

const MIB: u64 = 1 << 20;

/// Runs the lender with `args` until it exits (within 10 s) and returns its status and
/// stderr. A lender still running by then serves: the test fails.
fn lender_exit(dir: &Path, name: &str, args: &[String]) -> (ExitStatus, String) {
    let log = dir.join(format!("{name}.stderr"));
    let mut child = Command::new(bin("devlend-device-agent").unwrap())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{name}: the lender is still running after 10 s (it serves unauthenticated):\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, std::fs::read_to_string(&log).unwrap())
}

fn assert_refused(dir: &Path, name: &str, args: &[String]) {
    let (status, err) = lender_exit(dir, name, args);
    assert!(!status.success(), "{name}: exit {status}:\n{err}");
    for way_out in ["--insecure", "--pool", "devlend keygen", "--auth-key"] {
        assert!(err.contains(way_out), "{name}: {way_out} not named:\n{err}");
    }
}

fn attach(b: &Borrower, lender: &str, sock: &Path) {
    let out = b
        .cli(&[
            "attach",
            "--lender",
            lender,
            "--device",
            "disk0",
            "--socket",
            &sock.display().to_string(),
            "--json",
        ])
        .unwrap();
    assert!(
        out.status.success(),
        "attach through {lender}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(sock.exists());
}

#[test]
fn beyond_loopback_without_auth_refuses_to_start_unless_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, 16 * MIB).unwrap();
    let disk = format!("disk0={}", img.display());
    let args = |listen: &str, extra: &[&str]| -> Vec<String> {
        let mut a = vec![
            "--listen".to_owned(),
            listen.to_owned(),
            "--device".into(),
            disk.clone(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };

    // Wildcards, IPv4 and IPv6, over TCP and RDMA (the same address): refused.
    assert_refused(dir.path(), "wildcard", &args("0.0.0.0:0", &[]));
    assert_refused(dir.path(), "wildcard-v6", &args("[::]:0", &[]));
    assert_refused(
        dir.path(),
        "wildcard-rdma",
        &args("0.0.0.0:0", &["--transport", "rdma"]),
    );
    // The same from the config file.
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"0.0.0.0:0\"\n[[device]]\nname = \"disk0\"\npath = \"{}\"\n",
            img.display()
        ),
    )
    .unwrap();
    let config = vec!["--config".to_owned(), cfg.display().to_string()];
    assert_refused(dir.path(), "wildcard-file", &config);

    // --insecure: served on the wildcard, an attach through loopback works.
    let port = free_port().unwrap();
    let lender = Lender::start_with(
        dir.path(),
        &format!("0.0.0.0:{port}"),
        std::slice::from_ref(&disk),
        &["--insecure".into()],
    )
    .unwrap();
    let b = Borrower::start(dir.path()).unwrap();
    attach(&b, &format!("127.0.0.1:{port}"), &dir.path().join("a.sock"));
    // Logged before the first session is served.
    let log = lender.proc.log();
    assert!(
        log.contains("--insecure") && log.contains("unauthenticated"),
        "{log}"
    );
    drop(b);
    drop(lender);

    // `insecure = true` in the config file: served too.
    let cfg2 = dir.path().join("agent-insecure.toml");
    let port = free_port().unwrap();
    std::fs::write(
        &cfg2,
        format!(
            "listen = \"0.0.0.0:{port}\"\ninsecure = true\n[[device]]\nname = \"disk0\"\npath = \"{}\"\n",
            img.display()
        ),
    )
    .unwrap();
    // Started by the file alone (Lender::start_with would pass --listen).
    let mut p = Proc::spawn(
        "device-agent-file",
        &bin("devlend-device-agent").unwrap(),
        &["--config".into(), cfg2.display().to_string()],
        dir.path(),
    )
    .unwrap();
    wait_listening(&mut p, &format!("127.0.0.1:{port}")).unwrap();
    // The warning follows the bind.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !p.log().contains("--insecure") {
        p.check_alive().unwrap();
        assert!(
            Instant::now() < deadline,
            "no --insecure warning:\n{}",
            p.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn loopback_without_auth_and_any_address_with_a_key_start_as_before() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, 16 * MIB).unwrap();
    let disk = format!("disk0={}", img.display());

    // 127.0.0.1, no auth, no --insecure: served, with the warning.
    let lender = Lender::start(dir.path(), std::slice::from_ref(&disk)).unwrap();
    let b = Borrower::start(dir.path()).unwrap();
    attach(&b, &lender.addr, &dir.path().join("a.sock"));
    assert!(
        lender.proc.log().contains("unauthenticated"),
        "{}",
        lender.proc.log()
    );
    drop(b);
    drop(lender);

    // The wildcard with an auth key: served, no --insecure needed.
    let key = dir.path().join("borrower.key");
    let out = Command::new(bin("devlend").unwrap())
        .args(["keygen", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(out.status.success());
    let public = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let port = free_port().unwrap();
    let lender = Lender::start_with(
        dir.path(),
        &format!("0.0.0.0:{port}"),
        std::slice::from_ref(&disk),
        &["--auth-key".into(), public],
    )
    .unwrap();
    let d = dir.path().join("keyed");
    std::fs::create_dir_all(&d).unwrap();
    let b =
        Borrower::start_with(&d, &["--auth-key-file".into(), key.display().to_string()]).unwrap();
    attach(&b, &format!("127.0.0.1:{port}"), &d.join("b.sock"));
    drop(b);
    drop(lender);
}
