//! Tests of device specs, per kind: the `--device` flag, `[[device]]` tables with and
//! without `kind`, and the message of each refusal.

use std::path::PathBuf;

use super::{check_unique, parse_mac, BlockSpec, Coherence, DeviceSpec, KindSpec};
use super::{NetSpec, PciSpec};
use crate::Error;

fn spec(s: &str) -> Result<DeviceSpec, Error> {
    s.parse()
}

fn block(d: &DeviceSpec) -> &BlockSpec {
    match &d.kind {
        KindSpec::Block(b) => b,
        other => panic!("{other:?} is not a block device"),
    }
}

fn net(d: &DeviceSpec) -> &NetSpec {
    match &d.kind {
        KindSpec::Net(n) => n,
        other => panic!("{other:?} is not a network interface"),
    }
}

fn pci(d: &DeviceSpec) -> &PciSpec {
    match &d.kind {
        KindSpec::Pci(p) => p,
        other => panic!("{other:?} is not a PCIe function"),
    }
}

#[test]
fn parses_plain_ro_and_serial() {
    let d = spec("disk0=/dev/nvme0n1").unwrap();
    assert_eq!(d.name, "disk0");
    assert_eq!(block(&d).path, PathBuf::from("/dev/nvme0n1"));
    assert!(!block(&d).read_only);
    assert_eq!(block(&d).serial, None);

    let d = spec("d=/tmp/a.img,ro,serial=SN-1").unwrap();
    assert!(block(&d).read_only);
    assert_eq!(block(&d).serial.as_deref(), Some("SN-1"));

    let d = spec("d=/tmp/a.img,serial=X,ro").unwrap();
    assert!(block(&d).read_only);
    assert_eq!(block(&d).serial.as_deref(), Some("X"));

    // Exactly 20 bytes is fine.
    let d = spec("d=/x,serial=01234567890123456789").unwrap();
    assert_eq!(&block(&d).serial_bytes(&d.name), b"01234567890123456789");
}

#[test]
fn parses_pci_functions() {
    let s = spec("fpga0=pci:0000:00:03.0").unwrap();
    assert_eq!(pci(&s).bdf, "0000:00:03.0");
    assert_eq!(s.kind.name(), "pci");
    // An address without its domain is shown with it; garbage gets no hint.
    assert_eq!(
        spec("fpga0=pci:00:03.0").unwrap_err().to_string(),
        "device `fpga0`: PCIe address \"00:03.0\" is not DDDD:BB:DD.F (hex, with the domain: 0000:00:03.0)"
    );
    assert_eq!(
        spec("fpga0=pci:garbage").unwrap_err().to_string(),
        "device `fpga0`: PCIe address \"garbage\" is not DDDD:BB:DD.F (hex, with the domain)"
    );
    assert!(spec("fpga0=pci:0000:00:03.8").is_err());
    assert!(spec("fpga0=pci:0000:00:03.0,ro").is_err());
    assert!(spec("fpga0=pci:").is_err());
    assert_eq!(
        pci(&spec("fpga0=pci:0000:00:03.0").unwrap()).coherence,
        None
    );
    assert_eq!(
        pci(&spec("ssd0=pci:0000:00:03.0,coherence=nvme").unwrap()).coherence,
        Some(Coherence::Nvme)
    );
    assert_eq!(
        pci(&spec("ssd0=pci:0000:00:03.0,coherence=mirror").unwrap()).coherence,
        Some(Coherence::Mirror)
    );
    assert!(spec("ssd0=pci:0000:00:03.0,coherence=rdma").is_err());
    assert!(spec("d0=/tmp/x,coherence=nvme").is_err());
}

#[test]
fn parses_network_interfaces() {
    let s = spec("nic0=net:veth1").unwrap();
    assert_eq!(net(&s).interface, "veth1");
    assert_eq!(s.kind.name(), "net");
    let s = spec("nic0=net:eth0,mac=02:00:00:aa:bb:0C").unwrap();
    assert_eq!(
        parse_mac(net(&s).mac.as_deref().unwrap()),
        Some([2, 0, 0, 0xaa, 0xbb, 0x0c])
    );
    assert!(spec("nic0=net:eth0,mac=03:00:00:00:00:01").is_err()); // multicast
    assert!(spec("nic0=net:eth0,mac=02:00:00").is_err());
    assert!(spec("nic0=net:eth0,ro").is_err());
    let two = [spec("a=net:eth0").unwrap(), spec("b=net:eth0").unwrap()];
    assert!(matches!(
        check_unique(&two),
        Err(Error::SharedInterface { ref interface, .. }) if interface == "eth0"
    ));
    assert!(check_unique(&[spec("a=net:eth0").unwrap(), spec("b=net:eth1").unwrap()]).is_ok());
    assert!(spec("nic0=net:").is_err());
    assert!(spec("d=/x.img,mac=02:00:00:00:00:01").is_err());
    assert!(spec("nic0=net:a-very-long-ifname").is_err());
}

#[test]
fn refuses_bad_forms() {
    for bad in [
        "disk0",
        "=/x",
        "disk0=",
        "disk0=,ro",
        "disk0=/x,",
        "disk0=/x,rw",
        "disk0=/x,readonly",
        "disk0=/x,serial=",
        "disk0=/x,serial=a,serial=b",
    ] {
        assert!(spec(bad).is_err(), "{bad:?} was accepted");
    }
    let long = format!("{}=/x", "n".repeat(256));
    assert!(matches!(spec(&long), Err(Error::BadName { .. })));
}

#[test]
fn refuses_serial_over_20_bytes_naming_the_device() {
    let err = spec("disk7=/x,serial=012345678901234567890").unwrap_err();
    assert!(
        matches!(err, Error::SerialTooLong { len: 21, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("disk7") && msg.contains("21") && msg.contains("20"),
        "{msg}"
    );
    // Length counts bytes, not characters: 7 × 3 bytes = 21.
    assert!(matches!(
        spec("d=/x,serial=€€€€€€€"),
        Err(Error::SerialTooLong { .. })
    ));
}

#[test]
fn default_serial_is_the_name_truncated_to_20_bytes() {
    let d = spec("disk0=/x").unwrap();
    let mut want = [0u8; 20];
    want[..5].copy_from_slice(b"disk0");
    assert_eq!(block(&d).serial_bytes(&d.name), want);
    let d = spec("a-very-long-device-name-indeed=/x").unwrap();
    assert_eq!(&block(&d).serial_bytes(&d.name), b"a-very-long-device-n");
}

/// Each flag option of another kind is refused naming the device, the option and the
/// kind.
#[test]
fn flag_options_of_another_kind_name_the_option_and_the_kind() {
    for (flag, field, kind) in [
        ("eth=net:eth0,ro", "ro", "net"),
        ("eth=net:eth0,serial=S", "serial", "net"),
        ("eth=net:eth0,store=nvme0", "store", "net"),
        ("eth=net:eth0,coherence=nvme", "coherence", "net"),
        ("d=/x.img,mac=02:00:00:00:00:01", "mac", "block"),
        ("d=/x.img,coherence=mirror", "coherence", "block"),
        ("f=pci:0000:00:03.0,ro", "ro", "pci"),
        ("f=pci:0000:00:03.0,serial=S", "serial", "pci"),
        ("f=pci:0000:00:03.0,mac=02:00:00:00:00:01", "mac", "pci"),
        ("f=pci:0000:00:03.0,tx_bps=10", "tx_bps", "pci"),
        (
            "ssd=pci-pf:0000:00:03.0,vfs=1,store=nvme0",
            "store",
            "pci-pf",
        ),
    ] {
        let err = spec(flag).unwrap_err();
        let name = flag.split('=').next().unwrap();
        assert_eq!(
            err.to_string(),
            format!("device `{name}`: `{field}` does not apply to kind `{kind}`"),
            "{flag}"
        );
    }
    // Traits apply to every kind; limits to every kind, on its lanes.
    assert_eq!(
        spec("f=pci:0000:00:03.0,traits=FPGA").unwrap().traits,
        ["FPGA"]
    );
    assert!(spec("eth=net:eth0,tx_pps=100,traits=A").is_ok());
    // A limit on another kind's lane is named like any other option of another kind
    // (a trial found "invalid device spec ...: limit iops_read does not apply to a
    // network interface", not the documented form).
    assert_eq!(
        spec("eth=net:eth0,iops_read=10").unwrap_err().to_string(),
        "device `eth`: `iops_read` does not apply to kind `net`"
    );
    assert_eq!(
        spec("d=/x,rx_pps=10").unwrap_err().to_string(),
        "device `d`: `rx_pps` does not apply to kind `block`"
    );
}

#[test]
fn a_bad_interface_or_empty_backing_says_what_is_wrong() {
    // A trial found these reported as an invalid device *name*, or as an "empty path".
    let msg = spec("eth=net:bad/name").unwrap_err().to_string();
    assert!(
        msg.contains("interface name") && !msg.contains("device name"),
        "{msg}"
    );
    let msg = spec("eth=net:eth0,mac=01:00:00:00:00:01")
        .unwrap_err()
        .to_string();
    assert!(!msg.contains("device name"), "{msg}");
    assert!(spec("eth=net:")
        .unwrap_err()
        .to_string()
        .ends_with("empty interface name"));
    assert!(spec("f=pci:")
        .unwrap_err()
        .to_string()
        .ends_with("empty PCIe address"));
}

fn from_toml(text: &str) -> Result<DeviceSpec, String> {
    #[derive(serde::Deserialize)]
    struct File {
        device: DeviceSpec,
    }
    toml::from_str::<File>(text)
        .map(|f| f.device)
        .map_err(|e| e.message().to_owned())
}

/// Tables written before `kind` existed load, their kind inferred from the backing key.
#[test]
fn tables_without_kind_infer_it_from_the_backing_key() {
    let d = from_toml(
        "[device]\nname = \"d\"\npath = \"/x.img\"\nread_only = true\nserial = \"S\"\nstore = \"s\"\ntraits = [\"SSD\"]\n[device.qos]\nweight = 3\n",
    )
    .unwrap();
    assert_eq!(d.traits, ["SSD"]);
    let b = block(&d);
    assert_eq!(b.path, PathBuf::from("/x.img"));
    assert!(b.read_only);
    assert_eq!(b.serial.as_deref(), Some("S"));
    assert_eq!(b.store.as_deref(), Some("s"));
    assert_eq!(b.qos.weight, Some(3));

    let d = from_toml("[device]\nname = \"eth\"\nnet = \"eth0\"\nmac = \"02:00:00:00:00:01\"\n")
        .unwrap();
    assert_eq!(net(&d).interface, "eth0");
    assert_eq!(net(&d).mac.as_deref(), Some("02:00:00:00:00:01"));

    let d = from_toml("[device]\nname = \"f\"\npci = \"0000:00:03.0\"\ncoherence = \"mirror\"\n")
        .unwrap();
    assert_eq!(pci(&d).bdf, "0000:00:03.0");
    assert_eq!(pci(&d).coherence, Some(Coherence::Mirror));
}

#[test]
fn tables_with_kind_take_its_keys() {
    let d = from_toml("[device]\nname = \"d\"\nkind = \"block\"\npath = \"/x.img\"\n").unwrap();
    assert_eq!(block(&d).path, PathBuf::from("/x.img"));
    let d = from_toml("[device]\nname = \"eth\"\nkind = \"net\"\ninterface = \"eth0\"\n").unwrap();
    assert_eq!(net(&d).interface, "eth0");
    let d = from_toml("[device]\nname = \"f\"\nkind = \"pci\"\nbdf = \"0000:00:03.0\"\n").unwrap();
    assert_eq!(pci(&d).bdf, "0000:00:03.0");
}

#[test]
fn table_keys_of_another_kind_name_the_key_and_the_kind() {
    for (table, want) in [
        (
            "name = \"eth\"\nkind = \"net\"\nnet = \"eth0\"\nread_only = true",
            "device `eth`: `read_only` does not apply to kind `net`",
        ),
        (
            "name = \"eth\"\nnet = \"eth0\"\nstore = \"s\"",
            "device `eth`: `store` does not apply to kind `net`",
        ),
        (
            "name = \"d\"\npath = \"/x\"\nmac = \"02:00:00:00:00:01\"",
            "device `d`: `mac` does not apply to kind `block`",
        ),
        (
            "name = \"d\"\nkind = \"block\"\npath = \"/x\"\ncoherence = \"nvme\"",
            "device `d`: `coherence` does not apply to kind `block`",
        ),
        (
            "name = \"f\"\npci = \"0000:00:03.0\"\nserial = \"S\"",
            "device `f`: `serial` does not apply to kind `pci`",
        ),
        (
            "name = \"f\"\nkind = \"pci\"\npci = \"0000:00:03.0\"\nmac = \"52:54:00:00:00:01\"",
            "device `f`: `mac` does not apply to kind `pci`",
        ),
        (
            "name = \"f\"\nkind = \"pci\"\npath = \"/x\"",
            "device `f`: `path` does not apply to kind `pci`",
        ),
    ] {
        let msg = from_toml(&format!("[device]\n{table}\n")).unwrap_err();
        assert_eq!(msg, want, "{table}");
    }
}

#[test]
fn tables_that_do_not_say_their_kind_are_refused_by_name() {
    let msg = from_toml("[device]\nname = \"d\"\nread_only = true\n").unwrap_err();
    assert!(
        msg.contains("device `d`") && msg.contains("`path`"),
        "{msg}"
    );
    let msg = from_toml("[device]\nname = \"d\"\npath = \"/x\"\nnet = \"eth0\"\n").unwrap_err();
    assert!(msg.contains("both `path` and `net`"), "{msg}");
    let msg = from_toml("[device]\nname = \"d\"\nkind = \"gpu\"\npath = \"/x\"\n").unwrap_err();
    assert!(msg.contains("unknown kind `gpu`"), "{msg}");
    let msg = from_toml("[device]\nname = \"d\"\npath = \"/x\"\nsize = 3\n").unwrap_err();
    assert!(
        msg.contains(
            "device `d`: unknown key `size`; a device of kind `block` takes `name`, `kind`, `traits`, `path`, `read_only`, `serial`, `qos`, `store`"
        ),
        "{msg}"
    );
    let msg = from_toml("[device]\npath = \"/x\"\n").unwrap_err();
    assert!(msg.contains("`name`"), "{msg}");
}

/// What `--print-config` writes for each kind loads back as the same spec.
#[test]
fn each_kind_prints_back_as_a_table_that_loads() {
    for flag in [
        "d=/x.img,ro,serial=S,iops_read=100,store=s,traits=SSD",
        "eth=net:eth0,mac=02:00:00:00:00:01,tx_pps=10",
        "f=pci:0000:00:03.0,coherence=nvme",
    ] {
        let d = spec(flag).unwrap();
        #[derive(serde::Serialize)]
        struct File<'a> {
            device: &'a DeviceSpec,
        }
        let text = toml::to_string(&File { device: &d }).unwrap();
        assert!(
            text.contains(&format!("kind = \"{}\"", d.kind.name())),
            "{text}"
        );
        assert_eq!(from_toml(&text).unwrap(), d, "{text}");
    }
}

/// Limits take the K, M, G, T suffixes (powers of 1024) the CLI's sizes and `--qos`
/// take (a trial found `--device d=/x.img,bps_read=50M` refused as not a number).
#[test]
fn limits_take_size_suffixes() {
    use devlend_fabric::qos::Lane;
    let d = spec("d=/x.img,bps_read=50M,bps_read_burst=4m,iops_write=2K").unwrap();
    let q = &block(&d).qos;
    assert_eq!(q.get(Lane::BpsRead).unwrap().per_sec, 50 << 20);
    assert_eq!(q.get(Lane::BpsRead).unwrap().burst, 4 << 20);
    assert_eq!(q.get(Lane::IopsWrite).unwrap().per_sec, 2048);
    let msg = spec("d=/x.img,bps_read=50Q").unwrap_err().to_string();
    assert!(msg.contains("bps_read: unknown size suffix 'Q'"), "{msg}");
}

/// A `[device.qos]` table takes the same suffixes as the flag: `bps_read = "50M"` in
/// the TOML file means what `bps_read=50M` means in `--device` (numbers still load).
#[test]
fn toml_limits_take_the_flags_size_suffixes() {
    use devlend_fabric::qos::Lane;
    let d = from_toml(
        "[device]\nname = \"d\"\npath = \"/x.img\"\n[device.qos]\nbps_read = \"50M\"\nbps_read_burst = \"4m\"\niops_write = 2048\n",
    )
    .unwrap();
    let flag = spec("d=/x.img,bps_read=50M,bps_read_burst=4m,iops_write=2K").unwrap();
    assert_eq!(block(&d).qos, block(&flag).qos);
    assert_eq!(block(&d).qos.get(Lane::BpsRead).unwrap().per_sec, 50 << 20);
    let err =
        from_toml("[device]\nname = \"d\"\npath = \"/x.img\"\n[device.qos]\nbps_read = \"50Q\"\n")
            .unwrap_err()
            .to_string();
    assert!(err.contains("'Q'"), "{err}");
}

fn pf(d: &DeviceSpec) -> &super::PfSpec {
    match &d.kind {
        KindSpec::PciPf(p) => p,
        other => panic!("{other:?} is not an SR-IOV PF"),
    }
}

#[test]
fn parses_sriov_physical_functions_as_flags_and_tables() {
    let s =
        spec("ssd=pci-pf:0000:03:00.0,vfs=2,namespaces=1+3:2,coherence=nvme,traits=NVME").unwrap();
    assert_eq!(s.kind.name(), "pci-pf");
    let p = pf(&s);
    assert_eq!((p.bdf.as_str(), p.vfs), ("0000:03:00.0", 2));
    assert_eq!(p.namespaces, [vec![1, 3], vec![2]]);
    assert_eq!(p.coherence, Some(Coherence::Nvme));
    assert_eq!(s.traits, ["NVME"]);
    // An empty entry gives that VF no namespace; IDs may be hex.
    let s = spec("ssd=pci-pf:0000:03:00.0,vfs=3,namespaces=0x10::2").unwrap();
    assert_eq!(pf(&s).namespaces, [vec![16], vec![], vec![2]]);

    let t = from_toml(
        "[device]\nname = \"ssd\"\npf = \"0000:03:00.0\"\nvfs = 2\nnamespaces = [[1, 3], [2]]\n",
    )
    .unwrap();
    assert_eq!(pf(&t).namespaces, [vec![1, 3], vec![2]]);
    assert_eq!(t.kind.name(), "pci-pf", "the kind inferred from `pf`");
    let e = from_toml("[device]\nname = \"ssd\"\npf = \"0000:03:00.0\"\nvfs = 2\npath = \"/x\"\n")
        .unwrap_err();
    assert!(e.contains("both"), "{e}");
}

#[test]
fn refuses_bad_sriov_physical_functions_saying_why() {
    let err = |s: &str| spec(s).unwrap_err().to_string();
    let chain = |s: &str| devlend_fabric::error::chain(&spec(s).unwrap_err());
    assert!(chain("ssd=pci-pf:0000:03:00.0").contains("vfs = 0"));
    assert!(chain("ssd=pci-pf:0000:03:00.0,vfs=300").contains("1 to 256 VFs"));
    assert!(chain("ssd=pci-pf:0000:03:00.0,vfs=x").contains("is not a number"));
    assert!(chain("ssd=pci-pf:0000:03:00.0,vfs=1,namespaces=1:2").contains("namespaces for 2 VFs"));
    assert!(chain("ssd=pci-pf:0000:03:00.0,vfs=1,namespaces=0").contains("namespace ID 0"));
    // A trial attached namespace 1 to both VFs' controllers: their VMs shared it.
    assert!(chain("ssd=pci-pf:0000:03:00.0,vfs=2,namespaces=1:1").contains("named twice"));
    assert!(chain("ssd=pci-pf:0000:03:00.0,vfs=2,namespaces=1+2:2").contains("namespace 2"));
    assert!(chain("ssd=pci-pf:0000:03:00.0,vfs=1,namespaces=a").contains("not a namespace ID"));
    assert!(chain("ssd=pci-pf:0000:03:00.0,vfs=1,coherence=x").contains("unknown coherence"));
    assert!(err("ssd=pci-pf:0000:03:00,vfs=1").contains("0000:03:00"));
    assert!(spec("ssd=pci-pf:").is_err());
    // Options of other kinds, and NIC lanes.
    for bad in [
        "ro",
        "serial=S",
        "mac=52:54:00:00:00:01",
        "tx_pps=5",
        "store=s",
    ] {
        let e = chain(&format!("ssd=pci-pf:0000:03:00.0,vfs=1,{bad}"));
        assert!(e.contains("pci-pf"), "{bad}: {e}");
    }
    // vfs and namespaces belong to pci-pf only.
    let e = chain("fpga=pci:0000:03:00.0,vfs=2");
    assert!(e.contains("vfs") && e.contains("pci"), "{e}");
}

/// A PCIe function takes a block device's limits and store (the NVMe mediator enforces
/// them), a PF takes limits that bound its VFs together; a mirrored function, a PF's
/// weight and NIC lanes are refused, saying why.
#[test]
fn pci_functions_and_pfs_take_block_limits() {
    use devlend_fabric::qos::Lane;
    let s = spec("f=pci:0000:03:00.0,iops_read=2K,iops_read_burst=100,store=s,weight=3").unwrap();
    let p = pci(&s);
    assert_eq!(p.qos.get(Lane::IopsRead).unwrap().per_sec, 2048);
    assert_eq!(p.qos.get(Lane::IopsRead).unwrap().burst, 100);
    assert_eq!((p.qos.weight, p.store.as_deref()), (Some(3), Some("s")));
    assert_eq!(s.qos(), p.qos);
    assert_eq!(s.store(), Some("s"));
    let t = from_toml(
        "[device]\nname = \"f\"\npci = \"0000:03:00.0\"\nstore = \"s\"\n[device.qos]\niops_read = \"2K\"\niops_read_burst = 100\nweight = 3\n",
    )
    .unwrap();
    assert_eq!(t, s, "the table and the flag agree");

    let s = spec("ssd=pci-pf:0000:03:00.0,vfs=2,bps_total=1G").unwrap();
    assert_eq!(pf(&s).qos.get(Lane::BpsTotal).unwrap().per_sec, 1 << 30);
    assert_eq!(
        s.qos(),
        Default::default(),
        "a PF is not a device of its own"
    );
    let t = from_toml(
        "[device]\nname = \"ssd\"\npf = \"0000:03:00.0\"\nvfs = 2\n[device.qos]\nbps_total = \"1G\"\n",
    )
    .unwrap();
    assert_eq!(t, s);

    let chain = |s: &str| devlend_fabric::error::chain(&spec(s).unwrap_err());
    assert!(
        chain("f=pci:0000:03:00.0,coherence=mirror,iops_read=5").contains("coherence nvme only")
    );
    assert!(chain("f=pci:0000:03:00.0,coherence=mirror,store=s").contains("coherence nvme only"));
    assert!(
        spec("f=pci:0000:03:00.0,coherence=mirror,weight=5").is_ok(),
        "a weight alone limits nothing"
    );
    assert!(chain("ssd=pci-pf:0000:03:00.0,vfs=2,weight=5").contains("weights are the VFs'"));
    assert_eq!(
        spec("f=pci:0000:03:00.0,rx_pps=5").unwrap_err().to_string(),
        "device `f`: `rx_pps` does not apply to kind `pci`"
    );
    assert!(
        chain("f=pci:0000:03:00.0,iops_read_burst=5").contains("iops_read_burst without iops_read")
    );
}
