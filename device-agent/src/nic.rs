//! Lending a network interface: frames moved between a fabric session and the interface
//! through an AF_PACKET socket (promiscuous, batched with `recvmmsg`/`sendmmsg`).
//!
//! Each queue-pair session of the borrower opens its own packet socket; the sockets of
//! one interface form a `PACKET_FANOUT_HASH` group, so that each flow is received by one
//! session (one guest queue pair) and no frame twice. The holding session (queue
//! `0xffff`) carries nothing and opens no socket. Frames the lender's own host sends on
//! the interface are not captured (`PACKET_IGNORE_OUTGOING`, and `PACKET_OUTGOING`
//! frames are skipped where that option is missing).
//!
//! Nothing here blocks on the borrower: the fabric socket is non-blocking, frames for
//! the borrower are queued up to [`OUT_LIMIT`] bytes and dropped (counted) beyond, and
//! the fabric socket is always read, so the borrower never waits on the lender either.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use devlend_fabric::conn::Stream;
use devlend_fabric::net::{self, LinkState, NetMessage};

use crate::engine::End;
use crate::Error;

/// Most bytes of frames queued for a borrower that does not keep up; frames beyond are
/// dropped and counted.
pub(crate) const OUT_LIMIT: usize = 4 << 20;
/// Frames received or sent per system call.
const BATCH: usize = 32;
/// How often the link state and MTU are read (and sent when they changed).
const LINK_POLL: Duration = Duration::from_millis(500);
/// `PACKET_IGNORE_OUTGOING` (Linux 4.20): not in every libc.
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;
/// `PACKET_VNET_HDR`: each frame on the packet socket comes after a `virtio_net_hdr`.
const PACKET_VNET_HDR: libc::c_int = 15;
/// Size of that header (without `num_buffers`).
const VNET_HDR_LEN: usize = 10;
/// `VIRTIO_NET_HDR_F_NEEDS_CSUM`: the frame's checksum is left to whoever sends it on.
const VNET_F_NEEDS_CSUM: u8 = 1;

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

/// A network interface to lend.
#[derive(Debug)]
pub(crate) struct Nic {
    /// The interface name.
    pub(crate) ifname: String,
    /// The interface's index, looked up again when the interface is replaced (deleted
    /// and created again under the same name).
    ifindex: std::sync::atomic::AtomicI32,
    /// The MAC address the guest should use (configured, else the interface's).
    pub(crate) mac: [u8; 6],
    fanout_id: u16,
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

    fn open_socket(&self) -> io::Result<OwnedFd> {
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

/// Serves the holding session of a NIC: it carries nothing; returns when it closes.
pub(crate) fn hold(sock: &Stream) -> End {
    let mut b = [0u8; 64];
    loop {
        match (&mut &*sock).read(&mut b) {
            Ok(0) => return End::PeerClosed,
            Ok(_) => return End::Protocol("data on a holding session".into()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return End::Socket(e),
        }
    }
}

/// Serves one queue-pair session of a lent interface until the borrower closes it or
/// breaks the protocol; the interface's counters are logged as it ends.
pub(crate) fn serve(
    nic: &Nic,
    sock: &Stream,
    peer: SocketAddr,
    queue: u16,
    offload: bool,
    frame_timeout: Duration,
) -> End {
    let end = pump(nic, sock, peer, queue, offload, frame_timeout);
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let s = &nic.stats;
    tracing::info!(
        %peer,
        interface = %nic.ifname,
        queue,
        rx_packets = get(&s.rx_packets),
        rx_bytes = get(&s.rx_bytes),
        tx_packets = get(&s.tx_packets),
        tx_bytes = get(&s.tx_bytes),
        drops = get(&s.drops),
        "frames stopped; the interface's counters"
    );
    end
}

fn pump(
    nic: &Nic,
    sock: &Stream,
    peer: SocketAddr,
    queue: u16,
    offload: bool,
    frame_timeout: Duration,
) -> End {
    let bound = nic.refresh_ifindex();
    let pkt = match nic.open_socket() {
        Ok(p) => p,
        Err(e) => return End::Socket(e),
    };
    if let Err(e) = sock.set_nonblocking(true) {
        return End::Socket(e);
    }
    let mut link = nic.link();
    let mut out = Vec::with_capacity(1 << 20);
    link.encode(&mut out);
    let mut session = Session {
        nic,
        pkt: pkt.as_raw_fd(),
        inbuf: vec![0u8; 1 << 18],
        have: 0,
        progress: false,
        frames: Vec::with_capacity(BATCH),
        out,
        rx: RxBatch::new(link.mtu, offload),
        offload,
        accept: 0,
    };
    devlend_fabric::limited!(info, %peer, interface = %nic.ifname, queue, mtu = link.mtu, up = link.up, "frames flowing");
    let mut last_link = Instant::now();
    // Since when the borrower's bytes have ended in the middle of a message with no
    // whole message taken since.
    let mut partial_since: Option<Instant> = None;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: sock.as_raw_fd(),
                events: libc::POLLIN
                    | if session.out.is_empty() {
                        0
                    } else {
                        libc::POLLOUT
                    },
                revents: 0,
            },
            libc::pollfd {
                fd: session.pkt,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a live array of two pollfds for the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, LINK_POLL.as_millis() as libc::c_int) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return End::Socket(e);
            }
            continue;
        }
        if fds[0].revents != 0 {
            if let Some(end) = session.pump_from_borrower(sock) {
                return end;
            }
            partial_since = match (session.have, session.progress) {
                (0, _) => None,
                (_, true) => Some(Instant::now()),
                (_, false) => partial_since.or_else(|| Some(Instant::now())),
            };
            session.progress = false;
        }
        if fds[1].revents & libc::POLLIN != 0 {
            session.pump_from_interface();
        }
        if let Some(t) = partial_since.filter(|t| t.elapsed() >= frame_timeout) {
            return End::Protocol(format!(
                "a message cut short: {} bytes of it, nothing more for {:?}",
                session.have,
                t.elapsed()
            ));
        }
        if last_link.elapsed() >= LINK_POLL {
            last_link = Instant::now();
            if nic.refresh_ifindex() != bound {
                // Deleted and created again: this session's packet socket is bound to
                // the old interface. The borrower reconnects, and its next session
                // opens a socket on the new one.
                return End::Protocol(format!("interface {} was replaced; reopening", nic.ifname));
            }
            tracing::debug!(interface = %nic.ifname, stats = ?nic.stats, "counters");
            let now = nic.link();
            if now != link {
                tracing::info!(interface = %nic.ifname, up = now.up, mtu = now.mtu, "link changed");
                if now.mtu != link.mtu {
                    session.rx = RxBatch::new(now.mtu, session.offload);
                }
                link = now;
                link.encode(&mut session.out);
            }
        }
        if let Err(e) = session.flush(sock) {
            return End::Socket(e);
        }
    }
}

struct Session<'a> {
    nic: &'a Nic,
    pkt: RawFd,
    inbuf: Vec<u8>,
    /// The borrower was granted offload frames (`FEATURE_NET_OFFLOAD`).
    offload: bool,
    /// The offloaded frames the borrower's guest takes (`net::RX_*`, its last
    /// OFFLOADS message; none before one).
    accept: u32,
    have: usize,
    /// A whole message was taken from `inbuf` since the pump loop last looked.
    progress: bool,
    /// Frames of one read to send: (offload header or none, offset in `inbuf`, length).
    frames: Vec<(Option<[u8; VNET_HDR_LEN]>, usize, usize)>,
    out: Vec<u8>,
    rx: RxBatch,
}

impl Session<'_> {
    /// Reads what the borrower sent and puts its frames on the interface. Returns how
    /// the session ends, if it does.
    fn pump_from_borrower(&mut self, sock: &Stream) -> Option<End> {
        loop {
            let n = match (&mut &*sock).read(&mut self.inbuf[self.have..]) {
                Ok(0) => return Some(End::PeerClosed),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Some(End::Socket(e)),
            };
            self.have += n;
            // Reused from read to read: no allocation per read.
            let mut frames = std::mem::take(&mut self.frames);
            frames.clear();
            let mut at = 0;
            loop {
                match net::decode(&self.inbuf[at..self.have]) {
                    Ok(Some((NetMessage::Frame(f), len))) => {
                        frames.push((None, at + net::NET_HEADER_LEN, f.len()));
                        at += len;
                    }
                    Ok(Some((NetMessage::OffloadFrame(o, f), len))) => {
                        if !self.offload {
                            return Some(End::Protocol(
                                "offload frame without FEATURE_NET_OFFLOAD".into(),
                            ));
                        }
                        // Checked as a frame from the guest this time (no DATA_VALID).
                        if let Err(e) = o.validate(f.len(), false) {
                            return Some(End::Protocol(e.to_string()));
                        }
                        let off = at + net::NET_HEADER_LEN + net::OFFLOAD_LEN;
                        frames.push((Some(o.to_bytes()), off, f.len()));
                        at += len;
                    }
                    Ok(Some((NetMessage::Offloads(bits), len))) => {
                        if !self.offload {
                            return Some(End::Protocol(
                                "offloads message without FEATURE_NET_OFFLOAD".into(),
                            ));
                        }
                        tracing::debug!(bits, "the guest's receive offloads");
                        self.accept = bits;
                        at += len;
                    }
                    Ok(Some((NetMessage::Link(_), _))) => {
                        return Some(End::Protocol("link message from the borrower".into()))
                    }
                    Ok(None) => break,
                    Err(e) => return Some(End::Protocol(e.to_string())),
                }
            }
            self.send_frames(&frames);
            self.frames = frames;
            self.progress |= at > 0;
            self.inbuf.copy_within(at..self.have, 0);
            self.have -= at;
        }
    }

    /// Sends frames (vnet header to use, offset and length in `inbuf`) on the
    /// interface, `BATCH` per call. A frame without a header goes with a zero one.
    fn send_frames(&mut self, frames: &[(Option<[u8; VNET_HDR_LEN]>, usize, usize)]) {
        let s = &self.nic.stats;
        for chunk in frames.chunks(BATCH) {
            let zero = [0u8; VNET_HDR_LEN];
            let mut iovs: Vec<[libc::iovec; 2]> = chunk
                .iter()
                .map(|(hdr, off, len)| {
                    let (off, len) = (*off, *len);
                    let hdr = hdr.as_ref().unwrap_or(&zero);
                    [
                        libc::iovec {
                            iov_base: hdr.as_ptr() as *mut libc::c_void,
                            iov_len: VNET_HDR_LEN,
                        },
                        libc::iovec {
                            iov_base: self.inbuf[off..off + len].as_ptr() as *mut libc::c_void,
                            iov_len: len,
                        },
                    ]
                })
                .collect();
            // SAFETY: mmsghdr is plain old data; all-zero is a valid value.
            let mut msgs: Vec<libc::mmsghdr> = (0..iovs.len())
                .map(|_| unsafe { std::mem::zeroed() })
                .collect();
            for (m, iov) in msgs.iter_mut().zip(iovs.iter_mut()) {
                m.msg_hdr.msg_iov = iov.as_mut_ptr();
                m.msg_hdr.msg_iovlen = 2;
            }
            let mut done = 0;
            while done < msgs.len() {
                // SAFETY: each message points to one iovec into `inbuf`, all alive and
                // unchanged for the call; the packet socket is bound to the interface.
                let n = unsafe {
                    libc::sendmmsg(
                        self.pkt,
                        msgs[done..].as_mut_ptr(),
                        (msgs.len() - done) as libc::c_uint,
                        0,
                    )
                };
                if n <= 0 {
                    // The interface refused this frame (too long, queue full, down): drop
                    // it and go on with the next.
                    s.drops.fetch_add(1, Ordering::Relaxed);
                    done += 1;
                    continue;
                }
                for m in &msgs[done..done + n as usize] {
                    s.tx_packets.fetch_add(1, Ordering::Relaxed);
                    let len = (m.msg_len as usize).saturating_sub(VNET_HDR_LEN);
                    s.tx_bytes.fetch_add(len as u64, Ordering::Relaxed);
                }
                done += n as usize;
            }
        }
    }

    /// Receives what the interface has and queues it for the borrower.
    fn pump_from_interface(&mut self) {
        let s = &self.nic.stats;
        loop {
            let got = self.rx.receive(self.pkt);
            if got == 0 {
                return;
            }
            for i in 0..got {
                let (offload, frame) = match self.rx.frame(i, self.accept) {
                    Rx::Frame(f) => (None, f),
                    Rx::Offload(o, f) => (Some(o), f),
                    Rx::Outgoing => continue,
                    Rx::Drop => {
                        s.drops.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                };
                if self.out.len() + frame.len() + net::NET_HEADER_LEN + net::OFFLOAD_LEN > OUT_LIMIT
                {
                    s.drops.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                match offload {
                    Some(o) => net::encode_offload_frame(&o, frame, &mut self.out),
                    None => net::encode_frame(frame, &mut self.out),
                }
                s.rx_packets.fetch_add(1, Ordering::Relaxed);
                s.rx_bytes.fetch_add(frame.len() as u64, Ordering::Relaxed);
            }
            if got < BATCH {
                return;
            }
        }
    }

    /// Writes as much of the queued output as the socket takes now.
    fn flush(&mut self, sock: &Stream) -> io::Result<()> {
        let mut at = 0;
        while at < self.out.len() {
            match (&mut &*sock).write(&self.out[at..]) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        self.out.drain(..at);
        Ok(())
    }
}

/// Receive buffers for one `recvmmsg` of up to [`BATCH`] frames.
struct RxBatch {
    bufs: Vec<Vec<u8>>,
    addrs: Vec<libc::sockaddr_ll>,
    lens: Vec<(usize, bool, bool)>,
}

/// What became of one received frame.
enum Rx<'a> {
    /// A frame for the borrower.
    Frame(&'a [u8]),
    /// A frame for the borrower, with what its guest is left to do or need not do
    /// (a checksum to complete or already validated, a GSO frame).
    Offload(net::Offload, &'a [u8]),
    /// Sent by the lender's own host: not the borrower's.
    Outgoing,
    /// Truncated (larger than the buffer, e.g. from GRO) or shorter than a header.
    Drop,
}

impl RxBatch {
    /// Buffers for frames of `mtu` bytes; when `offload`, for GSO frames too (a GRO'd
    /// or TSO frame of up to 64 KiB: 32 such buffers are 2 MiB).
    fn new(mtu: u32, offload: bool) -> Self {
        // An Ethernet header, a VLAN tag, and some slack; at least a standard frame.
        let size = if offload {
            net::MAX_OFFLOAD_FRAME_LEN
        } else {
            (mtu as usize + 22).clamp(1536, net::MAX_FRAME_LEN)
        } + VNET_HDR_LEN;
        RxBatch {
            bufs: (0..BATCH).map(|_| vec![0u8; size]).collect(),
            // SAFETY: sockaddr_ll is plain old data; all-zero is a valid value.
            addrs: (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect(),
            lens: vec![(0, false, false); BATCH],
        }
    }

    /// Receives up to [`BATCH`] frames; returns how many (0: none waiting, or an error).
    fn receive(&mut self, fd: RawFd) -> usize {
        let mut iovs: Vec<libc::iovec> = self
            .bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: mmsghdr is plain old data; all-zero is a valid value.
        let mut msgs: Vec<libc::mmsghdr> =
            (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect();
        for ((m, iov), a) in msgs
            .iter_mut()
            .zip(iovs.iter_mut())
            .zip(self.addrs.iter_mut())
        {
            m.msg_hdr.msg_iov = iov;
            m.msg_hdr.msg_iovlen = 1;
            m.msg_hdr.msg_name = (a as *mut libc::sockaddr_ll).cast();
            m.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        }
        // SAFETY: every message points to a live, writable buffer and address of the
        // lengths given, all alive for the call; the socket is non-blocking.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                msgs.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_TRUNC,
                std::ptr::null_mut(),
            )
        };
        if n <= 0 {
            return 0;
        }
        for (i, m) in msgs.iter().take(n as usize).enumerate() {
            let outgoing = self.addrs[i].sll_pkttype == libc::PACKET_OUTGOING;
            let truncated = m.msg_hdr.msg_flags & libc::MSG_TRUNC != 0
                || m.msg_len as usize > self.bufs[i].len();
            self.lens[i] = (m.msg_len as usize, outgoing, truncated);
        }
        n as usize
    }

    /// The `i`th frame received: with its packet-socket header when the guest takes
    /// what it says (`accept`: `net::RX_*`), else its checksum completed where the
    /// header asks; a GSO frame the guest does not take is dropped.
    fn frame(&mut self, i: usize, accept: u32) -> Rx<'_> {
        match self.lens[i] {
            (_, true, _) => Rx::Outgoing,
            (len, false, false) if len >= VNET_HDR_LEN + net::MIN_FRAME_LEN => {
                let (hdr, frame) = self.bufs[i][..len].split_at_mut(VNET_HDR_LEN);
                let mut h = [0u8; VNET_HDR_LEN];
                h.copy_from_slice(hdr);
                let o = net::Offload::from_bytes(&h);
                if o.flags != 0 && o.taken_by(accept) {
                    return match o.validate(frame.len(), true) {
                        Ok(()) => Rx::Offload(o, frame),
                        Err(e) => {
                            tracing::debug!(len, error = %e, "frame with a bad packet header dropped");
                            Rx::Drop
                        }
                    };
                }
                // A GSO frame (gso_type set) is larger than the MTU: not for a guest
                // that takes no segmentation offload.
                if hdr[1] != 0 {
                    tracing::debug!(len, gso_type = hdr[1], "GSO frame dropped");
                    return Rx::Drop;
                }
                if hdr[0] & VNET_F_NEEDS_CSUM != 0 {
                    let start = usize::from(u16::from_ne_bytes([hdr[6], hdr[7]]));
                    let offset = usize::from(u16::from_ne_bytes([hdr[8], hdr[9]]));
                    if !complete_checksum(frame, start, offset) {
                        return Rx::Drop;
                    }
                }
                Rx::Frame(frame)
            }
            (len, _, truncated) => {
                tracing::debug!(len, truncated, "frame dropped");
                Rx::Drop
            }
        }
    }
}

/// Completes a checksum left to the sender (`CHECKSUM_PARTIAL`): the Internet checksum
/// of `frame[start..]`, whose field at `start + offset` holds the pseudo-header sum,
/// stored in that field (0 written as 0xffff, as Linux does). False when the offsets
/// fall outside the frame.
fn complete_checksum(frame: &mut [u8], start: usize, offset: usize) -> bool {
    let at = start + offset;
    if start >= frame.len() || at + 2 > frame.len() {
        return false;
    }
    let mut sum: u32 = 0;
    let mut words = frame[start..].chunks_exact(2);
    for w in &mut words {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let c = match !(sum as u16) {
        0 => 0xffff,
        c => c,
    };
    frame[at..at + 2].copy_from_slice(&c.to_be_bytes());
    true
}

#[cfg(test)]
mod tests {
    use super::complete_checksum;

    fn fold(mut sum: u32) -> u16 {
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        sum as u16
    }

    fn sum16(b: &[u8]) -> u32 {
        b.chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
            .sum()
    }

    #[test]
    fn a_partial_checksum_is_completed_so_that_the_receiver_verifies_it() {
        // An Ethernet + IPv4 header (34 bytes) then a TCP segment of odd length; the
        // checksum field (offset 16 in TCP) holds the pseudo-header sum, as Linux
        // leaves it with CHECKSUM_PARTIAL.
        let pseudo: u16 = 0x1c46;
        let mut frame: Vec<u8> = (0..34 + 20 + 37).map(|i| (i * 31 + 7) as u8).collect();
        frame[34 + 16..34 + 18].copy_from_slice(&pseudo.to_be_bytes());
        assert!(complete_checksum(&mut frame, 34, 16));
        // The receiver's check: pseudo-header plus the segment sums to all ones.
        assert_eq!(fold(u32::from(pseudo) + sum16(&frame[34..])), 0xffff);
        // Offsets outside the frame: refused, nothing written.
        let before = frame.clone();
        assert!(!complete_checksum(&mut frame, 80, 16));
        assert!(!complete_checksum(&mut frame, 200, 0));
        assert_eq!(frame, before);
    }
}
