#!/usr/bin/env python3
"""Minimal: 63 READs in flight on queue 0 (size 128); SET_VRING_NUM 2 while they are in flight
(accepted); their completions are refused by virtio-queue (head >= 2: one unthrottled ERROR line
each); GET_VRING_BASE; the queue is re-initialized at size 128 and the same heads offered again;
disconnect. Then: how long until the socket serves a new frontend, and what the agent logs.
usage: shrink_underflow.py SOCK AGENT_LOG"""
import os, sys, time, struct, subprocess
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vu import *
sock, log = sys.argv[1], sys.argv[2]
l0 = os.path.getsize(log)
ram = GuestRam(); fe, qs = setup(sock, ram); q = qs[0]
def offer_63():
    for h in range(63):
        b = 0x300000 + h * 0x1000
        ram.w(b, struct.pack("<IIQ", 0, 0, h))
        q.set_desc(h, b, 16, VRING_DESC_F_NEXT, h + 63)
        q.set_desc(h + 63, b + 0x100, 513, VRING_DESC_F_WRITE)
        q.offer(h)
    q.do_kick()
offer_63()
print("SET_VRING_NUM 2 with requests in flight: ack", fe.vring_num(0, 2))
time.sleep(0.3)
fe.s.settimeout(40); t = time.time()
print("GET_VRING_BASE ->", fe.get_vring_base(0), "after %.1fs" % (time.time() - t))
q.avail_idx = 0; ram.w(q.desc, bytes(q.used + 6 + 8 * q.n - q.desc)); q.start(fe)
offer_63(); time.sleep(0.5)
print("used.idx after re-init and 63 more:", q.used_idx())
fe.close(); t0 = time.time()
while time.time() - t0 < 60:
    try:
        ram2 = GuestRam(); fe2, qs2 = setup(sock, ram2)
        if qs2[0].read_ok(0):
            print("socket serves a new frontend after %.1fs" % (time.time() - t0)); fe2.close(); break
        fe2.close()
    except Exception:
        pass
with open(log, "rb") as f:
    f.seek(l0); new = f.read().decode(errors="replace").splitlines()
import collections
c = collections.Counter(" ".join(l.split()[1:4]) + " " + l.split(": ", 1)[-1][:90] for l in new)
for k, v in c.most_common(12):
    print("%5d %s" % (v, k))
for l in new:
    if "drain deadline" in l or "malformed" in l or "resending" in l:
        print(l[:260])
