//! A lender reached over two paths: its own network namespace joined to this one by
//! two veth links (two subnets), the lender listening on both addresses, and either
//! link cut silently on demand.

use std::path::Path;

use anyhow::Result;

use crate::agents::{bin, spawn_in, wait_listening, Proc};
use crate::lan::PeerLan;
use crate::netns::{BlackHole, HostLink, Netns};

/// The lender of `disk0` (a file) or `nic0` in namespace number `n`, on `0.0.0.0:7700`
/// there.
pub struct TwoPathLender {
    /// Link 0 is the namespace's own veth.
    pub ns: Netns,
    /// Link 1.
    pub link2: HostLink,
    _black_hole: BlackHole,
    /// The lender.
    pub lender: Proc,
    /// `HOST:PORT` of the lender on link 0 and on link 1.
    pub paths: [String; 2],
    /// The wire of the NIC it lends, with its peer host ([`Self::start_nic`]).
    pub lan: Option<PeerLan>,
}

impl TwoPathLender {
    /// Starts the lender of `img` as `disk0` (with `--insecure`: direct mode beyond
    /// loopback) and waits until it answers on both paths.
    ///
    /// # Errors
    /// `ip` fails (not root), or the lender does not start.
    pub fn start(n: u8, dir: &Path, img: &Path) -> Result<Self> {
        Self::start_limited(n, dir, img, "")
    }

    /// As [`Self::start`], with `options` after the device's path (`,iops_read=200`:
    /// the lender's own limits, `docs/qos.md`).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_limited(n: u8, dir: &Path, img: &Path, options: &str) -> Result<Self> {
        Self::start_lending(
            n,
            dir,
            |_| Ok((format!("disk0={}{options}", img.display()), None)),
            &[],
        )
    }

    /// As [`Self::start`], the lender given `args` too (`--tls-cert ...`).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_with_args(n: u8, dir: &Path, img: &Path, args: &[String]) -> Result<Self> {
        Self::start_lending(
            n,
            dir,
            |_| Ok((format!("disk0={}", img.display()), None)),
            args,
        )
    }

    /// Starts the lender of `nic0`: one end of a veth pair in its namespace, whose
    /// other end is a peer host at `peer_cidr` ([`PeerLan`], tagged `tag`).
    ///
    /// # Errors
    /// `ip` fails (not root), or the lender does not start.
    pub fn start_nic(n: u8, dir: &Path, tag: &str, peer_cidr: &str) -> Result<Self> {
        Self::start_lending(
            n,
            dir,
            |ns| {
                let lan = PeerLan::new(tag, &ns.name, peer_cidr, 1500)?;
                Ok((format!("nic0=net:{}", lan.lent_if), Some(lan)))
            },
            &[],
        )
    }

    /// Starts the lender of the device `device` makes in the lender's namespace (its
    /// `--device` value, and the peer's wire of a NIC), with `extra` arguments.
    fn start_lending(
        n: u8,
        dir: &Path,
        device: impl FnOnce(&Netns) -> Result<(String, Option<PeerLan>)>,
        extra: &[String],
    ) -> Result<Self> {
        let ns = Netns::new(n)?;
        let link2 = ns.second_link()?;
        // A cut path answers nothing, not even through the default route.
        let black_hole = BlackHole::new(&[&ns.ns_ip, &link2.ns_ip])?;
        let paths = [
            format!("{}:7700", ns.ns_ip),
            format!("{}:7700", link2.ns_ip),
        ];
        let (device, lan) = device(&ns)?;
        let mut args = vec![
            "--listen".to_owned(),
            "0.0.0.0:7700".into(),
            "--device".into(),
            device,
            "--insecure".into(),
        ];
        args.extend_from_slice(extra);
        let mut lender = spawn_in(
            Some(&ns.name),
            "device-agent",
            &bin("devlend-device-agent")?,
            &args,
            dir,
        )?;
        wait_listening(&mut lender, &paths[0])?;
        wait_listening(&mut lender, &paths[1])?;
        Ok(TwoPathLender {
            ns,
            link2,
            _black_hole: black_hole,
            lender,
            paths,
            lan,
        })
    }

    /// Starts another lender in the same namespace, listening on link 2's address at
    /// `port` only, lending `device` (a `--device` value) with its own key (made in
    /// `dir`): what a path given by mistake may lead to.
    ///
    /// # Errors
    /// The lender does not start.
    pub fn start_other(&self, dir: &Path, port: u16, device: &str) -> Result<(Proc, String)> {
        let addr = format!("{}:{port}", self.link2.ns_ip);
        let mut other = spawn_in(
            Some(&self.ns.name),
            "other-device-agent",
            &bin("devlend-device-agent")?,
            &[
                "--listen".into(),
                addr.clone(),
                "--device".into(),
                device.into(),
                "--key-file".into(),
                dir.join("other-identity.key").display().to_string(),
                "--insecure".into(),
            ],
            dir,
        )?;
        wait_listening(&mut other, &addr)?;
        Ok((other, addr))
    }

    /// Takes link `i` (0 or 1) down — a silent cut: no reset, packets dropped — or up.
    ///
    /// # Errors
    /// `ip` fails.
    pub fn set_link(&self, i: usize, up: bool) -> Result<()> {
        match i {
            0 => self.ns.set_link(up),
            _ => self.link2.set_link(up),
        }
    }
}
