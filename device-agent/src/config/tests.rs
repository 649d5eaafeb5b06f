//! Tests of the configuration: flags over the file, checks and their messages.
use super::*;
use clap::Parser;

fn write_config(text: &str) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), text).unwrap();
    f
}

#[test]
fn file_and_flags_merge() {
    let f = write_config(
        r#"
        listen = "0.0.0.0:7700"
        [[device]]
        name = "disk0"
        path = "/dev/nvme0n1"
        read_only = false
        serial = "SN0"
        [[device]]
        name = "disk1"
        path = "/srv/disk1.img"
        "#,
    );
    let cli = Cli::parse_from([
        "x",
        "--config",
        f.path().to_str().unwrap(),
        "--listen",
        "127.0.0.1:9",
        "--device",
        "disk1=/other.img,ro",
        "--device",
        "disk2=/two.img",
    ]);
    let c = Config::from_cli(&cli).unwrap();
    assert_eq!(c.listen, "127.0.0.1:9");
    let names: Vec<_> = c.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["disk0", "disk1", "disk2"]);
    let block = |i: usize| match &c.devices[i].kind {
        KindSpec::Block(b) => b.clone(),
        other => panic!("{other:?} is not a block device"),
    };
    assert_eq!(block(0).serial.as_deref(), Some("SN0"));
    assert_eq!(block(1).path, PathBuf::from("/other.img"));
    assert!(block(1).read_only);
}

#[test]
fn io_mode_comes_from_file_or_flag_and_prints_back() {
    let f = write_config(
        r#"
        listen = "0.0.0.0:7700"
        io_mode = "sync"
        [[device]]
        name = "disk0"
        path = "/srv/disk0.img"
        "#,
    );
    let path = f.path().to_str().unwrap();
    let c = Config::from_cli(&Cli::parse_from(["x", "--config", path])).unwrap();
    assert_eq!(c.io_mode, IoMode::Sync);
    assert!(c.to_toml().contains("io_mode = \"sync\""));
    let cli = Cli::parse_from(["x", "--config", path, "--io-mode", "uring"]);
    assert_eq!(Config::from_cli(&cli).unwrap().io_mode, IoMode::Uring);
    let cli = Cli::parse_from(["x", "--listen", "127.0.0.1:9", "--device", "d=/x"]);
    let c = Config::from_cli(&cli).unwrap();
    assert_eq!(c.io_mode, IoMode::Auto);
    assert!(!c.to_toml().contains("io_mode"));
}

#[test]
fn insecure_comes_from_file_or_flag_and_prints_back() {
    let f = write_config(
        "listen = \"0.0.0.0:7700\"\ninsecure = true\n[[device]]\nname = \"d\"\npath = \"/x\"\n",
    );
    let path = f.path().to_str().unwrap();
    let c = Config::from_cli(&Cli::parse_from(["x", "--config", path])).unwrap();
    assert!(c.insecure);
    assert!(c.to_toml().contains("insecure = true"), "{}", c.to_toml());
    let cli = Cli::parse_from(["x", "--listen", "0.0.0.0:1", "--device", "d=/x"]);
    let c = Config::from_cli(&cli).unwrap();
    assert!(!c.insecure);
    assert!(!c.to_toml().contains("insecure"), "{}", c.to_toml());
    let cli = Cli::parse_from([
        "x",
        "--listen",
        "0.0.0.0:1",
        "--device",
        "d=/x",
        "--insecure",
    ]);
    assert!(Config::from_cli(&cli).unwrap().insecure);
}

#[test]
fn the_shipped_example_config_parses_with_and_without_its_commented_pool() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../contrib/systemd/device-agent.toml.example");
    let text = std::fs::read_to_string(&path).unwrap();
    let f = Config::parse_file(&path, &text).unwrap();
    assert!(f.pool.is_none() && f.devices.len() == 2);
    // Uncomment the [pool] table (not auth_keys: the two modes exclude each other).
    let pool: String = text
        .lines()
        .map(|l| match l.strip_prefix("# ") {
            Some(rest)
                if rest.starts_with("[pool]")
                    || ["url", "provider", "advertise", "heartbeat"]
                        .iter()
                        .any(|k| rest.starts_with(k)) =>
            {
                rest.to_owned()
            }
            _ => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let f = Config::parse_file(&path, &pool).unwrap();
    let p = f.pool.expect("the [pool] table");
    assert_eq!(p.url, "http://pool.example:7400");
    assert_eq!(p.advertise.as_deref(), Some("devsrv-01:7700"));
    assert_eq!(p.advertise_paths, ["devsrv-01-b:7700"]);
}

#[test]
fn advertise_paths_come_from_file_or_flags_checked_as_advertise() {
    let f = write_config(
        "listen = \"0.0.0.0:7700\"\n[pool]\nurl = \"http://p:1\"\nadvertise = \"a:7700\"\n\
         advertise_paths = [\"b:7700\"]\n[[device]]\nname = \"d\"\npath = \"/x\"\n",
    );
    let path = f.path().to_str().unwrap();
    let config = |extra: &[&str]| {
        let mut args = vec!["x", "--config", path];
        args.extend_from_slice(extra);
        Config::from_cli(&Cli::parse_from(args))
    };
    let p = config(&[]).unwrap().pool.unwrap();
    assert_eq!(p.advertise_paths, ["b:7700"]);
    // The flags replace the file's list.
    let p = config(&[
        "--advertise-path",
        "c:7700",
        "--advertise-path",
        "10.0.0.4:7700",
    ])
    .unwrap()
    .pool
    .unwrap();
    assert_eq!(p.advertise_paths, ["c:7700", "10.0.0.4:7700"]);
    let eight: Vec<String> = (1..=8).map(|i| format!("h{i}:7700")).collect();
    let mut too_many = Vec::new();
    for a in &eight {
        too_many.extend(["--advertise-path", a.as_str()]);
    }
    assert!(config(&too_many[..14]).is_ok(), "seven are taken");
    let long = format!("{}:1", "h".repeat(300));
    let long_name = "n".repeat(300);
    assert!(config(&["--provider", "devsrv-01.example"]).is_ok());
    for bad in [
        &["--advertise-path", "0.0.0.0:7700"][..],
        &["--advertise-path", "[::]:7700"],
        &["--advertise-path", "c"],
        &["--advertise-path", "c:0"],
        &["--advertise-path", "a:7700"],
        &["--advertise-path", "c:1", "--advertise-path", "c:1"],
        &too_many,
        // What the pool refuses, the agent refuses before it starts: a control
        // character, an over-long host, a `*` or `::` wildcard, a path.
        &["--advertise-path", "c\u{1}:1"],
        &["--advertise-path", &long],
        &["--advertise-path", "*:7700"],
        &["--advertise", "*:7700"],
        &["--advertise", "0.0.0.0:7700"],
        &["--advertise-path", "c/x:1"],
        &["--provider", "dev srv"],
        &["--provider", &long_name],
    ] {
        let e = config(bad).unwrap_err();
        assert!(matches!(e, Error::BadPool(_)), "{bad:?}: {e}");
    }
    // Without a pool they mean nothing: refused.
    let cli = Cli::parse_from([
        "x",
        "--listen",
        "127.0.0.1:1",
        "--device",
        "d=/x",
        "--advertise-path",
        "c:1",
    ]);
    assert!(matches!(Config::from_cli(&cli), Err(Error::BadPool(_))));
}

#[test]
fn file_refuses_unknown_keys_naming_file_and_key() {
    let f = write_config(
        "listen = \"[::]:1\"\n[[device]]\nname = \"d\"\npath = \"/x\"\nreadonly = true\n",
    );
    let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
    let err = Config::from_cli(&cli).unwrap_err();
    let chain = format!("{:#}", anyhow::Error::from(err));
    assert!(chain.contains(&f.path().display().to_string()), "{chain}");
    assert!(chain.contains("readonly"), "{chain}");

    let f = write_config("listen = \"[::]:1\"\nport = 3\n");
    let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
    let chain = format!(
        "{:#}",
        anyhow::Error::from(Config::from_cli(&cli).unwrap_err())
    );
    assert!(chain.contains("port"), "{chain}");
}

/// A device table of one kind with a key of another: the message names the file, the
/// line, the device, the key and the kind; the flags refuse the same way.
#[test]
fn keys_of_another_kind_are_refused_naming_file_device_key_and_kind() {
    let f = write_config(
        "listen = \"[::]:1\"\n[[device]]\nname = \"d\"\npath = \"/x\"\n[[device]]\nname = \"eth\"\nkind = \"net\"\nnet = \"eth0\"\nread_only = true\n",
    );
    let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
    let chain = format!(
        "{:#}",
        anyhow::Error::from(Config::from_cli(&cli).unwrap_err())
    );
    assert!(chain.contains(&f.path().display().to_string()), "{chain}");
    assert!(
        chain.contains("device `eth`: `read_only` does not apply to kind `net`"),
        "{chain}"
    );
    assert!(chain.contains("line "), "{chain}");

    let err = Cli::try_parse_from(["x", "--device", "eth=net:eth0,serial=S"]).unwrap_err();
    assert!(
        err.to_string()
            .contains("device `eth`: `serial` does not apply to kind `net`"),
        "{err}"
    );
}

/// A config file's devices of each kind print back with their kind, and that prints
/// loads as the same configuration.
#[test]
fn devices_of_each_kind_print_back_with_their_kind() {
    let f = write_config(
        "listen = \"[::]:1\"\n[[device]]\nname = \"d\"\npath = \"/x\"\nread_only = true\n[[device]]\nname = \"eth\"\nnet = \"eth0\"\n[[device]]\nname = \"f\"\npci = \"0000:00:03.0\"\n",
    );
    let c = Config::from_cli(&Cli::parse_from([
        "x",
        "--config",
        f.path().to_str().unwrap(),
    ]))
    .unwrap();
    let kinds: Vec<_> = c.devices.iter().map(|d| d.kind.name()).collect();
    assert_eq!(kinds, ["block", "net", "pci"]);
    let text = c.to_toml();
    for k in ["block", "net", "pci"] {
        assert!(text.contains(&format!("kind = \"{k}\"")), "{text}");
    }
    let again = write_config(&text);
    let c2 = Config::from_cli(&Cli::parse_from([
        "x",
        "--config",
        again.path().to_str().unwrap(),
    ]))
    .unwrap();
    assert_eq!(c2.devices, c.devices);
}

#[test]
fn tls_keys_come_from_file_or_flags_and_go_together() {
    let f = write_config(
        "listen = \"[::]:1\"\ntls_cert = \"/etc/l.crt\"\ntls_key = \"/etc/l.key\"\n[[device]]\nname = \"d\"\npath = \"/x\"\n",
    );
    let path = f.path().to_str().unwrap();
    let c = Config::from_cli(&Cli::parse_from(["x", "--config", path])).unwrap();
    assert_eq!(c.tls_cert, Some(PathBuf::from("/etc/l.crt")));
    assert_eq!(c.tls_key, Some(PathBuf::from("/etc/l.key")));
    assert!(
        c.to_toml().contains("tls_cert = \"/etc/l.crt\""),
        "{}",
        c.to_toml()
    );
    let c = Config::from_cli(&Cli::parse_from([
        "x",
        "--config",
        path,
        "--tls-client-ca",
        "/etc/ca.crt",
    ]))
    .unwrap();
    assert_eq!(c.tls_client_ca, Some(PathBuf::from("/etc/ca.crt")));
    // A key without its certificate, a client CA without a certificate: refused.
    let f = write_config(
        "listen = \"[::]:1\"\ntls_key = \"/etc/l.key\"\n[[device]]\nname = \"d\"\npath = \"/x\"\n",
    );
    let e = Config::from_cli(&Cli::parse_from([
        "x",
        "--config",
        f.path().to_str().unwrap(),
    ]))
    .unwrap_err()
    .to_string();
    assert!(e.contains("tls_cert and tls_key go together"), "{e}");
    let e = Config::from_cli(&Cli::parse_from([
        "x",
        "--listen",
        "[::]:1",
        "--device",
        "d=/x",
        "--tls-client-ca",
        "/etc/ca.crt",
    ]))
    .unwrap_err()
    .to_string();
    assert!(e.contains("tls_client_ca needs tls_cert"), "{e}");
}

#[test]
fn file_refuses_duplicates_and_long_serials() {
    let f = write_config(
        "listen = \"[::]:1\"\n[[device]]\nname = \"d\"\npath = \"/x\"\n[[device]]\nname = \"d\"\npath = \"/y\"\n",
    );
    let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
    let chain = format!(
        "{:#}",
        anyhow::Error::from(Config::from_cli(&cli).unwrap_err())
    );
    assert!(chain.contains("\"d\" is given more than once"), "{chain}");

    let f = write_config(
        "listen = \"[::]:1\"\n[[device]]\nname = \"d9\"\npath = \"/x\"\nserial = \"123456789012345678901\"\n",
    );
    let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
    let chain = format!(
        "{:#}",
        anyhow::Error::from(Config::from_cli(&cli).unwrap_err())
    );
    assert!(
        chain.contains("d9") && chain.contains("21 bytes"),
        "{chain}"
    );
}

#[test]
fn flags_refuse_duplicates_and_need_listen_and_devices() {
    let cli = Cli::parse_from([
        "x", "--listen", "[::]:1", "--device", "a=/x", "--device", "a=/y",
    ]);
    assert!(matches!(Config::from_cli(&cli), Err(Error::DuplicateDevice(n)) if n == "a"));
    let cli = Cli::parse_from(["x", "--device", "a=/x"]);
    assert!(matches!(Config::from_cli(&cli), Err(Error::NoListen)));
    let cli = Cli::parse_from(["x", "--listen", "[::]:1"]);
    assert!(matches!(Config::from_cli(&cli), Err(Error::NoDevices)));
}

#[test]
fn an_auth_key_that_starts_with_a_hyphen_is_a_value() {
    // Found by CI: one unpadded base64url key in 64 starts with `-`, and clap took
    // `--auth-key -N...` for an unknown flag, so the lender did not start.
    let key = "-NqJ0dQ1cXo7l0Vh9Qm2nq0u3u0lR9e8Y1s5zW4x3c0";
    let cli = Cli::try_parse_from(["x", "--auth-key", key, "--auth-key", "AbC"]).unwrap();
    assert_eq!(cli.auth_keys, [key, "AbC"]);
}

#[test]
fn max_sessions_comes_from_file_or_flag_and_is_bounded() {
    let f = write_config(
        "listen = \"0.0.0.0:7700\"\nmax_sessions = 1000\n[[device]]\nname = \"d\"\npath = \"/x\"\n",
    );
    let path = f.path().to_str().unwrap();
    let c = Config::from_cli(&Cli::parse_from(["x", "--config", path])).unwrap();
    assert_eq!(c.max_sessions, Some(1000));
    assert!(c.to_toml().contains("max_sessions = 1000"));
    let cli = Cli::parse_from(["x", "--config", path, "--max-sessions", "2048"]);
    assert_eq!(Config::from_cli(&cli).unwrap().max_sessions, Some(2048));
    let cli = Cli::parse_from(["x", "--listen", "127.0.0.1:9", "--device", "d=/x"]);
    let c = Config::from_cli(&cli).unwrap();
    assert_eq!(c.max_sessions, None);
    assert!(!c.to_toml().contains("max_sessions"));
    for bad in ["0", "65537"] {
        let r = Cli::try_parse_from(["x", "--listen", "127.0.0.1:9", "--max-sessions", bad]);
        assert!(r.is_err(), "--max-sessions {bad} was taken");
    }
    let f = write_config(
        "listen = \"0.0.0.0:7700\"\nmax_sessions = 0\n[[device]]\nname = \"d\"\npath = \"/x\"\n",
    );
    let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
    assert!(matches!(
        Config::from_cli(&cli),
        Err(Error::BadMaxSessions(0))
    ));
}

#[test]
fn poll_us_comes_from_file_or_flag_and_is_bounded() {
    let f = write_config(
        "listen = \"0.0.0.0:7700\"\npoll_us = 50\n[[device]]\nname = \"d\"\npath = \"/x\"\n",
    );
    let path = f.path().to_str().unwrap();
    let c = Config::from_cli(&Cli::parse_from(["x", "--config", path])).unwrap();
    assert_eq!(c.poll_us, Some(50));
    assert!(c.to_toml().contains("poll_us = 50"));
    let cli = Cli::parse_from(["x", "--config", path, "--poll-us", "0"]);
    assert_eq!(Config::from_cli(&cli).unwrap().poll_us, Some(0));
    let cli = Cli::parse_from(["x", "--listen", "127.0.0.1:9", "--device", "d=/x"]);
    let c = Config::from_cli(&cli).unwrap();
    assert_eq!(c.poll_us, None);
    assert!(!c.to_toml().contains("poll_us"));
    let r = Cli::try_parse_from(["x", "--listen", "127.0.0.1:9", "--poll-us", "1001"]);
    assert!(r.is_err(), "--poll-us 1001 was taken");
    let f = write_config(
        "listen = \"0.0.0.0:7700\"\npoll_us = 5000\n[[device]]\nname = \"d\"\npath = \"/x\"\n",
    );
    let cli = Cli::parse_from(["x", "--config", f.path().to_str().unwrap()]);
    assert!(matches!(
        Config::from_cli(&cli),
        Err(Error::BadPollUs(5000))
    ));
}
