//! Several paths to a pooled lender (issue 36): a lender registers two fabric
//! addresses with a pool (`--advertise` and `--advertise-path`), and a disk attached
//! through the pool (`devlend attach --class`) goes over both. Real processes on
//! loopback: the lender listens on `0.0.0.0`, reached at 127.0.0.1 and 127.0.0.2.

use std::path::Path;
use std::time::{Duration, Instant};

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_pool::api::{DeviceQuery, DeviceState, LeaseFilter, Role};
use devlend_tests::agents::{free_port, sparse_file, Borrower, Lender, Pool};

const MIB: u64 = 1 << 20;
const PROVIDER: &str = "lender-a";

/// Writes 64 KiB on `queue` and reads it back; the completions' statuses.
fn write_read(c: &mut BlkClient, queue: usize, seed: u8) -> Vec<i32> {
    for (i, b) in c.buffer()[..65536].iter_mut().enumerate() {
        *b = seed.wrapping_add((i % 251) as u8);
    }
    let offset = 4096 + queue as u64 * 65536;
    let mut r = c
        .run(
            queue,
            &[BlkOp::Write {
                offset,
                buf: 0,
                len: 65536,
            }],
        )
        .unwrap();
    r.extend(
        c.run(
            queue,
            &[BlkOp::Read {
                offset,
                buf: 65536,
                len: 65536,
            }],
        )
        .unwrap(),
    );
    let b = c.buffer();
    assert_eq!(b[..65536], b[65536..131072], "read back differs");
    r
}

fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_disk_leased_through_the_pool_goes_over_every_registered_address() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pool = Pool::start(d).unwrap();
    let client = pool.admin().unwrap();
    let lender_key = d.join("lender.key");
    pool.enroll(Role::Lender, PROVIDER, &lender_key).unwrap();
    pool.enroll(
        Role::Compute,
        &devlend_daemon::host_name(),
        &Borrower::pool_key(d),
    )
    .unwrap();
    sparse_file(&d.join("disk0.img"), 64 * MIB).unwrap();
    let port = free_port().unwrap();
    let paths = [format!("127.0.0.1:{port}"), format!("127.0.0.2:{port}")];
    let lender = Lender::start_with(
        d,
        &format!("0.0.0.0:{port}"),
        &[format!("disk0={}", d.join("disk0.img").display())],
        &[
            "--pool".into(),
            pool.url.clone(),
            "--provider".into(),
            PROVIDER.into(),
            "--key-file".into(),
            lender_key.display().to_string(),
            "--advertise".into(),
            paths[0].clone(),
            "--advertise-path".into(),
            paths[1].clone(),
        ],
    )
    .unwrap();
    wait_for("disk0 registered and available", 20, || {
        let d = client.devices(&DeviceQuery::default()).unwrap_or_default();
        d.len() == 1 && d[0].state == DeviceState::Available
    });
    let providers = client.providers().unwrap();
    assert_eq!(providers[0].fabric_address, paths[0]);
    assert_eq!(providers[0].fabric_paths, [paths[1].clone()]);

    let b = Borrower::start(d).unwrap();
    let sock = d.join("a.sock").display().to_string();
    let key = Borrower::pool_key(d).display().to_string();
    let out = b
        .cli(&[
            "attach",
            "--pool",
            &pool.url,
            "--pool-key",
            &key,
            "--class",
            "BLOCK",
            "--vm",
            "vm-1",
            "--socket",
            &sock,
            "--queues",
            "2",
            "--json",
        ])
        .unwrap();
    assert!(
        out.status.success(),
        "{}\nlender log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        lender.proc.log()
    );
    let leases = client.leases(LeaseFilter::Active).unwrap();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].fabric_paths, [paths[1].clone()]);

    // Both queues serve I/O, one on each path.
    let mut c = BlkClient::connect(Path::new(&sock), 2, 4 * MIB as usize).unwrap();
    assert_eq!(c.capacity(), 64 * MIB);
    assert_eq!(write_read(&mut c, 0, 7), vec![0, 0]);
    assert_eq!(write_read(&mut c, 1, 9), vec![0, 0]);
    let status = || b.cli_json(&["status"]).unwrap()[0]["counters"].clone();
    wait_for("a session on each path", 10, || {
        let s = status();
        s["paths"]
            .as_array()
            .is_some_and(|p| p.len() == 2 && p.iter().all(|p| p["sessions"] == 1))
    });
    let s = status();
    let shown: Vec<&str> = s["paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["addr"].as_str().unwrap())
        .collect();
    assert_eq!(shown, [paths[0].as_str(), paths[1].as_str()], "{s}");
    assert_eq!(s["errors"], 0, "{s}");

    // Saved with its paths: a restart while the pool is away serves it on both.
    let state = std::fs::read_to_string(d.join("api.state.json")).unwrap();
    assert!(state.contains(&paths[1]), "{state}");
    drop(c);
    drop(lender);
}
