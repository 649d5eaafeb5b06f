//! The pool is the control plane: its outage must not stop a leased device (issue 42).
//! Real processes: a pool (`devlend pool serve`, SQLite or a private PostgreSQL), a
//! lender registered with it (heartbeat every 500 ms), a compute agent with one disk
//! attached by class under a 3 s lease, and the libblkio frontend doing verified I/O
//! (four 16 KiB writes at QD4, read back and compared) without a pause. Each outage
//! lasts three lease TTLs; the I/O must go on during it with no error, go on after it,
//! and the lease must still be live at the pool after it. The lender and the compute
//! host are cut from the pool in network namespaces (each with its own link to the
//! pool, which is in this namespace, and a direct link between them). A lender 5
//! minutes off the others' clocks runs under libfaketime. The safety tests: a compute
//! host killed for good gives its device to another one, whose newer lease fences the
//! first host's agent when it comes back although the lender could not reach the pool;
//! two pool servers on one PostgreSQL, one killed. One QEMU guest goes through a pool
//! stop, a pool kill and restart and a compute host cut with its O_DIRECT workload.
//!
//! The verified I/O load is in `load.rs`, the rig in `rig.rs`; the scenarios are here.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devlend_cli::blk_client::{BlkClient, BlkOp};
use devlend_pool::api::{LeaseState, Role};
use devlend_pool::PoolClient;
use devlend_tests::agents::{bin, free_port, sparse_file, spawn_in, wait_listening};
use devlend_tests::agents::{Borrower, Pool, Proc};
use devlend_tests::netns::{Netns, NsLink};
use devlend_tests::postgres::Postgres;

const MIB: u64 = 1 << 20;
const DISK: u64 = 64 * MIB;
const PROVIDER: &str = "lender-o";
/// The lease's TTL (s): `devlend attach --lease-ttl`.
const TTL_S: u64 = 3;
/// Every outage lasts three TTLs.
const OUTAGE: Duration = Duration::from_secs(3 * TTL_S);
const HEARTBEAT_MS: u64 = 500;
const LENDER_PORT: u16 = 7700;
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

mod load;
mod rig;
use load::{connect_retry, Load};
use rig::{attach, lender_config, start_lender, start_pool, through, wait_until, Opts, Rig};

// ---- the outages -------------------------------------------------------------------

#[test]
fn the_pool_stopped_for_three_ttls() {
    let r = Rig::new(Opts::default());
    let load = Load::start(&r.sock, 0, 1);
    load.run_for(Duration::from_secs(1), "before");
    r.pool.proc.signal(libc::SIGSTOP);
    through(&r, &load, "pool stopped");
    r.pool.proc.signal(libc::SIGCONT);
    r.after_outage(load, "pool stopped");
}

#[test]
fn the_pool_killed_and_restarted_after_three_ttls() {
    let mut r = Rig::new(Opts::default());
    let load = Load::start(&r.sock, 0, 2);
    load.run_for(Duration::from_secs(1), "before");
    r.kill_pool();
    through(&r, &load, "pool killed");
    r.restart_pool();
    r.after_outage(load, "pool killed and restarted");
}

#[test]
fn postgresql_stopped_under_the_pool_for_three_ttls() {
    let mut r = Rig::new(Opts {
        postgres: true,
        ..Opts::default()
    });
    let load = Load::start(&r.sock, 0, 3);
    load.run_for(Duration::from_secs(1), "before");
    r.pg.as_mut().unwrap().stop(libc::SIGINT).unwrap();
    through(&r, &load, "PostgreSQL stopped");
    r.pg.as_mut().unwrap().start().unwrap();
    r.after_outage(load, "PostgreSQL stopped");
}

#[test]
fn the_lender_cut_from_the_pool_for_three_ttls() {
    let r = Rig::new(Opts {
        netns: Some((0, 0)),
        ..Opts::default()
    });
    let load = Load::start(&r.sock, 0, 4);
    load.run_for(Duration::from_secs(1), "before");
    let net = r.net.as_ref().unwrap();
    net.l.set_link(false).unwrap();
    through(&r, &load, "lender cut from the pool");
    net.l.set_link(true).unwrap();
    r.after_outage(load, "lender cut from the pool");
}

#[test]
fn the_compute_host_cut_from_the_pool_for_three_ttls() {
    let r = Rig::new(Opts {
        netns: Some((2, 1)),
        ..Opts::default()
    });
    let load = Load::start(&r.sock, 0, 5);
    load.run_for(Duration::from_secs(1), "before");
    let net = r.net.as_ref().unwrap();
    net.c.set_link(false).unwrap();
    through(&r, &load, "compute host cut from the pool");
    // The agent shows since when it could not renew (once a renewal timed out: the
    // pool client's 10 s).
    let t = Instant::now();
    loop {
        let s = r.borrower.cli_json(&["status"]).unwrap();
        if s[0]["pool_unreachable_since_ms"].as_u64().unwrap_or(0) > 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "status 3 TTLs + 15 s into the cut: {s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(load.failed.load(Ordering::Relaxed), 0);
    let table = String::from_utf8(r.borrower.cli(&["status"]).unwrap().stdout).unwrap();
    assert!(table.contains("device pool unreachable since"), "{table}");
    net.c.set_link(true).unwrap();
    r.after_outage(load, "compute host cut from the pool");
    // Cleared by the first renewal that gets through (every third of the TTL, or once
    // a renewal sent into the cut times out: the pool client's 10 s).
    let t = Instant::now();
    loop {
        let s = r.borrower.cli_json(&["status"]).unwrap();
        if s[0]["pool_unreachable_since_ms"].as_u64().unwrap_or(0) == 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "status 15 s after the cut ended: {s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn the_lender_restarted_while_the_pool_is_down() {
    let mut r = Rig::new(Opts::default());
    let load = Load::start(&r.sock, 0, 6);
    load.run_for(Duration::from_secs(1), "before");
    r.kill_pool();
    let t = Instant::now();
    load.run_for(Duration::from_secs(TTL_S), "pool down");
    r.restart_lender(None);
    // The restarted lender serves at once, from the pool key and fences it kept.
    let n = load.run_for(OUTAGE.saturating_sub(t.elapsed()), "lender restarted");
    assert!(n > 0, "no I/O after the lender's restart\n{}", r.logs());
    assert!(t.elapsed() >= OUTAGE);
    r.restart_pool();
    r.after_outage(load, "lender restarted while the pool is down");
}

#[test]
fn the_compute_agent_restarted_while_the_pool_is_down() {
    let mut r = Rig::new(Opts::default());
    let load = Load::start(&r.sock, 0, 7);
    load.run_for(Duration::from_secs(1), "before");
    let end = load.finish();
    assert!(end.errors.is_empty(), "{:?}", end.errors);
    // A marker the restarted agent must serve back.
    let mut c = BlkClient::connect(&r.sock, 1, MIB as usize).unwrap();
    c.buffer()[..65536].fill(0x5a);
    let w = c.run(
        0,
        &[BlkOp::Write {
            offset: 32 * MIB,
            buf: 0,
            len: 65536,
        }],
    );
    assert_eq!(w.unwrap(), vec![0]);
    drop(c);
    r.kill_pool();
    let t = Instant::now();
    r.restart_borrower();
    let mut c = connect_retry(&r.sock).unwrap_or_else(|e| panic!("{e}\n{}", r.logs()));
    let got = c.run(
        0,
        &[BlkOp::Read {
            offset: 32 * MIB,
            buf: 65536,
            len: 65536,
        }],
    );
    assert_eq!(got.unwrap(), vec![0], "{}", r.logs());
    assert!(c.buffer()[65536..131072].iter().all(|&b| b == 0x5a));
    drop(c);
    let load = Load::start(&r.sock, 0, 8);
    through(&r, &load, "compute agent restarted, pool down");
    assert!(t.elapsed() >= OUTAGE);
    r.restart_pool();
    r.after_outage(load, "compute agent restarted while the pool is down");
}

#[test]
fn the_lenders_clock_five_minutes_ahead_then_behind() {
    let mut r = Rig::new(Opts {
        lender_clock: Some("+5m"),
        ..Opts::default()
    });
    let load = Load::start(&r.sock, 0, 9);
    let n = load.run_for(OUTAGE, "lender 5 minutes ahead");
    assert!(n > 0, "{}", r.logs());
    r.restart_lender(Some("-5m"));
    let n = load.run_for(OUTAGE, "lender 5 minutes behind");
    assert!(n > 0, "{}", r.logs());
    assert_eq!(r.lender_clock, Some("-5m"));
    r.after_outage(load, "lender 5 minutes off");
    // The lender ran with the clock it was given: its log's timestamps say so.
    for (log, sign) in [
        (r.d().join("device-agent.log"), 1i64),
        (r.d().join("device-agent-1.log"), -1),
    ] {
        let off = log_clock_offset_s(&std::fs::read_to_string(&log).unwrap());
        assert!(
            (sign * off - 300).abs() < 60,
            "{}: the lender's clock is {off} s off, not {} s",
            log.display(),
            sign * 300
        );
    }
}

/// How far (s) the first timestamp (`...THH:MM:SS`) of a log is from the time now.
fn log_clock_offset_s(log: &str) -> i64 {
    let line = log
        .lines()
        .find(|l| l.len() > 19 && l.as_bytes()[10] == b'T')
        .expect("a timestamped log line");
    let hms: Vec<i64> = line[11..19]
        .split(':')
        .map(|x| x.parse().unwrap())
        .collect();
    let then = hms[0] * 3600 + hms[1] * 60 + hms[2];
    let now = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 86400) as i64;
    let mut off = then - now;
    if off > 43200 {
        off -= 86400;
    } else if off < -43200 {
        off += 86400;
    }
    off
}

#[test]
fn two_pool_servers_on_one_postgresql_one_killed() {
    let mut r = Rig::new(Opts {
        two_servers: true,
        ..Opts::default()
    });
    let load = Load::start(&r.sock, 0, 10);
    load.run_for(Duration::from_secs(1), "before");
    r.kill_pool();
    load.run_for(Duration::from_secs(TTL_S), "first server killed");
    // Renewals go to the second server: the lease's expiry moves on there.
    let e0 = r.lease_state().expires_at_ms;
    through(&r, &load, "first server killed");
    let l = r.lease_state();
    assert_eq!(l.state, LeaseState::Bound, "{l:?}\n{}", r.logs());
    assert!(
        l.expires_at_ms >= e0 + 2 * TTL_S * 1000,
        "the lease was not renewed at the second server: expiry {} then {}\n{}",
        e0,
        l.expires_at_ms,
        r.logs()
    );
    // The compute agent itself renews at the second server (its lease names both): it
    // does not show the pool unreachable. (A lease naming only the first server stays
    // live through the lender's reports, but its holder's renewals fail: a trial saw
    // that when `attach --class` kept only the server that answered.)
    let s = r.borrower.cli_json(&["status"]).unwrap();
    assert!(
        s[0]["pool_unreachable_since_ms"].as_u64().unwrap_or(0) == 0,
        "the compute agent does not reach the second server: {s}\n{}",
        r.logs()
    );
    r.after_outage(load, "first of two pool servers killed");
}

// ---- safety ------------------------------------------------------------------------

/// Writes 64 KiB of `byte` at offset 0 through `sock` and reads it back: the statuses
/// (or the client's error).
fn write_byte(sock: &Path, byte: u8) -> Result<Vec<i32>, String> {
    let mut c = connect_retry(sock)?;
    c.buffer()[..65536].fill(byte);
    let mut r = c
        .run(
            0,
            &[BlkOp::Write {
                offset: 0,
                buf: 0,
                len: 65536,
            }],
        )
        .map_err(|e| format!("{e:#}"))?;
    r.extend(
        c.run(
            0,
            &[BlkOp::Read {
                offset: 0,
                buf: 65536,
                len: 65536,
            }],
        )
        .map_err(|e| format!("{e:#}"))?,
    );
    if r.iter().all(|&x| x == 0) && c.buffer()[65536..131072].iter().any(|&b| b != byte) {
        return Err("read back differs".into());
    }
    Ok(r)
}

/// Compute host A dies for good (its agent killed with SIGKILL, its link to the pool
/// gone); its lease expires at the pool after the TTL and the device goes to host B.
/// The lender is cut from the pool before B comes, so it learns of B's lease only from
/// B's token. Then A's agent comes back on its old state file, still cut from the pool:
/// the lender refuses its sessions (B's lease is newer), no I/O of A is served, and
/// B's data is intact.
#[test]
fn a_dead_compute_hosts_device_goes_to_another_and_the_newer_lease_fences_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (da, db) = (d.join("a"), d.join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let l = Netns::new(4).unwrap();
    let ca = Netns::new(5).unwrap();
    let cb = Netns::new(6).unwrap();
    let la = NsLink::new(&l, &ca, 2).unwrap();
    let lb = NsLink::new(&l, &cb, 3).unwrap();
    // The lender is advertised at its address on A's link; B reaches it through its own.
    devlend_tests::netns::ip(&[
        "-n",
        &cb.name,
        "route",
        "add",
        &format!("{}/32", la.a_ip),
        "via",
        &lb.a_ip,
    ])
    .unwrap();
    let port = free_port().unwrap();
    let pool = start_pool(d, "pool", port, true, None);
    let admin = pool.admin().unwrap();
    pool.enroll(Role::Lender, PROVIDER, &d.join("lender.key"))
        .unwrap();
    let host_a = devlend_daemon::host_name();
    pool.enroll(Role::Compute, &host_a, &Borrower::pool_key(&da))
        .unwrap();
    pool.enroll(Role::Compute, "host-b", &Borrower::pool_key(&db))
        .unwrap();
    sparse_file(&d.join("disk0.img"), DISK).unwrap();
    // Heartbeats every 4 s: the pool keeps the device available (three missed
    // heartbeats) while the lender is cut, long enough for B to lease it.
    let config = lender_config(
        d,
        &format!("0.0.0.0:{LENDER_PORT}"),
        &format!("{}:{LENDER_PORT}", la.a_ip),
        &format!("http://{}:{port}", l.host_ip),
        4000,
    );
    let lender = start_lender(
        d,
        "device-agent",
        Some(&l.name),
        &config,
        None,
        &format!("{}:{LENDER_PORT}", l.ns_ip),
    );
    let mut a = Borrower::start_in(&da, Some(&ca.name), "compute-agent", &[]).unwrap();
    let b = Borrower::start_in(&db, Some(&cb.name), "compute-agent", &[]).unwrap();
    let logs = |a: &Borrower| {
        format!(
            "--- pool ---\n{}\n--- lender ---\n{}\n--- A ---\n{}\n--- B ---\n{}",
            pool.proc.log(),
            lender.log(),
            a.proc.log(),
            b.proc.log()
        )
    };
    wait_until("disk0 available", || {
        admin
            .devices(&Default::default())
            .unwrap_or_default()
            .iter()
            .any(|x| x.state == devlend_pool::api::DeviceState::Available)
    });
    let sock_a = da.join("disk0.sock");
    let lease_a = attach(
        &a,
        &format!("http://{}:{port}", ca.host_ip),
        &Borrower::pool_key(&da),
        &sock_a,
        None,
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&a)));
    assert_eq!(write_byte(&sock_a, 0x11), Ok(vec![0, 0]));

    // A dies: its agent killed, its host gone from the network to the pool; the lender
    // is cut from the pool at once, before it can hear that A's lease ends.
    a.proc.kill_hard();
    ca.set_link(false).unwrap();
    l.set_link(false).unwrap();
    let t = Instant::now();
    wait_until("A's lease expired at the pool", || {
        admin
            .lease(lease_a)
            .is_ok_and(|x| x.state == LeaseState::Expired)
    });
    eprintln!("A's lease expired {:?} after A died", t.elapsed());

    // The device goes to B (its lease from the pool; the lender still cut).
    let sock_b = db.join("disk0.sock");
    let lease_b = attach(
        &b,
        &format!("http://{}:{port}", cb.host_ip),
        &Borrower::pool_key(&db),
        &sock_b,
        Some("host-b"),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", logs(&a)));
    assert_ne!(lease_a, lease_b);
    let at_pool = admin.lease(lease_b).unwrap();
    assert_eq!(at_pool.compute_host, "host-b");
    assert_eq!(write_byte(&sock_b, 0x22), Ok(vec![0, 0]), "{}", logs(&a));

    // A's agent comes back on its old state file, cut from the pool: only the lender's
    // fence stands between it and the device.
    a = Borrower::start_in(&da, Some(&ca.name), "compute-agent-again", &[]).unwrap();
    wait_until("A's attachment restored", || {
        a.cli_json(&["status"])
            .ok()
            .and_then(|s| s.as_array().map(|v| v.len() == 1))
            .unwrap_or(false)
            && sock_a.exists()
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let s = sock_a.clone();
    std::thread::spawn(move || {
        let _ = tx.send(write_byte(&s, 0xaa));
    });
    match rx.recv_timeout(Duration::from_secs(40)) {
        Ok(Ok(r)) => assert!(
            r.iter().any(|&x| x != 0),
            "the fenced host's I/O was served: {r:?}\n{}",
            logs(&a)
        ),
        Ok(Err(e)) => eprintln!("the fenced host's I/O failed: {e}"),
        Err(_) => eprintln!("the fenced host's I/O is not served after 40 s"),
    }
    // B's data is intact, and B goes on.
    assert_eq!(write_byte(&sock_b, 0x33), Ok(vec![0, 0]), "{}", logs(&a));
    // It is the lender that refused A: B's lease is newer.
    assert!(
        lender.log().contains("leased again"),
        "the lender did not refuse A's older lease:\n{}",
        logs(&a)
    );
    let img = std::fs::read(d.join("disk0.img")).unwrap();
    assert!(
        img[..65536].iter().all(|&x| x == 0x33),
        "the disk does not hold B's data"
    );

    // Back on the network: A's lease is over, B's holds the device.
    l.set_link(true).unwrap();
    ca.set_link(true).unwrap();
    wait_until("B's lease live and A's ended", || {
        admin.lease(lease_b).is_ok_and(|x| x.state.is_live())
            && admin.lease(lease_a).is_ok_and(|x| !x.state.is_live())
    });
    std::thread::sleep(Duration::from_secs(TTL_S));
    assert!(admin.lease(lease_b).unwrap().state.is_live());
    assert!(!admin.lease(lease_a).unwrap().state.is_live());
    let live = admin
        .leases(devlend_pool::api::LeaseFilter::Active)
        .unwrap();
    assert_eq!(live.len(), 1, "{live:?}");
    assert_eq!(live[0].id, lease_b);
    assert_eq!(write_byte(&sock_b, 0x44), Ok(vec![0, 0]), "{}", logs(&a));
    // A's agent, back in touch with the pool, is told its lease is over: it drops the
    // attachment for good.
    wait_until("A's attachment dropped", || {
        a.cli_json(&["status"])
            .is_ok_and(|s| s.as_array().is_some_and(|v| v.is_empty()))
    });
    assert!(!sock_a.exists());
    drop((la, lb));
}

// ---- a QEMU guest ------------------------------------------------------------------

fn dlio_writes(console: &str) -> usize {
    console.lines().filter(|l| l.contains("DLIO w ")).count()
}

/// A QEMU guest (TCG) writing and verifying its leased disk with O_DIRECT through a
/// pool stop, a pool kill and restart, and its compute host cut from the pool, each
/// three TTLs: no I/O error in the guest, I/O during each outage and after them.
#[test]
fn a_guest_goes_on_through_pool_outages() {
    let mut r = Rig::new(Opts {
        netns: Some((8, 5)),
        ..Opts::default()
    });
    let mut guest = devlend_tests::guest::Guest::builder()
        .name("pool-outage")
        .memory_mib(256)
        .script(devlend_tests::migration::workload_script(60, 64))
        .vhost_user_blk_with(&r.sock, Some(1000))
        .boot()
        .unwrap();
    guest
        .wait_for_text("DEVLEND-RESULT workload=started", Duration::from_secs(120))
        .unwrap();
    let mut mark = dlio_writes(&guest.console());
    let mut during = |guest: &devlend_tests::guest::Guest, what: &str, r: &Rig| {
        std::thread::sleep(OUTAGE);
        let now = dlio_writes(&guest.console());
        assert!(
            now > mark,
            "{what}: the guest did no I/O in the outage\n{}\n{}",
            guest.console(),
            r.logs()
        );
        assert!(
            !guest.console().contains("DLIO-ERR"),
            "{what}: {}",
            guest.console()
        );
        mark = now;
    };
    r.pool.proc.signal(libc::SIGSTOP);
    during(&guest, "pool stopped", &r);
    r.pool.proc.signal(libc::SIGCONT);
    std::thread::sleep(Duration::from_secs(2));
    r.kill_pool();
    during(&guest, "pool killed", &r);
    r.restart_pool();
    std::thread::sleep(Duration::from_secs(2));
    r.net.as_ref().unwrap().c.set_link(false).unwrap();
    during(&guest, "compute host cut from the pool", &r);
    r.net.as_ref().unwrap().c.set_link(true).unwrap();
    let end_of_outages = dlio_writes(&guest.console());
    assert!(
        !guest.console().contains("workload=done"),
        "the workload ended before the last outage did: raise its seconds"
    );
    let out = guest.wait_done(Duration::from_secs(120)).unwrap();
    assert!(
        dlio_writes(&out.console) > end_of_outages,
        "no guest I/O after the outages"
    );
    assert!(!out.console.contains("DLIO-ERR"), "{}", out.console);
    assert_eq!(out.result("errors"), Some("0"), "{}", out.console);
    assert_eq!(out.result("verified"), out.result("written"));
    assert_eq!(r.lease_state().state, LeaseState::Bound, "{}", r.logs());
    let s = r.borrower.cli_json(&["status"]).unwrap();
    assert_eq!(s[0]["counters"]["errors"], 0, "{s}");
    assert_eq!(s[0]["lease_ended"], false, "{s}");
}
