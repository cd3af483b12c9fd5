#!/bin/bash
# A replicated volume created as the CSI plugin creates its engines
# (`volume_create` with "resume": true: recorded in the node state with its
# engine's session), attached with the kernel's NVMe/TCP initiator:
#
# 1. fio with crc32c verify on /dev/nvmeXnY while the engine's daemon is
#    SIGKILLed and started again: the engine resumes its recorded session,
#    the replicas take it back, the kernel reconnects, fio finishes with no
#    error and verifies clean; the I/O pause is fio's largest completion
#    latency.
# 2. A failover while the daemon is away: a second engine daemon (B) takes
#    the volume over (a new session, newer than A's); when A starts again
#    its resumed engine is fenced by the replicas and A drops the volume
#    and its record, saying why in its log; the data written through B
#    reads back intact through B.
#
# Two store daemons hold the replicas; engines A and B have stores of their
# own only for their node state. Everything on the guest's loopback.
. "$KVM_DIR/lib.sh"

VOL=rv
VOL_MIB=64
NQN=$NQN_PREFIX:$VOL
# fio's write phase is paced so that it spans the restart (as 20-restart.sh)
RATE_IOPS=300
KILL_AFTER=3
FIO_WAIT=300        # fio finishes within this after the restart
DROP_WAIT=60        # A's resumed engine fenced and dropped after A's start

for d in s1 s2 a b; do mkdir -p "$T/$d"; done
S_ARGS() { echo --store "$T/$1" --replica-listen "127.0.0.1:$2" --replica-insecure --listen "127.0.0.1:$3" --rpc-socket "$T/$1.sock"; }
# shellcheck disable=SC2046
lull_start PS1 s1.log 10911 $(S_ARGS s1 10911 10821) || { fail resume-setup "$LASTERR"; exit 1; }
# shellcheck disable=SC2046
lull_start PS2 s2.log 10912 $(S_ARGS s2 10912 10822) || { fail resume-setup "$LASTERR"; exit 1; }
for s in s1 s2; do
  out=$(rpc "$T/$s.sock" replica_create "{\"name\": \"$VOL\", \"size\": \"${VOL_MIB}M\"}" 2>&1) \
    || { fail resume-setup "replica_create on $s: $(echo "$out" | oneline)"; exit 1; }
done
A_ARGS=(--store "$T/a" --replica-listen 127.0.0.1:10913 --replica-insecure --listen 127.0.0.1:10823
  --nvmf-listen 127.0.0.1:4420 --rpc-socket "$T/a.sock")
B_ARGS=(--store "$T/b" --replica-listen 127.0.0.1:10914 --replica-insecure --listen 127.0.0.1:10824
  --nvmf-listen 127.0.0.1:4421 --rpc-socket "$T/b.sock")
CREATE="{\"name\": \"$VOL\", \"size\": \"${VOL_MIB}M\", \"backend\": \"replicas=127.0.0.1:10911/$VOL+127.0.0.1:10912/$VOL\", \"resume\": true}"
lull_start PA a.log 4420 "${A_ARGS[@]}" || { fail resume-setup "$LASTERR"; exit 1; }
out=$(rpc "$T/a.sock" volume_create "$CREATE" 2>&1) || { fail resume-setup "volume_create on A: $(echo "$out" | oneline)"; exit 1; }
if grep -q '"session"' "$T/a/volumes.json" 2>/dev/null; then
  pass resume-recorded "A's node state records $VOL with its engine's session: $(oneline < "$T/a/volumes.json")"
else
  fail resume-recorded "A's node state has no session for $VOL: $(oneline < "$T/a/volumes.json" 2>&1)"
fi

# ---- 1. SIGKILL and restart under fio ----
nvme_conn "$NQN" || { fail resume-connect "$LASTERR"; exit 1; }
info resume-connect "/dev/$DEV ($CTRL) in ${CONNECT_SECS}s"
kmark resume-kill
fio --name=resume --filename="/dev/$DEV" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k \
  --iodepth=16 --size="$FIOSZ" --rate_iops=,"$RATE_IOPS" --verify=crc32c --do_verify=1 --verify_fatal=1 \
  --verify_state_save=0 --output="$TOUT/fio-resume.txt" > "$TOUT/fio-resume.stderr" 2>&1 &
FP=$!
sleep "$KILL_AFTER"   # fio under way (a scheduling point; the pause is measured by fio)
t0=$(now)
kill -9 "$PA"; wait "$PA" 2>/dev/null
lull_start PA a.log 4420 "${A_ARGS[@]}" || { fail resume-kill "$LASTERR"; kill "$FP"; exit 1; }
up=$(secs "$t0")
live() { [ "$(ctrl_state "$CTRL")" = live ]; }
wait_until "$RECONNECT_WAIT" live || fail resume-kill "controller $CTRL not live ${RECONNECT_WAIT}s after the restart: $(ctrl_state "$CTRL")"
fio_done() { ! alive "$FP"; }
wait_until "$FIO_WAIT" fio_done || kill -9 "$FP"
wait "$FP"; rc=$?
f=$TOUT/fio-resume.txt
e=$(grep -oE 'err= *[0-9]+' "$f" | grep -vE 'err= *0$' | head -n1)
pause=$(clat_max_ms "$f")
rec=$(kreconnect resume-kill "$CTRL")
if [ "$rc" = 0 ] && [ -z "$e" ] && ! grep -qiE 'verify: bad|bad magic|crc32c' "$f" "$f.stderr"; then
  pass resume-kill "2-replica resumed volume: fio randwrite+verify through SIGKILL and restart: 0 errors, verify clean; I/O pause (fio max clat) ${pause} ms; the kernel from error recovery to reconnected: ${rec}s; lull listening again ${up}s after SIGKILL"
else
  fail resume-kill "fio rc=$rc ${e:-} through the restart: $(grep -hiE 'verify|error|bad' "$f" "$f.stderr" | head -n 3 | oneline); pause ${pause} ms"
fi
echo "PAUSE resume-kill $VOL ${pause}ms listening=${up}s kernel:${rec}s" >> "$TOUT/pauses.txt"
if grep -q 'engine resumed its recorded session' "$TOUT/a.log"; then pass resume-session "A's engine came back with its recorded session"
else fail resume-session "A's log does not say the engine resumed its session: $(grep -i "$VOL" "$TOUT/a.log" | tail -n 3 | oneline)"; fi
kclean resume-kill-dmesg resume-kill
nvme_disc "$NQN" || fail resume-disconnect "$LASTERR"

# ---- 2. failover to B while A is away; A comes back fenced ----
kill -9 "$PA"; wait "$PA" 2>/dev/null
lull_start PB b.log 4421 "${B_ARGS[@]}" || { fail resume-failover "$LASTERR"; exit 1; }
out=$(rpc "$T/b.sock" volume_create "$CREATE" 2>&1) || { fail resume-failover "volume_create on B (the failover): $(echo "$out" | oneline)"; exit 1; }
kmark resume-failover
NVME_PORT=4421 nvme_conn "$NQN" || { fail resume-failover "connect to B: $LASTERR"; exit 1; }
if fio_verify "/dev/$DEV" resume-b; then pass resume-failover-write "fio randwrite+verify through B: $FIO_SUMMARY"
else fail resume-failover-write "through B: $FIO_SUMMARY"; fi
lull_start PA a.log 4420 "${A_ARGS[@]}" || { fail resume-fenced "$LASTERR"; exit 1; }
gone() { ! rpc "$T/a.sock" volume_list 2>/dev/null | grep -q "\"$VOL\""; }
if wait_until "$DROP_WAIT" gone; then
  if grep -q "\"$VOL\"" "$T/a/volumes.json" 2>/dev/null; then fail resume-fenced "A dropped $VOL and its node state still lists it: $(oneline < "$T/a/volumes.json")"
  elif grep -q 'volume dropped: its replicas were taken over by a newer engine' "$TOUT/a.log"; then
    pass resume-fenced "A's resumed engine was fenced by the replicas (B's newer session) and A dropped $VOL and its record: $(grep 'volume dropped' "$TOUT/a.log" | tail -n1 | cut -c1-200)"
  else fail resume-fenced "A dropped $VOL without saying why in its log"; fi
else
  fail resume-fenced "A still serves $VOL ${DROP_WAIT}s after its start: $(rpc "$T/a.sock" replica_list "{\"volume\": \"$VOL\"}" 2>&1 | oneline)"
fi
# B's data is untouched by A's return: read back and verified
if fio_verify "/dev/$DEV" resume-b --verify_only; then pass resume-failover-intact "B's data verified after A's return: $FIO_SUMMARY"
else fail resume-failover-intact "after A's return: $FIO_SUMMARY"; fi
kclean resume-failover-dmesg resume-failover
NVME_PORT=4421 nvme_disc "$NQN" || fail resume-failover-disconnect "$LASTERR"
for p in "$PA" "$PB" "$PS1" "$PS2"; do stop "$p"; done
exit 0
