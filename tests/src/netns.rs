//! A second host for tests: a network namespace joined to this one by a veth pair, with
//! private addresses on both ends; its link can be cut and restored.

use std::process::Command;

use anyhow::{bail, Context, Result};

/// A network namespace `dl<pid><n>` with veth `dl<pid><n>h` (here) and `dl<pid><n>n`
/// (inside), addresses 10.<a>.<b>.1/30 here and .2 inside. Removed on drop.
pub struct Netns {
    /// Namespace name (for `ip netns exec`).
    pub name: String,
    host_if: String,
    /// The address of this side.
    pub host_ip: String,
    /// The address inside the namespace.
    pub ns_ip: String,
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("cannot run ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Netns {
    /// Creates namespace number `n` of this process (0..=63).
    ///
    /// # Errors
    /// `ip` fails (not root, no iproute2).
    pub fn new(n: u8) -> Result<Self> {
        let tag = format!("dl{}{n}", std::process::id() % 100_000);
        let name = tag.clone();
        let host_if = format!("{tag}h");
        let ns_if = format!("{tag}n");
        let a = 100 + (std::process::id() % 100) as u8;
        let host_ip = format!("10.{a}.{}.1", n * 4);
        let ns_ip = format!("10.{a}.{}.2", n * 4);
        let _ = ip(&["netns", "del", &name]);
        ip(&["netns", "add", &name])?;
        let me = Netns {
            name,
            host_if: host_if.clone(),
            host_ip: host_ip.clone(),
            ns_ip: ns_ip.clone(),
        };
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
        ])?;
        ip(&["link", "set", &ns_if, "netns", &me.name])?;
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if])?;
        ip(&["link", "set", &host_if, "up"])?;
        let ns = |args: &[&str]| {
            let mut v = vec!["netns", "exec", &me.name, "ip"];
            v.extend_from_slice(args);
            ip(&v)
        };
        ns(&["addr", "add", &format!("{ns_ip}/30"), "dev", &ns_if])?;
        ns(&["link", "set", &ns_if, "up"])?;
        ns(&["link", "set", "lo", "up"])?;
        Ok(me)
    }

    /// Takes the link down (`false`: packets are dropped both ways) or up again.
    ///
    /// # Errors
    /// `ip` fails.
    pub fn set_link(&self, up: bool) -> Result<()> {
        ip(&["link", "set", &self.host_if, if up { "up" } else { "down" }])
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}
