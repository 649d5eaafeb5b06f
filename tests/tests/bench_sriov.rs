//! A benchmark, not a test (ignored; run it with `cargo test --release -p devlend-tests
//! --test bench_sriov -- --ignored --nocapture`): does the NVMe mediator serialize the
//! VFs of one device? One QEMU 11 guest reads 4 KiB at random at queue depth 32
//! (`devlend-randread`, 32 threads with O_DIRECT) from the PF lent whole through the
//! mediator; then two QEMU 11 guests do the same at once, each on its own VF of the
//! same device (`pci-pf:BDF,vfs=2`). Both setups run in turn, `DEVLEND_SRIOV_ROUNDS`
//! times (default 2), each from a fresh boot of the lender's guest (`tests/src/sriov.rs`);
//! the figure is the two VFs' sum over the PF alone, per round. Everything runs under
//! TCG on the same host cores, so the absolute numbers say nothing about hardware; the
//! ratio says whether two VFs together get what one function gets. It asserts only
//! that every read succeeded.

use std::path::{Path, PathBuf};
use std::time::Duration;

use devlend_qemu::guest::Guest;
use devlend_tests::{agents::free_port, qemu11, sriov};

const SECONDS: u64 = 20;

const PF_SCRIPT: &str = r#"
echo $PF > /sys/bus/pci/devices/$PF/driver/unbind
echo vfio-pci > /sys/bus/pci/devices/$PF/driver_override
echo $PF > /sys/bus/pci/drivers_probe
devlend-device-agent --listen 0.0.0.0:7700 --insecure --device ssd=pci:$PF 2>&1 | sed 's/^/lender: /' &
sleep 100000
"#;

const VF_SCRIPT: &str = r#"
devlend-device-agent --listen 0.0.0.0:7700 --insecure --device ssd=pci-pf:$PF,vfs=2,namespaces=1:2 2>&1 | sed 's/^/lender: /' &
sleep 100000
"#;

/// Runs after `qemu11::nvme_guest_prelude`.
const VM_SCRIPT: &str = r#"
/bin/devlend-randread /dev/nvme0n1 32 __SECONDS__
"#;

/// Boots a QEMU 11 guest on `sock` that runs the reads; does not wait.
fn vm(name: &str, sock: &Path, modules: &[(String, PathBuf)]) -> Guest {
    let device = format!(
        "{{\"driver\":\"vfio-user-pci\",\"socket\":{{\"path\":\"{}\",\"type\":\"unix\"}}}}",
        sock.display()
    );
    let mut b = Guest::builder()
        .name(name)
        .memory_mib(256)
        .vcpus(2)
        .args(["-device".to_string(), device])
        .script(format!(
            "{}{}",
            qemu11::nvme_guest_prelude(),
            VM_SCRIPT.replace("__SECONDS__", &SECONDS.to_string())
        ));
    let tool = devlend_tests::agents::bin("devlend-randread").expect("devlend-randread");
    b = sriov::with_binary(b, "/bin/devlend-randread", &tool);
    for (g, h) in modules {
        b = b.host_file(g.clone(), h.clone());
    }
    b.boot().expect("boot a QEMU 11 guest")
}

/// The IOPS a guest reported, after checking that no read failed.
fn iops(vm: &mut Guest) -> f64 {
    let out = vm
        .wait_done(Duration::from_secs(600))
        .expect("the guest's reads");
    assert_eq!(out.result("errors"), Some("0"), "reads failed");
    out.result("iops")
        .and_then(|v| v.parse().ok())
        .expect("the guest's IOPS")
}

/// One lender guest and `devices` borrowed at once, one QEMU 11 guest each; their IOPS.
fn run(dir: &Path, images: &[PathBuf], script: &str, devices: &[&str]) -> Vec<f64> {
    let modules = qemu11::nvme_modules(dir);
    let port = free_port().expect("a port");
    let detached = devices.len() > 1;
    let mut lender = sriov::lender("bench-lender", images, detached, port, &modules, script)
        .boot()
        .expect("boot the lender's guest");
    lender
        .wait_for_text("listening", Duration::from_secs(300))
        .expect("the lender listens");
    let handles: Vec<_> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            // The socket a previous round served on stays behind.
            let sock = dir.join(format!("{d}.sock"));
            let _ = std::fs::remove_file(&sock);
            sriov::borrow(port, d, i as u8 + 1, &sock)
        })
        .collect();
    let mut vms: Vec<Guest> = devices
        .iter()
        .map(|d| {
            vm(
                &format!("bench-{d}"),
                &dir.join(format!("{d}.sock")),
                &modules,
            )
        })
        .collect();
    let out = vms.iter_mut().map(iops).collect();
    for h in handles {
        h.disconnect();
    }
    lender.kill();
    out
}

#[test]
#[ignore = "a benchmark: run with --ignored"]
fn two_vfs_together_against_the_pf_alone() {
    let Some(root) = qemu11::root() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    std::env::set_var("DEVLEND_QEMU", qemu11::wrapper(dir.path(), &root));
    let images = [dir.path().join("a.img"), dir.path().join("b.img")];
    for img in &images {
        std::fs::write(img, vec![0x5a; 64 << 20]).expect("an image");
    }
    let rounds: usize = std::env::var("DEVLEND_SRIOV_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let mut rows = Vec::new();
    for round in 1..=rounds {
        let pf = run(dir.path(), &images[..1], PF_SCRIPT, &["ssd"])[0];
        let vfs = run(dir.path(), &images, VF_SCRIPT, &["ssd-vf0", "ssd-vf1"]);
        let sum: f64 = vfs.iter().sum();
        eprintln!(
            "round {round}: PF alone {pf:.0} IOPS; VFs {:.0} + {:.0} = {sum:.0} IOPS; ratio {:.2}",
            vfs[0],
            vfs[1],
            sum / pf
        );
        rows.push((pf, vfs, sum / pf));
    }
    eprintln!("| round | PF alone (IOPS) | VF 0 | VF 1 | VFs' sum | sum / PF |");
    eprintln!("| --- | --- | --- | --- | --- | --- |");
    for (i, (pf, vfs, r)) in rows.iter().enumerate() {
        eprintln!(
            "| {} | {pf:.0} | {:.0} | {:.0} | {:.0} | {r:.2} |",
            i + 1,
            vfs[0],
            vfs[1],
            vfs[0] + vfs[1]
        );
    }
}
