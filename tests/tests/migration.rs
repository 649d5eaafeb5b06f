//! Live migration of a running TCG guest with a lent disk between two compute hosts
//! (network namespaces A and B joined by a veth link), A→B→A→B, each time to a new
//! destination QEMU started with `-incoming`, while the guest's own virtio-blk driver
//! writes a fresh chunk with O_DIRECT, reads it back and compares, printing a line per
//! I/O: no I/O fails, every chunk verifies at the end, and the longest pause in the
//! workload across each switch-over is measured (host time between two I/O lines) and
//! printed.
//!
//! The disk is lent by a lender in a third namespace, in direct mode with a key per
//! compute host ([`devlend_tests::migration_lab::Lab`]); the source agent hands the
//! device over (`devlend migrate handover`), the destination's agent takes it
//! (`migrate prepare`), the source lets go (`migrate finish`). The disk has two queues
//! and the guest one vCPU, so its driver starts only the first (QEMU stops only that
//! one): the device must still be let go when QEMU stops the VM. The first migration's
//! `finish` comes late, past the attachments' short reconnect deadline, and the
//! destination's guest must do I/O before it (issue 40: the never-started queue's
//! session kept the device on the source until `finish`, and the guest's requests
//! failed after the deadline). QEMU runs with the arguments `devlend` prints, the
//! destination with those of `migrate prepare`. The same run measures
//! the baseline beside it, QEMU's own local `file` disk (`cache=none`, the same image
//! for every QEMU: shared storage). Then the handover is refused to anyone else, and a
//! cancelled migration leaves the guest and its disk working on the source.
//!
//! The NIC's migration is in `migration_net.rs`. Guest tests of this file run one at a
//! time (a lock): the pauses are measured on a machine of 2 cores.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use devlend_tests::agents::sparse_file;
use devlend_tests::guest::Guest;
use devlend_tests::migration::{
    self, cancel_migration, ms, qmp, query_migrate, run_state, set_bandwidth, start_migration,
    wait_migration, Chain, Params, CHUNK_BYTES,
};
use devlend_tests::migration_lab::{
    attachment_id, forge, label, ok_json, printed_device_args, to_host, Hosts, Lab,
};
use devlend_tests::sha256_hex;

mod migration_common;

use migration_common::{
    io_before_late_finish, migrate_chain, wait_workload, Run, CHUNKS, DISK_BYTES, LATE_FINISH,
    MEMORY_MIB, MIGRATIONS, MIGRATION_TIMEOUT, ONE_AT_A_TIME, RECONNECT_DEADLINE_S, WORKLOAD_SECS,
};

/// The baseline: QEMU's own `file` disk, the same image for every QEMU.
fn file_disk_run(dir: &Path, hosts: &Hosts) -> Result<Run> {
    let img = dir.join("file-disk.img");
    sparse_file(&img, DISK_BYTES)?;
    let guest = Guest::builder()
        .name("mig-file-A")
        .memory_mib(MEMORY_MIB)
        .netns(hosts.a.name.clone())
        .script(migration::workload_script(WORKLOAD_SECS, CHUNKS))
        .args([
            "-drive".to_string(),
            format!("file={},format=raw,if=none,id=d0,cache=none", img.display()),
            "-device".into(),
            "virtio-blk-pci,drive=d0,id=disk0".into(),
        ])
        .boot()?;
    let mut chain = Chain::new(guest);
    let (run, outcome, _) = migrate_chain(
        "file",
        &mut chain,
        hosts,
        |k, src, ns, uri| {
            src.incoming(uri)
                .name(format!("mig-file-{}", label(k)))
                .netns(ns)
                .start()
        },
        |_, _| Ok(()),
    )?;
    let file = std::fs::read(&img)?;
    let region = (u64::from(CHUNKS) * CHUNK_BYTES) as usize;
    assert_eq!(
        outcome.result("region_sha256"),
        Some(sha256_hex(&file[..region]).as_str()),
        "the image does not hold what the guest wrote"
    );
    Ok(run)
}

// ---------------------------------------------------------------------------------
// devlend: a lent disk, handed over between the compute agents of A and B.

/// The lab of this file: the lender serves `disk0` (the workload's) and `disk1` (for a
/// token of the wrong device), sparse images in `dir`.
fn start_lab(dir: &Path, n: u8, k: u8) -> Result<Lab> {
    Lab::start(dir, n, k, |_| {
        let mut devices = Vec::new();
        for (name, file) in [("disk0", "lent.img"), ("disk1", "other.img")] {
            let image = dir.join(file);
            sparse_file(&image, DISK_BYTES)?;
            devices.push(format!("{name}={}", image.display()));
        }
        Ok(devices)
    })
}

/// Attaches disk0 on A and boots the workload guest there: the attachment id, its
/// socket and the guest.
fn boot_on_a(lab: &Lab, name: &str, secs: u32) -> Result<(String, PathBuf, Guest)> {
    let sock = lab.a.socket("boot");
    let id = attachment_id(&lab.a.attach("disk0", &sock)?)?;
    let guest = Guest::builder()
        .name(name)
        .memory_mib(MEMORY_MIB)
        .netns(lab.hosts.a.name.clone())
        .script(migration::workload_script(secs, CHUNKS))
        .vhost_user_blk_with(&sock, Some(1000))
        .boot()?;
    Ok((id, sock, guest))
}

/// The lender's image (`lent.img` in `dir`), the workload's region.
fn region_sha256(dir: &Path) -> Result<String> {
    let file = std::fs::read(dir.join("lent.img"))?;
    Ok(sha256_hex(
        &file[..(u64::from(CHUNKS) * CHUNK_BYTES) as usize],
    ))
}

/// The options of the lent run's attachments, source and destination alike: two
/// queues (the guest, with one vCPU, starts one) and a short reconnect deadline.
fn two_queues() -> [String; 4] {
    [
        "--queues".into(),
        "2".into(),
        "--reconnect-deadline".into(),
        RECONNECT_DEADLINE_S.to_string(),
    ]
}

/// A→B→A→B with the lent disk (images in `dir`), two queues, the first `finish` late;
/// returns the run's pauses.
fn lent_disk_run(lab: &Lab, dir: &Path) -> Result<Run> {
    let opts = two_queues();
    let opts: Vec<&str> = opts.iter().map(String::as_str).collect();
    let first_sock = lab.a.socket("boot");
    let v = lab.a.attach_with("disk0", &first_sock, &opts)?;
    let first_id = attachment_id(&v)?;
    let info: devlend_compute_agent::api::AttachmentInfo = serde_json::from_value(v)?;
    let printed = devlend_cli::output::qemu_args(&info);
    ensure!(
        printed.contains("num-queues=2") && printed.contains(&format!(",id=devlend-{first_id}")),
        "the printed QEMU arguments: {printed}"
    );
    // One vCPU (the default): the guest's driver starts one of the two queues. The
    // workload spans the late finish too.
    let guest = Guest::builder()
        .name("mig-lent-A")
        .memory_mib(MEMORY_MIB)
        .netns(lab.hosts.a.name.clone())
        .script(migration::workload_script(
            WORKLOAD_SECS + LATE_FINISH.as_secs() as u32,
            CHUNKS,
        ))
        .args(printed_device_args(&printed)?)
        .boot()?;
    // The attachment each host holds now.
    let ids = std::cell::RefCell::new(vec![first_id]);
    let mut chain = Chain::new(guest);
    let (run, outcome, _) = migrate_chain(
        "devlend",
        &mut chain,
        &lab.hosts,
        |k, src, ns, uri| {
            let from = k % 2;
            let to = lab.host(to_host(k));
            let src_id = ids.borrow().last().cloned().context("no attachment")?;
            let token = lab.handover(from, &src_id)?;
            let sock = to.socket(&format!("m{k}"));
            let v = ok_json(
                &lab.prepare_with(to, &token, "disk0", &sock, &opts)?,
                &format!("migrate prepare on {}", to.name),
            )?;
            let dst_id = attachment_id(&v)?;
            let args = v["qemu_args"].as_str().context("no qemu_args")?;
            ensure!(
                args.contains(&sock.display().to_string()) && args.contains("-incoming"),
                "qemu_args of migrate prepare: {v}"
            );
            ids.borrow_mut().push(dst_id);
            // The destination with the arguments `migrate prepare` printed: the same
            // device ids as the source's (the same attachment id).
            src.incoming(uri)
                .name(format!("mig-lent-{}", label(k)))
                .netns(ns)
                .device_args(printed_device_args(args)?)
                .start()
        },
        |k, chain| {
            let from = lab.host(k % 2);
            let to = lab.host(to_host(k));
            if k == 0 {
                io_before_late_finish("devlend", chain)?;
            }
            let all = ids.borrow();
            let src_id = &all[all.len() - 2];
            let dst_id = &all[all.len() - 1];
            from.json(&["migrate", "finish", src_id])?;
            let left = from.attachment_ids()?;
            ensure!(
                !left.contains(src_id),
                "{}: attachment {src_id} still listed after migrate finish: {left:?}",
                from.name
            );
            let there = to.attachment_ids()?;
            ensure!(
                there.contains(dst_id),
                "{}: the incoming attachment {dst_id} is not listed: {there:?}",
                to.name
            );
            Ok(())
        },
    )?;
    assert_eq!(
        outcome.result("region_sha256"),
        Some(region_sha256(dir)?.as_str()),
        "the lender's file does not hold what the guest wrote"
    );
    let final_id = ids.borrow().last().cloned().context("no attachment")?;
    let last = lab.host(to_host(MIGRATIONS - 1));
    last.json(&["detach", &final_id])?;
    Ok(run)
}

/// (a) and (d): A→B→A→B with a lent disk, and the baseline in the same run, pauses
/// printed side by side.
#[test]
fn a_lent_disk_guest_migrates_three_times_beside_the_baseline() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir()?;
    let lab = start_lab(dir.path(), 10, 10)?;
    let lent = lent_disk_run(&lab, dir.path()).with_context(|| lab.logs())?;
    let baseline = file_disk_run(dir.path(), &lab.hosts)?;
    baseline.print();
    lent.print();
    println!(
        "longest guest-visible pause: devlend {} ms, QEMU file disk {} ms",
        ms(lent.longest()),
        ms(baseline.longest())
    );
    Ok(())
}

/// (b) and (c): during a handover nobody else gets the device (another trusted compute
/// agent attaching it, a token for another device, a forged token); a migration
/// cancelled halfway leaves the guest working on the source with its disk, the
/// destination's attachment is removed, and a migration after that goes through.
#[test]
fn a_handover_is_refused_to_others_and_a_cancelled_migration_keeps_the_disk() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir()?;
    let lab = start_lab(dir.path(), 20, 20)?;
    let (a_id, a_sock, guest) = boot_on_a(&lab, "mig-cancel-A", WORKLOAD_SECS)?;
    let mut chain = Chain::new(guest);
    wait_workload(&chain)?;

    // The handover, and B's incoming attachment. One token per handover: a second
    // request while this one is pending is refused.
    let token = lab.handover(0, &a_id)?;
    let again = lab.a.try_cli(&["migrate", "handover", &a_id])?;
    ensure!(
        !again.status.success()
            && String::from_utf8_lossy(&again.stderr).contains("being handed over already"),
        "a second handover token while one is pending: {}",
        String::from_utf8_lossy(&again.stdout)
    );
    let b_sock = lab.b.socket("m0");
    let v = ok_json(
        &lab.prepare(&lab.b, &token, "disk0", &b_sock)?,
        "migrate prepare on b",
    )?;
    let b_id = attachment_id(&v)?;

    // (b) C, whose key the lender trusts, gets nothing of it meanwhile.
    let c_sock = lab.c.socket("x");
    let s = c_sock.display().to_string();
    let out = lab.c.try_cli(&[
        "attach",
        "--lender",
        &lab.c.lender,
        "--device",
        "disk0",
        "--socket",
        &s,
    ])?;
    ensure!(
        !out.status.success(),
        "C attached the device during the handover"
    );
    eprintln!(
        "C's attach refused: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let out = lab.prepare(&lab.c, &token, "disk1", &c_sock)?;
    ensure!(
        !out.status.success(),
        "migrate prepare took disk1 with disk0's token"
    );
    eprintln!(
        "prepare for another device refused: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let forged = forge(&token);
    let out = lab.prepare(&lab.c, &forged, "disk0", &c_sock)?;
    ensure!(!out.status.success(), "migrate prepare took a forged token");
    eprintln!(
        "forged token refused: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    // The real token, replayed by C (whose key the lender trusts) while B stands by:
    // it names B's key, which C cannot prove (issue 39; before, C was taken as the
    // destination and both were served).
    let out = lab.prepare(&lab.c, &token, "disk0", &c_sock)?;
    ensure!(
        !out.status.success(),
        "migrate prepare on C took the device with B's handover token"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        err.contains("possession"),
        "C's replay refused for another reason: {err}"
    );
    eprintln!("replayed handover token refused: {}", err.trim());
    ensure!(!c_sock.exists(), "a refused attach left its socket");
    ensure!(
        lab.c.attachment_ids()?.is_empty(),
        "C lists attachments after refusals"
    );

    // (c) A migration slowed down so that it cannot finish, cancelled halfway.
    let (ns, uri) = lab.hosts.dest(1, 0);
    let dest = chain
        .current
        .incoming(&uri)
        .name("mig-cancel-A>B")
        .netns(ns)
        .replace_in_args(&a_sock.display().to_string(), &b_sock.display().to_string())
        .start()?;
    let mut dq = qmp(&dest, Duration::from_secs(20))?;
    migration::wait_state(&mut dq, "inmigrate", Duration::from_secs(20))?;
    let mut sq = qmp(&chain.current, Duration::from_secs(5))?;
    start_migration(
        &mut sq,
        &uri,
        Params {
            max_bandwidth: 4 << 20,
            ..Params::default()
        },
    )?;
    std::thread::sleep(Duration::from_secs(2));
    let during = query_migrate(&mut sq)?;
    ensure!(
        during["status"] == "active",
        "the slowed migration is not active after 2 s: {during}"
    );
    let cancelled_at = Instant::now();
    cancel_migration(&mut sq)?;
    let info = wait_migration(&mut sq, Duration::from_secs(30))?;
    ensure!(
        info.status == "cancelled",
        "after migrate_cancel: {:?}",
        info.raw
    );
    ensure!(run_state(&mut sq)? == "running", "the source does not run");
    set_bandwidth(&mut sq, Params::default().max_bandwidth)?;
    drop(sq);
    drop(dq);
    drop(dest);
    lab.a.json(&["migrate", "cancel", &a_id])?;
    lab.b.json(&["detach", &b_id])?;
    ensure!(
        lab.b.attachment_ids()?.is_empty(),
        "B keeps its incoming attachment"
    );
    ensure!(
        lab.a.attachment_ids()? == vec![a_id.clone()],
        "A lost its attachment"
    );
    // The workload goes on on the source.
    let seen = chain.lines().len();
    let end = Instant::now() + Duration::from_secs(20);
    while chain.lines()[seen..]
        .iter()
        .filter(|l| l.text.contains("DLIO r "))
        .count()
        < 5
    {
        ensure!(
            Instant::now() < end,
            "no I/O on the source after the cancel:\n{}",
            chain.console()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "the guest went on after the cancel ({} ms to 5 reads)",
        ms(cancelled_at.elapsed())
    );

    // And the next migration goes through.
    let token = lab.handover(0, &a_id)?;
    let b_sock2 = lab.b.socket("m1");
    let v = ok_json(
        &lab.prepare(&lab.b, &token, "disk0", &b_sock2)?,
        "second migrate prepare on b",
    )?;
    let b_id = attachment_id(&v)?;
    let (ns, uri) = lab.hosts.dest(1, 1);
    let dest = chain
        .current
        .incoming(&uri)
        .name("mig-cancel-A>B-2")
        .netns(ns)
        .replace_in_args(
            &a_sock.display().to_string(),
            &b_sock2.display().to_string(),
        )
        .start()?;
    chain.migrate("A>B", dest, &uri, Params::default(), MIGRATION_TIMEOUT)?;
    lab.a.json(&["migrate", "finish", &a_id])?;
    ensure!(lab.a.attachment_ids()?.is_empty(), "A keeps its attachment");
    let outcome = chain.current.wait_done(Duration::from_secs(240))?;
    outcome.check_success()?;
    let (_, errors) = migration::ticks(&chain.lines())?;
    ensure!(errors.is_empty(), "the guest saw I/O errors: {errors:?}");
    ensure!(outcome.result("errors") == Some("0"), "{}", chain.console());
    ensure!(
        outcome.result("verified") == Some(&CHUNKS.to_string()),
        "{}",
        chain.console()
    );
    assert_eq!(
        outcome.result("region_sha256"),
        Some(region_sha256(dir.path())?.as_str())
    );
    lab.b.json(&["detach", &b_id])?;
    Ok(())
}
