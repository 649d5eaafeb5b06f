#!/usr/bin/env python3
"""63 READs in flight on queue 0 (128 entries), SET_VRING_NUM 2 (accepted), then GET_VRING_BASE:
how long until it is answered, and does the session survive? usage: shrink_then_getbase.py SOCK"""
import os, sys, time, struct
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vu import *
for attempt in range(3):
    t0 = time.time()
    while True:
        try:
            ram = GuestRam(); fe, qs = setup(sys.argv[1], ram); q = qs[0]; break
        except Exception as e:
            print("(new frontend not served yet: %r)" % e, end=" ", flush=True)
    print("session set up after %.1fs" % (time.time() - t0), end="; ")
    for h in range(63):
        b = 0x300000 + h * 0x1000
        ram.w(b, struct.pack("<IIQ", 0, 0, h))
        q.set_desc(h, b, 16, VRING_DESC_F_NEXT, h + 63)
        q.set_desc(h + 63, b + 0x100, 513, VRING_DESC_F_WRITE)
        q.offer(h)
    q.do_kick(); print("NUM 2 ack", fe.vring_num(0, 2), end="; ")
    fe.s.settimeout(60); t = time.time()
    try:
        r = fe.get_vring_base(0); print("GET_VRING_BASE -> %r after %.1fs" % (r, time.time() - t), end="; ")
    except Exception as e:
        print("GET_VRING_BASE -> %r after %.1fs" % (e, time.time() - t), end="; ")
    print("used.idx", q.used_idx(), "session", "alive" if fe.alive() else "dropped", flush=True)
    fe.close(); time.sleep(0.3)
