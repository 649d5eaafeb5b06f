//! Live migration of a guest whose disk is leased from a device pool: the lease moves
//! with the VM. A pool (`devlend pool serve`, SQLite, signed requests) and a lender
//! registered with it; compute agents of hosts A and B each with its own enrolled pool
//! key (A under this machine's host name, which `devlend attach --class` leases for; B
//! as `host-b`). The guest's QEMUs run in network namespaces A and B joined by a veth
//! link (the migration stream's path); the agents, the pool and the lender run in this
//! namespace, on loopback (the direct-mode test, `migration.rs`, puts the agents in the
//! hosts' namespaces; the pool's part is what this one adds).
//!
//! A→B→A→B with the verifying workload of `migration.rs`: each migration is `devlend
//! migrate handover --to HOST` on the source (the pool grants the destination host a
//! lease that names the source's as predecessor), `migrate prepare --pool` on the
//! destination (its agent binds and renews that lease), QMP `migrate`, `migrate finish`
//! on the source (its lease released). After each, the pool lists one live lease for
//! the disk, on the destination host, naming the previous one as `successor_of`. No
//! guest I/O error, every chunk verified, and the lender's file holds what the guest
//! wrote.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use devlend_pool::api::{DeviceQuery, DeviceState, LeaseFilter, Role};
use devlend_tests::agents::{free_port, sparse_file, Lender, Pool};
use devlend_tests::guest::Guest;
use devlend_tests::migration::{self, ms, Chain, CHUNK_BYTES};
use devlend_tests::migration_lab::{
    attachment_id, keygen, label, ok_json, to_host, ComputeHost, Hosts,
};
use devlend_tests::sha256_hex;

mod migration_common;

use migration_common::{
    migrate_chain, CHUNKS, DISK_BYTES, MEMORY_MIB, MIGRATIONS, ONE_AT_A_TIME, WORKLOAD_SECS,
};

const PROVIDER: &str = "lender-m";

/// A lease id as text without hyphens (the handover answer's form).
fn simple(id: &str) -> String {
    id.replace('-', "")
}

#[test]
fn a_pool_leased_disk_migrates_and_its_lease_moves_with_the_vm() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let hosts = Hosts::new(40, 40)?;
    let pool = Pool::start(d)?;
    let admin = pool.admin()?;

    // The compute hosts' pool keys are enrolled before their agents start (which sign
    // with `DIR/compute.key`).
    let names = [devlend_daemon::host_name(), "host-b".to_owned()];
    for (i, n) in ["a", "b"].iter().enumerate() {
        std::fs::create_dir_all(d.join(n))?;
        pool.enroll(Role::Compute, &names[i], &d.join(n).join("compute.key"))?;
    }
    let lender_key = d.join("lender.key");
    pool.enroll(Role::Lender, PROVIDER, &lender_key)?;
    let image = d.join("lent.img");
    sparse_file(&image, DISK_BYTES)?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let config = d.join("device-agent.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"{addr}\"\nkey_file = \"{key}\"\n[pool]\nurl = \"{url}\"\nprovider = \"{PROVIDER}\"\nheartbeat_interval_ms = 500\n\n[[device]]\nname = \"disk0\"\npath = \"{img}\"\n",
            key = lender_key.display(),
            url = pool.url,
            img = image.display(),
        ),
    )?;
    let lender = Lender::start_with(
        d,
        &addr,
        &[],
        &["--config".into(), config.display().to_string()],
    )?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !admin
        .devices(&DeviceQuery::default())
        .unwrap_or_default()
        .iter()
        .any(|x| x.state == DeviceState::Available)
    {
        ensure!(
            Instant::now() < deadline,
            "the lender's disk never became available:\n{}",
            lender.proc.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let hosts_agents = [
        ComputeHost::start("a", d, None, &d.join("a.key").tap_keygen()?, addr.clone())?,
        ComputeHost::start("b", d, None, &d.join("b.key").tap_keygen()?, addr.clone())?,
    ];
    let logs = || {
        format!(
            "pool log:\n{}\nlender log:\n{}\n--- A ---\n{}\n--- B ---\n{}",
            pool.proc.log(),
            lender.proc.log(),
            hosts_agents[0].agent.proc.log(),
            hosts_agents[1].agent.proc.log()
        )
    };

    // A leases the disk from the pool, as an operator does.
    let sock = hosts_agents[0].socket("boot");
    let s = sock.display().to_string();
    let key_a = d.join("a").join("compute.key").display().to_string();
    let v = hosts_agents[0]
        .json(&[
            "attach",
            "--class",
            "BLOCK",
            "--vm",
            "vm1",
            "--pool",
            &pool.url,
            "--pool-key",
            &key_a,
            "--socket",
            &s,
            "--queues",
            "1",
        ])
        .with_context(logs)?;
    let first_id = attachment_id(&v)?;
    let first_lease = simple(
        v["lease"]
            .as_str()
            .context("no lease in the attach answer")?,
    );
    let guest = Guest::builder()
        .name("mig-pool-A")
        .memory_mib(MEMORY_MIB)
        .netns(hosts.a.name.clone())
        .script(migration::workload_script(WORKLOAD_SECS, CHUNKS))
        .vhost_user_blk_with(&sock, Some(1000))
        .boot()?;
    let ids = std::cell::RefCell::new(vec![(first_id, sock.clone(), first_lease)]);
    let mut chain = Chain::new(guest);
    let run = migrate_chain_n(
        &mut chain,
        &hosts,
        &hosts_agents,
        &names,
        &pool,
        &admin,
        &ids,
        &addr,
    );
    let (run, outcome) = run.with_context(logs)?;
    let file = std::fs::read(&image)?;
    assert_eq!(
        outcome.result("region_sha256"),
        Some(sha256_hex(&file[..(u64::from(CHUNKS) * CHUNK_BYTES) as usize]).as_str()),
        "the lender's file does not hold what the guest wrote"
    );
    run.print();
    println!(
        "longest guest-visible pause (pool mode): {} ms",
        ms(run.longest())
    );
    let (last_id, _, _) = ids.borrow().last().cloned().context("no attachment")?;
    hosts_agents[to_host(MIGRATIONS - 1)].json(&["detach", &last_id])?;
    ensure!(
        admin.leases(LeaseFilter::Active)?.is_empty(),
        "a lease is left after the last detach"
    );
    Ok(())
}

/// Small extension: make a direct-mode key file at the path (the agents are started
/// with one, as the lab's are), returning the path and the public key.
trait TapKeygen {
    fn tap_keygen(&self) -> Result<(std::path::PathBuf, String)>;
}

impl TapKeygen for std::path::PathBuf {
    fn tap_keygen(&self) -> Result<(std::path::PathBuf, String)> {
        let public = keygen(self)?;
        Ok((self.clone(), public))
    }
}

type Ids = std::cell::RefCell<Vec<(String, std::path::PathBuf, String)>>;

#[allow(clippy::too_many_arguments)]
fn migrate_chain_n(
    chain: &mut Chain,
    hosts: &Hosts,
    agents: &[ComputeHost; 2],
    names: &[String; 2],
    pool: &Pool,
    admin: &devlend_pool::PoolClient,
    ids: &Ids,
    lender: &str,
) -> Result<(migration_common::Run, devlend_tests::guest::GuestOutcome)> {
    let (run, outcome, _) = migrate_chain(
        "pool",
        chain,
        hosts,
        |k, src, ns, uri| {
            let from = &agents[k % 2];
            let to = &agents[to_host(k)];
            let (src_id, src_sock, _) = ids.borrow().last().cloned().context("no attachment")?;
            let h = from.json(&["migrate", "handover", &src_id, "--to", &names[to_host(k)]])?;
            let token = h["handover_token"].as_str().context("no token")?.to_owned();
            let new_lease = simple(h["lease"].as_str().context("no lease")?);
            ensure!(
                h["pool"].is_string(),
                "a pool-mode handover names no pool: {h}"
            );
            let sock = to.socket(&format!("m{k}"));
            let s = sock.display().to_string();
            let v = ok_json(
                &to.try_cli(&[
                    "migrate",
                    "prepare",
                    "--handover-token",
                    &token,
                    "--lender",
                    lender,
                    "--device",
                    "disk0",
                    "--socket",
                    &s,
                    "--queues",
                    "1",
                    "--pool",
                    &pool.url,
                ])?,
                &format!("migrate prepare on {}", to.name),
            )?;
            let dst_id = attachment_id(&v)?;
            ids.borrow_mut().push((dst_id, sock.clone(), new_lease));
            src.incoming(uri)
                .name(format!("mig-pool-{}", label(k)))
                .netns(ns)
                .replace_in_args(&src_sock.display().to_string(), &s)
                .start()
        },
        |k, _| {
            let from = &agents[k % 2];
            let all = ids.borrow();
            let (src_id, _, old_lease) = &all[all.len() - 2];
            let (_, _, new_lease) = &all[all.len() - 1];
            from.json(&["migrate", "finish", src_id])?;
            // The pool: one live lease for the disk, the destination's, after the old.
            let live = admin.leases(LeaseFilter::Active)?;
            ensure!(live.len() == 1, "live leases after {}: {live:?}", label(k));
            let l = &live[0];
            ensure!(
                l.id.simple().to_string() == *new_lease
                    && l.compute_host == names[to_host(k)]
                    && l.successor_of.map(|p| p.simple().to_string()).as_ref() == Some(old_lease),
                "after {}: the live lease is {l:?}, want {new_lease} on {} after {old_lease}",
                label(k),
                names[to_host(k)]
            );
            Ok(())
        },
    )?;
    Ok((run, outcome))
}
