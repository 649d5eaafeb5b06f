//! A captured credential opens nothing (issue 39). A relay between a compute agent and
//! its lender (`devlend-capture relay`) records every byte the compute agent sent, on plain TCP without TLS, over
//! a whole session: the hellos, the proofs of possession, the I/O. Once the device is
//! free again, those bytes are replayed at the real lender from another host (a thread
//! in a network namespace): every replayed connection is refused (`Denied`), because
//! the lender asks each handshake for a signature of a fresh nonce by the key the token
//! names, and the capture holds only signatures of old ones. In direct mode (a token
//! the compute agent signed with its `--auth-key-file`) and in pool mode (a pool lease
//! whose token names the compute host's enrolled key).
//!
//! Before proof of possession, the hello carried the token itself and the replay opened
//! the device (this test then fails at "a replayed connection opened a session").

use std::io::Write;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_fabric::{HelloReply, HelloStatus};
use devlend_pool::api::{DeviceQuery, DeviceState, Role};
use devlend_tests::agents::{
    bin, free_port, sparse_file, wait_listening, Borrower, Lender, Pool, Proc,
};
use devlend_tests::netns::Netns;

const MIB: u64 = 1 << 20;

/// What a relay (`devlend-capture relay`, the test tool) saw the compute agent send:
/// `out.N` for the Nth connection it accepted. The relay runs while this lives.
struct Captured {
    _relay: Proc,
    out: PathBuf,
}

/// A relay on loopback to `target` that records the bytes each connection's client
/// sends, in `dir`.
fn recorder(dir: &Path, target: String) -> (String, Captured) {
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let out = dir.join("capture");
    let mut relay = Proc::spawn(
        "capture",
        &bin("devlend-capture").unwrap(),
        &[
            "relay".into(),
            addr.clone(),
            target,
            out.display().to_string(),
        ],
        dir,
    )
    .unwrap();
    wait_listening(&mut relay, &addr).unwrap();
    (addr, Captured { _relay: relay, out })
}

fn keygen(out: &Path) -> String {
    let o = std::process::Command::new(bin("devlend").unwrap())
        .args(["keygen", "--out"])
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success());
    String::from_utf8(o.stdout).unwrap().trim().to_owned()
}

/// Writes and reads back 64 KiB through the attachment's socket: a whole session.
fn io(sock: &Path) {
    let mut c = BlkClient::connect(sock, 1, MIB as usize).unwrap();
    c.buffer()[..65536].fill(0x3c);
    let r = c
        .run(
            0,
            &[
                BlkOp::Write {
                    offset: 0,
                    buf: 0,
                    len: 65536,
                },
                BlkOp::Read {
                    offset: 0,
                    buf: 65536,
                    len: 65536,
                },
            ],
        )
        .unwrap();
    assert_eq!(r, vec![0, 0]);
}

/// Replays each captured connection at `lender` from inside `ns`, one after the other;
/// the lender's last answer to each (a connection it closed without one: `None`).
fn replay(ns: &Netns, lender: &str, captured: &Captured) -> Vec<Option<HelloStatus>> {
    // `out.N`, in order of N; the probe of the relay's readiness sent nothing (and made
    // no file when the lender was not up yet).
    let name = captured
        .out
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mut files: Vec<(u32, PathBuf)> = std::fs::read_dir(captured.out.parent().unwrap())
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let n = e
                .file_name()
                .to_string_lossy()
                .strip_prefix(&format!("{name}."))?
                .parse()
                .ok()?;
            Some((n, e.path()))
        })
        .collect();
    files.sort();
    let conns: Vec<Vec<u8>> = files
        .iter()
        .map(|(_, p)| std::fs::read(p).unwrap())
        .filter(|c| !c.is_empty())
        .collect();
    assert!(!conns.is_empty(), "nothing was captured");
    let path = format!("/var/run/netns/{}", ns.name);
    let lender = lender.to_owned();
    std::thread::spawn(move || {
        let f = std::fs::File::open(&path).unwrap();
        // SAFETY: setns(2) on an open namespace file; it moves only this thread.
        let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
        conns
            .iter()
            .map(|bytes| {
                let mut s = TcpStream::connect(&lender).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                // The lender may close after its refusal, before all of it is read.
                let _ = s.write_all(bytes);
                let mut last = None;
                while let Ok(reply) = HelloReply::read_from(&mut s) {
                    assert_ne!(
                        reply.status,
                        HelloStatus::Ok,
                        "a replayed connection opened a session"
                    );
                    last = Some(reply.status);
                    if reply.status != HelloStatus::Prove {
                        break;
                    }
                }
                last
            })
            .collect()
    })
    .join()
    .unwrap()
}

/// Every replayed connection ends refused, and the lender says why.
fn assert_refused(statuses: &[Option<HelloStatus>], lender: &Lender) {
    eprintln!("replayed connections: {statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == Some(HelloStatus::Denied)),
        "{statuses:?}\nlender log:\n{}",
        lender.proc.log()
    );
    assert!(
        lender
            .proc
            .log()
            .contains("does not verify with the token's holder key"),
        "{}",
        lender.proc.log()
    );
}

fn detach(b: &Borrower, id: &str) {
    let out = b.cli(&["detach", id]).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_replayed_direct_mode_session_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, 16 * MIB).unwrap();
    let key = dir.path().join("compute.key");
    let public = keygen(&key);
    let ns = Netns::new(40).unwrap();
    let port = free_port().unwrap();
    let lender = Lender::start_with(
        dir.path(),
        &format!("0.0.0.0:{port}"),
        &[format!("disk0={}", img.display())],
        &["--auth-key".into(), public],
    )
    .unwrap();
    let (relay, captured) = recorder(dir.path(), format!("127.0.0.1:{port}"));
    let b = Borrower::start_with(
        dir.path(),
        &["--auth-key-file".into(), key.display().to_string()],
    )
    .unwrap();
    let sock = dir.path().join("vm.sock");
    let a = b
        .cli_json(&[
            "attach",
            "--lender",
            &relay,
            "--device",
            "disk0",
            "--socket",
            &sock.display().to_string(),
        ])
        .unwrap();
    io(&sock);
    detach(&b, a["id"].as_str().unwrap());
    let statuses = replay(&ns, &format!("{}:{port}", ns.host_ip), &captured);
    assert_refused(&statuses, &lender);
}

#[test]
fn a_replayed_pool_lease_session_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::start(dir.path()).unwrap();
    let client = pool.admin().unwrap();
    let lender_key = dir.path().join("lender.key");
    pool.enroll(Role::Lender, "lender-r", &lender_key).unwrap();
    pool.enroll(
        Role::Compute,
        &devlend_daemon::host_name(),
        &Borrower::pool_key(dir.path()),
    )
    .unwrap();
    sparse_file(&dir.path().join("disk0.img"), 16 * MIB).unwrap();
    let ns = Netns::new(41).unwrap();
    let port = free_port().unwrap();
    // Borrowers are sent to the relay, which passes everything on to the lender.
    let (relay, captured) = recorder(dir.path(), format!("127.0.0.1:{port}"));
    let config = dir.path().join("device-agent.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"0.0.0.0:{port}\"\nkey_file = \"{key}\"\n[pool]\nurl = \"{url}\"\nprovider = \"lender-r\"\nadvertise = \"{relay}\"\nheartbeat_interval_ms = 500\n\n[[device]]\nname = \"disk0\"\npath = \"{d}/disk0.img\"\n",
            key = lender_key.display(),
            url = pool.url,
            d = dir.path().display(),
        ),
    )
    .unwrap();
    let lender = Lender::start_with(
        dir.path(),
        &format!("0.0.0.0:{port}"),
        &[],
        &["--config".into(), config.display().to_string()],
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !client
        .devices(&DeviceQuery::default())
        .unwrap_or_default()
        .iter()
        .any(|d| d.state == DeviceState::Available)
    {
        assert!(Instant::now() < deadline, "{}", lender.proc.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut b = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("vm.sock");
    let a = b.attach_class(&pool.url, dir.path(), &sock, 1).unwrap();
    io(&sock);
    assert!(a["id"].is_string(), "{a}");
    // The compute agent dies: its sessions close, the device is free, and its lease
    // stays live until its TTL passes without renewals. A replay now would take it.
    b.proc.kill_hard();
    std::thread::sleep(Duration::from_secs(1));
    let statuses = replay(&ns, &format!("{}:{port}", ns.host_ip), &captured);
    assert_refused(&statuses, &lender);
}
