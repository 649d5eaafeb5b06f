//! The lender's guest of the SR-IOV tests and benchmark: a TCG guest with intel-iommu
//! and QEMU's emulated NVMe with SR-IOV (`nvme-subsys`, `sriov_max_vfs=2`, 8 flexible
//! queues and 6 interrupts: 4 and 3 per VF) behind a PCIe root port (on q35's root
//! bus, QEMU 10 maps no VF BAR that Linux places above 4 GiB), one namespace per image
//! file on the host, and the guest kernel's `nvme` driver for the PF. Its script starts
//! with [`PRELUDE`], which leaves the PF's address in `$PF`.

use std::path::{Path, PathBuf};

use devlend_qemu::guest::{Guest, GuestBuilder};

use crate::qemu11;

/// Loads the NVMe and VFIO modules, brings the network up (with a default route: QEMU's
/// user network hands the guest a forwarded connection from a source that is not
/// loopback with that source address), and sets `$PF` to the NVMe PF, on its driver.
pub const PRELUDE: &str = r#"
__INSMOD_NVME__
devlend-modprobe vfio vfio_iommu_type1 vfio_virqfd irqbypass vfio_pci_core vfio_pci
ip link set lo up
ip addr add 10.0.2.15/24 dev eth0
ip link set eth0 up
ip route add default via 10.0.2.2
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/class)" = 0x010802 ] && [ -e $d/sriov_totalvfs ]; then PF=$(basename $d); fi
done
n=0
while [ ! -e /sys/bus/pci/devices/$PF/nvme ] && [ $n -lt 300 ]; do sleep 0.2; n=$((n + 1)); done
echo "sriov: pf=$PF driver=$(basename $(readlink /sys/bus/pci/devices/$PF/driver)) totalvfs=$(cat /sys/bus/pci/devices/$PF/sriov_totalvfs)"
"#;

/// A builder of the lender's guest: `images` become namespaces 1, 2, ...; `detached`:
/// attached to no controller at first (the lender attaches them to VFs), else to the
/// PF; the guest's port 7700 is forwarded from `port` on every host address.
/// `script` runs after [`PRELUDE`]; `modules` are [`qemu11::nvme_modules`].
pub fn lender(
    name: &str,
    images: &[PathBuf],
    detached: bool,
    port: u16,
    modules: &[(String, PathBuf)],
    script: &str,
) -> GuestBuilder {
    let mut args = vec![
        "-machine".to_string(),
        "kernel-irqchip=split".to_string(),
        "-device".to_string(),
        "intel-iommu,intremap=on,caching-mode=on".to_string(),
        "-device".to_string(),
        "nvme-subsys,id=subsys0".to_string(),
        "-device".to_string(),
        "pcie-root-port,id=sriov-rp,chassis=9,slot=9".to_string(),
        "-device".to_string(),
        "nvme,id=nvme0,bus=sriov-rp,serial=pf0,subsys=subsys0,sriov_max_vfs=2,sriov_vq_flexible=8,sriov_vi_flexible=6"
            .to_string(),
    ];
    for (i, img) in images.iter().enumerate() {
        args.push("-drive".into());
        args.push(format!(
            "file={},if=none,id=ns{i},format=raw",
            img.display()
        ));
        args.push("-device".into());
        args.push(format!(
            "nvme-ns,drive=ns{i},bus=nvme0,nsid={},detached={}",
            i + 1,
            if detached { "on" } else { "off" }
        ));
    }
    args.push("-nic".into());
    args.push(format!(
        "user,model=virtio-net-pci,hostfwd=tcp:0.0.0.0:{port}-:7700"
    ));
    let agent = crate::agents::bin("devlend-device-agent").expect("the device agent");
    let mut b = Guest::builder()
        .name(name)
        .memory_mib(768)
        .kernel_arg("intel_iommu=on iommu=pt")
        .args(args)
        .script(format!(
            "{}{script}",
            PRELUDE.replace("__INSMOD_NVME__", qemu11::INSMOD_NVME)
        ));
    b = with_binary(b, "/bin/devlend-device-agent", &agent);
    for (guest_path, host_path) in modules {
        b = b.host_file(guest_path.clone(), host_path.clone());
    }
    b
}

/// `b` with the host binary `path` at `guest_path`, and the shared libraries it needs.
pub fn with_binary(mut b: GuestBuilder, guest_path: &str, path: &Path) -> GuestBuilder {
    b = b.host_file(guest_path, path);
    let mut files = crate::shared_libraries(path);
    files.push("/lib64/ld-linux-x86-64.so.2".into());
    files.sort();
    files.dedup();
    for f in files {
        b = b.host_file(f.clone(), f);
    }
    b
}

/// What a borrower `id` (its 16 bytes all `id`) dials for `device` at the lender on
/// `127.0.0.1:port`: TCP, no token, no TLS.
pub fn target(port: u16, device: &str, id: u8) -> devlend_backend::pci::LinkTarget {
    devlend_backend::pci::LinkTarget {
        lender: format!("127.0.0.1:{port}"),
        device: device.into(),
        borrower: [id; 16],
        token: Vec::new(),
        tls: None,
        timeout: std::time::Duration::from_secs(10),
        transport: devlend_fabric::transport::Transport::Tcp,
        lender_key: None,
        holder: None,
    }
}

/// Borrows `device` from the lender at `127.0.0.1:port` as borrower `id` (retrying for
/// up to 60 s while the lender starts or quiesces it) and serves it over vfio-user at
/// `sock`, in a thread; returns its handle.
pub fn borrow(port: u16, device: &str, id: u8, sock: &Path) -> devlend_backend::pci::PciHandle {
    use devlend_backend::pci::PciBorrower;
    let target = target(port, device, id);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let borrower = loop {
        match PciBorrower::connect(&target) {
            Ok(b) => break b,
            Err(e) if std::time::Instant::now() < until => {
                eprintln!("borrower {device}: {e}; retrying");
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            Err(e) => panic!("borrower {device}: {}", devlend_fabric::error::chain(&e)),
        }
    };
    let server = borrower.listen(sock).expect("listen");
    let handle = borrower.handle();
    let mut borrower = borrower;
    std::thread::spawn(move || borrower.serve(&server));
    handle
}
