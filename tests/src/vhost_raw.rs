//! A raw vhost-user frontend for tests that play a hostile or buggy VMM: it sends any
//! message, valid or not, over the unix socket of a real attachment, and owns the guest
//! memory (a memfd it maps itself) so that it lays out the virtqueues' rings and
//! buffers where it likes.
//!
//! Wire format (QEMU `docs/interop/vhost-user.rst`): a header of request `u32`, flags
//! `u32` (version 0x1, REPLY 0x4, NEED_REPLY 0x8) and payload size `u32`, then the
//! payload; file descriptors ride along in `SCM_RIGHTS`. Values are native-endian.
//!
//! Why this file is over 600 lines: it is the whole raw frontend: the message client
//! (`RawFrontend`, a method per request, about 400 lines), the guest memory it owns
//! (`GuestRam`) and the rings and queues it lays out there (`SplitRing`, `RawQueue`), and
//! the fuzz target `vhost_sequence` compiles this one file in by `#[path]`. The guest
//! memory and rings could move to a module of their own (which that fuzz target would then
//! include too), and are left here for now.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{fence, AtomicU16, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Header flag: protocol version 1.
pub const VERSION: u32 = 0x1;
/// Header flag: the message is a reply.
pub const REPLY: u32 = 0x4;
/// Header flag: the frontend asks for a reply (REPLY_ACK).
pub const NEED_REPLY: u32 = 0x8;

/// Frontend request codes.
#[allow(missing_docs)]
pub mod req {
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const RESET_OWNER: u32 = 4;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_VRING_ADDR: u32 = 9;
    pub const SET_VRING_BASE: u32 = 10;
    pub const GET_VRING_BASE: u32 = 11;
    pub const SET_VRING_KICK: u32 = 12;
    pub const SET_VRING_CALL: u32 = 13;
    pub const SET_VRING_ERR: u32 = 14;
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const GET_QUEUE_NUM: u32 = 17;
    pub const SET_VRING_ENABLE: u32 = 18;
    pub const GET_CONFIG: u32 = 24;
    pub const SET_CONFIG: u32 = 25;
    pub const GET_INFLIGHT_FD: u32 = 31;
    pub const SET_INFLIGHT_FD: u32 = 32;
    pub const RESET_DEVICE: u32 = 34;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    pub const ADD_MEM_REG: u32 = 37;
    pub const REM_MEM_REG: u32 = 38;
}

/// Protocol feature bits.
#[allow(missing_docs)]
pub mod proto {
    pub const MQ: u64 = 1 << 0;
    pub const REPLY_ACK: u64 = 1 << 3;
    pub const CONFIG: u64 = 1 << 9;
    pub const INFLIGHT_SHMFD: u64 = 1 << 12;
    pub const CONFIGURE_MEM_SLOTS: u64 = 1 << 15;
}

/// Virtio feature bit 30, VHOST_USER_F_PROTOCOL_FEATURES.
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// Virtio feature bit 32, VIRTIO_F_VERSION_1.
pub const F_VERSION_1: u64 = 1 << 32;

/// Descriptor flag VRING_DESC_F_NEXT.
pub const DESC_NEXT: u16 = 1;
/// Descriptor flag VRING_DESC_F_WRITE (the device writes the buffer).
pub const DESC_WRITE: u16 = 2;
/// Descriptor flag VRING_DESC_F_INDIRECT (the buffer is a table of descriptors).
pub const DESC_INDIRECT: u16 = 4;

/// A message from the backend.
#[derive(Debug)]
pub struct Reply {
    /// Its request code (that of the request it answers).
    pub request: u32,
    /// Its header flags.
    pub flags: u32,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// One entry of SET_MEM_TABLE (`VhostUserMemoryRegion`).
#[derive(Debug, Clone, Copy)]
pub struct Region {
    /// Guest physical address.
    pub gpa: u64,
    /// Size in bytes.
    pub size: u64,
    /// The frontend's virtual address of the region (what ring addresses are given in).
    pub user_addr: u64,
    /// Offset of the region in its fd.
    pub mmap_offset: u64,
}

/// A vhost-user connection driven message by message.
pub struct RawFrontend {
    sock: UnixStream,
}

/// The payload of a `VhostUserVringState` (SET_VRING_NUM, SET_VRING_BASE, ...).
pub fn vring_state(index: u32, num: u32) -> Vec<u8> {
    [index.to_ne_bytes(), num.to_ne_bytes()].concat()
}

impl RawFrontend {
    /// Connects to the vhost-user socket at `path`; replies are awaited up to 10 s.
    ///
    /// # Errors
    /// The socket cannot be reached.
    pub fn connect(path: &Path) -> Result<Self> {
        let sock = UnixStream::connect(path)
            .with_context(|| format!("cannot connect to {}", path.display()))?;
        sock.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(RawFrontend { sock })
    }

    /// Sends one message with `fds` attached.
    ///
    /// # Errors
    /// The socket fails.
    pub fn send(&mut self, request: u32, flags: u32, payload: &[u8], fds: &[RawFd]) -> Result<()> {
        let mut msg = Vec::with_capacity(12 + payload.len());
        msg.extend_from_slice(&request.to_ne_bytes());
        msg.extend_from_slice(&flags.to_ne_bytes());
        msg.extend_from_slice(&(payload.len() as u32).to_ne_bytes());
        msg.extend_from_slice(payload);
        if fds.is_empty() {
            self.sock.write_all(&msg)?;
            return Ok(());
        }
        let fd_bytes = std::mem::size_of_val(fds);
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
        let mut control = vec![0u64; space.div_ceil(8)];
        let mut iov = libc::iovec {
            iov_base: msg.as_mut_ptr().cast(),
            iov_len: msg.len(),
        };
        // SAFETY: an all-zero msghdr is a valid value; the fields are set below.
        let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        hdr.msg_iov = &mut iov;
        hdr.msg_iovlen = 1;
        hdr.msg_control = control.as_mut_ptr().cast();
        hdr.msg_controllen = space as _;
        // SAFETY: `hdr` points at `control`, which has room for one cmsg header with
        // `fds` (CMSG_SPACE); CMSG_FIRSTHDR/CMSG_DATA stay inside it, and the copy
        // writes exactly `fd_bytes` there.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&hdr);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                fd_bytes,
            );
        }
        let sent = loop {
            // SAFETY: `hdr` and what it points at are alive for the call.
            let sent = unsafe { libc::sendmsg(self.sock.as_raw_fd(), &hdr, 0) };
            if sent >= 0 {
                break sent;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e.into());
            }
        };
        if (sent as usize) < msg.len() {
            self.sock.write_all(&msg[sent as usize..])?;
        }
        Ok(())
    }

    /// Sends a bare header whose payload size is `size`, with no payload (e.g. a size no
    /// backend may accept, or one it waits for).
    ///
    /// # Errors
    /// The socket fails.
    pub fn send_header(&mut self, request: u32, flags: u32, size: u32) -> Result<()> {
        let mut hdr = Vec::with_capacity(12);
        for v in [request, flags, size] {
            hdr.extend_from_slice(&v.to_ne_bytes());
        }
        self.sock.write_all(&hdr)?;
        Ok(())
    }

    /// Sets how long a receive waits for a message (10 s from [`Self::connect`]).
    ///
    /// # Errors
    /// The socket refuses the timeout (zero).
    pub fn set_timeout(&self, timeout: Duration) -> Result<()> {
        self.sock.set_read_timeout(Some(timeout))?;
        Ok(())
    }

    /// Receives one message and the file descriptors that came with it (GET_INFLIGHT_FD
    /// sends its memfd). A closed connection is an `io::Error` of kind `UnexpectedEof`,
    /// nothing within the timeout one of kind `WouldBlock`.
    ///
    /// # Errors
    /// The socket fails, is closed, or nothing comes in time.
    pub fn recv_with_fds(&mut self) -> Result<(Reply, Vec<OwnedFd>)> {
        let mut hdr = [0u8; 12];
        // Room for one SCM_RIGHTS message of up to 8 fds (CMSG_SPACE(32) = 48 bytes).
        let mut control = [0u64; 8];
        let mut iov = libc::iovec {
            iov_base: hdr.as_mut_ptr().cast(),
            iov_len: hdr.len(),
        };
        // SAFETY: an all-zero msghdr is a valid value; the fields are set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        let n = loop {
            // SAFETY: `msg` points at `hdr` and `control`, both alive for the call.
            let n =
                unsafe { libc::recvmsg(self.sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            if n >= 0 {
                break n;
            }
            let e = std::io::Error::last_os_error();
            // A signal (libFuzzer's timer, for one) is no reason to give up.
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e.into());
            }
        };
        let mut fds = Vec::new();
        // SAFETY: the kernel filled `control` with `msg_controllen` bytes of cmsgs; the
        // CMSG_* macros walk them inside it, and each SCM_RIGHTS one carries fds that are
        // now this process's and owned by nothing else.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c).cast::<RawFd>();
                    let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                        / std::mem::size_of::<RawFd>();
                    for i in 0..count {
                        fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        let n = n as usize;
        if n == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        self.sock.read_exact(&mut hdr[n..])?;
        let word = |i: usize| u32::from_ne_bytes([hdr[i], hdr[i + 1], hdr[i + 2], hdr[i + 3]]);
        let mut payload = vec![0u8; word(8) as usize];
        self.sock.read_exact(&mut payload)?;
        let reply = Reply {
            request: word(0),
            flags: word(4),
            payload,
        };
        Ok((reply, fds))
    }

    /// Receives one message.
    ///
    /// # Errors
    /// The socket fails, is closed, or nothing comes within 10 s.
    pub fn recv(&mut self) -> Result<Reply> {
        let mut hdr = [0u8; 12];
        self.sock
            .read_exact(&mut hdr)
            .context("no reply from the backend (connection closed or timed out)")?;
        let word = |i: usize| u32::from_ne_bytes([hdr[i], hdr[i + 1], hdr[i + 2], hdr[i + 3]]);
        let mut payload = vec![0u8; word(8) as usize];
        self.sock.read_exact(&mut payload)?;
        Ok(Reply {
            request: word(0),
            flags: word(4),
            payload,
        })
    }

    /// Sends `request` with NEED_REPLY and returns its reply.
    ///
    /// # Errors
    /// No reply, or a reply to another request.
    pub fn call(&mut self, request: u32, payload: &[u8], fds: &[RawFd]) -> Result<Reply> {
        self.send(request, VERSION | NEED_REPLY, payload, fds)?;
        let r = self.recv()?;
        if r.request != request || r.flags & REPLY == 0 {
            bail!("request {request}: got {r:?}");
        }
        Ok(r)
    }

    /// Sends `request` with NEED_REPLY and returns the u64 of its reply (the REPLY_ACK
    /// status, 0 for success, or a GET_* value).
    ///
    /// # Errors
    /// As [`Self::call`], or a reply that is not a u64.
    pub fn ack(&mut self, request: u32, payload: &[u8], fds: &[RawFd]) -> Result<u64> {
        let r = self.call(request, payload, fds)?;
        let v: [u8; 8] =
            r.payload.as_slice().try_into().with_context(|| {
                format!("request {request}: reply of {} bytes", r.payload.len())
            })?;
        Ok(u64::from_ne_bytes(v))
    }

    /// Sends a request that has a reply of its own (GET_FEATURES, ...), without
    /// NEED_REPLY, and returns its u64.
    ///
    /// # Errors
    /// As [`Self::ack`].
    pub fn get_u64(&mut self, request: u32) -> Result<u64> {
        self.send(request, VERSION, &[], &[])?;
        let r = self.recv()?;
        let v: [u8; 8] =
            r.payload.as_slice().try_into().with_context(|| {
                format!("request {request}: reply of {} bytes", r.payload.len())
            })?;
        if r.request != request {
            bail!("request {request}: got a reply to {}", r.request);
        }
        Ok(u64::from_ne_bytes(v))
    }

    /// Negotiates as QEMU does (GET_FEATURES, GET/SET_PROTOCOL_FEATURES, SET_OWNER,
    /// SET_FEATURES), acking `protocol` (REPLY_ACK is added) and the virtio `features`
    /// (PROTOCOL_FEATURES and VERSION_1 are added).
    ///
    /// # Errors
    /// A step fails or is refused.
    pub fn negotiate(&mut self, features: u64, protocol: u64) -> Result<()> {
        self.negotiate_protocol(protocol)?;
        let owner = self.ack(req::SET_OWNER, &[], &[])?;
        let acked = features | F_PROTOCOL_FEATURES | F_VERSION_1;
        let set = self.ack(req::SET_FEATURES, &acked.to_ne_bytes(), &[])?;
        if owner != 0 || set != 0 {
            bail!("SET_OWNER answered {owner}, SET_FEATURES {set}");
        }
        Ok(())
    }

    /// The part of [`Self::negotiate`] allowed before SET_OWNER: GET_FEATURES and
    /// GET/SET_PROTOCOL_FEATURES (with REPLY_ACK).
    ///
    /// # Errors
    /// A step fails, or the backend lacks what is asked.
    pub fn negotiate_protocol(&mut self, protocol: u64) -> Result<()> {
        let offered = self.get_u64(req::GET_FEATURES)?;
        if offered & F_PROTOCOL_FEATURES == 0 {
            bail!("the backend does not offer PROTOCOL_FEATURES: {offered:#x}");
        }
        let offered_proto = self.get_u64(req::GET_PROTOCOL_FEATURES)?;
        let want = protocol | proto::REPLY_ACK;
        if offered_proto & want != want {
            bail!("protocol features {want:#x} not all offered: {offered_proto:#x}");
        }
        let r = self.ack(req::SET_PROTOCOL_FEATURES, &want.to_ne_bytes(), &[])?;
        if r != 0 {
            bail!("SET_PROTOCOL_FEATURES refused: {r}");
        }
        Ok(())
    }

    /// SET_MEM_TABLE of `regions` with `fds` (their counts may differ, to test that).
    ///
    /// # Errors
    /// No reply.
    pub fn set_mem_table(&mut self, regions: &[Region], fds: &[RawFd]) -> Result<u64> {
        let mut p = Vec::new();
        p.extend_from_slice(&(regions.len() as u32).to_ne_bytes());
        p.extend_from_slice(&0u32.to_ne_bytes());
        for r in regions {
            for v in [r.gpa, r.size, r.user_addr, r.mmap_offset] {
                p.extend_from_slice(&v.to_ne_bytes());
            }
        }
        self.ack(req::SET_MEM_TABLE, &p, fds)
    }

    /// SET_VRING_NUM.
    ///
    /// # Errors
    /// No reply.
    pub fn set_vring_num(&mut self, index: u32, num: u32) -> Result<u64> {
        self.ack(req::SET_VRING_NUM, &vring_state(index, num), &[])
    }

    /// SET_VRING_BASE.
    ///
    /// # Errors
    /// No reply.
    pub fn set_vring_base(&mut self, index: u32, base: u32) -> Result<u64> {
        self.ack(req::SET_VRING_BASE, &vring_state(index, base), &[])
    }

    /// GET_VRING_BASE: the next avail index the backend would take.
    ///
    /// # Errors
    /// No reply, or a reply of the wrong shape.
    pub fn get_vring_base(&mut self, index: u32) -> Result<u32> {
        self.send(req::GET_VRING_BASE, VERSION, &vring_state(index, 0), &[])?;
        let r = self.recv()?;
        if r.request != req::GET_VRING_BASE || r.payload.len() != 8 {
            bail!("GET_VRING_BASE: got {r:?}");
        }
        Ok(u32::from_ne_bytes([
            r.payload[4],
            r.payload[5],
            r.payload[6],
            r.payload[7],
        ]))
    }

    /// SET_VRING_ADDR with the frontend's virtual addresses of the rings.
    ///
    /// # Errors
    /// No reply.
    pub fn set_vring_addr(&mut self, index: u32, desc: u64, used: u64, avail: u64) -> Result<u64> {
        let mut p = Vec::new();
        p.extend_from_slice(&index.to_ne_bytes());
        p.extend_from_slice(&0u32.to_ne_bytes());
        for v in [desc, used, avail, 0u64] {
            p.extend_from_slice(&v.to_ne_bytes());
        }
        self.ack(req::SET_VRING_ADDR, &p, &[])
    }

    /// SET_VRING_KICK, SET_VRING_CALL or SET_VRING_ERR (`request`) of ring `index` with
    /// `fd`, or with bit 8 ("no fd") when `None`.
    ///
    /// # Errors
    /// No reply.
    pub fn set_vring_fd(&mut self, request: u32, index: u64, fd: Option<RawFd>) -> Result<u64> {
        match fd {
            Some(fd) => self.ack(request, &index.to_ne_bytes(), &[fd]),
            None => self.ack(request, &(index | 0x100).to_ne_bytes(), &[]),
        }
    }

    /// SET_VRING_ENABLE.
    ///
    /// # Errors
    /// No reply.
    pub fn set_vring_enable(&mut self, index: u32, enable: bool) -> Result<u64> {
        self.ack(
            req::SET_VRING_ENABLE,
            &vring_state(index, u32::from(enable)),
            &[],
        )
    }

    /// GET_CONFIG of `size` bytes at `offset` (a request payload of `size` zero bytes, as
    /// QEMU sends): the reply's `(size, data)`; an error is a reply with size 0 and no
    /// data.
    ///
    /// # Errors
    /// No reply, or a reply shorter than its config header.
    pub fn get_config(&mut self, offset: u32, size: u32) -> Result<(u32, Vec<u8>)> {
        let mut p = Vec::new();
        for v in [offset, size, 0u32] {
            p.extend_from_slice(&v.to_ne_bytes());
        }
        p.resize(12 + size as usize, 0);
        let r = self.call(req::GET_CONFIG, &p, &[])?;
        if r.payload.len() < 12 {
            bail!("GET_CONFIG: reply of {} bytes", r.payload.len());
        }
        let got = u32::from_ne_bytes([r.payload[4], r.payload[5], r.payload[6], r.payload[7]]);
        Ok((got, r.payload[12..].to_vec()))
    }

    /// SET_CONFIG of `data` at `offset` with `flags`.
    ///
    /// # Errors
    /// No reply.
    pub fn set_config(&mut self, offset: u32, flags: u32, data: &[u8]) -> Result<u64> {
        let mut p = Vec::new();
        for v in [offset, data.len() as u32, flags] {
            p.extend_from_slice(&v.to_ne_bytes());
        }
        p.extend_from_slice(data);
        self.ack(req::SET_CONFIG, &p, &[])
    }
}

/// Guest RAM: a memfd mapped shared in this process, at guest physical address `gpa`.
pub struct GuestRam {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
    gpa: u64,
}

impl GuestRam {
    /// `len` bytes (zeroed) at guest physical address `gpa`.
    ///
    /// # Errors
    /// The memfd cannot be created, sized or mapped.
    pub fn new(gpa: u64, len: usize) -> Result<Self> {
        Self::with_flags(gpa, len, libc::MFD_CLOEXEC)
    }

    /// As [`Self::new`], in a memfd made with MFD_ALLOW_SEALING (QEMU's
    /// `memory-backend-memfd`), which a backend can seal against shrinking.
    ///
    /// # Errors
    /// The memfd cannot be created, sized or mapped.
    pub fn sealable(gpa: u64, len: usize) -> Result<Self> {
        Self::with_flags(gpa, len, libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
    }

    fn with_flags(gpa: u64, len: usize, flags: libc::c_uint) -> Result<Self> {
        // SAFETY: a NUL-terminated name and valid flags.
        let raw = unsafe { libc::memfd_create(c"devlend-test-ram".as_ptr(), flags) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: `raw` is a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: a new shared mapping of the whole memfd; nothing else is mapped there.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(GuestRam {
            fd,
            ptr: ptr.cast(),
            len,
            gpa,
        })
    }

    /// The memfd (to send with SET_MEM_TABLE).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The whole RAM as one memory-table entry.
    pub fn region(&self) -> Region {
        Region {
            gpa: self.gpa,
            size: self.len as u64,
            user_addr: self.ptr as u64,
            mmap_offset: 0,
        }
    }

    /// This process's address of guest physical address `gpa` (how SET_VRING_ADDR names
    /// rings).
    pub fn user_addr(&self, gpa: u64) -> u64 {
        self.ptr as u64 + (gpa - self.gpa)
    }

    fn at(&self, gpa: u64, len: usize) -> *mut u8 {
        let off = gpa
            .checked_sub(self.gpa)
            .filter(|o| o + len as u64 <= self.len as u64);
        match off {
            // SAFETY: the offset and `len` lie within the mapping.
            Some(o) => unsafe { self.ptr.add(o as usize) },
            None => panic!("guest address {gpa:#x}+{len} outside the test's RAM"),
        }
    }

    /// Writes `data` at `gpa`.
    pub fn write(&self, gpa: u64, data: &[u8]) {
        let p = self.at(gpa, data.len());
        // SAFETY: `p` has room for `data` (checked by `at`); the backend may access the
        // memory concurrently, as a device does guest memory: bytes only, no references.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
    }

    /// Reads `len` bytes at `gpa`.
    pub fn read(&self, gpa: u64, len: usize) -> Vec<u8> {
        let p = self.at(gpa, len);
        let mut out = vec![0u8; len];
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), len) };
        out
    }

    fn atomic_u16(&self, gpa: u64) -> &AtomicU16 {
        assert_eq!(gpa % 2, 0, "unaligned u16 at {gpa:#x}");
        let p = self.at(gpa, 2);
        // SAFETY: `p` is 2-aligned and in the mapping, which lives as long as `self`.
        unsafe { &*(p as *const AtomicU16) }
    }

    /// Reads the u16 at `gpa` (acquire: what the device wrote before it is visible).
    pub fn load_u16(&self, gpa: u64) -> u16 {
        u16::from_le(self.atomic_u16(gpa).load(Ordering::Acquire))
    }

    /// Writes the u16 at `gpa` (release: what was written before it is visible first).
    pub fn store_u16(&self, gpa: u64, v: u16) {
        self.atomic_u16(gpa).store(v.to_le(), Ordering::Release);
    }

    /// Reads the little-endian u32 at `gpa`.
    pub fn read_u32(&self, gpa: u64) -> u32 {
        let b = self.read(gpa, 4);
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A split virtqueue's rings in [`GuestRam`] (virtio 1.2 §2.7): guest physical
/// addresses of the descriptor table, the available and the used ring.
#[derive(Debug, Clone, Copy)]
pub struct SplitRing {
    /// Queue size.
    pub size: u16,
    /// Descriptor table.
    pub desc: u64,
    /// Available ring.
    pub avail: u64,
    /// Used ring.
    pub used: u64,
}

impl SplitRing {
    /// Rings of `size` entries from `base` (page-aligned parts).
    pub fn at(base: u64, size: u16) -> Self {
        let page = |x: u64| (x + 0xfff) & !0xfff;
        let desc = base;
        let avail = page(desc + 16 * u64::from(size));
        let used = page(avail + 6 + 2 * u64::from(size));
        SplitRing {
            size,
            desc,
            avail,
            used,
        }
    }

    /// Bytes from `desc` to the end of the used ring.
    pub fn span(&self) -> u64 {
        self.used + 6 + 8 * u64::from(self.size) - self.desc
    }

    /// Writes descriptor `i`.
    pub fn set_desc(&self, ram: &GuestRam, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = Vec::with_capacity(16);
        d.extend_from_slice(&addr.to_le_bytes());
        d.extend_from_slice(&len.to_le_bytes());
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&next.to_le_bytes());
        ram.write(self.desc + 16 * u64::from(i), &d);
    }

    /// The buffer address descriptor `i` holds.
    pub fn desc_addr(&self, ram: &GuestRam, i: u16) -> u64 {
        let b = ram.read(self.desc + 16 * u64::from(i), 8);
        u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }

    /// The avail ring's index.
    pub fn avail_idx(&self, ram: &GuestRam) -> u16 {
        ram.load_u16(self.avail + 2)
    }

    /// Offers `head` as the next entry of the avail ring and publishes it.
    pub fn offer(&self, ram: &GuestRam, head: u16) {
        let idx = self.avail_idx(ram);
        let slot = u64::from(idx % self.size);
        ram.write(self.avail + 4 + 2 * slot, &head.to_le_bytes());
        fence(Ordering::SeqCst);
        ram.store_u16(self.avail + 2, idx.wrapping_add(1));
    }

    /// Sets the avail ring's index (e.g. to a value no driver would write).
    pub fn set_avail_idx(&self, ram: &GuestRam, idx: u16) {
        ram.store_u16(self.avail + 2, idx);
    }

    /// The used ring's index.
    pub fn used_idx(&self, ram: &GuestRam) -> u16 {
        ram.load_u16(self.used + 2)
    }

    /// Sets the used ring's index (e.g. a stale value a previous driver left).
    pub fn set_used_idx(&self, ram: &GuestRam, idx: u16) {
        ram.store_u16(self.used + 2, idx);
    }

    /// The used element in slot `slot`: (head id, bytes written).
    pub fn used_elem(&self, ram: &GuestRam, slot: u16) -> (u32, u32) {
        let at = self.used + 4 + 8 * u64::from(slot % self.size);
        (ram.read_u32(at), ram.read_u32(at + 4))
    }

    /// Writes the used element in slot `slot` (e.g. garbage, to see it overwritten).
    pub fn set_used_elem(&self, ram: &GuestRam, slot: u16, id: u32, len: u32) {
        let at = self.used + 4 + 8 * u64::from(slot % self.size);
        ram.write(at, &[id.to_le_bytes(), len.to_le_bytes()].concat());
    }

    /// Zeroes the avail ring (flags, index, entries), as a new driver's fresh ring.
    pub fn clear_avail(&self, ram: &GuestRam) {
        ram.write(self.avail, &vec![0u8; 6 + 2 * usize::from(self.size)]);
    }

    /// Waits up to `timeout` for the used index to differ from `old`; returns it.
    pub fn wait_used_change(&self, ram: &GuestRam, old: u16, timeout: Duration) -> Option<u16> {
        let end = std::time::Instant::now() + timeout;
        loop {
            let now = self.used_idx(ram);
            if now != old {
                return Some(now);
            }
            if std::time::Instant::now() > end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// A virtqueue a raw frontend sets up: its rings in [`GuestRam`] and its kick, call
/// and error eventfds.
pub struct RawQueue {
    /// The vring index.
    pub index: u32,
    /// Its rings.
    pub ring: SplitRing,
    /// SET_VRING_KICK's eventfd (the frontend writes it).
    pub kick: vmm_sys_util::eventfd::EventFd,
    /// SET_VRING_CALL's.
    pub call: vmm_sys_util::eventfd::EventFd,
    /// SET_VRING_ERR's (the backend signals it when the ring is broken).
    pub err: vmm_sys_util::eventfd::EventFd,
}

impl RawQueue {
    /// Vring `index` with its rings of `size` entries from `base` (guest physical).
    ///
    /// # Panics
    /// An eventfd cannot be created.
    pub fn new(index: u32, base: u64, size: u16) -> Self {
        let ev = || vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        RawQueue {
            index,
            ring: SplitRing::at(base, size),
            kick: ev(),
            call: ev(),
            err: ev(),
        }
    }

    /// SET_VRING_NUM, _BASE `base`, _ADDR, _CALL, _ERR, _KICK, _ENABLE.
    ///
    /// # Errors
    /// A request fails or is refused.
    pub fn start(&self, fe: &mut RawFrontend, ram: &GuestRam, base: u32) -> Result<()> {
        let i = self.index;
        let r = self.ring;
        let acks = [
            ("NUM", fe.set_vring_num(i, u32::from(r.size))?),
            ("BASE", fe.set_vring_base(i, base)?),
            (
                "ADDR",
                fe.set_vring_addr(
                    i,
                    ram.user_addr(r.desc),
                    ram.user_addr(r.used),
                    ram.user_addr(r.avail),
                )?,
            ),
            (
                "CALL",
                fe.set_vring_fd(
                    req::SET_VRING_CALL,
                    u64::from(i),
                    Some(self.call.as_raw_fd()),
                )?,
            ),
            (
                "ERR",
                fe.set_vring_fd(req::SET_VRING_ERR, u64::from(i), Some(self.err.as_raw_fd()))?,
            ),
            (
                "KICK",
                fe.set_vring_fd(
                    req::SET_VRING_KICK,
                    u64::from(i),
                    Some(self.kick.as_raw_fd()),
                )?,
            ),
            ("ENABLE", fe.set_vring_enable(i, true)?),
        ];
        for (what, ack) in acks {
            if ack != 0 {
                bail!("SET_VRING_{what} of vring {i} refused: {ack}");
            }
        }
        Ok(())
    }

    /// Writes the kick eventfd.
    ///
    /// # Panics
    /// The eventfd cannot be written.
    pub fn kick(&self) {
        self.kick.write(1).expect("kick");
    }

    /// Whether the error eventfd is signalled within `timeout` (and clears it).
    pub fn err_signalled(&self, timeout: Duration) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.err.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        n == 1 && self.err.read().is_ok()
    }
}

/// The CPU time (user + system) process `pid` has used, in seconds.
///
/// # Panics
/// Its `/proc/PID/stat` cannot be read.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc stat");
    // Fields after "(comm) ": state is field 3; utime and stime are fields 14, 15.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime");
    // SAFETY: sysconf with a valid name.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks as f64 / hz
}

/// The share of one core process `pid` uses over the next `over`.
pub fn cpu_share(pid: u32, over: Duration) -> f64 {
    let t0 = cpu_seconds(pid);
    let start = std::time::Instant::now();
    std::thread::sleep(over);
    (cpu_seconds(pid) - t0) / start.elapsed().as_secs_f64()
}
