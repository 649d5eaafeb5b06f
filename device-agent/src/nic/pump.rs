//! A queue-pair session of a lent interface: frames from the borrower put on the
//! interface, frames from the interface queued for the borrower, the link state and MTU
//! sent when they change.
//!
//! Nothing here blocks on the borrower: the fabric socket is non-blocking, frames for
//! the borrower are queued up to [`OUT_LIMIT`] bytes and dropped (counted) beyond, and
//! the fabric socket is always read, so the borrower never waits on the lender either.
//!
//! Under limits (`tx_*`/`rx_*`, `docs/qos.md`) the session polices: a frame either way
//! that its holder's buckets cannot pay for is dropped and counted (`throttled`, and
//! the interface's drops), as a switch's ingress policer does; TCP in the guest backs
//! off to the rate.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devlend_fabric::conn::Stream;
use devlend_fabric::net::{self, NetMessage};

use super::rx::{Rx, RxBatch};
use super::{Nic, BATCH, VNET_HDR_LEN};
use crate::qos::{Cost, Group};
use crate::session::end::End;
use crate::stats::DeviceStats;

/// A session's policer: its holder's limits, and the device's counters.
pub(crate) struct Police<'a> {
    /// The holder's limits (`None`, or a group that limits nothing: no policing).
    pub(crate) group: Option<std::sync::Arc<Group>>,
    /// Where dropped frames are counted.
    pub(crate) stats: &'a DeviceStats,
}

impl Police<'_> {
    /// Whether a frame of `len` bytes the guest sends (`tx`) or receives may pass.
    fn pass(&self, tx: bool, len: usize) -> bool {
        let Some(g) = &self.group else {
            return true;
        };
        if g.take(&Cost::frame(tx, len as u64), Instant::now()).is_ok() {
            return true;
        }
        self.stats.throttle_held();
        self.stats.throttle_dropped();
        false
    }
}

/// Most bytes of frames queued for a borrower that does not keep up; frames beyond are
/// dropped and counted.
pub(crate) const OUT_LIMIT: usize = 4 << 20;
/// How often the link state and MTU are read (and sent when they changed).
const LINK_POLL: Duration = Duration::from_millis(500);

/// A queue-pair session of a lent interface, opened and not yet served.
pub(super) struct QueuePair<'a> {
    pub(super) nic: &'a Nic,
    pub(super) dev: &'a Arc<crate::device_counters::DeviceCounters>,
    pub(super) queue: u16,
    /// The borrower was granted the offloads (frames carry a vnet header).
    pub(super) offload: bool,
    pub(super) frame_timeout: Duration,
    /// The holder's limits.
    pub(super) group: Arc<Group>,
}

impl crate::session::open::TcpSession for QueuePair<'_> {
    fn serve(self: Box<Self>, sock: &Stream, peer: SocketAddr) -> End {
        let police = Police {
            group: Some(Arc::clone(&self.group)),
            stats: &self.dev.stats,
        };
        serve(
            self.nic,
            sock,
            peer,
            self.queue,
            self.offload,
            self.frame_timeout,
            police,
        )
    }
}

/// Serves one queue-pair session of a lent interface until the borrower closes it or
/// breaks the protocol; the interface's counters are logged as it ends.
fn serve(
    nic: &Nic,
    sock: &Stream,
    peer: SocketAddr,
    queue: u16,
    offload: bool,
    frame_timeout: Duration,
    mut police: Police<'_>,
) -> End {
    police.group = police.group.filter(|g| !g.is_unlimited());
    let end = pump(nic, sock, peer, queue, offload, frame_timeout, police);
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let s = &nic.stats;
    // A peer can open and close sessions as fast as it likes: rate-limited, like the
    // session's other lines (docs/logging.md).
    devlend_fabric::limited!(
        info,
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
    police: Police<'_>,
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
    let mut session = Pump {
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
        police,
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

struct Pump<'a> {
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
    police: Police<'a>,
}

impl Pump<'_> {
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
                        if self.police.pass(true, f.len()) {
                            frames.push((None, at + net::NET_HEADER_LEN, f.len()));
                        } else {
                            self.nic.stats.drops.fetch_add(1, Ordering::Relaxed);
                        }
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
                        if self.police.pass(true, f.len()) {
                            frames.push((Some(o.to_bytes()), off, f.len()));
                        } else {
                            self.nic.stats.drops.fetch_add(1, Ordering::Relaxed);
                        }
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
                    // Its TCP acknowledgement was the point (a borrower with several
                    // paths checks the path with it); nothing to do.
                    Ok(Some((NetMessage::Heartbeat, len))) => at += len,
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
                    || !self.police.pass(false, frame.len())
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
