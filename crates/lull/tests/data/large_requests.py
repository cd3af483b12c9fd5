# 40 MiB and 64 MiB reads and writes through libnbd, as a client that
# never negotiates block sizes (nbd-tester-client's "integrityhuge" log
# reads 40 MiB): aligned and not, each read verified against what was
# written. Prints "ok" at the end.
#
#   python3 large_requests.py nbd://HOST:PORT/EXPORT
import os
import sys

import nbd

MIB = 1 << 20
h = nbd.NBD()
# As older clients: no NBD_INFO_BLOCK_SIZE request; and no client-side
# check against the size the server advertises.
h.set_request_block_size(False)
h.set_strict_mode(0)
h.connect_uri(sys.argv[1])
size = h.get_size()
assert size >= 200 * MIB, size
for length, offset in [(40 * MIB, 0), (64 * MIB, 64 * MIB), (40 * MIB + 511, 128 * MIB + 1),
                       (64 * MIB, 130 * MIB + 4095)]:
    data = os.urandom(length)
    h.pwrite(data, offset)
    back = h.pread(length, offset)
    assert back == data, f"{length} bytes at {offset} read back different"
    print(f"{length} bytes at {offset}: written and read back")
h.flush()
print("ok")
