//! `expand` against a directory laid out as `/sys/bus/pci` and a fake NVMe primary
//! controller that keeps the secondary controllers' state as the NVMe spec says.

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

use super::nvme_admin::{Admin, AdminCommand, AdminError};
use super::*;

const PF: &str = "0000:01:00.0";

/// A fake sysfs: a PF with `total` VFs possible, bound to `driver`, of class `class`,
/// and its VFs `0000:01:00.(i+1)` already bound to vfio-pci (the kernel's binding is not
/// something a directory can do).
fn sysfs(dir: &Path, total: u16, driver: &str, class: &str) -> Sysfs {
    let dev = dir.join("devices");
    let pf = dev.join(PF);
    std::fs::create_dir_all(&pf).unwrap();
    std::fs::write(pf.join("sriov_totalvfs"), format!("{total}\n")).unwrap();
    std::fs::write(pf.join("sriov_numvfs"), "0\n").unwrap();
    std::fs::write(pf.join("sriov_drivers_autoprobe"), "1\n").unwrap();
    std::fs::write(pf.join("class"), format!("{class}\n")).unwrap();
    std::fs::write(pf.join("reset"), "").unwrap();
    let drivers = dir.join("drivers");
    for d in [driver, "vfio-pci"] {
        std::fs::create_dir_all(drivers.join(d)).unwrap();
    }
    std::os::unix::fs::symlink(drivers.join(driver), pf.join("driver")).unwrap();
    for i in 0..total {
        let vf = format!("0000:01:00.{}", i + 1);
        std::fs::create_dir_all(dev.join(&vf)).unwrap();
        std::os::unix::fs::symlink(drivers.join("vfio-pci"), dev.join(&vf).join("driver")).unwrap();
        std::os::unix::fs::symlink(format!("../{vf}"), pf.join(format!("virtfn{i}"))).unwrap();
    }
    let mut s = Sysfs::at(dir);
    s.settle = Duration::from_millis(50);
    s
}

/// A secondary controller: online, queues, interrupts, attached namespaces.
type Sec = (bool, u16, u16, Vec<u32>);

/// A primary controller (ID 0) with `vfs` secondary controllers (IDs 1..), 8 flexible
/// queues and 4 interrupts, all held by the primary at first.
#[derive(Debug, Default)]
struct Ctrl {
    primary_queues: u16,
    primary_interrupts: u16,
    /// Per secondary: (online, queues, interrupts, namespaces).
    secondaries: Vec<Sec>,
    log: Vec<String>,
}

struct Fake(Rc<RefCell<Ctrl>>);

impl Admin for Fake {
    fn run(&mut self, cmd: &AdminCommand, data: &mut [u8]) -> Result<u32, AdminError> {
        let mut c = self.0.borrow_mut();
        let put16 =
            |d: &mut [u8], at: usize, v: u16| d[at..at + 2].copy_from_slice(&v.to_le_bytes());
        let put32 =
            |d: &mut [u8], at: usize, v: u32| d[at..at + 4].copy_from_slice(&v.to_le_bytes());
        match (cmd.opcode, cmd.cdw10 & 0xff) {
            (0x06, 0x14) => {
                let assigned =
                    |f: fn(&Sec) -> u16| c.secondaries.iter().map(|s| u32::from(f(s))).sum::<u32>();
                put16(data, 0, 0);
                put32(data, 32, 8);
                put32(data, 36, assigned(|s| s.1));
                put16(data, 40, c.primary_queues);
                put16(data, 44, 4);
                put16(data, 46, 1);
                put32(data, 64, 4);
                put32(data, 68, assigned(|s| s.2));
                put16(data, 72, c.primary_interrupts);
                put16(data, 76, 2);
                put16(data, 78, 1);
                Ok(0)
            }
            (0x06, 0x15) => {
                data[0] = c.secondaries.len() as u8;
                for (i, s) in c.secondaries.iter().enumerate() {
                    let at = 32 + 32 * i;
                    put16(data, at, i as u16 + 1);
                    data[at + 4] = u8::from(s.0);
                    put16(data, at + 8, i as u16 + 1);
                    put16(data, at + 10, s.1);
                    put16(data, at + 12, s.2);
                }
                Ok(0)
            }
            (0x1c, _) => {
                let (act, rt, id, n) = (
                    cmd.cdw10 & 0xf,
                    (cmd.cdw10 >> 8) & 7,
                    (cmd.cdw10 >> 16) as usize,
                    cmd.cdw11 as u16,
                );
                c.log
                    .push(format!("virt-mgmt act={act} rt={rt} id={id} n={n}"));
                match act {
                    1 if rt == 0 => c.primary_queues = n,
                    1 => c.primary_interrupts = n,
                    8 | 9 => {
                        if c.primary_queues > 0 {
                            // The flexible resources are still the primary's.
                            return Err(AdminError::Status(0x121));
                        }
                        let s = c
                            .secondaries
                            .get_mut(id - 1)
                            .ok_or(AdminError::Status(0x11f))?;
                        if s.0 {
                            return Err(AdminError::Status(0x120));
                        }
                        match (act, rt) {
                            (8, 0) => s.1 = n,
                            (8, _) => s.2 = n,
                            _ if s.1 < 2 || s.2 < 1 => return Err(AdminError::Status(0x121)),
                            _ => s.0 = true,
                        }
                    }
                    _ => return Err(AdminError::Status(0x2)),
                }
                Ok(0)
            }
            (0x15, _) => {
                let id = u16::from_le_bytes([data[2], data[3]]) as usize;
                c.log.push(format!("attach ns={} id={id}", cmd.nsid));
                let s = c
                    .secondaries
                    .get_mut(id - 1)
                    .ok_or(AdminError::Status(0x11f))?;
                if s.3.contains(&cmd.nsid) {
                    return Err(AdminError::Status(0x118));
                }
                s.3.push(cmd.nsid);
                Ok(0)
            }
            _ => Err(AdminError::Status(0x1)),
        }
    }
}

fn pf_spec(vfs: u16, namespaces: Vec<Vec<u32>>) -> Vec<DeviceSpec> {
    let mut p = PfSpec::new(PF, vfs);
    p.namespaces = namespaces;
    let mut d = DeviceSpec::new("ssd", KindSpec::PciPf(p));
    d.traits.push("NVME".into());
    vec![d]
}

fn nvme_ctrl(vfs: usize) -> Rc<RefCell<Ctrl>> {
    Rc::new(RefCell::new(Ctrl {
        primary_queues: 8,
        primary_interrupts: 4,
        secondaries: vec![(false, 0, 0, Vec::new()); vfs],
        log: Vec::new(),
    }))
}

#[test]
fn an_nvme_pf_gives_its_vfs_resources_brings_them_online_and_lends_them() {
    let dir = tempfile::tempdir().unwrap();
    let sys = sysfs(dir.path(), 2, "nvme", "0x010802");
    let ctrl = nvme_ctrl(2);
    let c = Rc::clone(&ctrl);
    let opener = move |_: &Sysfs, _: &str| Ok(Box::new(Fake(Rc::clone(&c))) as Box<dyn Admin>);
    let out = expand(
        &pf_spec(2, vec![vec![1], vec![2, 3]]),
        Mode::Start,
        &sys,
        &opener,
    )
    .unwrap();
    let names: Vec<_> = out.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["ssd-vf0", "ssd-vf1"]);
    for (i, d) in out.iter().enumerate() {
        let KindSpec::Pci(p) = &d.kind else {
            panic!("a VF is lent as a PCIe function: {d:?}")
        };
        assert_eq!(p.bdf, format!("0000:01:00.{}", i + 1));
        assert_eq!(d.traits, ["NVME", "PF_SSD", "SRIOV_VF"]);
    }
    let pf = dir.path().join("devices").join(PF);
    assert_eq!(
        std::fs::read_to_string(pf.join("sriov_numvfs")).unwrap(),
        "2"
    );
    assert_eq!(
        std::fs::read_to_string(pf.join("sriov_drivers_autoprobe")).unwrap(),
        "0",
        "the VFs must not be probed by the PF's VF driver"
    );
    assert_eq!(
        std::fs::read_to_string(pf.join("reset")).unwrap(),
        "1",
        "the PF is reset for its flexible allocation of 0 to take effect"
    );
    let c = ctrl.borrow();
    assert_eq!((c.primary_queues, c.primary_interrupts), (0, 0));
    // 8 queues and 4 interrupts over 2 VFs, at most 4 and 2 each.
    assert_eq!(
        c.secondaries,
        [(true, 4, 2, vec![1]), (true, 4, 2, vec![2, 3])],
        "{:#?}",
        c.log
    );
    drop(c);

    // A restart finds everything in place: no resource is assigned again, no
    // namespace attached twice fails it, the names are the same.
    ctrl.borrow_mut().log.clear();
    std::fs::write(pf.join("reset"), "").unwrap();
    let again = expand(
        &pf_spec(2, vec![vec![1], vec![2, 3]]),
        Mode::Start,
        &sys,
        &opener,
    )
    .unwrap();
    assert_eq!(again, out);
    let c = ctrl.borrow();
    assert!(
        c.log.iter().all(|l| !l.starts_with("virt-mgmt")),
        "{:?}",
        c.log
    );
    assert_eq!(std::fs::read_to_string(pf.join("reset")).unwrap(), "");
}

#[test]
fn more_vfs_than_the_pf_offers_is_refused_with_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let sys = sysfs(dir.path(), 2, "nvme", "0x010802");
    let ctrl = nvme_ctrl(2);
    let opener = move |_: &Sysfs, _: &str| Ok(Box::new(Fake(Rc::clone(&ctrl))) as Box<dyn Admin>);
    let e = expand(&pf_spec(3, vec![]), Mode::Start, &sys, &opener).unwrap_err();
    let msg = devlend_fabric::error::chain(&e);
    assert!(
        msg.contains("3 VFs asked for") && msg.contains("at most 2"),
        "{msg}"
    );
    let numvfs = dir.path().join("devices").join(PF).join("sriov_numvfs");
    assert_eq!(std::fs::read_to_string(numvfs).unwrap(), "0\n");
}

#[test]
fn too_few_flexible_resources_are_refused_before_any_vf_goes_online() {
    let dir = tempfile::tempdir().unwrap();
    // 5 VFs share 4 interrupts: a VF needs 1 at least.
    let sys = sysfs(dir.path(), 5, "nvme", "0x010802");
    let ctrl = nvme_ctrl(5);
    let c = Rc::clone(&ctrl);
    let opener = move |_: &Sysfs, _: &str| Ok(Box::new(Fake(Rc::clone(&c))) as Box<dyn Admin>);
    let e = expand(&pf_spec(5, vec![]), Mode::Start, &sys, &opener).unwrap_err();
    let msg = devlend_fabric::error::chain(&e);
    assert!(msg.contains("cannot give 5 VFs"), "{msg}");
    assert!(ctrl.borrow().secondaries.iter().all(|s| !s.0));
}

#[test]
fn a_pf_without_sriov_or_without_its_driver_or_a_pf_lent_whole_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sys = sysfs(dir.path(), 2, "igb", "0x020000");
    let no_admin = |_: &Sysfs, _: &str| -> Result<Box<dyn Admin>, SriovError> {
        panic!("an igb PF has no NVMe admin queue")
    };
    // A PF lent whole beside its VFs, and one of its VFs given again as pci:.
    for bdf in [PF, "0000:01:00.2"] {
        let mut specs = pf_spec(2, vec![]);
        specs.push(DeviceSpec::new("whole", PciSpec::new(bdf)));
        let msg = expand(&specs, Mode::Start, &sys, &no_admin)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("the lender keeps a PF with VFs"), "{msg}");
    }
    // An igb PF: no virtualization management, the VFs are enabled and lent.
    let out = expand(&pf_spec(2, vec![]), Mode::Start, &sys, &no_admin).unwrap();
    assert_eq!(out.len(), 2);
    // At a reload the number cannot change.
    let msg = devlend_fabric::error::chain(
        &expand(&pf_spec(1, vec![]), Mode::Reload, &sys, &no_admin).unwrap_err(),
    );
    assert!(msg.contains("only at a lender restart"), "{msg}");
    assert_eq!(
        expand(&pf_spec(2, vec![]), Mode::Reload, &sys, &no_admin).unwrap(),
        out
    );

    let pf = dir.path().join("devices").join(PF);
    std::fs::remove_file(pf.join("driver")).unwrap();
    let msg = devlend_fabric::error::chain(
        &expand(&pf_spec(2, vec![]), Mode::Start, &sys, &no_admin).unwrap_err(),
    );
    assert!(msg.contains("bound to no driver"), "{msg}");
    std::fs::remove_file(pf.join("sriov_totalvfs")).unwrap();
    let msg = devlend_fabric::error::chain(
        &expand(&pf_spec(2, vec![]), Mode::Start, &sys, &no_admin).unwrap_err(),
    );
    assert!(msg.contains("no SR-IOV capability"), "{msg}");
}

#[test]
fn a_vf_that_does_not_bind_to_vfio_pci_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let sys = sysfs(dir.path(), 2, "igb", "0x020000");
    let vf = dir.path().join("devices/0000:01:00.2");
    std::fs::remove_file(vf.join("driver")).unwrap();
    std::fs::write(dir.path().join("drivers_probe"), "").unwrap();
    let no_admin = |_: &Sysfs, _: &str| -> Result<Box<dyn Admin>, SriovError> { unreachable!() };
    let msg = devlend_fabric::error::chain(
        &expand(&pf_spec(2, vec![]), Mode::Start, &sys, &no_admin).unwrap_err(),
    );
    assert!(
        msg.contains("0000:01:00.2 did not bind to vfio-pci"),
        "{msg}"
    );
    assert_eq!(
        std::fs::read_to_string(vf.join("driver_override")).unwrap(),
        "vfio-pci"
    );
}

#[test]
fn pf_traits_are_pool_traits() {
    assert_eq!(pf_trait("ssd-a.0"), "PF_SSD_A_0");
    assert_eq!(pf_trait(&"x".repeat(100)).len(), 64);
}

#[test]
fn a_borrower_asking_for_a_pf_or_a_vf_that_is_not_there_is_told_what_is() {
    let names: Vec<String> = ["ssd-vf0", "ssd-vf1", "fpga0", "disk"]
        .map(String::from)
        .to_vec();
    let hint = |n| unknown_device_hint(n, &names);
    assert_eq!(
        hint("ssd").as_deref(),
        Some("\"ssd\" is an SR-IOV physical function, which the lender keeps; borrow one of its VFs, ssd-vf0 to ssd-vf1")
    );
    assert_eq!(
        hint("ssd-vf2").as_deref(),
        Some("\"ssd\" has VFs ssd-vf0 to ssd-vf1 only")
    );
    assert!(hint("fpga0-vf0").is_some_and(|h| h.contains("lent whole and has no VFs")));
    assert_eq!(hint("other"), None);
    assert_eq!(hint("other-vf0"), None);
    assert_eq!(hint("ssd-vfx"), None);
}

#[test]
fn a_pf_spec_built_in_code_with_no_vfs_is_refused_not_divided_by() {
    let dir = tempfile::tempdir().unwrap();
    let sys = sysfs(dir.path(), 2, "nvme", "0x010802");
    let ctrl = nvme_ctrl(2);
    let opener = move |_: &Sysfs, _: &str| Ok(Box::new(Fake(Rc::clone(&ctrl))) as Box<dyn Admin>);
    let msg = expand(&pf_spec(0, vec![]), Mode::Start, &sys, &opener)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("vfs = 0"), "{msg}");
}

/// Limits on a PF whose VFs would be mirrored (a NIC, or `coherence=mirror`) are
/// refused before the VFs are enabled: a trial found the VFs enabled, then every
/// borrower refused. An NVMe PF's limits become its VFs' store.
#[test]
fn limits_on_a_mirrored_pf_are_refused_before_anything_changes() {
    use devlend_fabric::qos::{Lane, Qos};
    let dir = tempfile::tempdir().unwrap();
    let sys = sysfs(dir.path(), 2, "igb", "0x020000");
    let no_admin = |_: &Sysfs, _: &str| -> Result<Box<dyn Admin>, SriovError> {
        panic!("an igb PF has no admin queue")
    };
    let mut specs = pf_spec(2, vec![]);
    let KindSpec::PciPf(p) = &mut specs[0].kind else {
        unreachable!()
    };
    p.qos = Qos::default().with(Lane::IopsRead, 100, 0);
    let e = expand(&specs, Mode::Start, &sys, &no_admin).unwrap_err();
    let msg = devlend_fabric::error::chain(&e);
    assert!(msg.contains("coherence mirror"), "{msg}");
    let numvfs = dir.path().join("devices").join(PF).join("sriov_numvfs");
    assert_eq!(std::fs::read_to_string(numvfs).unwrap(), "0\n");
    assert_eq!(
        super::pf_store(&specs[0]).map(|s| s.name),
        Some("pf:ssd".to_string())
    );
}
