//! README.md's "With a device pool", typed as a newcomer types it, on three hosts.
//!
//! Three network namespaces on one bridge stand for the README's three machines: the
//! pool host (`10.0.0.1`, the README's pool address), the device server `devsrv`
//! (`10.0.0.3`) and the compute host `computehost` (`10.0.0.2`). Each host is one
//! long-lived `bash` in `ip netns exec NS unshare --mount --uts`, fed commands on its
//! stdin, so that its daemons and its commands share one mount namespace (the compute
//! agent's socket and key file are used by `devlend pool join` and `devlend attach`).
//! In that mount namespace `/var/lib/devlend` and `/run/devlend` are fresh tmpfs and
//! `/etc/hosts` is a file naming the three hosts (so `devsrv:7700` resolves as on a real
//! network), and the UTS namespace has the host's name (so `hostname` on the compute
//! host is `computehost`, the name its key is enrolled under). The README's default
//! paths are therefore used unchanged, and the real machine's are never written (only
//! made, empty, as mount points when missing). All
//! traffic between hosts crosses veths (no loopback), so every secure default is in
//! play, and nothing is started with `--insecure` or `--insecure-open-api`.
//!
//! [`README_COMMANDS`] is the newcomer's list: the `sh` blocks of that README section,
//! comments and line continuations removed. The test first checks that the README says
//! exactly these commands (so the README cannot drift from what is tested), that there
//! are fewer than 10 (issue 23's "done when") and that none is `--insecure*`. It then
//! runs each as its own command line on its host, in the README's order, with only
//! these substitutions:
//! - `dlj_...`: the join token the matching `devlend pool enroll` printed (the lender's
//!   for the device agent, the compute host's for `devlend pool join`), as a newcomer
//!   pastes it;
//! - `/dev/nvme0n1`: a 256 MiB sparse file, and `--min-capacity 100G`: `100M`, to fit;
//! - the two servers the README runs in a terminal of their own (`pool serve`, the
//!   device agent) get `&` and a log file, as `devlend-compute-agent &` already has;
//!   the test waits, as a newcomer would, for the pool to serve, the lender's
//!   "registered with the device pool" and the compute agent's socket.
//!
//! Then it proves the result usable and secure:
//! 1. `devlend verify` (libblkio, 16 MiB, 2 rounds) through `/run/devlend/vm1.sock` on
//!    the compute host succeeds, and the lender's file holds what verify wrote (sha256
//!    of its first 16 MiB against verify's `--out`);
//! 2. from the compute host: `devlend pool devices` without a key gets 401; an unsigned
//!    `PUT /v1/providers/devsrv` moving `devsrv` to the compute host's address gets 401
//!    and the pool still sends borrowers to `devsrv:7700`; a key the pool never
//!    enrolled cannot lease (403); a second compute agent without a lease, attaching
//!    `devsrv:7700`'s `disk0` directly, is refused by the lender (`Denied`).
//!
//! Needs root (namespaces, mounts), iproute2 (`ip`, a bridge), util-linux (`unshare`)
//! and bash (its `/dev/tcp`); a few seconds.
//!
//! Why this file is over 600 lines: a test file with one test, so that the README's
//! commands run in order on one set of three hosts; its rig (`Lan`, `Host`, `Hosts`,
//! about 300 lines) serves only this test and could move to a module of its own.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use devlend_tests::agents::{bin, sparse_file};
use devlend_tests::sha256_hex;

/// What a newcomer types, in order: README.md's "With a device pool" `sh` blocks.
const README_COMMANDS: [&str; 7] = [
    "devlend pool serve --listen 10.0.0.1:7400",
    "devlend pool enroll --pool http://10.0.0.1:7400 --role lender --name devsrv",
    "devlend pool enroll --pool http://10.0.0.1:7400 --role compute --name computehost",
    "devlend-device-agent --listen 0.0.0.0:7700 --advertise devsrv:7700 \
     --pool http://10.0.0.1:7400 --provider devsrv --pool-join-token dlj_... \
     --device disk0=/dev/nvme0n1",
    "devlend-compute-agent &",
    "devlend pool join --pool http://10.0.0.1:7400 --token dlj_...",
    "devlend attach --pool http://10.0.0.1:7400 --class BLOCK --min-capacity 100G \
     --trait FABRIC_TCP --vm vm1 --socket /run/devlend/vm1.sock",
];

/// The pool's URL, as the README gives it.
const POOL: &str = "http://10.0.0.1:7400";
const MIB: u64 = 1 << 20;
/// Longest a newcomer's command, or a check, may take.
const STEP: Duration = Duration::from_secs(30);

/// The `sh` blocks of README.md's section `heading`: one entry per command, comments
/// dropped, continuation lines joined, whitespace collapsed.
fn readme_commands(readme: &str, heading: &str) -> Vec<String> {
    let mut in_section = false;
    let mut in_fence = false;
    let mut sh = false;
    let mut commands = Vec::new();
    let mut pending = String::new();
    for line in readme.lines() {
        if line.starts_with("```") {
            in_fence = !in_fence;
            sh = in_fence && line.trim_start_matches('`').trim() == "sh";
            continue;
        }
        if !in_fence && line.starts_with('#') {
            in_section = line.trim() == heading;
            continue;
        }
        if !(in_section && in_fence && sh) {
            continue;
        }
        let code = line.split_once(" #").map_or(line, |(c, _)| c).trim_end();
        let (code, more) = match code.strip_suffix('\\') {
            Some(c) => (c, true),
            None => (code, false),
        };
        pending.push(' ');
        pending.push_str(code);
        if !more {
            let c = pending.split_whitespace().collect::<Vec<_>>().join(" ");
            if !c.is_empty() {
                commands.push(c);
            }
            pending.clear();
        }
    }
    commands
}

/// Three namespaces on a bridge (in the pool host's namespace): the README's hosts.
struct Lan {
    names: Vec<String>,
}

use devlend_tests::netns::ip;

impl Lan {
    /// Namespaces `<tag>p` (10.0.0.1, on the bridge itself), `<tag>d` (10.0.0.3) and
    /// `<tag>c` (10.0.0.2).
    fn new() -> Result<Self> {
        let tag = format!("dlr{}", std::process::id() % 100_000);
        let [p, d, c] = ["p", "d", "c"].map(|s| format!("{tag}{s}"));
        for n in [&p, &d, &c] {
            let _ = ip(&["netns", "del", n]);
        }
        let mut lan = Lan { names: Vec::new() };
        for n in [&p, &d, &c] {
            ip(&["netns", "add", n])?;
            lan.names.push(n.clone());
            ip(&["-n", n, "link", "set", "lo", "up"])?;
        }
        ip(&["-n", &p, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &p, "addr", "add", "10.0.0.1/24", "dev", "br0"])?;
        ip(&["-n", &p, "link", "set", "br0", "up"])?;
        for (ns, addr) in [(&d, "10.0.0.3/24"), (&c, "10.0.0.2/24")] {
            // The port's name lives in the pool host's namespace, eth0 in the host's.
            let port = format!("{ns}x");
            ip(&[
                "link", "add", &port, "netns", &p, "type", "veth", "peer", "name", "eth0", "netns",
                ns,
            ])?;
            ip(&["-n", &p, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &p, "link", "set", &port, "up"])?;
            ip(&["-n", ns, "addr", "add", addr, "dev", "eth0"])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
        }
        Ok(lan)
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// A background process a host started (`CMD > LOG 2>&1 &`).
struct Daemon {
    name: String,
    pid: i32,
    log: PathBuf,
}

impl Daemon {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether `path` exists in the daemon's mount namespace (`/proc/PID/root`).
    fn sees(&self, path: &str) -> bool {
        Path::new(&format!("/proc/{}/root{path}", self.pid)).exists()
    }

    fn alive(&self) -> bool {
        // A zombie still exists; its state in /proc/PID/stat is Z.
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .map(|s| {
                !s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(false)
    }
}

/// One host: a `bash` reading commands on its stdin, in its network, mount and UTS
/// namespaces; killed with its whole process group (its daemons too) on drop.
struct Host {
    name: &'static str,
    child: Child,
    stdin: ChildStdin,
    dir: PathBuf,
    n: usize,
    daemons: Vec<Daemon>,
}

/// A finished command: its exit status and what it printed (stdout and stderr).
struct Ran {
    rc: i32,
    out: String,
}

impl Host {
    /// Starts host `name` in namespace `ns`, its files in `dir/name`, and sets up its
    /// private `/var/lib/devlend`, `/run/devlend`, `/etc/hosts` and host name.
    fn start(name: &'static str, ns: &str, dir: &Path, hosts: &Path) -> Result<Self> {
        let dir = dir.join(name);
        std::fs::create_dir_all(&dir)?;
        let log = File::create(dir.join("shell.log"))?;
        let bin_dir = bin("devlend")?
            .parent()
            .ok_or_else(|| anyhow!("no target directory"))?
            .to_path_buf();
        let path = format!(
            "{}:{}",
            bin_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, "unshare", "--mount", "--uts"])
            .args([
                "--propagation",
                "private",
                "bash",
                "--noprofile",
                "--norc",
                "-s",
            ])
            .env("PATH", path)
            .env_remove("DEVLEND_POOL")
            .env_remove("DEVLEND_POOL_KEY")
            .env_remove("DEVLEND_POOL_CA")
            .current_dir(&dir)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("cannot start ip netns exec ... unshare ... bash")?;
        let stdin = child.stdin.take().ok_or_else(|| anyhow!("no stdin"))?;
        let mut host = Host {
            name,
            child,
            stdin,
            dir,
            n: 0,
            daemons: Vec::new(),
        };
        // Only once these mounts are in place does anything write below the README's
        // paths: a failure here stops the test before any other command.
        let setup = format!(
            "set -o pipefail; mount -t tmpfs -o mode=0755 tmpfs /var/lib/devlend && \
             mount -t tmpfs -o mode=0755 tmpfs /run/devlend && \
             mount --bind {} /etc/hosts && hostname {name} && \
             test \"$(hostname)\" = {name} && test -z \"$(ls -A /var/lib/devlend)\"",
            hosts.display()
        );
        let r = host.run(&setup, STEP)?;
        if r.rc != 0 {
            bail!("{name}: setting up its namespaces failed:\n{}", r.out);
        }
        Ok(host)
    }

    fn send(&mut self, line: &str) -> Result<()> {
        writeln!(self.stdin, "{line}").with_context(|| format!("{}: shell gone", self.name))?;
        self.stdin.flush()?;
        Ok(())
    }

    /// Runs `cmd` (stdin from /dev/null) and waits up to `timeout` for it to finish.
    fn run(&mut self, cmd: &str, timeout: Duration) -> Result<Ran> {
        self.n += 1;
        let out = self.dir.join(format!("{}.out", self.n));
        let rc = self.dir.join(format!("{}.rc", self.n));
        std::fs::write(self.dir.join(format!("{}.cmd", self.n)), cmd)?;
        self.send(&format!(
            "{{ {cmd}\n}} > {o} 2>&1 < /dev/null; echo $? > {r}.tmp; mv {r}.tmp {r}",
            o = out.display(),
            r = rc.display()
        ))?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(s) = std::fs::read_to_string(&rc) {
                return Ok(Ran {
                    rc: s.trim().parse().unwrap_or(-1),
                    out: std::fs::read_to_string(&out).unwrap_or_default(),
                });
            }
            if let Ok(Some(s)) = self.child.try_wait() {
                bail!("{}: its shell exited ({s}) during `{cmd}`", self.name);
            }
            if Instant::now() > deadline {
                bail!(
                    "{}: `{cmd}` did not finish within {timeout:?}; it printed:\n{}",
                    self.name,
                    std::fs::read_to_string(&out).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `cmd`, which must succeed; what it printed.
    fn ok(&mut self, cmd: &str) -> Result<String> {
        let r = self.run(cmd, STEP)?;
        if r.rc != 0 {
            bail!("{}: `{cmd}` failed ({}):\n{}", self.name, r.rc, r.out);
        }
        Ok(r.out)
    }

    /// Starts `cmd` in the background (`CMD > NAME.log 2>&1 &`); the daemon's index.
    fn spawn(&mut self, name: &str, cmd: &str) -> Result<usize> {
        let log = self.dir.join(format!("{name}.log"));
        let pid_file = self.dir.join(format!("{name}.pid"));
        self.ok(&format!(
            "{cmd} > {} 2>&1 < /dev/null & echo $! > {}",
            log.display(),
            pid_file.display()
        ))?;
        let pid = std::fs::read_to_string(&pid_file)?.trim().parse()?;
        self.daemons.push(Daemon {
            name: name.to_owned(),
            pid,
            log,
        });
        Ok(self.daemons.len() - 1)
    }

    /// Waits up to 20 s for `ready` (given the daemon and its log), failing early if
    /// the daemon exits.
    fn wait_daemon(
        &self,
        d: usize,
        what: &str,
        ready: impl Fn(&Daemon, &str) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let dm = &self.daemons[d];
            let log = dm.log();
            if ready(dm, &log) {
                return Ok(());
            }
            if !dm.alive() {
                bail!("{}: {} exited before {what}:\n{log}", self.name, dm.name);
            }
            if Instant::now() > deadline {
                bail!("{}: {} not {what} after 20 s:\n{log}", self.name, dm.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Everything this host ran and printed, for a failure's report.
    fn report(&self) -> String {
        let mut s = format!("===== host {} =====\n", self.name);
        for i in 1..=self.n {
            let cmd = std::fs::read_to_string(self.dir.join(format!("{i}.cmd")));
            let out = std::fs::read_to_string(self.dir.join(format!("{i}.out")));
            let rc = std::fs::read_to_string(self.dir.join(format!("{i}.rc")));
            s += &format!(
                "$ {}\n{}[rc {}]\n",
                cmd.unwrap_or_default(),
                out.unwrap_or_default(),
                rc.unwrap_or_else(|_| "-".into()).trim()
            );
        }
        for d in &self.daemons {
            s += &format!("----- {} log -----\n{}", d.name, d.log());
        }
        s += &std::fs::read_to_string(self.dir.join("shell.log")).unwrap_or_default();
        s
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let pgid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) on the process group of our own child (made its leader).
        unsafe { libc::kill(-pgid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && self.daemons.iter().any(Daemon::alive) {
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// The three hosts, reported in full when the test fails.
struct Hosts {
    pool: Host,
    devsrv: Host,
    compute: Host,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("DEVLEND_TEST_VERBOSE").is_some() {
            for h in [&self.pool, &self.devsrv, &self.compute] {
                eprintln!("{}", h.report());
            }
        }
    }
}

/// `cmd` with `from` replaced by `to`; `from` must be there.
fn subst(cmd: &str, from: &str, to: &str) -> Result<String> {
    if !cmd.contains(from) {
        bail!("the README's `{cmd}` has no `{from}` any more: update this test");
    }
    Ok(cmd.replace(from, to))
}

/// The one token line `devlend pool enroll` printed.
fn token(out: &str) -> Result<String> {
    let t = out.trim();
    if !t.starts_with("dlj_") || t.contains(char::is_whitespace) {
        bail!("`devlend pool enroll` did not print one join token:\n{out}");
    }
    Ok(t.to_owned())
}

/// Runs [`README_COMMANDS`] on their hosts, in order; `image` stands for
/// `/dev/nvme0n1`.
fn run_readme(h: &mut Hosts, image: &Path) -> Result<()> {
    let [serve, enroll_lender, enroll_compute, lender, compute_agent, join, attach] =
        README_COMMANDS;
    let image = image.display().to_string();

    // On the pool host.
    let pool = h.pool.spawn("pool", serve)?;
    h.pool
        .wait_daemon(pool, "serving", |_, log| log.contains("pool serving"))?;
    let lender_token = token(&h.pool.ok(enroll_lender)?)?;
    let compute_token = token(&h.pool.ok(enroll_compute)?)?;

    // On the device server.
    let cmd = subst(lender, "dlj_...", &lender_token)?;
    let cmd = subst(&cmd, "/dev/nvme0n1", &image)?;
    let d = h.devsrv.spawn("device-agent", &cmd)?;
    h.devsrv
        .wait_daemon(d, "registered with the pool", |_, log| {
            log.contains("registered with the device pool")
        })?;

    // On the compute host.
    let cmd = compute_agent
        .strip_suffix('&')
        .ok_or_else(|| anyhow!("the README runs the compute agent in the background"))?
        .trim();
    let c = h.compute.spawn("compute-agent", cmd)?;
    h.compute
        .wait_daemon(c, "ready", |d, _| d.sees("/run/devlend/compute-agent.sock"))?;
    let joined = h.compute.ok(&subst(join, "dlj_...", &compute_token)?)?;
    if !joined.contains("computehost") {
        bail!("`devlend pool join` did not enroll computehost:\n{joined}");
    }
    let attached = h.compute.ok(&subst(
        attach,
        "--min-capacity 100G",
        "--min-capacity 100M",
    )?)?;
    if !attached.contains("leased disk0 on devsrv (devsrv:7700)") {
        bail!("`devlend attach --class` did not lease devsrv's disk0:\n{attached}");
    }
    Ok(())
}

/// The README's result works, and is closed to everyone the README did not enroll.
fn check_usable_and_secure(h: &mut Hosts, image: &Path, dir: &Path) -> Result<()> {
    // 1. I/O through the attachment, landing in the lender's file.
    let expected = dir.join("expected.bin");
    let out = h.compute.ok(&format!(
        "devlend verify --socket /run/devlend/vm1.sock --queues 1 --span 16M --rounds 2 \
         --out {}",
        expected.display()
    ))?;
    if !out.contains("verified") {
        bail!("devlend verify: {out}");
    }
    let want = std::fs::read(&expected)?;
    assert_eq!(want.len() as u64, 16 * MIB);
    let mut got = Vec::new();
    File::open(image)?.take(16 * MIB).read_to_end(&mut got)?;
    assert_eq!(
        sha256_hex(&got),
        sha256_hex(&want),
        "the lender's file does not hold what verify wrote"
    );

    // 2a. The pool answers no one without an enrolled key.
    let r = h
        .compute
        .run(&format!("devlend pool devices --pool {POOL}"), STEP)?;
    assert!(
        r.rc != 0 && r.out.contains("401"),
        "an unsigned listing was not refused with 401:\n{}",
        r.out
    );

    // 2b. Nobody can move devsrv to an address of their own with an unsigned request.
    let body = r#"{"fabric_address":"10.0.0.2:7700","devices":[{"name":"disk0","resource_class":"BLOCK","capacity_bytes":1099511627776,"traits":["FABRIC_TCP"]}]}"#;
    let put = h.compute.dir.join("put.sh");
    std::fs::write(
        &put,
        format!(
            "body='{body}'\nexec 3<>/dev/tcp/10.0.0.1/7400\n\
             printf 'PUT /v1/providers/devsrv HTTP/1.1\\r\\nHost: 10.0.0.1:7400\\r\\n\
             Content-Type: application/json\\r\\nContent-Length: %d\\r\\n\
             Connection: close\\r\\n\\r\\n%s' \"${{#body}}\" \"$body\" >&3\n\
             timeout 10 cat <&3\n"
        ),
    )?;
    let out = h.compute.ok(&format!("bash {}", put.display()))?;
    assert!(
        out.starts_with("HTTP/1.1 401"),
        "an unsigned registration of devsrv was not refused with 401:\n{out}"
    );
    let providers: serde_json::Value = serde_json::from_str(
        &h.pool
            .ok(&format!("devlend pool providers --pool {POOL} --json"))?,
    )?;
    let devsrv = providers
        .as_array()
        .and_then(|a| a.iter().find(|p| p["name"] == "devsrv"))
        .ok_or_else(|| anyhow!("devsrv is not a provider: {providers}"))?;
    assert_eq!(devsrv["fabric_address"], "devsrv:7700", "{providers}");

    // 2c. A compute agent whose key the pool never enrolled can neither lease nor
    // open the lender's device directly.
    h.compute.spawn(
        "intruder-agent",
        "devlend-compute-agent --api /run/devlend/intruder.sock \
         --pool-key-file /run/devlend/intruder.key --state-file none",
    )?;
    let i = h.compute.daemons.len() - 1;
    h.compute
        .wait_daemon(i, "ready", |d, _| d.sees("/run/devlend/intruder.sock"))?;
    let r = h.compute.run(
        &format!(
            "devlend attach --api /run/devlend/intruder.sock --pool {POOL} --class BLOCK \
             --pool-key /run/devlend/intruder.key --vm vm2 --socket /run/devlend/vm2.sock"
        ),
        STEP,
    )?;
    assert!(
        r.rc != 0 && r.out.contains("403"),
        "an unenrolled key was not refused a lease with 403:\n{}",
        r.out
    );
    let r = h.compute.run(
        "devlend attach --api /run/devlend/intruder.sock --lender devsrv:7700 \
         --device disk0 --socket /run/devlend/vm2.sock",
        STEP,
    )?;
    assert!(
        r.rc != 0 && r.out.contains("Denied"),
        "the lender did not deny a session without a lease:\n{}",
        r.out
    );
    Ok(())
}

#[test]
fn a_newcomer_sets_up_a_secure_pool_from_the_readme_in_fewer_than_10_commands() {
    let started = Instant::now();
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    assert_eq!(
        readme_commands(&readme, "### With a device pool"),
        README_COMMANDS
            .iter()
            .map(|c| c.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>(),
        "README.md's pool commands are not the ones this test runs: update one or the other"
    );
    assert!(README_COMMANDS.len() < 10, "issue 23: under 10 commands");
    for c in README_COMMANDS {
        assert!(!c.contains("--insecure"), "the README's flow needs {c}");
    }

    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("nvme0n1.img");
    sparse_file(&image, 256 * MIB).unwrap();
    let hosts_file = dir.path().join("hosts");
    std::fs::write(
        &hosts_file,
        "127.0.0.1 localhost\n10.0.0.1 poolhost\n10.0.0.2 computehost\n10.0.0.3 devsrv\n",
    )
    .unwrap();
    // Mount points only: each host mounts a tmpfs on them in its own mount namespace.
    std::fs::create_dir_all("/var/lib/devlend").unwrap();
    std::fs::create_dir_all("/run/devlend").unwrap();

    let lan = Lan::new().expect("network namespaces (run as root)");
    let [p, d, c] = [0, 1, 2].map(|i| lan.names[i].clone());
    let mut hosts = Hosts {
        pool: Host::start("poolhost", &p, dir.path(), &hosts_file).unwrap(),
        devsrv: Host::start("devsrv", &d, dir.path(), &hosts_file).unwrap(),
        compute: Host::start("computehost", &c, dir.path(), &hosts_file).unwrap(),
    };
    if let Err(e) = run_readme(&mut hosts, &image) {
        panic!("the README's flow failed: {e:#}");
    }
    eprintln!(
        "README flow ({} commands) done in {:?}",
        README_COMMANDS.len(),
        started.elapsed()
    );
    if let Err(e) = check_usable_and_secure(&mut hosts, &image, dir.path()) {
        panic!("{e:#}");
    }
    drop(hosts);
    drop(lan);
    eprintln!("done in {:?}", started.elapsed());
}
