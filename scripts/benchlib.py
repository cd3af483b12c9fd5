"""Helpers of the Python benchmark scripts (scripts/bench-snapshots,
scripts/bench-qos): one `lull serve` on core 1, fio's nbd engine on core 0,
interleaved pairs."""

import json
import os
import socket
import statistics
import subprocess
import sys
import time

LULL = os.environ.get("LULL", "target/release/lull")
PY = "/usr/bin/python3"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Server:
    def __init__(self, work, volumes):
        self.port = free_port()
        self.sock = os.path.join(work, "rpc.sock")
        args = ["taskset", "-c", "1", LULL, "serve", "--cores", "1",
                "--listen", f"127.0.0.1:{self.port}", "--rpc-socket", self.sock]
        for v in volumes:
            args += ["--volume", v]
        self.log = open(os.path.join(work, "serve.log"), "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port)).close()
                return
            except OSError:
                time.sleep(0.05)
        sys.exit("lull serve did not start; see serve.log")

    def uri(self, export):
        return f"nbd://127.0.0.1:{self.port}/{export}"

    def rpc(self, method, params):
        out = subprocess.run([LULL, "rpc", "-s", self.sock, method, json.dumps(params)],
                             check=True, capture_output=True, text=True)
        return json.loads(out.stdout) if out.stdout.strip() else None

    def wchar(self):
        with open(f"/proc/{self.proc.pid}/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
        return 0

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def fio(uri, rw, bs, qd, runtime=None, io_size=None):
    args = ["taskset", "-c", "0", "fio", "--name=b", "--ioengine=nbd", f"--uri={uri}",
            f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", "--output-format=json"]
    if runtime:
        args += ["--time_based", f"--runtime={runtime}"]
    if io_size:
        args += [f"--io_size={io_size}"]
    out = subprocess.run(args, check=True, capture_output=True, text=True)
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    side = job["read"] if rw.endswith("read") else job["write"]
    return side["iops"], side["clat_ns"]["max"] / 1000.0


def med(xs):
    return statistics.median(xs)


def spread(xs):
    return f"{min(xs):,.0f}-{max(xs):,.0f}"


def pairs(n, a, b):
    """n pairs of (a(), b()), the order alternating."""
    ra, rb = [], []
    for i in range(n):
        if i % 2 == 0:
            ra.append(a()); rb.append(b())
        else:
            rb.append(b()); ra.append(a())
    return ra, rb


