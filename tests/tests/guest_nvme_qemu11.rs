//! A real VMM and the guest's own `nvme` driver on a lent NVMe SSD: the lender runs in a
//! first TCG guest with intel-iommu and QEMU's emulated `nvme` (an image file on the
//! host) bound to vfio-pci, in coherence mode `nvme` (the default for an NVMe
//! controller); devlend's borrower serves vfio-user on the host; QEMU 11 (`-device
//! vfio-user-pci`, from the Debian 13 chroot) boots a second guest with 2 vCPUs, which
//! maps all its RAM for DMA.
//!
//! In the QEMU 11 guest, the kernel's own `nvme` driver (loaded from the same Debian
//! kernel package) probes the function and shows `/dev/nvme0n1` with the lender's
//! namespace size. A script writes a 64 KiB pattern with `dd oflag=direct`, reads it
//! back with `iflag=direct` and compares, then runs direct I/O pinned to each vCPU at
//! once, so that both I/O queues carry commands (their interrupt counts in
//! `/proc/interrupts`). The host checks that the lender's image holds the pattern.
//!
//! Needs the chroot at `$DEVLEND_QEMU11_ROOT` (default `/var/cache/devlend/qemu11-root`,
//! see `tests/src/qemu11.rs`). Without it the test says so and passes; with
//! `DEVLEND_REQUIRE_QEMU11=1` it fails instead.

use devlend_tests::qemu11;
use devlend_tests::shared_libraries as libs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use devlend_backend::pci::{LinkTarget, PciBorrower};
use devlend_qemu::guest::Guest;

fn bin(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/release")
        .join(name)
}

const LENDER_SCRIPT: &str = r#"
set -e
devlend-modprobe vfio vfio_iommu_type1 vfio_virqfd irqbypass vfio_pci_core vfio_pci
ip link set lo up
ip addr add 10.0.2.15/24 dev eth0
ip link set eth0 up
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/class)" = 0x010802 ]; then BDF=$(basename $d); fi
done
echo vfio-pci > /sys/bus/pci/devices/$BDF/driver_override
echo $BDF > /sys/bus/pci/drivers_probe
devlend-device-agent --listen 0.0.0.0:7700 --insecure --device ssd0=pci:$BDF --log-level info 2>&1 | sed 's/^/lender: /' &
sleep 100000
"#;

/// Runs in the QEMU 11 guest after `qemu11::nvme_guest_prelude`.
const VMM_SCRIPT: &str = r#"
echo "DEVLEND-RESULT model=$(cat /sys/class/nvme/nvme0/serial | tr -d ' ')"
echo "DEVLEND-RESULT hwqueues=$(ls /sys/block/nvme0n1/mq | wc -l)"
dmesg | grep -i nvme
grep nvme /proc/interrupts
# A 64 KiB pattern (not zero, not random: the host regenerates nothing, it compares
# the md5 sums).
i=0; : > /tmp/pat
while [ $i -lt 16 ]; do printf "devlend-nvme-%04d-" $i; i=$((i + 1)); done > /tmp/line
while [ $(stat -c %s /tmp/pat) -lt 65536 ]; do cat /tmp/line >> /tmp/pat; done
dd if=/tmp/pat of=/tmp/pat64 bs=65536 count=1 2>/dev/null
(sleep 90; echo "still writing after 90 s"; dmesg | grep -i nvme | tail; grep nvme /proc/interrupts) &
WATCH=$!
dd if=/tmp/pat64 of=/dev/nvme0n1 bs=4096 seek=256 oflag=direct 2>&1 | tail -1
kill $WATCH
dd if=/dev/nvme0n1 of=/tmp/back bs=4096 skip=256 count=16 iflag=direct 2>&1 | tail -1
if cmp /tmp/pat64 /tmp/back; then echo "DEVLEND-RESULT verify=ok"; else echo "DEVLEND-RESULT verify=bad"; fi
echo "DEVLEND-RESULT md5=$(md5sum /tmp/pat64 | cut -d' ' -f1)"
# Both vCPUs at once: each CPU submits on its own I/O queue.
grep nvme /proc/interrupts
taskset -c 0 dd if=/dev/nvme0n1 of=/dev/null bs=4096 count=64 iflag=direct 2>/dev/null &
taskset -c 1 dd if=/dev/nvme0n1 of=/dev/null bs=4096 skip=64 count=64 iflag=direct 2>/dev/null &
taskset -c 1 dd if=/tmp/pat64 of=/dev/nvme0n1 bs=4096 seek=512 oflag=direct 2>/dev/null &
wait
dd if=/dev/nvme0n1 of=/tmp/back2 bs=4096 skip=512 count=16 iflag=direct 2>/dev/null
if cmp /tmp/pat64 /tmp/back2; then echo "DEVLEND-RESULT verify2=ok"; else echo "DEVLEND-RESULT verify2=bad"; fi
grep nvme /proc/interrupts
for q in 1 2; do
  echo "DEVLEND-RESULT irq_q$q=$(grep "nvme0q$q\$" /proc/interrupts | awk '{ s = 0; for (i = 2; i <= 3; i++) s += $i; print s }')"
done
"#;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[test]
fn qemu11_guest_uses_a_lent_nvme_with_its_own_driver() {
    let Some(root) = qemu11::root() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("nvme.img");
    const IMAGE: u64 = 32 << 20;
    std::fs::write(&image, vec![0u8; IMAGE as usize]).expect("the image");
    let modules = qemu11::nvme_modules(dir.path());
    let port = free_port();
    let agent = bin("devlend-device-agent");
    let mut b = Guest::builder()
        .name("nvme-lender")
        .memory_mib(512)
        .kernel_arg("intel_iommu=on iommu=pt")
        .args([
            "-machine".to_string(),
            "kernel-irqchip=split".to_string(),
            "-device".to_string(),
            "intel-iommu,intremap=on,caching-mode=on".to_string(),
            "-drive".to_string(),
            format!("file={},if=none,id=nv0,format=raw", image.display()),
            "-device".to_string(),
            "nvme,serial=lend0,drive=nv0".to_string(),
            "-nic".to_string(),
            format!("user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:{port}-:7700"),
        ])
        .script(LENDER_SCRIPT)
        .host_file("/bin/devlend-device-agent", &agent);
    let mut files = libs(&agent);
    files.push("/lib64/ld-linux-x86-64.so.2".into());
    files.sort();
    files.dedup();
    for f in files {
        b = b.host_file(f.clone(), f);
    }
    let mut lender = b.boot().expect("boot the lender's guest");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lender
            .wait_for_text("listening", Duration::from_secs(240))
            .expect("the lender listens");
        let target = LinkTarget {
            lender: format!("127.0.0.1:{port}"),
            device: "ssd0".into(),
            borrower: [9; 16],
            token: Vec::new(),
            tls: None,
            timeout: Duration::from_secs(10),
            transport: devlend_fabric::transport::Transport::Tcp,
            lender_key: None,
            holder: None,
        };
        let until = Instant::now() + Duration::from_secs(30);
        let borrower = loop {
            match PciBorrower::connect(&target) {
                Ok(b) => break b,
                Err(e) if Instant::now() < until => {
                    eprintln!("borrower: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => panic!("borrower: {}", devlend_fabric::error::chain(&e)),
            }
        };
        let sock = dir.path().join("nvme.sock");
        let server = borrower.listen(&sock).expect("listen");
        let handle = borrower.handle();
        assert!(handle.mediated(), "the NVMe controller is mediated");
        let mut borrower = borrower;
        std::thread::spawn(move || borrower.serve(&server));

        std::env::set_var("DEVLEND_QEMU", qemu11::wrapper(dir.path(), &root));
        let device = format!(
            "{{\"driver\":\"vfio-user-pci\",\"socket\":{{\"path\":\"{}\",\"type\":\"unix\"}}}}",
            sock.display()
        );
        let mut vb = Guest::builder()
            .name("qemu11")
            .memory_mib(256)
            .vcpus(2)
            .args(["-device".to_string(), device])
            .script(format!("{}{VMM_SCRIPT}", qemu11::nvme_guest_prelude()));
        for (guest_path, host_path) in &modules {
            vb = vb.host_file(guest_path.clone(), host_path.clone());
        }
        let mut vmm = vb.boot().expect("boot the QEMU 11 guest");
        let out = vmm.wait_done(Duration::from_secs(600));
        for l in vmm.console().lines().filter(|l| {
            l.contains("DEVLEND-RESULT")
                || l.contains("nvme")
                || l.contains("insmod")
                || l.contains("records")
        }) {
            eprintln!("qemu11: {l}");
        }
        let out = out.expect("the QEMU 11 guest's script");
        let get = |k: &str| out.result(k).unwrap_or("").to_string();
        assert_eq!(
            get("dev"),
            "yes",
            "the guest's nvme driver shows /dev/nvme0n1"
        );
        assert_eq!(
            get("sectors"),
            (IMAGE / 512).to_string(),
            "/dev/nvme0n1 has the lender's namespace size"
        );
        assert_eq!(get("model"), "lend0", "the controller's serial");
        assert_eq!(get("verify"), "ok", "the pattern read back with O_DIRECT");
        assert_eq!(
            get("verify2"),
            "ok",
            "the pattern written during concurrent I/O"
        );
        let irq = |q: &str| get(q).parse::<u64>().unwrap_or(0);
        assert!(
            irq("irq_q1") > 0 && irq("irq_q2") > 0,
            "both I/O queues completed commands: q1 {}, q2 {}",
            irq("irq_q1"),
            irq("irq_q2")
        );
        // The lender's image holds the pattern.
        let img = std::fs::read(&image).expect("read the image");
        let md5 = |b: &[u8]| qemu11::md5_hex(dir.path(), b);
        let at = 256 * 4096;
        assert_eq!(
            md5(&img[at..at + 65536]),
            get("md5"),
            "the image holds the pattern"
        );
        let at = 512 * 4096;
        assert_eq!(
            md5(&img[at..at + 65536]),
            get("md5"),
            "and the concurrent write"
        );
        let c = handle.link_counters();
        eprintln!(
            "fabric: {} messages, {} bytes sent; {} messages, {} bytes received",
            c.msgs_sent.load(std::sync::atomic::Ordering::Relaxed),
            c.bytes_sent.load(std::sync::atomic::Ordering::Relaxed),
            c.msgs_received.load(std::sync::atomic::Ordering::Relaxed),
            c.bytes_received.load(std::sync::atomic::Ordering::Relaxed)
        );
    }));
    for l in lender.console().lines().filter(|l| l.contains("lender: ")) {
        eprintln!("{l}");
    }
    lender.kill();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}
