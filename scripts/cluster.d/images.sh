#!/usr/bin/env bash
# Writes the cluster tier's images as docker-archive tarballs into
# $CACHE/images, from local files only (no registry is reachable, and none
# is needed): mkimage.py packs each one. A tarball newer than its inputs
# is kept.
#
#   scripts/cluster.d/images.sh CACHE LULL_BIN
#
#   localhost/pause:3.10          the pod sandbox (pause.c, gcc -static)
#   localhost/lull:cluster        the lull binary under test and the node
#                                 tools its attach methods run (the host's
#                                 Debian 12 binaries with their libraries;
#                                 deploy/kubernetes/Dockerfile installs the
#                                 same packages for users who build with Docker)
#   localhost/workload:cluster    busybox and fio, for the scenarios' pods
#   localhost/SIDECAR:VERSION     each CSI sidecar and the snapshot controller,
#                                 built by build.sh from its Go module
set -euo pipefail
# One compound command, read whole before it runs (a shared checkout may
# change this file during a run).
{
CACHE=${1:?usage: images.sh CACHE LULL_BIN}
LULL_BIN=${2:?usage: images.sh CACHE LULL_BIN}
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/cluster.d/versions.sh
. "$HERE/versions.sh"
B=$CACHE/bin I=$CACHE/images
mkdir -p "$I"
mk() { python3 "$HERE/mkimage.py" "$@" >/dev/null; }
fresh() { # fresh TAR INPUT...: the tarball exists and is newer than every input
  local tar=$1 f; shift
  [ -s "$tar" ] || return 1
  for f in "$@"; do [ "$tar" -nt "$f" ] || return 1; done
}
# a static busybox (Debian's busybox-static) for sh and the small tools
BB=$(dpkg -L busybox-static 2>/dev/null | grep -E '/bin/busybox$' | head -1)
[ -n "$BB" ] && [ -x "$BB" ] || { echo "images.sh: no busybox-static (apt-get install busybox-static)" >&2; exit 1; }
bb_links() { # --link args for busybox applets, except those in $1 (a |-separated list)
  local a
  for a in $("$BB" --list-full); do
    [[ "/$a" =~ ^/(${1})$ ]] && continue
    printf -- '--link\n/bin/busybox:/%s\n' "$a"
  done
}
etc() { # /etc files every image has
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$I/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' > "$I/group"
}
etc
common=(--file "$BB:/bin/busybox" --file "$I/passwd:/etc/passwd:644" --file "$I/group:/etc/group:644"
        --dir /tmp --dir /proc --dir /sys --dir /dev --dir /root --dir /run --dir /var/tmp)

if ! fresh "$I/pause.tar" "$HERE/pause.c"; then
  gcc -Os -static -s -o "$I/pause" "$HERE/pause.c"
  mk "$I/pause.tar" localhost/pause:3.10 --entrypoint '["/pause"]' --file "$I/pause:/pause"
fi

if ! fresh "$I/workload.tar" "$BB" /usr/bin/fio "$HERE/mkimage.py"; then
  mapfile -t links < <(bb_links 'bin/busybox')
  mk "$I/workload.tar" localhost/workload:cluster --cmd '["/bin/sh"]' \
    "${common[@]}" --elf /usr/bin/fio --dir /data "${links[@]}"
fi

# The node tools lull's attach methods run (crates/csi/src/attach*.rs):
# fuse: nbdfuse, losetup; nbd: nbd-client; nvme-tcp: nvme; modprobe;
# filesystems: mkfs.ext4/e2fsck/resize2fs/dumpe2fs, mkfs.xfs/xfs_growfs;
# mount, umount, blkid, blockdev; fusermount3 (nbdfuse unmounts with it).
tools=(/usr/bin/nbdfuse /usr/sbin/losetup /usr/sbin/nbd-client /usr/sbin/nvme /usr/sbin/modprobe
       /usr/sbin/mkfs.ext4 /usr/sbin/mke2fs /usr/sbin/e2fsck /usr/sbin/resize2fs /usr/sbin/dumpe2fs
       /usr/sbin/mkfs.xfs /usr/sbin/xfs_growfs /usr/sbin/xfs_db /usr/sbin/xfs_io
       /usr/bin/mount /usr/bin/umount /usr/sbin/blkid /usr/sbin/blockdev /usr/bin/fusermount3)
for t in "${tools[@]}"; do
  [ -x "$t" ] || { echo "images.sh: $t is missing (scripts/cluster installs its package)" >&2; exit 1; }
done
if ! fresh "$I/lull.tar" "$LULL_BIN" "$BB" "$HERE/mkimage.py" "${tools[@]}"; then
  elf=()
  for t in "${tools[@]}"; do elf+=(--elf "$t"); done
  # busybox applets that would shadow a real tool stay out
  mapfile -t links < <(bb_links 'bin/busybox|bin/mount|bin/umount|sbin/losetup|sbin/modprobe|sbin/blkid|sbin/blockdev|usr/bin/nbdfuse|sbin/e2fsck|sbin/mke2fs')
  mk "$I/lull.tar" localhost/lull:cluster --entrypoint '["/usr/local/bin/lull"]' \
    "${common[@]}" --elf "$LULL_BIN:/usr/local/bin/lull" "${elf[@]}" \
    --file /etc/mke2fs.conf:/etc/mke2fs.conf:644 --link ../proc/self/mounts:/etc/mtab \
    --dir /var/lib/lull --dir /var/lib/lull-csi "${links[@]}"
fi

for s in csi-provisioner csi-resizer csi-snapshotter snapshot-controller; do
  v=$(sidecar_version "$s")
  if ! fresh "$I/$s.tar" "$B/$s"; then
    mk "$I/$s.tar" "localhost/$s:$v" --entrypoint "[\"/$s\"]" --file "$B/$s:/$s" --dir /tmp
  fi
done
ls -la "$I"/*.tar
exit
}
