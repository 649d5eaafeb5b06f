#!/usr/bin/env python3
"""Hostile vhost-user frontend attacks against a devlend compute agent's vhost-user-blk socket.

usage: attacks.py SOCK1 AGENT_PID AGENT_LOG SOCK2 [attack-name ...]
After each attack: agent alive?, CPU over 3 s, log growth, fd count, a fresh session on
SOCK1 serving a READ, and (every attack) `devlend verify` on SOCK2.
"""
import os, sys, struct, time, socket, subprocess, errno, fcntl
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vu import *

SOCK1, PID, LOG, SOCK2 = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ONLY = sys.argv[5:]
DEVLEND = os.environ.get("DEVLEND", "devlend")
HZ = os.sysconf("SC_CLK_TCK")
results = []


def logsize():
    return os.path.getsize(LOG)


def nfds():
    try:
        return len(os.listdir("/proc/%d/fd" % PID))
    except OSError:
        return -1


def nthreads():
    try:
        return len(os.listdir("/proc/%d/task" % PID))
    except OSError:
        return -1


def verify_other():
    out = "/dev/shm/hostile-vhost-user-verify.out"
    t = time.time()
    r = subprocess.run(["nice", "-n", "19", DEVLEND, "verify", "--socket", SOCK2, "--queues", "2",
                        "--span", "1M", "--rounds", "1", "--seed", str(int(t) & 0xffff), "--out", out],
                       capture_output=True, text=True, timeout=120)
    return r.returncode == 0, time.time() - t, (r.stdout + r.stderr).strip()[-200:]


def fresh_read_ok():
    try:
        ram = GuestRam()
        fe, qs = setup(SOCK1, ram)
        ok = qs[0].read_ok(0) and qs[1].read_ok(0)
        fe.close()
        return ok
    except Exception as e:
        return "exc: %r" % e


def check(name, note=""):
    alive = alive_pid(PID)
    cpu = None
    if alive:
        c0 = agent_stats(PID)[0]; time.sleep(3); c1 = agent_stats(PID)[0]
        cpu = (c1 - c0) / HZ / 3 * 100
    lg = logsize() - LOG0[0]
    rd = fresh_read_ok() if alive else False
    vok, vt, vmsg = verify_other() if alive else (False, 0, "agent dead")
    r = dict(attack=name, alive=alive, cpu_pct=None if cpu is None else round(cpu, 1), log_growth=lg,
             fds=nfds(), threads=nthreads(), disk1_fresh_read=rd, disk2_verify=vok, verify_s=round(vt, 1), note=note)
    if not vok:
        r["verify_msg"] = vmsg
    print("RESULT", r, flush=True)
    results.append(r)
    LOG0[0] = logsize()


def ack_of(fe, req, payload=b"", fds=()):
    """Send with NEED_REPLY; return ack value, 'closed', or 'timeout'."""
    try:
        fe.send(req, payload, fds, F_VERSION | F_NEED_REPLY)
        r, f, p = fe.recv_msg()
        if len(p) == 8:
            return struct.unpack("<Q", p)[0]
        return ("reply", r, f, len(p))
    except Closed:
        return "closed"
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return "oserr %s" % e


def session_state(fe):
    return "session-alive" if fe.alive() else "session-dropped"


ATTACKS = {}


def attack(fn):
    ATTACKS[fn.__name__] = fn
    return fn


# ---------- ring attacks ----------
def ring_session():
    ram = GuestRam()
    fe, qs = setup(SOCK1, ram)
    assert qs[0].read_ok(0), "baseline read failed"
    return ram, fe, qs


def errfd_fired(q):
    try:
        return os.eventfd_read(q.errfd)
    except BlockingIOError:
        return 0


@attack
def avail_jump():
    ram, fe, qs = ring_session()
    q = qs[0]
    q.set_avail_idx(q.avail_idx + 5000)
    q.do_kick(); time.sleep(0.3)
    e = errfd_fired(q)
    q1 = qs[1].read_ok(0)
    note = "errfd=%d q1_ok=%s %s" % (e, q1, session_state(fe))
    fe.close(); return note


@attack
def head_out_of_range():
    ram, fe, qs = ring_session()
    q = qs[0]
    q.offer(500); q.do_kick(); time.sleep(0.3)
    note = "errfd=%d used=%d q1_ok=%s %s" % (errfd_fired(q), q.used_idx(), qs[1].read_ok(0), session_state(fe))
    fe.close(); return note


@attack
def chain_loop():
    ram, fe, qs = ring_session()
    q = qs[0]
    b = q.buf + 0x8000
    ram.w(b, struct.pack("<IIQ", 0, 0, 0))
    q.set_desc(10, b, 16, VRING_DESC_F_NEXT, 11)
    q.set_desc(11, b + 0x1000, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 10)
    u = q.used_idx()
    q.offer(10); q.do_kick(); time.sleep(0.3)
    note = "errfd=%d used %d->%d q1_ok=%s %s" % (errfd_fired(q), u, q.used_idx(), qs[1].read_ok(0), session_state(fe))
    fe.close(); return note


@attack
def desc_outside_memory():
    ram, fe, qs = ring_session()
    q = qs[0]
    notes = []
    for i, (addr, ln) in enumerate([(0x10000000, 16), (0xfffffffffffff000, 0x2000), (ram.size - 8, 16)]):
        h = 20 + 4 * i
        q.set_desc(h, addr, ln, VRING_DESC_F_NEXT, h + 1)
        q.set_desc(h + 1, q.buf + 0x3fff, 1, VRING_DESC_F_WRITE)
        u = q.used_idx(); q.offer(h); q.do_kick(); time.sleep(0.2)
        notes.append("used %d->%d st=%r" % (u, q.used_idx(), ram.r(q.buf + 0x3fff, 1)))
    # status descriptor itself outside memory
    b = q.buf
    ram.w(b, struct.pack("<IIQ", 0, 0, 0))
    q.set_desc(40, b, 16, VRING_DESC_F_NEXT, 41)
    q.set_desc(41, 0x20000000, 1, VRING_DESC_F_WRITE)
    u = q.used_idx(); q.offer(40); q.do_kick(); time.sleep(0.2)
    notes.append("status-outside used %d->%d" % (u, q.used_idx()))
    note = "; ".join(notes) + " errfd=%d q1_ok=%s %s" % (errfd_fired(q), qs[1].read_ok(0), session_state(fe))
    fe.close(); return note


@attack
def indirect_bad():
    ram, fe, qs = ring_session()
    q = qs[0]
    notes = []
    tbl = q.buf + 0x10000
    b = q.buf + 0x20000
    ram.w(b, struct.pack("<IIQ", 0, 0, 0))
    cases = [("len17", tbl, 17), ("len0", tbl, 0), ("outside", 0x30000000, 48), ("huge", tbl, 0xfffffff0)]
    for k, (nm, a, ln) in enumerate(cases):
        # a valid-ish 3-entry table
        ram.w(tbl, struct.pack("<QIHH", b, 16, VRING_DESC_F_NEXT, 1) + struct.pack("<QIHH", b + 0x1000, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2) + struct.pack("<QIHH", b + 0x3000, 1, VRING_DESC_F_WRITE, 0))
        h = 50 + k
        q.set_desc(h, a, ln, VRING_DESC_F_INDIRECT)
        u = q.used_idx(); q.offer(h); q.do_kick(); time.sleep(0.2)
        notes.append("%s used %d->%d" % (nm, u, q.used_idx()))
    # indirect table whose entries loop, and a nested indirect
    ram.w(tbl, struct.pack("<QIHH", b, 16, VRING_DESC_F_NEXT, 1) + struct.pack("<QIHH", b + 0x1000, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 0) + bytes(16))
    q.set_desc(60, tbl, 48, VRING_DESC_F_INDIRECT)
    u = q.used_idx(); q.offer(60); q.do_kick(); time.sleep(0.2)
    notes.append("loop-in-table used %d->%d" % (u, q.used_idx()))
    ram.w(tbl, struct.pack("<QIHH", tbl, 48, VRING_DESC_F_INDIRECT, 0))
    q.set_desc(61, tbl, 16, VRING_DESC_F_INDIRECT)
    u = q.used_idx(); q.offer(61); q.do_kick(); time.sleep(0.2)
    notes.append("nested used %d->%d" % (u, q.used_idx()))
    note = "; ".join(notes) + " errfd=%d q1_ok=%s %s" % (errfd_fired(q), qs[1].read_ok(0), session_state(fe))
    fe.close(); return note


@attack
def bad_requests_in_good_chains():
    """Well-formed chains, malformed requests: should complete with IOERR/UNSUPP, queue goes on."""
    ram, fe, qs = ring_session()
    q = qs[0]
    notes = []
    for nm, typ, sector, ln in [("past-end", 0, 1 << 40, 4096), ("odd-len", 0, 0, 513), ("type99", 99, 0, 512),
                                 ("sector-overflow", 1, 0xffffffffffffffff, 4096), ("write-4GiB-1", 1, 0, 0xffffffff)]:
        st = q.lay_read(0, sector, min(ln, 0x2000) if ln != 0xffffffff else 0x1000, typ)
        if ln == 0xffffffff:
            q.set_desc(1, q.buf + 0x1000, 0xffffffff, VRING_DESC_F_NEXT, 2)
        if nm == "odd-len":
            q.set_desc(1, q.buf + 0x1000, 513, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2)
        u = q.used_idx(); q.offer(0); q.do_kick(); q.wait_used(u + 1, 1)
        notes.append("%s used %d->%d st=%r" % (nm, u, q.used_idx(), ram.r(st, 1)))
    notes.append("after: read_ok=%s" % q.read_ok(0))
    note = "; ".join(notes) + " %s" % session_state(fe)
    fe.close(); return note


@attack
def bad_kick_flood():
    """Break queue 0 (head >= size) then kick it 100000 times; also a flood of IOERR requests on q1."""
    ram, fe, qs = ring_session()
    q = qs[0]
    q.offer(999)
    t = time.time()
    for _ in range(100000):
        os.eventfd_write(q.kick, 1)
    t1 = time.time() - t
    # 20000 malformed-but-valid-chain requests on q1 (read past the end)
    q1 = qs[1]
    n = 0
    t = time.time()
    while n < 20000 and time.time() - t < 60:
        st = q1.lay_read(0, 1 << 40, 512)
        u = q1.used_idx(); q1.offer(0); q1.do_kick()
        if not q1.wait_used(u + 1, 2):
            break
        n += 1
    note = "100000 kicks in %.1fs; %d IOERR requests on q1 in %.1fs; %s" % (t1, n, time.time() - t, session_state(fe))
    fe.close(); return note


@attack
def break_reset_cycle_flood():
    """Break a queue, reset it (GET_VRING_BASE + re-init), break it again: 300 times. Log must stay bounded."""
    ram, fe, qs = ring_session()
    q = qs[0]
    t = time.time()
    done = 0
    for k in range(300):
        q.offer(999); q.do_kick()
        try:
            fe.get_vring_base(0)
        except Exception as e:
            return "GET_VRING_BASE failed at %d: %r" % (k, e)
        q.avail_idx = 0
        ram.w(q.desc, bytes(q.used + 6 + 8 * q.n - q.desc))
        q.start(fe)
        done += 1
    note = "%d cycles in %.1fs; final read_ok=%s %s" % (done, time.time() - t, q.read_ok(0), session_state(fe))
    fe.close(); return note


# ---------- message attacks ----------
def msg_session(pf=PF_MQ | PF_REPLY_ACK | PF_CONFIG, mem=True):
    ram = GuestRam()
    fe = Frontend(SOCK1)
    fe.negotiate(pf)
    if mem:
        fe.mem_table([ram.region()], [ram.fd])
    return ram, fe


@attack
def vring_num_values():
    ram, fe = msg_session()
    out = []
    for n in [0, 3, 100, 65535, 32768, 2048, 1024, 1]:
        out.append("%d:%s" % (n, ack_of(fe, SET_VRING_NUM, struct.pack("<II", 0, n))))
    note = " ".join(out) + " " + session_state(fe)
    fe.close(); return note


@attack
def config_attacks():
    ram, fe = msg_session()
    out = []
    for nm, off, size in [("ovf", 0xfffffff8, 16), ("size0", 0, 0), ("big", 0, 4096), ("past", 60, 8), ("ok", 0, 8)]:
        try:
            fe.send(GET_CONFIG, struct.pack("<III", off, size, 0) + bytes(size))
            r, f, p = fe.recv_msg()
            out.append("GET %s -> %d bytes" % (nm, len(p)))
        except Exception as e:
            out.append("GET %s -> %r" % (nm, e))
            fe = msg_session()[1]
    # size field disagreeing with payload
    try:
        fe.send(GET_CONFIG, struct.pack("<III", 0, 200, 0) + bytes(8))
        r, f, p = fe.recv_msg()
        out.append("GET size200/payload8 -> %d bytes" % len(p))
    except Exception as e:
        out.append("GET size200/payload8 -> %r" % e)
        fe = msg_session()[1]
    for nm, off, size in [("capacity", 0, 8), ("ovf", 0xfffffffc, 8), ("size0", 0, 0), ("num_queues", 34, 2), ("wce", 32, 1)]:
        out.append("SET %s -> %s" % (nm, ack_of(fe, SET_CONFIG, struct.pack("<III", off, size, 0) + b"\xff" * size)))
    # read capacity back
    try:
        fe.send(GET_CONFIG, struct.pack("<III", 0, 8, 0) + bytes(8))
        r, f, p = fe.recv_msg()
        out.append("capacity now %r" % (p[12:20].hex(),))
    except Exception as e:
        out.append("capacity read %r" % e)
    note = "; ".join(str(x) for x in out) + " " + session_state(fe)
    fe.close(); return note


@attack
def mem_table_attacks():
    ram, fe = msg_session(mem=False)
    out = []
    mk = lambda: GuestRam(1 << 20)
    rams = [mk() for _ in range(10)]
    regs = [r.region(gpa=i << 20, uaddr=UADDR_BASE + (i << 20)) for i, r in enumerate(rams)]
    def mt(regions, fds):
        p = struct.pack("<II", len(regions), 0)
        for (g, s, u, o) in regions:
            p += struct.pack("<QQQQ", g, s, u, o)
        return ack_of(fe, SET_MEM_TABLE, p, fds)
    out.append("9regions:%s" % mt(regs[:9], [r.fd for r in rams[:9]]))
    out.append("2regs1fd:%s" % mt(regs[:2], [rams[0].fd]))
    out.append("1reg2fd:%s" % mt(regs[:1], [rams[0].fd, rams[1].fd]))
    out.append("overlap-gpa:%s" % mt([regs[0], (0x80000, 1 << 20, UADDR_BASE + (5 << 20), 0)], [rams[0].fd, rams[1].fd]))
    out.append("overlap-uaddr:%s" % mt([regs[0], (5 << 20, 1 << 20, UADDR_BASE + 0x80000, 0)], [rams[0].fd, rams[1].fd]))
    out.append("bigger-than-memfd:%s" % mt([(0, 2 << 20, UADDR_BASE, 0)], [rams[0].fd]))
    out.append("offset-past-end:%s" % mt([(0, 1 << 20, UADDR_BASE, 1 << 20)], [rams[0].fd]))
    out.append("size0:%s" % mt([(0, 0, UADDR_BASE, 0)], [rams[0].fd]))
    out.append("gpa-wrap:%s" % mt([(0xfffffffffff00000, 2 << 20, UADDR_BASE, 0)], [rams[0].fd]))
    out.append("uaddr-wrap:%s" % mt([(0, 1 << 20, 0xfffffffffff80000, 0)], [rams[0].fd]))
    out.append("0regions:%s" % mt([], []))
    out.append("nregions=1000-short-payload:%s" % ack_of(fe, SET_MEM_TABLE, struct.pack("<II", 1000, 0) + struct.pack("<QQQQ", *regs[0]), [rams[0].fd]))
    pfd_r, pfd_w = os.pipe()
    out.append("pipe-fd:%s" % mt([(0, 1 << 20, UADDR_BASE, 0)], [pfd_r]))
    rofd = os.open("/proc/self/exe", os.O_RDONLY)
    out.append("readonly-file-fd:%s" % mt([(0, 4096, UADDR_BASE, 0)], [rofd]))
    os.close(rofd); os.close(pfd_r); os.close(pfd_w)
    out.append("good:%s" % mt([regs[0]], [rams[0].fd]))
    note = " ".join(str(x) for x in out) + " " + session_state(fe)
    fe.close(); return note


@attack
def vring_addr_and_index():
    ram, fe = msg_session()
    out = []
    fe.vring_num(0, 128)
    out.append("addr-outside:%s" % ack_of(fe, SET_VRING_ADDR, struct.pack("<IIQQQQ", 0, 0, 0x1000, 0x2000, 0x3000, 0)))
    out.append("addr-straddle:%s" % ack_of(fe, SET_VRING_ADDR, struct.pack("<IIQQQQ", 0, 0, UADDR_BASE + ram.size - 16, UADDR_BASE + 0x2000, UADDR_BASE + 0x3000, 0)))
    out.append("addr-unaligned:%s" % ack_of(fe, SET_VRING_ADDR, struct.pack("<IIQQQQ", 0, 0, UADDR_BASE + 1, UADDR_BASE + 0x2001, UADDR_BASE + 0x3001, 0)))
    out.append("addr-wrap:%s" % ack_of(fe, SET_VRING_ADDR, struct.pack("<IIQQQQ", 0, 0, 0xfffffffffffffff0, UADDR_BASE, UADDR_BASE, 0)))
    for i in [2, 16, 0xffff, 0xffffffff]:
        out.append("num[%x]:%s" % (i, ack_of(fe, SET_VRING_NUM, struct.pack("<II", i, 128))))
        out.append("base[%x]:%s" % (i, ack_of(fe, SET_VRING_BASE, struct.pack("<II", i, 0))))
        out.append("enable[%x]:%s" % (i, ack_of(fe, SET_VRING_ENABLE, struct.pack("<II", i, 1))))
    efd = os.eventfd(0)
    for i in [2, 0xff, 0x1ff, 0xffffffffffffffff]:
        out.append("kick[%x]:%s" % (i, ack_of(fe, SET_VRING_KICK, struct.pack("<Q", i), [efd])))
    try:
        fe.send(GET_VRING_BASE, struct.pack("<II", 7, 0))
        r, f, p = fe.recv_msg()
        out.append("getbase[7]: %d bytes" % len(p))
    except Exception as e:
        out.append("getbase[7]: %r" % e)
    os.close(efd)
    note = " ".join(str(x) for x in out) + " " + session_state(fe)
    fe.close(); return note


@attack
def before_set_owner():
    fe = Frontend(SOCK1)
    out = []
    pf = fe.get_u64(GET_PROTOCOL_FEATURES)
    fe.send(SET_PROTOCOL_FEATURES, struct.pack("<Q", PF_REPLY_ACK | PF_MQ | PF_CONFIG)); fe.reply_ack = True
    ram = GuestRam()
    for nm, req, p, fds in [("SET_FEATURES", SET_FEATURES, struct.pack("<Q", VIRTIO_F_VERSION_1), ()),
                            ("SET_MEM_TABLE", SET_MEM_TABLE, struct.pack("<II", 1, 0) + struct.pack("<QQQQ", *ram.region()), (ram.fd,)),
                            ("SET_VRING_NUM", SET_VRING_NUM, struct.pack("<II", 0, 128), ())]:
        out.append("%s:%s" % (nm, ack_of(fe, req, p, fds)))
    note = " ".join(str(x) for x in out) + " " + session_state(fe)
    fe.close(); return note


@attack
def garbage_and_framing():
    out = []
    # pure garbage
    s = socket.socket(socket.AF_UNIX); s.connect(SOCK1); s.sendall(os.urandom(4096)); time.sleep(0.2)
    s.settimeout(1)
    try:
        out.append("garbage->%r" % s.recv(100)[:20])
    except Exception as e:
        out.append("garbage->%r" % e)
    s.close()
    # huge size field
    fe = Frontend(SOCK1); fe.send(GET_FEATURES, b"", size=0xffffffff)
    out.append("hugesize->%s" % session_state(fe)); fe.close()
    fe = Frontend(SOCK1); fe.send(SET_MEM_TABLE, b"\x00" * 100, size=0x10000)
    out.append("size>payload->%s" % session_state(fe)); fe.close()
    # close mid-message
    for _ in range(50):
        fe = Frontend(SOCK1); fe.s.sendall(struct.pack("<III", SET_MEM_TABLE, 1, 200) + b"\x01\x00")
        fe.close()
    # bad version flags, unknown request with NEED_REPLY, request 0
    fe = Frontend(SOCK1); fe.negotiate()
    out.append("flags=0x2:%s" % ack_of(fe, SET_VRING_NUM, b"") if False else "")
    fe.send(GET_FEATURES, flags=0x2)
    out.append("badversion->%s" % session_state(fe)); fe.close()
    fe = Frontend(SOCK1); fe.negotiate()
    out.append("req200:%s" % ack_of(fe, 200, b"\x00" * 8))
    fe.close()
    fe = Frontend(SOCK1); fe.negotiate()
    out.append("req0:%s" % ack_of(fe, 0, b""))
    fe.close()
    # too many fds (253 fds with one message)
    fe = Frontend(SOCK1); fe.negotiate()
    efds = [os.eventfd(0) for _ in range(250)]
    try:
        out.append("250fds:%s" % ack_of(fe, SET_VRING_KICK, struct.pack("<Q", 0), efds))
    except OSError as e:
        out.append("250fds send: %r" % e)
    for e in efds: os.close(e)
    out.append(session_state(fe)); fe.close()
    # many idle connections held open
    conns = []
    for _ in range(200):
        try:
            c = socket.socket(socket.AF_UNIX); c.connect(SOCK1); conns.append(c)
        except OSError as e:
            out.append("conn %d: %r" % (len(conns), e)); break
    out.append("held %d idle conns, threads=%d" % (len(conns), nthreads()))
    for c in conns: c.close()
    return " ".join(x for x in out if x)


@attack
def fd_leak_refused():
    """Refused messages carrying fds, 2000 times: do the fds leak in the agent?"""
    ram, fe = msg_session()
    f0 = nfds()
    efd = os.eventfd(0)
    acks = set()
    for k in range(2000):
        a = ack_of(fe, SET_VRING_KICK, struct.pack("<Q", 5), [efd])  # index out of range
        acks.add(str(a))
        a = ack_of(fe, SET_VRING_CALL, struct.pack("<Q", 0x105), [efd])  # no-fd flag and an fd
        acks.add(str(a))
    f1 = nfds()
    note = "agent fds %d -> %d during (acks %s) %s" % (f0, f1, acks, session_state(fe))
    fe.close(); os.close(efd)
    time.sleep(0.5)
    return note + " after close %d" % nfds()


# ---------- hostile fd kinds ----------
@attack
def kick_fd_pipe_hup():
    """Kick fd = read end of a pipe whose write end is closed: always readable (EOF/HUP)."""
    ram = GuestRam(); fe = Frontend(SOCK1); fe.negotiate(); fe.mem_table([ram.region()], [ram.fd])
    q0 = Queue(ram, 0); q1 = Queue(ram, 1)
    r, w = os.pipe(); os.close(w)
    q0.kick = r
    q0.start(fe); q1.start(fe)
    time.sleep(0.5)
    note = "q1_ok=%s %s" % (q1.read_ok(0), session_state(fe))
    return note + " (session kept open during check)", fe


@attack
def kick_fd_regular_file():
    ram = GuestRam(); fe = Frontend(SOCK1); fe.negotiate(); fe.mem_table([ram.region()], [ram.fd])
    q0 = Queue(ram, 0); q1 = Queue(ram, 1)
    mf = os.memfd_create("x")
    out = []
    fe.vring_num(0, 128); fe.vring_base(0, 0)
    fe.vring_addr(0, UADDR_BASE + q0.desc, UADDR_BASE + q0.used, UADDR_BASE + q0.avail)
    out.append("kick=memfd:%s" % ack_of(fe, SET_VRING_KICK, struct.pack("<Q", 0), [mf]))
    out.append("call=memfd:%s" % ack_of(fe, SET_VRING_CALL, struct.pack("<Q", 0), [mf]))
    sp = socket.socketpair()
    out.append("kick=socket:%s" % ack_of(fe, SET_VRING_KICK, struct.pack("<Q", 0), [sp[0].fileno()]))
    sp[1].send(b"x" * 100)
    time.sleep(0.5)
    q1.start(fe)
    out.append("q1_ok=%s" % q1.read_ok(0))
    return " ".join(str(x) for x in out) + " " + session_state(fe), (fe, sp)


@attack
def call_fd_blocking_full():
    """Call fd = a blocking pipe that is full: the worker's write() to signal used blocks."""
    ram = GuestRam(); fe = Frontend(SOCK1); fe.negotiate(); fe.mem_table([ram.region()], [ram.fd])
    q0 = Queue(ram, 0); q1 = Queue(ram, 1)
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETFL, os.O_NONBLOCK)
    try:
        while True:
            os.write(w, b"x" * 65536)
    except BlockingIOError:
        pass
    fcntl.fcntl(w, fcntl.F_SETFL, 0)  # back to blocking (file status flags are shared)
    q0.callfd = w
    q0.start(fe); q1.start(fe)
    ok0 = q0.read_ok(0)
    ok1 = q1.read_ok(0)
    t = time.time()
    try:
        fe.s.settimeout(10)
        gb = fe.get_vring_base(0)
        gbn = "GET_VRING_BASE answered %r in %.1fs" % (gb, time.time() - t)
    except Exception as e:
        gbn = "GET_VRING_BASE: %r after %.1fs" % (e, time.time() - t)
    note = "q0_read=%s q1_read=%s %s" % (ok0, ok1, gbn)
    return note, (fe, r, w)


@attack
def call_fd_eventfd_saturated():
    """Call fd = a blocking eventfd at 0xfffffffffffffffe: eventfd write(1) blocks."""
    ram = GuestRam(); fe = Frontend(SOCK1); fe.negotiate(); fe.mem_table([ram.region()], [ram.fd])
    q0 = Queue(ram, 0); q1 = Queue(ram, 1)
    e = os.eventfd(0)  # blocking
    os.eventfd_write(e, 0xfffffffffffffffe)
    q0.callfd = e
    q0.start(fe); q1.start(fe)
    ok0 = q0.read_ok(0)
    ok1 = q1.read_ok(0)
    t = time.time()
    try:
        fe.s.settimeout(10)
        gb = fe.get_vring_base(0)
        gbn = "GET_VRING_BASE answered %r in %.1fs" % (gb, time.time() - t)
    except Exception as ex:
        gbn = "GET_VRING_BASE: %r after %.1fs" % (ex, time.time() - t)
    return "q0_read=%s q1_read=%s %s" % (ok0, ok1, gbn), (fe, e)


# ---------- memory that shrinks under the agent (expected to be fatal) ----------
@attack
def inflight_fd_shrunk():
    """GET_INFLIGHT_FD (the agent's own memfd, unsealed), SET_INFLIGHT_FD, ftruncate it to 0, kick a request."""
    ram = GuestRam(); fe = Frontend(SOCK1)
    fe.negotiate(PF_MQ | PF_REPLY_ACK | PF_CONFIG | PF_INFLIGHT)
    fe.mem_table([ram.region()], [ram.fd])
    fe.send(GET_INFLIGHT_FD, struct.pack("<QQHH", 0, 0, 2, 128) + b"\0\0\0\0")
    r, f, p, fds = fe.recv_msg(with_fds=True)
    size, off, nq, qs = struct.unpack("<QQHH", p[:20])
    ifd = fds[0]
    try:
        seals = fcntl.fcntl(ifd, 1034)  # F_GET_SEALS
    except OSError as e:
        seals = "err %s" % e
    a = fe.call(SET_INFLIGHT_FD, p, [ifd])
    q0 = Queue(ram, 0); q1 = Queue(ram, 1); q0.start(fe); q1.start(fe)
    ok = q0.read_ok(0)
    os.ftruncate(ifd, 0)
    q1.read_ok(0)
    time.sleep(0.5)
    return "inflight mmap_size=%d seals=%s set_ack=%s first_read=%s ; after ftruncate(0) agent alive=%s" % (size, seals, a, ok, alive_pid(PID))


@attack
def guest_ram_shrunk():
    """SET_MEM_TABLE with an unsealed memfd, then ftruncate it to 0 and kick a request."""
    ram = GuestRam()
    fe, qs = setup(SOCK1, ram)
    ok = qs[0].read_ok(0)
    os.ftruncate(ram.fd, 0)
    try:
        os.eventfd_write(qs[0].kick, 1)
    except Exception:
        pass
    time.sleep(0.5)
    return "first_read=%s ; after ftruncate(0)+kick agent alive=%s" % (ok, alive_pid(PID))


LOG0 = [logsize()]
if __name__ == "__main__":
    names = ONLY or [n for n in ATTACKS if n not in ("inflight_fd_shrunk", "guest_ram_shrunk")]
    check("baseline")
    for n in names:
        print("=== %s" % n, flush=True)
        keep = None
        try:
            res = ATTACKS[n]()
            if isinstance(res, tuple):
                res, keep = res
        except Exception as e:
            import traceback; traceback.print_exc()
            res = "attack raised %r" % e
        print("NOTE", n, res, flush=True)
        check(n, res)
        keep = None
        if not alive_pid(PID):
            print("AGENT DEAD after", n); break
    print("SUMMARY")
    for r in results:
        print(r)
