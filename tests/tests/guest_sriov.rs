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
//! A first lender readies the VFs and is killed with SIGKILL; a second one, on the same
//! configuration, finds them ready (nothing enabled, assigned or brought online again)
//! and lends the same functions under the same names.
//!
//! The lender registers with a pool on the host (reached at 10.0.2.2): the pool lists
//! one item per VF, of the VF's class, with the traits `NVME` (the spec's), `SRIOV_VF`
//! and `PF_SSD`. Two compute hosts, each a compute agent in a network namespace of its
//! own (A under this host's name, B as `host-b`), each lease a VF of PF `ssd` through
//! the pool (`devlend attach --class PCI_1B36_0010 --trait SRIOV_VF --trait PF_SSD
//! --kind pci`) and get the two VFs; two QEMU 11 guests with 2 vCPUs each boot at the
//! same time, one on each compute agent's socket. Each guest's own `nvme` driver
//! finds its VF, sees only its own namespace (by its size), writes its own pattern
//! with O_DIRECT, reads it back, then writes it again from both vCPUs at once, on an
//! I/O queue each. After both are done the host finds each pattern in its own
//! namespace's image and not in the other's.
//!
//! The same lender guest has an emulated `igb` NIC (SR-IOV) behind another root port,
//! its PF on the `igb` driver, lent as `nic=pci-pf:BDF,vfs=1`: the lender enables its
//! VF without virtualization management, binds it and the pool lists it (`PF_NIC`). At
//! the end a QEMU 11 guest on host B leases the VF (the generic mirror), and its own
//! `igbvf` driver pings the PF's address and sends 64 KiB over TCP to a listener there,
//! which finds the same md5. The transfer may take up to 3 connections: in the full
//! suite (not alone) its connection has been reset after about ten segments, the
//! sender's socket gone in 4 s with no FIN_WAIT2 or TIME_WAIT; the cause is not found
//! yet. Each connection's bytes are a file of their own on the lender, and only one
//! that holds all 64 KiB is reported.
//!
//! Then host A's VF changes hands through the pool: a holder enables its controller and
//! is detached while its VMM is still connected; the lender resets the VF (FLR), and the next holder finds
//! its controller disabled with nothing of the first one's queues in its registers, and
//! uses it (enable, an I/O queue, Identify). Asking for the PF, or for a VF the PF does
//! not have, is refused with what the lender has.
//!
//! Limits: the PF has `iops_read=100`, which its VFs' holders share. A test driver on
//! host A's VF sends 200 reads with one doorbell (about 100/s), then on both VFs at
//! once (the sum about 100/s, each its share); a lease of `--max-iops 40` holds its VF
//! to that; a lease with limits on the igb VF, which the lender mirrors and so cannot
//! hold to any, is refused.
//!
//! Why this file is over 600 lines: one test, so that every check runs on one boot of
//! the lender's guest (its NVMe and igb PFs, their VFs, the pool, two compute hosts):
//! the scripts (about 110 lines), the compute hosts (about 110), the test's setup
//! (about 210), the scenario (about 190) and the full queue of writes (about 70); the
//! limits are in `guest_sriov/limits.rs`.
//!
//! Needs the QEMU 11 chroot (`tests/src/qemu11.rs`); without it the test says so and
//! passes (`DEVLEND_REQUIRE_QEMU11=1` makes that a failure).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use devlend_backend::pci::PciBorrower;
use devlend_pool::api::{DeviceQuery, DeviceState, Role};
use devlend_qemu::guest::Guest;
use devlend_tests::agents::{free_port, Borrower, Pool};
use devlend_tests::netns::{ip, Netns};
use devlend_tests::{nvme, qemu11, sriov};

/// The limits' checks (a file of its own: this one holds the rest of the test).
#[path = "guest_sriov/limits.rs"]
mod limits;

fn bin(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/release")
        .join(name)
}

/// Runs after `sriov::PRELUDE` in the lender's guest: a first lender readies the VFs
/// and is killed (SIGKILL) once it listens; a second one, on the same configuration,
/// finds them ready and lends them.
const LENDER_SCRIPT: &str = r#"
for m in dca i2c-algo-bit igb; do insmod /kmod/$m.ko || echo "insmod $m failed"; done
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/vendor)" = 0x8086 ] && [ "$(cat $d/device)" = 0x10c9 ]; then IGB=$(basename $d); fi
done
n=0
while [ ! -d /sys/bus/pci/devices/$IGB/net ] && [ $n -lt 300 ]; do sleep 0.2; n=$((n + 1)); done
IF=$(ls /sys/bus/pci/devices/$IGB/net)
ip addr add 192.168.77.1/24 dev $IF
ip link set $IF up
echo "sriov: igb pf=$IGB if=$IF"
DEV="--config /lender.toml --device ssd=pci-pf:$PF,vfs=2,namespaces=1:2,iops_read=__PF_IOPS__,traits=NVME --device nic=pci-pf:$IGB,vfs=1 --log-level info"
devlend-device-agent $DEV > /tmp/first.log 2>&1 &
n=0
while ! grep -q "addr=0.0.0.0:7700" /tmp/first.log && [ $n -lt 600 ]; do sleep 0.2; n=$((n + 1)); done
sed 's/^/first: /' /tmp/first.log
killall -9 devlend-device-agent
sleep 1
devlend-device-agent $DEV > /tmp/second.log 2>&1 &
n=0
while ! grep -q "addr=0.0.0.0:7700" /tmp/second.log && [ $n -lt 600 ]; do sleep 0.2; n=$((n + 1)); done
sed 's/^/second: /' /tmp/second.log
# Each connection's bytes go to a file of their own; the first that holds all 64 KiB
# is reported (not at its end of stream: the sender's guest may power off before its
# FIN gets through). One that ends short is reported, and the next one taken.
(i=0
 while [ $i -lt 3 ]; do
   i=$((i + 1))
   timeout 1800 nc -l -p 5000 > /tmp/recv.$i &
   pid=$!
   while [ "$(stat -c %s /tmp/recv.$i 2>/dev/null)" != 65536 ] && kill -0 $pid 2>/dev/null; do sleep 0.5; done
   if [ "$(stat -c %s /tmp/recv.$i)" = 65536 ]; then
     echo "sriov: received $(md5sum /tmp/recv.$i | cut -d' ' -f1) 65536"
     break
   fi
   echo "sriov: connection $i ended after $(stat -c %s /tmp/recv.$i) bytes"
 done) &
echo "sriov: the second lender is up"
tail -n 0 -f /tmp/second.log | sed 's/^/lender: /' &
sleep 100000
"#;

/// Runs in the QEMU 11 guest on the igb VF: its own `igbvf` driver, pings to the PF's
/// address on the lender (until 3 are answered, within 2 min), and 64 KiB over TCP to a
/// listener there.
const IGBVF_SCRIPT: &str = r#"
insmod /kmod/igbvf.ko || echo "insmod igbvf failed"
n=0
while [ ! -e /sys/class/net/eth0 ] && [ $n -lt 600 ]; do sleep 0.5; n=$((n + 1)); done
echo "DEVLEND-RESULT mac=$(cat /sys/class/net/eth0/address)"
ip link set eth0 up
ip addr add 192.168.77.2/24 dev eth0
n=0
while [ "$(cat /sys/class/net/eth0/carrier 2>/dev/null)" != 1 ] && [ $n -lt 300 ]; do sleep 0.2; n=$((n + 1)); done
got=0; n=0
while [ $got -lt 3 ] && [ $n -lt 60 ]; do
  if ping -c 1 -W 2 192.168.77.1 > /dev/null 2>&1; then got=$((got + 1)); fi
  n=$((n + 1))
done
echo "DEVLEND-RESULT pings=$got of $n"
dd if=/dev/urandom of=/tmp/up bs=1K count=64 2>/dev/null
echo "DEVLEND-RESULT md5=$(md5sum /tmp/up | cut -d' ' -f1)"
t0=$(date +%s)
# Up to 3 connections: one the lender's side resets (it ends with no FIN_WAIT2 or
# TIME_WAIT socket to port 5000, 1388 in /proc/net/tcp) is sent again. In the full
# suite a connection has been reset after about ten segments (cause not found yet);
# the lender reports only a connection that brought all 64 KiB.
attempt=0
sent=no
while [ $attempt -lt 3 ]; do
  attempt=$((attempt + 1))
  nc 192.168.77.1 5000 < /tmp/up && sent=yes
  # What nc wrote may still be in this kernel's send queue, unacknowledged: let it go
  # before power-off (a frame the mirror's pull delivers half-written is dropped, and
  # TCP's retransmission timer backs off: under load a transfer has taken 3 minutes).
  # Busy: a socket with bytes queued, or one established or closing (01, 04, 08, 09, 0B).
  n=0
  while [ $n -lt 1500 ] && awk 'NR > 1 { split($5, q, ":"); if (q[1] != "00000000" || $4 ~ /^(01|04|08|09|0B)$/) busy = 1 } END { exit !busy }' /proc/net/tcp; do sleep 0.2; n=$((n + 1)); done
  awk 'NR > 1 && $3 ~ /:1388$/ && ($4 == "05" || $4 == "06") { ok = 1 } END { exit !ok }' /proc/net/tcp && break
  echo "sriov: connection $attempt was reset ($(( $(date +%s) - t0 )) s)"
done
echo "DEVLEND-RESULT sent=$sent"
echo "DEVLEND-RESULT connections=$attempt"
echo "DEVLEND-RESULT seconds=$(( $(date +%s) - t0 ))"
for c in rx_packets tx_packets rx_dropped rx_errors tx_errors; do printf "%s=%s " $c $(cat /sys/class/net/eth0/statistics/$c); done; echo
dmesg | grep -i igbvf | tail -20
"#;

/// Runs in each QEMU 11 guest after `qemu11::nvme_guest_prelude`; `__TAG__` names the
/// guest in its pattern.
const VMM_SCRIPT: &str = r#"
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

/// Two compute hosts, A (this host's name) and B (`host-b`), each a compute agent in a
/// network namespace of its own, routed to this host (the pool, the lender's port).
struct Host {
    ns: Netns,
    dir: PathBuf,
    name: Option<&'static str>,
    agent: Borrower,
}

impl Host {
    fn new(parent: &Path, n: u8, name: Option<&'static str>) -> Host {
        let ns = Netns::new(n).expect("a network namespace");
        ip(&[
            "-n",
            &ns.name,
            "route",
            "add",
            "default",
            "via",
            &ns.host_ip,
        ])
        .expect("route");
        let dir = parent.join(format!("host{n}"));
        std::fs::create_dir_all(&dir).expect("the host's directory");
        let agent = Borrower::start_in(&dir, Some(&ns.name), &format!("compute-{n}"), &[])
            .expect("a compute agent");
        Host {
            ns,
            dir,
            name,
            agent,
        }
    }

    /// `devlend attach --kind pci` of a VF of PF `ssd` placed by the pool, for `vm`;
    /// the attachment's JSON. The CLI runs under this host's name (a UTS namespace for
    /// B), as it would on that host.
    fn attach_vf(&self, pool_port: u16, vm: &str, sock: &Path) -> serde_json::Value {
        self.attach(pool_port, vm, sock, "PCI_1B36_0010", "PF_SSD", &[])
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `devlend attach --kind pci` of a function of `class` with `SRIOV_VF` and
    /// `pf_trait`, placed by the pool, with `extra` arguments (a lease's limits); the
    /// attachment's JSON, or what the CLI and the compute agent said.
    fn attach(
        &self,
        pool_port: u16,
        vm: &str,
        sock: &Path,
        class: &str,
        pf_trait: &str,
        extra: &[&str],
    ) -> Result<serde_json::Value, String> {
        let mut cmd = match self.name {
            None => Command::new(bin("devlend")),
            Some(h) => {
                let mut c = Command::new("unshare");
                c.args([
                    "--uts",
                    "sh",
                    "-c",
                    &format!("hostname {h} && exec \"$0\" \"$@\""),
                ])
                .arg(bin("devlend"));
                c
            }
        };
        let out = cmd
            .arg("--api")
            .arg(&self.agent.api)
            .args(["attach", "--class", class, "--trait", "SRIOV_VF"])
            .args(["--trait", pf_trait, "--kind", "pci", "--vm", vm, "--pool"])
            .arg(format!("http://{}:{pool_port}", self.ns.host_ip))
            .arg("--pool-key")
            .arg(Borrower::pool_key(&self.dir))
            .arg("--socket")
            .arg(sock)
            .arg("--json")
            .args(extra)
            .output()
            .expect("devlend attach");
        if !out.status.success() {
            return Err(format!(
                "attach on {:?}: {}\n{}",
                self.name,
                String::from_utf8_lossy(&out.stderr),
                self.agent.proc.log()
            ));
        }
        Ok(serde_json::from_slice(&out.stdout).expect("the attachment's JSON"))
    }

    fn detach(&self, sock: &Path) {
        let out = self
            .agent
            .cli(&["detach", &sock.display().to_string()])
            .expect("devlend detach");
        assert!(
            out.status.success(),
            "detach: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
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
    let port = free_port().expect("a port");
    // The pool, on every address of this host: the lender's guest reaches it at
    // 10.0.2.2 (QEMU's user network: this host's loopback), the compute hosts at their
    // namespaces' host addresses.
    let pool_port = free_port().expect("a port");
    let pool = Pool::serve(
        dir.path(),
        "pool",
        &format!("0.0.0.0:{pool_port}"),
        &format!("http://127.0.0.1:{pool_port}"),
        &dir.path().join("pool"),
        &[],
    )
    .expect("the pool");
    let lender_key = dir.path().join("lender.key");
    pool.enroll(Role::Lender, "sriov-lender", &lender_key)
        .expect("enroll the lender");
    let hosts = [
        Host::new(dir.path(), 1, None),
        Host::new(dir.path(), 2, Some("host-b")),
    ];
    pool.enroll(
        Role::Compute,
        &devlend_daemon::host_name(),
        &Borrower::pool_key(&hosts[0].dir),
    )
    .expect("enroll host A");
    pool.enroll(Role::Compute, "host-b", &Borrower::pool_key(&hosts[1].dir))
        .expect("enroll host B");
    let config = dir.path().join("lender.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"0.0.0.0:7700\"\nkey_file = \"/lender.key\"\n[pool]\nurl = \"http://10.0.2.2:{pool_port}\"\nprovider = \"sriov-lender\"\nadvertise = \"{}:{port}\"\n",
            hosts[0].ns.host_ip
        ),
    )
    .expect("the lender's config");
    let script = LENDER_SCRIPT.replace("__PF_IOPS__", &limits::PF_READ_IOPS.to_string());
    let mut lender = sriov::lender("sriov-lender", &images, true, port, &modules, &script)
        // The igb VF's mirror of its guest's 128 MiB needs 320 MiB of the lender's.
        .memory_mib(1280)
        .args([
            "-device",
            "pcie-root-port,id=igb-rp,chassis=10,slot=10",
            "-netdev",
            "user,id=igbnet",
            "-device",
            "igb,id=igb0,bus=igb-rp,netdev=igbnet",
        ])
        .host_file("/lender.key", &lender_key)
        .host_file("/lender.toml", &config);
    for (g, h) in qemu11::kernel_modules(dir.path(), qemu11::IGB_MODULES, "/kmod") {
        lender = lender.host_file(g, h);
    }
    let mut lender = lender.boot().expect("boot the lender's guest");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lender
            .wait_for_text("sriov: the second lender is up", Duration::from_secs(300))
            .expect("the lender listens, after a restart");
        // The restart found the VFs ready: nothing was enabled, assigned or brought
        // online again, and the same functions are lent.
        let console = lender.console();
        let count = |prefix: &str, what: &str| {
            console
                .lines()
                .filter(|l| l.contains(prefix) && l.contains(what))
                .count()
        };
        // One line per PF (the NVMe's two VFs, the igb's one).
        assert_eq!(count("first: ", "SR-IOV virtual functions enabled"), 2);
        assert_eq!(count("first: ", "NVMe secondary controller online"), 2);
        let ready = |prefix: &str| -> Vec<String> {
            console
                .lines()
                .filter(|l| l.contains(prefix) && l.contains("PCIe function ready"))
                .filter_map(|l| l.split("bdf=").nth(1))
                .filter_map(|r| r.split_whitespace().next())
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(count("second: ", "SR-IOV virtual functions enabled"), 0);
        assert_eq!(count("second: ", "NVMe secondary controller online"), 0);
        assert_eq!(ready("first: ").len(), 3, "{console}");
        assert_eq!(
            ready("second: "),
            ready("first: "),
            "the same VFs, lent again"
        );
        let admin = pool.admin().expect("the pool's admin client");
        let until = Instant::now() + Duration::from_secs(60);
        let vfs = loop {
            let q = DeviceQuery {
                traits: vec!["SRIOV_VF".into(), "PF_SSD".into()],
                ..Default::default()
            };
            let v = admin.devices(&q).unwrap_or_default();
            if v.iter()
                .filter(|d| d.state == DeviceState::Available)
                .count()
                == 2
            {
                break v;
            }
            assert!(Instant::now() < until, "the VFs are in the pool: {v:#?}");
            std::thread::sleep(Duration::from_millis(200));
        };
        let mut names: Vec<_> = vfs.iter().map(|d| d.name.as_str()).collect();
        names.sort();
        assert_eq!(names, ["ssd-vf0", "ssd-vf1"], "one pool item per VF");
        for d in &vfs {
            assert_eq!(d.resource_class, "PCI_1B36_0010");
            for t in ["NVME", "SRIOV_VF", "PF_SSD"] {
                assert!(
                    d.traits.iter().any(|x| x == t),
                    "{}: {t} in {:?}",
                    d.name,
                    d.traits
                );
            }
        }
        // The igb's one VF: an item of its own, of the VF's class, under PF nic.
        let q = DeviceQuery {
            traits: vec!["SRIOV_VF".into(), "PF_NIC".into()],
            ..Default::default()
        };
        let nic = admin.devices(&q).expect("the pool's devices");
        assert_eq!(nic.len(), 1, "{nic:#?}");
        assert_eq!(nic[0].name, "nic-vf0");
        assert_eq!(nic[0].resource_class, "PCI_8086_10CA");
        scenario(Lab {
            dir: dir.path(),
            root: &root,
            port,
            modules: &modules,
            images: &images,
            hosts: &hosts,
            pool_port,
            lender: &lender,
        });
        // A trial found a doorbell of 16 MiB of writes (the full queue) waiting 10 s
        // for completions with nothing submitted to the controller.
        assert!(
            !lender.console().contains("completed nothing for 10 s"),
            "the lender waited for a controller it had given nothing"
        );
    }));
    for l in lender.console().lines().filter(|l| {
        ["lender: ", "sriov: ", "first: ", "second: "]
            .iter()
            .any(|p| l.contains(p))
    }) {
        eprintln!("{l}");
    }
    if result.is_err() {
        eprintln!("--- pool ---\n{}", pool.proc.log());
        for h in &hosts {
            eprintln!("--- compute {:?} ---\n{}", h.name, h.agent.proc.log());
        }
    }
    lender.kill();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

/// What the scenario works with: the test's directory, the QEMU 11 chroot, the lender's
/// forwarded port, the NVMe modules, the namespaces' images, the two compute hosts, the
/// pool's port and the lender's guest.
#[derive(Clone, Copy)]
struct Lab<'a> {
    dir: &'a Path,
    root: &'a Path,
    port: u16,
    modules: &'a [(String, PathBuf)],
    images: &'a [PathBuf; 2],
    hosts: &'a [Host; 2],
    pool_port: u16,
    lender: &'a Guest,
}

fn scenario(lab: Lab<'_>) {
    let Lab {
        dir,
        root,
        port,
        modules,
        images,
        hosts,
        pool_port,
        lender,
    } = lab;
    // The PF is the lender's, and a VF past the two it has does not exist.
    for (asked, said) in [
        ("ssd", "borrow one of its VFs, ssd-vf0 to ssd-vf1"),
        ("ssd-vf2", "has VFs ssd-vf0 to ssd-vf1 only"),
    ] {
        let Err(e) = PciBorrower::connect(&sriov::target(port, asked, 7)) else {
            panic!("{asked}: lent")
        };
        let msg = devlend_fabric::error::chain(&e);
        assert!(msg.contains(said), "{asked}: {msg}");
    }

    // Each compute host leases a VF of PF ssd through the pool: the two VFs, at once.
    let socks: Vec<PathBuf> = hosts.iter().map(|h| h.dir.join("ssd.sock")).collect();
    let vf_of: Vec<usize> = hosts
        .iter()
        .zip(["vm-a", "vm-b"])
        .zip(&socks)
        .map(|((h, vm), sock)| {
            let a = h.attach_vf(pool_port, vm, sock);
            assert_eq!(a["coherence"], "mediated", "an NVMe VF is mediated: {a}");
            match a["device"].as_str() {
                Some("ssd-vf0") => 0,
                Some("ssd-vf1") => 1,
                other => panic!("{vm} leased {other:?}: {a}"),
            }
        })
        .collect();
    assert_ne!(vf_of[0], vf_of[1], "two hosts, two VFs");

    std::env::set_var("DEVLEND_QEMU", qemu11::wrapper(dir, root));
    let mut vms: Vec<Guest> = ["a", "b"]
        .iter()
        .zip(&socks)
        .map(|(tag, sock)| {
            let device = format!(
                "{{\"driver\":\"vfio-user-pci\",\"socket\":{{\"path\":\"{}\",\"type\":\"unix\"}}}}",
                sock.display()
            );
            let script = format!(
                "{}{}",
                qemu11::nvme_guest_prelude(),
                VMM_SCRIPT.replace("__TAG__", tag)
            );
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
    // Per VF (its namespace, its image): the pattern's md5 and the guest's tag.
    let mut written: [(String, &str); 2] = Default::default();
    for ((vm, tag), &vf) in vms.iter_mut().zip(["a", "b"]).zip(&vf_of) {
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
        let size = [IMAGE_A, IMAGE_B][vf];
        assert_eq!(
            get("dev"),
            "yes",
            "vm-{tag}: its nvme driver shows /dev/nvme0n1"
        );
        assert_eq!(
            get("sectors"),
            (size / 512).to_string(),
            "vm-{tag} sees its VF's namespace {}",
            vf + 1
        );
        assert_eq!(get("namespaces"), "1", "vm-{tag} sees one namespace only");
        assert_eq!(get("verify"), "ok", "vm-{tag}: the pattern read back");
        assert_eq!(get("verify2"), "ok", "vm-{tag}: the patterns of both vCPUs");
        assert_eq!(
            get("io_queues"),
            "2",
            "vm-{tag}: an I/O queue per vCPU (the VF has 4 queues and 3 interrupts)"
        );
        written[vf] = (get("md5"), tag);
    }
    for (i, img) in images.iter().enumerate() {
        let data = std::fs::read(img).expect("read the image");
        let (md5sum, tag) = &written[i];
        for at in [256usize, 512, 1024] {
            let at = at * 4096;
            assert_eq!(
                &qemu11::md5_hex(dir, &data[at..at + 65536]),
                md5sum,
                "namespace {} holds vm-{tag}'s pattern at byte {at}",
                i + 1
            );
        }
        let other = written[1 - i].1;
        assert!(
            !contains(&data, format!("devlend-sriov-{other}-").as_bytes()),
            "namespace {} holds nothing of vm-{other}",
            i + 1
        );
    }

    // Host A's VF changes hands. A holder enables its controller and creates queues,
    // and is detached while its VMM is still connected (so that no reset comes from
    // the VMM); the next holder finds the VF reset, and working.
    let a = &hosts[0];
    a.detach(&socks[0]);
    let first = a.dir.join("first.sock");
    let got = a.attach_vf(pool_port, "vm-c", &first);
    assert_eq!(
        got["device"],
        ["ssd-vf0", "ssd-vf1"][vf_of[0]],
        "the VF A gave back"
    );
    let mut d = nvme::start(&first);
    assert_eq!(d.r32(0x1c) & 1, 1, "the first holder's controller is ready");
    a.detach(&first);
    drop(d);
    let next = a.dir.join("next.sock");
    a.attach_vf(pool_port, "vm-d", &next);
    let mut d = nvme::join(&next);
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
    full_queue_of_writes(&mut d, vf_of[0] as u32 + 1);
    repeated_creates(&mut d, lender);
    limits::check(lab, &mut d, &vf_of);
    drop(d);
    a.detach(&next);
    igbvf_traffic(dir, &hosts[1], pool_port, lender);
}

/// The igb NIC's VF, leased by host B, passes traffic with the guest's own igbvf
/// driver: pings to the PF's address on the lender and a TCP transfer, the bytes
/// checked there (the PF's internal switch loops VF traffic back to the PF).
fn igbvf_traffic(dir: &Path, b: &Host, pool_port: u16, lender: &Guest) {
    let nic = b.dir.join("nic.sock");
    let got = b
        .attach(pool_port, "vm-igbvf", &nic, "PCI_8086_10CA", "PF_NIC", &[])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(got["coherence"], "mirror", "a NIC VF is mirrored: {got}");
    let device = format!(
        "{{\"driver\":\"vfio-user-pci\",\"socket\":{{\"path\":\"{}\",\"type\":\"unix\"}}}}",
        nic.display()
    );
    let mut vb = Guest::builder()
        .name("vm-igbvf")
        // The generic mirror costs the lender 2.5 times the guest memory mapped for DMA.
        .memory_mib(128)
        .args(["-device".to_string(), device])
        .script(IGBVF_SCRIPT);
    for (g, h) in qemu11::kernel_modules(dir, qemu11::IGBVF_MODULES, "/kmod") {
        vb = vb.host_file(g, h);
    }
    let mut vm = vb.boot().expect("boot the igbvf guest");
    let out = vm.wait_done(Duration::from_secs(900));
    for l in vm.console().lines() {
        eprintln!("vm-igbvf: {l}");
    }
    let out = out.expect("the igbvf guest's script");
    // No MAC given by the PF's administrator: igbvf picks one and registers it with the
    // PF through the mailbox, which the VF's traffic then needs.
    let mac = out.result("mac").unwrap_or_default();
    assert!(
        mac.len() == 17 && mac != "00:00:00:00:00:00",
        "the VF's MAC: {mac:?}"
    );
    let pings = out.result("pings").unwrap_or_default();
    assert!(
        pings.starts_with("3 of"),
        "pings answered through the VF: {pings}"
    );
    assert_eq!(out.result("sent"), Some("yes"), "the TCP transfer");
    let md5 = out.result("md5").expect("the sent bytes' md5").to_string();
    let line = lender
        .wait_for_text("sriov: received", Duration::from_secs(300))
        .expect("the lender's listener got the transfer");
    assert!(
        line.contains(&format!("{md5} 65536")),
        "the lender received what the VF sent: {line}"
    );
    b.detach(&nic);
}

/// A guest that sends 12 creates of one I/O SQ (2048 entries) with one admin doorbell:
/// the mediator refuses all but the first itself (Invalid Queue Identifier), since each
/// would pin a shadow queue of 128 KiB until the controller refused it (a trial's 4000
/// pinned 500 MiB of the lender's guest). The first is created, and deleted after.
fn repeated_creates(d: &mut nvme::Driver, lender: &Guest) {
    const N: u16 = 12;
    const SQ: u64 = 0x8_0000;
    let refusals = |g: &Guest| {
        g.console()
            .lines()
            .filter(|l| l.contains("command refused") && l.contains("opcode=1 sct=1 sc=1"))
            .count()
    };
    let before = refusals(lender);
    d.ok(
        false,
        nvme::sqe(
            0x05,
            0,
            nvme::IOVA + 0xA_0000,
            0,
            [15 << 16 | 3, 1 << 16 | 3, 0, 0, 0, 0],
        ),
        "create I/O CQ 3",
    );
    let (sq, cq, entries) = (d.admin.sq, d.admin.cq, d.admin.entries);
    let mut tail = d.admin.tail;
    for _ in 0..N {
        d.cid = d.cid.wrapping_add(1);
        let mut e = nvme::sqe(
            0x01,
            0,
            nvme::IOVA + SQ,
            0,
            [2047 << 16 | 3, 3 << 16 | 1, 0, 0, 0, 0],
        );
        e[2..4].copy_from_slice(&d.cid.to_le_bytes());
        d.mem.write(sq + u64::from(tail) * 64, &e);
        tail = (tail + 1) % entries;
    }
    d.admin.tail = tail;
    d.w32(0x1000, u32::from(tail));
    let mut statuses = Vec::new();
    let until = Instant::now() + Duration::from_secs(60);
    while statuses.len() < usize::from(N) {
        let c = d.mem.read(cq + u64::from(d.admin.head) * 16, 16);
        let st = u16::from_le_bytes([c[14], c[15]]);
        if (st & 1 == 1) != d.admin.phase {
            assert!(Instant::now() < until, "completions: {statuses:x?}");
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        statuses.push(st >> 1);
        d.admin.head = (d.admin.head + 1) % entries;
        if d.admin.head == 0 {
            d.admin.phase = !d.admin.phase;
        }
    }
    d.w32(0x1004, u32::from(d.admin.head));
    while d.admin.irq.read().is_ok() {}
    assert_eq!(
        statuses.iter().filter(|&&s| s == 0).count(),
        1,
        "{statuses:x?}"
    );
    // Invalid Queue Identifier, Do Not Retry: from the mediator, and without it from
    // the controller (the log lines below tell which).
    assert!(
        statuses.iter().all(|&s| s == 0 || s == 0x4101),
        "{statuses:x?}"
    );
    let until = Instant::now() + Duration::from_secs(10);
    while refusals(lender) < before + usize::from(N) - 1 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        refusals(lender) - before,
        usize::from(N) - 1,
        "the mediator refused the creates of a queue being created, not the controller"
    );
    d.delete_queue_pair(3);
}

/// A guest that submits a whole queue of 128 KiB writes with one doorbell: the lender
/// fetches them as the commands waiting for the controller leave room (16 MiB), not all
/// at once (128 MiB here; 64 such queues would be 32 GiB), so the SQ head in the first
/// completion is far behind the tail; and every write still completes.
fn full_queue_of_writes(d: &mut nvme::Driver, nsid: u32) {
    const ENTRIES: u32 = 1024;
    const SQ: u64 = 0x4_0000;
    const CQ: u64 = 0x5_0000;
    let n = ENTRIES - 1;
    d.identify_namespace(nsid);
    d.create_queue_pair(2, ENTRIES, SQ, CQ);
    // 128 KiB of data: PRP 1 and a list of the 31 pages after it.
    d.mem.write(nvme::DATA, &[0xa5; 128 << 10]);
    let list: Vec<u8> = (1..32u64)
        .flat_map(|k| (nvme::IOVA + nvme::DATA + k * 4096).to_le_bytes())
        .collect();
    d.mem.write(nvme::LIST, &list);
    for i in 0..n {
        let mut e = nvme::sqe(
            0x01,
            nsid,
            nvme::IOVA + nvme::DATA,
            nvme::IOVA + nvme::LIST,
            [(i * 256) % 32768, 0, 255, 0, 0, 0],
        );
        e[2..4].copy_from_slice(&(i as u16).to_le_bytes());
        d.mem.write(SQ + u64::from(i) * 64, &e);
    }
    d.w32(0x1000 + 8 * 2, n);
    let mut heads = Vec::new();
    let until = Instant::now() + Duration::from_secs(300);
    for i in 0..n {
        let c = loop {
            let c = d.mem.read(CQ + u64::from(i) * 16, 16);
            if u16::from_le_bytes([c[14], c[15]]) & 1 == 1 {
                break c;
            }
            assert!(
                Instant::now() < until,
                "{i} of {n} writes completed; heads {heads:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(
            u16::from_le_bytes([c[14], c[15]]) >> 1,
            0,
            "write {i}'s status"
        );
        heads.push(u16::from_le_bytes([c[8], c[9]]));
    }
    d.w32(0x1000 + 8 * 2 + 4, n);
    eprintln!(
        "SQ heads in the completions: first {}, then {:?}",
        heads[0],
        &heads[1..8]
    );
    assert!(
        heads[0] <= 512,
        "the first completion says the lender had fetched {} of {n} entries",
        heads[0]
    );
    assert_eq!(
        heads.last().copied(),
        Some(n as u16),
        "all fetched in the end"
    );
    d.delete_queue_pair(2);
}
