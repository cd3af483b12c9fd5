#!/bin/bash
# Attached volumes across a daemon restart, with the kernel's NVMe/TCP
# initiator: fio with crc32c verify on /dev/nvmeXnY of a volume declared on
# the command line (cli0) and of one created over RPC (rpc0: volume_create,
# recorded in the node's --store) while `lull serve` is SIGKILLed and
# started again with the same flags and store, then while it is SIGTERMed
# and a different build is started (an upgrade). fio must finish with no
# error and verify clean; the I/O pause is fio's largest completion
# latency. The namespace's identity in sysfs must not change, and the
# namespace must be a multipath head (so a path change is survivable).
. "$KVM_DIR/lib.sh"

VOL_MIB=128
# fio's write phase is paced so that it spans the restart: FIOSZ of 4 KiB
# writes at RATE_IOPS, the kill KILL_AFTER seconds in; reads (the verify
# phase) unpaced.
RATE_IOPS=300
KILL_AFTER=3
FIO_WAIT=300        # both fio runs finish within this after the restart
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:5e1f2a3b-0000-4000-8000-0000000003e5
REPEATS=${KVM_RESTART_REPEATS:-1}   # each kind of restart; bench.sh measures 5

E_SOCK=$T/e.sock
mkdir -p "$T/store"
E_ARGS=(--store "$T/store" --replica-listen 127.0.0.1:10902 --replica-insecure
  --listen 127.0.0.1:10809 --nvmf-listen 127.0.0.1:4420 --rpc-socket "$E_SOCK"
  --volume "cli0:${VOL_MIB}M:file=$T/cli0.img")
lull_start PE engine.log 4420 "${E_ARGS[@]}" || { fail restart-setup "$LASTERR"; exit 1; }
if ! out=$(rpc "$E_SOCK" volume_create "{\"name\": \"rpc0\", \"size\": \"${VOL_MIB}M\", \"backend\": \"file=$T/rpc0.img\"}" 2>&1); then
  fail restart-setup "volume_create rpc0: $(echo "$out" | oneline)"; exit 1
fi
grep -q rpc0 "$T/store/volumes.json" 2>/dev/null || info restart-setup "rpc0 is not in $T/store/volumes.json: $(cat "$T/store/volumes.json" 2>&1 | oneline)"

declare -A DEVS CTRLS
for v in cli0 rpc0; do
  if ! nvme_conn "$NQN_PREFIX:$v" --hostnqn="$HOSTNQN"; then fail "restart-connect-$v" "$LASTERR"; exit 1; fi
  DEVS[$v]=$DEV CTRLS[$v]=$CTRL
done
info restart-setup "cli0 /dev/${DEVS[cli0]}, rpc0 /dev/${DEVS[rpc0]}, connected with --reconnect-delay=1 --ctrl-loss-tmo=$CTRL_LOSS_TMO"

# ids VOL: the namespace's identity as the kernel shows it
ids() {
  local d=/sys/block/${DEVS[$1]} a
  for a in wwid nguid uuid eui; do printf '%s=%s ' "$a" "$(cat "$d/$a" 2>/dev/null || echo -)"; done
}
declare -A ID0
for v in cli0 rpc0; do ID0[$v]=$(ids "$v"); done
info restart-ids "cli0: ${ID0[cli0]}; rpc0: ${ID0[rpc0]}"
# identifiers lull must report (NGUID, UUID, EUI-64): the kernel's wwid
# falls back to the serial number and model without them
for v in cli0; do
  id=${ID0[$v]}
  if [[ $id == *"nguid=-"* ]] || [[ $id == *"uuid=-"* ]] || [[ $id == *"eui=-"* ]]; then
    fail restart-ns-identifiers "/sys/block/${DEVS[$v]} lacks namespace identifiers: $id (want nguid, uuid and eui: Identify Namespace NGUID/EUI64 and the descriptor list)"
  else pass restart-ns-identifiers "$id"; fi
done
link=$(readlink -f "/sys/block/${DEVS[cli0]}/device")
if [[ $link == */nvme-subsystem/nvme-subsys* ]]; then pass restart-multipath-head "/dev/${DEVS[cli0]} hangs off ${link##*/devices/}"
else fail restart-multipath-head "/dev/${DEVS[cli0]} hangs off ${link##*/devices/} (the controller): no multipath head"; fi

# cycle KIND N: fio on both volumes, then the restart of KIND (kill: SIGKILL
# and the same build; term: SIGTERM and the same build; upgrade: SIGTERM and
# the other build, so repeated upgrades go back and forth)
CUR=$KVM_LULL
# build BIN: the build a binary is a snapshot of (scripts/kernel-vm's KVM_*_SRC)
build() { if [ "$1" = "$KVM_LULL" ]; then echo "${KVM_LULL_SRC:-$1}"; else echo "${KVM_LULL_UPGRADE_SRC:-$1}"; fi; }
cycle() {
  local kind=$1 n=$2 bin=$CUR sig=KILL v pids=() rc t0 up sfx=""
  [ "$REPEATS" -gt 1 ] && sfx="#$n"
  if [ "$kind" = upgrade ]; then
    sig=TERM; bin=$KVM_LULL_UPGRADE; [ "$CUR" = "$KVM_LULL_UPGRADE" ] && bin=$KVM_LULL
  fi
  [ "$kind" = term ] && sig=TERM
  local from=$CUR; CUR=$bin
  kmark "restart-$kind$sfx"
  for v in cli0 rpc0; do
    fio --name="$kind-$v" --filename="/dev/${DEVS[$v]}" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k \
      --iodepth=16 --size="$FIOSZ" --rate_iops=,"$RATE_IOPS" --verify=crc32c --do_verify=1 --verify_fatal=1 \
      --verify_state_save=0 --output="$TOUT/fio-$kind-$v.txt" > "$TOUT/fio-$kind-$v.stderr" 2>&1 &
    pids+=($!)
  done
  sleep "$KILL_AFTER"   # fio under way (a scheduling point; the pause is measured by fio)
  t0=$(now)
  if [ "$sig" = KILL ]; then kill -9 "$PE"; wait "$PE" 2>/dev/null; else stop "$PE" TERM; fi
  lull_start PE engine.log 4420 "BIN=$bin" "${E_ARGS[@]}" || { fail "restart-$kind$sfx" "$LASTERR"; kill "${pids[@]}"; return 1; }
  up=$(secs "$t0")
  live() { [ "$(ctrl_state "${CTRLS[cli0]}")" = live ] && [ "$(ctrl_state "${CTRLS[rpc0]}")" = live ]; }
  wait_until "$RECONNECT_WAIT" live || fail "restart-$kind$sfx" "controllers not live ${RECONNECT_WAIT}s after the restart: $(ctrl_state "${CTRLS[cli0]}") $(ctrl_state "${CTRLS[rpc0]}")"
  local rec=""
  for v in cli0 rpc0; do rec="$rec ${CTRLS[$v]} $(kreconnect "restart-$kind$sfx" "${CTRLS[$v]}")s"; done
  local i=0
  for v in cli0 rpc0; do
    wait_fio() { ! alive "${pids[$i]}"; }
    if ! wait_until "$FIO_WAIT" wait_fio; then kill -9 "${pids[$i]}"; fi
    wait "${pids[$i]}"; rc=$?
    local f=$TOUT/fio-$kind-$v.txt e pause
    e=$(grep -oE 'err= *[0-9]+' "$f" | grep -vE 'err= *0$' | head -n1)
    pause=$(clat_max_ms "$f")
    if [ "$rc" = 0 ] && [ -z "$e" ] && ! grep -qiE 'verify: bad|bad magic|crc32c' "$f" "$f.stderr"; then
      pass "restart-$kind-$v$sfx" "fio randwrite+verify through the ${kind}: 0 errors, verify clean; I/O pause (fio max clat) ${pause} ms; the kernel from error recovery to reconnected:${rec}; lull listening again ${up}s after SIG$sig (this script's view)$( [ "$kind" = upgrade ] && echo "; upgraded $(build "$from") -> $(build "$bin")")"
    else
      fail "restart-$kind-$v$sfx" "fio rc=$rc ${e:-} through the ${kind}: $(grep -hiE 'verify|error|bad' "$f" "$f.stderr" | head -n 3 | oneline); pause ${pause} ms"
    fi
    echo "PAUSE $kind $v ${pause}ms listening=${up}s kernel:${rec}" >> "$TOUT/pauses.txt"
    i=$((i + 1))
  done
  for v in cli0 rpc0; do
    local now_id; now_id=$(ids "$v")
    if [ "$now_id" = "${ID0[$v]}" ]; then pass "restart-$kind-ids-$v$sfx" "same identity after the $kind: $now_id"
    else fail "restart-$kind-ids-$v$sfx" "identity changed across the $kind: before ${ID0[$v]}, after $now_id"; fi
  done
  kclean "restart-$kind-dmesg$sfx" "restart-$kind$sfx"
}

for n in $(seq 1 "$REPEATS"); do cycle kill "$n"; done
if [ -n "$KVM_LULL_UPGRADE" ]; then
  for n in $(seq 1 "$REPEATS"); do cycle upgrade "$n"; done
else
  skip restart-upgrade "no second lull build to upgrade to (LULL_BIN_UPGRADE, or both target/ci/lull and target/release/lull); SIGTERM and the same build instead"
  for n in $(seq 1 "$REPEATS"); do cycle term "$n"; done
fi

# rpc0 is still a volume after the restarts (it came back from the store's record)
if rpc "$E_SOCK" volume_list 2>&1 | grep -q '"rpc0"'; then pass restart-rpc-volume-recorded "rpc0 recreated from $T/store/volumes.json at each start"
else fail restart-rpc-volume-recorded "rpc0 is gone after the restarts"; fi
for v in cli0 rpc0; do
  if nvme_disc "$NQN_PREFIX:$v"; then pass "restart-disconnect-$v" "device gone"; else fail "restart-disconnect-$v" "$LASTERR"; fi
done
stop "$PE"
exit 0
