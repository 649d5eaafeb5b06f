//! A real libvirt domain (libvirt 9.0, QEMU 10 under TCG) built around the `<disk>` and
//! `<interface>` XML that `devlend attach` prints: `virsh create` starts it, the guest does
//! direct I/O on the lent disk verified from both sides and sees the serial devlend sets,
//! pings a peer through the lent NIC; then a second lent disk goes in with
//! `virsh attach-device --live` of the printed XML and out with `detach-device --live`,
//! the guest seeing it appear and go. The recipe is the one in docs/libvirt.md.
//!
//! libvirt is configured and its daemons started by the test itself
//! (`devlend_tests::libvirt`); without libvirt installed the test fails.

use std::fs;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use devlend_tests::agents::{free_port, sparse_file, Borrower, Lender};
use devlend_tests::guest::Guest;
use devlend_tests::lan::PeerLan;
use devlend_tests::libvirt::{ensure_daemons, Domain};
use devlend_tests::netns::Netns;
use devlend_tests::{console_result, sha256_hex};

const MIB: usize = 1 << 20;
const SERIAL: &str = "LV-SN-1";
const HOT_SERIAL: &str = "LV-HOT-2";
const PEER_IP: &str = "10.78.0.2";
const MAC: &str = "52:54:00:12:34:78";
const STEP: Duration = Duration::from_secs(150);

const SCRIPT: &str = r#"
set -e
devlend-wait-for /dev/vda 60
echo "DEVLEND-RESULT serial=$(cat /sys/block/vda/serial)"
echo "DEVLEND-RESULT size=$(cat /sys/block/vda/size)"
dd if=/dev/urandom of=/tmp/w bs=1M count=4 2>/dev/null
dd if=/tmp/w of=/dev/vda bs=1M seek=1 oflag=direct conv=fsync 2>/dev/null
dd if=/dev/vda of=/tmp/r bs=1M skip=1 count=4 iflag=direct 2>/dev/null
echo "DEVLEND-RESULT written=$(sha256sum /tmp/w | cut -d' ' -f1)"
echo "DEVLEND-RESULT read=$(sha256sum /tmp/r | cut -d' ' -f1)"
echo "DEVLEND-RESULT head=$(dd if=/dev/vda bs=1M count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"
devlend-wait-for /sys/class/net/eth0 30
ip link set eth0 up
ip addr add 10.78.0.1/24 dev eth0
ping -c 3 -W 5 10.78.0.2 > /tmp/ping.txt || { cat /tmp/ping.txt; exit 1; }
echo "DEVLEND-RESULT ping=ok"
echo "DEVLEND-PHASE booted"
devlend-wait-for /dev/vdb 300
echo "DEVLEND-RESULT hot_serial=$(cat /sys/block/vdb/serial)"
echo "DEVLEND-RESULT hot_head=$(dd if=/dev/vdb bs=1M count=1 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"
echo "DEVLEND-PHASE hot-io-done"
i=0
while [ -e /sys/block/vdb ]; do sleep 0.1; i=$((i+1)); [ $i -lt 3000 ] || exit 3; done
echo "DEVLEND-PHASE hot-gone"
"#;

/// The libvirt XML `devlend attach` printed: everything after its `libvirt:` line.
fn printed_libvirt_xml(b: &Borrower, args: &[&str]) -> Result<String> {
    let out = b.cli(args)?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "devlend {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, xml) = text
        .split_once("libvirt:\n")
        .with_context(|| format!("no libvirt XML in:\n{text}"))?;
    Ok(xml.trim().to_owned())
}

fn domain_xml(
    name: &str,
    boot: &devlend_tests::guest::BootFiles,
    devices: &str,
    console: &Path,
) -> String {
    format!(
        "<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>512</memory>
  <vcpu>1</vcpu>
  <memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{}</kernel>
    <initrd>{}</initrd>
    <cmdline>{}</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{}</emulator>
    <controller type='pci' index='0' model='pcie-root'/>
    <controller type='pci' model='pcie-root-port'/>
    <controller type='pci' model='pcie-root-port'/>
    <controller type='pci' model='pcie-root-port'/>
    <controller type='pci' model='pcie-root-port'/>
{devices}
    <serial type='file'><source path='{}'/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
</domain>
",
        boot.kernel.display(),
        boot.initrd.display(),
        boot.cmdline,
        qemu_path().display(),
        console.display(),
    )
}

fn qemu_path() -> std::path::PathBuf {
    let q = devlend_tests::guest::qemu_binary();
    if q.is_absolute() {
        return q;
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(&q))
        .find(|p| p.is_file())
        .unwrap_or(q)
}

fn result(console: &str, key: &str) -> Result<String> {
    console_result(console, key).with_context(|| format!("no {key} in the console:\n{console}"))
}

#[test]
fn printed_xml_boots_a_libvirt_domain_and_plugs_live() -> Result<()> {
    ensure_daemons()?;
    let dir = tempfile::tempdir()?;
    // libvirt's QEMU (root, no namespace) reads the boot files and sockets from here.
    let pattern: Vec<u8> = (0..MIB).map(|i| (i * 29 % 251) as u8).collect();
    let disk0 = dir.path().join("disk0.img");
    sparse_file(&disk0, 16 << 20)?;
    let disk1 = dir.path().join("disk1.img");
    let mut hot = vec![0u8; 8 * MIB];
    hot[..MIB].copy_from_slice(&pattern);
    fs::write(&disk1, &hot)?;
    let mut head = fs::read(&disk0)?;
    head[..MIB].copy_from_slice(&pattern);
    fs::write(&disk0, &head)?;

    // The lender's host, with a NIC whose other end is a peer in its own namespace.
    let fabric = Netns::new(0)?;
    let tag = format!("lv{}", std::process::id() % 100_000);
    let lan = PeerLan::new(&tag, &fabric.name, &format!("{PEER_IP}/24"), 1500)?;
    let addr = format!("{}:{}", fabric.ns_ip, free_port()?);
    let devices = [
        format!("disk0={},serial={SERIAL}", disk0.display()),
        format!("disk1={},serial={HOT_SERIAL}", disk1.display()),
        format!("nic0=net:{},mac={MAC}", lan.lent_if),
    ];
    let lender = Lender::start_in(
        dir.path(),
        Some(&fabric.name),
        &addr,
        &devices,
        &["--insecure".to_owned()],
    )?;
    let borrower = Borrower::start(dir.path())?;
    let sock = |n: &str| dir.path().join(format!("{n}.sock")).display().to_string();
    let (s0, s1, sn) = (sock("disk0"), sock("disk1"), sock("nic0"));
    let disk_xml = printed_libvirt_xml(
        &borrower,
        &[
            "attach", "--lender", &addr, "--device", "disk0", "--socket", &s0,
        ],
    )?;
    let nic_xml = printed_libvirt_xml(
        &borrower,
        &[
            "attach", "--lender", &addr, "--device", "nic0", "--socket", &sn,
        ],
    )?;
    ensure!(!disk_xml.contains("<serial"), "{disk_xml}");

    let boot = Guest::builder()
        .name("libvirt")
        .script(SCRIPT)
        .boot_files(dir.path())?;
    let console = dir.path().join("console.log");
    let name = format!("devlend-test-{}", std::process::id());
    let xml = domain_xml(&name, &boot, &format!("{disk_xml}\n{nic_xml}"), &console);
    let domain = Domain::create(dir.path(), &name, &xml, console)?;

    let text = match domain.wait_for("DEVLEND-PHASE booted", STEP) {
        Ok(t) => t,
        Err(e) => bail!(
            "{e:#}\nlender log:\n{}\nborrower log:\n{}",
            lender.proc.log(),
            borrower.proc.log()
        ),
    };
    ensure!(result(&text, "serial")? == SERIAL, "serial");
    ensure!(result(&text, "size")? == (16u64 << 11).to_string(), "size");
    let written = result(&text, "written")?;
    ensure!(result(&text, "read")? == written, "read back differs");
    let file = fs::read(&disk0)?;
    ensure!(
        sha256_hex(&file[MIB..5 * MIB]) == written,
        "the guest's direct writes are not in the lender's file"
    );
    ensure!(result(&text, "head")? == sha256_hex(&pattern), "head");
    ensure!(result(&text, "ping")? == "ok", "ping");

    // Live attach of a second disk, from the XML devlend prints, then live detach.
    let hot_xml = printed_libvirt_xml(
        &borrower,
        &[
            "attach",
            "--lender",
            &addr,
            "--device",
            "disk1",
            "--socket",
            &s1,
            "--libvirt-dev",
            "vdc",
        ],
    )?;
    domain.device("attach-device", &hot_xml)?;
    let text = domain.wait_for("DEVLEND-PHASE hot-io-done", STEP)?;
    ensure!(result(&text, "hot_serial")? == HOT_SERIAL, "hot serial");
    ensure!(
        result(&text, "hot_head")? == sha256_hex(&pattern),
        "hot head"
    );
    domain.device("detach-device", &hot_xml)?;
    domain.wait_for("DEVLEND-PHASE hot-gone", STEP)?;
    borrower.cli_json(&["detach", "disk1"])?;
    let text = domain.wait_for(devlend_tests::guest::DONE_MARKER, STEP)?;
    eprintln!("guest console:\n{text}");
    ensure!(
        text.contains("DEVLEND-DONE rc=0"),
        "guest script failed:\n{text}"
    );
    drop(domain);
    Ok(())
}
