#!/bin/bash
# The kernel tier's benchmark (`scripts/kernel-vm bench`; docs/BENCHMARKS.md
# §18): in the guest, the kernel's NVMe/TCP initiator against lull and
# against SPDK's nvmf_tgt, and the kernel's NBD client against lull and
# nbdkit; fio jobs 4 KiB randread QD1 and QD32, 4 KiB randwrite QD32,
# 128 KiB read QD32, each BENCH_RUNTIME seconds after BENCH_RAMP. PAIRS
# interleaved pairs, the order reversed every other pair; medians, min-max
# and the per-pair ratio lull/other. Then the I/O pause across a daemon
# restart (SIGKILL) and an upgrade (SIGTERM, the other build) RESTARTS
# times each (tests/20-restart.sh with KVM_RESTART_REPEATS).
#
# Placement: each target on vCPU 0 (taskset; lull --cores 0; nvmf_tgt
# -m 0x1), fio on vCPU 1. Every target is attached once (nvme connect with
# keep-alive off, -k 0, so that a stopped target is not a lost one;
# nbd-client on its own /dev/nbdN), and the target not being measured is
# SIGSTOPped (nvmf_tgt polls a full core even when idle): interleaved per
# job, the two targets of a pair run back to back, a few seconds apart.
# Each target serves a BENCH_MIB memory volume (a malloc bdev for
# nvmf_tgt), 4 KiB blocks, filled once before the first run.
. "$KVM_DIR/lib.sh"

PAIRS=${KVM_BENCH_PAIRS:-5}           # interleaved pairs per job (issue 42: at least 5)
BENCH_RUNTIME=${KVM_BENCH_RUNTIME:-4} # seconds measured per fio run (TCG: short runs, many pairs)
BENCH_RAMP=1                          # seconds of fio ramp before each measured run
BENCH_MIB=64                          # each target's volume
RESTARTS=${KVM_BENCH_RESTARTS:-5}     # restart and upgrade pauses measured
SPDK_MEM=512                          # nvmf_tgt --no-huge -s MB: the malloc bdev and its pools
JOBS=("randread-4k-qd1 randread 4k 1" "randread-4k-qd32 randread 4k 32"
      "randwrite-4k-qd32 randwrite 4k 32" "read-128k-qd32 read 128k 32")
RAW=$TOUT/bench-raw.txt
: > "$RAW"

[ -n "$KVM_SPDK" ] && [ -x "$KVM_SPDK/bin/nvmf_tgt" ] || { fail bench-setup "no SPDK nvmf_tgt (LULL_SPDK_TOOLS)"; exit 1; }
command -v nbdkit > /dev/null || { fail bench-setup "no nbdkit"; exit 1; }

# ---- the targets ----
LULL_WRAP="taskset -c 0" lull_start PL lull.log 4420 --cores 0 --listen 127.0.0.1:10809 --nvmf-listen 127.0.0.1:4420 \
  --rpc-socket "$T/l.sock" --volume "b0:${BENCH_MIB}M" --nvmf-lba b0=4096 || { fail bench-setup "$LASTERR"; exit 1; }
taskset -c 0 "$KVM_SPDK/bin/nvmf_tgt" --no-huge -s "$SPDK_MEM" -m 0x1 -r "$T/spdk.sock" > "$TOUT/nvmf_tgt.log" 2>&1 &
PS=$!
wait_until "$PORT_WAIT" test -S "$T/spdk.sock" || { fail bench-setup "nvmf_tgt has no RPC socket: $(tail -n 3 "$TOUT/nvmf_tgt.log" | oneline)"; exit 1; }
# one rpc.py process for every call (Python's start-up takes seconds under TCG)
printf '%s\n' \
  "nvmf_create_transport -t TCP" \
  "bdev_malloc_create -b Malloc0 $BENCH_MIB 4096" \
  "nvmf_create_subsystem nqn.2016-06.io.spdk:b0 -a -s SPDK0" \
  "nvmf_subsystem_add_ns nqn.2016-06.io.spdk:b0 Malloc0" \
  "nvmf_subsystem_add_listener nqn.2016-06.io.spdk:b0 -t tcp -a 127.0.0.1 -s 4421" \
  | python3 "$KVM_SPDK/scripts/rpc.py" -s "$T/spdk.sock" -t 60 > "$TOUT/spdk-rpc.txt" 2>&1 \
  || { fail bench-setup "nvmf_tgt's RPC: $(tail -n 3 "$TOUT/spdk-rpc.txt" | oneline)"; exit 1; }
wait_port 4421 || { fail bench-setup "nvmf_tgt not listening on 4421"; exit 1; }
taskset -c 0 nbdkit -f -i 127.0.0.1 -p 10810 -e b0 memory "${BENCH_MIB}M" > "$TOUT/nbdkit.log" 2>&1 &
PN=$!
wait_port 10810 || { fail bench-setup "nbdkit not listening"; exit 1; }
kill -STOP "$PL" "$PS" "$PN"
info bench-setup "lull pid $PL (${KVM_LULL#"$KVM_REPO"/}), nvmf_tgt pid $PS, nbdkit pid $PN, all on vCPU 0; fio on vCPU 1; ${PAIRS} pairs x ${#JOBS[@]} jobs x ${BENCH_RUNTIME}s"

# attach PROTO TARGET -> DEVICE on stdout
attach() {
  case $1/$2 in
    nvmf/lull) NVME_PORT=4420 nvme_conn "$NQN_PREFIX:b0" -k 0 > /dev/null && echo "/dev/$(nvme_dev "$NQN_PREFIX:b0")" ;;
    nvmf/spdk) NVME_PORT=4421 nvme_conn nqn.2016-06.io.spdk:b0 -k 0 > /dev/null && echo "/dev/$(nvme_dev nqn.2016-06.io.spdk:b0)" ;;
    nbd/lull) nbd-client -N b0 127.0.0.1 10809 /dev/nbd0 > /dev/null 2>&1 && wait_until "$DEV_WAIT" test "$(cat /sys/block/nbd0/size)" != 0 && echo /dev/nbd0 ;;
    nbd/nbdkit) nbd-client -N b0 127.0.0.1 10810 /dev/nbd1 > /dev/null 2>&1 && wait_until "$DEV_WAIT" test "$(cat /sys/block/nbd1/size)" != 0 && echo /dev/nbd1 ;;
  esac
}
pid_of() { case $1 in lull) echo "$PL" ;; spdk) echo "$PS" ;; nbdkit) echo "$PN" ;; esac; }
declare -A DEVOF
kill -CONT "$PL" "$PS" "$PN"
for pt in nvmf/lull nvmf/spdk nbd/lull nbd/nbdkit; do
  d=$(attach "${pt%/*}" "${pt#*/}")
  if [ -z "$d" ] || [ ! -b "$d" ]; then fail bench-setup "attaching $pt failed: $LASTERR"; exit 1; fi
  dd if=/dev/urandom of="$d" bs=1M count="$BENCH_MIB" oflag=direct status=none
  DEVOF[$pt]=$d
done
kill -STOP "$PL" "$PS" "$PN"
info bench-setup "devices: nvmf lull ${DEVOF[nvmf/lull]}, spdk ${DEVOF[nvmf/spdk]}; nbd lull ${DEVOF[nbd/lull]}, nbdkit ${DEVOF[nbd/nbdkit]}; each filled with ${BENCH_MIB} MiB"

# one_run PAIR PROTO TARGET JOB...: one fio run with only TARGET running
one_run() {
  local pair=$1 proto=$2 tgt=$3 name=$4 rw=$5 bs=$6 qd=$7 dev line iops lat
  dev=${DEVOF[$proto/$tgt]}
  kill -CONT "$(pid_of "$tgt")"
  line=$(fio --name="$name" --filename="$dev" --direct=1 --ioengine=libaio --rw="$rw" --bs="$bs" \
    --iodepth="$qd" --size="${BENCH_MIB}M" --time_based --runtime="$BENCH_RUNTIME" --ramp_time="$BENCH_RAMP" \
    --cpus_allowed=1 --norandommap --randrepeat=0 --output-format=terse 2> "$TOUT/fio.err" | tail -n 1)
  kill -STOP "$(pid_of "$tgt")"
  # terse v3: field 5 the error, 8 read IOPS, 16 read clat mean (us); 49 write IOPS, 57 write clat mean
  if [ "$rw" = randwrite ]; then iops=$(echo "$line" | cut -d';' -f49); lat=$(echo "$line" | cut -d';' -f57)
  else iops=$(echo "$line" | cut -d';' -f8); lat=$(echo "$line" | cut -d';' -f16); fi
  [ "$(echo "$line" | cut -d';' -f5)" = 0 ] || { iops=ERR; echo "ERROR pair=$pair proto=$proto target=$tgt job=$name: $(oneline < "$TOUT/fio.err")" >> "$RAW"; }
  echo "RUN pair=$pair proto=$proto target=$tgt job=$name iops=${iops:-ERR} clat_mean_us=${lat:-ERR}" >> "$RAW"
}

t0=$(now)
for pair in $(seq 1 "$PAIRS"); do
  for proto in nvmf nbd; do
    other=spdk; [ "$proto" = nbd ] && other=nbdkit
    if [ $((pair % 2)) = 1 ]; then order="lull $other"; else order="$other lull"; fi
    for j in "${JOBS[@]}"; do
      # shellcheck disable=SC2086
      for tgt in $order; do one_run "$pair" "$proto" "$tgt" $j; done
    done
  done
  say "bench: pair $pair of $PAIRS done ($(secs "$t0")s)"
done
kill -CONT "$PL" "$PS" "$PN"
nvme disconnect -n "$NQN_PREFIX:b0" > /dev/null 2>&1; nvme disconnect -n nqn.2016-06.io.spdk:b0 > /dev/null 2>&1
nbd-client -d /dev/nbd0 > /dev/null 2>&1; nbd-client -d /dev/nbd1 > /dev/null 2>&1
stop "$PL"; stop "$PS"; stop "$PN"

# ---- medians, min-max, per-pair ratios ----
summary() { # PROTO OTHER JOB
  awk -v proto="$1" -v other="$2" -v job="$3" '
    function med(a, n,   i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
                                    return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
    function mn(a, n,   i, m) { m = a[1]; for (i = 2; i <= n; i++) if (a[i] < m) m = a[i]; return m }
    function mx(a, n,   i, m) { m = a[1]; for (i = 2; i <= n; i++) if (a[i] > m) m = a[i]; return m }
    $1 == "RUN" { split($0, f, /[ =]/); p = f[3]; pr = f[5]; t = f[7]; j = f[9]; v = f[11]
                  if (pr != proto || j != job || v == "ERR") next
                  if (t == "lull") L[p] = v; else if (t == other) O[p] = v }
    END { nl = no = nr = 0
          for (p in L) { nl++; l[nl] = L[p]; if (p in O) { nr++; r[nr] = L[p] / O[p] } }
          for (p in O) { no++; o[no] = O[p] }
          if (nr == 0) { print "no complete pair"; exit 1 }
          printf "lull %d IOPS [%d-%d], %s %d IOPS [%d-%d], ratio lull/%s %.3f [%.3f-%.3f] over %d pairs\n",
            med(l, nl), mn(l, nl), mx(l, nl), other, med(o, no), mn(o, no), mx(o, no), other, med(r, nr), mn(r, nr), mx(r, nr), nr }' "$RAW"
}
for proto in nvmf nbd; do
  other=spdk; [ "$proto" = nbd ] && other=nbdkit
  for j in "${JOBS[@]}"; do
    read -r name _ <<< "$j"
    if s=$(summary "$proto" "$other" "$name"); then pass "bench-$proto-$name" "$s"; else fail "bench-$proto-$name" "$s: $(grep ERROR "$RAW" | head -n 2 | oneline)"; fi
  done
done
grep ERROR "$RAW" | head -n 3 | while read -r l; do fail bench-runs "$l"; done

# ---- the I/O pause across restarts and upgrades ----
[ "$RESTARTS" -gt 0 ] || { skip bench-pause "KVM_BENCH_RESTARTS=0"; exit 0; }
export KVM_RESTART_REPEATS=$RESTARTS KVM_TOUT=$TOUT/restart KVM_T=$T/restart
mkdir -p "$KVM_TOUT" "$KVM_T"
bash "$KVM_DIR/tests/20-restart.sh" > "$KVM_TOUT/log" 2>&1
for kind in kill upgrade term; do
  grep -q "^PAUSE $kind " "$KVM_TOUT/pauses.txt" 2>/dev/null || continue
  s=$(awk -v k="$kind" '$1 == "PAUSE" && $2 == k { v = $4; sub(/ms$/, "", v); n++; a[n] = v + 0 }
    END { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
          m = (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
          printf "I/O pause (fio max clat) median %d ms [%d-%d] over %d runs (2 volumes each)", m, a[1], a[n], n }' "$KVM_TOUT/pauses.txt")
  info "bench-pause-$kind" "$s"
done
exit 0
