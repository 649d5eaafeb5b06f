//! NIC lending beside QEMU's own `-netdev tap`, in one run: guest↔peer TCP throughput
//! (each way) and ping RTT through a NIC lent by devlend, and through a tap on the same
//! host (the local ceiling: no fabric hop). One TCG guest has both NICs, so both paths
//! share the guest, its vCPU and the moment; only the ratio means anything.
//!
//! `cargo bench -p devlend-tests --bench net_vs_tap` (root; after `cargo build --release
//! --workspace`). Prints a table and the ratios against the targets (throughput ≥ 0.6×
//! tap, RTT ≤ 2× tap); `docs/performance.md` records a run.
//!
//! Topology: the lender's interface is one end of a veth pair in the lender's namespace,
//! the other end a peer host in its own namespace (10.77.0.2/24); QEMU's tap is moved
//! into the same peer namespace once QEMU has opened it (10.78.0.2/24). Both peer ends
//! send one segment per packet (`gso_max_segs 1`), as a remote host would. MTU 1500.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use devlend_tests::agents::{free_port, Borrower, Lender};
use devlend_tests::guest::Guest;
use devlend_tests::lan::{run, PeerLan};
use devlend_tests::netns::Netns;

const MIB: u32 = 32;
const ROUNDS: u32 = 5;
const PINGS: u32 = 20;

/// The peer's servers: 5001 receives and logs `bytes secs` per connection (first byte
/// to EOF), 5002 sends MIB MiB per connection. Both on every address of the peer.
const PEER: &str = r#"
import socket, sys, threading, time
log = sys.argv[1]; n = int(sys.argv[2]) << 20
def sink():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5001)); s.listen(4)
    while True:
        c, _ = s.accept(); got = 0; t0 = None
        while True:
            b = c.recv(1 << 18)
            if not b: break
            if t0 is None: t0 = time.monotonic()
            got += len(b)
        t = time.monotonic() - (t0 or time.monotonic())
        c.close()
        with open(log, "a") as f: f.write(f"{got} {t:.6f}\n")
def source():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5002)); s.listen(4)
    data = b"\xa5" * n
    while True:
        c, _ = s.accept(); c.sendall(data); c.close()
threading.Thread(target=sink, daemon=True).start()
source()
"#;

const SCRIPT: &str = r#"
set -e
devlend-wait-for /sys/class/net/eth1 30
find_if() { for i in /sys/class/net/*; do if [ "$(cat $i/address)" = "$1" ]; then basename $i; fi; done; }
dev=$(find_if 52:54:00:00:00:01); tap=$(find_if 52:54:00:00:00:02)
ip link set $dev up; ip addr add 10.77.0.1/24 dev $dev
ip link set $tap up; ip addr add 10.78.0.1/24 dev $tap
for peer in 10.77.0.2 10.78.0.2; do
  i=0; while ! ping -c 1 -W 1 $peer > /dev/null 2>&1; do i=$((i+1)); [ $i -lt 60 ] || { echo "no ping to $peer"; ip addr; cat /proc/net/dev; exit 1; }; done
done
dd if=/dev/zero of=/tmp/up bs=64k count=$((MIB * 16)) 2>/dev/null
now() { cut -d' ' -f1 /proc/uptime; }
r=1
while [ $r -le ROUNDS ]; do
  if [ $((r % 2)) = 1 ]; then order="devlend tap"; else order="tap devlend"; fi
  for p in $order; do
    [ $p = devlend ] && peer=10.77.0.2 || peer=10.78.0.2
    echo "DEVLEND-RESULT up_start=$p"
    nc $peer 5001 < /tmp/up
    t0=$(now); nc $peer 5002 > /tmp/down; t1=$(now)
    echo "DEVLEND-RESULT down_$p$r=$(wc -c < /tmp/down) $(awk "BEGIN{print $t1-$t0}")"
  done
  r=$((r+1))
done
for p in devlend tap; do
  [ $p = devlend ] && peer=10.77.0.2 || peer=10.78.0.2
  echo "DEVLEND-RESULT rtt_$p=$(ping -c PINGS $peer | tail -1 | cut -d= -f2 | cut -d/ -f2)"
done
"#;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; nothing else is taken.
    let dir = tempfile::tempdir()?;
    let fabric = Netns::new(0)?;
    let tag = format!("db{}", std::process::id() % 100_000);
    let mut lan = PeerLan::new(&tag, &fabric.name, "10.77.0.2/24", 1500)?;
    let log = dir.path().join("sink.log");
    lan.spawn_python(PEER, &[&log.display().to_string(), &MIB.to_string()])?;

    let addr = format!("{}:{}", fabric.ns_ip, free_port()?);
    let device = format!("nic0=net:{},mac=52:54:00:00:00:01", lan.lent_if);
    let _lender = Lender::start_in(
        dir.path(),
        Some(&fabric.name),
        &addr,
        &[device],
        &["--insecure".to_owned()],
    )?;
    let borrower = Borrower::start(dir.path())?;
    let sock = dir.path().join("nic0.sock");
    borrower.attach(&addr, "nic0", &sock, 1)?;

    let tap = format!("{tag}t");
    let _ = run(&["ip", "link", "del", &tap]);
    run(&["ip", "tuntap", "add", "dev", &tap, "mode", "tap"])?;
    let script = SCRIPT
        .replace("ROUNDS", &ROUNDS.to_string())
        .replace("PINGS", &PINGS.to_string())
        .replace("MIB", &MIB.to_string());
    let mut guest = Guest::builder()
        .name("net_vs_tap")
        .script(script)
        .args([
            "-chardev".to_owned(),
            format!("socket,id=n0,path={}", sock.display()),
            "-netdev".into(),
            "vhost-user,id=net0,chardev=n0".into(),
            "-device".into(),
            "virtio-net-pci,netdev=net0,mac=52:54:00:00:00:01,romfile=".into(),
            "-netdev".into(),
            format!("tap,id=net1,ifname={tap},script=no,downscript=no,vhost=off"),
            "-device".into(),
            "virtio-net-pci,netdev=net1,mac=52:54:00:00:00:02,romfile=".into(),
        ])
        .boot()?;
    // Once the guest runs, QEMU holds the tap open: move it to the peer, beside the veth.
    guest.wait_for_text("DEVLEND-READY", Duration::from_secs(120))?;
    run(&["ip", "link", "set", &tap, "netns", &lan.ns])?;
    lan.exec(&["ip", "addr", "add", "10.78.0.2/24", "dev", &tap])?;
    lan.exec(&["ip", "link", "set", "dev", &tap, "gso_max_segs", "1"])?;
    lan.exec(&["ip", "link", "set", &tap, "up"])?;

    let out = guest.wait_done(Duration::from_secs(900))?;
    if out.rc != 0 {
        bail!("the guest's script failed:\n{}", out.console);
    }
    // Uploads, in the order the guest ran them (the sink logs them in that order).
    let order: Vec<String> = out
        .console
        .lines()
        .filter_map(|l| l.trim().strip_prefix("DEVLEND-RESULT up_start="))
        .map(str::to_owned)
        .collect();
    let sink = std::fs::read_to_string(&log).context("the peer's sink log")?;
    let mut up = [Vec::new(), Vec::new()];
    for (path, line) in order.iter().zip(sink.lines()) {
        let mut f = line.split_whitespace();
        let bytes: f64 = f.next().context("sink log")?.parse()?;
        let secs: f64 = f.next().context("sink log")?.parse()?;
        if bytes != f64::from(MIB << 20) {
            bail!(
                "the peer received {bytes} bytes over {path}, not {} MiB",
                MIB
            );
        }
        up[usize::from(path == "tap")].push(bytes / secs / 1e6);
    }
    let mut down = [Vec::new(), Vec::new()];
    for (i, p) in ["devlend", "tap"].iter().enumerate() {
        for r in 1..=ROUNDS {
            let v = out
                .result(&format!("down_{p}{r}"))
                .with_context(|| format!("no down_{p}{r}:\n{}", out.console))?;
            let (bytes, secs) = v.split_once(' ').context("down result")?;
            let bytes: f64 = bytes.parse()?;
            if bytes != f64::from(MIB << 20) {
                bail!("the guest received {bytes} bytes over {p}");
            }
            down[i].push(bytes / secs.parse::<f64>()?.max(0.01) / 1e6);
        }
    }
    let rtt = |p: &str| -> Result<f64> {
        out.result(&format!("rtt_{p}"))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no rtt_{p}:\n{}", out.console))
    };
    let (rtt_d, rtt_t) = (rtt("devlend")?, rtt("tap")?);
    let (up_d, up_t) = (median(up[0].clone()), median(up[1].clone()));
    let (down_d, down_t) = (median(down[0].clone()), median(down[1].clone()));
    println!("net_vs_tap: one TCG guest, {MIB} MiB per transfer, median of {ROUNDS} rounds, {PINGS} pings");
    println!("| path | guest→peer MB/s | peer→guest MB/s | ping RTT ms |");
    println!("| --- | --- | --- | --- |");
    println!("| devlend | {up_d:.1} | {down_d:.1} | {rtt_d:.3} |");
    println!("| tap | {up_t:.1} | {down_t:.1} | {rtt_t:.3} |");
    println!(
        "every round, MB/s: devlend up {:?} down {:?}; tap up {:?} down {:?}",
        up[0], down[0], up[1], down[1]
    );
    let status = borrower.cli_json(&["status"])?;
    println!("devlend's counters: {}", status[0]["counters"]);
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    let (ru, rd, rr) = (up_d / up_t, down_d / down_t, rtt_d / rtt_t);
    println!(
        "[{}] guest→peer throughput, devlend / tap: {ru:.2} (must be >= 0.6)",
        verdict(ru >= 0.6)
    );
    println!(
        "[{}] peer→guest throughput, devlend / tap: {rd:.2} (must be >= 0.6)",
        verdict(rd >= 0.6)
    );
    println!(
        "[{}] ping RTT, devlend / tap: {rr:.2} (must be <= 2)",
        verdict(rr <= 2.0)
    );
    Ok(())
}
