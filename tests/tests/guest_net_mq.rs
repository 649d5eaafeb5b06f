//! A NIC lent by devlend, plugged live into a running QEMU 10 guest (TCG, 2 vCPUs)
//! through QMP (`netdev_add` + `device_add`) with 2 queue pairs (`mq=on`): TCP flows from
//! both vCPUs and towards the guest carry traffic on both queue pairs, every byte
//! checked. The lender is then killed: the guest's link goes down (QMP `set_link`),
//! and comes back up with the lender, and traffic resumes without a re-attach. Last,
//! the NIC is detached live (the guest sees it go) and attached again under the same
//! id, which works only if the detach left no netdev or chardev behind. Before that the
//! compute agent is restarted (SIGTERM): the NIC is restored from its state file and
//! QEMU joins it again (the chardev was added with `reconnect-ms`). One guest for the
//! whole file.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use devlend_tests::agents::{free_port, Borrower, Lender};
use devlend_tests::guest::Guest;
use devlend_tests::lan::PeerLan;
use devlend_tests::netns::Netns;
use devlend_tests::{metric_value, scrape_metrics, sha256_hex};

const FLOWS: usize = 8;
const FLOW_KIB: usize = 512;
const MAC: &str = "52:54:00:00:00:21";

const SCRIPT: &str = r#"
set -e
devlend-wait-for /sys/class/net/eth0 120
echo "DEVLEND-RESULT queues=$(ls /sys/class/net/eth0/queues | tr '\n' ' ')"
ip link set eth0 up
ip addr add 10.77.0.1/24 dev eth0
ping -c 3 -W 5 10.77.0.2 > /tmp/ping.txt || { cat /tmp/ping.txt; exit 1; }
echo "DEVLEND-RESULT ping=ok"
dd if=/dev/urandom of=/tmp/up bs=1K count=FLOW_KIB 2>/dev/null
echo "DEVLEND-RESULT up_sha256=$(sha256sum /tmp/up | cut -d' ' -f1)"
# FLOWS flows out, alternately from vCPU 0 and 1 (XPS picks the transmit queue by CPU).
i=0
while [ $i -lt FLOWS ]; do
  taskset $((1 << (i % 2))) nc 10.77.0.2 5001 < /tmp/up &
  i=$((i+1))
done
wait
# FLOWS flows in, at once (the lender spreads flows over the queue pairs' sessions).
i=0
while [ $i -lt FLOWS ]; do
  taskset $((1 << (i % 2))) sh -c "nc 10.77.0.2 5002 < /dev/null > /tmp/down$i" &
  i=$((i+1))
done
wait
i=0
while [ $i -lt FLOWS ]; do
  echo "DEVLEND-RESULT down$i=$(sha256sum /tmp/down$i | cut -d' ' -f1)"
  i=$((i+1))
done
echo "DEVLEND-RESULT phase=traffic-done"
i=0
while [ "$(cat /sys/class/net/eth0/carrier 2>/dev/null)" = 1 ]; do
  sleep 0.2; i=$((i+1)); [ $i -lt 300 ] || break
done
echo "DEVLEND-RESULT carrier_while_gone=$(cat /sys/class/net/eth0/carrier 2>/dev/null)"
echo "DEVLEND-RESULT phase=link-down"
i=0
while [ "$(cat /sys/class/net/eth0/carrier 2>/dev/null)" != 1 ]; do
  sleep 0.2; i=$((i+1)); [ $i -lt 300 ] || break
done
echo "DEVLEND-RESULT carrier_back=$(cat /sys/class/net/eth0/carrier 2>/dev/null)"
i=0
while ! ping -c 1 -W 1 10.77.0.2 > /dev/null 2>&1; do
  i=$((i+1)); [ $i -lt 40 ] || break
done
ping -c 3 -W 5 10.77.0.2 > /dev/null && echo "DEVLEND-RESULT resumed=ok"
echo "DEVLEND-RESULT phase=resumed"
# The host restarts the compute agent: QEMU loses the socket (link down), joins the
# restored attachment again (link up).
i=0
while [ "$(cat /sys/class/net/eth0/carrier 2>/dev/null)" = 1 ]; do
  sleep 0.1; i=$((i+1)); [ $i -lt 600 ] || break
done
echo "DEVLEND-RESULT carrier_at_restart=$(cat /sys/class/net/eth0/carrier 2>/dev/null)"
i=0
while ! ping -c 1 -W 1 10.77.0.2 > /dev/null 2>&1; do
  i=$((i+1)); [ $i -lt 60 ] || break
done
ping -c 3 -W 5 10.77.0.2 > /dev/null && echo "DEVLEND-RESULT after_restart=ok"
nc 10.77.0.2 5002 < /dev/null > /tmp/down-restart
echo "DEVLEND-RESULT down_restart=$(sha256sum /tmp/down-restart | cut -d' ' -f1)"
echo "DEVLEND-RESULT phase=restarted"
i=0
while [ -e /sys/class/net/eth0 ]; do sleep 0.2; i=$((i+1)); [ $i -lt 300 ] || exit 4; done
echo "DEVLEND-RESULT phase=unplugged"
devlend-wait-for /sys/class/net/eth0 120
ip link set eth0 up
ip addr add 10.77.0.1/24 dev eth0
i=0
while ! ping -c 1 -W 1 10.77.0.2 > /dev/null 2>&1; do
  i=$((i+1)); [ $i -lt 40 ] || break
done
ping -c 3 -W 5 10.77.0.2 > /dev/null && echo "DEVLEND-RESULT again=ok"
"#;

/// The peer: 5001 takes any number of connections at once and logs `sha256 length` of
/// each to `OUT`; 5002 sends FLOW_KIB KiB of a fixed pattern to each connection.
const PEER: &str = r#"
import hashlib, socket, sys, threading
out = sys.argv[1]; n = int(sys.argv[2]) << 10
data = bytes((i * 7 + 3) % 256 for i in range(n))
lock = threading.Lock()
def take(c):
    h = hashlib.sha256(); got = 0
    while True:
        b = c.recv(1 << 16)
        if not b: break
        h.update(b); got += len(b)
    c.close()
    with lock, open(out, "a") as f: f.write(f"{h.hexdigest()} {got}\n")
def give(c):
    c.sendall(data); c.close()
def serve(port, fn):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.77.0.2", port)); s.listen(64)
    while True:
        c, _ = s.accept(); threading.Thread(target=fn, args=(c,), daemon=True).start()
threading.Thread(target=serve, args=(5001, take), daemon=True).start()
serve(5002, give)
"#;

fn wait_phase(guest: &Guest, phase: &str, timeout: Duration) -> Result<()> {
    let want = format!("DEVLEND-RESULT phase={phase}");
    guest
        .wait_for_line(|l| l.trim() == want || l.contains("DEVLEND-DONE"), timeout)
        .and_then(|l| {
            if l.contains("DEVLEND-DONE") {
                bail!("the guest ended before {phase}:\n{}", guest.console())
            }
            Ok(())
        })
        .with_context(|| format!("waiting for {phase}:\n{}", guest.console()))
}

#[test]
fn a_nic_plugged_live_carries_two_queue_pairs_and_follows_the_lender() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let fabric = Netns::new(0)?;
    let tag = format!("dq{}", std::process::id() % 100_000);
    let mut lan = PeerLan::new(&tag, &fabric.name, "10.77.0.2/24", 1500)?;
    let received = dir.path().join("received.txt");
    lan.spawn_python(
        PEER,
        &[&received.display().to_string(), &FLOW_KIB.to_string()],
    )?;

    let addr = format!("{}:{}", fabric.ns_ip, free_port()?);
    let device = format!("nic0=net:{},mac={MAC}", lan.lent_if);
    let metrics = format!("{}:{}", fabric.ns_ip, free_port()?);
    let mut lender = Lender::start_in(
        dir.path(),
        Some(&fabric.name),
        &addr,
        std::slice::from_ref(&device),
        &[
            "--insecure".to_owned(),
            "--metrics-listen".to_owned(),
            metrics.clone(),
        ],
    )?;
    let mut borrower = Borrower::start(dir.path())?;
    let script = SCRIPT
        .replace("FLOWS", &FLOWS.to_string())
        .replace("FLOW_KIB", &FLOW_KIB.to_string());
    let mut guest = Guest::builder()
        .name("guest_net_mq")
        .vcpus(2)
        .script(script)
        .boot()?;
    guest.wait_for_text(
        "DEVLEND-WAIT path=/sys/class/net/eth0",
        Duration::from_secs(120),
    )?;
    let qmp = guest.qmp_socket().display().to_string();
    let sock = dir.path().join("nic0.sock");
    let s = sock.display().to_string();
    let attach = [
        "attach", "--lender", &addr, "--device", "nic0", "--socket", &s, "--queues", "2", "--qmp",
        &qmp, "--id", "net0",
    ];
    let info = borrower.cli_json(&attach)?;
    assert_eq!(info["kind"], "nic", "{info}");
    assert_eq!(info["vmm"]["device_id"], "net0", "{info}");

    if let Err(e) = wait_phase(&guest, "traffic-done", Duration::from_secs(240)) {
        eprintln!(
            "lender log:\n{}\nborrower log:\n{}",
            lender.proc.log(),
            borrower.proc.log()
        );
        return Err(e);
    }
    let during = borrower.cli_json(&["status"])?;
    let table = String::from_utf8_lossy(&borrower.cli(&["status"])?.stdout).into_owned();
    let lent = scrape_metrics(&metrics)?;
    lender.proc.kill_hard();
    wait_phase(&guest, "link-down", Duration::from_secs(90))?;
    let _lender = Lender::start_in(
        dir.path(),
        Some(&fabric.name),
        &addr,
        &[device],
        &["--insecure".to_owned()],
    )?;
    wait_phase(&guest, "resumed", Duration::from_secs(120))?;
    let after = borrower.cli_json(&["status"])?;
    // SIGTERM keeps the attachment (and the VM's device) in the state file; the next
    // agent serves it again on the same socket.
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("api.state.json"))?)?;
    assert_eq!(saved["attachments"][0]["kind"], "nic", "{saved}");
    let code = borrower.proc.terminate(Duration::from_secs(40))?;
    assert!(code.success(), "compute agent exit: {code:?}");
    borrower = Borrower::start_named(dir.path(), "compute-agent-2", &[])?;
    wait_phase(&guest, "restarted", Duration::from_secs(120))?;
    let restored = borrower.cli_json(&["status"])?;
    assert_eq!(restored[0]["id"], "net0", "{restored}");
    assert_eq!(restored[0]["kind"], "nic", "{restored}");
    assert_eq!(
        restored[0]["pairs"].as_array().map(Vec::len),
        Some(2),
        "{restored}"
    );
    let detached = borrower.cli_json(&["detach", "net0"])?;
    eprintln!("detach: {detached}");
    wait_phase(&guest, "unplugged", Duration::from_secs(90))?;
    borrower
        .cli_json(&attach)
        .context("attach again under the same id")?;
    let out = guest.wait_done(Duration::from_secs(180))?;
    out.check_success()?;

    let queues = out.result("queues").context("no queues")?;
    for q in ["rx-0", "rx-1", "tx-0", "tx-1"] {
        assert!(queues.split_whitespace().any(|x| x == q), "{queues}");
    }
    assert_eq!(out.result("ping"), Some("ok"));
    let up = out.result("up_sha256").context("no up_sha256")?;
    let got = std::fs::read_to_string(&received)?;
    let want = format!("{up} {}", FLOW_KIB << 10);
    assert_eq!(
        got.lines().filter(|l| *l == want).count(),
        FLOWS,
        "guest → peer flows: {got}"
    );
    let pattern: Vec<u8> = (0..FLOW_KIB << 10)
        .map(|i| ((i * 7 + 3) % 256) as u8)
        .collect();
    let down = sha256_hex(&pattern);
    for i in 0..FLOWS {
        assert_eq!(
            out.result(&format!("down{i}")),
            Some(down.as_str()),
            "peer → guest flow {i}"
        );
    }
    // Both queue pairs carried frames each way.
    let pairs = during[0]["pairs"].as_array().context("no pairs")?.clone();
    assert_eq!(pairs.len(), 2, "{during}");
    for (i, p) in pairs.iter().enumerate() {
        for k in ["tx_packets", "rx_packets"] {
            assert!(
                p[k].as_u64().unwrap_or(0) >= 50,
                "queue pair {i} carried too few {k}: {during}"
            );
        }
    }
    // The human table has the NIC's line; the lender's metrics count the frames.
    let row = table
        .lines()
        .find(|l| l.starts_with("net0 "))
        .with_context(|| format!("no net0 line in:\n{table}"))?;
    assert!(table.contains("RX PKTS") && row.contains(" up "), "{table}");
    let flows_bytes = ((FLOWS * FLOW_KIB) << 10) as f64;
    for dir in ["rx", "tx"] {
        let bytes = metric_value(
            &lent,
            &format!("devlend_nic_bytes_total{{device=\"nic0\",dir=\"{dir}\"}}"),
        )
        .with_context(|| format!("no NIC bytes {dir} in:\n{lent}"))?;
        assert!(bytes > flows_bytes, "lender's {dir} bytes {bytes}:\n{lent}");
    }
    assert_eq!(
        out.result("carrier_while_gone"),
        Some("0"),
        "the guest's link stayed up while the lender was away:\n{}",
        out.console
    );
    assert_eq!(out.result("carrier_back"), Some("1"), "{}", out.console);
    assert_eq!(out.result("resumed"), Some("ok"), "{}", out.console);
    assert_eq!(
        out.result("after_restart"),
        Some("ok"),
        "no traffic after the compute agent restarted:\n{}",
        out.console
    );
    assert_eq!(out.result("down_restart"), Some(down.as_str()));
    assert_eq!(
        out.result("carrier_at_restart"),
        Some("0"),
        "the guest's link stayed up while the compute agent was away:\n{}",
        out.console
    );
    assert_eq!(after[0]["link_up"], true, "{after}");
    assert!(after[0]["reconnects"].as_u64().unwrap_or(0) >= 2, "{after}");
    assert_eq!(
        out.result("again"),
        Some("ok"),
        "the NIC attached again after a live detach carries no traffic:\n{}",
        out.console
    );
    Ok(())
}
