#!/usr/bin/python3
"""The engine's view of its replicas, over time, for scripts/netlab's
scenarios: polls `replica_list` on a `lull serve` RPC socket (JSON-RPC 2.0,
one object each way, as `lull rpc` does) and records every change.

  watch.py record SOCK VOLUME OUT [PERIOD_MS]
      until killed: one line per change, "T STATE1 STATE2 ..." (T the wall
      clock in seconds, as `date +%s.%N`; states in replica_list's order,
      "addr=state"), and "T rpc-error" while the socket does not answer.
  watch.py wait SOCK VOLUME WHAT TIMEOUT_S
      until WHAT holds, then prints the time: WHAT is "healthy" (every
      replica healthy), "degraded" (a replica not healthy), "STATE=ADDR"
      (the replica whose address starts with ADDR is in STATE: failed,
      rebuilding, healthy, ...), "no-healthy" (none healthy). Exit 1 at the
      timeout, printing the last states.
  watch.py summary SOCK VOLUME
      each replica: address, state, times failed, the last rebuild's kind
      and seconds, the last error (cut to 120 characters).
  watch.py times OUT T_FAULT T_HEAL
      from a record: the first change to "degraded" after T_FAULT, the first
      "all healthy" after T_HEAL, as "degraded_after_s=X healthy_after_s=Y"
      (X "none" when no replica left the healthy set).
"""

import json
import socket
import sys
import time


def call(sock_path, method, params, timeout=5.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock_path)
        s.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode())
        buf = b""
        dec = json.JSONDecoder()
        while True:
            chunk = s.recv(65536)
            if not chunk:
                raise OSError("connection closed")
            buf += chunk
            try:
                reply, _ = dec.raw_decode(buf.decode())
                break
            except ValueError:
                continue
    finally:
        s.close()
    if "error" in reply:
        raise RuntimeError(reply["error"].get("message", str(reply["error"])))
    return reply["result"]


def states(sock_path, volume):
    return [(r["addr"], r["state"]) for r in call(sock_path, "replica_list", {"volume": volume})]


def line(st):
    return " ".join(f"{a}={s}" for a, s in st)


def record(sock_path, volume, out, period_ms=50):
    last = None
    with open(out, "a", buffering=1) as f:
        while True:
            try:
                now = line(states(sock_path, volume))
            except (OSError, RuntimeError, ValueError):
                now = "rpc-error"
            if now != last:
                f.write(f"{time.time():.3f} {now}\n")
                last = now
            time.sleep(period_ms / 1000)


def holds(st, what):
    if what == "healthy":
        return bool(st) and all(s == "healthy" for _, s in st)
    if what == "degraded":
        return any(s != "healthy" for _, s in st)
    if what == "no-healthy":
        return not any(s == "healthy" for _, s in st)
    if "=" in what:
        state, addr = what.split("=", 1)
        return any(a.startswith(addr) and s == state for a, s in st)
    sys.exit(f"watch.py: unknown condition {what}")


def wait(sock_path, volume, what, timeout_s):
    deadline = time.monotonic() + timeout_s
    st = []
    while True:
        try:
            st = states(sock_path, volume)
            if holds(st, what):
                print(f"{time.time():.3f}")
                return 0
        except (OSError, RuntimeError, ValueError) as e:
            st = [("rpc", str(e))]
        if time.monotonic() > deadline:
            print(f"timeout after {timeout_s} s waiting for {what}: {line(st)}")
            return 1
        time.sleep(0.05)


def times(out, t_fault, t_heal):
    rows = []
    with open(out) as f:
        for ln in f:
            t, _, rest = ln.strip().partition(" ")
            rows.append((float(t), rest))
    degraded = next((t for t, r in rows if t >= t_fault and "rpc-error" not in r and "=" in r
                     and any(not p.endswith("=healthy") for p in r.split())), None)
    healthy = None
    for t, r in rows:
        if t >= t_heal and "rpc-error" not in r and all(p.endswith("=healthy") for p in r.split()):
            healthy = t
            break
    # Healthy already at the heal (never degraded, or back before it).
    if healthy is None and rows:
        before = [r for t, r in rows if t < t_heal]
        after = [r for t, r in rows if t >= t_heal]
        if not after and before and all(p.endswith("=healthy") for p in before[-1].split()):
            healthy = t_heal
    d = f"{degraded - t_fault:.2f}" if degraded is not None else "none"
    h = f"{healthy - t_heal:.2f}" if healthy is not None else "never"
    print(f"degraded_after_s={d} healthy_after_s={h}")


def summary(sock_path, volume):
    try:
        rs = call(sock_path, "replica_list", {"volume": volume})
    except (OSError, RuntimeError, ValueError) as e:
        print(f"replica_list failed: {e}")
        return
    out = []
    for r in rs:
        lr = r.get("last_rebuild") or {}
        rebuild = f" last rebuild {lr.get('kind')} {lr.get('secs', 0):.2f} s" if lr else ""
        err = (r.get("last_error") or "")[:120]
        out.append(f"{r['addr']} {r['state']} errors={r.get('errors')}{rebuild}" + (f" ({err})" if err else ""))
    print("; ".join(out))


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "record":
        record(args[0], args[1], args[2], int(args[3]) if len(args) > 3 else 50)
    elif cmd == "wait":
        sys.exit(wait(args[0], args[1], args[2], float(args[3])))
    elif cmd == "summary":
        summary(args[0], args[1])
    elif cmd == "times":
        times(args[0], float(args[1]), float(args[2]))
    else:
        sys.exit(__doc__)
