//! The NVMe admin commands a primary controller (the PF) takes to give its secondary
//! controllers (the VFs) queues and interrupts and bring them online, and to attach
//! namespaces to them: NVMe Base 2.0 §5.22 (Virtualization Management), §5.20
//! (Namespace Attachment), §5.17.2.14-15 (Identify CNS 14h and 15h). They go to the
//! PF's kernel driver through its admin passthrough ioctl (what `nvme virt-mgmt` and
//! `nvme attach-ns` send), so the PF stays the kernel's and no admin queue is shared.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Identify (admin 06h).
const OPC_IDENTIFY: u8 = 0x06;
/// Namespace Attachment (admin 15h).
const OPC_NS_ATTACH: u8 = 0x15;
/// Virtualization Management (admin 1Ch).
const OPC_VIRT_MGMT: u8 = 0x1c;
/// Identify CNS 14h: Primary Controller Capabilities.
const CNS_PRIMARY_CAPS: u32 = 0x14;
/// Identify CNS 15h: Secondary Controller List.
const CNS_SECONDARY_LIST: u32 = 0x15;
/// Status of a Namespace Attachment that names a controller the namespace is already
/// attached to (SCT 1h, SC 18h), as the kernel's ioctl returns it (SCT << 8 | SC).
pub(crate) const STATUS_NS_ALREADY_ATTACHED: u16 = 0x118;

/// Resource types of Virtualization Management (CDW10 bits 10:8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resource {
    /// Virtual queue resources (a VF's admin queue counts as one).
    Queues = 0,
    /// Virtual interrupt resources (MSI-X vectors).
    Interrupts = 1,
}

/// One admin command as the passthrough ioctl takes it (no metadata).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct AdminCommand {
    /// The opcode.
    pub(crate) opcode: u8,
    /// The namespace ID (CDW1).
    pub(crate) nsid: u32,
    /// CDW10.
    pub(crate) cdw10: u32,
    /// CDW11.
    pub(crate) cdw11: u32,
}

impl AdminCommand {
    /// Identify Primary Controller Capabilities (4096 bytes of data).
    pub(crate) fn identify_primary() -> AdminCommand {
        AdminCommand {
            opcode: OPC_IDENTIFY,
            cdw10: CNS_PRIMARY_CAPS,
            ..Default::default()
        }
    }

    /// Identify Secondary Controller List, from controller ID 0 (4096 bytes).
    pub(crate) fn identify_secondaries() -> AdminCommand {
        AdminCommand {
            opcode: OPC_IDENTIFY,
            cdw10: CNS_SECONDARY_LIST,
            ..Default::default()
        }
    }

    /// Virtualization Management: `action` (1h primary flexible allocation, 7h
    /// secondary offline, 8h secondary assign, 9h secondary online) on controller
    /// `cntlid`, `count` resources of type `rt`.
    pub(crate) fn virt_mgmt(action: u8, rt: Resource, cntlid: u16, count: u16) -> AdminCommand {
        AdminCommand {
            opcode: OPC_VIRT_MGMT,
            cdw10: u32::from(action & 0xf) | (rt as u32) << 8 | u32::from(cntlid) << 16,
            cdw11: u32::from(count),
            ..Default::default()
        }
    }

    /// Namespace Attachment, select 0h (attach) of `nsid`; the data is
    /// [`controller_list`].
    pub(crate) fn attach(nsid: u32) -> AdminCommand {
        AdminCommand {
            opcode: OPC_NS_ATTACH,
            nsid,
            ..Default::default()
        }
    }
}

/// Virtualization Management actions (NVMe Base 2.0 Figure 390).
pub(crate) const ACT_PRIMARY_FLEXIBLE: u8 = 0x1;
/// Secondary Assign.
pub(crate) const ACT_SECONDARY_ASSIGN: u8 = 0x8;
/// Secondary Online.
pub(crate) const ACT_SECONDARY_ONLINE: u8 = 0x9;

/// A Controller List (Figure 134) of one controller: the data of a Namespace
/// Attachment.
pub(crate) fn controller_list(cntlid: u16) -> Vec<u8> {
    let mut d = vec![0u8; 4096];
    d[0..2].copy_from_slice(&1u16.to_le_bytes());
    d[2..4].copy_from_slice(&cntlid.to_le_bytes());
    d
}

/// Why an admin command failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The controller completed it with this status (SCT << 8 | SC).
    #[error("NVMe status {0:#05x}")]
    Status(u16),
    /// The ioctl failed.
    #[error("admin passthrough ioctl")]
    Io(#[source] io::Error),
}

/// Something that runs admin commands on the PF: its kernel driver's character device,
/// or a fake in tests.
pub(crate) trait Admin {
    /// Runs `cmd` with `data` as its buffer (the opcode's low bits say which way the
    /// data goes); returns the completion's DW0.
    fn run(&mut self, cmd: &AdminCommand, data: &mut [u8]) -> Result<u32, AdminError>;
}

/// `struct nvme_passthru_cmd` of `<linux/nvme_ioctl.h>`.
#[repr(C)]
#[derive(Default)]
struct PassthruCmd {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    result: u32,
}

/// `NVME_IOCTL_ADMIN_CMD`: `_IOWR('N', 0x41, struct nvme_admin_cmd)`, 72 bytes.
const NVME_IOCTL_ADMIN_CMD: libc::c_ulong = 0xC048_4E41;

/// The PF's admin queue through its kernel driver's `/dev/nvmeN`.
pub(crate) struct CharDev(File);

impl CharDev {
    /// Opens `path` (`/dev/nvmeN`) read-write.
    pub(crate) fn open(path: &Path) -> io::Result<CharDev> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map(CharDev)
    }
}

impl Admin for CharDev {
    fn run(&mut self, cmd: &AdminCommand, data: &mut [u8]) -> Result<u32, AdminError> {
        let len = u32::try_from(data.len())
            .map_err(|_| AdminError::Io(io::Error::from(io::ErrorKind::InvalidInput)))?;
        let mut c = PassthruCmd {
            opcode: cmd.opcode,
            nsid: cmd.nsid,
            addr: if data.is_empty() {
                0
            } else {
                data.as_mut_ptr() as u64
            },
            data_len: len,
            cdw10: cmd.cdw10,
            cdw11: cmd.cdw11,
            timeout_ms: 10_000,
            ..Default::default()
        };
        // SAFETY: `c` is a valid `nvme_passthru_cmd` that lives across the call; its
        // `addr` and `data_len` name `data`, which is borrowed mutably for the call, so
        // the kernel may read or write all of it and nothing else.
        let r = unsafe {
            libc::ioctl(
                self.0.as_raw_fd(),
                NVME_IOCTL_ADMIN_CMD as _,
                &mut c as *mut PassthruCmd,
            )
        };
        match r {
            0 => Ok(c.result),
            r if r > 0 => Err(AdminError::Status((r & 0x7ff) as u16)),
            _ => Err(AdminError::Io(io::Error::last_os_error())),
        }
    }
}

/// The flexible resources of a primary controller (Figure 312), per type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Flexible {
    /// Total flexible resources (VQFRT / VIFRT).
    pub(crate) total: u32,
    /// Assigned to secondary controllers (VQRFA / VIRFA).
    pub(crate) assigned: u32,
    /// Allocated to the primary (VQRFAP / VIRFAP).
    pub(crate) primary: u16,
    /// The most one secondary controller may have (VQFRSM / VIFRSM).
    pub(crate) per_secondary: u16,
    /// The granularity of assignments (VQGRAN / VIGRAN); 0 means 1.
    pub(crate) granularity: u16,
}

/// Primary Controller Capabilities, the fields the lender uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PrimaryCaps {
    /// The PF's controller ID.
    pub(crate) cntlid: u16,
    /// Queue resources.
    pub(crate) queues: Flexible,
    /// Interrupt resources.
    pub(crate) interrupts: Flexible,
}

fn u16_at(d: &[u8], at: usize) -> u16 {
    d.get(at..at + 2)
        .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]))
}

fn u32_at(d: &[u8], at: usize) -> u32 {
    d.get(at..at + 4)
        .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

impl PrimaryCaps {
    /// Parses the 4096 bytes of Identify CNS 14h.
    pub(crate) fn parse(d: &[u8]) -> PrimaryCaps {
        let flexible = |at: usize| Flexible {
            total: u32_at(d, at),
            assigned: u32_at(d, at + 4),
            primary: u16_at(d, at + 8),
            per_secondary: u16_at(d, at + 12),
            granularity: u16_at(d, at + 14),
        };
        PrimaryCaps {
            cntlid: u16_at(d, 0),
            queues: flexible(32),
            interrupts: flexible(64),
        }
    }
}

/// One entry of the Secondary Controller List (Figure 314).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Secondary {
    /// Its controller ID.
    pub(crate) cntlid: u16,
    /// Online (SCS bit 0).
    pub(crate) online: bool,
    /// The VF it is (1 for the first VF; 0 for none).
    pub(crate) vf_number: u16,
    /// Queue resources assigned.
    pub(crate) queues: u16,
    /// Interrupt resources assigned.
    pub(crate) interrupts: u16,
}

/// Parses the 4096 bytes of Identify CNS 15h (at most 127 entries).
pub(crate) fn parse_secondaries(d: &[u8]) -> Vec<Secondary> {
    let n = usize::from(d.first().copied().unwrap_or(0)).min(127);
    (0..n)
        .map(|i| 32 + 32 * i)
        .map(|at| Secondary {
            cntlid: u16_at(d, at),
            online: d.get(at + 4).is_some_and(|s| s & 1 == 1),
            vf_number: u16_at(d, at + 8),
            queues: u16_at(d, at + 10),
            interrupts: u16_at(d, at + 12),
        })
        .collect()
}
