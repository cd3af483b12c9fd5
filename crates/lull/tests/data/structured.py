# libnbd's Python bindings (what nbdsh runs) against a lull export:
# structured reads of a hole and of data, block status with REQ_ONE, fast
# zero. Usage: python3 structured.py URI EXPECT_FAST_ZERO EXPECT_FAST_NO_HOLE
# where each expectation is 0, 1 or "any" (depends on the filesystem).
# The export must be fresh, at least 8 MiB, and its first write lands here.
import sys
import nbd

uri, expect_fast, expect_fast_no_hole = sys.argv[1], sys.argv[2], sys.argv[3]
MIB = 1 << 20

h = nbd.NBD()
h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
h.connect_uri(uri)
assert h.get_structured_replies_negotiated(), "structured replies not negotiated"
assert h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION), "no base:allocation"
assert h.can_fast_zero(), "fast zero not advertised"
assert h.can_cache(), "cache not advertised"
size = h.get_size()

# A structured read of a hole: one hole chunk, no data on the wire.
chunks = []
def chunk(subbuf, offset, status, error):
    chunks.append((status, offset, len(subbuf)))
    return 0
buf = h.pread_structured(MIB, 0, chunk)
assert buf == bytearray(MIB), "hole did not read as zeros"
assert chunks == [(nbd.READ_HOLE, 0, MIB)], chunks
print("hole read chunks:", chunks)

# Data at 2 MiB, then a read across data and hole.
h.pwrite(b"\xab" * MIB, 2 * MIB)
chunks.clear()
buf = h.pread_structured(2 * MIB, MIB, chunk)
assert buf[:MIB] == bytearray(MIB) and buf[MIB:] == b"\xab" * MIB
kinds = [c[0] for c in chunks]
assert kinds == [nbd.READ_HOLE, nbd.READ_DATA], chunks
print("mixed read chunks:", chunks)

# Block status: whole map, then REQ_ONE gives exactly one extent.
def extents_of(flags=0, offset=0, length=None):
    got = []
    def cb(metacontext, offset, entries, error):
        assert metacontext == nbd.CONTEXT_BASE_ALLOCATION
        got.extend(zip(entries[0::2], entries[1::2]))
        return 0
    h.block_status(length or size - offset, offset, cb, flags)
    return got

HOLE_ZERO = nbd.STATE_HOLE | nbd.STATE_ZERO
full = extents_of()
print("block status:", full)
assert full[0] == (2 * MIB, HOLE_ZERO), full
assert full[1] == (MIB, 0), full
one = extents_of(nbd.CMD_FLAG_REQ_ONE)
assert one == [(2 * MIB, HOLE_ZERO)], one
one = extents_of(nbd.CMD_FLAG_REQ_ONE, offset=2 * MIB)
assert one == [(MIB, 0)], one
print("REQ_ONE:", one)

# Fast zero: succeeds (and makes a hole) where the device zeroes fast,
# else ENOTSUP at once with the data untouched.
def fast_zero(flags):
    try:
        h.zero(MIB, 2 * MIB, nbd.CMD_FLAG_FAST_ZERO | flags)
        return True
    except nbd.Error as e:
        assert e.errno in ("ENOTSUP", "EOPNOTSUPP"), (e.errno, e.string)
        return False

def check(got, expect, what):
    print(what, got)
    assert expect == "any" or got == (expect == "1"), (what, got, expect)

fast_no_hole = fast_zero(nbd.CMD_FLAG_NO_HOLE)
check(fast_no_hole, expect_fast_no_hole, "fast zero with NO_HOLE:")
if not fast_no_hole:
    assert h.pread(MIB, 2 * MIB) == b"\xab" * MIB, "a refused fast zero wrote"
fast = fast_zero(0)
check(fast, expect_fast, "fast zero:")
if fast:
    assert h.pread(MIB, 2 * MIB) == bytearray(MIB)
    assert extents_of(nbd.CMD_FLAG_REQ_ONE, offset=2 * MIB)[0][1] & nbd.STATE_ZERO
    assert h.pread(MIB, 2 * MIB) == bytearray(MIB)
else:
    if not fast_no_hole:
        assert h.pread(MIB, 2 * MIB) == b"\xab" * MIB
    h.zero(MIB, 2 * MIB)
    assert h.pread(MIB, 2 * MIB) == bytearray(MIB)

# Cache succeeds everywhere.
h.cache(4 * MIB, 0)
# An error reply to a structured read arrives as an error chunk.
h.set_strict_mode(0)  # let the server judge the bad request
try:
    h.pread(4096, size - 1)
    raise AssertionError("read past the end succeeded")
except nbd.Error as e:
    print("read past the end:", e.errno)
h.shutdown()
print("ok")
