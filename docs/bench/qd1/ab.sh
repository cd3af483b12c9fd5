#!/bin/bash
# usage: docs/bench/qd1/ab.sh N OLD NEW -- alternates two lull binaries (OLD
# and NEW, e.g. copies of target/release/lull built at two commits), NVMe/TCP
# QD1 4 KiB randread+randwrite with spdk_nvme_perf, target on core 1, perf
# on core 0. SPDK=DIR overrides ../shared/tools/spdk.
set -u
T=${SPDK:-../shared/tools/spdk}
OLD=$2
NEW=$3
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
run() { # bin job port
  rm -f $W/ab.sock
  taskset -c 1 $1 serve --nvmf-listen 127.0.0.1:$3 --listen 127.0.0.1:0 --rpc-socket $W/ab.sock --mode adaptive --cores 1 --volume bench:128M > $W/ab-serve.log 2>&1 &
  local pid=$!
  sleep 0.7
  TR="trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$3 subnqn:nqn.2026-11.io.lull:bench"
  taskset -c 0 $T/bin/spdk_nvme_perf --no-huge -s 256 -c 0x1 -q 32 -o 131072 -w write -t 1 -r "$TR" >/dev/null 2>&1
  taskset -c 0 $T/bin/spdk_nvme_perf --no-huge -s 256 -c 0x1 -q 1 -o 4096 -w $2 -t 3 -a 1 -r "$TR" 2>/dev/null | awk '/^Total/{print $3, $5}'
  kill $pid; wait $pid 2>/dev/null
}
port=21000
for i in $(seq 1 $1); do
  for job in randread randwrite; do
    if [ $((i%2)) = 1 ]; then order="old new"; else order="new old"; fi
    for w in $order; do port=$((port+1)); if [ $w = old ]; then bin=$OLD; else bin=$NEW; fi; echo "$i $job $w $(run $bin $job $port)"; done
  done
done
