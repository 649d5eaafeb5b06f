//! A peer host on a lent NIC's wire: a veth pair whose one end (the interface a lender
//! lends) sits in a given namespace, and whose other end is a peer host in a namespace
//! of its own, with an address. Removed on drop.

use std::process::{Child, Command, Output, Stdio};

use anyhow::{bail, Context, Result};

/// Runs `args`, failing with its stderr when it exits non-zero.
///
/// # Errors
/// The program cannot start or fails.
pub fn run(args: &[&str]) -> Result<String> {
    let out: Output = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("cannot run {}", args[0]))?;
    if !out.status.success() {
        bail!("{args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The peer's namespace and the two ends of its wire.
pub struct PeerLan {
    /// The peer host's namespace.
    pub ns: String,
    /// The end to lend, inside the lender's namespace (up, no address).
    pub lent_if: String,
    /// The peer's end, inside [`PeerLan::ns`], with the peer's address.
    pub peer_if: String,
    servers: Vec<Child>,
}

impl PeerLan {
    /// A veth pair `<tag>l` (moved into `lender_ns`) ↔ `<tag>p` (in a new namespace
    /// `<tag>peer`, address `peer_cidr`), both with `mtu` bytes of MTU. The peer's end
    /// hands the wire one segment per packet (`gso_max_segs 1`), as a remote host's
    /// would: a local TCP's multi-segment sends would otherwise reach the lent end whole.
    ///
    /// # Errors
    /// `ip` fails (not root).
    pub fn new(tag: &str, lender_ns: &str, peer_cidr: &str, mtu: u32) -> Result<Self> {
        let lan = PeerLan {
            ns: format!("{tag}peer"),
            lent_if: format!("{tag}l"),
            peer_if: format!("{tag}p"),
            servers: Vec::new(),
        };
        let _ = Command::new("ip").args(["netns", "del", &lan.ns]).status();
        run(&["ip", "netns", "add", &lan.ns])?;
        let mtu = mtu.to_string();
        run(&[
            "ip",
            "link",
            "add",
            &lan.lent_if,
            "mtu",
            &mtu,
            "type",
            "veth",
            "peer",
            "name",
            &lan.peer_if,
            "mtu",
            &mtu,
        ])?;
        run(&["ip", "link", "set", &lan.lent_if, "netns", lender_ns])?;
        run(&["ip", "link", "set", &lan.peer_if, "netns", &lan.ns])?;
        run(&[
            "ip",
            "netns",
            "exec",
            lender_ns,
            "ip",
            "link",
            "set",
            &lan.lent_if,
            "up",
        ])?;
        lan.exec(&["ip", "addr", "add", peer_cidr, "dev", &lan.peer_if])?;
        lan.exec(&[
            "ip",
            "link",
            "set",
            "dev",
            &lan.peer_if,
            "gso_max_segs",
            "1",
        ])?;
        lan.exec(&["ip", "link", "set", &lan.peer_if, "up"])?;
        lan.exec(&["ip", "link", "set", "lo", "up"])?;
        Ok(lan)
    }

    /// Lets the peer hand the wire multi-segment TCP sends (`gso_max_segs 65535`, the
    /// default): they reach the lent end whole, as GRO on a real port makes them.
    ///
    /// # Errors
    /// As [`run`].
    pub fn allow_gso(&self) -> Result<()> {
        self.exec(&[
            "ip",
            "link",
            "set",
            "dev",
            &self.peer_if,
            "gso_max_segs",
            "65535",
        ])?;
        Ok(())
    }

    /// Runs `args` inside the peer's namespace.
    ///
    /// # Errors
    /// As [`run`].
    pub fn exec(&self, args: &[&str]) -> Result<String> {
        let mut v = vec!["ip", "netns", "exec", &self.ns];
        v.extend_from_slice(args);
        run(&v)
    }

    /// Starts `python3 -c script args...` inside the peer's namespace; killed on drop.
    ///
    /// # Errors
    /// python3 cannot start.
    pub fn spawn_python(&mut self, script: &str, args: &[&str]) -> Result<()> {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns, "python3", "-c", script])
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .context("cannot start the peer's servers (python3)")?;
        self.servers.push(child);
        Ok(())
    }
}

impl Drop for PeerLan {
    fn drop(&mut self) {
        for s in &mut self.servers {
            let _ = s.kill();
            let _ = s.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}
