//! Direct mode with authentication: a key pair from `devlend keygen`, the public key
//! given to the lender (`--auth-key`), the private key to a compute agent
//! (`--auth-key-file`). Only that compute agent's attachments get sessions.

use std::path::Path;
use std::process::Command;

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_tests::agents::{bin, sparse_file, Borrower, Lender};

const MIB: u64 = 1 << 20;

fn keygen(out: &Path) -> std::process::Output {
    Command::new(bin("devlend").unwrap())
        .args(["keygen", "--out"])
        .arg(out)
        .output()
        .unwrap()
}

fn borrower(dir: &Path, name: &str, key: Option<&Path>) -> Borrower {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    let extra: Vec<String> = key
        .map(|k| vec!["--auth-key-file".into(), k.display().to_string()])
        .unwrap_or_default();
    Borrower::start_with(&d, &extra).unwrap()
}

fn attach(b: &Borrower, lender: &str, sock: &Path) -> std::process::Output {
    b.cli(&[
        "attach",
        "--lender",
        lender,
        "--device",
        "disk0",
        "--socket",
        &sock.display().to_string(),
        "--json",
    ])
    .unwrap()
}

#[test]
fn only_a_borrower_holding_the_key_gets_a_session() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, 16 * MIB).unwrap();
    let good = dir.path().join("good.key");
    let out = keygen(&good);
    assert!(out.status.success());
    let public = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert_eq!(public.len(), 43, "{public}");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&good).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    assert!(
        !keygen(&good).status.success(),
        "keygen overwrote a key file"
    );
    let other = dir.path().join("other.key");
    assert!(keygen(&other).status.success());

    let lender = Lender::start_with(
        dir.path(),
        &format!("127.0.0.1:{}", devlend_tests::agents::free_port().unwrap()),
        &[format!("disk0={}", img.display())],
        &["--auth-key".into(), public],
    )
    .unwrap();

    // Without a key, and with another key: refused, nothing left behind.
    for (name, key, why) in [
        ("none", None, "no lease token"),
        ("other", Some(other.as_path()), "signature"),
    ] {
        let b = borrower(dir.path(), name, key);
        let sock = dir.path().join(format!("{name}.sock"));
        let out = attach(&b, &lender.addr, &sock);
        assert!(!out.status.success(), "{name}: attached");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(why), "{name}: {err}");
        assert!(!sock.exists());
    }
    assert!(lender.proc.log().contains("lease check failed"));

    // With the key: attached, and I/O works.
    let b = borrower(dir.path(), "good", Some(&good));
    let sock = dir.path().join("good.sock");
    let out = attach(&b, &lender.addr, &sock);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut c = BlkClient::connect(&sock, 1, MIB as usize).unwrap();
    c.buffer()[..4096].fill(0x5a);
    let r = c
        .run(
            0,
            &[BlkOp::Write {
                offset: 8192,
                buf: 0,
                len: 4096,
            }],
        )
        .unwrap();
    assert_eq!(r, vec![0]);
    drop(c);
    let f = std::fs::read(&img).unwrap();
    assert!(f[8192..12288].iter().all(|&b| b == 0x5a));
}

/// Both ways in direct mode (issue 23): the lender proves its own key to a borrower
/// that names it (`devlend attach --lender-key`); a borrower that expects another key
/// refuses the lender, and nothing is attached.
#[test]
fn a_borrower_given_the_lenders_key_refuses_any_other_lender() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk0.img");
    sparse_file(&img, 16 * MIB).unwrap();
    let good = dir.path().join("good.key");
    let public = String::from_utf8(keygen(&good).stdout)
        .unwrap()
        .trim()
        .to_owned();
    let lender_key = dir.path().join("lender.key");
    let lender_public = String::from_utf8(keygen(&lender_key).stdout)
        .unwrap()
        .trim()
        .to_owned();
    let stranger = String::from_utf8(keygen(&dir.path().join("x.key")).stdout)
        .unwrap()
        .trim()
        .to_owned();
    let lender = Lender::start_with(
        dir.path(),
        &format!("127.0.0.1:{}", devlend_tests::agents::free_port().unwrap()),
        &[format!("disk0={}", img.display())],
        &[
            "--auth-key".into(),
            public,
            "--key-file".into(),
            lender_key.display().to_string(),
        ],
    )
    .unwrap();
    assert!(
        lender.proc.log().contains(&lender_public),
        "the lender does not log its key:\n{}",
        lender.proc.log()
    );
    let b = borrower(dir.path(), "b", Some(&good));
    let attach_expecting = |key: &str, sock: &Path| {
        b.cli(&[
            "attach",
            "--lender",
            &lender.addr,
            "--lender-key",
            key,
            "--device",
            "disk0",
            "--reconnect-deadline",
            "2",
            "--socket",
            &sock.display().to_string(),
            "--json",
        ])
        .unwrap()
    };
    let wrong = dir.path().join("wrong.sock");
    let out = attach_expecting(&stranger, &wrong);
    assert!(
        !out.status.success(),
        "attached to a lender with another key"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another lender answered"), "{err}");
    assert!(!wrong.exists());

    let sock = dir.path().join("good.sock");
    let out = attach_expecting(&lender_public, &sock);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut c = BlkClient::connect(&sock, 1, MIB as usize).unwrap();
    let r = c
        .run(
            0,
            &[BlkOp::Read {
                offset: 0,
                buf: 0,
                len: 4096,
            }],
        )
        .unwrap();
    assert_eq!(r, vec![0]);
}
