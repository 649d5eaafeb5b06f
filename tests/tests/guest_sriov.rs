//! One NVMe SSD, two VMs: the lender runs in a TCG guest with intel-iommu and QEMU's
//! emulated NVMe with SR-IOV (`nvme-subsys`, `sriov_max_vfs=2`, flexible queue and
//! interrupt resources, two namespaces detached from every controller, each backed by
//! an image file on the host) behind a PCIe root port (on q35's root bus, QEMU 10 maps
//! no VF BAR that Linux places above 4 GiB). The PF stays on the guest kernel's `nvme` driver; the
//! lender is started with `--device ssd=pci-pf:BDF,vfs=2,namespaces=1:2` and, by
//! itself, enables the VFs, gives each secondary controller queues and interrupts
//! through the PF's admin queue, brings them online, attaches namespace 1 to VF 0's
//! controller and 2 to VF 1's, binds the VFs to vfio-pci and lends them as `ssd-vf0`
//! and `ssd-vf1` (through the NVMe mediator, the default for their class).
//!
//! On the host, two borrowers (one per VF) serve vfio-user, and two QEMU 11 guests
//! with 2 vCPUs each boot at the same time, one per VF. Each guest's own `nvme` driver
//! finds its VF, sees only its own namespace (by its size), writes its own pattern
//! with O_DIRECT, reads it back, then writes it again from both vCPUs at once. After
//! both are done the host finds each pattern in its own namespace's image and not in
//! the other's.
//!
//! Then VF 0 changes hands: a holder enables its controller and is detached while its
//! VMM is still connected; the lender resets the VF (FLR), and the next holder finds
//! its controller disabled with nothing of the first one's queues in its registers, and
//! uses it (enable, an I/O queue, Identify). Asking for the PF, or for a VF the PF does
//! not have, is refused with what the lender has.
//!
//! Needs the QEMU 11 chroot (`tests/src/qemu11.rs`); without it the test says so and
//! passes (`DEVLEND_REQUIRE_QEMU11=1` makes that a failure).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use devlend_backend::pci::{LinkTarget, PciBorrower, PciHandle};
use devlend_qemu::guest::Guest;
use devlend_tests::shared_libraries as libs;
use devlend_tests::{nvme, qemu11};

fn bin(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/release")
        .join(name)
}

const LENDER_SCRIPT: &str = r#"
__INSMOD_NVME__
devlend-modprobe vfio vfio_iommu_type1 vfio_virqfd irqbypass vfio_pci_core vfio_pci
ip link set lo up
ip addr add 10.0.2.15/24 dev eth0
ip link set eth0 up
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/class)" = 0x010802 ] && [ -e $d/sriov_totalvfs ]; then PF=$(basename $d); fi
done
n=0
while [ ! -e /sys/bus/pci/devices/$PF/nvme ] && [ $n -lt 300 ]; do sleep 0.2; n=$((n + 1)); done
echo "sriov: pf=$PF driver=$(basename $(readlink /sys/bus/pci/devices/$PF/driver)) totalvfs=$(cat /sys/bus/pci/devices/$PF/sriov_totalvfs)"
devlend-device-agent --listen 0.0.0.0:7700 --insecure --device ssd=pci-pf:$PF,vfs=2,namespaces=1:2 --log-level info 2>&1 | sed 's/^/lender: /' &
sleep 100000
"#;

/// Runs in each QEMU 11 guest; `__TAG__` names the guest in its pattern.
const VMM_SCRIPT: &str = r#"
__INSMOD_NVME__
n=0
while [ ! -b /dev/nvme0n1 ] && [ $n -lt 600 ]; do sleep 0.5; n=$((n + 1)); done
if [ ! -b /dev/nvme0n1 ]; then echo "DEVLEND-RESULT dev=no"; dmesg | grep -i nvme; exit 1; fi
echo "DEVLEND-RESULT dev=yes"
echo "DEVLEND-RESULT sectors=$(cat /sys/block/nvme0n1/size)"
echo "DEVLEND-RESULT namespaces=$(ls /sys/block | grep -c '^nvme[0-9]*n[0-9]*$')"
i=0
while [ $i -lt 16 ]; do printf "devlend-sriov-__TAG__-%04d-" $i; i=$((i + 1)); done > /tmp/line
: > /tmp/pat
while [ $(stat -c %s /tmp/pat) -lt 65536 ]; do cat /tmp/line >> /tmp/pat; done
dd if=/tmp/pat of=/tmp/pat64 bs=65536 count=1 2>/dev/null
dd if=/tmp/pat64 of=/dev/nvme0n1 bs=4096 seek=256 oflag=direct 2>&1 | tail -1
dd if=/dev/nvme0n1 of=/tmp/back bs=4096 skip=256 count=16 iflag=direct 2>/dev/null
if cmp /tmp/pat64 /tmp/back; then echo "DEVLEND-RESULT verify=ok"; else echo "DEVLEND-RESULT verify=bad"; fi
echo "DEVLEND-RESULT md5=$(md5sum /tmp/pat64 | cut -d' ' -f1)"
# Both vCPUs at once, each on its own I/O queue.
taskset -c 0 dd if=/tmp/pat64 of=/dev/nvme0n1 bs=4096 seek=512 oflag=direct 2>/dev/null &
taskset -c 1 dd if=/tmp/pat64 of=/dev/nvme0n1 bs=4096 seek=1024 oflag=direct 2>/dev/null &
taskset -c 0 dd if=/dev/nvme0n1 of=/dev/null bs=4096 count=64 iflag=direct 2>/dev/null &
wait
ok=ok
for at in 512 1024; do
  dd if=/dev/nvme0n1 of=/tmp/back2 bs=4096 skip=$at count=16 iflag=direct 2>/dev/null
  cmp -s /tmp/pat64 /tmp/back2 || ok=bad
done
echo "DEVLEND-RESULT verify2=$ok"
grep nvme /proc/interrupts
echo "DEVLEND-RESULT io_queues=$(grep -c 'nvme0q[1-9]' /proc/interrupts)"
"#;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn target(port: u16, device: &str, borrower: u8) -> LinkTarget {
    LinkTarget {
        lender: format!("127.0.0.1:{port}"),
        device: device.into(),
        borrower: [borrower; 16],
        token: Vec::new(),
        tls: None,
        timeout: Duration::from_secs(10),
        transport: devlend_fabric::transport::Transport::Tcp,
        lender_key: None,
    }
}

/// Connects to `device`, retrying while the lender is busy (quiescing a VF).
fn connect(port: u16, device: &str, borrower: u8) -> PciBorrower {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        match PciBorrower::connect(&target(port, device, borrower)) {
            Ok(b) => return b,
            Err(e) if Instant::now() < until => {
                eprintln!("borrower {device}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => panic!("borrower {device}: {}", devlend_fabric::error::chain(&e)),
        }
    }
}

/// Serves `borrower` on `sock` in a thread; returns its handle.
fn serve(borrower: PciBorrower, sock: &Path) -> PciHandle {
    let server = borrower.listen(sock).expect("listen");
    let handle = borrower.handle();
    let mut borrower = borrower;
    std::thread::spawn(move || borrower.serve(&server));
    handle
}

fn md5(dir: &Path, b: &[u8]) -> String {
    let p = dir.join("slice");
    std::fs::write(&p, b).expect("write the slice");
    let o = Command::new("md5sum").arg(&p).output().expect("md5sum");
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

const IMAGE_A: u64 = 32 << 20;
const IMAGE_B: u64 = 48 << 20;

#[test]
fn two_vms_use_two_vfs_of_one_nvme_with_their_own_drivers() {
    let Some(root) = qemu11::root() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let images = [dir.path().join("a.img"), dir.path().join("b.img")];
    for (img, size) in images.iter().zip([IMAGE_A, IMAGE_B]) {
        std::fs::File::create(img)
            .and_then(|f| f.set_len(size))
            .expect("the image");
    }
    let modules = qemu11::nvme_modules(dir.path());
    let port = free_port();
    let agent = bin("devlend-device-agent");
    let mut b = Guest::builder()
        .name("sriov-lender")
        .memory_mib(768)
        .kernel_arg("intel_iommu=on iommu=pt")
        .args([
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
            "-drive".to_string(),
            format!("file={},if=none,id=nsa,format=raw", images[0].display()),
            "-device".to_string(),
            "nvme-ns,drive=nsa,bus=nvme0,nsid=1,detached=on".to_string(),
            "-drive".to_string(),
            format!("file={},if=none,id=nsb,format=raw", images[1].display()),
            "-device".to_string(),
            "nvme-ns,drive=nsb,bus=nvme0,nsid=2,detached=on".to_string(),
            "-nic".to_string(),
            format!("user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:{port}-:7700"),
        ])
        .script(LENDER_SCRIPT.replace("__INSMOD_NVME__", qemu11::INSMOD_NVME))
        .host_file("/bin/devlend-device-agent", &agent);
    for (guest_path, host_path) in &modules {
        b = b.host_file(guest_path.clone(), host_path.clone());
    }
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
            .wait_for_text("listening", Duration::from_secs(300))
            .expect("the lender listens");
        scenario(dir.path(), &root, port, &modules, &images);
    }));
    for l in lender
        .console()
        .lines()
        .filter(|l| l.contains("lender: ") || l.contains("sriov: "))
    {
        eprintln!("{l}");
    }
    lender.kill();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

fn scenario(
    dir: &Path,
    root: &Path,
    port: u16,
    modules: &[(String, PathBuf)],
    images: &[PathBuf; 2],
) {
    // The PF is the lender's, and a VF past the two it has does not exist.
    for (asked, said) in [
        ("ssd", "borrow one of its VFs, ssd-vf0 to ssd-vf1"),
        ("ssd-vf2", "has VFs ssd-vf0 to ssd-vf1 only"),
    ] {
        let Err(e) = PciBorrower::connect(&target(port, asked, 7)) else {
            panic!("{asked}: lent")
        };
        let msg = devlend_fabric::error::chain(&e);
        assert!(msg.contains(said), "{asked}: {msg}");
    }

    let handles: Vec<PciHandle> = ["ssd-vf0", "ssd-vf1"]
        .iter()
        .enumerate()
        .map(|(i, vf)| {
            let b = connect(port, vf, i as u8 + 1);
            assert!(b.handle().mediated(), "{vf}: an NVMe VF is mediated");
            serve(b, &dir.join(format!("{vf}.sock")))
        })
        .collect();

    std::env::set_var("DEVLEND_QEMU", qemu11::wrapper(dir, root));
    let mut vms: Vec<Guest> = ["a", "b"]
        .iter()
        .enumerate()
        .map(|(i, tag)| {
            let device = format!(
                "{{\"driver\":\"vfio-user-pci\",\"socket\":{{\"path\":\"{}\",\"type\":\"unix\"}}}}",
                dir.join(format!("ssd-vf{i}.sock")).display()
            );
            let script = VMM_SCRIPT
                .replace("__INSMOD_NVME__", qemu11::INSMOD_NVME)
                .replace("__TAG__", tag);
            let mut vb = Guest::builder()
                .name(format!("vm-{tag}"))
                .memory_mib(256)
                .vcpus(2)
                .args(["-device".to_string(), device])
                .script(script);
            for (guest_path, host_path) in modules {
                vb = vb.host_file(guest_path.clone(), host_path.clone());
            }
            vb.boot().expect("boot a QEMU 11 guest")
        })
        .collect();
    let mut md5s = Vec::new();
    for ((vm, tag), size) in vms.iter_mut().zip(["a", "b"]).zip([IMAGE_A, IMAGE_B]) {
        let out = vm.wait_done(Duration::from_secs(900));
        for l in vm
            .console()
            .lines()
            .filter(|l| l.contains("DEVLEND-RESULT") || l.contains("nvme"))
        {
            eprintln!("vm-{tag}: {l}");
        }
        let out = out.expect("the QEMU 11 guest's script");
        let get = |k: &str| out.result(k).unwrap_or("").to_string();
        assert_eq!(
            get("dev"),
            "yes",
            "vm-{tag}: its nvme driver shows /dev/nvme0n1"
        );
        assert_eq!(
            get("sectors"),
            (size / 512).to_string(),
            "vm-{tag} sees its own namespace"
        );
        assert_eq!(get("namespaces"), "1", "vm-{tag} sees one namespace only");
        assert_eq!(get("verify"), "ok", "vm-{tag}: the pattern read back");
        assert_eq!(get("verify2"), "ok", "vm-{tag}: the patterns of both vCPUs");
        assert_eq!(
            get("io_queues"),
            "2",
            "vm-{tag}: an I/O queue per vCPU (the VF has 4 queues and 3 interrupts)"
        );
        md5s.push(get("md5"));
    }
    for (i, img) in images.iter().enumerate() {
        let data = std::fs::read(img).expect("read the image");
        for at in [256usize, 512, 1024] {
            let at = at * 4096;
            assert_eq!(
                md5(dir, &data[at..at + 65536]),
                md5s[i],
                "namespace {} holds its guest's pattern at byte {at}",
                i + 1
            );
        }
        let other = ["b", "a"][i];
        assert!(
            !contains(&data, format!("devlend-sriov-{other}-").as_bytes()),
            "namespace {} holds nothing of vm-{other}",
            i + 1
        );
    }
    for (i, h) in handles.iter().enumerate() {
        let c = h.link_counters();
        eprintln!(
            "ssd-vf{i}: {} messages, {} bytes sent; {} bytes received",
            c.msgs_sent.load(std::sync::atomic::Ordering::Relaxed),
            c.bytes_sent.load(std::sync::atomic::Ordering::Relaxed),
            c.bytes_received.load(std::sync::atomic::Ordering::Relaxed)
        );
    }

    // VF 0 changes hands. A holder enables its controller and creates queues, and
    // is detached while its VMM is still connected (so that no reset comes from the
    // VMM); the next holder finds the VF reset, and working.
    handles[0].disconnect();
    let first = serve(connect(port, "ssd-vf0", 3), &dir.join("first.sock"));
    let mut d = nvme::start(&dir.join("first.sock"));
    assert_eq!(d.r32(0x1c) & 1, 1, "the first holder's controller is ready");
    first.disconnect();
    drop(d);
    let next = serve(connect(port, "ssd-vf0", 4), &dir.join("next.sock"));
    let mut d = nvme::join(&dir.join("next.sock"));
    let regs: Vec<(u64, u32)> = [0x14u64, 0x1c, 0x24, 0x28, 0x30]
        .iter()
        .map(|&o| (o, d.r32(o)))
        .collect();
    assert!(
        regs.iter().all(|&(_, v)| v == 0),
        "CC, CSTS, AQA, ASQ and ACQ of a VF lent again: {regs:x?}"
    );
    d.enable();
    d.create_io_queue();
    let ident = d.ok(
        false,
        nvme::sqe(0x06, 0, nvme::IOVA + nvme::IDENT, 0, [1, 0, 0, 0, 0, 0]),
        "Identify Controller",
    );
    assert_eq!(ident.status, 0);
    let id = d.mem.read(nvme::IDENT, 4096);
    assert_eq!(
        &id[4..7],
        b"pf0",
        "the VF's controller has the subsystem's serial"
    );
    drop(d);
    next.disconnect();
    handles[1].disconnect();
}
