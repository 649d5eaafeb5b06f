//! Lending a network interface: frames moved between a fabric session and the interface
//! through an AF_PACKET socket (promiscuous, batched with `recvmmsg`/`sendmmsg`).
//!
//! - here: the interface ([`Nic`]: found by name, its MAC, link state and MTU) and its
//!   counters;
//! - [`socket`]: a queue pair's packet socket;
//! - [`pump`]: a queue-pair session, frames both ways;
//! - [`rx`]: frames received from the interface, their offload headers and checksums.
//!
//! Each queue-pair session of the borrower opens its own packet socket; the sockets of
//! one interface form a `PACKET_FANOUT_HASH` group, so that each flow is received by one
//! session (one guest queue pair) and no frame twice. The holding session (queue
//! `0xffff`) carries nothing and opens no socket. Frames the lender's own host sends on
//! the interface are not captured (`PACKET_IGNORE_OUTGOING`, and `PACKET_OUTGOING`
//! frames are skipped where that option is missing).

pub(crate) mod pump;
mod rx;
mod socket;

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use devlend_fabric::net::LinkState;

use crate::session::open::{Opened, Opening, Refused, TcpSession};
use crate::Error;

/// Frames received or sent per system call.
const BATCH: usize = 32;
/// Size of the packet socket's `virtio_net_hdr` (without `num_buffers`).
const VNET_HDR_LEN: usize = 10;

/// Counters of a lent interface, shared by its sessions.
#[derive(Debug, Default)]
pub(crate) struct NicStats {
    /// Frames received on the interface and sent to the borrower.
    pub(crate) rx_packets: AtomicU64,
    /// Their bytes.
    pub(crate) rx_bytes: AtomicU64,
    /// Frames from the borrower sent on the interface.
    pub(crate) tx_packets: AtomicU64,
    /// Their bytes.
    pub(crate) tx_bytes: AtomicU64,
    /// Frames dropped: the borrower did not keep up, a frame larger than the receive
    /// buffer (e.g. GRO on the interface), or the interface refused to send one.
    pub(crate) drops: AtomicU64,
}

impl NicStats {
    /// The counters now.
    pub(crate) fn snapshot(&self) -> crate::kind_view::NicCounters {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        crate::kind_view::NicCounters {
            rx_packets: get(&self.rx_packets),
            rx_bytes: get(&self.rx_bytes),
            tx_packets: get(&self.tx_packets),
            tx_bytes: get(&self.tx_bytes),
            drops: get(&self.drops),
        }
    }
}

/// A network interface to lend.
#[derive(Debug)]
pub(crate) struct Nic {
    /// The interface name.
    pub(crate) ifname: String,
    /// The interface's index, looked up again when the interface is replaced (deleted
    /// and created again under the same name).
    pub(crate) ifindex: std::sync::atomic::AtomicI32,
    /// The MAC address the guest should use (configured, else the interface's).
    pub(crate) mac: [u8; 6],
    pub(crate) fanout_id: u16,
    /// The counters.
    pub(crate) stats: NicStats,
}

fn ifreq(ifname: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(ifname.bytes().take(15)) {
        *d = s as libc::c_char;
    }
    req
}

/// Runs one `SIOCGIF*` ioctl on a throwaway datagram socket.
fn if_ioctl(ifname: &str, request: libc::Ioctl) -> io::Result<libc::ifreq> {
    // SAFETY: plain system call; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = ifreq(ifname);
    // SAFETY: the request writes into the live `req` (an ifreq, as the SIOCGIF* requests
    // expect); the fd is open for the call.
    if unsafe { libc::ioctl(fd.as_raw_fd(), request, &mut req as *mut libc::ifreq) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(req)
}

impl Nic {
    /// The interface's index now, looked up by name again (and recorded, for the
    /// packet sockets opened next): another one than a socket was bound to means the
    /// interface was deleted and created again, and that socket carries nothing any
    /// more. The last known index while the name does not resolve.
    pub(crate) fn refresh_ifindex(&self) -> i32 {
        let known = self.ifindex.load(Ordering::Relaxed);
        let Ok(c) = std::ffi::CString::new(self.ifname.as_str()) else {
            return known;
        };
        // SAFETY: `c` is a NUL-terminated string alive for the call.
        let now = unsafe { libc::if_nametoindex(c.as_ptr()) } as i32;
        if now == 0 {
            return known;
        }
        self.ifindex.store(now, Ordering::Relaxed);
        now
    }

    /// Finds the interface and reads its MAC address.
    ///
    /// # Errors
    /// [`Error::Open`] naming the device and interface when it does not exist.
    pub(crate) fn open(name: &str, ifname: &str, mac: Option<[u8; 6]>) -> Result<Nic, Error> {
        let err = |source| Error::Open {
            device: name.to_owned(),
            path: format!("net:{ifname}").into(),
            source,
        };
        let c = std::ffi::CString::new(ifname)
            .map_err(|_| err(io::Error::from(io::ErrorKind::InvalidInput)))?;
        // SAFETY: `c` is a NUL-terminated string alive for the call.
        let ifindex = unsafe { libc::if_nametoindex(c.as_ptr()) };
        if ifindex == 0 {
            return Err(err(io::Error::last_os_error()));
        }
        let own = if_ioctl(ifname, libc::SIOCGIFHWADDR).map_err(err)?;
        // SAFETY: SIOCGIFHWADDR filled the `ifru_hwaddr` member of the union.
        let hw = unsafe { own.ifr_ifru.ifru_hwaddr };
        let mut own_mac = [0u8; 6];
        for (d, s) in own_mac.iter_mut().zip(hw.sa_data.iter()) {
            *d = *s as u8;
        }
        let nic = Nic {
            ifname: ifname.to_owned(),
            ifindex: std::sync::atomic::AtomicI32::new(ifindex as i32),
            mac: mac.unwrap_or(own_mac),
            fanout_id: (ifindex as u16) ^ (std::process::id() as u16).rotate_left(8),
            stats: NicStats::default(),
        };
        let link = nic.link();
        tracing::info!(device = %name, interface = %ifname, ifindex, mtu = link.mtu, up = link.up, "network interface ready");
        Ok(nic)
    }

    /// The interface's link state and MTU now (down with MTU 1500 if they cannot be read).
    pub(crate) fn link(&self) -> LinkState {
        let up = if_ioctl(&self.ifname, libc::SIOCGIFFLAGS)
            // SAFETY: SIOCGIFFLAGS filled the `ifru_flags` member of the union.
            .map(|r| unsafe { r.ifr_ifru.ifru_flags } as libc::c_int)
            .map(|f| f & libc::IFF_UP != 0 && f & libc::IFF_RUNNING != 0)
            .unwrap_or(false);
        let mtu = if_ioctl(&self.ifname, libc::SIOCGIFMTU)
            // SAFETY: SIOCGIFMTU filled the `ifru_mtu` member of the union.
            .map(|r| unsafe { r.ifr_ifru.ifru_mtu })
            .ok()
            .and_then(|m| u32::try_from(m).ok())
            .unwrap_or(1500);
        LinkState {
            up,
            mtu,
            mac: self.mac,
        }
    }
}

impl crate::kind::LentKind for Nic {
    fn device_info(&self) -> devlend_fabric::DeviceDescription {
        // The link as it is now (read at each handshake), and the offloads the packet
        // socket's vnet header provides.
        devlend_fabric::NicLink::new(
            &self.link(),
            devlend_fabric::handshake::description::NIC_OFFLOADS,
        )
        .into()
    }

    fn check_hello(&self, device: &str, hello: &devlend_fabric::Hello) -> Result<(), String> {
        if hello.features & devlend_fabric::pci::FEATURE_PCI != 0 {
            return Err(format!(
                "device {device:?} is a network interface, not a PCIe function: attach it without --kind pci"
            ));
        }
        if hello.features & devlend_fabric::net::FEATURE_NET == 0 {
            return Err(format!(
                "device {device:?} is a network interface, and this borrower does not speak frames"
            ));
        }
        Ok(())
    }

    /// The holding session (queue [`crate::holding::CONTROL_QUEUE`]) carries nothing;
    /// a queue pair moves frames. Offloads asked for are granted: the packet socket's
    /// vnet header has the kernel complete checksums and segment in software where the
    /// interface cannot.
    fn open_tcp<'a>(
        &'a self,
        at: &Opening<'a>,
    ) -> Result<Opened<Box<dyn TcpSession + 'a>>, Refused> {
        use devlend_fabric::net::{FEATURE_NET, FEATURE_NET_OFFLOAD};
        let offload = at.hello.features & FEATURE_NET_OFFLOAD;
        // Heartbeat messages are read (and dropped) on every queue-pair session.
        let heartbeat = at.hello.features & devlend_fabric::FEATURE_HEARTBEAT;
        let session: Box<dyn TcpSession + 'a> =
            if at.hello.queue_index == crate::holding::CONTROL_QUEUE {
                Box::new(crate::session::open::Holding)
            } else {
                Box::new(pump::QueuePair {
                    nic: self,
                    dev: at.dev,
                    queue: at.hello.queue_index,
                    offload: offload != 0,
                    frame_timeout: at.options.frame_timeout,
                    group: std::sync::Arc::clone(at.claim.group()),
                })
            };
        Ok(Opened {
            features: FEATURE_NET | offload | heartbeat,
            credit: None,
            session,
        })
    }

    #[cfg(feature = "rdma")]
    fn open_rdma<'a>(
        &'a self,
        at: &Opening<'a>,
        _conn: &devlend_fabric::rdma::verbs::Connection,
    ) -> Result<Opened<Box<dyn crate::session::open::RdmaSession + 'a>>, Refused> {
        Err(crate::session::open::tcp_only(at, "a network interface"))
    }

    fn resource_class(&self) -> String {
        "NIC".into()
    }

    /// A queue pair's new session (another path, after a silent cut) ends the old one:
    /// its packet socket would otherwise take half the pair's received frames into a
    /// dead connection until the lender's keepalive noticed.
    fn fences_earlier_sessions(&self) -> bool {
        true
    }

    fn view(&self) -> crate::kind_view::KindView {
        let link = self.link();
        crate::kind_view::KindView::Net {
            interface: self.ifname.clone(),
            mac: self.mac,
            mtu: link.mtu,
            link_up: link.up,
            frames: self.stats.snapshot(),
        }
    }
}
