//! `devlend attach`: a device named on the command line (direct mode) or one the pool
//! places and leases, attached through the compute agent; then what to give the VMM.

use std::path::Path;

use anyhow::{bail, Result};
use devlend_cli::api_client::ApiClient;
use devlend_cli::output::{human_bytes, libvirt_xml, nic_link_words, qemu_args};
use devlend_cli::placement;
use devlend_compute_agent::api::{AttachRequest, KindInfo, Transport, VmmTarget};
use devlend_compute_agent::vmm::cloud_hypervisor;

use crate::args::{AttachArgs, CliKind, Vmm};
use crate::{absolute, print_json};

/// Runs `devlend attach` against the compute agent behind the control socket `api`.
pub(crate) fn run(api: &Path, args: AttachArgs) -> Result<()> {
    let AttachArgs {
        lender,
        device,
        class,
        min_capacity,
        traits,
        numa_node,
        vm,
        lease_ttl,
        limits,
        pool,
        pool_key,
        pool_ca,
        socket,
        queues,
        queue_size,
        poll_us,
        reconnect_deadline_s,
        tls,
        tls_server_name,
        lender_key,
        transport,
        rdma_exposure,
        id,
        kind,
        qmp,
        ch_api,
        vmm,
        libvirt_dev,
        json,
    } = args;
    let socket = if socket.is_absolute() {
        socket
    } else {
        std::env::current_dir()?.join(socket)
    };
    if class.is_none() && limits.to_qos()?.is_some() {
        bail!(
            "--max-iops, --max-bps, --weight and --qos are a lease's limits: they need --class (a pool lease); in direct mode the lender sets limits on its device (docs/qos.md)"
        );
    }
    // Checked before a lease is taken.
    if !rdma_exposure.is_request() && transport != Transport::Rdma {
        bail!("--rdma-exposure guest-memory applies to --transport rdma only");
    }
    let pci_vm = pci_vm(vm.as_deref(), kind, class.is_some())?;
    let api = ApiClient::new(api)?;
    let mut lender = lender.into_iter();
    let (first, paths) = (lender.next(), lender.collect::<Vec<_>>());
    let (lender, device, claimed) = match (first, device, class) {
        (Some(l), Some(d), _) => (l, d, None),
        (None, Some(d), None) if d.contains('/') => (String::new(), d, None),
        (None, Some(_), None) => {
            bail!("--device without --lender must be a device address CLUSTER/LENDER/DEVICE")
        }
        (_, _, Some(class)) => {
            if !(1..=86_400).contains(&lease_ttl) {
                bail!("--lease-ttl {lease_ttl} must be 1..=86400 seconds");
            }
            if !(1..=16).contains(&queues) || reconnect_deadline_s > 3600 {
                bail!("--queues must be 1..=16 and --reconnect-deadline at most 3600 s");
            }
            let key = devlend_cli::pool_auth::PoolKey {
                file: pool_key,
                ca: pool_ca,
            };
            let client = key.client(
                &pool,
                std::path::Path::new(devlend_cli::pool_auth::COMPUTE_KEY_FILE),
            )?;
            let c = placement::claim(
                client,
                &placement::Wanted {
                    class,
                    min_capacity_bytes: min_capacity,
                    traits,
                    numa_node,
                    vm: vm.unwrap_or_default(),
                    ttl_ms: lease_ttl.saturating_mul(1000),
                    qos: limits.to_qos()?,
                },
            )?;
            if !json {
                println!(
                    "leased {} on {} ({}), lease {}",
                    c.grant.lease.device,
                    c.grant.lease.provider,
                    c.grant.lease.fabric_address,
                    c.grant.lease.id
                );
            }
            (
                c.grant.lease.fabric_address.clone(),
                c.grant.lease.device.clone(),
                Some(c),
            )
        }
        _ => bail!("give --lender and --device, or --class and --vm"),
    };
    let lease = claimed.as_ref().map(|c| c.lease.clone());
    let attached = api.attach(&AttachRequest {
        id,
        lender,
        paths,
        device,
        socket,
        queues,
        queue_size,
        poll_us,
        reconnect_deadline_s,
        vmm: match (qmp, ch_api) {
            (Some(qmp), _) => Some(VmmTarget::Qemu {
                qmp: absolute(qmp)?,
            }),
            (None, Some(api)) => Some(VmmTarget::CloudHypervisor {
                api: absolute(api)?,
            }),
            (None, None) => None,
        },
        lease,
        lender_key,
        tls,
        tls_server_name,
        transport,
        rdma_exposure,
        kind: match kind {
            CliKind::Device => devlend_compute_agent::api::AttachKind::Device,
            CliKind::Pci => devlend_compute_agent::api::AttachKind::Pci,
        },
        vm: pci_vm,
        handover_token: None,
    });
    let a = match attached {
        Ok(a) => a,
        Err(e) => {
            if let Some(c) = claimed {
                c.release();
            }
            return Err(e);
        }
    };
    if json {
        return print_json(&a);
    }
    match &a.part {
        KindInfo::Pci(p) => {
            println!(
                "attached PCIe function {} ({}) as {}{}",
                a.device,
                if p.bdf.is_empty() {
                    "-"
                } else {
                    p.bdf.as_str()
                },
                a.id,
                p.vm.as_ref().map_or(String::new(), |vm| format!(
                    ", VM {vm} (peer-to-peer with its other PCIe functions)"
                ))
            );
            println!("vfio-user socket: {}\n", a.socket.display());
            println!("{}", devlend_cli::output::vfio_user_args(&a));
            return Ok(());
        }
        KindInfo::Nic(n) => {
            println!(
                "attached NIC {} as {}: MAC {}, MTU {}, {} queue pair(s), {}",
                a.device,
                a.id,
                n.mac,
                n.mtu,
                n.queue_pairs,
                nic_link_words(n, a.connected)
            );
        }
        KindInfo::Block(b) => {
            println!(
                "attached {} as {}: {} ({} sectors of 512 bytes), serial {:?}{}",
                a.device,
                a.id,
                human_bytes(b.capacity_sectors * 512),
                b.capacity_sectors,
                b.serial,
                if b.read_only { ", read-only" } else { "" }
            );
        }
    }
    println!("vhost-user socket: {}", a.socket.display());
    if let Some(p) = &a.vmm {
        println!(
            "plugged into the running VM as device {:?} at {}",
            p.device_id, p.location
        );
        return Ok(());
    }
    println!();
    match (vmm, &a.part) {
        (Vmm::Qemu, _) => {
            println!("QEMU:\n  {}\n", qemu_args(&a));
            println!("libvirt:\n{}", libvirt_xml(&a, &libvirt_dev));
        }
        (Vmm::CloudHypervisor, KindInfo::Nic(n)) => {
            println!(
                "Cloud Hypervisor:\n  --memory size=<guest RAM>,shared=on --net vhost_user=true,socket={},num_queues={},queue_size={},mac={}",
                a.socket.display(),
                2 * u32::from(n.queue_pairs),
                n.queue_size,
                n.mac
            );
        }
        (Vmm::CloudHypervisor, KindInfo::Block(b)) => {
            let arg =
                cloud_hypervisor::cli_arg(&a.socket, &a.id, b.queues, b.queue_size, b.read_only);
            println!("Cloud Hypervisor:\n  --memory size=<guest RAM>,shared=on {arg}");
        }
        // Printed above, with the vfio-user arguments.
        (Vmm::CloudHypervisor, KindInfo::Pci(_)) => {}
    }
    Ok(())
}

/// The request's `vm` for `--vm`: a PCIe function's VM (`--kind pci`), checked here so
/// that a bad name fails before a lease is taken; `None` for other kinds. Without
/// `--class` (where `--vm` is the lease's consumer), `--vm` needs `--kind pci`.
fn pci_vm(vm: Option<&str>, kind: CliKind, leased: bool) -> Result<Option<String>> {
    let Some(vm) = vm else {
        return Ok(None);
    };
    if kind != CliKind::Pci {
        if leased {
            return Ok(None);
        }
        bail!(
            "--vm names the VM a PCIe function is lent to (peer-to-peer between its functions): it needs --kind pci (or, with --class, names the lease's consumer)"
        );
    }
    if !devlend_compute_agent::api::valid_vm_name(vm) {
        bail!(
            "--vm {vm:?}: a VM name is 1..={} letters, digits, '.', '_' or '-'",
            devlend_compute_agent::api::MAX_VM_NAME
        );
    }
    Ok(Some(vm.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_goes_with_a_pci_function_and_is_refused_for_a_device_without_class() {
        assert_eq!(pci_vm(None, CliKind::Device, false).unwrap(), None);
        assert_eq!(
            pci_vm(Some("vm-1"), CliKind::Pci, false)
                .unwrap()
                .as_deref(),
            Some("vm-1")
        );
        assert_eq!(
            pci_vm(Some("vm-1"), CliKind::Pci, true).unwrap().as_deref(),
            Some("vm-1"),
            "a leased PCIe function joins its consumer VM's group"
        );
        // With --class, --vm is the lease's consumer only for a device.
        assert_eq!(pci_vm(Some("vm-1"), CliKind::Device, true).unwrap(), None);
        let e = pci_vm(Some("vm-1"), CliKind::Device, false).unwrap_err();
        assert!(e.to_string().contains("--kind pci"), "{e}");
        let e = pci_vm(Some("vm 1"), CliKind::Pci, false).unwrap_err();
        assert!(e.to_string().contains("1..=64"), "{e}");
    }
}
