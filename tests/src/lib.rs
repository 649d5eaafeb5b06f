//! devlend end-to-end test support: real agents, real vhost-user frontends
//! and real QEMU guests.
//!
//! The integration tests live in `tests/tests/*.rs`; this library holds what
//! they share.

pub mod agents;
pub mod certs;
pub mod delay;
pub mod edu;
pub mod gateways;
pub mod lan;
pub mod libvirt;
pub mod migration;
pub mod migration_lab;
pub mod netns;
pub mod nvme;
pub mod postgres;
pub mod qemu11;
pub mod sriov;
pub use devlend_qemu::guest;
pub mod storage_daemon;
pub mod two_paths;
pub mod vhost_raw;

/// SHA-256 of `data`, lower-case hex.
pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The last value a guest script printed for `key` (`DEVLEND-RESULT key=value` lines)
/// in console text read while the guest still runs; [`guest::GuestOutcome::result`]
/// gives the same once the script has ended.
pub fn console_result(console: &str, key: &str) -> Option<String> {
    let prefix = format!("DEVLEND-RESULT {key}=");
    console
        .lines()
        .filter_map(|l| l.split_once(&prefix))
        .map(|(_, v)| v.trim().to_owned())
        .next_back()
}

/// The seed of a randomized test: `DEVLEND_TEST_SEED` if set, else the clock; printed,
/// so that a failing run can be repeated.
pub fn test_seed() -> u64 {
    let s = std::env::var("DEVLEND_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("seed {s} (DEVLEND_TEST_SEED={s} repeats this run)");
    s
}

/// `GET /metrics` from the Prometheus endpoint at `addr` (`HOST:PORT`): the body and
/// headers of a 200 answer.
///
/// # Errors
/// The endpoint cannot be reached or does not answer 200.
pub fn scrape_metrics(addr: &str) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    if !(out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200")) {
        anyhow::bail!("metrics at {addr}: {out}");
    }
    Ok(out)
}

/// The value of the series whose line starts with `series` (name and labels in
/// order) in a Prometheus text exposition.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The shared libraries `ldd` lists for `path` (absolute paths).
pub fn shared_libraries(path: &std::path::Path) -> Vec<String> {
    let out = match std::process::Command::new("ldd").arg(path).output() {
        Ok(o) => o,
        Err(_) => return Vec::new(),
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split("=>").nth(1))
        .filter_map(|r| r.split_whitespace().next())
        .filter(|p| p.starts_with('/'))
        .map(str::to_string)
        .collect()
}

/// Copies host binaries into a guest's initramfs: each `(name, host path)` at
/// `/bin/NAME`, with every library it links and the dynamic loader, plus `extra` host
/// files at their own paths (e.g. a verbs provider and its driver file).
pub fn with_host_binaries(
    mut b: guest::GuestBuilder,
    bins: &[(&str, std::path::PathBuf)],
    extra: &[&str],
) -> guest::GuestBuilder {
    let mut files: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    files.push("/lib64/ld-linux-x86-64.so.2".into());
    for (name, path) in bins {
        files.extend(shared_libraries(path));
        b = b.host_file(format!("/bin/{name}"), path.clone());
    }
    files.sort();
    files.dedup();
    for f in files {
        b = b.host_file(f.clone(), f);
    }
    b
}

/// A guest shell function, `now_ms`, that sets `ms` to the kernel's monotonic clock in
/// milliseconds: `now at` in /proc/timer_list (in ns, read by the shell's own `read`,
/// no process started for it), or /proc/uptime (10 ms) where that is missing. Sets
/// `clock` to which one it uses. Put it in a guest script before its first `now_ms`.
pub const GUEST_NOW_MS: &str = r#"
clock=uptime
if { read -r _; read -r _; read -r a b _; } < /proc/timer_list 2>/dev/null && [ "$a $b" = "now at" ]; then
  clock=timer_list
fi
now_ms() {
  if [ $clock = timer_list ]; then
    { read -r _; read -r _; read -r _ _ ns _; } < /proc/timer_list
    ms=$((ns / 1000000))
  else
    read -r up _ < /proc/uptime
    ms=$(( ${up%.*} * 1000 + 1${up#*.} * 10 - 1000 ))
  fi
}
"#;
