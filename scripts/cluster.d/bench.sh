# `scripts/cluster bench` (sourced by scripts/cluster): the Kubernetes
# benchmark of docs/BENCHMARKS.md ("Kubernetes"). On the cluster
# scripts/cluster brings up (fuse attach, one node, 1-replica volumes):
#
#   bring-up (cached)   `down --purge` then `up`, the binaries and images
#                       kept: node Ready, lull rolled out, csi.lull.io registered
#   one claim           PVC created -> Bound -> its pod's container started
#                       -> the pod's first write (4 KiB, O_DIRECT, fsync)
#                       done, each from the same clock (the pod prints
#                       its /proc/uptime: the host's clock, at 10 ms;
#                       busybox's date has no %N)
#   20 claims at once   20 PVCs and their pods applied together -> the
#                       last pod's first write done
#   at rest             with the 20 claims mounted and idle: CPU and memory of
#                       lull's node containers (the daemon; the node plugin
#                       with its nbdfuse processes) and of the controller's
#                       lull container, from their cgroups (cpuacct.usage,
#                       memory.stat rss), over BENCH_IDLE_WINDOW_SECONDS windows
#
# Each is repeated LULL_CLUSTER_BENCH_RUNS times (default 5): the median,
# min and max are printed; the raw samples go to $OUT/bench/. The cold
# bring-up (nothing cached: packages, Go module and build caches, binaries)
# is one command, run once (docs/BENCHMARKS.md gives it).

BENCH_RUNS=${LULL_CLUSTER_BENCH_RUNS:-5}
BENCH_NS=lull-bench
BENCH_CLAIMS=20                # issue 48: 20 PVCs created and mounted in parallel
BENCH_IDLE_WINDOW_SECONDS=10   # one CPU sample at rest; BENCH_RUNS of them
BENCH_WAIT_SECONDS=300         # any one step; far above what it took here

now() { cut -d' ' -f1 /proc/uptime; }   # the clock the pods read too (one kernel)
bk() { kubectl -n "$BENCH_NS" "$@"; }
stats() { # stats LABEL UNIT < numbers: median (min-max) of n
  python3 -c '
import statistics, sys
label, unit = sys.argv[1], sys.argv[2]
v = sorted(float(x) for x in sys.stdin.read().split())
if not v:
    print(f"{label}: no samples"); sys.exit(1)
print(f"{label}: {statistics.median(v):.2f} {unit} ({v[0]:.2f}-{v[-1]:.2f}, n={len(v)})")
' "$1" "$2" | tee -a "$OUT/bench/summary.txt"
}

bench_objects() { # bench_objects PREFIX COUNT: COUNT claims and their pods, as one YAML stream
  local i
  for i in $(seq "$2"); do
    cat <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $1-$i}
spec:
  storageClassName: lull
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 1Gi}}
---
apiVersion: v1
kind: Pod
metadata: {name: $1-$i}
spec:
  terminationGracePeriodSeconds: 1
  automountServiceAccountToken: false
  containers:
  - name: w
    image: localhost/workload:cluster
    imagePullPolicy: Never
    command: [sh, -c, 'echo START \$(cut -d" " -f1 /proc/uptime); dd if=/dev/urandom of=/data/first bs=4k count=1 oflag=direct conv=fsync 2>/dev/null && echo IO \$(cut -d" " -f1 /proc/uptime); exec sleep 36000']
    volumeMounts: [{name: v, mountPath: /data}]
  volumes:
  - name: v
    persistentVolumeClaim: {claimName: $1-$i}
---
EOF
  done
}

bench_wait_io() { # bench_wait_io POD: its log's IO time (epoch seconds)
  local t
  for _ in $(seq $((BENCH_WAIT_SECONDS * 2))); do
    t=$(bk logs "$1" 2>/dev/null | awk '$1 == "IO" {print $2}')
    [ -n "$t" ] && { echo "$t"; return 0; }
    sleep 0.5
  done
  return 1
}

bench_clean() { # every claim and pod of the benchmark gone (DeleteVolume of each)
  bk delete pod --all --wait=true --timeout=300s >/dev/null 2>&1 || true
  bk delete pvc --all --wait=true --timeout=300s >/dev/null 2>&1 || true
  local _i
  for _i in $(seq "$BENCH_WAIT_SECONDS"); do
    [ -z "$(kubectl get pv -o jsonpath="{.items[?(@.spec.claimRef.namespace==\"$BENCH_NS\")].metadata.name}" 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "bench: PVs of $BENCH_NS left after their claims were deleted" >&2
  return 1
}

bench_bringup() {
  local r t
  # the binary under test resolved (built, when missing) before any
  # timing: a run's time is the bring-up's, never a cargo build's
  LULL_BIN=$(lull_bin) || { fail bench-bringup "no lull binary (above)"; return 1; }
  export LULL_BIN
  for r in $(seq "$BENCH_RUNS"); do
    down --purge >/dev/null 2>&1 || true
    t=$(now)
    ( up ) > "$OUT/bench/bringup-$r.log" 2>&1 || { fail bench-bringup "run $r: up failed ($OUT/bench/bringup-$r.log)"; return 1; }
    python3 -c "print(f'{$(now) - $t:.2f}')" >> "$OUT/bench/bringup-cached.txt"
    say "bench: cached bring-up $r: $(tail -1 "$OUT/bench/bringup-cached.txt") s"
  done
  stats "bring-up, binaries and images cached (down --purge; up)" s < "$OUT/bench/bringup-cached.txt"
}

bench_one() {
  local r t0 bound start io phase
  kubectl create namespace "$BENCH_NS" >/dev/null 2>&1 || true
  for r in $(seq "$BENCH_RUNS"); do
    t0=$(now)
    bench_objects one "1" | sed "s/one-1/one-$r/g" | bk apply -f - >/dev/null || { fail bench-one "apply failed"; return 1; }
    bound=""
    for _ in $(seq $((BENCH_WAIT_SECONDS * 10))); do
      phase=$(bk get pvc "one-$r" -o jsonpath='{.status.phase}' 2>/dev/null)
      [ "$phase" = Bound ] && { bound=$(now); break; }
      sleep 0.1
    done
    [ -n "$bound" ] || { fail bench-one "run $r: claim not Bound in ${BENCH_WAIT_SECONDS}s"; return 1; }
    io=$(bench_wait_io "one-$r") || { fail bench-one "run $r: no first write: $(bk logs "one-$r" 2>&1 | tail -2)"; return 1; }
    start=$(bk logs "one-$r" | awk '$1 == "START" {print $2}')
    python3 -c "print(f'{$bound - $t0:.2f} {$start - $t0:.2f} {$io - $t0:.2f}')" >> "$OUT/bench/one-claim.txt"
    say "bench: one claim $r: Bound, container started, first write at $(tail -1 "$OUT/bench/one-claim.txt") s"
  done
  awk '{print $1}' "$OUT/bench/one-claim.txt" | stats "one claim: created -> Bound" s
  awk '{print $2}' "$OUT/bench/one-claim.txt" | stats "one claim: created -> its pod's container started" s
  awk '{print $3}' "$OUT/bench/one-claim.txt" | stats "one claim: created -> the pod's first write done" s
  bench_clean
}

bench_many() { # the last run's claims stay mounted for bench_idle
  local r t0 i last io
  kubectl create namespace "$BENCH_NS" >/dev/null 2>&1 || true
  for r in $(seq "$BENCH_RUNS"); do
    [ "$r" -gt 1 ] && { bench_clean || return 1; }
    t0=$(now)
    bench_objects "many$r" "$BENCH_CLAIMS" | bk apply -f - >/dev/null || { fail bench-many "apply failed"; return 1; }
    last=0
    for i in $(seq "$BENCH_CLAIMS"); do
      io=$(bench_wait_io "many$r-$i") || { fail bench-many "run $r: pod many$r-$i made no first write: $(bk describe pod "many$r-$i" | tail -3 | tr '\n' ' ')"; return 1; }
      last=$(python3 -c "print(max($last, $io))")
    done
    python3 -c "print(f'{$last - $t0:.2f}')" >> "$OUT/bench/many-claims.txt"
    say "bench: $BENCH_CLAIMS claims at once, run $r: the last first write at $(tail -1 "$OUT/bench/many-claims.txt") s"
  done
  stats "$BENCH_CLAIMS claims and pods applied at once -> the last pod's first write done" s < "$OUT/bench/many-claims.txt"
}

cgroup_of() { # cgroup_of CONTROLLER CONTAINER-ID: its cgroup directory (cgroup v1), empty when none
  # (a controller is mounted alone, as cpuacct here, or beside another, as
  # cpu,cpuacct; a missing one must not stop the run: set -e, pipefail)
  local d
  for d in /sys/fs/cgroup/"$1" /sys/fs/cgroup/*,"$1" /sys/fs/cgroup/"$1",*; do
    [ -d "$d/kubepods" ] || continue
    find "$d/kubepods" -type d -name "*$2*" 2>/dev/null | head -1 || true
    return 0
  done
}

bench_idle() {
  local node ctl ids name id cpu mem r t0 u0 u1 t1
  node=$(kubectl -n lull-system get pods -l app=lull-node -o jsonpath='{.items[0].metadata.name}')
  ctl=$(kubectl -n lull-system get pods -l app=lull-csi-controller -o jsonpath='{.items[0].metadata.name}')
  say "bench: at rest with $(bk get pods --no-headers 2>/dev/null | grep -c Running) pods running on lull claims; sampling ${BENCH_RUNS} x ${BENCH_IDLE_WINDOW_SECONDS} s"
  sleep 10   # the claims' staging and the pods' first writes behind them
  for spec in "$node lull daemon" "$node lull-csi node-plugin" "$ctl lull-csi controller-plugin"; do
    read -r pod cname label <<<"$spec"
    id=$(kubectl -n lull-system get pod "$pod" -o jsonpath="{.status.containerStatuses[?(@.name==\"$cname\")].containerID}")
    id=${id#containerd://}
    cpu=$(cgroup_of cpuacct "$id"); mem=$(cgroup_of memory "$id")
    if [ -z "$cpu" ] || [ -z "$mem" ]; then fail bench-idle "no cgroup for $label ($pod/$cname, $id)"; continue; fi
    : > "$OUT/bench/idle-$label.txt"
    for r in $(seq "$BENCH_RUNS"); do
      t0=$(now); u0=$(cat "$cpu/cpuacct.usage")
      sleep "$BENCH_IDLE_WINDOW_SECONDS"
      t1=$(now); u1=$(cat "$cpu/cpuacct.usage")
      python3 -c "print(100 * ($u1 - $u0) / 1e9 / ($t1 - $t0))" >> "$OUT/bench/idle-$label.txt"
    done
    stats "at rest, $label: CPU" "% of one core" < "$OUT/bench/idle-$label.txt"
    echo "at rest, $label: memory rss $(( $(awk '$1 == "total_rss" {print $2}' "$mem/memory.stat") >> 20 )) MiB, processes $(wc -l < "$cpu/cgroup.procs") ($(xargs -I{} cat /proc/{}/comm < "$cpu/cgroup.procs" 2>/dev/null | sort | uniq -c | awk '{printf "%s%s x%s", s, $2, $1; s=", "}'))" | tee -a "$OUT/bench/summary.txt"
  done
}

bench() {
  rm -rf "$OUT/bench"; mkdir -p "$OUT/bench"
  echo "scripts/cluster bench, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null), load $(cut -d' ' -f1-3 /proc/loadavg)" > "$OUT/bench/summary.txt"
  bench_bringup || return
  bench_one || return
  bench_many || return
  bench_idle
  bench_clean || true
  kubectl delete namespace "$BENCH_NS" --wait=false >/dev/null 2>&1 || true
  pass bench "$OUT/bench/summary.txt"
  cat "$OUT/bench/summary.txt"
}
