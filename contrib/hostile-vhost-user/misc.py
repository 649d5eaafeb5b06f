#!/usr/bin/env python3
"""Smaller probes. usage: misc.py SOCK AGENT_PID AGENT_LOG probe"""
import os, sys, time, struct, socket
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vu import *
sock, pid, log, probe = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def nfds(): return len(os.listdir("/proc/%d/fd" % pid))
def rss():
    for l in open("/proc/%d/status" % pid):
        if l.startswith("VmRSS"): return l.split()[1] + " kB"
l0 = os.path.getsize(log); t0 = time.time()
if probe == "connect_flood":          # connect + close as fast as possible for 10 s
    n = 0
    while time.time() - t0 < 10:
        s = socket.socket(socket.AF_UNIX); s.connect(sock); s.close(); n += 1
    print("connect/close %d times" % n)
elif probe == "inflight_repeat":      # GET_INFLIGHT_FD 3000 times on one session: leaks?
    f0, r0 = nfds(), rss()
    fe = Frontend(sock); fe.negotiate(PF_MQ | PF_REPLY_ACK | PF_CONFIG | PF_INFLIGHT)
    for i in range(3000):
        fe.send(GET_INFLIGHT_FD, struct.pack("<QQHH", 0, 0, 16, 1024) + b"\0" * 4)
        r, f, p, fds = fe.recv_msg(with_fds=True)
        for x in fds: os.close(x)
    print("agent fds %d -> %d, RSS %s -> %s, inflight size %d" % (f0, nfds(), r0, rss(), struct.unpack("<Q", p[:8])[0]))
    fe.close()
elif probe == "before_owner":         # proper negotiation with REPLY_ACK, then requests before SET_OWNER
    fe = Frontend(sock)
    feats = fe.get_u64(GET_FEATURES); pf = fe.get_u64(GET_PROTOCOL_FEATURES)
    fe.send(SET_PROTOCOL_FEATURES, struct.pack("<Q", PF_REPLY_ACK | PF_MQ | PF_CONFIG))
    ram = GuestRam(); out = []
    for nm, req, p, fds in [("SET_VRING_NUM", SET_VRING_NUM, struct.pack("<II", 0, 128), ()),
                            ("SET_MEM_TABLE", SET_MEM_TABLE, struct.pack("<II", 1, 0) + struct.pack("<QQQQ", *ram.region()), (ram.fd,)),
                            ("SET_FEATURES", SET_FEATURES, struct.pack("<Q", VIRTIO_F_VERSION_1 | VHOST_USER_F_PROTOCOL_FEATURES), ())]:
        try:
            fe.send(req, p, fds, F_VERSION | F_NEED_REPLY); r, f, pl = fe.recv_msg()
            out.append("%s ack=%d" % (nm, struct.unpack("<Q", pl)[0]))
        except Exception as e:
            out.append("%s -> %r" % (nm, e)); break
    print(" ".join(out), "; session", "alive" if fe.alive() else "dropped")
elif probe == "reply_ack_drops":      # REPLY_ACK in effect: which refused requests drop the session instead of an error reply
    for nm, req, p in [("GET_VRING_BASE idx 7", GET_VRING_BASE, struct.pack("<II", 7, 0)),
                       ("GET_CONFIG size 4096", GET_CONFIG, struct.pack("<III", 0, 4096, 0) + bytes(4096)),
                       ("SET_CONFIG size 4096", SET_CONFIG, struct.pack("<III", 0, 4096, 0) + bytes(4096)),
                       ("SET_VRING_NUM short payload", SET_VRING_NUM, b"\0\0\0\0"),
                       ("SET_VRING_ADDR short payload", SET_VRING_ADDR, b"\0" * 16),
                       ("SET_LOG_BASE", SET_LOG_BASE, struct.pack("<QQ", 4096, 0)),
                       ("unknown 99", 99, b"\0" * 8)]:
        fe = Frontend(sock); fe.negotiate(); ram = GuestRam(); fe.mem_table([ram.region()], [ram.fd])
        try:
            fe.send(req, p, (), F_VERSION | F_NEED_REPLY); r, f, pl = fe.recv_msg()
            res = "reply req=%d %d bytes %s" % (r, len(pl), pl[:8].hex())
        except Exception as e:
            res = repr(e)
        print("%-30s -> %s; session %s" % (nm, res, "alive" if fe.alive() else "DROPPED"))
        fe.close()
dt = time.time() - t0; g = os.path.getsize(log) - l0
print("log grew %d bytes in %.1fs (%.0f B/s)" % (g, dt, g / dt))
