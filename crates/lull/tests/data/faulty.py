# Drives one NBD connection against a volume on the faulty backend:
# writes, reads and flushes, some of which fail with EIO. Checks that the
# failures are EIO, that the connection keeps working after each one, and
# that every successful read returns what the last successful write put
# there (an injected write failure leaves the old data). Prints counts.
# Usage: faulty.py URI ROUNDS
import errno
import sys

import nbd

uri, rounds = sys.argv[1], int(sys.argv[2])
BLOCK = 4096
BLOCKS = 64
h = nbd.NBD()
h.connect_uri(uri)
expected = {}
counts = {"write_ok": 0, "write_eio": 0, "read_ok": 0, "read_eio": 0, "flush_ok": 0, "flush_eio": 0}


def attempt(kind, fn):
    try:
        r = fn()
        counts[kind + "_ok"] += 1
        return True, r
    except nbd.Error as e:
        # libnbd gives the errno as a number or as its name, by version.
        if e.errno not in (errno.EIO, "EIO"):
            sys.exit(f"{kind}: expected EIO, got {e.errno}: {e}")
        counts[kind + "_eio"] += 1
        return False, None


for i in range(rounds):
    block = (i * 7) % BLOCKS
    data = bytes([(i * 31 + block) % 251]) * BLOCK
    ok, _ = attempt("write", lambda: h.pwrite(data, block * BLOCK))
    if ok:
        expected[block] = data
    ok, got = attempt("read", lambda: h.pread(BLOCK, block * BLOCK))
    if ok and got != expected.get(block, bytes(BLOCK)):
        sys.exit(f"round {i}: block {block} reads back wrong data")
    attempt("flush", h.flush)

h.shutdown()
print(" ".join(f"{k}={v}" for k, v in counts.items()))
print("ok")
