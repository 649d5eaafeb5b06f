//! Live attach and detach into a running QEMU guest through QMP (one TCG guest, 2 vCPUs,
//! for the whole file): the guest sees the disk appear with the right size and serial,
//! does I/O verified from both sides on both virtqueues, sees it go on detach, and a
//! second attach of the same device works. Refusals leave no half-made state.

use std::fs;
use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use devlend_tests::agents::{sparse_file, Borrower, Lender};
use devlend_tests::guest::Guest;
use devlend_tests::sha256_hex;
use serde_json::Value;

const MIB: usize = 1 << 20;
const DISK_BYTES: u64 = 32 << 20;
const SERIAL: &str = "HOTPLUG-SN-7";
const STEP: Duration = Duration::from_secs(120);

const SCRIPT: &str = r#"
set -e
# First attach.
devlend-wait-for /dev/vda 300
echo "DEVLEND-RESULT size1=$(cat /sys/block/vda/size)"
echo "DEVLEND-RESULT serial1=$(cat /sys/block/vda/serial)"
echo "DEVLEND-RESULT hwqueues=$(ls /sys/block/vda/mq | wc -l)"
echo "DEVLEND-RESULT head1=$(dd if=/dev/vda bs=1M count=1 2>/dev/null | sha256sum | cut -d' ' -f1)"
dd if=/dev/urandom of=/tmp/a bs=1M count=1 2>/dev/null
dd if=/dev/urandom of=/tmp/b bs=1M count=1 2>/dev/null
# One writer pinned to each vCPU: each CPU's requests go to its own virtqueue.
taskset 0x1 dd if=/tmp/a of=/dev/vda bs=64k seek=32 conv=fsync 2>/dev/null &
taskset 0x2 dd if=/tmp/b of=/dev/vda bs=64k seek=64 conv=fsync 2>/dev/null &
wait
echo "DEVLEND-RESULT a=$(sha256sum /tmp/a | cut -d' ' -f1)"
echo "DEVLEND-RESULT b=$(sha256sum /tmp/b | cut -d' ' -f1)"
echo "DEVLEND-PHASE io-done"
i=0
while [ -e /sys/block/vda ]; do sleep 0.1; i=$((i+1)); [ $i -lt 3000 ] || exit 3; done
echo "DEVLEND-PHASE gone"
# Second attach of the same device.
devlend-wait-for /dev/vda 300
echo "DEVLEND-RESULT head2=$(dd if=/dev/vda bs=1M skip=8 count=1 2>/dev/null | sha256sum | cut -d' ' -f1)"
echo "DEVLEND-PHASE io2-done"
i=0
while [ -e /sys/block/vda ]; do sleep 0.1; i=$((i+1)); [ $i -lt 3000 ] || exit 4; done
echo "DEVLEND-PHASE gone2"
"#;

fn attach_live(
    b: &Borrower,
    lender: &str,
    sock: &Path,
    qmp: &Path,
    id: &str,
) -> Result<std::process::Output> {
    b.cli(&[
        "attach",
        "--lender",
        lender,
        "--device",
        "disk0",
        "--socket",
        sock.to_str().context("utf8")?,
        "--queues",
        "2",
        "--qmp",
        qmp.to_str().context("utf8")?,
        "--id",
        id,
    ])
}

fn err_text(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn live_attach_io_detach_and_reattach() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let img = dir.path().join("disk0.img");
    sparse_file(&img, DISK_BYTES)?;
    let head: Vec<u8> = (0..MIB).map(|i| (i * 13 % 256) as u8).collect();
    let mut f = fs::read(&img)?;
    f[..MIB].copy_from_slice(&head);
    f[8 * MIB..9 * MIB].copy_from_slice(&head);
    fs::write(&img, &f)?;
    let mut devices = vec![format!("disk0={},serial={SERIAL}", img.display())];
    for d in ["disk1", "disk2"] {
        let p = dir.path().join(format!("{d}.img"));
        sparse_file(&p, 4 << 20)?;
        devices.push(format!("{d}={}", p.display()));
    }
    let lender = Lender::start(dir.path(), &devices)?;
    let borrower = Borrower::start(dir.path())?;

    let mut guest = Guest::builder()
        .name("hotplug")
        .vcpus(2)
        .root_ports(2)
        .script(SCRIPT)
        .boot()?;
    let qmp = guest.qmp_socket().to_owned();
    guest.wait_for_line(|l| l.contains("DEVLEND-WAIT path=/dev/vda"), STEP)?;

    // Clear errors that leave nothing behind: a QMP socket that does not exist.
    let sock = dir.path().join("disk0.sock");
    let bad = attach_live(
        &borrower,
        &lender.addr,
        &sock,
        &dir.path().join("no-qmp.sock"),
        "vdisk",
    )?;
    ensure!(
        !bad.status.success(),
        "attach with a dead QMP socket succeeded"
    );
    ensure!(err_text(&bad).contains("QMP socket"), "{}", err_text(&bad));
    ensure!(!sock.exists(), "a failed attach left its socket");
    ensure!(
        borrower.cli_json(&["status"])? == serde_json::json!([]),
        "a failed attach left an attachment"
    );
    // An id already used by a device of the VM (a root port's id).
    let taken = attach_live(&borrower, &lender.addr, &sock, &qmp, "rp1")?;
    ensure!(
        !taken.status.success() && err_text(&taken).contains("already in use"),
        "{}",
        err_text(&taken)
    );
    ensure!(!sock.exists());

    // Attach live.
    let out = attach_live(&borrower, &lender.addr, &sock, &qmp, "vdisk")?;
    ensure!(
        out.status.success(),
        "live attach failed: {}",
        err_text(&out)
    );
    ensure!(String::from_utf8_lossy(&out.stdout).contains("plugged into the running VM"));
    guest.wait_for_line(|l| l.contains("DEVLEND-PHASE io-done"), STEP)?;

    // Attaching the same device elsewhere meanwhile is refused.
    let other = dir.path().join("other.sock");
    let dup = borrower.cli(&[
        "attach",
        "--lender",
        &lender.addr,
        "--device",
        "disk0",
        "--socket",
        other.to_str().context("utf8")?,
    ])?;
    ensure!(
        !dup.status.success() && err_text(&dup).contains("already attached here as"),
        "{}",
        err_text(&dup)
    );

    let status = borrower.cli_json(&["status"])?;
    let per_queue: Vec<u64> = status[0]["counters"]["per_queue"]
        .as_array()
        .context("per_queue")?
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    ensure!(
        per_queue.len() == 2 && per_queue.iter().all(|&n| n > 0),
        "both virtqueues must carry I/O: {status}"
    );
    ensure!(status[0]["vmm"]["device_id"] == "vdisk", "{status}");

    // A second device takes the last free root port; a third finds none, and leaves
    // nothing behind.
    let live = |dev: &str, id: &str| -> Result<std::process::Output> {
        let sock = dir.path().join(format!("{dev}.sock"));
        borrower.cli(&[
            "attach",
            "--lender",
            &lender.addr,
            "--device",
            dev,
            "--socket",
            sock.to_str().context("utf8")?,
            "--qmp",
            qmp.to_str().context("utf8")?,
            "--id",
            id,
        ])
    };
    let one = live("disk1", "vdisk1")?;
    ensure!(
        one.status.success(),
        "second live attach failed: {}",
        err_text(&one)
    );
    let full = live("disk2", "vdisk2")?;
    ensure!(
        !full.status.success()
            && err_text(&full).contains("no free hotplug-capable PCIe root port"),
        "{}",
        err_text(&full)
    );
    ensure!(
        !dir.path().join("disk2.sock").exists(),
        "a refused attach left its socket"
    );
    ensure!(borrower.cli_json(&["status"])?.as_array().map(Vec::len) == Some(2));
    // A guest that does not release the device in time: the attachment stays, served;
    // a later detach finishes the job.
    let slow = borrower.cli(&["detach", "vdisk1", "--timeout", "0"])?;
    ensure!(
        !slow.status.success() && err_text(&slow).contains("did not release"),
        "{}",
        err_text(&slow)
    );
    ensure!(
        borrower.cli_json(&["status"])?.as_array().map(Vec::len) == Some(2),
        "the attachment went away"
    );
    ensure!(dir.path().join("disk1.sock").exists());
    borrower.cli_json(&["detach", "vdisk1"])?;
    ensure!(!dir.path().join("disk1.sock").exists());

    // Detach live: the guest releases it, the socket goes away.
    let d = borrower.cli_json(&["detach", "vdisk"])?;
    ensure!(d["id"] == "vdisk", "{d}");
    ensure!(!sock.exists(), "socket still there after detach");
    guest.wait_for_line(|l| l.contains("DEVLEND-PHASE gone"), STEP)?;

    // A second attach of the same device works.
    let again = attach_live(&borrower, &lender.addr, &sock, &qmp, "vdisk")?;
    ensure!(
        again.status.success(),
        "second attach failed: {}",
        err_text(&again)
    );
    guest.wait_for_line(|l| l.contains("DEVLEND-PHASE io2-done"), STEP)?;
    borrower.cli_json(&["detach", "vdisk"])?;
    let outcome = guest.wait_done(STEP)?;
    outcome.check_success()?;

    let want_size = (DISK_BYTES / 512).to_string();
    ensure!(
        outcome.result("size1") == Some(want_size.as_str()),
        "size: {:?}",
        outcome.result("size1")
    );
    ensure!(outcome.result("serial1") == Some(SERIAL));
    ensure!(
        outcome.result("hwqueues") == Some("2"),
        "hw queues: {:?}",
        outcome.result("hwqueues")
    );
    let h = sha256_hex(&head);
    ensure!(
        outcome.result("head1") == Some(h.as_str()) && outcome.result("head2") == Some(h.as_str())
    );
    let file = fs::read(&img)?;
    ensure!(
        outcome.result("a") == Some(sha256_hex(&file[2 * MIB..3 * MIB]).as_str()),
        "write from CPU 0 not in the file"
    );
    ensure!(
        outcome.result("b") == Some(sha256_hex(&file[4 * MIB..5 * MIB]).as_str()),
        "write from CPU 1 not in the file"
    );
    Ok(())
}
