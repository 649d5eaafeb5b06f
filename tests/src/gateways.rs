//! Two clusters joined by their gateways, each host in its own network namespace, for
//! the gateway tests (`tests/tests/gateway.rs`, `tests/tests/guest_gateway.rs`):
//!
//! ```text
//! cluster a                                         cluster b
//! [compute: compute agent] --- [gateway a] ==delay relay (root ns)== [gateway b] --- [device: lender]
//! ```
//!
//! Each cluster's hosts are joined by a veth pair of their own ([`NsLink`]); the
//! gateways' link goes through a [`DelayRelay`] in the test process, one each way
//! (the relay a -> b carries gateway a's link, b -> a gateway b's). Cluster `loop` is
//! routed a -> b and b -> a: a routing loop; cluster `dead` is routed by gateway a to
//! an address where nothing listens. The lender serves `disk0` (a sparse file
//! of [`DISK`] bytes) as `store1` of cluster b.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::agents::{bin, sparse_file, spawn_in, wait_listening, Borrower, Proc};
use crate::certs::Certs;
use crate::delay::DelayRelay;
use crate::netns::{Netns, NsLink};

const MIB: u64 = 1 << 20;
/// Size of the lent disk, bytes.
pub const DISK: u64 = 64 * MIB;
/// The port of the agents' metrics endpoints (each in its own namespace); the gateways'
/// is 7713.
pub const METRICS_PORT: u16 = 7714;
/// The long link's one-way delay when on.
pub const DELAY: Duration = Duration::from_millis(10);

/// The topology of the module doc. Fields drop in order: processes, relays, links,
/// namespaces.
pub struct Topo {
    /// The compute agent, in cluster a (`--cluster a --gateway ...`).
    pub borrower: Borrower,
    /// Gateway a.
    pub gw_a: Proc,
    /// Gateway b (`None` while a test has it stopped).
    pub gw_b: Option<Proc>,
    _lender: Proc,
    /// The relay carrying gateway a's link to gateway b.
    pub relay_ab: DelayRelay,
    _relay_ba: DelayRelay,
    gw_b_ns: String,
    compute_ns: String,
    borrower_args: Vec<String>,
    gw_b_config: PathBuf,
    gw_b_probe: String,
    /// Gateway a's control address, from the root namespace.
    pub control_a: String,
    /// Gateway b's control address, from the root namespace.
    pub control_b: String,
    /// Gateway a's local listener, from the root namespace.
    pub local_a: String,
    /// The lender's image file.
    pub img: PathBuf,
    _links: (NsLink, NsLink),
    _ns: Vec<Netns>,
    /// The Prometheus endpoints (`HOST:PORT`, from the root namespace) of the compute
    /// agent, the lender, gateway a and gateway b, in that order.
    pub metrics: [String; 4],
    /// The test's directory (logs, sockets, certificates).
    pub dir: tempfile::TempDir,
}

fn gateway_config(
    dir: &Path,
    certs: &Certs,
    name: &str,
    cluster: &str,
    routes: &[(&str, &str, &str)],
    lenders: &[(&str, String)],
    window: Option<u32>,
) -> PathBuf {
    let mut t = String::new();
    if let Some(w) = window {
        t.push_str(&format!("window = {w}\n"));
    }
    t += &format!(
        "cluster = \"{cluster}\"\nlisten = \"0.0.0.0:7710\"\npeer_listen = \"0.0.0.0:7711\"\ncontrol = \"0.0.0.0:7712\"\n\
         tls_cert = \"{}\"\ntls_key = \"{}\"\ntls_ca = \"{}\"\nping_interval_ms = 200\nlink_timeout_ms = 3000\nmetrics_listen = \"0.0.0.0:7713\"\n[routes]\n",
        certs.path(&format!("{name}.crt")),
        certs.path(&format!("{name}.key")),
        certs.path("ca.crt"),
    );
    for (c, addr, sni) in routes {
        t.push_str(&format!(
            "{c} = {{ addr = \"{addr}\", server_name = \"{sni}\" }}\n"
        ));
    }
    t.push_str("[lenders]\n");
    for (l, addr) in lenders {
        t.push_str(&format!("{l} = \"{addr}\"\n"));
    }
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, t).unwrap();
    p
}

fn start_gateway(dir: &Path, ns: &str, name: &str, config: &Path, probe: &str) -> Proc {
    let mut p = spawn_in(
        Some(ns),
        name,
        &bin("devlend-gateway").unwrap(),
        &["--config".to_owned(), config.display().to_string()],
        dir,
    )
    .unwrap();
    wait_listening(&mut p, probe).unwrap();
    p
}

impl Topo {
    /// Builds it with namespace numbers `base..base + 4` and link numbers `base / 2`
    /// and one more (distinct `base`s, multiples of 4, for tests running at once); the
    /// relays start with no delay. Returns once gateway a's link to b is up.
    ///
    /// # Panics
    /// Any step failing (a test fixture).
    pub fn new(base: u8) -> Topo {
        Self::with_window(base, None)
    }

    /// As [`Self::new`], with both gateways' per-session `window` (bytes) when given.
    ///
    /// # Panics
    /// Any step failing (a test fixture).
    pub fn with_window(base: u8, window: Option<u32>) -> Topo {
        Self::build(base, window, false)
    }

    /// As [`Self::with_window`]; with `lender_tls`, the lender speaks only TLS (the test
    /// CA's `lender` certificate, names `localhost` and `127.0.0.1`) and the compute
    /// agent trusts that CA, for TLS end to end through the gateways.
    ///
    /// # Panics
    /// Any step failing (a test fixture).
    pub fn build(base: u8, window: Option<u32>, lender_tls: bool) -> Topo {
        let dir = tempfile::tempdir().unwrap();
        let certs = Certs::make(&dir.path().join("certs")).unwrap();
        let ns: Vec<Netns> = (0..4).map(|i| Netns::new(base + i).unwrap()).collect();
        let (c, ga, gb, d) = (&ns[0], &ns[1], &ns[2], &ns[3]);
        let k = base / 2;
        let link_a = NsLink::new(c, ga, k).unwrap();
        let link_b = NsLink::new(gb, d, k + 1).unwrap();
        // The long link: a relay each way, in the root namespace.
        let relay_ab = DelayRelay::start(
            &format!("{}:0", ga.host_ip),
            &format!("{}:7711", gb.ns_ip),
            Duration::ZERO,
        )
        .unwrap();
        let relay_ba = DelayRelay::start(
            &format!("{}:0", gb.host_ip),
            &format!("{}:7711", ga.ns_ip),
            Duration::ZERO,
        )
        .unwrap();
        let img = dir.path().join("disk0.img");
        sparse_file(&img, DISK).unwrap();
        let mut lender = spawn_in(
            Some(&d.name),
            "device-agent",
            &bin("devlend-device-agent").unwrap(),
            &[
                vec![
                    "--listen".to_owned(),
                    "0.0.0.0:7700".into(),
                    "--device".into(),
                    format!("disk0={}", img.display()),
                    "--metrics-listen".into(),
                    format!("0.0.0.0:{METRICS_PORT}"),
                    // Borrowers are not authenticated (TLS, if any, is server-side only).
                    "--insecure".into(),
                ],
                if lender_tls {
                    certs.lender_args(false)
                } else {
                    Vec::new()
                },
            ]
            .concat(),
            dir.path(),
        )
        .unwrap();
        wait_listening(&mut lender, &format!("{}:7700", d.ns_ip)).unwrap();
        // Cluster "loop" is routed a -> b and b -> a: a routing loop.
        let cfg_a = gateway_config(
            dir.path(),
            &certs,
            "gw-a",
            "a",
            &[
                ("b", &relay_ab.addr, "gw-b"),
                ("loop", &relay_ab.addr, "gw-b"),
                // Nothing listens there: an unreachable gateway.
                ("dead", "127.0.0.1:9", "gw-b"),
            ],
            &[],
            window,
        );
        let cfg_b = gateway_config(
            dir.path(),
            &certs,
            "gw-b",
            "b",
            &[
                ("a", &relay_ba.addr, "gw-a"),
                ("loop", &relay_ba.addr, "gw-a"),
            ],
            &[("store1", format!("{}:7700", link_b.b_ip))],
            window,
        );
        let control_a = format!("{}:7712", ga.ns_ip);
        let control_b = format!("{}:7712", gb.ns_ip);
        let gw_b = start_gateway(dir.path(), &gb.name, "gateway-b", &cfg_b, &control_b);
        let gw_a = start_gateway(dir.path(), &ga.name, "gateway-a", &cfg_a, &control_a);
        let borrower_args = [
            vec![
                "--cluster".to_owned(),
                "a".into(),
                "--gateway".into(),
                format!("{}:7710", link_a.b_ip),
                "--metrics-listen".into(),
                format!("0.0.0.0:{METRICS_PORT}"),
            ],
            if lender_tls {
                certs.borrower_args("ca.crt", None)
            } else {
                Vec::new()
            },
        ]
        .concat();
        let borrower =
            Borrower::start_in(dir.path(), Some(&c.name), "compute-agent", &borrower_args).unwrap();
        let t = Topo {
            borrower,
            gw_a,
            gw_b: Some(gw_b),
            _lender: lender,
            relay_ab,
            _relay_ba: relay_ba,
            gw_b_ns: gb.name.clone(),
            compute_ns: c.name.clone(),
            borrower_args,
            gw_b_config: cfg_b,
            gw_b_probe: control_b.clone(),
            local_a: format!("{}:7710", ga.ns_ip),
            control_a,
            control_b,
            img,
            metrics: [
                format!("{}:{METRICS_PORT}", c.ns_ip),
                format!("{}:{METRICS_PORT}", d.ns_ip),
                format!("{}:7713", ga.ns_ip),
                format!("{}:7713", gb.ns_ip),
            ],
            _links: (link_a, link_b),
            _ns: ns,
            dir,
        };
        t.wait_peer_up(Duration::from_secs(20));
        t
    }

    /// `devlend gateway status --json` of the gateway at `control`.
    ///
    /// # Panics
    /// The command fails.
    pub fn status(&self, control: &str) -> Value {
        let out = Command::new(bin("devlend").unwrap())
            .args(["gateway", "status", "--control", control, "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Gateway a's peer for cluster b, from its status.
    ///
    /// # Panics
    /// No such peer.
    pub fn peer_b(&self) -> Value {
        let s = self.status(&self.control_a);
        s["peers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["clusters"].as_array().unwrap().iter().any(|c| c == "b"))
            .cloned()
            .unwrap()
    }

    /// Waits until gateway a's link to b is up with an RTT measured.
    ///
    /// # Panics
    /// Not `within`.
    pub fn wait_peer_up(&self, within: Duration) {
        let t = Instant::now();
        loop {
            let p = self.peer_b();
            if p["connected"] == true && p["rtt_us"].as_u64().is_some() {
                return;
            }
            assert!(
                t.elapsed() < within,
                "gateway a never joined gateway b: {p}\n{}",
                self.gw_a.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A path in the test directory.
    pub fn socket(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `devlend attach --device DEVICE --socket SOCK --queues N --json`.
    ///
    /// # Panics
    /// The CLI cannot run.
    pub fn attach(&self, device: &str, sock: &Path, queues: u16) -> std::process::Output {
        self.borrower
            .cli(&[
                "attach",
                "--device",
                device,
                "--socket",
                &sock.display().to_string(),
                "--queues",
                &queues.to_string(),
                "--json",
            ])
            .unwrap()
    }

    /// Kills gateway b with SIGKILL, waits `down`, and starts it again on the same
    /// configuration (logging to `name`.log).
    ///
    /// # Panics
    /// It cannot start again.
    pub fn restart_gw_b(&mut self, down: Duration, name: &str) {
        if let Some(mut old) = self.gw_b.take() {
            old.kill_hard();
        }
        std::thread::sleep(down);
        self.gw_b = Some(start_gateway(
            self.dir.path(),
            &self.gw_b_ns,
            name,
            &self.gw_b_config,
            &self.gw_b_probe,
        ));
    }

    /// Kills the compute agent with SIGKILL and starts it again with the same
    /// arguments and state file (logging to `name`.log).
    ///
    /// # Panics
    /// It cannot start again.
    pub fn restart_borrower(&mut self, name: &str) {
        self.borrower.proc.kill_hard();
        self.borrower = Borrower::start_in(
            self.dir.path(),
            Some(&self.compute_ns),
            name,
            &self.borrower_args,
        )
        .unwrap();
    }

    /// Takes gateway a's only link out of its namespace down (`false`: every packet to
    /// or from gateway a is dropped, silently: the long link is cut) or up again.
    ///
    /// # Panics
    /// `ip` fails.
    pub fn set_long_link(&self, up: bool) {
        self._ns[1].set_link(up).unwrap();
    }

    /// The logs of both gateways and the compute agent.
    pub fn logs(&self) -> String {
        format!(
            "--- gateway a\n{}\n--- gateway b\n{}\n--- compute agent\n{}",
            self.gw_a.log(),
            self.gw_b.as_ref().map(|p| p.log()).unwrap_or_default(),
            self.borrower.proc.log()
        )
    }
}

/// The first attachment's I/O counters (`devlend status --json`).
///
/// # Panics
/// The command fails.
pub fn counters(b: &Borrower) -> Value {
    let list = b.cli_json(&["status"]).unwrap();
    list[0]["counters"].clone()
}
