//! A real VMM on the borrower: QEMU 11 (`-device vfio-user-pci`, from a Debian 13
//! chroot, as `../shared` guides describe) boots a guest that uses the lent `edu`
//! function through devlend. The lender runs in a first TCG guest with intel-iommu and
//! edu bound to vfio-pci (as in `guest_vfio.rs`); devlend's borrower serves vfio-user on
//! the host; QEMU 11 joins it and maps all of its guest's RAM for DMA.
//!
//! In the QEMU 11 guest, with no edu driver, a script reads the function through sysfs
//! and `/dev/mem` (`iomem=relaxed`): vendor and device IDs, the edu ID register, a
//! factorial, and a DMA of 64 bytes from reserved guest RAM (`memmap=`) into the card
//! and back to another address, whose bytes it compares. Every step crosses QEMU's
//! vfio-user client, the fabric, VFIO and the device model, and the DMA the mirror.
//!
//! Needs the chroot at `$DEVLEND_QEMU11_ROOT` (default `/var/cache/devlend/qemu11-root`):
//! `debootstrap --variant=minbase trixie DIR`, a `trixie-backports` source, then
//! `apt-get install -t trixie-backports --no-install-recommends qemu-system-x86`. Without
//! it the test says so and passes; with `DEVLEND_REQUIRE_QEMU11=1` it fails instead.

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
  if [ "$(cat $d/vendor)" = 0x1234 ] && [ "$(cat $d/device)" = 0x11e8 ]; then BDF=$(basename $d); fi
done
echo vfio-pci > /sys/bus/pci/devices/$BDF/driver_override
echo $BDF > /sys/bus/pci/drivers_probe
devlend-device-agent --listen 0.0.0.0:7700 --insecure --device edu=pci:$BDF --log-level info 2>&1 | sed 's/^/lender: /' &
sleep 100000
"#;

/// Runs in the QEMU 11 guest. Reserved RAM at 0x5000000 (`memmap=1M$0x5000000`) is the
/// DMA buffer: the pattern at +0, the copy back at +0x1000.
const VMM_SCRIPT: &str = r#"
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/vendor)" = 0x1234 ] && [ "$(cat $d/device)" = 0x11e8 ]; then D=$d; fi
done
[ -n "$D" ] || { echo "DEVLEND-RESULT found=no"; ls /sys/bus/pci/devices; exit 1; }
echo "DEVLEND-RESULT found=$(basename $D)"
BAR=$(head -n 1 $D/resource | cut -d' ' -f1)
BAR=$((BAR))
echo "DEVLEND-RESULT bar0=$(printf 0x%x $BAR)"
# Memory decoding and bus mastering (the command register).
printf '\007' | dd of=$D/config bs=1 seek=4 conv=notrunc 2>/dev/null
echo "DEVLEND-RESULT id=$(devmem $BAR 32)"
# Writes may be posted, and the first one waits for the mirror's first push (all of
# guest RAM that is not zero): poll for the result.
devmem $((BAR + 8)) 32 10
n=0
while [ "$(devmem $((BAR + 8)) 32)" = 0x0000000A ] && [ $n -lt 120 ]; do sleep 0.5; n=$((n + 1)); done
echo "DEVLEND-RESULT fact=$(devmem $((BAR + 8)) 32)"
SRC=$((0x5000000)); DST=$((0x5001000))
i=0
while [ $i -lt 16 ]; do
  devmem $((SRC + 4 * i)) 32 $((0x5a000000 + i * 0x01010101))
  devmem $((DST + 4 * i)) 32 0
  i=$((i + 1))
done
devmem $((BAR + 0x80)) 32 $SRC
devmem $((BAR + 0x88)) 32 $((0x40000))
devmem $((BAR + 0x90)) 32 64
devmem $((BAR + 0x98)) 32 1
n=0
while [ $(( $(devmem $((BAR + 0x98)) 32) & 1 )) = 1 ] && [ $n -lt 120 ]; do sleep 0.5; n=$((n + 1)); done
devmem $((BAR + 0x80)) 32 $((0x40000))
devmem $((BAR + 0x88)) 32 $DST
devmem $((BAR + 0x90)) 32 64
devmem $((BAR + 0x98)) 32 7
# The copy reaches guest RAM when the borrower pulls, at the DMA's interrupt.
check() {
  ok=yes
  i=0
  while [ $i -lt 16 ]; do
    want=$(printf 0x%08X $((0x5a000000 + i * 0x01010101)))
    got=$(devmem $((DST + 4 * i)) 32)
    [ "$got" = "$want" ] || { ok=no; [ -z "$1" ] || echo "word $i: $got, want $want"; }
    i=$((i + 1))
  done
}
n=0
check
while [ $ok = no ] && [ $n -lt 120 ]; do sleep 0.5; n=$((n + 1)); check; done
check show
echo "DEVLEND-RESULT dma=$ok"
"#;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[test]
fn qemu11_guest_uses_a_lent_edu_through_vfio_user() {
    let Some(root) = qemu11::root() else { return };
    let port = free_port();
    let agent = bin("devlend-device-agent");
    let mut b = Guest::builder()
        .name("lender")
        .memory_mib(1024)
        .kernel_arg("intel_iommu=on iommu=pt")
        .args([
            "-machine".to_string(),
            "kernel-irqchip=split".to_string(),
            "-device".to_string(),
            "intel-iommu,intremap=on,caching-mode=on".to_string(),
            "-device".to_string(),
            "edu".to_string(),
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
    let dir = tempfile::tempdir().expect("tempdir");
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            lender
                .wait_for_text("listening", Duration::from_secs(240))
                .expect("the lender listens");
            let target = LinkTarget {
                lender: format!("127.0.0.1:{port}"),
                device: "edu".into(),
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
            let sock = dir.path().join("edu.sock");
            let server = borrower.listen(&sock).expect("listen");
            let handle = borrower.handle();
            let mut borrower = borrower;
            std::thread::spawn(move || borrower.serve(&server));

            std::env::set_var("DEVLEND_QEMU", qemu11::wrapper(dir.path(), &root));
            let device = format!(
                "{{\"driver\":\"vfio-user-pci\",\"socket\":{{\"path\":\"{}\",\"type\":\"unix\"}}}}",
                sock.display()
            );
            let mut vmm = Guest::builder()
                .name("qemu11")
                .memory_mib(128)
                .kernel_arg("iomem=relaxed memmap=1M$0x5000000")
                .args(["-device".to_string(), device])
                .script(VMM_SCRIPT)
                .boot()
                .expect("boot the QEMU 11 guest");
            let out = vmm.wait_done(Duration::from_secs(300));
            for l in vmm.console().lines().filter(|l| {
                l.contains("DEVLEND-RESULT") || l.contains("word ") || l.contains("vfio")
            }) {
                eprintln!("qemu11: {l}");
            }
            let out = out.expect("the QEMU 11 guest's script");
            let get = |k: &str| out.result(k).unwrap_or("").to_string();
            assert_ne!(get("found"), "no", "the guest enumerates 1234:11e8");
            assert_eq!(
                get("id").to_lowercase(),
                "0x010000ed",
                "the edu ID register"
            );
            assert_eq!(get("fact").to_lowercase(), "0x00375f00", "10! = 3628800");
            assert_eq!(get("dma"), "yes", "the DMA copy, through the mirror");
            let pushed = handle
                .stats()
                .pages_pushed
                .load(std::sync::atomic::Ordering::Relaxed);
            let pulled = handle
                .stats()
                .pages_pulled
                .load(std::sync::atomic::Ordering::Relaxed);
            eprintln!("pages pushed {pushed}, pulled {pulled}");
            assert!(pulled >= 1, "the DMA to guest RAM was pulled");
        }));
    for l in lender.console().lines().filter(|l| l.contains("lender: ")) {
        eprintln!("{l}");
    }
    lender.kill();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}
