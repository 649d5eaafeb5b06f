//! PCIe lending over RDMA, on real verbs and real VFIO: one QEMU TCG guest has a
//! virtual IOMMU (intel-iommu) with QEMU's `edu` device bound to vfio-pci, and
//! Soft-RoCE (rdma_rxe) on a dummy interface. In it, the lender serves `edu` with
//! `--transport rdma`, the compute agent borrows it with `devlend attach --kind pci
//! --transport rdma`, and `devlend-edu-vmm` (the `vfio_user` crate's `Client`) acts as the
//! VMM on its vfio-user socket: config space 1234:11e8, the ID register, 10! with its
//! MSI, and eight pages copied through the card's DMA engine and back, then three more.
//!
//! Over RDMA no page travels in a message (a message holds at most 2048 bytes): the
//! lender RDMA-READs the changed guest pages into the mirror before a BAR write and
//! RDMA-WRITEs the pages the card changed into guest memory before the interrupt, so
//! the bytes coming back right is the one-sided path working.
//!
//! An emulated NVMe controller in the same guest is lent through the NVMe mediator over
//! RDMA: `devlend-nvme-vmm` (a userspace NVMe driver on the vfio-user socket) runs
//! IDENTIFY, a 16 KiB WRITE through a PRP list and a READ back, and a misaligned PRP
//! that must be refused; every fetch and push of the mediator is an RDMA READ or WRITE
//! of the registered guest memory; the image on the host holds the data.
//!
//! Also: a second borrower is refused while the first holds the function; after a
//! detach the lender quiesces the function and lends it again over RDMA, and it works;
//! a lender shutdown ends the PCI session over RDMA; a lender that requires TLS refuses
//! the function over RDMA (which has no TLS).

use std::path::PathBuf;
use std::time::Duration;

use devlend_qemu::guest::Guest;

/// Bytes of the emulated NVMe's image (512-byte LBAs).
const IMAGE: u64 = 8 << 20;

fn bin(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/release")
        .join(name)
}

const SCRIPT: &str = r#"
set -e
devlend-modprobe vfio vfio_iommu_type1 vfio_virqfd irqbypass vfio_pci_core vfio_pci
devlend-modprobe crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe iw_cm ib_cm configfs rdma_cm rdma_ucm dummy
ip link set lo up
ip link add d0 type dummy
ip addr add 10.9.0.1/24 dev d0
ip link set d0 up
rdma link add rxe0 type rxe netdev d0
BDF=
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/vendor)" = 0x1234 ] && [ "$(cat $d/device)" = 0x11e8 ]; then BDF=$(basename $d); fi
done
[ -n "$BDF" ] || { echo "no edu device"; exit 1; }
echo vfio-pci > /sys/bus/pci/devices/$BDF/driver_override
echo $BDF > /sys/bus/pci/drivers_probe
NVME=
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/class)" = 0x010802 ]; then NVME=$(basename $d); fi
done
[ -n "$NVME" ] || { echo "no NVMe controller"; exit 1; }
echo vfio-pci > /sys/bus/pci/devices/$NVME/driver_override
echo $NVME > /sys/bus/pci/drivers_probe
mkdir -p /run/devlend
devlend-device-agent --listen 10.9.0.1:7700 --insecure --transport rdma --device edu=pci:$BDF --device ssd0=pci:$NVME --log-level info >> /tmp/lender.log 2>&1 &
LPID=$!
devlend-compute-agent --api /run/devlend/ca.sock --log-level info > /tmp/ca.log 2>&1 &
devlend-wait-for /run/devlend/ca.sock 30
sleep 1
attach() {
  devlend attach --api /run/devlend/ca.sock --lender 10.9.0.1:7700 --device edu --id $1 --socket /run/devlend/$1.sock --kind pci --transport rdma
}
attach edu > /tmp/attach.out
grep -q vfio-user-pci /tmp/attach.out && echo "DEVLEND-RESULT printed_qemu=yes"
devlend-edu-vmm /run/devlend/edu.sock
if attach edu2 > /tmp/attach2.out 2>&1; then echo "DEVLEND-RESULT second=attached"; else echo "DEVLEND-RESULT second=refused"; sed 's/^/second: /' /tmp/attach2.out; fi
devlend detach --api /run/devlend/ca.sock edu > /dev/null
attach again > /dev/null
echo "DEVLEND-RESULT round=2"
devlend-edu-vmm /run/devlend/again.sock
# The NVMe controller, mediated (the default for class 01:08:02), over RDMA.
devlend attach --api /run/devlend/ca.sock --lender 10.9.0.1:7700 --device ssd0 --id ssd --socket /run/devlend/ssd.sock --kind pci --transport rdma > /dev/null
devlend-nvme-vmm /run/devlend/ssd.sock IMAGE_BYTES
devlend detach --api /run/devlend/ca.sock ssd > /dev/null
sleep 1
grep 'NVMe mediator ends' /tmp/lender.log | tail -n 1 | sed 's/^/mediator: /'
echo "DEVLEND-RESULT rdma_pci_sessions=$(grep -c 'RDMA session opened.*kind=pci' /tmp/lender.log)"
echo "DEVLEND-RESULT quiesced=$(grep -c 'function quiesced for the next borrower' /tmp/lender.log)"
kill -TERM $LPID
wait $LPID || true
echo "DEVLEND-RESULT stopped=$(grep -c 'PCI session over RDMA stopped' /tmp/lender.log)"
sleep 1
devlend --api /run/devlend/ca.sock status --json > /tmp/status.json
if grep -q -E '"lender_lost": ?true' /tmp/status.json; then echo "DEVLEND-RESULT lost_shown=yes"; else echo "DEVLEND-RESULT lost_shown=no"; cat /tmp/status.json; fi
devlend --api /run/devlend/ca.sock status | grep -q lender-lost && echo "DEVLEND-RESULT lost_table=yes"
# A lender that requires TLS lends no PCIe function over RDMA (RDMA has no TLS).
devlend-device-agent --listen 10.9.0.1:7700 --insecure --transport rdma --device edu=pci:$BDF --tls-cert /certs/lender.crt --tls-key /certs/lender.key --log-level info >> /tmp/lender-tls.log 2>&1 &
LPID=$!
sleep 2
if attach tls > /tmp/attach-tls.out 2>&1; then echo "DEVLEND-RESULT tls_rdma=attached"; else echo "DEVLEND-RESULT tls_rdma=refused"; sed 's/^/tls: /' /tmp/attach-tls.out; fi
kill -TERM $LPID
wait $LPID || true
tail -n 25 /tmp/lender.log | sed 's/^/lender: /'
grep -i -E 'warn|error' /tmp/ca.log | tail -n 10 | sed 's/^/borrower: /' || true
"#;

#[test]
fn pcie_functions_are_lent_over_rdma_one_sided() {
    let names = ["devlend", "devlend-device-agent", "devlend-compute-agent"];
    let mut bins: Vec<(&str, PathBuf)> = names.iter().map(|n| (*n, bin(n))).collect();
    for (n, p) in &bins {
        assert!(p.exists(), "{n} is missing: cargo build --release");
    }
    bins.push((
        "devlend-edu-vmm",
        PathBuf::from(env!("CARGO_BIN_EXE_devlend-edu-vmm")),
    ));
    bins.push((
        "devlend-nvme-vmm",
        PathBuf::from(env!("CARGO_BIN_EXE_devlend-nvme-vmm")),
    ));
    bins.push(("rdma", PathBuf::from("/usr/bin/rdma")));
    let dir = tempfile::tempdir().expect("tempdir");
    let image = dir.path().join("nvme.img");
    std::fs::write(&image, vec![0u8; IMAGE as usize]).expect("the NVMe image");
    let b = Guest::builder()
        .name("vfio-rdma")
        // The initramfs holds four devlend binaries with debug info (~350 MB).
        .memory_mib(1536)
        .vcpus(2)
        .kernel_arg("intel_iommu=on iommu=pt")
        .args([
            "-machine",
            "kernel-irqchip=split",
            "-device",
            "intel-iommu,intremap=on,caching-mode=on",
            "-device",
            "edu",
            "-drive",
            &format!("file={},if=none,id=nv0,format=raw", image.display()),
            "-device",
            "nvme,serial=lend0,drive=nv0",
        ])
        .script(SCRIPT.replace("IMAGE_BYTES", &IMAGE.to_string()));
    let b = devlend_tests::with_host_binaries(
        b,
        &bins,
        &[
            "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so",
            "/etc/libibverbs.d/rxe.driver",
        ],
    );
    let certs_dir = tempfile::tempdir().expect("tempdir");
    let certs = devlend_tests::certs::Certs::make(certs_dir.path()).expect("certificates");
    let b = b
        .host_file("/certs/lender.crt", certs.path("lender.crt"))
        .host_file("/certs/lender.key", certs.path("lender.key"));
    let mut guest = b.boot().expect("boot");
    let out = guest.wait_done(Duration::from_secs(600)).expect("guest");
    if std::env::var_os("DEVLEND_CONSOLE").is_some() {
        eprintln!("{}", guest.console());
    }
    for l in guest.console().lines().filter(|l| {
        l.contains("DEVLEND-RESULT")
            || l.contains("lender: ")
            || l.contains("borrower: ")
            || l.contains("second: ")
            || l.contains("tls: ")
            || l.contains("mediator: ")
            || l.contains("panicked")
    }) {
        eprintln!("{l}");
    }
    out.check_success().expect("the guest's script");
    assert_eq!(
        out.result("printed_qemu"),
        Some("yes"),
        "attach prints QEMU 11's argument"
    );
    assert_eq!(
        out.result("edu_ids"),
        Some("0x11e81234"),
        "vendor and device ID"
    );
    assert_eq!(
        out.result("edu_id_register"),
        Some("0x010000ed"),
        "the edu ID register"
    );
    assert_eq!(
        out.result("edu_factorial_10"),
        Some("3628800"),
        "10! with its MSI"
    );
    assert_eq!(out.result("edu_dma_map"), Some("ok"));
    assert_eq!(
        out.result("edu_dma_wrong_bytes"),
        Some("0"),
        "eight pages through the card and back over RDMA"
    );
    assert_eq!(
        out.result("edu_dma_wrong_bytes_again"),
        Some("0"),
        "three more, with the mirror already in sync"
    );
    // The NVMe controller through the mediator, over RDMA.
    assert_eq!(out.result("nvme_vid"), Some("1b36"), "IDENTIFY controller");
    assert_eq!(
        out.result("nvme_namespace_bytes"),
        Some(IMAGE.to_string().as_str()),
        "IDENTIFY namespace: the image's size"
    );
    assert_eq!(
        out.result("nvme_wrong_bytes"),
        Some("0"),
        "16 KiB written and read back"
    );
    assert_eq!(
        out.result("nvme_misaligned_prp"),
        Some("(0, 19)"),
        "a misaligned PRP refused with PRP Offset Invalid"
    );
    let img = std::fs::read(&image).expect("the image");
    let pattern: Vec<u8> = (0..16384u32)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add((i >> 9) as u8))
        .collect();
    assert!(
        img[8 * 512..8 * 512 + 16384] == pattern[..],
        "the lender's image holds the 16 KiB written at LBA 8"
    );
    assert_eq!(
        out.result("second"),
        Some("refused"),
        "a second borrower while the first holds the function"
    );
    assert_eq!(out.result("round"), Some("2"), "lent again after a detach");
    let sessions: u32 = out
        .result("rdma_pci_sessions")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(sessions >= 2, "PCI sessions opened over RDMA: {sessions}");
    let quiesced: u32 = out
        .result("quiesced")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(quiesced >= 1, "the function was quiesced after the detach");
    assert_eq!(
        out.result("lost_shown"),
        Some("yes"),
        "status says the lender is lost once the function's session is gone"
    );
    assert_eq!(
        out.result("lost_table"),
        Some("yes"),
        "and the table says so"
    );
    assert_eq!(
        out.result("tls_rdma"),
        Some("refused"),
        "a lender that requires TLS does not lend a PCIe function over plain RDMA"
    );
    assert_eq!(
        out.result("stopped"),
        Some("1"),
        "the lender's shutdown stopped the session of the attachment still open"
    );
}
