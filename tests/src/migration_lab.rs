//! The hosts of a live-migration test with lent devices: compute hosts A and B (network
//! namespaces joined by a veth link, the migration stream's path), a lender L in a third
//! namespace linked to both, and a compute host C in this namespace. The lender runs in
//! direct mode and trusts one key per compute host; each compute host runs its own
//! compute agent with its key. Shared by the block (`tests/tests/migration.rs`) and NIC
//! (`tests/tests/migration_net.rs`) migration tests.
//!
//! The devices the lender serves are the test's: [`Lab::start`] asks for them once L's
//! namespace exists (a NIC's interface must be moved into it before the lender starts).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{ensure, Context, Result};
use serde_json::Value;

use crate::agents::{bin, spawn_in, wait_listening, Borrower, Proc};
use crate::netns::{Netns, NsLink};

/// The port the lender listens on, in its namespace.
pub const LENDER_PORT: u16 = 7700;

/// Compute hosts A and B, joined directly (the migration stream's path).
pub struct Hosts {
    /// The A–B link.
    pub ab: NsLink,
    /// Host B's namespace.
    pub b: Netns,
    /// Host A's namespace.
    pub a: Netns,
}

impl Hosts {
    /// Namespaces `n` and `n + 1`, link `k`.
    ///
    /// # Errors
    /// `ip` fails (not root).
    pub fn new(n: u8, k: u8) -> Result<Self> {
        let a = Netns::new(n)?;
        let b = Netns::new(n + 1)?;
        let ab = NsLink::new(&a, &b, k)?;
        Ok(Hosts { ab, b, a })
    }

    /// The namespace of host `to` (0: A, 1: B) and the URI its destination QEMU listens
    /// on for migration `k`.
    pub fn dest(&self, to: usize, k: usize) -> (&str, String) {
        let port = 4600 + k;
        if to == 0 {
            (&self.a.name, format!("tcp:{}:{port}", self.ab.a_ip))
        } else {
            (&self.b.name, format!("tcp:{}:{port}", self.ab.b_ip))
        }
    }
}

/// The host (0: A, 1: B) migration `k` goes to: B, A, B, ...
pub fn to_host(k: usize) -> usize {
    (k + 1) % 2
}

/// The label of migration `k`: `A>B`, `B>A`, ...
pub fn label(k: usize) -> String {
    let n = ["A", "B"];
    format!("{}>{}", n[k % 2], n[to_host(k)])
}

/// `devlend keygen --out PATH`; returns the public key.
///
/// # Errors
/// The CLI fails.
pub fn keygen(path: &Path) -> Result<String> {
    let out = Command::new(bin("devlend")?)
        .args(["keygen", "--out"])
        .arg(path)
        .output()?;
    ensure!(
        out.status.success(),
        "keygen: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// A compute host: its directory, agent and the lender's address from there.
pub struct ComputeHost {
    /// `a`, `b` or `c`.
    pub name: &'static str,
    /// Its directory (agent log, API and vhost-user sockets).
    pub dir: PathBuf,
    /// Its compute agent.
    pub agent: Borrower,
    /// The lender's `HOST:PORT` as this host reaches it.
    pub lender: String,
    /// The public key of its `--auth-key-file`: a handover to it names it (`--to-key`).
    pub public_key: String,
}

impl ComputeHost {
    /// Starts the compute agent of host `name` in `root/name`, inside `ns` when given,
    /// with the key file and public key `key`.
    ///
    /// # Errors
    /// The agent does not start.
    pub fn start(
        name: &'static str,
        root: &Path,
        ns: Option<&str>,
        key: &(PathBuf, String),
        lender: String,
    ) -> Result<Self> {
        let (key, public) = key;
        let dir = root.join(name);
        std::fs::create_dir_all(&dir)?;
        let agent = Borrower::start_in(
            &dir,
            ns,
            &format!("compute-{name}"),
            &["--auth-key-file".into(), key.display().to_string()],
        )?;
        Ok(ComputeHost {
            name,
            dir,
            agent,
            lender,
            public_key: public.clone(),
        })
    }

    /// A vhost-user socket path on this host, tagged `tag`.
    pub fn socket(&self, tag: &str) -> PathBuf {
        self.dir.join(format!("dev0-{tag}.sock"))
    }

    /// `devlend ARGS... --json` on this host's agent; the output whether it succeeds.
    ///
    /// # Errors
    /// The CLI cannot run.
    pub fn try_cli(&self, args: &[&str]) -> Result<Output> {
        let mut a = args.to_vec();
        a.push("--json");
        self.agent.cli(&a)
    }

    /// `devlend ARGS... --json`, which must succeed: its JSON.
    ///
    /// # Errors
    /// The command fails (its stderr and this host's name are in the error).
    pub fn json(&self, args: &[&str]) -> Result<Value> {
        self.agent
            .cli_json(args)
            .with_context(|| format!("on {}: devlend {args:?}", self.name))
    }

    /// `devlend attach` of the lender's `device` on `sock` with one queue: the JSON.
    ///
    /// # Errors
    /// As [`Self::json`].
    pub fn attach(&self, device: &str, sock: &Path) -> Result<Value> {
        self.attach_with(device, sock, &["--queues", "1"])
    }

    /// `devlend attach` of the lender's `device` on `sock` with the options `extra`
    /// (`--queues N`, ...): the JSON.
    ///
    /// # Errors
    /// As [`Self::json`].
    pub fn attach_with(&self, device: &str, sock: &Path, extra: &[&str]) -> Result<Value> {
        let s = sock.display().to_string();
        let mut args = vec![
            "attach",
            "--lender",
            &self.lender,
            "--device",
            device,
            "--socket",
            &s,
        ];
        args.extend_from_slice(extra);
        self.json(&args)
    }

    /// Ids of the attachments `devlend status` lists.
    ///
    /// # Errors
    /// As [`Self::json`].
    pub fn attachment_ids(&self) -> Result<Vec<String>> {
        let s = self.json(&["status"])?;
        Ok(s.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }
}

/// The attachment id in an `attach` / `migrate prepare` answer (`id`, or
/// `attachment.id`).
///
/// # Errors
/// There is none.
pub fn attachment_id(v: &Value) -> Result<String> {
    v["id"]
        .as_str()
        .or_else(|| v["attachment"]["id"].as_str())
        .map(str::to_owned)
        .with_context(|| format!("no attachment id in {v}"))
}

/// The JSON of a CLI command's output, which must have succeeded.
///
/// # Errors
/// It failed (its stderr is in the error) or printed no JSON.
pub fn ok_json(out: &Output, what: &str) -> Result<Value> {
    ensure!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).with_context(|| format!("{what}: not JSON"))
}

/// The `-chardev`, `-netdev` and `-device` arguments of QEMU arguments as `devlend`
/// prints them (`attach`, `migrate prepare`): what a test's QEMU adds to the harness's
/// own (which has the shared memory backend; `-incoming` the test gives).
///
/// # Errors
/// There is no `-device` among them.
pub fn printed_device_args(qemu_args: &str) -> Result<Vec<String>> {
    let words: Vec<&str> = qemu_args
        .split_whitespace()
        .filter(|w| *w != "\\")
        .collect();
    let mut out = Vec::new();
    for w in words.windows(2) {
        if matches!(w[0], "-chardev" | "-netdev" | "-device") {
            out.push(w[0].to_owned());
            out.push(w[1].to_owned());
        }
    }
    ensure!(
        out.iter().any(|a| a == "-device"),
        "no -device in the printed QEMU arguments: {qemu_args}"
    );
    Ok(out)
}

/// `token` with one character of its signature changed (base64url).
pub fn forge(token: &str) -> String {
    let mut t: Vec<char> = token.chars().collect();
    if let Some(c) = t.iter_mut().rev().nth(5) {
        *c = if *c == 'A' { 'B' } else { 'A' };
    }
    t.into_iter().collect()
}

/// Lender L (own namespace) and compute hosts A, B (their namespaces, each linked to L)
/// and C (this namespace), each with a key the lender trusts.
pub struct Lab {
    /// A and B.
    pub hosts: Hosts,
    /// The lender's namespace.
    pub l: Netns,
    _la: NsLink,
    _lb: NsLink,
    /// The lender.
    pub lender: Proc,
    /// Compute host A.
    pub a: ComputeHost,
    /// Compute host B.
    pub b: ComputeHost,
    /// Compute host C.
    pub c: ComputeHost,
}

impl Lab {
    /// Namespaces `n` (A), `n + 1` (B), `n + 2` (L), links `k` to `k + 2`; the lender
    /// serves the `--device` specs `devices` returns, given L's namespace.
    ///
    /// # Errors
    /// A namespace, agent or device cannot be set up.
    pub fn start(
        dir: &Path,
        n: u8,
        k: u8,
        devices: impl FnOnce(&Netns) -> Result<Vec<String>>,
    ) -> Result<Self> {
        let hosts = Hosts::new(n, k)?;
        let l = Netns::new(n + 2)?;
        let la = NsLink::new(&l, &hosts.a, k + 1)?;
        let lb = NsLink::new(&l, &hosts.b, k + 2)?;
        let mut args = vec!["--listen".to_owned(), format!("0.0.0.0:{LENDER_PORT}")];
        for d in devices(&l)? {
            args.push("--device".into());
            args.push(d);
        }
        args.push("--key-file".into());
        args.push(dir.join("lender.key").display().to_string());
        let mut keys = Vec::new();
        for name in ["a", "b", "c"] {
            let key = dir.join(format!("{name}.key"));
            let public = keygen(&key)?;
            args.push("--auth-key".into());
            args.push(public.clone());
            keys.push((key, public));
        }
        let mut lender = spawn_in(
            Some(&l.name),
            "device-agent",
            &bin("devlend-device-agent")?,
            &args,
            dir,
        )?;
        wait_listening(&mut lender, &format!("{}:{LENDER_PORT}", l.ns_ip))?;
        let a = ComputeHost::start(
            "a",
            dir,
            Some(&hosts.a.name),
            &keys[0],
            format!("{}:{LENDER_PORT}", la.a_ip),
        )?;
        let b = ComputeHost::start(
            "b",
            dir,
            Some(&hosts.b.name),
            &keys[1],
            format!("{}:{LENDER_PORT}", lb.a_ip),
        )?;
        let c = ComputeHost::start(
            "c",
            dir,
            None,
            &keys[2],
            format!("{}:{LENDER_PORT}", l.ns_ip),
        )?;
        Ok(Lab {
            hosts,
            l,
            _la: la,
            _lb: lb,
            lender,
            a,
            b,
            c,
        })
    }

    /// Compute host `i` (0: A, 1: B).
    pub fn host(&self, i: usize) -> &ComputeHost {
        if i == 0 {
            &self.a
        } else {
            &self.b
        }
    }

    /// `migrate handover` of attachment `id` on host `from` to the other host (named by
    /// its key, `--to-key`): the token.
    ///
    /// # Errors
    /// The agent refuses.
    pub fn handover(&self, from: usize, id: &str) -> Result<String> {
        // For the other host: its key is the handover's holder.
        let to = &self.host(1 - from.min(1)).public_key;
        let v = self
            .host(from)
            .json(&["migrate", "handover", id, "--to-key", to])?;
        v["handover_token"]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("no handover_token in {v}"))
    }

    /// `migrate prepare` on `on` with `token` for `device` at `sock` (one queue): the
    /// output, whether it succeeded.
    ///
    /// # Errors
    /// The CLI cannot run.
    pub fn prepare(
        &self,
        on: &ComputeHost,
        token: &str,
        device: &str,
        sock: &Path,
    ) -> Result<Output> {
        self.prepare_with(on, token, device, sock, &["--queues", "1"])
    }

    /// `migrate prepare` as [`Self::prepare`], with the options `extra` (`--queues N`,
    /// ...) instead of one queue.
    ///
    /// # Errors
    /// The CLI cannot run.
    pub fn prepare_with(
        &self,
        on: &ComputeHost,
        token: &str,
        device: &str,
        sock: &Path,
        extra: &[&str],
    ) -> Result<Output> {
        let s = sock.display().to_string();
        let mut args = vec![
            "migrate",
            "prepare",
            "--handover-token",
            token,
            "--lender",
            &on.lender,
            "--device",
            device,
            "--socket",
            &s,
        ];
        args.extend_from_slice(extra);
        on.try_cli(&args)
    }

    /// The logs of the lender and of A's and B's agents, for an error's context.
    pub fn logs(&self) -> String {
        format!(
            "lender log:\n{}\n--- A ---\n{}\n--- B ---\n{}",
            self.lender.log(),
            self.a.agent.proc.log(),
            self.b.agent.proc.log()
        )
    }
}
