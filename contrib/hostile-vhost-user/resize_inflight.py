#!/usr/bin/env python3
"""While requests are in flight (lender SIGSTOPped), change the running queue under the
backend: SET_VRING_NUM to a smaller size, SET_VRING_BASE, SET_VRING_ADDR elsewhere, and
SET_MEM_TABLE with a new memfd; then let the lender go on.
usage: resize_inflight.py SOCK AGENT_PID LENDER_PID"""
import os, sys, time, struct, signal
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vu import *
sock, apid, lpid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ram = GuestRam()
fe, qs = setup(sock, ram)
q = qs[0]
assert q.read_ok(0)
os.kill(lpid, signal.SIGSTOP)
try:
    heads = list(range(0, 126, 3))
    for h in heads:
        q.lay_read(h, sector=h * 8)
        q.offer(h)
    q.do_kick(); time.sleep(0.3)
    acks = []
    acks.append(("NUM 2", fe.vring_num(0, 2)))
    acks.append(("BASE 5", fe.vring_base(0, 5)))
    acks.append(("ADDR moved", fe.vring_addr(0, UADDR_BASE + 0x30000, UADDR_BASE + 0x32000, UADDR_BASE + 0x31000)))
    ram2 = GuestRam(8 << 20)
    acks.append(("MEM_TABLE new memfd", fe.mem_table([ram2.region()], [ram2.fd])))
    print("acks while %d requests in flight:" % len(heads), acks, flush=True)
finally:
    os.kill(lpid, signal.SIGCONT)
time.sleep(1.0)
print("agent alive:", alive_pid(apid), "session:", "alive" if fe.alive() else "dropped")
print("old ring used.idx:", q.used_idx())
try:
    print("GET_VRING_BASE(0):", fe.get_vring_base(0))
except Exception as e:
    print("GET_VRING_BASE(0):", repr(e))
print("q1 still serves:", qs[1].read_ok(0) if fe.alive() else "n/a")
fe.close()
time.sleep(0.5)
print("agent alive:", alive_pid(apid))
