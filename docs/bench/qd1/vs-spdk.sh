#!/bin/bash
# usage: docs/bench/qd1/vs-spdk.sh N [LULL] -- alternates lull (adaptive;
# LULL, default target/release/lull) and SPDK's nvmf_tgt (poll), QD1 4 KiB
# randread+randwrite (ab.sh's fill and perf commands; target on core 1, perf
# on core 0). SPDK=DIR overrides ../shared/tools/spdk.
set -u
T=${SPDK:-../shared/tools/spdk}
LULL=${2:-target/release/lull}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
perf() { # port nqn job
  TR="trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$1 subnqn:$2"
  taskset -c 0 $T/bin/spdk_nvme_perf --no-huge -s 256 -c 0x1 -q 32 -o 131072 -w write -t 1 -r "$TR" >/dev/null 2>&1
  taskset -c 0 $T/bin/spdk_nvme_perf --no-huge -s 256 -c 0x1 -q 1 -o 4096 -w $3 -t 3 -a 1 -r "$TR" 2>/dev/null | awk '/^Total/{print $3, $5}'
}
run_lull() { # job port
  rm -f $W/qd1.sock
  taskset -c 1 $LULL serve --nvmf-listen 127.0.0.1:$2 --listen 127.0.0.1:0 --rpc-socket $W/qd1.sock --mode adaptive --cores 1 --volume bench:128M > $W/qd1-serve.log 2>&1 &
  local pid=$!
  sleep 0.7
  perf $2 nqn.2026-11.io.lull:bench $1
  kill $pid; wait $pid 2>/dev/null
}
run_spdk() { # job port
  rm -f $W/qd1-spdk.sock
  $T/bin/nvmf_tgt --no-huge -s 1024 -m 0x2 -r $W/qd1-spdk.sock > $W/qd1-spdk.log 2>&1 &
  local pid=$!
  R="python3 $T/scripts/rpc.py -s $W/qd1-spdk.sock"
  for i in $(seq 1 50); do [ -S $W/qd1-spdk.sock ] && break; sleep 0.1; done
  sleep 0.3
  { $R nvmf_create_transport -t TCP && $R bdev_malloc_create -b Malloc0 128 4096 && $R nvmf_create_subsystem nqn.2016-06.io.spdk:cnode1 -a -s SPDK1 && $R nvmf_subsystem_add_ns nqn.2016-06.io.spdk:cnode1 Malloc0 && $R nvmf_subsystem_add_listener nqn.2016-06.io.spdk:cnode1 -t tcp -a 127.0.0.1 -s $2; } >/dev/null 2>&1
  perf $2 nqn.2016-06.io.spdk:cnode1 $1
  kill $pid; wait $pid 2>/dev/null
}
port=24000
for i in $(seq 1 $1); do
  for job in randread randwrite; do
    if [ $((i%2)) = 1 ]; then order="lull spdk"; else order="spdk lull"; fi
    for w in $order; do port=$((port+1)); echo "$i $job $w $(run_$w $job $port)"; done
  done
done
