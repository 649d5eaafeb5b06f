//! `devlend demo --frontend blkio`: the libblkio frontend writes and verifies the lent
//! disk through the vhost-user socket; then the lender's file is checked.

use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use devlend_compute_agent::api::AttachRequest;
use sha2::{Digest, Sha256};

use super::rig::{bar, file_sha256, hex, step, Rig};
use super::{DemoOptions, DemoSummary};
use crate::blk_client::{BlkClient, BlkOp};
use crate::pattern::{fill, first_mismatch};

const CHUNK: usize = 1 << 20;
const DEPTH: usize = 4;
const SEED: u64 = 0x0064_6576_6c65_6e64;

/// Runs the demo.
///
/// # Errors
/// Any step failing, with the agents' logs when one of them died; a data mismatch.
pub fn run(opts: &DemoOptions) -> Result<DemoSummary> {
    let t0 = Instant::now();
    if opts.size == 0 || !opts.size.is_multiple_of(CHUNK as u64) {
        bail!("demo size must be a non-zero multiple of 1 MiB");
    }
    let p = opts.progress;
    let rig = Rig::start(opts.dir.as_deref(), opts.size, p)?;
    let (dir, image, client) = (&rig.dir, &rig.image, &rig.client);
    let t_attach = Instant::now();
    let socket = dir.join("disk0.vhost.sock");
    step(
        p,
        &format!("attaching disk0 on vhost-user socket {}", socket.display()),
    );
    let claimed = rig.lease("demo-blkio", opts.size, p)?;
    client.attach(&AttachRequest {
        id: Some("demo".into()),
        lender: claimed.grant.lease.fabric_address.clone(),
        paths: Vec::new(),
        device: claimed.grant.lease.device.clone(),
        socket: socket.clone(),
        queues: 1,
        queue_size: 256,
        poll_us: 0,
        reconnect_deadline_s: 30,
        vmm: None,
        lease: Some(claimed.lease.clone()),
        lender_key: None,
        tls: false,
        tls_server_name: None,
        transport: Default::default(),
        rdma_exposure: Default::default(),
        kind: Default::default(),
        vm: None,
        handover_token: None,
    })?;

    step(
        p,
        "writing a known pattern across the disk through vhost-user (libblkio frontend)",
    );
    let attach_s = t_attach.elapsed().as_secs_f64();
    let mut blk = BlkClient::connect(&socket, 1, CHUNK * DEPTH)?;
    if blk.capacity() != opts.size {
        bail!(
            "the frontend sees {} bytes, expected {}",
            blk.capacity(),
            opts.size
        );
    }
    let chunks = opts.size / CHUNK as u64;
    let pb = bar(p, opts.size, "write");
    let tw = Instant::now();
    let mut c = 0u64;
    while c < chunks {
        let n = DEPTH.min((chunks - c) as usize);
        let ops: Vec<BlkOp> = (0..n)
            .map(|i| BlkOp::Write {
                offset: (c + i as u64) * CHUNK as u64,
                buf: i * CHUNK,
                len: CHUNK,
            })
            .collect();
        for (i, op) in ops.iter().enumerate() {
            if let BlkOp::Write { offset, .. } = op {
                fill(&mut blk.buffer()[i * CHUNK..(i + 1) * CHUNK], *offset, SEED);
            }
        }
        check(&blk.run(0, &ops)?, "write")?;
        c += n as u64;
        pb.inc((n * CHUNK) as u64);
    }
    check(&blk.run_one(0, BlkOp::Flush).map(|r| vec![r])?, "flush")?;
    let write_s = tw.elapsed().as_secs_f64();
    pb.finish();

    step(p, "reading the disk back and verifying it");
    let pb = bar(p, opts.size, "verify");
    let tr = Instant::now();
    let mut sum = Sha256::new();
    let mut c = 0u64;
    while c < chunks {
        let n = DEPTH.min((chunks - c) as usize);
        let ops: Vec<BlkOp> = (0..n)
            .map(|i| BlkOp::Read {
                offset: (c + i as u64) * CHUNK as u64,
                buf: i * CHUNK,
                len: CHUNK,
            })
            .collect();
        check(&blk.run(0, &ops)?, "read")?;
        for i in 0..n {
            let off = (c + i as u64) * CHUNK as u64;
            let data = &blk.buffer()[i * CHUNK..(i + 1) * CHUNK];
            if let Some(bad) = first_mismatch(data, off, SEED) {
                bail!("data read back differs from what was written at byte {bad}");
            }
            sum.update(data);
        }
        c += n as u64;
        pb.inc((n * CHUNK) as u64);
    }
    let read_s = tr.elapsed().as_secs_f64();
    pb.finish();
    drop(blk);

    step(p, "detaching (requests in flight complete, socket removed)");
    let t_detach = Instant::now();
    let detached = client.detach("demo", 30)?;
    if socket.exists() {
        bail!("socket {} still exists after detach", socket.display());
    }

    let detach_s = t_detach.elapsed().as_secs_f64();
    step(p, "checking the lender's image file holds the same data");
    let frontend = hex(&sum.finalize());
    let lender = file_sha256(image)?;
    if lender != frontend {
        bail!("checksum mismatch: frontend {frontend}, lender file {lender}");
    }
    Ok(DemoSummary {
        frontend: "blkio".into(),
        size: opts.size,
        phases: vec![
            ("attach".into(), attach_s),
            ("write".into(), write_s),
            ("verify".into(), read_s),
            ("detach".into(), detach_s),
        ],
        checksum_frontend: frontend,
        checksum_lender: lender,
        attachment: detached,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

fn check(results: &[i32], what: &str) -> Result<()> {
    match results.iter().find(|&&r| r != 0) {
        Some(r) => Err(anyhow!(
            "{what} failed: {}",
            std::io::Error::from_raw_os_error(-r)
        )),
        None => Ok(()),
    }
}
