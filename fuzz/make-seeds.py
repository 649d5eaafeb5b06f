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


def field(s):
    return struct.pack("<H", len(s)) + s


claims = b"\x01" + bytes([9] * 16) + struct.pack("<Q", 1_800_000_000_000)
claims += field(b"lender-a") + field(b"disk0") + field(b"vm-1")
put("wire_decode", "token-text", b"\x04" + base64.urlsafe_b64encode(claims + bytes(64)).rstrip(b"="))
put("wire_decode", "token-claims", b"\x05" + claims)

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
