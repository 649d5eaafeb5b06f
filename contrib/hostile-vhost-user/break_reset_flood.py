#!/usr/bin/env python3
"""Log flood: break a virtqueue (head index past the queue size), reset it (GET_VRING_BASE,
re-initialize), break it again, for SECONDS. Each cycle logs one WARN + one INFO line
in the compute agent, with no rate limit.
usage: break_reset_flood.py SOCK AGENT_LOG SECONDS"""
import os, sys, time, select
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vu import *
sock, log, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
ram = GuestRam()
fe, qs = setup(sock, ram)
q = qs[0]
l0 = os.path.getsize(log); t0 = time.time(); n = 0
while time.time() - t0 < secs:
    q.offer(999); q.do_kick()
    select.select([q.errfd], [], [], 1.0)          # wait until the agent says it broke
    try: os.eventfd_read(q.errfd)
    except BlockingIOError: pass
    fe.get_vring_base(0)
    q.avail_idx = 0
    ram.w(q.desc, bytes(q.used + 6 + 8 * q.n - q.desc))
    q.start(fe)
    n += 1
dt = time.time() - t0; grown = os.path.getsize(log) - l0
print("cycles=%d in %.1fs; agent log grew %d bytes = %.0f bytes/s (%.0f lines/s approx)" % (n, dt, grown, grown / dt, 2 * n / dt))
print("queue still serves:", q.read_ok(0))
