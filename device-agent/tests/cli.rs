//! The `devlend-device-agent` binary: start-up errors and a real session.

mod common;

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use devlend_fabric::{tcp, Status};

const BIN: &str = env!("CARGO_BIN_EXE_devlend-device-agent");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run the binary")
}

fn image(dir: &tempfile::TempDir, name: &str, size: u64) -> String {
    let p = dir.path().join(name);
    std::fs::File::create(&p)
        .and_then(|f| f.set_len(size))
        .expect("image");
    p.to_str().expect("utf-8 path").to_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn refuses_a_21_byte_serial_naming_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(&dir, "a.img", 1 << 20);
    let out = run(&[
        "--listen",
        "127.0.0.1:0",
        "--device",
        &format!("disk0={img},serial=ABCDEFGHIJKLMNOPQRSTU"),
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("disk0") && err.contains("21 bytes") && err.contains("at most 20"),
        "{err}"
    );

    // The same in a config file.
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!("listen = \"127.0.0.1:0\"\n[[device]]\nname = \"disk9\"\npath = \"{img}\"\nserial = \"ABCDEFGHIJKLMNOPQRSTU\"\n"),
    )
    .unwrap();
    let out = run(&["--config", cfg.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("disk9") && err.contains("21 bytes") && err.contains("agent.toml"),
        "{err}"
    );
}

#[test]
fn refuses_unknown_config_keys_naming_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(&dir, "a.img", 1 << 20);
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!("listen = \"127.0.0.1:0\"\n[[device]]\nname = \"d\"\npath = \"{img}\"\nreadonly = true\n"),
    )
    .unwrap();
    let out = run(&["--config", cfg.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("agent.toml") && err.contains("readonly"),
        "{err}"
    );
}

#[test]
fn refuses_missing_files_and_duplicate_names() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.img");
    let out = run(&[
        "--listen",
        "127.0.0.1:0",
        "--device",
        &format!("d={}", missing.display()),
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("missing.img") && err.contains("No such file"),
        "{err}"
    );

    let img = image(&dir, "a.img", 1 << 20);
    let out = run(&[
        "--listen",
        "127.0.0.1:0",
        "--device",
        &format!("d={img}"),
        "--device",
        &format!("d={img},ro"),
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("\"d\" is given more than once"),
        "{}",
        stderr(&out)
    );
}

/// Kills the child when the test ends, however it ends.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn serves_a_device_from_flags_and_config() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(&dir, "a.img", 1 << 20);
    let ro = image(&dir, "b.img", 4096);
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!("listen = \"127.0.0.1:1\"\n[[device]]\nname = \"ro\"\npath = \"{ro}\"\nread_only = true\nserial = \"SN-RO\"\n"),
    )
    .unwrap();
    // A free port (released just before the agent binds it).
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let child = Command::new(BIN)
        .args(["--config", cfg.to_str().unwrap(), "--listen", &addr])
        .args([
            "--device",
            &format!("disk0={img},serial=SN0"),
            "--log-level",
            "warn",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the agent");
    let _kill = Kill(child);

    let deadline = Instant::now() + Duration::from_secs(20);
    let (sock, reply) = loop {
        match tcp::connect(&addr, "disk0", 0, Duration::from_secs(5)) {
            Ok(x) => break x,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("agent not reachable: {e}"),
        }
    };
    let geometry = reply.block().cloned().expect("a block device");
    assert_eq!(&geometry.serial[..4], b"SN0\0");
    sock.set_read_timeout(Some(common::IO_TIMEOUT)).unwrap();
    let mut c = common::Client::from_stream(sock, geometry);
    assert_eq!(c.write(1, &[0x11u8; 512]), Status::Ok);
    assert_eq!(c.read(1, 512), (Status::Ok, vec![0x11u8; 512]));

    let (_, reply) = tcp::connect(&addr, "ro", 0, Duration::from_secs(5)).unwrap();
    let ro = reply.block().expect("a block device");
    assert!(ro.read_only());
    assert_eq!(ro.capacity_sectors, 8);
    assert_eq!(&ro.serial[..6], b"SN-RO\0");
}
