//! The compute agent's state file with real processes (no VM): a saved attachment
//! whose lender is away is listed as restoring, keeps its id and socket, and can be
//! given up; one agent per state file; an unusable state file stops the agent at start.

use std::time::{Duration, Instant};

use devlend_tests::agents::{free_port, sparse_file, Borrower, Lender};

const MIB: u64 = 1 << 20;

fn wait_status(
    b: &Borrower,
    what: &str,
    f: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let s = b.cli_json(&["status"]).unwrap();
        if f(&s) {
            return s;
        }
        assert!(
            Instant::now() < end,
            "timed out waiting for {what}: {s}\n{}",
            b.proc.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_saved_attachment_whose_lender_is_away_is_listed_reserved_and_can_be_given_up() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, 8 * MIB).unwrap();
    let spec = format!("disk0={}", img.display());
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let mut lender = Lender::start_on(dir.path(), &addr, std::slice::from_ref(&spec)).unwrap();
    let mut b = Borrower::start(dir.path()).unwrap();
    let sock = dir.path().join("disk0.sock");
    b.attach(&addr, "disk0", &sock, 1).unwrap();
    b.proc.kill_hard();
    lender.proc.kill_hard();

    // Restarted while the lender is away: listed as restoring, with the reason.
    let b = Borrower::start_named(dir.path(), "compute-agent-2", &[]).unwrap();
    let s = wait_status(&b, "a restoring entry with a reason", |s| {
        s[0]["restoring"].as_str().is_some_and(|r| r != "starting")
    });
    assert_eq!(s[0]["id"], "disk0", "{s}");
    assert!(
        s[0]["restoring"].as_str().unwrap().contains("lender"),
        "{s}"
    );
    let table = b.cli(&["status"]).unwrap();
    assert!(String::from_utf8_lossy(&table.stdout).contains("restoring"));
    // Its socket and id are reserved.
    let other = format!("127.0.0.1:{}", free_port().unwrap());
    let out = b
        .cli(&[
            "attach",
            "--lender",
            &other,
            "--device",
            "disk0",
            "--socket",
            &sock.display().to_string(),
        ])
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("being served again"), "{err}");

    // The lender comes back: the attachment is served again.
    lender = Lender::start_on(dir.path(), &addr, std::slice::from_ref(&spec)).unwrap();
    wait_status(&b, "served again", |s| {
        s[0]["id"] == "disk0" && s[0]["restoring"].is_null()
    });
    let c = devlend_cli::blk_client::BlkClient::connect(&sock, 1, MIB as usize).unwrap();
    assert_eq!(c.capacity(), 8 * MIB);
    drop(c);

    // Away again, and given up with detach: gone from the state file.
    let mut b = b;
    b.proc.kill_hard();
    lender.proc.kill_hard();
    let b = Borrower::start_named(dir.path(), "compute-agent-3", &[]).unwrap();
    wait_status(&b, "restoring", |s| s[0]["restoring"].is_string());
    let d = b.cli_json(&["detach", "disk0"]).unwrap();
    assert_eq!(d["id"], "disk0");
    assert_eq!(b.cli_json(&["status"]).unwrap(), serde_json::json!([]));
    let state = std::fs::read_to_string(dir.path().join("api.state.json")).unwrap();
    assert!(!state.contains("disk0"), "{state}");
}

#[test]
fn one_agent_per_state_file_and_an_unusable_one_stops_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let _a = Borrower::start(dir.path()).unwrap();
    // Another API socket, the same state file.
    let state = dir.path().join("api.state.json").display().to_string();
    let other = dir.path().join("b");
    std::fs::create_dir_all(&other).unwrap();
    let e = Borrower::start_with(&other, &["--state-file".into(), state])
        .err()
        .expect("second agent started");
    assert!(
        format!("{e:#}").contains("in use by another compute agent"),
        "{e:#}"
    );
    // A state file that cannot be written.
    let bad = dir.path().join("c");
    std::fs::create_dir_all(&bad).unwrap();
    let e = Borrower::start_with(
        &bad,
        &["--state-file".into(), "/proc/devlend-state.json".into()],
    )
    .err()
    .expect("started with an unwritable state file");
    assert!(
        format!("{e:#}").contains("/proc/devlend-state.json"),
        "{e:#}"
    );
    // A damaged one: refused, saying what to do.
    let dmg = dir.path().join("d");
    std::fs::create_dir_all(&dmg).unwrap();
    std::fs::write(
        dmg.join("api.state.json"),
        "{\"version\": 1, \"attachments\": [",
    )
    .unwrap();
    let e = Borrower::start(&dmg)
        .err()
        .expect("started with a damaged state file");
    assert!(format!("{e:#}").contains("move it aside"), "{e:#}");
}

#[test]
fn an_attach_whose_state_cannot_be_saved_fails_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, 8 * MIB).unwrap();
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let _lender =
        Lender::start_on(dir.path(), &addr, &[format!("disk0={}", img.display())]).unwrap();
    let b = Borrower::start(dir.path()).unwrap();
    // The state file's place becomes a directory after start: the next save fails.
    let state = dir.path().join("api.state.json");
    std::fs::remove_file(&state).unwrap();
    std::fs::create_dir(&state).unwrap();
    let sock = dir.path().join("disk0.sock");
    let out = b
        .cli(&[
            "attach",
            "--lender",
            &addr,
            "--device",
            "disk0",
            "--socket",
            &sock.display().to_string(),
        ])
        .unwrap();
    assert!(
        !out.status.success(),
        "attached though it would not survive a restart"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not attached"), "{err}");
    assert!(!sock.exists(), "the socket was left behind");
    assert_eq!(b.cli_json(&["status"]).unwrap(), serde_json::json!([]));
}
