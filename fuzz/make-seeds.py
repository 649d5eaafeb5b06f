#!/usr/bin/env python3
"""Writes the committed seed inputs of fuzz/corpus/<target>/seed-* (valid requests,
one per kind), in the input layouts documented at the top of each fuzz target."""

import base64
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    with open(os.path.join(HERE, "corpus", target, "seed-" + name), "wb") as f:
        f.write(data)


# --- wire_decode: a selector byte, then the decoder's input.
def req(op, flags, ln, rid, sector):
    return struct.pack("<BBHIQQ", op, flags, 0, ln, rid, sector)


put("wire_decode", "request-read", b"\x00" + req(1, 0, 4096, 1, 8))
put("wire_decode", "request-write-zeroes-unmap", b"\x00" + req(5, 1, 16, 2, 64))
put("wire_decode", "response-ok", b"\x01" + struct.pack("<BBHIQ", 0x80, 0, 0, 4096, 1))
name, token = b"disk0", bytes(range(100))
hello = b"DVLD" + struct.pack("<HHQ", 1, 0, 0) + bytes([7] * 16)
hello += struct.pack("<HH", len(name), len(token)) + name + token
put("wire_decode", "hello", b"\x02" + hello)
serial = b"SN01".ljust(20, b"\0")
reply = b"DVLD" + struct.pack("<HHQQIIIII", 1, 0, 0, 2048, 4096, 1 << 20, 1 << 16, 1 << 16, 2)
reply += struct.pack("<HH", 0, 0) + serial
put("wire_decode", "reply-ok", b"\x03" + reply)
msg = b'no device "x"'
refusal = b"DVLD" + struct.pack("<HHQQIIIII", 1, 2, 0, 0, 0, 0, 0, 0, 0)
refusal += struct.pack("<HH", len(msg), 0) + bytes(20) + msg
put("wire_decode", "reply-refused", b"\x03" + refusal)
# Version 1 replies above; a NIC in version 1 (MTU in max_transfer, MAC in serial).
v1nic = b"DVLD" + struct.pack("<HHQQIIIII", 1, 0, 1, 0, 512, 9000, 0, 0, (1 << 3) | (1 << 4))
v1nic += struct.pack("<HH", 0, 0) + bytes([2, 1, 2, 3, 4, 5]).ljust(20, b"\0")
put("wire_decode", "reply-v1-nic", b"\x03" + v1nic)


# Version 2 replies: head, msg_len, desc_len, reserved, [credit], description, message.
def reply_v2(status, features, desc, msg=b"", credit=b""):
    return (b"DVLD" + struct.pack("<HHQ", 2, status, features)
            + struct.pack("<HH4x", len(msg), len(desc)) + credit + desc + msg)


desc_block = bytes([1, 0, 0, 0]) + struct.pack("<QIIIII", 2048, 4096, 1 << 20, 1 << 16,
                                                 1 << 16, 2) + serial
desc_nic = bytes([2, 0, 0, 0]) + bytes([2, 1, 2, 3, 4, 5, 0, 0]) + struct.pack("<III", 1, 1500, 0xf)
bdf = b"0000:03:00.0"
desc_pci = (bytes([3, 0, 0, 0])
            + struct.pack("<HHHHIBBBB", 0x1b36, 0x0010, 0x1af4, 0x1100, 0x010802, 1, len(bdf), 2, 0)
            + bdf + struct.pack("<IIQ", 0, 3, 0x4000) + struct.pack("<IIQ", 7, 3, 0x1000))
put("wire_decode", "reply-v2-block", b"\x03" + reply_v2(0, 8, desc_block,
                                                        credit=struct.pack("<II", 1024, 64 << 20)))
put("wire_decode", "reply-v2-nic", b"\x03" + reply_v2(0, 1, desc_nic))
put("wire_decode", "reply-v2-pci", b"\x03" + reply_v2(0, 4, desc_pci))
put("wire_decode", "reply-v2-refused", b"\x03" + reply_v2(2, 0, b"", msg))
put("wire_decode", "description-pci", b"\x03" + desc_pci)


def field(s):
    return struct.pack("<H", len(s)) + s


claims = b"\x01" + bytes([9] * 16) + struct.pack("<Q", 1_800_000_000_000)
claims += field(b"lender-a") + field(b"disk0") + field(b"vm-1")
put("wire_decode", "token-text", b"\x04" + base64.urlsafe_b64encode(claims + bytes(64)).rstrip(b"="))
put("wire_decode", "token-claims", b"\x05" + claims)
# Version 3: flags (bit 0 provider key, bit 1 limits), the key, then the limits: count,
# (lane, per_sec u64, burst u64) in ascending lane order, weight u32.
claims3 = b"\x03" + claims[1:] + b"\x03" + bytes([0x42] * 32)
claims3 += b"\x02" + struct.pack("<BQQ", 2, 2000, 0) + struct.pack("<BQQ", 5, 50 << 20, 1 << 20)
claims3 += struct.pack("<I", 3)
put("wire_decode", "token-claims-v3-limits", b"\x05" + claims3)
# Version 3 with a predecessor (flag bit 2, a live migration's handover): the key, the
# predecessor's lease id, no limits.
claims3s = b"\x03" + claims[1:] + b"\x05" + bytes([0x42] * 32) + bytes([7] * 16)
put("wire_decode", "token-claims-v3-successor", b"\x05" + claims3s)

# --- blk_request: device byte, head, n, n descriptors, then memory writes.
NEXT, WRITE, INDIRECT = 1, 2, 4
DEVICE = 0x56  # capacity 2048 sectors, max_transfer 1 MiB, discard + write-zeroes


def desc(addr, ln, flags, nxt):
    return struct.pack("<QIHH", addr, ln, flags, nxt)


def chain(descs, writes, device=DEVICE, head=0):
    b = bytes([device, head, len(descs)]) + b"".join(descs)
    for addr, data in writes:
        b += struct.pack("<IH", addr, len(data)) + data
    return b


def outhdr(t, sector):
    return struct.pack("<IIQ", t, 0, sector)


HDR, DATA, STATUS = 0x1000, 0x2000, 0x900
put("blk_request", "in", chain(
    [desc(HDR, 16, NEXT, 1), desc(DATA, 1024, NEXT | WRITE, 2), desc(STATUS, 1, WRITE, 0)],
    [(HDR, outhdr(0, 3))]))
# Header and data in one descriptor that crosses from the first region into the second.
put("blk_request", "out-across-regions", chain(
    [desc(0xFF00, 16 + 512, NEXT, 1), desc(STATUS, 1, WRITE, 0)],
    [(0xFF00, outhdr(1, 10) + bytes([0xAB] * 512))]))
put("blk_request", "flush", chain(
    [desc(HDR, 16, NEXT, 1), desc(STATUS, 1, WRITE, 0)], [(HDR, outhdr(4, 0))]))
put("blk_request", "get-id", chain(
    [desc(HDR, 16, NEXT, 1), desc(DATA, 20, NEXT | WRITE, 2), desc(STATUS, 1, WRITE, 0)],
    [(HDR, outhdr(8, 0))]))
put("blk_request", "discard", chain(
    [desc(HDR, 32, NEXT, 1), desc(STATUS, 1, WRITE, 0)],
    [(HDR, outhdr(11, 0) + struct.pack("<QII", 16, 8, 0))]))
put("blk_request", "write-zeroes-unmap", chain(
    [desc(HDR, 16, NEXT, 1), desc(DATA, 16, NEXT, 2), desc(STATUS, 1, WRITE, 0)],
    [(HDR, outhdr(13, 0)), (DATA, struct.pack("<QII", 32, 4, 1))]))
# The IN request again, through an indirect table in the region past the hole.
TABLE = 0x40000
table = desc(HDR, 16, NEXT, 1) + desc(DATA, 512, NEXT | WRITE, 2) + desc(STATUS, 1, WRITE, 0)
put("blk_request", "in-indirect", chain(
    [desc(TABLE, len(table), INDIRECT, 0)], [(HDR, outhdr(0, 5)), (TABLE, table)]))
# Read-only device, OUT refused.
put("blk_request", "out-read-only", chain(
    [desc(HDR, 16, NEXT, 1), desc(DATA, 512, NEXT, 2), desc(STATUS, 1, WRITE, 0)],
    [(HDR, outhdr(1, 0))], device=DEVICE | 1))

# --- wire_decode, the gateway's decoders (selectors 6-8).
def relay_request(cluster, lender, ttl=8):
    return b"DLGW" + struct.pack("<BBBBI", 1, ttl, len(cluster), len(lender), 0) + cluster + lender


def relay_reply(status, msg):
    return b"DLGW" + struct.pack("<BBH", 1, status, len(msg)) + msg


def mux_header(kind, stream, ln):
    return struct.pack("<BBHII", kind, 0, 0, stream, ln)


put("wire_decode", "relay-request", b"\x06" + relay_request(b"site-b", b"lender1"))
put("wire_decode", "relay-reply-ok", b"\x07" + relay_reply(0, b""))
put("wire_decode", "relay-reply-refused", b"\x07" + relay_reply(1, b'no route to cluster "zz"'))
cluster = b"site-a"
link_hello = b"DLMX" + struct.pack("<BBHI", 1, len(cluster), 0, 32 << 20) + cluster
put("wire_decode", "mux-hello", b"\x08" + mux_header(1, 0, len(link_hello)) + link_hello)
open_req = relay_request(b"site-b", b"lender1", ttl=7)
put("wire_decode", "mux-open", b"\x08" + mux_header(2, 1, len(open_req)) + open_req)
put("wire_decode", "mux-data", b"\x08" + mux_header(3, 1, 5) + b"hello")
put("wire_decode", "mux-window", b"\x08" + mux_header(4, 3, 1 << 16))

# --- wire_decode, NIC frame messages (selector 9): several in one buffer, as read.
def net_msg(kind, payload):
    return struct.pack("<BBHI", kind, 0, 0, len(payload)) + payload


eth = bytes([0xff] * 6 + [2, 0, 0, 0, 0, 7]) + b"\x08\x00" + bytes(46)
link = net_msg(0x21, struct.pack("<II", 1, 1500) + bytes([2, 0, 0, 0, 0, 7]) + bytes(2))
put("wire_decode", "net-link-frames", b"\x09" + link + net_msg(0x20, eth) + net_msg(0x20, eth[:14]))
# NEEDS_CSUM, TCPv4 segmentation with ECN, hdr_len 54, MSS 1448, checksum at 34+16.
offload = struct.pack("<BBHHHH", 1, 0x81, 54, 1448, 34, 16)
tcp = eth[:12] + b"\x08\x00" + bytes(3000)
put("wire_decode", "net-offloads", b"\x09" + net_msg(0x23, struct.pack("<I", 0xf))
    + net_msg(0x22, offload + tcp))

# --- wire_decode, RDMA request messages (selector 10): header, count, segments.
def rdma_req(op, ln, segs, rid=1, sector=8):
    b = req(op, 0, ln, rid, sector) + struct.pack("<H", len(segs)) + bytes(6)
    return b + b"".join(struct.pack("<QII", a, k, n) for a, k, n in segs)


put("wire_decode", "rdma-write", b"\x0a" + rdma_req(2, 1536, [(0x7f00_0000_1000, 5, 512),
                                                            (0x7f00_0000_9000, 5, 1024)]))
put("wire_decode", "rdma-flush", b"\x0a" + rdma_req(3, 0, [], sector=0))

# --- pci_decode: a selector byte; 0: a PCI session message (the seed-* files without
# "nvme" in their name, written by hand); 1: an NVMe command, below.
def sqe(opcode, nsid=0, prp1=0, prp2=0, cdw10=0, cdw11=0, cdw12=0, cid=1):
    b = struct.pack("<BBHI", opcode, 0, cid, nsid) + bytes(16) + struct.pack("<QQ", prp1, prp2)
    return b + struct.pack("<IIIIII", cdw10, cdw11, cdw12, 0, 0, 0)


def nvme(config, entry, writes=()):
    b = b"\x01" + bytes([config]) + entry
    for m, off, data in writes:
        b += struct.pack("<BHH", m, off, len(data)) + data
    return b


IO = 1
# Read of 8 blocks of 512 bytes (namespace 1) into one page.
put("pci_decode", "nvme-read", nvme(IO, sqe(0x02, nsid=1, prp1=0x11000, cdw12=7)))
# Write of 4 blocks of 4096 bytes (namespace 2): PRP 1, then a list of three pages in
# the first map at 0x1f000 (offset 0xf000).
prp_list = struct.pack("<QQQ", 0x13000, 0x14000, 0x18000)
put("pci_decode", "nvme-write-prp-list",
    nvme(IO, sqe(0x01, nsid=2, prp1=0x12000, prp2=0x1f000, cdw12=3), [(0, 0xf000, prp_list)]))
# Admin: Identify Controller (4096 bytes), and Get Log Page SMART (NUMD 1023: 4096 bytes)
# from the middle of a page, so PRP 2 is the second page.
put("pci_decode", "nvme-identify", nvme(0, sqe(0x06, prp1=0x11000, cdw10=1)))
put("pci_decode", "nvme-log-page", nvme(0, sqe(0x02, prp1=0x11800, prp2=0x15000,
                                            cdw10=0x02 | 1023 << 16)))

# --- vhost_sequence: actions, each an opcode byte and its fields (layout at the top of
# fuzz_targets/vhost_sequence/main.rs).
def negotiate(p=0, v=0):
    return bytes([0, p, v])


def mem(layout=0):
    return bytes([1, layout])


def setup(q, sz=8, base=0, fl=0):
    return struct.pack("<BBBHB", 3, q, sz, base, fl)


def vring(code, q, v, extra=b""):
    return struct.pack("<BBBI", 4, code, q, v) + extra


def simple(code, v=0, f=0):
    return struct.pack("<BBBQ", 5, code, f, v)


def config(kind, off, size, flags=0, data=b""):
    return struct.pack("<BBHHB", 6, kind, off, size, flags) + data


def inflight(kind, nq=2, qs=256, size=0, off=0):
    return struct.pack("<BBHHII", 7, kind, nq, qs, size, off)


def raw(code, hflags, payload=b"", nfd=0):
    return struct.pack("<BBBHB", 8, code, hflags, len(payload), nfd) + payload


def offer(q, kind, sector=0, n=8, fl=8):
    return struct.pack("<BBBHBB", 9, q, kind, sector, n, fl)


def avail_idx(q, mode, v):
    return struct.pack("<BBBH", 12, q, mode, v)


def kick(q):
    return bytes([13, q])


def wait(ms=0):
    return bytes([14, ms])


RECONNECT = bytes([17])


def rebuild(q, base):
    return struct.pack("<BBH", 18, q, base)


IN, OUT, FLUSH, GET_ID, DISCARD, WZ = range(6)
start = negotiate() + mem() + setup(0) + setup(1)
put("vhost_sequence", "read", start + offer(0, IN) + wait() + vring(2, 0, 0))
put("vhost_sequence", "write-flush-two-queues", start + offer(0, OUT, 16, 16) + offer(1, FLUSH)
    + offer(1, GET_ID) + wait() + offer(0, IN, 16, 16) + wait() + vring(2, 0, 0) + vring(2, 1, 0))
put("vhost_sequence", "discard-write-zeroes", start + offer(0, DISCARD, 8, 4)
    + offer(0, WZ, 8, 4, fl=8 | 16) + wait())
# The SeaBIOS handover: a request, then the ring rebuilt at the same place from base 1.
put("vhost_sequence", "rebuild", negotiate() + mem() + setup(0, sz=3) + offer(0, IN) + wait()
    + rebuild(0, 1) + offer(0, IN, 4, 1) + wait())
# A driver that moves avail.idx far past the queue size.
put("vhost_sequence", "avail-idx-corrupt", start + avail_idx(0, 0, 1000) + kick(0) + wait()
    + offer(1, IN) + wait() + rebuild(0, 0) + offer(0, IN) + wait())
# Inflight tracking across a backend restart.
put("vhost_sequence", "inflight-reconnect", negotiate() + inflight(0) + mem() + setup(0)
    + offer(0, OUT, 0, 8, fl=0) + kick(0) + RECONNECT + negotiate() + inflight(1 | 8)
    + mem() + setup(0) + offer(0, IN) + wait())
put("vhost_sequence", "config", negotiate() + config(0, 0, 60) + config(0, 0, 0)
    + config(0, 0xfff0, 0x20) + config(1, 0, 8, 0, bytes(8)) + config(0, 20, 4))
put("vhost_sequence", "queue-sizes", negotiate() + vring(0, 0, 3) + vring(0, 0, 65535)
    + vring(0, 1, 0) + vring(0, 3, 256) + vring(1, 0, 0x10000) + vring(3, 0, 2))
mem_regions = struct.pack("<HHBHH", 0, 0x20, 0, 0, 0) + struct.pack("<HHBHH", 0x20, 0x40, 0, 0x20, 0x20)
put("vhost_sequence", "mem-table-raw", negotiate() + bytes([2, 0, 2]) + mem_regions
    + bytes([2, 0]) + bytes([2, 0, 1]) + struct.pack("<HHBHH", 0, 0x60, 0, 0, 0) + bytes([0])
    + mem(2) + setup(0) + offer(0, IN) + wait())
put("vhost_sequence", "before-owner", bytes([5, 5]) + struct.pack("<BQ", 0, 1 << 3)
    + simple(0) + mem() + setup(0) + simple(2) + mem() + raw(99, 0x09, bytes(8)))


def inflight_write(off, data):
    return struct.pack("<BHB", 16, off, len(data)) + data


def inflight_desc(head, counter):
    return inflight_write(16 + 16 * head, b"\x01" + bytes(7) + struct.pack("<Q", counter))


# A frontend that hands a restarted backend an inflight buffer it wrote itself: four
# heads marked in flight (queue 0: version 1, 256 descriptors), resubmitted on start.
put("vhost_sequence", "inflight-resubmit", negotiate() + inflight(0) + mem() + setup(0)
    + offer(0, OUT, 0, 8, fl=4) + offer(0, IN, 0, 8, fl=4)
    + inflight_write(0, struct.pack("<QHHHH", 0, 1, 256, 0, 0))
    + inflight_desc(0, 5) + inflight_desc(3, 2) + inflight_desc(7, 9) + inflight_desc(255, 1)
    + RECONNECT + negotiate() + inflight(1 | 8) + mem() + setup(0, fl=1) + wait()
    + offer(0, IN) + wait())
