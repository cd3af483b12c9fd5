#!/usr/bin/env python3
"""Writes a one-layer image as a docker-archive tarball (the format of
`docker save`, which `ctr images import` reads) from local files only: no
registry, no Docker. Adapted from ../shared/tools/k8s-cluster/images.

usage: mkimage.py OUT.tar NAME:TAG [--entrypoint JSON] [--cmd JSON] [--env K=V]...
                  [--file SRC:DEST[:MODE]]... [--elf SRC[:DEST]]...
                  [--link TARGET:DEST]... [--dir DEST]...

--elf adds an executable with every shared library `ldd` names for it
(and the dynamic loader), each at the path ldd gives: the host's Debian 12
binaries then run unchanged in the image. The layer is deterministic
(every mtime 0, entries in a fixed order), so the same inputs make the
same image digest.
"""
import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile


def ldd(path):
    """The absolute paths of the shared objects `path` loads (the loader too)."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True)
    if out.returncode != 0:
        if "not a dynamic executable" in (out.stdout + out.stderr):
            return []
        sys.exit(f"mkimage.py: ldd {path}: {out.stderr.strip()}")
    libs = []
    for line in out.stdout.splitlines():
        line = line.strip()
        if "=>" in line:
            target = line.split("=>", 1)[1].strip().split(" ")[0]
            if target == "not":
                sys.exit(f"mkimage.py: {path}: a library is missing: {line}")
            if target.startswith("/"):
                libs.append(target)
        elif line.startswith("/"):
            libs.append(line.split(" ")[0])
    return libs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("name")
    ap.add_argument("--entrypoint", default=None)
    ap.add_argument("--cmd", default=None)
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--file", action="append", default=[])
    ap.add_argument("--elf", action="append", default=[])
    ap.add_argument("--link", action="append", default=[])
    ap.add_argument("--dir", action="append", default=[])
    a = ap.parse_args()

    files = {}  # dest -> (src, mode)
    for spec in a.file:
        src, dest, *mode = spec.split(":")
        files[dest.strip("/")] = (src, int(mode[0], 8) if mode else 0o755)
    for spec in a.elf:
        src, *dest = spec.split(":")
        files[(dest[0] if dest else src).strip("/")] = (src, 0o755)
        for lib in ldd(src):
            files.setdefault(lib.strip("/"), (os.path.realpath(lib), 0o755))
    links = {}
    for spec in a.link:
        target, dest = spec.split(":")
        links[dest.strip("/")] = target

    layer = io.BytesIO()
    seen = set()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as t:
        def add_dir(path):
            parts = path.strip("/").split("/")
            for i in range(1, len(parts) + 1):
                p = "/".join(parts[:i])
                if p and p not in seen:
                    seen.add(p)
                    ti = tarfile.TarInfo(p)
                    ti.type = tarfile.DIRTYPE
                    ti.mode = 0o1777 if p == "tmp" else 0o755
                    t.addfile(ti)
        for d in sorted(a.dir):
            add_dir(d)
        for dest in sorted(files):
            src, mode = files[dest]
            add_dir(os.path.dirname(dest))
            with open(src, "rb") as f:
                data = f.read()
            ti = tarfile.TarInfo(dest)
            ti.size = len(data)
            ti.mode = mode
            t.addfile(ti, io.BytesIO(data))
        for dest in sorted(links):
            if dest in files:
                continue
            add_dir(os.path.dirname(dest))
            ti = tarfile.TarInfo(dest)
            ti.type = tarfile.SYMTYPE
            ti.linkname = links[dest]
            ti.mode = 0o777
            t.addfile(ti)
    layer = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()

    cfg = {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] + a.env}
    if a.entrypoint:
        cfg["Entrypoint"] = json.loads(a.entrypoint)
    if a.cmd:
        cfg["Cmd"] = json.loads(a.cmd)
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "config": cfg,
        "created": "1970-01-01T00:00:00Z",
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "scripts/cluster.d/mkimage.py"}],
    }, sort_keys=True).encode()
    cfg_name = hashlib.sha256(config).hexdigest() + ".json"
    layer_name = diff_id[7:] + "/layer.tar"
    manifest = json.dumps([{"Config": cfg_name, "RepoTags": [a.name],
                            "Layers": [layer_name]}]).encode()
    tmp = a.out + ".tmp"
    with tarfile.open(tmp, "w") as out:
        for name, data in ((layer_name, layer), (cfg_name, config), ("manifest.json", manifest)):
            if "/" in name:
                ti = tarfile.TarInfo(name.split("/")[0])
                ti.type = tarfile.DIRTYPE
                ti.mode = 0o755
                out.addfile(ti)
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mode = 0o644
            out.addfile(ti, io.BytesIO(data))
    os.replace(tmp, a.out)
    print(f"{a.out}: {a.name} layer {diff_id[:19]} ({len(layer)} bytes)")


if __name__ == "__main__":
    main()
