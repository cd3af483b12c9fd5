#!/usr/bin/python3
"""The crash campaign's recorded writer and its checker (libnbd's Python
bindings, what nbdsh runs).

  campaign-io.py write URI LOG OFFSET BLOCKS SEED TAG SECONDS FLUSH_EVERY
  campaign-io.py check URI LOG OFFSET BLOCKS

`write` writes 4 KiB blocks at random in [OFFSET, OFFSET + BLOCKS * 4096),
one at a time, each with a unique version stamped in its bytes, and a FLUSH
every FLUSH_EVERY writes, for SECONDS; it reconnects when the server goes
away (the campaign kills it) and appends to LOG, in order:

  A BLOCK VERSION   before sending a write
  K BLOCK VERSION   the write was acknowledged
  E BLOCK VERSION   the write got an error reply (its data may or may not be there)
  F                 a FLUSH was acknowledged

`check` replays LOG and reads every block back. A block acknowledged
before the last acknowledged FLUSH must read as that version, or as one
of the versions attempted after it (those may or may not have landed); a
block written only with errors or never flushed may read as any version
attempted, or as what it held before. Never-written blocks read as zeros.
Exit status 1 and one line per bad block otherwise.
"""

import random
import sys
import time

import nbd

BLOCK = 4096
ZERO = "zero"


def content(block, version):
    stamp = f"lull-campaign {block} {version} ".encode()
    return (stamp * (BLOCK // len(stamp) + 1))[:BLOCK]


def parse(data, block):
    if data == bytes(BLOCK):
        return ZERO
    parts = data[:80].split(b" ")
    if len(parts) < 3 or parts[0] != b"lull-campaign":
        return "garbage"
    version = parts[2].decode(errors="replace")
    if int(parts[1]) != block or data != content(block, version):
        return "garbage"
    return version


def connect(uri, deadline):
    while True:
        try:
            h = nbd.NBD()
            h.connect_uri(uri)
            return h
        except nbd.Error:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def write(uri, log_path, offset, blocks, seed, tag, seconds, flush_every):
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    log = open(log_path, "a", buffering=1)
    n = acked = errors = flushes = reconnects = 0
    h = connect(uri, deadline)
    while h is not None and time.monotonic() < deadline:
        try:
            b = rng.randrange(blocks)
            version = f"{tag}.{n}"
            n += 1
            log.write(f"A {b} {version}\n")
            try:
                h.pwrite(content(b, version), offset + b * BLOCK)
                log.write(f"K {b} {version}\n")
                acked += 1
            except nbd.Error as e:
                if not h.aio_is_ready():
                    raise
                log.write(f"E {b} {version}\n")
                errors += 1
            if n % flush_every == 0:
                try:
                    h.flush()
                    log.write("F\n")
                    flushes += 1
                except nbd.Error:
                    if not h.aio_is_ready():
                        raise
        except nbd.Error:
            # The connection is gone (server killed): a new one.
            reconnects += 1
            h = connect(uri, deadline)
    if h is not None:
        try:
            h.shutdown()
        except nbd.Error:
            pass
    print(f"writes={n} acked={acked} errors={errors} flushes={flushes} reconnects={reconnects}")


def check(uri, log_path, offset, blocks):
    # possible[b]: the versions block b may hold now.
    possible = {}
    since_flush = {}  # b -> [(version, acked)] since the last FLUSH
    lines = 0
    with open(log_path) as log:
        for line in log:
            lines += 1
            f = line.split()
            if not f:
                continue
            if f[0] == "F":
                for b, attempts in since_flush.items():
                    acked = [i for i, (_, ok) in enumerate(attempts) if ok]
                    if acked:
                        last = acked[-1]
                        now = {attempts[last][0]}
                        # Later failed writes may or may not have landed.
                        now |= {v for v, _ in attempts[last + 1:]}
                    else:
                        now = possible.get(b, {ZERO}) | {v for v, _ in attempts}
                    possible[b] = now
                since_flush = {}
            elif f[0] == "A":
                since_flush.setdefault(int(f[1]), []).append((f[2], False))
            elif f[0] == "K":
                b = int(f[1])
                v, _ = since_flush[b][-1]
                assert v == f[2], f"log out of order at line {lines}"
                since_flush[b][-1] = (v, True)
            elif f[0] == "E":
                pass
    for b, attempts in since_flush.items():
        possible[b] = possible.get(b, {ZERO}) | {v for v, _ in attempts}
    h = connect(uri, time.monotonic() + 30)
    if h is None:
        sys.exit("check: cannot connect")
    bad = 0
    flushed = 0
    for b in range(blocks):
        got = parse(h.pread(BLOCK, offset + b * BLOCK), b)
        want = possible.get(b, {ZERO})
        if len(want) == 1 and ZERO not in want:
            flushed += 1
        if got not in want:
            bad += 1
            print(f"BAD block {b}: reads {got}, expected one of {sorted(want)[:5]}")
    h.shutdown()
    print(f"checked {blocks} blocks ({flushed} with exactly one allowed version), {lines} log lines: {bad} bad")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "write":
        uri, log, off, blocks, seed, tag, secs, fe = args
        write(uri, log, int(off), int(blocks), int(seed), tag, float(secs), int(fe))
    elif cmd == "check":
        uri, log, off, blocks = args
        check(uri, log, int(off), int(blocks))
    else:
        sys.exit(__doc__)
