//! A queue pair's packet socket on the lent interface: `AF_PACKET`, non-blocking,
//! bound to the interface, promiscuous, `PACKET_VNET_HDR`, `PACKET_IGNORE_OUTGOING`
//! where the kernel has it, in the interface's fanout group, 4 MiB buffers.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;

use super::Nic;

/// `PACKET_IGNORE_OUTGOING` (Linux 4.20): not in every libc.
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;
/// `PACKET_VNET_HDR`: each frame on the packet socket comes after a `virtio_net_hdr`.
const PACKET_VNET_HDR: libc::c_int = 15;

impl Nic {
    /// Opens a packet socket on the interface (its index as last looked up).
    ///
    /// # Errors
    /// The socket calls' (e.g. EPERM without `CAP_NET_RAW`).
    pub(crate) fn open_socket(&self) -> io::Result<OwnedFd> {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain system call; the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                libc::c_int::from(proto),
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // Frames the lender's own host sends (a veth or TAP end in the same host: a
        // peer in a namespace, a local bridge) may come with their checksum not done
        // (checksum offload); the header says so and where, and it is done here. Sent
        // frames take an all-zero header: complete as they are.
        setsockopt(fd.as_raw_fd(), libc::SOL_PACKET, PACKET_VNET_HDR, &1i32)?;
        // SAFETY: sockaddr_ll is plain old data; all-zero is a valid value.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = self.ifindex.load(Ordering::Relaxed);
        // SAFETY: `sll` is a live sockaddr_ll of the length given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: packet_mreq is plain old data; all-zero is a valid value.
        let mut mreq: libc::packet_mreq = unsafe { std::mem::zeroed() };
        mreq.mr_ifindex = self.ifindex.load(Ordering::Relaxed);
        mreq.mr_type = libc::PACKET_MR_PROMISC as u16;
        setsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_ADD_MEMBERSHIP,
            &mreq,
        )?;
        if let Err(e) = setsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            PACKET_IGNORE_OUTGOING,
            &1i32,
        ) {
            tracing::debug!(error = %e, "PACKET_IGNORE_OUTGOING unsupported; outgoing frames are skipped one by one");
        }
        let fanout = u32::from(self.fanout_id) | (libc::PACKET_FANOUT_HASH << 16);
        setsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_FANOUT,
            &fanout,
        )?;
        for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
            let _ = setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, opt, &(4i32 << 20));
        }
        Ok(fd)
    }
}

fn setsockopt<T>(fd: RawFd, level: libc::c_int, name: libc::c_int, v: &T) -> io::Result<()> {
    // SAFETY: `v` points to a live value of the size given, as the option expects.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
