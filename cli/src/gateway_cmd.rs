//! `devlend gateway status`: a cluster gateway's peers, sessions, bytes and RTTs, from
//! its control endpoint (`GET /v1/status`).

use anyhow::{Context, Result};
use devlend_gateway::status::Status;

/// `devlend gateway` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum GatewayCmd {
    /// Show the gateway's peers (link up or down, RTT, sessions, bytes), the links peers
    /// opened to it, and its local sessions.
    Status {
        /// The gateway's control address (its `control` setting), HOST:PORT.
        #[arg(long, default_value = "127.0.0.1:7712")]
        control: String,
        /// Print the JSON the gateway answered.
        #[arg(long)]
        json: bool,
    },
}

/// Fetches the gateway's status.
///
/// # Errors
/// The gateway cannot be reached, or answers something else than a status.
pub fn fetch(control: &str) -> Result<Status> {
    let url = format!("http://{control}/v1/status");
    devlend_pool::https::http_only_builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()?
        .get(&url)
        .send()
        .with_context(|| format!("cannot reach the gateway's control endpoint at {url}"))?
        .error_for_status()?
        .json()
        .with_context(|| format!("{url} did not answer a gateway status"))
}

fn bytes(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// The status as text.
pub fn render(s: &Status) -> String {
    let mut o = format!("gateway of cluster {} (up {} s)\n", s.cluster, s.uptime_s);
    o.push_str(&format!(
        "local sessions: {} active, {} total, {} refused; {} in, {} out\n",
        s.local.sessions_active,
        s.local.sessions_total,
        s.local.refused,
        bytes(s.local.bytes_in),
        bytes(s.local.bytes_out)
    ));
    o.push_str("peers:\n");
    if s.peers.is_empty() {
        o.push_str("  (no routes)\n");
    }
    for p in &s.peers {
        let rtt = p.rtt_us.map_or_else(
            || "-".to_owned(),
            |r| format!("{:.2} ms", r as f64 / 1000.0),
        );
        o.push_str(&format!(
            "  {:<12} {:<22} {:<5} rtt {:<9} sessions {}/{}  sent {}  received {}  links {}\n",
            p.clusters.join(","),
            p.addr,
            if p.connected { "up" } else { "DOWN" },
            rtt,
            p.sessions_active,
            p.sessions_total,
            bytes(p.bytes_sent),
            bytes(p.bytes_received),
            p.connects
        ));
        if let Some(e) = &p.last_error {
            o.push_str(&format!("    {e}\n"));
        }
    }
    if !s.inbound.is_empty() {
        o.push_str("inbound links:\n");
        for i in &s.inbound {
            o.push_str(&format!(
                "  {:<12} {:<22} sessions {}/{}  sent {}  received {}\n",
                i.cluster,
                i.remote,
                i.sessions_active,
                i.sessions_total,
                bytes(i.bytes_sent),
                bytes(i.bytes_received)
            ));
        }
    }
    o
}

/// Runs a `devlend gateway` subcommand.
///
/// # Errors
/// As [`fetch`].
pub fn run(cmd: GatewayCmd) -> Result<()> {
    match cmd {
        GatewayCmd::Status { control, json } => {
            let s = fetch(&control)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print!("{}", render(&s));
            }
        }
    }
    Ok(())
}
