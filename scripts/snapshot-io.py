#!/usr/bin/python3
"""Snapshots taken under a recorded writer, each checked against what was
acknowledged when it was taken (libnbd's Python bindings, what nbdsh runs).

  snapshot-io.py run URI SOCKET VOLUME OFFSET BLOCKS SECONDS EVERY_MS LULL RECORD
  snapshot-io.py check RECORD [SKIP,...]

For SECONDS, a writer keeps 8 writes in flight on one connection to URI:
4 KiB blocks at random in [OFFSET, OFFSET + BLOCKS * 4096), each with a
unique version stamped in its bytes, never two at once on one block. Every
EVERY_MS, `LULL rpc --socket SOCKET snapshot_create` takes snapshot
`io-PID-N` of VOLUME; the times around each call are kept (a refusal, while a
replica is away, is kept too and skipped). Then each snapshot taken is read
through its export (URI's host, `VOLUME@io-PID-N`) and every block must hold:

- the last version acknowledged before the call started (or what the
  block held when the run began, read first), or
- a version whose write was in flight while the call ran (sent before it
  returned, not acknowledged before it started): the snapshot may or may
  not hold those;

never a version sent after the call returned, nor an older one superseded
by an acknowledged write. One line per snapshot; exit status 1 and the bad
blocks if any snapshot fails, 2 if no snapshot was taken. `run` keeps what
it saw in RECORD (JSON), and `check` checks the snapshots again from it
(after the test has killed the replica the views read from, say), but
those named in SKIP (a comma-separated list: snapshots the replica left
does not hold), saying so.
"""

import json
import os
import subprocess
import sys
import threading
import time
import random

import nbd

BLOCK = 4096
QD = 8
ZERO = "zero"
READ_CHUNK = 1 << 20


def content(block, version):
    stamp = f"lull-snapshot-io {block} {version} ".encode()
    return (stamp * (BLOCK // len(stamp) + 1))[:BLOCK]


def parse(data, block):
    if data == bytes(BLOCK):
        return ZERO
    parts = data[:80].split(b" ")
    if len(parts) < 3 or parts[0] != b"lull-snapshot-io":
        return "garbage"
    version = parts[2].decode(errors="replace")
    if int(parts[1]) != block or data != content(block, version):
        return "garbage"
    return version


def writer(uri, offset, blocks, stop, history, counts):
    """history[b]: [(version, t_sent, t_acked or None)] in send order."""
    h = nbd.NBD()
    h.connect_uri(uri)
    rng = random.Random(4242)
    busy = set()
    inflight = 0
    n = 0

    def done(b, entry_index, err):
        nonlocal inflight
        inflight -= 1
        busy.discard(b)
        if err.value == 0:
            v, sent, _ = history[b][entry_index]
            history[b][entry_index] = (v, sent, time.monotonic())
            counts["acked"] += 1
        else:
            counts["errors"] += 1
        return 1

    while not stop.is_set() or inflight > 0:
        while not stop.is_set() and inflight < QD:
            b = rng.randrange(blocks)
            if b in busy:
                continue
            version = str(n)
            n += 1
            entries = history.setdefault(b, [])
            entries.append((version, time.monotonic(), None))
            busy.add(b)
            inflight += 1
            i = len(entries) - 1
            h.aio_pwrite(content(b, version), offset + b * BLOCK,
                         completion=lambda err, b=b, i=i: done(b, i, err))
        h.poll(1)
    counts["sent"] = n
    h.shutdown()


def snapshots(lull, socket, volume, every, stop, taken):
    i = 0
    while not stop.is_set():
        name = f"io-{os.getpid()}-{i}"
        i += 1
        t0 = time.monotonic()
        r = subprocess.run([lull, "rpc", "--socket", socket, "snapshot_create",
                            f'{{"volume":"{volume}","name":"{name}"}}'],
                           capture_output=True, text=True)
        t1 = time.monotonic()
        taken.append((name, t0, t1, r.returncode == 0,
                      " ".join((r.stdout + r.stderr).split())))
        stop.wait(every)


def allowed(entries, before, t0, t1):
    """The versions a block may hold in a snapshot called over [t0, t1];
    `before`: what it held when the run began."""
    last = before
    for v, sent, acked in entries:
        if acked is not None and acked < t0:
            last = v
    out = {last}
    for v, sent, acked in entries:
        if sent < t1 and (acked is None or acked >= t0):
            out.add(v)
    return out


def read_region(uri, offset, blocks):
    """What each block of the region holds (`parse`)."""
    h = nbd.NBD()
    h.connect_uri(uri)
    out = []
    for start in range(0, blocks * BLOCK, READ_CHUNK):
        size = min(READ_CHUNK, blocks * BLOCK - start)
        data = h.pread(size, offset + start)
        out += [parse(data[i * BLOCK:(i + 1) * BLOCK], start // BLOCK + i)
                for i in range(size // BLOCK)]
    h.shutdown()
    return out


def check(base_uri, volume, offset, blocks, name, t0, t1, history, before):
    uri = f"{base_uri}/{volume}@{name}"
    h = nbd.NBD()
    h.connect_uri(uri)
    if not h.is_read_only():
        return [f"{name}: export not read-only"]
    h.shutdown()
    bad = []
    for b, got in enumerate(read_region(uri, offset, blocks)):
        want = allowed(history.get(b, []), before[b], t0, t1)
        if got not in want:
            bad.append(f"{name} block {b}: {got}, allowed {sorted(want)[:6]}")
    return bad


def run(uri, socket, volume, offset, blocks, seconds, every_ms, lull, record):
    offset, blocks = int(offset), int(blocks)
    stop = threading.Event()
    history, counts, taken = {}, {"acked": 0, "errors": 0, "sent": 0}, []
    before = read_region(uri, offset, blocks)
    w = threading.Thread(target=writer, args=(uri, offset, blocks, stop, history, counts))
    s = threading.Thread(target=snapshots,
                         args=(lull, socket, volume, int(every_ms) / 1000, stop, taken))
    w.start()
    time.sleep(0.2)
    s.start()
    time.sleep(float(seconds))
    stop.set()
    s.join()
    w.join()
    print(f"writes sent={counts['sent']} acked={counts['acked']} errors={counts['errors']}")
    with open(record, "w") as f:
        json.dump({"uri": uri, "volume": volume, "offset": offset, "blocks": blocks,
                   "before": before, "taken": taken,
                   "history": {str(b): e for b, e in history.items()}}, f)
    check_all(record)


def check_all(record, skip=()):
    with open(record) as f:
        r = json.load(f)
    uri, volume, offset, blocks = r["uri"], r["volume"], r["offset"], r["blocks"]
    base_uri = uri.rsplit("/", 1)[0]
    history = {int(b): e for b, e in r["history"].items()}
    before, taken = r["before"], r["taken"]
    ok = [t for t in taken if t[3]]
    print(f"snapshots taken={len(ok)} refused={len(taken) - len(ok)}")
    for name, t0, t1, good, why in taken:
        if not good:
            print(f"{name}: refused: {why}")
    failed = False
    for name, t0, t1, _, _ in ok:
        if name in skip:
            print(f"{name}: skipped (SKIP names it)")
            continue
        bad = check(base_uri, volume, offset, blocks, name, t0, t1, history, before)
        print(f"{name}: {blocks} blocks, call {1000 * (t1 - t0):.1f} ms: {len(bad)} bad")
        for line in bad[:20]:
            print("  BAD " + line)
        failed |= bool(bad)
    if failed:
        sys.exit(1)
    if not ok:
        sys.exit(2)


if __name__ == "__main__":
    if len(sys.argv) == 11 and sys.argv[1] == "run":
        run(*sys.argv[2:])
    elif len(sys.argv) in (3, 4) and sys.argv[1] == "check":
        check_all(sys.argv[2], sys.argv[3].split(",") if len(sys.argv) == 4 else ())
    else:
        sys.exit(__doc__)
