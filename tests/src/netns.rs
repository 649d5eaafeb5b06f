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

/// Runs `ip ARGS` (iproute2); its stderr in the error when it fails.
///
/// # Errors
/// `ip` is missing or fails.
pub fn ip(args: &[&str]) -> Result<()> {
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

impl Netns {
    /// A second link into this namespace (another veth pair, another subnet): a
    /// second path to whatever listens inside on a wildcard address.
    ///
    /// # Errors
    /// `ip` fails.
    pub fn second_link(&self) -> Result<HostLink> {
        let host_if = format!("{}h2", self.name);
        let ns_if = format!("{}n2", self.name);
        // The first link is 10.<a>.<4n>.0/30; this one is 10.<a>.<4n+1>.0/30.
        let (prefix, n) = self
            .host_ip
            .rsplit_once('.')
            .and_then(|(net, _)| net.rsplit_once('.'))
            .context("host address")?;
        let third: u8 = n.parse().context("host address")?;
        let host_ip = format!("{prefix}.{}.1", third + 1);
        let ns_ip = format!("{prefix}.{}.2", third + 1);
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
        ])?;
        ip(&["link", "set", &ns_if, "netns", &self.name])?;
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if])?;
        ip(&["link", "set", &host_if, "up"])?;
        ip(&[
            "-n",
            &self.name,
            "addr",
            "add",
            &format!("{ns_ip}/30"),
            "dev",
            &ns_if,
        ])?;
        ip(&["-n", &self.name, "link", "set", &ns_if, "up"])?;
        Ok(HostLink {
            host_if,
            host_ip,
            ns_ip,
        })
    }
}

/// A further link between this namespace and another ([`Netns::second_link`]).
pub struct HostLink {
    host_if: String,
    /// The address of this side.
    pub host_ip: String,
    /// The address inside the namespace.
    pub ns_ip: String,
}

impl HostLink {
    /// Takes the link down (packets dropped both ways, no reset: a silent cut) or up.
    ///
    /// # Errors
    /// `ip` fails.
    pub fn set_link(&self, up: bool) -> Result<()> {
        ip(&["link", "set", &self.host_if, if up { "up" } else { "down" }])
    }
}

impl Drop for HostLink {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.host_if]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// A veth pair joining two namespaces directly (a cluster's own fabric in tests), with
/// addresses 10.<200+pid%50>.<4k>.1/30 in `a` and .2 in `b`. Removed with the
/// namespaces, or on drop.
pub struct NsLink {
    a_ns: String,
    a_if: String,
    /// The address in `a`.
    pub a_ip: String,
    /// The address in `b`.
    pub b_ip: String,
}

impl NsLink {
    /// Joins `a` and `b` with link number `k` of this process (0..=63).
    ///
    /// # Errors
    /// `ip` fails.
    pub fn new(a: &Netns, b: &Netns, k: u8) -> Result<Self> {
        let tag = format!("dg{}{k}", std::process::id() % 100_000);
        let (a_if, b_if) = (format!("{tag}a"), format!("{tag}b"));
        let n = 200 + (std::process::id() % 50) as u8;
        let a_ip = format!("10.{n}.{}.1", k * 4);
        let b_ip = format!("10.{n}.{}.2", k * 4);
        ip(&[
            "link", "add", &a_if, "netns", &a.name, "type", "veth", "peer", "name", &b_if, "netns",
            &b.name,
        ])?;
        for (ns, ifn, addr) in [(&a.name, &a_if, &a_ip), (&b.name, &b_if, &b_ip)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", ifn])?;
            ip(&["-n", ns, "link", "set", ifn, "up"])?;
        }
        Ok(NsLink {
            a_ns: a.name.clone(),
            a_if,
            a_ip,
            b_ip,
        })
    }
}

impl Drop for NsLink {
    fn drop(&mut self) {
        let _ = ip(&["-n", &self.a_ns, "link", "del", &self.a_if]);
    }
}

/// While a link is down its subnet's route is gone, and a connect to the lender's
/// address on it follows the default route instead: in some sandboxes to a proxy that
/// answers any connection (the path's probe then finds the cut path "reachable"). This
/// routes the subnets, below their own routes, into a veth whose peer stays down: while
/// cut, a path answers nothing, as on a real network. Removed on drop.
pub struct BlackHole {
    dev: String,
}

impl BlackHole {
    /// Routes the /30 subnets of `addrs` into the sink.
    ///
    /// # Errors
    /// `ip` fails, or an address is not IPv4.
    pub fn new(addrs: &[&str]) -> Result<Self> {
        // One per rig: tests of one binary run side by side in one process.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 100;
        let dev = format!("dlbh{}x{k}", std::process::id() % 100_000);
        let _ = ip(&["link", "del", &dev]);
        ip(&[
            "link",
            "add",
            &dev,
            "type",
            "veth",
            "peer",
            "name",
            &format!("{dev}p"),
        ])?;
        let me = BlackHole { dev };
        ip(&["link", "set", &me.dev, "up"])?;
        for a in addrs {
            let (net, _) = a.rsplit_once('.').context("an IPv4 address")?;
            let subnet = format!("{net}.0/30");
            ip(&["route", "add", &subnet, "dev", &me.dev, "metric", "4000"])?;
        }
        Ok(me)
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.dev]);
    }
}
