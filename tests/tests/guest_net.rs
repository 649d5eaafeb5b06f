//! A real QEMU 10 guest (TCG) with a NIC lent by devlend: the lender's interface is one
//! end of a veth pair in the lender's network namespace; the other end is a peer host in
//! its own namespace. The guest's own virtio-net driver (through the compute agent's
//! vhost-user-net backend) pings the peer both ways, moves files over TCP each way with
//! their checksums verified on both sides, and, with MTU 9000 on both ends, moves
//! 8000-byte pings (frames spanning mergeable receive buffers). Then the lender is
//! killed: frames are dropped and counted, nothing hangs; it is restarted and traffic
//! resumes without a re-attach. One guest for the whole file.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use devlend_tests::agents::{free_port, Borrower, Lender};
use devlend_tests::guest::Guest;
use devlend_tests::lan::{run, PeerLan};
use devlend_tests::netns::Netns;
use devlend_tests::{console_result, sha256_hex};

const GUEST_IP: &str = "10.77.0.1";
const PEER_IP: &str = "10.77.0.2";
const FILE_MIB: usize = 4;

const SCRIPT: &str = r#"
set -e
devlend-wait-for /sys/class/net/eth0 30
ip link set eth0 up
ip addr add 10.77.0.1/24 dev eth0
echo "DEVLEND-RESULT mtu=$(cat /sys/class/net/eth0/mtu)"
ping -c 3 -W 5 10.77.0.2 > /tmp/ping.txt || { cat /tmp/ping.txt; cat /proc/net/dev; exit 1; }
echo "DEVLEND-RESULT ping=ok"
cat /tmp/ping.txt
dd if=/dev/urandom of=/tmp/up bs=1M count=4 2>/dev/null
echo "DEVLEND-RESULT up_sha256=$(sha256sum /tmp/up | cut -d' ' -f1)"
nc 10.77.0.2 5001 < /tmp/up
nc 10.77.0.2 5002 < /dev/null > /tmp/down
echo "DEVLEND-RESULT down_sha256=$(sha256sum /tmp/down | cut -d' ' -f1)"
ping -c 3 -W 5 -s 8000 10.77.0.2 > /tmp/jumbo.txt 2>&1 && echo "DEVLEND-RESULT jumbo=ok"
cat /tmp/jumbo.txt
echo "DEVLEND-RESULT phase=peer-ping"
# The host pings from the peer now, then kills the lender.
sleep 8
echo "DEVLEND-RESULT phase=lender-gone"
ping -c 4 -W 1 10.77.0.2 > /dev/null 2>&1 || true
echo "DEVLEND-RESULT phase=during-outage-done"
i=0
while ! ping -c 1 -W 1 10.77.0.2 > /dev/null 2>&1; do
  i=$((i+1)); [ $i -lt 40 ] || break
done
ping -c 3 -W 5 10.77.0.2 > /dev/null && echo "DEVLEND-RESULT resumed=ok"
"#;

/// The peer's TCP servers (python3): port 5001 receives a file and writes its sha256
/// and length to `OUT`; port 5002 sends `FILE_MIB` MiB of a fixed pattern.
const PEER: &str = r#"
import hashlib, socket, sys, threading
out = sys.argv[1]
data = bytes((i * 7 + 3) % 256 for i in range(FILE_BYTES))
def recv():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.77.0.2", 5001)); s.listen(1)
    c, _ = s.accept(); h = hashlib.sha256(); n = 0
    while True:
        b = c.recv(1 << 16)
        if not b: break
        h.update(b); n += len(b)
    c.close(); open(out, "w").write(f"{h.hexdigest()} {n}\n")
def send():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.77.0.2", 5002)); s.listen(1)
    c, _ = s.accept(); c.sendall(data); c.close()
t = threading.Thread(target=recv); t.start(); send(); t.join()
"#;

fn pattern() -> Vec<u8> {
    (0..FILE_MIB << 20)
        .map(|i| ((i * 7 + 3) % 256) as u8)
        .collect()
}

fn wait_console(guest: &Guest, key: &str, value: &str, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        let console = guest.console();
        if console_result(&console, key).as_deref() == Some(value) {
            return Ok(());
        }
        if console.contains("DEVLEND-DONE") {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!("guest did not reach {key}={value}:\n{}", guest.console())
}

#[test]
fn a_guest_uses_a_lent_nic() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // The lender's host: reached by the compute agent over `fabric`.
    let fabric = Netns::new(0)?;
    let tag = format!("dn{}", std::process::id() % 100_000);
    // MTU 9000 on the wire. The peer's TCP hands the wire segments of many MSS (TSO on
    // the veth), as GRO on a real port would: the lender passes them on whole and the
    // guest takes them (GUEST_TSO4).
    let mut lan = PeerLan::new(&tag, &fabric.name, &format!("{PEER_IP}/24"), 9000)?;
    lan.allow_gso()?;
    let lent_if = lan.lent_if.clone();
    let peer_if = lan.peer_if.clone();
    let received = dir.path().join("received.txt");
    let script = PEER.replace("FILE_BYTES", &(FILE_MIB << 20).to_string());
    lan.spawn_python(&script, &[&received.display().to_string()])?;
    let in_peer = |args: &[&str]| lan.exec(args);

    let addr = format!("{}:{}", fabric.ns_ip, free_port()?);
    let device = format!("nic0=net:{lent_if},mac=52:54:00:12:34:56");
    let mut lender = Lender::start_in(
        dir.path(),
        Some(&fabric.name),
        &addr,
        std::slice::from_ref(&device),
        &["--insecure".to_owned()],
    )?;
    let borrower = Borrower::start(dir.path())?;
    let sock = dir.path().join("nic0.sock");
    let info = borrower.attach(&addr, "nic0", &sock, 1)?;
    assert_eq!(info["kind"], "nic", "{info}");
    assert_eq!(info["mtu"], 9000, "{info}");

    let s = sock.display().to_string();
    let mut guest = Guest::builder()
        .name("guest_net")
        .script(SCRIPT)
        .args([
            "-chardev".to_owned(),
            format!("socket,id=n0,path={s},reconnect-ms=1000"),
            "-netdev".into(),
            "vhost-user,id=net0,chardev=n0".into(),
            "-device".into(),
            "virtio-net-pci,netdev=net0,mac=52:54:00:12:34:56,host_mtu=9000".into(),
        ])
        .boot()?;

    if let Err(e) = wait_console(&guest, "phase", "peer-ping", Duration::from_secs(150)) {
        eprintln!(
            "lender log:\n{}\nborrower log:\n{}\nstatus: {:?}\nlent: {:?}\npeer: {:?}",
            lender.proc.log(),
            borrower.proc.log(),
            borrower.cli_json(&["status"]).map(|s| s[0].to_string()),
            run(&[
                "ip",
                "netns",
                "exec",
                &fabric.name,
                "ip",
                "-s",
                "link",
                "show",
                &lent_if
            ]),
            in_peer(&["ip", "-s", "link", "show", &peer_if]),
        );
        return Err(e);
    }
    let ping = in_peer(&["busybox", "ping", "-c", "3", "-W", "5", GUEST_IP])?;
    assert!(
        ping.contains(" 0% packet loss"),
        "peer → guest ping: {ping}"
    );
    lender.proc.kill_hard();
    wait_console(&guest, "phase", "lender-gone", Duration::from_secs(30))?;
    wait_console(
        &guest,
        "phase",
        "during-outage-done",
        Duration::from_secs(30),
    )?;
    let during = borrower.cli_json(&["status"])?;
    let _lender = Lender::start_in(
        dir.path(),
        Some(&fabric.name),
        &addr,
        &[device],
        &["--insecure".to_owned()],
    )?;

    let out = guest.wait_done(Duration::from_secs(120))?;
    out.check_success()?;
    assert_eq!(
        out.result("mtu"),
        Some("9000"),
        "MTU not taken from the lender"
    );
    assert_eq!(out.result("ping"), Some("ok"), "guest → peer ping");
    let up = out.result("up_sha256").context("no up_sha256")?;
    let got = std::fs::read_to_string(&received)?;
    assert_eq!(
        got.trim(),
        format!("{up} {}", FILE_MIB << 20),
        "guest → peer file"
    );
    assert_eq!(
        out.result("down_sha256"),
        Some(sha256_hex(&pattern()).as_str()),
        "peer → guest file"
    );
    assert_eq!(
        out.result("jumbo"),
        Some("ok"),
        "8000-byte pings at MTU 9000:\n{}",
        out.console
    );
    assert_eq!(
        out.result("resumed"),
        Some("ok"),
        "traffic did not resume after the lender came back:\n{}",
        out.console
    );

    let n = &during[0];
    assert!(
        n["counters"]["tx_drops"].as_u64().unwrap_or(0) > 0,
        "frames sent while the lender was away were not counted: {during}"
    );
    let status = borrower.cli_json(&["status"])?;
    let n = &status[0];
    eprintln!("net counters: {n}");
    assert!(
        n["counters"]["rx_bytes"].as_u64().unwrap_or(0) > (FILE_MIB << 20) as u64,
        "{status}"
    );
    assert!(
        n["counters"]["tx_bytes"].as_u64().unwrap_or(0) > (FILE_MIB << 20) as u64,
        "{status}"
    );
    assert!(n["reconnects"].as_u64().unwrap_or(0) >= 1, "{status}");
    // The 8000-byte echo replies (at least) spanned several receive buffers.
    assert!(
        n["counters"]["rx_merged"].as_u64().unwrap_or(0) >= 3,
        "{status}"
    );
    // The peer's TSO segments reached the guest whole. (Whether the guest's own TCP
    // builds multi-segment sends depends on its pacing under TCG: tx_gso is not
    // asserted; the net_vs_tap bench shows it.)
    assert!(
        n["counters"]["rx_gso"].as_u64().unwrap_or(0) > 0,
        "{status}"
    );
    assert_eq!(n["link_up"], true, "{status}");
    Ok(())
}
