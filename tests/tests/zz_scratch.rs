use devlend_tests::guest::Guest;
use std::time::Duration;

#[test]
fn scratch_failures() {
    // rc propagation + results + wait_for_line + files
    let mut g = Guest::builder().name("fail").native_pcie_hotplug(true)
        .file("/usr/local/bin/hello", "#!/bin/sh\necho hi-from-file\n", 0o755)
        .host_file("/opt/x/cat", "/bin/busybox")
        .modules(["dummy", "rdma_rxe"])
        .script("hello\necho DEVLEND-RESULT a=1\necho DEVLEND-RESULT a=2\nls /sys/bus/pci/slots\nlsmod | grep -c . \n/opt/x/cat --help >/dev/null 2>&1; echo DEVLEND-RESULT cat=$?\nexit 3\n")
        .boot().unwrap();
    let l = g
        .wait_for_text("hi-from-file", Duration::from_secs(120))
        .unwrap();
    eprintln!("matched: {l}");
    let o = g.wait_done(Duration::from_secs(120)).unwrap();
    assert_eq!(o.rc, 3);
    assert_eq!(o.result("a"), Some("2"));
    eprintln!("{}", o.console);
    eprintln!("check_success: {:#}", o.check_success().unwrap_err());
    // timeout
    let mut g = Guest::builder()
        .name("hang")
        .script("echo before; sleep 1000")
        .boot()
        .unwrap();
    let e = g.wait_done(Duration::from_secs(12)).unwrap_err();
    eprintln!("TIMEOUT ERROR: {e:#}");
    // bad QEMU arg -> exits early
    let mut g = Guest::builder()
        .name("bad")
        .arg("-device")
        .arg("nosuchdevice")
        .boot()
        .unwrap();
    let e = g.wait_done(Duration::from_secs(30)).unwrap_err();
    eprintln!("EARLY EXIT ERROR: {e:#}");
}
