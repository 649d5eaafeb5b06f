//! A lent NIC reached over two paths, under a real QEMU guest (TCG): the lender in its
//! own network namespace, reached over two veth links, lends one end of a veth pair
//! whose other end is a peer host; the attachment is given both lender addresses. The
//! guest pings the peer back to back while the host cuts each link in turn (its end set
//! down: a silent cut) and brings it back. The NIC stays up, frames lost in the cut are
//! only those in flight, and the longest wait between two answered pings stays far
//! below the cut's length: the queue pair's heartbeats notice the cut and its session
//! reopens on the other path, and moves back to its own once that answers again.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use devlend_tests::agents::{free_port, Borrower};
use devlend_tests::guest::Guest;
use devlend_tests::two_paths::TwoPathLender;
use devlend_tests::{metric_value, scrape_metrics};

const GUEST_IP: &str = "10.78.0.1";
const PEER_IP: &str = "10.78.0.2";
/// How long each link stays cut.
const CUT: Duration = Duration::from_secs(3);
/// How long the guest pings (the host's cuts fit in it).
const PING_SECONDS: u64 = 16;

/// Pings the peer one at a time (`-W 1`: a ping lost in a cut costs a second) for
/// PING_SECONDS and reports the longest time between two answered pings, from the
/// kernel's monotonic clock (`now at` in /proc/timer_list; /proc/uptime if missing).
const SCRIPT: &str = r#"
set -e
devlend-wait-for /sys/class/net/eth0 30
ip link set eth0 up
ip addr add GUEST_IP/24 dev eth0
ping -c 3 -W 5 PEER_IP > /tmp/ping.txt || { cat /tmp/ping.txt; exit 1; }
set +e
NOW_MS
now_ms; start=$ms; last=$ms; max=0; ok=0; lost=0
echo "DEVLEND-RESULT phase=pinging"
while [ $((ms - start)) -lt $((PING_SECONDS * 1000)) ]; do
  if ping -c 1 -W 1 PEER_IP > /dev/null 2>&1; then
    now_ms; ok=$((ok + 1))
    gap=$((ms - last)); last=$ms
    [ $gap -gt $max ] && max=$gap
    [ $gap -ge 500 ] && echo "gap of $gap ms, $((ms - start)) ms in"
  else
    now_ms; lost=$((lost + 1))
  fi
done
echo "DEVLEND-RESULT answered=$ok"
echo "DEVLEND-RESULT lost=$lost"
echo "DEVLEND-RESULT max_gap_ms=$max"
"#;

#[test]
fn a_lent_nic_rides_out_silent_cuts_of_either_path() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let tag = format!("dm{}", std::process::id() % 100_000);
    let rig = TwoPathLender::start_nic(43, dir.path(), &tag, &format!("{PEER_IP}/24"))?;
    let paths = rig.paths.clone();
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let borrower = Borrower::start_with(dir.path(), &["--metrics-listen".into(), metrics.clone()])?;
    let sock = dir.path().join("nic0.sock");
    let sock_s = sock.display().to_string();
    let info = borrower.cli_json(&[
        "attach", "--lender", &paths[0], "--lender", &paths[1], "--device", "nic0", "--socket",
        &sock_s,
    ])?;
    assert_eq!(info["kind"], "nic", "{info}");

    let script = SCRIPT
        .replace("NOW_MS", devlend_tests::GUEST_NOW_MS)
        .replace("GUEST_IP", GUEST_IP)
        .replace("PEER_IP", PEER_IP)
        .replace("PING_SECONDS", &PING_SECONDS.to_string());
    let mut guest = Guest::builder()
        .name("guest_net_multipath")
        .script(script)
        .args([
            "-chardev".to_owned(),
            format!("socket,id=n0,path={sock_s},reconnect-ms=1000"),
            "-netdev".into(),
            "vhost-user,id=net0,chardev=n0".into(),
            "-device".into(),
            "virtio-net-pci,netdev=net0,mac=52:54:00:12:34:57".into(),
        ])
        .boot()?;
    guest.wait_for_text("phase=pinging", Duration::from_secs(240))?;
    let pinging = Instant::now();
    let before = borrower.cli_json(&["status"])?[0].clone();
    std::thread::sleep(Duration::from_secs(2));
    for link in 0..2 {
        eprintln!(
            "cut link {link} at {:.1} s into the pings",
            pinging.elapsed().as_secs_f64()
        );
        rig.set_link(link, false)?;
        std::thread::sleep(CUT);
        rig.set_link(link, true)?;
        std::thread::sleep(Duration::from_secs(2));
    }
    // While the guest still pings: where the pair's session is.
    let during = borrower.cli_json(&["status"])?[0].clone();
    if pinging.elapsed() >= Duration::from_secs(PING_SECONDS) {
        bail!("the cuts outlasted the guest's pings");
    }
    let out = guest.wait_done(Duration::from_secs(120))?;
    let status = borrower.cli_json(&["status"])?[0].clone();
    eprintln!("net status: {status}");
    out.check_success()?;
    let max_gap: u64 = out.result("max_gap_ms").context("no max_gap_ms")?.parse()?;
    let answered: u64 = out.result("answered").context("no answered")?.parse()?;
    eprintln!(
        "{answered} pings answered, {} lost; the longest wait between two answers: {max_gap} ms",
        out.result("lost").unwrap_or("?")
    );
    assert!(answered >= 10, "{}", out.console);
    // A cut costs the ping in flight (its 1 s wait) and the ~400 ms until the pair's
    // heartbeats notice it: well under the 3 s cut a single path rides out.
    assert!(
        max_gap < 2_000,
        "a {} s cut stopped the pings for {max_gap} ms:\n{}",
        CUT.as_secs(),
        out.console
    );
    // Each cut moved the pair's session: a reconnect each, the NIC up throughout.
    let reconnects = |s: &serde_json::Value| s["reconnects"].as_u64().unwrap_or(0);
    assert!(
        reconnects(&status) > reconnects(&before),
        "before {before}\nafter {status}"
    );
    assert_eq!(status["link_up"], true, "{status}");
    // The first cut moved the pair to path 2; once path 1 answered again the pair
    // moved back to it, its own, so the second cut (of path 2) cost it nothing: one
    // failover, within the 2 s bound. Without the move back, the second cut is a
    // second failover.
    assert_eq!(status["failovers"], 1, "{status}");
    let last_us = status["last_failover_us"].as_u64().unwrap_or(0);
    assert!(last_us > 0 && last_us < 2_000_000, "{status}");
    let log = borrower.proc.log();
    assert!(
        log.contains("queue pair moved back to its own path"),
        "no move back:\n{log}"
    );
    let p = status["paths"].as_array().context("paths in status")?;
    assert_eq!(p.len(), 2, "{status}");
    for (i, path) in p.iter().enumerate() {
        assert_eq!(path["addr"], paths[i], "{status}");
        assert_eq!(path["up"], true, "{status}");
    }
    assert_eq!(p[0]["failures"], 1, "the first cut: {status}");
    let sessions = |s: &serde_json::Value| -> Vec<u64> {
        s["paths"]
            .as_array()
            .map(|p| p.iter().filter_map(|p| p["sessions"].as_u64()).collect())
            .unwrap_or_default()
    };
    assert_eq!(
        sessions(&during),
        [1, 0],
        "the pair is back on its own path: {during}"
    );
    // The guest is gone, and with it the frontend and its pair engines: no session
    // counts on a path any more.
    assert_eq!(sessions(&status), [0, 0], "{status}");
    let table = borrower.cli(&["status"])?;
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains(&format!("paths {} up (0 sessions, 1 failure)", paths[0]))
            && table.contains("; 1 failover, the last took"),
        "{table}"
    );
    let text = scrape_metrics(&metrics)?;
    assert_eq!(
        metric_value(&text, "devlend_attachment_failovers_total{"),
        Some(1.0),
        "{text}"
    );
    for p in &paths {
        let up = text.lines().find(|l| {
            l.starts_with("devlend_attachment_path_up{") && l.contains(&format!("path=\"{p}\""))
        });
        assert!(up.is_some_and(|l| l.ends_with(" 1")), "{p}: {text}");
    }
    let lender_log = rig.lender.log();
    assert!(
        lender_log.contains("earlier session of this queue fenced"),
        "the lender did not fence the cut path's session:\n{lender_log}"
    );
    Ok(())
}
