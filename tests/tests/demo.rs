//! The README's main job, `devlend demo`, run as a user would (the binary, with --json):
//! once with a QEMU guest attached and detached live, once with the libblkio frontend.

use std::process::Command;

use devlend_tests::agents::bin;
use serde_json::Value;

fn demo(args: &[&str]) -> Value {
    let out = Command::new(bin("devlend").unwrap())
        .arg("demo")
        .args(args)
        .arg("--json")
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "demo failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn check(s: &Value, size: u64) {
    assert_eq!(s["size"], size);
    let sum = s["checksum_frontend"].as_str().unwrap();
    assert_eq!(sum.len(), 64, "{s}");
    assert_eq!(s["checksum_lender"], sum, "{s}");
    let c = &s["attachment"]["counters"];
    assert_eq!(c["errors"], 0, "{s}");
    assert!(c["bytes_written"].as_u64().unwrap() >= size, "{s}");
    assert!(c["bytes_read"].as_u64().unwrap() >= size, "{s}");
    assert!(c["flushes"].as_u64().unwrap() >= 1, "{s}");
}

#[test]
fn the_demo_lends_a_disk_to_a_vm_live_and_to_libblkio() {
    let vm = demo(&["--size", "16M"]);
    check(&vm, 16 << 20);
    assert_eq!(vm["frontend"], "vm");
    let phases: Vec<&str> = vm["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_str().unwrap())
        .collect();
    assert_eq!(phases, ["boot", "attach", "write+verify", "detach"]);
    assert_eq!(vm["attachment"]["vmm"]["target"]["type"], "qemu", "{vm}");

    let blk = demo(&["--frontend", "blkio", "--size", "64M"]);
    check(&blk, 64 << 20);
    assert_eq!(blk["frontend"], "blkio");
}

#[test]
fn the_demo_says_what_to_install_without_qemu() {
    let out = Command::new(bin("devlend").unwrap())
        .args(["demo", "--size", "16M"])
        .env("DEVLEND_QEMU", "/nonexistent/qemu-system-x86_64")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("apt-get install -t bookworm-backports qemu-system-x86"),
        "{err}"
    );
    assert!(err.contains("qemu/install-deps.sh"), "{err}");
}
