//! Live attach and detach into a running QEMU through QMP.
//!
//! Attach: `chardev-add` (a unix socket client of the attachment's vhost-user socket),
//! then `device_add vhost-user-blk-pci` on a free hotplug-capable PCIe root port; for a
//! lent NIC, `netdev_add` (type `vhost-user` on that chardev) and `device_add
//! virtio-net-pci`. Detach: `device_del`, wait for the guest to release the device
//! (`DEVICE_DELETED`), then `netdev_del` (a NIC) and `chardev-remove`. Each failure
//! undoes what the operation had done, so no half-made state is left in QEMU. A NIC's
//! guest-visible link follows the lender with `set_link` ([`set_link`]).

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use super::qmp::{Qmp, QmpError};

/// A hotplug failure, with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum HotplugError {
    /// QMP failed (unreachable socket, a command error, a timeout).
    #[error(transparent)]
    Qmp(#[from] QmpError),
    /// The device or chardev id is taken in that VM.
    #[error("id {0:?} is already in use in the VM (pick another with --id)")]
    IdInUse(String),
    /// Every hotplug-capable port is occupied.
    #[error("the VM has no free hotplug-capable PCIe root port (start QEMU with -device pcie-root-port,id=rpN,slot=N,chassis=N)")]
    NoFreePort,
    /// The guest did not release the device in time.
    #[error("the guest did not release device {id:?} within {timeout:?}; it stays attached (retry detach later)")]
    NotReleased {
        /// Device id.
        id: String,
        /// How long was waited.
        timeout: Duration,
    },
}

/// The chardev id devlend uses for device `id`.
pub fn chardev_id(id: &str) -> String {
    format!("devlend-{id}")
}

/// How often QEMU retries a lost vhost-user socket, in milliseconds (chardev
/// `reconnect-ms`, QEMU 9.2 and later).
pub const RECONNECT_MS: u64 = 1000;

/// The netdev id devlend uses for NIC device `id`.
pub fn netdev_id(id: &str) -> String {
    format!("devlend-net-{id}")
}

/// What to plug.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlugKind {
    /// A `vhost-user-blk-pci` disk with `num_queues` virtqueues of `queue_size`
    /// descriptors.
    Blk {
        /// Virtqueues.
        num_queues: u16,
        /// Descriptors per virtqueue.
        queue_size: u16,
        /// The lender refuses writes (the backend offers `VIRTIO_BLK_F_RO` to QEMU;
        /// Cloud Hypervisor is told `readonly`).
        read_only: bool,
    },
    /// A `virtio-net-pci` NIC on a `vhost-user` netdev with `pairs` queue pairs
    /// (`mq=on` and 2 × pairs + 2 MSI-X vectors when more than one).
    Net {
        /// Queue pairs.
        pairs: u16,
        /// The guest's MAC address, `aa:bb:cc:dd:ee:ff`.
        mac: String,
        /// The MTU the guest is given (`host_mtu`), in bytes; 1500 leaves QEMU's default.
        mtu: u32,
    },
}

/// Ids of the devices of the VM (`qom-list /machine/peripheral`).
fn device_ids(q: &mut Qmp) -> Result<Vec<String>, QmpError> {
    let r = q.execute("qom-list", json!({ "path": "/machine/peripheral" }))?;
    Ok(r.as_array()
        .into_iter()
        .flatten()
        .filter(|p| {
            p.get("type")
                .and_then(Value::as_str)
                .is_some_and(|t| t.starts_with("child<"))
        })
        .filter_map(|p| p.get("name").and_then(Value::as_str).map(str::to_owned))
        .collect())
}

fn chardev_ids(q: &mut Qmp) -> Result<Vec<String>, QmpError> {
    let r = q.execute("query-chardev", json!({}))?;
    Ok(r.as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("label").and_then(Value::as_str).map(str::to_owned))
        .collect())
}

/// The qdev id of a PCIe root port (or other hotplug-capable bridge) with nothing on its
/// secondary bus, from `query-pci`.
pub fn free_port(q: &mut Qmp) -> Result<Option<String>, QmpError> {
    let r = q.execute("query-pci", json!({}))?;
    let mut free = Vec::new();
    fn walk(devices: &[Value], free: &mut Vec<String>) {
        for d in devices {
            let Some(bridge) = d.get("pci_bridge") else {
                continue;
            };
            let children = bridge
                .get("devices")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let id = d.get("qdev_id").and_then(Value::as_str).unwrap_or("");
            let is_root_port = d
                .get("class_info")
                .and_then(|c| c.get("class"))
                .and_then(Value::as_u64)
                == Some(0x0604);
            if children.is_empty() && is_root_port && !id.is_empty() {
                free.push(id.to_owned());
            }
            walk(&children, free);
        }
    }
    for bus in r.as_array().into_iter().flatten() {
        if let Some(devs) = bus.get("devices").and_then(Value::as_array) {
            walk(devs, &mut free);
        }
    }
    free.sort();
    Ok(free.into_iter().next())
}

/// Where a device was plugged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plugged {
    /// QEMU device id.
    pub device_id: String,
    /// Chardev id.
    pub chardev_id: String,
    /// Root port id it sits on.
    pub port: String,
}

/// Plugs a device of `kind` joined to `socket` into the VM behind `qmp`.
///
/// # Errors
/// [`HotplugError`]; on error nothing is left plugged.
pub fn plug(qmp: &Path, id: &str, socket: &Path, kind: &PlugKind) -> Result<Plugged, HotplugError> {
    let mut q = Qmp::connect(qmp)?;
    let chardev = chardev_id(id);
    if device_ids(&mut q)?.iter().any(|d| d == id) {
        return Err(HotplugError::IdInUse(id.to_owned()));
    }
    if chardev_ids(&mut q)?.contains(&chardev) {
        return Err(HotplugError::IdInUse(chardev));
    }
    let port = free_port(&mut q)?.ok_or(HotplugError::NoFreePort)?;
    q.execute(
        "chardev-add",
        json!({
            "id": chardev,
            "backend": { "type": "socket", "data": {
                "addr": { "type": "unix", "data": { "path": socket.display().to_string() } },
                "server": false,
                // QEMU joins the socket again if the compute agent restarts (the
                // attachment is restored from the state file on the same path).
                "reconnect-ms": RECONNECT_MS,
            }},
        }),
    )?;
    let added = match kind {
        PlugKind::Blk {
            num_queues,
            queue_size,
            ..
        } => q.execute(
            "device_add",
            json!({
                "driver": "vhost-user-blk-pci",
                "id": id,
                "chardev": chardev,
                "bus": port,
                "num-queues": num_queues,
                "queue-size": queue_size,
            }),
        ),
        PlugKind::Net { pairs, mac, mtu } => {
            // A taken netdev id fails netdev_add, and the chardev is removed below.
            let netdev = netdev_id(id);
            match q.execute(
                "netdev_add",
                json!({ "type": "vhost-user", "id": netdev, "chardev": chardev, "queues": pairs }),
            ) {
                Err(e) => Err(e),
                Ok(_) => {
                    let mut dev = json!({
                        "driver": "virtio-net-pci",
                        "id": id,
                        "netdev": netdev,
                        "bus": port,
                        "mac": mac,
                    });
                    if *pairs > 1 {
                        dev["mq"] = json!(true);
                        dev["vectors"] = json!(2 * u32::from(*pairs) + 2);
                    }
                    if *mtu != 1500 {
                        dev["host_mtu"] = json!(mtu);
                    }
                    let r = q.execute("device_add", dev);
                    if r.is_err() {
                        let _ = q.execute("netdev_del", json!({ "id": netdev }));
                    }
                    r
                }
            }
        }
    };
    if let Err(e) = added {
        let _ = q.execute("chardev-remove", json!({ "id": chardev }));
        return Err(e.into());
    }
    Ok(Plugged {
        device_id: id.to_owned(),
        chardev_id: chardev,
        port,
    })
}

/// Default time the guest gets to release a device on detach.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(30);

/// Unplugs device `id` and removes its chardev. A device already gone from the VM is
/// not an error, nor a VM that is gone (its QMP socket missing or refusing
/// connections).
///
/// # Errors
/// [`HotplugError::NotReleased`] when the guest keeps the device past `timeout` (it is
/// then still attached and the backend must keep serving it); QMP errors.
pub fn unplug(qmp: &Path, id: &str, timeout: Duration) -> Result<(), HotplugError> {
    let mut q = match Qmp::connect(qmp) {
        Ok(q) => q,
        // Nobody listens on the QMP socket (or it is gone): the VM has exited, and its
        // devices with it.
        Err(QmpError::Connect { source, .. })
            if matches!(
                source.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            tracing::info!(id, qmp = %qmp.display(), "the VM is gone; nothing to unplug");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let present = device_ids(&mut q)?.iter().any(|d| d == id);
    if present {
        match q.execute("device_del", json!({ "id": id })) {
            Ok(_) => {}
            Err(QmpError::Command { class, .. }) if class == "DeviceNotFound" => {}
            Err(e) => return Err(e.into()),
        }
        let wanted = id.to_owned();
        match q.wait_event("DEVICE_DELETED", timeout, |d| {
            d.get("device").and_then(Value::as_str) == Some(wanted.as_str())
        }) {
            Ok(_) => {}
            Err(QmpError::Timeout { .. }) => {
                return Err(HotplugError::NotReleased {
                    id: id.to_owned(),
                    timeout,
                })
            }
            Err(e) => return Err(e.into()),
        }
    }
    // A NIC's netdev (absent for a disk: QEMU answers that it is not found).
    match q.execute("netdev_del", json!({ "id": netdev_id(id) })) {
        Ok(_) | Err(QmpError::Command { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    let chardev = chardev_id(id);
    if chardev_ids(&mut q)?.contains(&chardev) {
        q.execute("chardev-remove", json!({ "id": chardev }))?;
    }
    Ok(())
}

/// Sets the guest-visible link of NIC device `id` up or down (QMP `set_link`): the
/// guest's driver sees the carrier change (virtio-net's `VIRTIO_NET_S_LINK_UP` and a
/// config interrupt).
///
/// # Errors
/// QMP errors (the VM gone, no such device).
pub fn set_link(qmp: &Path, id: &str, up: bool) -> Result<(), HotplugError> {
    let mut q = Qmp::connect(qmp)?;
    q.execute("set_link", json!({ "name": id, "up": up }))?;
    Ok(())
}
