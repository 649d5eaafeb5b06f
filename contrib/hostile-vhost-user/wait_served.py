#!/usr/bin/env python3
"""How long until SOCK serves a new frontend (a READ on both queues completes). usage: wait_served.py SOCK"""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vu import *
t0 = time.time()
while time.time() - t0 < 120:
    try:
        ram = GuestRam(); fe, qs = setup(sys.argv[1], ram)
        if qs[0].read_ok(0) and qs[1].read_ok(0):
            print("served again after %.1fs" % (time.time() - t0)); break
        fe.close()
    except Exception as e:
        pass
else:
    print("not served within 120s")
