#!/usr/bin/env python3
"""Incremental backup of a lull snapshot over NBD, with libnbd's Python
bindings and nothing of lull's.

    scripts/incremental-backup.py nbd://HOST:PORT/vol0@s2 s1 backup.img

BACKUP holds a full copy of snapshot s1 (e.g. `nbdcopy
nbd://HOST:PORT/vol0@s1 backup.img`). The script asks the export
`vol0@s2` for the metadata context `lull:changed:s1`, the extents written
between s1 and s2, and copies only those into BACKUP, which then holds
s2. It prints the bytes it copied.
"""

import sys

import nbd

# Largest block status and read requests sent (the server's maximum
# payload is larger; this keeps one read's buffer small).
CHUNK = 32 << 20


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    uri, since, backup = sys.argv[1:]
    context = "lull:changed:" + since
    h = nbd.NBD()
    h.add_meta_context(context)
    h.connect_uri(uri)
    if not h.can_meta_context(context):
        sys.exit(f"{uri}: the server does not know {context} (no snapshot {since!r}?)")
    size = h.get_size()
    changed = []

    def record(metacontext, offset, entries, err):
        if metacontext != context:
            return 0
        pos = offset
        for i in range(0, len(entries), 2):
            length, flags = entries[i], entries[i + 1]
            if flags & 1:
                changed.append((pos, length))
            pos += length
        return 0

    pos = 0
    while pos < size:
        seen = []

        def step(metacontext, offset, entries, err):
            if metacontext == context:
                seen.append(sum(entries[0::2]))
            return record(metacontext, offset, entries, err)

        h.block_status(min(CHUNK, size - pos), pos, step)
        if not seen or seen[0] == 0:
            sys.exit(f"{uri}: empty block status reply at {pos}")
        pos += seen[0]
    copied = 0
    with open(backup, "r+b") as out:
        for offset, length in changed:
            end = min(offset + length, size)
            while offset < end:
                n = min(CHUNK, end - offset)
                out.seek(offset)
                out.write(h.pread(n, offset))
                copied += n
                offset += n
    h.shutdown()
    print(f"copied {copied} bytes in {len(changed)} extents of {size}")


if __name__ == "__main__":
    main()
