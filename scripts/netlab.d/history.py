#!/usr/bin/python3
"""The network scenarios' recorded writer and their strict checker.

Blocks are written as scripts/campaign-io.py writes them (its `content`:
"lull-campaign BLOCK VERSION " repeated), and the log has campaign-io.py's
lines with the wall-clock time (seconds, as `date +%s.%N`) appended, so
`campaign-io.py check` reads these logs too:

  A BLOCK VERSION T   before sending a write
  K BLOCK VERSION T   the write was acknowledged
  E BLOCK VERSION T   the write got an error reply
  F T                 a FLUSH was acknowledged
  X T WHAT            the connection was lost (WHAT: libnbd's message)
  R BLOCK GOT T1 T2   a read-back (called at T1, answered at T2) read GOT
  S BLOCK T GOT       a read-back of a block this writer had acknowledged
                      found an older version of its own or zeros (a stale read)
  O BLOCK T GOT       ... found another writer's version

  history.py write URI LOG OFFSET BLOCKS SEED TAG SECONDS [--sweep] [--flush-every N]
      one write at a time, at random blocks (--sweep: every block once, in
      order, first), for SECONDS; after every 8th acknowledged write, one
      block it acknowledged before is read back and must hold that version
      or a later one of this writer's (no other writer writes the region
      meanwhile) (stale reads are counted, logged with
      S, and make the exit status 3). It reconnects when the connection
      goes and sleeps 20 ms after an error (an engine with no replica fails
      every write at once). Prints a summary line.
  history.py check SOURCE OFFSET BLOCKS LOG... [--fenced TAG@T]... [--as-of T0 T1] [--reads-out FILE]
      SOURCE is an NBD URI or a file (a replica's data layer, read at
      OFFSET). No process of these scenarios is killed, so every
      acknowledged write must be there, flushed or not: a block must read
      as its last acknowledged version (the latest acknowledgement over
      every log, by time) or as a version attempted after that one was sent
      (those may or may not have landed); a block never acknowledged reads
      as zeros or any version attempted. --fenced TAG@T: the writer TAG's
      engine was fenced (failed over) at T: a write of TAG sent at or after
      T must never be acknowledged (a silent success) and never be read
      (a write of the old engine landed after the failover). --as-of T0 T1:
      SOURCE is a snapshot whose create was called at T0 and returned at
      T1: it holds every write acknowledged before T0 and none sent from
      T1 on. --reads-out FILE: every block read, as R lines (for
      scripts/netlab.d/porcupine). Exit 1 and one line per violation; the
      last line is the summary.
"""

import importlib.util
import os
import random
import sys
import time

import nbd

_spec = importlib.util.spec_from_file_location(
    "campaign_io", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "campaign-io.py"))
campaign_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(campaign_io)
BLOCK = campaign_io.BLOCK
ZERO = campaign_io.ZERO
content = campaign_io.content
parse = campaign_io.parse

# Acknowledged writes between two read-backs.
READBACK_EVERY = 8
# Pause after a failed write or connect, so an engine that fails every
# request at once does not fill the log.
ERROR_PAUSE_S = 0.02


def now():
    return f"{time.time():.6f}"


def connect(uri, deadline, log):
    while True:
        try:
            h = nbd.NBD()
            h.connect_uri(uri)
            return h
        except nbd.Error as e:
            if time.monotonic() > deadline:
                return None
            log.write(f"X {now()} connect: {str(e)[:80].replace(chr(10), ' ')}\n")
            time.sleep(0.2)


def version_no(version):
    return int(version.rsplit(".", 1)[1])


def write(uri, log_path, offset, blocks, seed, tag, seconds, sweep=False, flush_every=16):
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    log = open(log_path, "a", buffering=1)
    n = acked = errors = flushes = reconnects = stale = foreign = readbacks = 0
    slowest_s = 0.0
    mine = {}  # block -> last acknowledged version number of this writer
    order = list(range(blocks)) if sweep else []
    h = connect(uri, deadline, log)
    while h is not None and time.monotonic() < deadline:
        try:
            b = order.pop(0) if order else rng.randrange(blocks)
            version = f"{tag}.{n}"
            n += 1
            log.write(f"A {b} {version} {now()}\n")
            sent = time.monotonic()
            try:
                h.pwrite(content(b, version), offset + b * BLOCK)
                log.write(f"K {b} {version} {now()}\n")
                acked += 1
                slowest_s = max(slowest_s, time.monotonic() - sent)
                mine[b] = n - 1
            except nbd.Error:
                if not h.aio_is_ready():
                    raise
                log.write(f"E {b} {version} {now()}\n")
                errors += 1
                time.sleep(ERROR_PAUSE_S)
            if n % flush_every == 0:
                try:
                    h.flush()
                    log.write(f"F {now()}\n")
                    flushes += 1
                except nbd.Error:
                    if not h.aio_is_ready():
                        raise
            if acked and acked % READBACK_EVERY == 0 and mine:
                rb = rng.choice(list(mine))
                try:
                    t_call = now()
                    got = parse(h.pread(BLOCK, offset + rb * BLOCK), rb)
                    log.write(f"R {rb} {got} {t_call} {now()}\n")
                    readbacks += 1
                    # Zeros or an older version of its own: older than
                    # what it was told had landed. Another writer's
                    # version (a failed-over engine's client) is counted
                    # apart: the final check judges it by time.
                    if got == ZERO or got == "garbage" or (got.startswith(tag + ".") and version_no(got) < mine[rb]):
                        stale += 1
                        log.write(f"S {rb} {now()} {got} (acknowledged {tag}.{mine[rb]})\n")
                    elif not got.startswith(tag + "."):
                        foreign += 1
                        log.write(f"O {rb} {now()} {got} (acknowledged {tag}.{mine[rb]})\n")
                except nbd.Error:
                    if not h.aio_is_ready():
                        raise
        except nbd.Error as e:
            reconnects += 1
            log.write(f"X {now()} {str(e)[:80].replace(chr(10), ' ')}\n")
            time.sleep(ERROR_PAUSE_S)
            h = connect(uri, deadline, log)
    if h is not None:
        try:
            h.shutdown()
        except nbd.Error:
            pass
    print(f"{tag}: writes={n} acked={acked} errors={errors} flushes={flushes} "
          f"reconnects={reconnects} readbacks={readbacks} stale={stale} foreign={foreign} "
          f"slowest_ack_ms={slowest_s * 1000:.0f}")
    sys.exit(3 if stale else 0)


def load(paths):
    """Every attempt of every log: (block, version, tag, sent, status, done)."""
    attempts = {}
    for p in paths:
        with open(p) as f:
            for ln in f:
                x = ln.split()
                if len(x) < 4 or x[0] not in "AKE":
                    continue
                b, v, t = int(x[1]), x[2], float(x[3])
                if x[0] == "A":
                    attempts[v] = [b, v, v.rsplit(".", 1)[0], t, "pending", None]
                else:
                    a = attempts[v]
                    a[4], a[5] = ("acked" if x[0] == "K" else "error"), t
    per_block = {}
    for a in attempts.values():
        per_block.setdefault(a[0], []).append(a)
    return attempts, per_block


def reader(source):
    if "://" in source:
        h = campaign_io.connect(source, time.monotonic() + 30)
        if h is None:
            sys.exit(f"check: cannot connect to {source}")
        return (lambda off: h.pread(BLOCK, off)), h.shutdown
    f = open(source, "rb")

    def rd(off):
        f.seek(off)
        d = f.read(BLOCK)
        return d + bytes(BLOCK - len(d))
    return rd, f.close


def as_of(attempts, per_block, t0, t1):
    """What a snapshot whose call began at t0 and returned at t1 may hold:
    writes sent from t1 on are not in it; those acknowledged before t0
    are; the others may or may not be."""
    kept = {v: a for v, a in attempts.items() if a[3] < t1}
    for a in kept.values():
        if a[4] == "acked" and a[5] >= t0:
            a[4] = "pending"
    pb = {}
    for a in kept.values():
        pb.setdefault(a[0], []).append(a)
    return kept, pb


def check(source, offset, blocks, logs, fenced, snapshot=None, reads_out=None):
    attempts, per_block = load(logs)
    if snapshot:
        attempts, per_block = as_of(attempts, per_block, *snapshot)
    bad = 0
    for tag, t in fenced.items():
        for a in attempts.values():
            if a[2] == tag and a[3] >= t and a[4] == "acked":
                bad += 1
                print(f"SILENT SUCCESS: {a[1]} (block {a[0]}) sent at {a[3]:.3f}, after {tag}'s engine was fenced "
                      f"at {t:.3f}, was acknowledged at {a[5]:.3f}")
    rd, close = reader(source)
    exact = 0
    reads = open(reads_out, "w") if reads_out else None
    for b in range(blocks):
        t_call = now()
        got = parse(rd(offset + b * BLOCK), b)
        if reads:
            reads.write(f"R {b} {got} {t_call} {now()}\n")
        tries = sorted(per_block.get(b, []), key=lambda a: a[3])
        acked = [a for a in tries if a[4] == "acked"]
        if acked:
            last = max(acked, key=lambda a: a[5])
            want = {last[1]} | {a[1] for a in tries if a[4] != "acked" and a[3] >= last[3]}
        else:
            want = {ZERO} | {a[1] for a in tries}
        # A fenced engine's write sent after its fencing never lands.
        late = {a[1] for a in tries if a[2] in fenced and a[3] >= fenced[a[2]]}
        if got in late:
            bad += 1
            print(f"FENCED WRITE LANDED: block {b} reads {got}, sent by the fenced engine's client after {fenced[got.rsplit('.', 1)[0]]:.3f}")
            continue
        want -= late
        if len(want) == 1 and ZERO not in want:
            exact += 1
        if got not in want:
            bad += 1
            lost = f"; the last acknowledged was {last[1]} at {last[5]:.3f}" if acked else ""
            print(f"BAD block {b}: reads {got}, expected one of {sorted(want)[:5]}{lost}")
    close()
    if reads:
        reads.close()
    n_acked = sum(1 for a in attempts.values() if a[4] == "acked")
    print(f"checked {blocks} blocks of {source} ({exact} with exactly one allowed version; "
          f"{len(attempts)} writes logged, {n_acked} acknowledged): {bad} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "write":
        sweep = "--sweep" in args
        fe = 16
        if "--flush-every" in args:
            i = args.index("--flush-every")
            fe = int(args[i + 1])
            del args[i:i + 2]
        args = [a for a in args if a != "--sweep"]
        uri, log, off, blocks, seed, tag, secs = args
        write(uri, log, int(off), int(blocks), int(seed), tag, float(secs), sweep, fe)
    elif cmd == "check":
        fenced = {}
        snapshot = None
        reads_out = None
        rest = []
        i = 0
        while i < len(args):
            if args[i] == "--reads-out":
                reads_out = args[i + 1]
                i += 2
            elif args[i] == "--as-of":
                snapshot = (float(args[i + 1]), float(args[i + 2]))
                i += 3
            elif args[i] == "--fenced":
                tag, _, t = args[i + 1].partition("@")
                fenced[tag] = float(t)
                i += 2
            else:
                rest.append(args[i])
                i += 1
        source, off, blocks, *logs = rest
        sys.exit(check(source, int(off), int(blocks), logs, fenced, snapshot, reads_out))
    else:
        sys.exit(__doc__)
