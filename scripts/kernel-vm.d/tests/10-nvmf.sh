#!/bin/bash
# The kernel's NVMe/TCP initiator against `lull serve --nvmf-listen`: a
# memory, a file and a 2-replica volume (two store daemons in the guest,
# replica links plain inside the guest), each connected once (plain, with
# a header digest, with a data digest), fio with crc32c verify, ext4 and xfs
# with a file round trip, an online resize seen in sysfs, disconnect; the
# multipath head; bad input from the kernel's side (a host NQN not allowed,
# a volume deleted while a host connects and while one does I/O).
. "$KVM_DIR/lib.sh"

VOL_MIB=320        # each volume: mkfs.xfs (xfsprogs 6.1) refuses a filesystem under 300 MB
GROW_MIB=384       # the size volume_resize grows to
HOST_OK=nqn.2014-08.org.nvmexpress:uuid:5e1f2a3b-0000-4000-8000-00000000a11e
HOST_BAD=nqn.2014-08.org.nvmexpress:uuid:5e1f2a3b-0000-4000-8000-0000000000bd
DELETE_WAIT=30     # an nvme connect racing a volume_delete returns within this (no hang)

E_SOCK=$T/e.sock
mkdir -p "$T/a" "$T/b"
say "starting two store daemons and the engine"
lull_start PA store-a.log 10900 --store "$T/a" --replica-listen 127.0.0.1:10900 --replica-insecure \
  --rpc-socket "$T/a.sock" --listen 127.0.0.1:10811 || { fail nvmf-setup "$LASTERR"; exit 1; }
lull_start PB store-b.log 10901 --store "$T/b" --replica-listen 127.0.0.1:10901 --replica-insecure \
  --rpc-socket "$T/b.sock" --listen 127.0.0.1:10812 || { fail nvmf-setup "$LASTERR"; exit 1; }
rpc "$T/a.sock" replica_create "{\"name\": \"rep0.r0\", \"size\": \"${VOL_MIB}M\"}" > "$TOUT/rpc.txt" 2>&1 &&
rpc "$T/b.sock" replica_create "{\"name\": \"rep0.r1\", \"size\": \"${VOL_MIB}M\"}" >> "$TOUT/rpc.txt" 2>&1 ||
  { fail nvmf-setup "replica_create: $(oneline < "$TOUT/rpc.txt")"; exit 1; }
E_ARGS=(--listen 127.0.0.1:10809 --nvmf-listen 127.0.0.1:4420 --rpc-socket "$E_SOCK" --replica-insecure
  --volume "mem0:${VOL_MIB}M" --volume "file0:${VOL_MIB}M:file=$T/file0.img"
  --volume "rep0:${VOL_MIB}M:replicas=127.0.0.1:10900/rep0.r0+127.0.0.1:10901/rep0.r1"
  --volume acl0:64M --nvmf-allow-host "acl0=$HOST_OK")
lull_start PE engine.log 4420 "${E_ARGS[@]}" || { fail nvmf-setup "$LASTERR"; exit 1; }
info nvmf-setup "engine up in ${LULL_UP_SECS}s"
healthy2() { [ "$(rpc "$E_SOCK" replica_list '{"volume": "rep0"}' 2>/dev/null | grep -ciE '"(state|health)": *"(healthy|in_sync|ok)"')" -ge 2 ]; }
wait_until 60 healthy2 || info nvmf-setup "rep0's replicas not both healthy after 60 s: $(rpc "$E_SOCK" replica_list '{"volume": "rep0"}' 2>&1 | oneline)"

# ---- discovery ----
kmark discover
if nvme discover -t tcp -a 127.0.0.1 -s 4420 > "$TOUT/discover.txt" 2>&1; then
  got=$(awk '/subnqn:/{print $2}' "$TOUT/discover.txt" | grep -v discovery | sort | oneline)
  want="$NQN_PREFIX:file0 $NQN_PREFIX:mem0 $NQN_PREFIX:rep0"
  if [ "$got" = "$want" ]; then pass nvmf-discover "lists $got; acl0 hidden from a host not allowed"
  else fail nvmf-discover "nvme discover listed '$got', want '$want' (acl0 hidden from this host)"; fi
else fail nvmf-discover "nvme discover failed: $(oneline < "$TOUT/discover.txt")"; fi

# ---- the three volumes ----
# one_volume VOL TAG CONNECT-FLAGS...
one_volume() {
  local vol=$1 tag=$2 nqn=$NQN_PREFIX:$1 size; shift 2
  kmark "$tag"
  if ! nvme_conn "$nqn" "$@"; then fail "nvmf-connect-$tag" "$LASTERR"; return 1; fi
  size=$(( $(cat "/sys/block/$DEV/size") * 512 ))
  if [ "$size" = $((VOL_MIB << 20)) ]; then
    pass "nvmf-connect-$tag" "nvme connect ${*:-(plain)} -> /dev/$DEV ($CTRL) in ${CONNECT_SECS}s, $size bytes"
  else fail "nvmf-connect-$tag" "/dev/$DEV is $size bytes, want $((VOL_MIB << 20))"; fi
  nvme id-ns "/dev/$DEV" > "$TOUT/id-ns-$tag.txt" 2>&1
  nvme id-ctrl "/dev/$CTRL" > "$TOUT/id-ctrl-$tag.txt" 2>&1
  [ "$vol" = mem0 ] && multipath_head "$tag"
  if fio_verify "/dev/$DEV" "$tag"; then pass "nvmf-fio-$tag" "$FIO_SUMMARY"; else fail "nvmf-fio-$tag" "$FIO_SUMMARY"; fi
  local fs
  for fs in ext4 xfs; do
    if fs_roundtrip "/dev/$DEV" "$fs" "$tag-$fs"; then pass "nvmf-$fs-$tag" "$FS_DETAIL"; else fail "nvmf-$fs-$tag" "$LASTERR"; fi
  done
  [ "$vol" != file0 ] && resize "$vol" "$tag"
  if nvme_disc "$nqn"; then pass "nvmf-disconnect-$tag" "nvme disconnect; /dev/$DEV and $CTRL gone"
  else fail "nvmf-disconnect-$tag" "$LASTERR"; fi
  kclean "nvmf-dmesg-$tag" "$tag"
}

# multipath_head: with native multipath on, the namespace is a head node
# /dev/nvmeXnY whose device is the nvme-subsystem, with a hidden per-path
# nvmeXcYnZ. Linux builds it only when Identify Namespace says NMIC bit 0
# (may be shared) or the controller CMIC says multi-controller.
multipath_head() {
  local mp link hidden nmic cmic
  mp=$(cat /sys/module/nvme_core/parameters/multipath 2>/dev/null)
  if [ "$mp" != Y ]; then fail nvmf-multipath-head "native multipath is off in this kernel (nvme_core multipath=$mp)"; return; fi
  link=$(readlink -f "/sys/block/$DEV/device")
  hidden=$(ls /sys/block | grep -E "^nvme[0-9]+c[0-9]+n[0-9]+$" | oneline)
  nmic=$(awk '/^nmic/{print $3}' "$TOUT/id-ns-$1.txt")
  cmic=$(awk '/^cmic/{print $3}' "$TOUT/id-ctrl-$1.txt")
  if [[ $link == */nvme-subsystem/nvme-subsys* ]] && [ -n "$hidden" ]; then
    pass nvmf-multipath-head "/dev/$DEV is a head node (device ${link##*/devices/}), per-path $hidden; NMIC $nmic, CMIC $cmic"
  else
    fail nvmf-multipath-head "/dev/$DEV hangs off ${link##*/devices/}, not an nvme-subsystem (hidden per-path devices: ${hidden:-none}): Identify Namespace NMIC $nmic, Identify Controller CMIC $cmic; Linux makes a head only for a namespace that may be shared (NMIC bit 0)"
  fi
}

# resize VOL TAG: grow the volume over RPC while connected; the kernel
# sees the new size (ns-rescan) and the new tail takes data
resize() {
  local vol=$1 tag=$2 out want=$((GROW_MIB << 20)) got
  if ! out=$(rpc "$E_SOCK" volume_resize "{\"name\": \"$vol\", \"size\": \"${GROW_MIB}M\"}" 2>&1); then
    fail "nvmf-resize-$tag" "volume_resize: $(echo "$out" | oneline)"; return
  fi
  nvme ns-rescan "/dev/$CTRL" > "$TOUT/rescan-$tag.txt" 2>&1
  sized() { [ "$(( $(cat "/sys/block/$DEV/size") * 512 ))" = "$want" ]; }
  if ! wait_until "$DEV_WAIT" sized; then
    fail "nvmf-resize-$tag" "after volume_resize to ${GROW_MIB}M and nvme ns-rescan, /sys/block/$DEV/size says $(( $(cat "/sys/block/$DEV/size") * 512 )) bytes"; return
  fi
  # 1 MiB of random data at the old end, read back with the cache dropped
  head -c 1M /dev/urandom > "$T/tail-$tag.bin"
  dd if="$T/tail-$tag.bin" of="/dev/$DEV" bs=1M seek=$((VOL_MIB)) count=1 oflag=direct status=none 2> "$TOUT/tail-$tag.txt"
  got=$(dd if="/dev/$DEV" bs=1M skip=$((VOL_MIB)) count=1 iflag=direct status=none 2>> "$TOUT/tail-$tag.txt" | sha256sum)
  if [ "$got" = "$(sha256sum < "$T/tail-$tag.bin")" ]; then
    pass "nvmf-resize-$tag" "volume_resize ${VOL_MIB}M -> ${GROW_MIB}M; /sys/block/$DEV/size $want bytes after ns-rescan; 1 MiB past the old end written and read back"
  else fail "nvmf-resize-$tag" "the new tail did not read back what was written: $(oneline < "$TOUT/tail-$tag.txt")"; fi
}

one_volume mem0 mem0-plain
one_volume file0 file0-hdgst --hdr-digest
one_volume rep0 rep0-ddgst --data-digest

# ---- bad input: a host NQN not allowed ----
kmark acl
NQN=$NQN_PREFIX:acl0
pattern=$T/acl-pattern.bin; head -c 1M /dev/urandom > "$pattern"
if nvme_conn "$NQN" --hostnqn="$HOST_OK"; then
  dd if="$pattern" of="/dev/$DEV" bs=1M count=1 oflag=direct status=none
  nvme_disc "$NQN" || fail nvmf-refuse-host "disconnecting the allowed host: $LASTERR"
  if out=$(nvme connect -t tcp -a 127.0.0.1 -s 4420 -n "$NQN" --hostnqn="$HOST_BAD" 2>&1); then
    fail nvmf-refuse-host "nvme connect --hostnqn $HOST_BAD succeeded ($(echo "$out" | oneline)); device $(nvme_dev "$NQN")"
    nvme disconnect -n "$NQN" > /dev/null 2>&1
  elif nvme_dev "$NQN" > /dev/null; then
    fail nvmf-refuse-host "connect failed but a block device appeared: $(nvme_dev "$NQN")"
  elif ! alive "$PE"; then
    fail nvmf-refuse-host "lull serve died"
  elif ! kline=$(ksince acl | grep -m1 "Connect for subsystem $NQN is not allowed, hostnqn: $HOST_BAD"); then
    fail nvmf-refuse-host "refused, but the kernel does not say the host is not allowed (Connect Invalid Host): $(ksince acl | grep -iE 'connect' | tail -n 2 | oneline)"
  else
    pass nvmf-refuse-host "nvme connect --hostnqn $HOST_BAD refused: $(echo "$out" | oneline); the kernel: ${kline#*] }; no device; lull serving"
  fi
  if nvme_conn "$NQN" --hostnqn="$HOST_OK"; then
    got=$(dd if="/dev/$DEV" bs=1M count=1 iflag=direct status=none | sha256sum)
    PASS_DETAIL="the allowed host reads back the 1 MiB it wrote before the refusal"
    check nvmf-refuse-host-untouched "the allowed host read back other data after the refusal" \
      [ "$got" = "$(sha256sum < "$pattern")" ]
    nvme_disc "$NQN" || fail nvmf-refuse-host-untouched "$LASTERR"
  else fail nvmf-refuse-host-untouched "the allowed host could not connect again: $LASTERR"; fi
else fail nvmf-refuse-host "the allowed host $HOST_OK could not connect: $LASTERR"; fi
kclean nvmf-dmesg-acl acl

# ---- bad input: a volume deleted while a host connects, and while one does I/O ----
create() { rpc "$E_SOCK" volume_create "{\"name\": \"$1\", \"size\": \"64M\", \"backend\": \"malloc\"}" >> "$TOUT/rpc.txt" 2>&1; }
served() { rpc "$E_SOCK" volume_list > "$TOUT/volume-list.txt" 2>&1 && grep -q '"mem0"' "$TOUT/volume-list.txt" && grep -q '"rep0"' "$TOUT/volume-list.txt"; }
if create del0; then
  NQN=$NQN_PREFIX:del0
  t0=$(now)
  timeout "$DELETE_WAIT" nvme connect -t tcp -a 127.0.0.1 -s 4420 -n "$NQN" --reconnect-delay=1 --ctrl-loss-tmo=5 > "$TOUT/del0-connect.txt" 2>&1 &
  cpid=$!
  rpc "$E_SOCK" volume_delete '{"name": "del0"}' > "$TOUT/del0-delete.txt" 2>&1; drc=$?
  wait "$cpid"; crc=$?
  took=$(secs "$t0")
  nvme disconnect -n "$NQN" > /dev/null 2>&1
  if [ "$crc" = 124 ]; then fail nvmf-delete-while-connecting "nvme connect hung past ${DELETE_WAIT}s"
  elif [ "$drc" != 0 ]; then fail nvmf-delete-while-connecting "volume_delete failed: $(oneline < "$TOUT/del0-delete.txt")"
  elif ! wait_until "$GONE_WAIT" no_dev "$NQN"; then fail nvmf-delete-while-connecting "a device or controller of the deleted volume stays: $(nvme_dev "$NQN") $(nvme_ctrls "$NQN" | oneline)"
  elif ! alive "$PE" || ! served; then fail nvmf-delete-while-connecting "lull serve is not serving any more: $(tail -n 3 "$TOUT/engine.log" | oneline)"
  else pass nvmf-delete-while-connecting "connect exit $crc in ${took}s ($(oneline < "$TOUT/del0-connect.txt" | cut -c1-120)); volume deleted; nothing left; lull serving"; fi
  # connecting after the delete: a refusal the kernel can read (Connect
  # Invalid Parameters, IATTR 1, IPO the offset of SUBNQN in the data: the
  # kernel names the field)
  kmark deleted
  if out=$(timeout "$DELETE_WAIT" nvme connect -t tcp -a 127.0.0.1 -s 4420 -n "$NQN" 2>&1); then
    fail nvmf-connect-deleted "nvme connect to the deleted volume succeeded: $(echo "$out" | oneline)"; nvme disconnect -n "$NQN" >/dev/null 2>&1
  elif kline=$(ksince deleted | grep -m1 "Connect Invalid Data Parameter, subsysnqn"); then
    pass nvmf-connect-deleted "refused: $(echo "$out" | oneline); the kernel: ${kline#*] }"
  else
    fail nvmf-connect-deleted "refused, but the kernel cannot tell which field: $(ksince deleted | grep -iE 'connect' | head -n 1 | sed 's/^[^]]*] //') (Connect Invalid Parameters' DW0 must hold IPO in bits 15:0 and IATTR in bit 16)"
  fi
else fail nvmf-delete-while-connecting "volume_create del0: $(tail -n 2 "$TOUT/rpc.txt" | oneline)"; fi

if create del1; then
  NQN=$NQN_PREFIX:del1
  if nvme_conn "$NQN" --ctrl-loss-tmo=5; then
    # reads in flight while the volume goes: they may fail (the volume is
    # gone) but must end, and the device with them
    timeout "$DELETE_WAIT" fio --name=del1 --filename="/dev/$DEV" --direct=1 --ioengine=libaio --rw=randread \
      --bs=4k --iodepth=8 --time_based --runtime=15 --output="$TOUT/fio-del1.txt" > /dev/null 2>&1 &
    fpid=$!
    sleep 2   # fio under way (a scheduling point, not a synchronisation)
    rpc "$E_SOCK" volume_delete '{"name": "del1"}' > "$TOUT/del1-delete.txt" 2>&1; drc=$?
    wait "$fpid"; frc=$?
    nvme disconnect -n "$NQN" > /dev/null 2>&1
    if [ "$frc" = 124 ]; then fail nvmf-delete-under-io "fio on the deleted volume hung past ${DELETE_WAIT}s"
    elif [ "$drc" != 0 ]; then fail nvmf-delete-under-io "volume_delete failed: $(oneline < "$TOUT/del1-delete.txt")"
    elif ! wait_until "$GONE_WAIT" no_dev "$NQN"; then fail nvmf-delete-under-io "the device stays: $(nvme_dev "$NQN")"
    elif ! alive "$PE" || ! served; then fail nvmf-delete-under-io "lull serve is not serving any more"
    else pass nvmf-delete-under-io "fio exit $frc ($(grep -m1 -oE 'err= *[0-9]+[^)]*' "$TOUT/fio-del1.txt" | oneline)), device gone, lull serving"; fi
  else fail nvmf-delete-under-io "connect: $LASTERR"; fi
else fail nvmf-delete-under-io "volume_create del1: $(tail -n 2 "$TOUT/rpc.txt" | oneline)"; fi

# ---- a clean stop ----
stop "$PE"
if [ "$STOP_RC" != 0 ]; then fail nvmf-stop "lull serve exited $STOP_RC on SIGTERM ($STOP_NOTE): $(tail -n 3 "$TOUT/engine.log" | oneline)"
elif grep -qiE 'panicked|thread .* panicked' "$TOUT/engine.log"; then fail nvmf-stop "a panic in the engine's log: $(grep -m1 -i panicked "$TOUT/engine.log")"
else pass nvmf-stop "SIGTERM: the engine exited 0, no panic in its log"; fi
stop "$PA"; stop "$PB"
exit 0
