//! End to end with real processes: a lender and a borrower on loopback, driven through
//! the vhost-user socket by the `blkio` crate's virtio-blk-vhost-user frontend.
//!
//! Why this file is over 600 lines: a test file: its nine end-to-end tests share one small
//! rig (`Setup`: a lender and a borrower process, and a `blkio` client on the attachment).
//! The two tests that drive the `devlend` command line
//! (`cli_attach_prints_qemu_and_libvirt_and_detach_removes_the_socket` and
//! `socket_paths_never_destroy_files`, about 270 lines) could move to their own file, and
//! are left here for now.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_tests::agents::{sparse_file, Borrower, Lender};
use rand::{Rng, SeedableRng};

const MIB: u64 = 1 << 20;

struct Setup {
    dir: tempfile::TempDir,
    lender: Lender,
    borrower: Borrower,
}

fn setup(devices: &[(&str, u64, &str)]) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let mut specs = Vec::new();
    for (name, size, opts) in devices {
        let img = dir.path().join(format!("{name}.img"));
        sparse_file(&img, *size).unwrap();
        specs.push(format!("{name}={}{opts}", img.display()));
    }
    let lender = Lender::start(dir.path(), &specs).unwrap();
    let borrower = Borrower::start(dir.path()).unwrap();
    Setup {
        dir,
        lender,
        borrower,
    }
}

impl Setup {
    fn attach(&self, device: &str, queues: u16) -> (std::path::PathBuf, BlkClient) {
        let sock = self.dir.path().join(format!("{device}.sock"));
        self.borrower
            .attach(&self.lender.addr, device, &sock, queues)
            .unwrap();
        let client = BlkClient::connect(&sock, queues as usize, 4 * MIB as usize).unwrap();
        (sock, client)
    }

    fn image(&self, device: &str) -> std::path::PathBuf {
        self.dir.path().join(format!("{device}.img"))
    }
}

fn ok(results: &[i32]) {
    assert!(results.iter().all(|&r| r == 0), "results: {results:?}");
}

#[test]
fn random_writes_read_back_and_reach_the_lenders_file() {
    let s = setup(&[("disk0", 64 * MIB, ",serial=SN-RANDOM")]);
    let (_sock, mut c) = s.attach("disk0", 1);
    assert_eq!(c.capacity(), 64 * MIB);
    let mut model = vec![0u8; (64 * MIB) as usize];
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    for round in 0..40 {
        // A batch of up to 8 non-overlapping writes in flight at once.
        let n = rng.random_range(1..=8);
        let mut ops = Vec::new();
        let mut used: Vec<(u64, u64)> = Vec::new();
        let mut buf_off = 0usize;
        while ops.len() < n {
            let len = 512 * rng.random_range(1..=256u64);
            let off = 512 * rng.random_range(0..(64 * MIB - len) / 512);
            if used.iter().any(|&(o, l)| off < o + l && o < off + len) {
                continue;
            }
            used.push((off, len));
            rng.fill(&mut c.buffer()[buf_off..buf_off + len as usize]);
            model[off as usize..(off + len) as usize]
                .copy_from_slice(&c.buffer()[buf_off..buf_off + len as usize]);
            ops.push(BlkOp::Write {
                offset: off,
                buf: buf_off,
                len: len as usize,
            });
            buf_off += len as usize;
        }
        ok(&c.run(0, &ops).unwrap());
        // Read every range back through the borrower.
        for &(off, len) in &used {
            ok(&[c
                .run_one(
                    0,
                    BlkOp::Read {
                        offset: off,
                        buf: 0,
                        len: len as usize,
                    },
                )
                .unwrap()]);
            assert!(
                c.buffer()[..len as usize] == model[off as usize..(off + len) as usize],
                "round {round}: data at {off}+{len} differs"
            );
        }
    }
    ok(&[c.run_one(0, BlkOp::Flush).unwrap()]);
    let file = fs::read(s.image("disk0")).unwrap();
    assert!(
        file == model,
        "the lender's file differs from what was written"
    );
}

#[test]
fn flush_discard_and_write_zeroes_work() {
    let s = setup(&[("disk0", 16 * MIB, "")]);
    let (_sock, mut c) = s.attach("disk0", 1);
    // Fill 4 MiB with non-zero data and flush it.
    c.buffer()[..(4 * MIB) as usize].fill(0xa5);
    ok(&c
        .run(
            0,
            &[
                BlkOp::Write {
                    offset: 0,
                    buf: 0,
                    len: (4 * MIB) as usize,
                },
                BlkOp::Flush,
            ],
        )
        .unwrap());
    let blocks_before = fs::metadata(s.image("disk0")).unwrap().blocks();

    // DISCARD punches a hole: the range reads back as zeroes and the file shrinks.
    ok(&[c
        .run_one(
            0,
            BlkOp::Discard {
                offset: 0,
                len: MIB,
            },
        )
        .unwrap()]);
    // WRITE_ZEROES without and with unmap.
    ok(&[c
        .run_one(
            0,
            BlkOp::WriteZeroes {
                offset: MIB,
                len: MIB,
                unmap: false,
            },
        )
        .unwrap()]);
    ok(&[c
        .run_one(
            0,
            BlkOp::WriteZeroes {
                offset: 2 * MIB,
                len: MIB,
                unmap: true,
            },
        )
        .unwrap()]);
    ok(&[c.run_one(0, BlkOp::Flush).unwrap()]);

    ok(&[c
        .run_one(
            0,
            BlkOp::Read {
                offset: 0,
                buf: 0,
                len: (4 * MIB) as usize,
            },
        )
        .unwrap()]);
    let buf = &c.buffer()[..(4 * MIB) as usize];
    assert!(
        buf[..(3 * MIB) as usize].iter().all(|&b| b == 0),
        "discarded/zeroed range is not zero"
    );
    assert!(
        buf[(3 * MIB) as usize..].iter().all(|&b| b == 0xa5),
        "data outside the ranges changed"
    );
    let file = fs::read(s.image("disk0")).unwrap();
    assert!(file[..(3 * MIB) as usize].iter().all(|&b| b == 0));
    assert!(file[(3 * MIB) as usize..(4 * MIB) as usize]
        .iter()
        .all(|&b| b == 0xa5));
    let blocks_after = fs::metadata(s.image("disk0")).unwrap().blocks();
    assert!(
        blocks_after < blocks_before,
        "discard did not deallocate: {blocks_before} -> {blocks_after} blocks"
    );
}

#[test]
fn a_read_only_device_refuses_writes() {
    let s = setup(&[("ro0", 4 * MIB, ",ro")]);
    fs::write(s.image("ro0"), vec![0x5a; (4 * MIB) as usize]).unwrap();
    let sock = s.dir.path().join("ro0.sock");
    let a = s.borrower.attach(&s.lender.addr, "ro0", &sock, 1).unwrap();
    assert_eq!(a["read_only"], true);
    // libblkio refuses a read-write start on a device that offers VIRTIO_BLK_F_RO.
    let rw = BlkClient::connect(&sock, 1, 1 << 20);
    assert!(
        rw.is_err(),
        "read-write start on a read-only device succeeded"
    );
    drop(rw);
    let mut c = BlkClient::connect_with(&sock, 1, 1 << 20, true).unwrap();
    assert!(c.read_only(), "VIRTIO_BLK_F_RO is not offered");
    c.buffer()[..4096].fill(1);
    let w = c
        .run_one(
            0,
            BlkOp::Write {
                offset: 0,
                buf: 0,
                len: 4096,
            },
        )
        .unwrap();
    assert!(w < 0, "a write to a read-only device succeeded");
    ok(&[c
        .run_one(
            0,
            BlkOp::Read {
                offset: 0,
                buf: 0,
                len: 4096,
            },
        )
        .unwrap()]);
    assert!(c.buffer()[..4096].iter().all(|&b| b == 0x5a));
    assert!(
        fs::read(s.image("ro0")).unwrap().iter().all(|&b| b == 0x5a),
        "the file changed"
    );
}

#[test]
fn two_queues_carry_io_at_once() {
    let s = setup(&[("mq0", 32 * MIB, "")]);
    let (_sock, mut c) = s.attach("mq0", 2);
    assert_eq!(c.num_queues(), 2);
    for (i, b) in c.buffer()[..(2 * MIB) as usize]
        .chunks_mut(MIB as usize)
        .enumerate()
    {
        b.fill(0x10 + i as u8);
    }
    // Each queue writes 16 x 64 KiB to its own half, all in flight together.
    let q0: Vec<BlkOp> = (0..16)
        .map(|i| BlkOp::Write {
            offset: i * 65536,
            buf: 0,
            len: 65536,
        })
        .collect();
    let q1: Vec<BlkOp> = (0..16)
        .map(|i| BlkOp::Write {
            offset: 16 * MIB + i * 65536,
            buf: MIB as usize,
            len: 65536,
        })
        .collect();
    for r in c.run_multi(&[(0, &q0), (1, &q1)]).unwrap() {
        ok(&r);
    }
    // Read across: queue 1 reads what queue 0 wrote and the other way round.
    let r = c
        .run_multi(&[
            (
                1,
                &[BlkOp::Read {
                    offset: 0,
                    buf: 2 * MIB as usize,
                    len: MIB as usize,
                }],
            ),
            (
                0,
                &[BlkOp::Read {
                    offset: 16 * MIB,
                    buf: 3 * MIB as usize,
                    len: MIB as usize,
                }],
            ),
        ])
        .unwrap();
    r.iter().for_each(|r| ok(r));
    assert!(c.buffer()[(2 * MIB) as usize..(3 * MIB) as usize]
        .iter()
        .all(|&b| b == 0x10));
    assert!(c.buffer()[(3 * MIB) as usize..(4 * MIB) as usize]
        .iter()
        .all(|&b| b == 0x11));
    // The agent samples counters every second: the recent rates show the I/O.
    std::thread::sleep(std::time::Duration::from_millis(2200));
    let status = s.borrower.cli_json(&["status"]).unwrap();
    assert_eq!(status[0]["queues"], 2);
    assert_eq!(status[0]["counters"]["writes"], 32);
    let rates = &status[0]["rates"];
    assert!(rates["iops"].as_f64().unwrap() > 0.0, "{status}");
    assert!(rates["write_mb_s"].as_f64().unwrap() > 0.0, "{status}");
    assert!(rates["p99_us"].as_u64().is_some(), "{status}");
    let table = String::from_utf8_lossy(&s.borrower.cli(&["status"]).unwrap().stdout).into_owned();
    assert!(
        table.contains("IOPS") && table.contains("P99") && table.contains("tcp"),
        "{table}"
    );
}

#[test]
fn out_of_range_io_fails_and_the_rest_goes_on() {
    let s = setup(&[("disk0", 4 * MIB, "")]);
    let (_sock, mut c) = s.attach("disk0", 1);
    let r = c
        .run_one(
            0,
            BlkOp::Read {
                offset: 4 * MIB - 512,
                buf: 0,
                len: 1024,
            },
        )
        .unwrap();
    assert!(r < 0, "a read past the end succeeded");
    ok(&[c
        .run_one(
            0,
            BlkOp::Read {
                offset: 4 * MIB - 512,
                buf: 0,
                len: 512,
            },
        )
        .unwrap()]);
}

#[test]
fn cli_attach_prints_qemu_and_libvirt_and_detach_removes_the_socket() {
    let s = setup(&[
        ("disk0", 8 * MIB, ",serial=SN-CLI-01"),
        ("disk1", 8 * MIB, ""),
    ]);
    let sock = s.dir.path().join("cli.sock");
    let out = s
        .borrower
        .cli(&[
            "attach",
            "--lender",
            &s.lender.addr,
            "--device",
            "disk0",
            "--socket",
            sock.to_str().unwrap(),
            "--queues",
            "2",
            "--id",
            "vm1-disk",
        ])
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "attach failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!(
            "-chardev socket,id=devlend-vm1-disk,path={}",
            sock.display()
        )),
        "{text}"
    );
    assert!(
        text.contains("-device vhost-user-blk-pci,chardev=devlend-vm1-disk,num-queues=2"),
        "{text}"
    );
    assert!(
        text.contains("<disk type='vhostuser' device='disk'>"),
        "{text}"
    );
    assert!(
        text.contains(&format!("<source type='unix' path='{}'>", sock.display())),
        "{text}"
    );
    assert!(text.contains("SN-CLI-01"), "{text}");
    // libvirt 9.0 refuses a <serial> inside <disk type='vhostuser'> ("serial is not
    // supported with vhostuser disk"); the guest gets the serial from devlend itself.
    assert!(!text.contains("<serial>"), "{text}");
    assert!(sock.exists());
    use std::os::unix::fs::PermissionsExt;
    let mode = fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode, 0o660,
        "the vhost-user socket must be owner+group only"
    );

    // The same id or socket again is refused with a clear message.
    let again = s
        .borrower
        .cli(&[
            "attach",
            "--lender",
            &s.lender.addr,
            "--device",
            "disk0",
            "--socket",
            sock.to_str().unwrap(),
        ])
        .unwrap();
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("already used"),
        "{again:?}"
    );

    // An unknown device and an unreachable lender are refused, naming the cause.
    let bad = s
        .borrower
        .cli(&[
            "attach",
            "--lender",
            &s.lender.addr,
            "--device",
            "nope",
            "--socket",
            "/tmp/devlend-nope.sock",
        ])
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("nope"),
        "{bad:?}"
    );
    assert!(!Path::new("/tmp/devlend-nope.sock").exists());
    let port = devlend_tests::agents::free_port().unwrap();
    let lender = format!("127.0.0.1:{port}");
    let dead = s
        .borrower
        .cli(&[
            "attach",
            "--lender",
            &lender,
            "--device",
            "disk0",
            "--socket",
            "/tmp/devlend-dead.sock",
        ])
        .unwrap();
    assert!(!dead.status.success());
    assert!(
        String::from_utf8_lossy(&dead.stderr).contains(&lender),
        "{dead:?}"
    );

    // Cloud Hypervisor's argument, for a VM started with the disk.
    let ch_sock = s.dir.path().join("ch.sock");
    let out = s
        .borrower
        .cli(&[
            "attach",
            "--lender",
            &s.lender.addr,
            "--device",
            "disk1",
            "--socket",
            ch_sock.to_str().unwrap(),
            "--vmm",
            "cloud-hypervisor",
        ])
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("--memory size=<guest RAM>,shared=on"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "--disk vhost_user=true,socket={}",
            ch_sock.display()
        )),
        "{text}"
    );
    s.borrower.cli_json(&["detach", "disk1"]).unwrap();

    // Status lists it; detach by socket path removes it.
    let status = String::from_utf8_lossy(&s.borrower.cli(&["status"]).unwrap().stdout).into_owned();
    assert!(
        status.contains("vm1-disk") && status.contains("disk0"),
        "{status}"
    );
    let d = s
        .borrower
        .cli_json(&["detach", sock.to_str().unwrap()])
        .unwrap();
    assert_eq!(d["id"], "vm1-disk");
    assert!(!sock.exists(), "socket still there after detach");
    assert_eq!(
        s.borrower.cli_json(&["status"]).unwrap(),
        serde_json::json!([])
    );
}

#[test]
fn a_device_is_lent_to_one_borrower_at_a_time() {
    let s = setup(&[("disk0", 8 * MIB, "")]);
    let first = s.dir.path().join("first.sock");
    s.borrower
        .attach(&s.lender.addr, "disk0", &first, 1)
        .unwrap();
    // A second borrower (another compute agent) is refused while the first holds it.
    let other_dir = tempfile::tempdir().unwrap();
    let other = Borrower::start(other_dir.path()).unwrap();
    let second = other_dir.path().join("second.sock");
    let out = other
        .cli(&[
            "attach",
            "--lender",
            &s.lender.addr,
            "--device",
            "disk0",
            "--socket",
            second.to_str().unwrap(),
        ])
        .unwrap();
    assert!(!out.status.success(), "a second borrower got the device");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("attached by another borrower"), "{err}");
    assert!(!second.exists(), "a refused attach left its socket behind");
    // So is a second attachment on the same compute agent.
    let again = s.dir.path().join("again.sock");
    let out = s
        .borrower
        .cli(&[
            "attach",
            "--lender",
            &s.lender.addr,
            "--device",
            "disk0",
            "--socket",
            again.to_str().unwrap(),
        ])
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already attached here as"), "{err}");
    // Once the first detaches, the device can be attached again.
    s.borrower
        .cli_json(&["detach", first.to_str().unwrap()])
        .unwrap();
    other.attach(&s.lender.addr, "disk0", &second, 1).unwrap();
    let mut c = BlkClient::connect(&second, 1, MIB as usize).unwrap();
    ok(&[c
        .run_one(
            0,
            BlkOp::Read {
                offset: 0,
                buf: 0,
                len: 4096,
            },
        )
        .unwrap()]);
}

#[test]
fn socket_paths_never_destroy_files() {
    let s = setup(&[("disk0", 4 * MIB, "")]);
    let img = s.image("disk0");
    // The lent image itself, the agent's own API socket, a directory: all refused.
    for (target, why) in [
        (img.clone(), "not a socket"),
        (s.borrower.api.clone(), "live socket"),
        (s.dir.path().to_owned(), "not a socket"),
    ] {
        let out = s
            .borrower
            .cli(&[
                "attach",
                "--lender",
                &s.lender.addr,
                "--device",
                "disk0",
                "--socket",
                target.to_str().unwrap(),
            ])
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(why),
            "{}: {err}",
            target.display()
        );
    }
    assert_eq!(
        std::fs::metadata(&img).unwrap().len(),
        4 * MIB,
        "the image was touched"
    );
    assert!(
        s.borrower.cli_json(&["status"]).is_ok(),
        "the API socket was replaced"
    );
    // A second compute agent on the same API socket is refused; one on a regular file too.
    for api in [s.borrower.api.clone(), img.clone()] {
        let out = std::process::Command::new(
            devlend_tests::agents::bin("devlend-compute-agent").unwrap(),
        )
        .arg("--api")
        .arg(&api)
        .output()
        .unwrap();
        assert!(
            !out.status.success(),
            "a second agent took {}",
            api.display()
        );
    }
    assert!(s.borrower.cli_json(&["status"]).is_ok());
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 4 * MIB);
    // A stale socket (nobody listening) is replaced; relative paths work for detach.
    let stale = s.dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let out = std::process::Command::new(devlend_tests::agents::bin("devlend").unwrap())
        .current_dir(s.dir.path())
        .args([
            "--api",
            s.borrower.api.to_str().unwrap(),
            "attach",
            "--lender",
            &s.lender.addr,
            "--device",
            "disk0",
        ])
        .args(["--socket", "stale.sock"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = std::process::Command::new(devlend_tests::agents::bin("devlend").unwrap())
        .current_dir(s.dir.path())
        .args([
            "--api",
            s.borrower.api.to_str().unwrap(),
            "detach",
            "./stale.sock",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stale.exists());
}

#[test]
fn a_lender_restart_keeps_the_device_with_its_borrower() {
    let mut s = setup(&[("disk0", 8 * MIB, "")]);
    let (sock, mut c) = s.attach("disk0", 1);
    ok(&[c
        .run_one(
            0,
            BlkOp::Write {
                offset: 0,
                buf: 0,
                len: 4096,
            },
        )
        .unwrap()]);
    // Restart the lender in place.
    let spec = format!("disk0={}", s.image("disk0").display());
    s.lender
        .proc
        .terminate(std::time::Duration::from_secs(10))
        .unwrap();
    s.lender = Lender::start_on(s.dir.path(), &s.lender.addr.clone(), &[spec]).unwrap();
    // The borrower's holding session comes back: the device is its own again.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match devlend_fabric::tcp::connect(
            &s.lender.addr,
            "disk0",
            0,
            std::time::Duration::from_secs(2),
        ) {
            Err(devlend_fabric::tcp::ConnectError::Refused {
                status: devlend_fabric::HelloStatus::Busy,
                ..
            }) => break,
            _ => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the holding session was not re-established"
                );
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
    // Another borrower is refused; the first one's I/O goes on.
    let other_dir = tempfile::tempdir().unwrap();
    let other = Borrower::start(other_dir.path()).unwrap();
    let other_sock = other_dir.path().join("b.sock");
    let out = other
        .cli(&[
            "attach",
            "--lender",
            &s.lender.addr,
            "--device",
            "disk0",
            "--socket",
            other_sock.to_str().unwrap(),
        ])
        .unwrap();
    assert!(
        !out.status.success(),
        "a second borrower took the device after a lender restart"
    );
    // The first request after the restart may fail (the session was lost); the next works.
    let _ = c.run_one(
        0,
        BlkOp::Read {
            offset: 0,
            buf: 0,
            len: 4096,
        },
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    ok(&[c
        .run_one(
            0,
            BlkOp::Read {
                offset: 0,
                buf: 0,
                len: 4096,
            },
        )
        .unwrap()]);
    let status = s.borrower.cli_json(&["status"]).unwrap();
    assert!(
        status[0]["counters"]["reconnects"].as_u64().unwrap() >= 1,
        "{status}"
    );
    drop(c);
    let _ = sock;
}
