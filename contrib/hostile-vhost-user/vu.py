"""Minimal raw vhost-user frontend for hostile testing of devlend's compute agent."""
import os, socket, struct, mmap, time, select

GET_FEATURES=1; SET_FEATURES=2; SET_OWNER=3; RESET_OWNER=4; SET_MEM_TABLE=5
SET_LOG_BASE=6; SET_LOG_FD=7; SET_VRING_NUM=8; SET_VRING_ADDR=9; SET_VRING_BASE=10
GET_VRING_BASE=11; SET_VRING_KICK=12; SET_VRING_CALL=13; SET_VRING_ERR=14
GET_PROTOCOL_FEATURES=15; SET_PROTOCOL_FEATURES=16; GET_QUEUE_NUM=17; SET_VRING_ENABLE=18
SET_BACKEND_REQ_FD=21; GET_CONFIG=24; SET_CONFIG=25; GET_INFLIGHT_FD=31; SET_INFLIGHT_FD=32
RESET_DEVICE=34; VRING_KICK=35; GET_MAX_MEM_SLOTS=36; ADD_MEM_REG=37; REM_MEM_REG=38
SET_STATUS=39; GET_STATUS=40

F_VERSION = 0x1; F_REPLY = 0x4; F_NEED_REPLY = 0x8
VIRTIO_F_VERSION_1 = 1 << 32
VHOST_USER_F_PROTOCOL_FEATURES = 1 << 30
VIRTIO_RING_F_INDIRECT_DESC = 1 << 28
VIRTIO_RING_F_EVENT_IDX = 1 << 29
PF_MQ=1<<0; PF_REPLY_ACK=1<<3; PF_CONFIG=1<<9; PF_INFLIGHT=1<<12; PF_MEM_SLOTS=1<<15

VRING_DESC_F_NEXT=1; VRING_DESC_F_WRITE=2; VRING_DESC_F_INDIRECT=4
UADDR_BASE = 0x7f0000000000  # the VMM virtual address of guest phys 0


class Closed(Exception):
    pass


class GuestRam:
    def __init__(self, size=4 << 20, name="guest", seal=False):
        flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seal else 0)
        self.fd = os.memfd_create(name, flags)
        os.ftruncate(self.fd, size)
        self.size = size
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def w(self, gpa, data):
        self.mm[gpa:gpa + len(data)] = data

    def r(self, gpa, n):
        return bytes(self.mm[gpa:gpa + n])

    def region(self, gpa=0, size=None, uaddr=UADDR_BASE, off=0):
        return (gpa, self.size if size is None else size, uaddr, off)


class Frontend:
    def __init__(self, path, timeout=3.0):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.connect(path)
        self.s.settimeout(timeout)
        self.reply_ack = False

    def close(self):
        try:
            self.s.close()
        except Exception:
            pass

    def send(self, req, payload=b"", fds=(), flags=F_VERSION, size=None):
        hdr = struct.pack("<III", req, flags, len(payload) if size is None else size)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("%di" % len(fds), *fds))] if fds else []
        self.s.sendmsg([hdr + payload], anc)

    def recv_exact(self, n):
        buf = b""
        while len(buf) < n:
            c = self.s.recv(n - len(buf))
            if not c:
                raise Closed("backend closed the connection")
            buf += c
        return buf

    def recv_msg(self, with_fds=False):
        msg, anc, _, _ = self.s.recvmsg(12, socket.CMSG_SPACE(8 * 4))
        if not msg:
            raise Closed("backend closed the connection")
        if len(msg) < 12:
            msg += self.recv_exact(12 - len(msg))
        req, flags, size = struct.unpack("<III", msg)
        payload = self.recv_exact(size) if size else b""
        fds = []
        for lvl, typ, data in anc:
            if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                fds += list(struct.unpack("%di" % (len(data) // 4), data[:len(data) - len(data) % 4]))
        return (req, flags, payload, fds) if with_fds else (req, flags, payload)

    # request/response helpers
    def call(self, req, payload=b"", fds=(), need_reply=None):
        """Send; if REPLY_ACK is on (or need_reply) wait for the ack; returns the ack u64 or None."""
        nr = self.reply_ack if need_reply is None else need_reply
        self.send(req, payload, fds, F_VERSION | (F_NEED_REPLY if nr else 0))
        if nr:
            r, f, p = self.recv_msg()
            assert r == req, ("reply to", r, "expected", req)
            return struct.unpack("<Q", p)[0]
        return None

    def get_u64(self, req):
        self.send(req)
        r, f, p = self.recv_msg()
        assert r == req, (r, req)
        return struct.unpack("<Q", p)[0]

    def negotiate(self, pf_want=PF_MQ | PF_REPLY_ACK | PF_CONFIG, feat_mask=None):
        feats = self.get_u64(GET_FEATURES)
        self.features = feats
        pf = self.get_u64(GET_PROTOCOL_FEATURES)
        self.pf = pf & pf_want
        self.send(SET_PROTOCOL_FEATURES, struct.pack("<Q", self.pf))
        self.reply_ack = bool(self.pf & PF_REPLY_ACK)
        self.call(SET_OWNER)
        use = feats if feat_mask is None else feats & feat_mask
        use &= ~VIRTIO_RING_F_EVENT_IDX
        self.call(SET_FEATURES, struct.pack("<Q", use))
        return feats, pf

    def mem_table(self, regions, fds):
        p = struct.pack("<II", len(regions), 0)
        for (gpa, size, uaddr, off) in regions:
            p += struct.pack("<QQQQ", gpa, size, uaddr, off)
        return self.call(SET_MEM_TABLE, p, fds)

    def vring_num(self, i, n):
        return self.call(SET_VRING_NUM, struct.pack("<II", i, n))

    def vring_base(self, i, n):
        return self.call(SET_VRING_BASE, struct.pack("<II", i, n))

    def vring_addr(self, i, desc, used, avail, flags=0):
        return self.call(SET_VRING_ADDR, struct.pack("<IIQQQQ", i, flags, desc, used, avail, 0))

    def vring_fd(self, req, i, fd=None):
        if fd is None:
            return self.call(req, struct.pack("<Q", i | 0x100))
        return self.call(req, struct.pack("<Q", i), [fd])

    def vring_enable(self, i, on=1):
        return self.call(SET_VRING_ENABLE, struct.pack("<II", i, on))

    def get_vring_base(self, i):
        self.send(GET_VRING_BASE, struct.pack("<II", i, 0))
        r, f, p = self.recv_msg()
        return struct.unpack("<II", p)

    def alive(self):
        """A GET_FEATURES round trip: True if the session answers."""
        try:
            self.get_u64(GET_FEATURES)
            return True
        except Exception:
            return False


class Queue:
    """A split virtqueue in guest RAM: desc at base, avail after, used page-aligned."""
    def __init__(self, ram, index, size=128, base=None, bufbase=None):
        self.ram, self.i, self.n = ram, index, size
        self.desc = base if base is not None else index * 0x10000
        self.avail = self.desc + 16 * size
        self.used = (self.avail + 6 + 2 * size + 4095) // 4096 * 4096
        self.buf = bufbase if bufbase is not None else (1 << 20) + index * (1 << 20)
        self.kick = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.callfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.errfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.avail_idx = 0
        self.used_seen = 0
        ram.w(self.desc, bytes(self.used + 6 + 8 * size - self.desc))

    def start(self, fe, num=None):
        fe.vring_num(self.i, self.n if num is None else num)
        fe.vring_base(self.i, 0)
        fe.vring_addr(self.i, UADDR_BASE + self.desc, UADDR_BASE + self.used, UADDR_BASE + self.avail)
        fe.vring_fd(SET_VRING_CALL, self.i, self.callfd)
        fe.vring_fd(SET_VRING_ERR, self.i, self.errfd)
        fe.vring_fd(SET_VRING_KICK, self.i, self.kick)
        fe.vring_enable(self.i, 1)

    def set_desc(self, idx, addr, length, flags, nxt=0):
        self.ram.w(self.desc + 16 * idx, struct.pack("<QIHH", addr, length, flags, nxt))

    def offer(self, head, bump=1):
        self.ram.w(self.avail + 4 + 2 * (self.avail_idx % self.n), struct.pack("<H", head))
        self.avail_idx = (self.avail_idx + bump) & 0xffff
        self.ram.w(self.avail + 2, struct.pack("<H", self.avail_idx))

    def set_avail_idx(self, v):
        self.avail_idx = v & 0xffff
        self.ram.w(self.avail + 2, struct.pack("<H", self.avail_idx))

    def do_kick(self):
        os.eventfd_write(self.kick, 1)

    def used_idx(self):
        return struct.unpack("<H", self.ram.r(self.used + 2, 2))[0]

    def used_elem(self, k):
        return struct.unpack("<II", self.ram.r(self.used + 4 + 8 * (k % self.n), 8))

    def lay_read(self, head, sector=0, length=4096, typ=0):
        """3-descriptor request at descs head..head+2; buffers in this queue's buf area per head."""
        b = self.buf + (head % 64) * 0x4000
        self.ram.w(b, struct.pack("<IIQ", typ, 0, sector))
        self.ram.w(b + 0x3fff, b"\xee")
        self.set_desc(head, b, 16, VRING_DESC_F_NEXT, head + 1)
        if length:
            self.set_desc(head + 1, b + 0x1000, length,
                          VRING_DESC_F_NEXT | (VRING_DESC_F_WRITE if typ == 0 else 0), head + 2)
            self.set_desc(head + 2, b + 0x3fff, 1, VRING_DESC_F_WRITE)
        else:
            self.set_desc(head, b, 16, VRING_DESC_F_NEXT, head + 1)
            self.set_desc(head + 1, b + 0x3fff, 1, VRING_DESC_F_WRITE)
        return b + 0x3fff

    def wait_used(self, target, timeout=3.0):
        t = time.time() + timeout
        while time.time() < t:
            if self.used_idx() == target & 0xffff:
                return True
            time.sleep(0.005)
        return False

    def read_ok(self, head=0):
        st = self.lay_read(head)
        before = self.used_idx()
        self.offer(head)
        self.do_kick()
        ok = self.wait_used(before + 1)
        return ok and self.ram.r(st, 1) == b"\x00"


def agent_stats(pid):
    with open("/proc/%d/stat" % pid) as f:
        s = f.read()
    fields = s[s.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12]), fields[0]


def alive_pid(pid):
    try:
        os.kill(pid, 0)
        st = agent_stats(pid)[1]
        return st != "Z"
    except OSError:
        return False


def setup(path, ram, nq=2, qsize=128, pf=PF_MQ | PF_REPLY_ACK | PF_CONFIG):
    fe = Frontend(path)
    fe.negotiate(pf)
    fe.mem_table([ram.region()], [ram.fd])
    qs = []
    for i in range(nq):
        q = Queue(ram, i, qsize)
        q.start(fe)
        qs.append(q)
    return fe, qs
