//! `devlend demo` with a VM: a QEMU guest (TCG) gets the lent disk live over QMP, its own
//! virtio-blk driver writes a known pattern across the disk and verifies it, the disk is
//! detached live, and the lender's file must hold what the guest wrote.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use devlend_compute_agent::api::{AttachRequest, VmmTarget};
use devlend_qemu::guest::{guest_dir, qemu_binary, Guest, GuestImage};
use sha2::{Digest, Sha256};

use super::rig::{bar, file_sha256, hex, step, Rig};
use super::{DemoOptions, DemoSummary};

const MIB: u64 = 1 << 20;
/// Each MiB of the disk is this header (with the block number) and then filler.
const HEADER: &str = "devlend block ";
/// The filler: `yes devlend` output.
const FILL_WORD: &[u8] = b"devlend\n";
/// Wait for each guest phase.
const PHASE_TIMEOUT: Duration = Duration::from_secs(180);

/// What to install when QEMU is missing or too old.
pub const INSTALL_HINT: &str = concat!(
    "devlend demo needs QEMU 10 (qemu-system-x86_64) and the guest-image tools.\n",
    "On Debian 12, as root, from the devlend source tree:  bash qemu/install-deps.sh\n",
    "or by hand:\n",
    "  echo 'deb http://deb.debian.org/debian bookworm-backports main' > /etc/apt/sources.list.d/backports.list\n",
    "  apt-get update && apt-get install -t bookworm-backports qemu-system-x86 qemu-utils\n",
    "  apt-get install busybox-static cpio kmod\n",
    "(or run the demo without a VM: devlend demo --frontend blkio)"
);

/// The guest's script: wait for the disk, write the pattern across it MiB by MiB,
/// drop the page cache and compare every MiB with the pattern, print the disk's SHA-256,
/// wait until it is unplugged.
const SCRIPT: &str = r#"
set -e
devlend-wait-for /dev/vda 120
echo "DEVLEND-RESULT size=$(cat /sys/block/vda/size)"
echo "DEVLEND-RESULT serial=$(cat /sys/block/vda/serial)"
n=$(( $(cat /sys/block/vda/size) / 2048 ))
yes devlend | head -c 1048553 > /tmp/fill
block() { printf 'devlend block %08d\n' $1; cat /tmp/fill; }
i=0
while [ $i -lt $n ]; do
	block $i > /tmp/blk
	conv=notrunc
	[ $i -lt $((n-1)) ] || conv=notrunc,fsync
	dd if=/tmp/blk of=/dev/vda bs=1M seek=$i count=1 conv=$conv 2>/dev/null
	i=$((i+1))
	[ $((i % 8)) -ne 0 ] || echo "DEVLEND-PROGRESS write $i $n"
done
echo 3 > /proc/sys/vm/drop_caches
i=0
while [ $i -lt $n ]; do
	block $i > /tmp/blk
	dd if=/dev/vda bs=1M skip=$i count=1 2>/dev/null | cmp -s - /tmp/blk || { echo "DEVLEND-RESULT verified=no block=$i"; exit 2; }
	i=$((i+1))
	[ $((i % 8)) -ne 0 ] || echo "DEVLEND-PROGRESS verify $i $n"
done
echo "DEVLEND-RESULT verified=yes"
echo 3 > /proc/sys/vm/drop_caches
echo "DEVLEND-RESULT checksum=$(dd if=/dev/vda bs=1M 2>/dev/null | sha256sum | cut -d' ' -f1)"
echo "DEVLEND-PHASE io-done"
i=0
while [ -e /sys/block/vda ]; do sleep 0.1; i=$((i+1)); [ $i -lt 1200 ] || exit 3; done
echo "DEVLEND-PHASE gone"
"#;

/// The bytes of MiB `block` of the pattern.
pub fn pattern_block(block: u64) -> Vec<u8> {
    let mut b = format!("{HEADER}{block:08}\n").into_bytes();
    let rest = MIB as usize - b.len();
    b.extend(FILL_WORD.iter().cycle().take(rest));
    b
}

/// Checks that QEMU 10 or newer is there.
///
/// # Errors
/// It is missing or older, with [`INSTALL_HINT`].
pub fn check_qemu() -> Result<()> {
    let out = Command::new(qemu_binary()).arg("--version").output();
    let text = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        _ => bail!("{} was not found.\n{INSTALL_HINT}", qemu_binary().display()),
    };
    let major = text
        .split("version ")
        .nth(1)
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.trim().parse::<u32>().ok())
        .unwrap_or(0);
    if major < 10 {
        bail!(
            "QEMU {major} is too old (found: {}).\n{INSTALL_HINT}",
            text.lines().next().unwrap_or("")
        );
    }
    for tool in ["busybox", "cpio"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output();
        if !found.is_ok_and(|o| o.status.success()) && !guest_dir().join("initrd.gz").exists() {
            bail!("{tool} was not found (needed to build the guest image).\n{INSTALL_HINT}");
        }
    }
    Ok(())
}

/// Runs the VM demo.
///
/// # Errors
/// QEMU missing, a step failing, or a data mismatch.
pub fn run(opts: &DemoOptions) -> Result<DemoSummary> {
    let t0 = Instant::now();
    let p = opts.progress;
    if opts.size < MIB || !opts.size.is_multiple_of(MIB) {
        bail!("demo size must be a non-zero multiple of 1 MiB");
    }
    check_qemu()?;
    step(
        p,
        &format!(
            "preparing the guest image (Debian kernel + busybox, cached in {})",
            guest_dir().display()
        ),
    );
    GuestImage::ensure().context("cannot build the guest image")?;
    let rig = Rig::start(opts.dir.as_deref(), opts.size, p)?;
    let mut phases = Vec::new();

    step(
        p,
        "booting a QEMU guest (TCG, 1 vCPU, 512 MiB, QMP socket, free PCIe root ports)",
    );
    let t = Instant::now();
    let mut guest = Guest::builder()
        .name("demo")
        .root_ports(2)
        .script(SCRIPT)
        .boot()?;
    guest.wait_for_line(|l| l.contains("DEVLEND-WAIT path=/dev/vda"), PHASE_TIMEOUT)?;
    phases.push(("boot".to_owned(), t.elapsed().as_secs_f64()));

    let socket = rig.dir.join("disk0.vhost.sock");
    step(
        p,
        "attaching disk0 live into the running guest over QMP (vhost-user-blk-pci)",
    );
    let t = Instant::now();
    let claimed = rig.lease("demo-vm", opts.size, p)?;
    let attached = rig.client.attach(&AttachRequest {
        id: Some("demo".into()),
        lender: claimed.grant.lease.fabric_address.clone(),
        paths: Vec::new(),
        device: claimed.grant.lease.device.clone(),
        socket: socket.clone(),
        queues: 1,
        queue_size: 256,
        poll_us: 0,
        reconnect_deadline_s: 30,
        vmm: Some(VmmTarget::Qemu {
            qmp: guest.qmp_socket().to_owned(),
        }),
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
    guest.wait_for_line(
        |l| l.contains("DEVLEND-WAITED path=/dev/vda"),
        PHASE_TIMEOUT,
    )?;
    phases.push(("attach".to_owned(), t.elapsed().as_secs_f64()));
    if let Some(v) = &attached.vmm {
        step(
            p,
            &format!(
                "the guest sees /dev/vda (device {:?} on {})",
                v.device_id, v.location
            ),
        );
    }

    step(
        p,
        "the guest writes a known pattern across the disk, then verifies it",
    );
    let t = Instant::now();
    let pb = bar(p, opts.size, "write");
    let mut verifying = false;
    loop {
        let line = guest.wait_for_line(
            |l| {
                l.contains("DEVLEND-PROGRESS")
                    || l.contains("DEVLEND-PHASE io-done")
                    || l.contains("DEVLEND-DONE")
            },
            PHASE_TIMEOUT,
        )?;
        if line.contains("DEVLEND-DONE") {
            // The script ended before finishing its I/O: say why, from what it printed.
            pb.finish_and_clear();
            let outcome = guest.wait_done(PHASE_TIMEOUT)?;
            let why = match outcome.result("verified") {
                Some("no") => "the data read back differs from what was written".to_owned(),
                _ => format!("the guest's script failed (exit status {})", outcome.rc),
            };
            let tail: Vec<&str> = outcome.console.lines().rev().take(15).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "the guest's I/O on the lent disk failed: {why}\nguest console (last lines):\n{}",
                tail.join("\n")
            );
        }
        if line.contains("DEVLEND-PHASE io-done") {
            break;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [.., "DEVLEND-PROGRESS", what, i, _] = f.as_slice() {
            if *what == "verify" && !verifying {
                verifying = true;
                pb.set_message("verify");
            }
            pb.set_position(i.parse::<u64>().unwrap_or(0) * MIB);
        }
    }
    pb.finish_and_clear();
    phases.push(("write+verify".to_owned(), t.elapsed().as_secs_f64()));

    step(
        p,
        "detaching disk0 live (device_del, DEVICE_DELETED, chardev-remove, then the backend)",
    );
    let t = Instant::now();
    let detached = rig.client.detach("demo", 30)?;
    guest.wait_for_line(
        |l| l.contains("DEVLEND-PHASE gone") || l.contains("DEVLEND-DONE"),
        PHASE_TIMEOUT,
    )?;
    phases.push(("detach".to_owned(), t.elapsed().as_secs_f64()));
    let outcome = guest.wait_done(PHASE_TIMEOUT)?;
    outcome.check_success()?;
    if socket.exists() {
        bail!("socket {} still exists after detach", socket.display());
    }
    let guest_sum = outcome
        .result("checksum")
        .context("the guest printed no checksum")?
        .to_owned();
    if outcome.result("verified") != Some("yes") {
        bail!("the guest could not verify what it wrote");
    }

    step(
        p,
        "checking on the lender's side that the file holds the same data",
    );
    let lender_sum = file_sha256(&rig.image)?;
    let mut want = Sha256::new();
    for b in 0..opts.size / MIB {
        want.update(pattern_block(b));
    }
    if hex(&want.finalize()) != lender_sum {
        bail!("the lender's file does not hold the pattern");
    }
    if lender_sum != guest_sum {
        bail!("checksum mismatch: guest {guest_sum}, lender file {lender_sum}");
    }
    Ok(DemoSummary {
        frontend: "vm".into(),
        size: opts.size,
        phases,
        checksum_frontend: guest_sum,
        checksum_lender: lender_sum,
        attachment: detached,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_blocks_are_one_mib_and_numbered() {
        let b = pattern_block(42);
        assert_eq!(b.len(), MIB as usize);
        assert!(b.starts_with(b"devlend block 00000042\ndevlend\ndevlend\n"));
        assert_ne!(pattern_block(1), pattern_block(2));
    }
}
