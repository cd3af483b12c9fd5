# The cluster tier's scenarios (`scripts/cluster test`), sourced by
# scripts/cluster: real pods on lull's volumes through the kubelet, the
# external sidecars and the snapshot controller. Each scenario is a
# function reporting with pass/fail; the pods run fio (with verify) or
# write and check a pattern, from the workload image. They run in their
# own namespace, deleted at the end (every claim's DeleteVolume).
#
# The attach method here is fuse (this host's kernel has neither nbd nor
# nvme_tcp): what that means for expansion and a daemon restart is said
# in those scenarios and in docs/KUBERNETES.md.

NS=lull-scenarios
# Waits, each far above what the step took here (2 cores, the whole suite's load).
PVC_BOUND_SECONDS=120      # CreateVolume through the provisioner: about 1 s
POD_SECONDS=240            # a pod to finish its fio (64 MiB written and verified) or to be Ready
SNAPSHOT_READY_SECONDS=120 # CreateSnapshot through the snapshotter
RESIZE_SECONDS=120         # ControllerExpandVolume through the resizer
DAEMON_RESTART_SECONDS=120 # the lull container restarted by the kubelet
FIO_SIZE=64M               # per fio job: enough to cross many extents, quick on FUSE

k() { kubectl -n "$NS" "$@"; }

pvc() { # pvc NAME SIZE MODE [DATASOURCE-YAML]
  k apply -f - >/dev/null <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $1}
spec:
  storageClassName: lull
  accessModes: [ReadWriteOnce]
  volumeMode: $3
  resources: {requests: {storage: $2}}
${4:-}
EOF
}

pod() { # pod NAME CLAIM MODE RESTART SCRIPT: a workload pod on the claim (/data or /dev/xvda)
  local vol
  if [ "$3" = Block ]; then
    vol="volumeDevices: [{name: v, devicePath: /dev/xvda}]"
  else
    vol="volumeMounts: [{name: v, mountPath: /data}]"
  fi
  k apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1}
spec:
  restartPolicy: $4
  terminationGracePeriodSeconds: 1
  automountServiceAccountToken: false
  containers:
  - name: w
    image: localhost/workload:cluster
    imagePullPolicy: Never
    command: [sh, -c, $(printf '%s' "$5" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')]
    $vol
  volumes:
  - name: v
    persistentVolumeClaim: {claimName: $2}
EOF
}

wait_bound() { k wait --for=jsonpath='{.status.phase}'=Bound "pvc/$1" --timeout="${PVC_BOUND_SECONDS}s" >/dev/null 2>&1; }
wait_done() { # wait_done POD: Succeeded (0) or Failed/timeout (1)
  local phase
  for _ in $(seq "$POD_SECONDS"); do
    phase=$(k get pod "$1" -o jsonpath='{.status.phase}' 2>/dev/null)
    case $phase in Succeeded) return 0 ;; Failed) return 1 ;; esac
    sleep 1
  done
  return 1
}
wait_ready() { k wait --for=condition=Ready "pod/$1" --timeout="${POD_SECONDS}s" >/dev/null 2>&1; }
delpod() { k delete pod "$1" --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1; }
why() { # why POD: the pod's last log lines and events, on one line
  { k logs "$1" --tail=5 2>&1; k get events --field-selector "involvedObject.name=$1" -o custom-columns=R:.reason,M:.message --no-headers 2>&1 | tail -4; } | tr '\n' ' ' | cut -c1-600
}
fio_cmd() { # fio_cmd FILE: write FIO_SIZE at random with crc32c verify, fatal on a mismatch
  echo "fio --name=verify --filename=$1 --size=$FIO_SIZE --rw=randwrite --bs=4k --iodepth=1 --ioengine=psync --direct=1 --verify=crc32c --verify_fatal=1 --do_verify=1 --randrepeat=0 --output-format=normal"
}

sc_fs_fio() {
  pvc fs 1Gi Filesystem
  wait_bound fs || { fail fs-fio "claim fs not Bound in ${PVC_BOUND_SECONDS}s: $(k describe pvc fs | tail -3 | tr '\n' ' ')"; return; }
  pod fs-fio fs Filesystem Never "$(fio_cmd /data/fio) && grep ' /data ' /proc/mounts && echo FIO-VERIFIED"
  if wait_done fs-fio && k logs fs-fio | grep -q FIO-VERIFIED; then
    pass fs-fio "fio wrote $FIO_SIZE with crc32c verify on an ext4 claim: $(k logs fs-fio | grep -m1 ' /data ' | awk '{print $1, $3}')"
  else
    fail fs-fio "$(why fs-fio)"
  fi
  delpod fs-fio
}

sc_block_fio() {
  pvc blk 1Gi Block
  wait_bound blk || { fail block-fio "claim blk not Bound"; return; }
  pod blk-fio blk Block Never "$(fio_cmd /dev/xvda) && echo FIO-VERIFIED"
  if wait_done blk-fio && k logs blk-fio | grep -q FIO-VERIFIED; then
    pass block-fio "fio wrote $FIO_SIZE with crc32c verify on a raw block claim (/dev/xvda)"
  else
    fail block-fio "$(why blk-fio)"
  fi
  delpod blk-fio
  k delete pvc blk --wait=true --timeout=120s >/dev/null 2>&1 || true
}

# A pattern file and its checksum, written once: the snapshot, the clone
# and the re-created pod check it.
WRITE_PATTERN="dd if=/dev/urandom of=/data/pattern bs=1M count=16 conv=fsync 2>/dev/null && md5sum /data/pattern > /data/pattern.md5 && sync && cat /data/pattern.md5"
CHECK_PATTERN="md5sum -c /data/pattern.md5 && echo PATTERN-INTACT"

sc_recreate() {
  pod writer fs Filesystem Never "$WRITE_PATTERN"
  if ! wait_done writer; then fail pod-recreate "the writer pod failed: $(why writer)"; return; fi
  local sum; sum=$(k logs writer | awk '{print $1}')
  delpod writer
  # the claim's only pod is gone: the kubelet unstaged it; a new pod restages it
  pod reader fs Filesystem Never "$CHECK_PATTERN"
  if wait_done reader && k logs reader | grep -q PATTERN-INTACT; then
    pass pod-recreate "16 MiB written, pod deleted (unstage), a new pod (restage) read md5 $sum back"
  else
    fail pod-recreate "$(why reader)"
  fi
  delpod reader
}

sc_snapshot() {
  k apply -f - >/dev/null <<EOF
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: fs-snap}
spec:
  volumeSnapshotClassName: lull
  source: {persistentVolumeClaimName: fs}
EOF
  if ! k wait --for=jsonpath='{.status.readyToUse}'=true volumesnapshot/fs-snap --timeout="${SNAPSHOT_READY_SECONDS}s" >/dev/null 2>&1; then
    fail snapshot-restore "VolumeSnapshot fs-snap not readyToUse: $(k get volumesnapshot fs-snap -o jsonpath='{.status.error.message}' 2>&1)"
    return
  fi
  # written after the snapshot: the restored claim must not have it
  pod after fs Filesystem Never "echo after > /data/after-snapshot && sync"
  wait_done after || true
  delpod after
  pvc restored 1Gi Filesystem "  dataSource: {name: fs-snap, kind: VolumeSnapshot, apiGroup: snapshot.storage.k8s.io}"
  wait_bound restored || { fail snapshot-restore "restored claim not Bound: $(k describe pvc restored | tail -3 | tr '\n' ' ')"; return; }
  pod restored-check restored Filesystem Never "$CHECK_PATTERN && test ! -e /data/after-snapshot && echo NO-LATER-WRITE"
  if wait_done restored-check && k logs restored-check | grep -q NO-LATER-WRITE; then
    pass snapshot-restore "VolumeSnapshot readyToUse; a claim restored from it has the pattern (md5 checked) and not a file written after the snapshot"
  else
    fail snapshot-restore "$(why restored-check)"
  fi
  delpod restored-check
}

sc_clone() {
  pvc clone 1Gi Filesystem "  dataSource: {name: fs, kind: PersistentVolumeClaim}"
  wait_bound clone || { fail clone "clone not Bound: $(k describe pvc clone | tail -3 | tr '\n' ' ')"; return; }
  pod clone-check clone Filesystem Never "$CHECK_PATTERN && test -e /data/after-snapshot && echo CLONE-CURRENT"
  if wait_done clone-check && k logs clone-check | grep -q CLONE-CURRENT; then
    pass clone "a claim cloned from fs (dataSource PersistentVolumeClaim) has its pattern and its latest file"
  else
    fail clone "$(why clone-check)"
  fi
  delpod clone-check
}

sc_expand() {
  # with fuse, the staged device keeps its size (nbdfuse keeps the NBD
  # handshake's size): the pod sees the new size when it is staged again
  # (docs/KUBERNETES.md, "Expansion"); with nvme-tcp it grows online
  pod grow fs Filesystem Always "df -k /data | tail -1; exec sleep 3600"
  wait_ready grow || { fail expand "pod grow not Ready: $(why grow)"; return; }
  local before after cap
  before=$(k exec grow -- df -k /data | awk 'END {print $2}')
  k patch pvc fs --type merge -p '{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}' >/dev/null
  for _ in $(seq "$RESIZE_SECONDS"); do
    cap=$(kubectl get pv "$(k get pvc fs -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.capacity.storage}')
    [ "$cap" = 2Gi ] && break
    sleep 1
  done
  if [ "$cap" != 2Gi ]; then fail expand "the PV did not reach 2Gi (ControllerExpandVolume): $cap"; delpod grow; return; fi
  sleep 5
  local online; online=$(k exec grow -- df -k /data | awk 'END {print $2}')
  delpod grow
  pod grown fs Filesystem Never "df -k /data | tail -1 && $CHECK_PATTERN"
  wait_done grown || { fail expand "restaged pod: $(why grown)"; return; }
  after=$(k logs grown | awk 'NR==1 {print $2}')
  if [ "$after" -gt $(( before * 3 / 2 )) ] && k logs grown | grep -q PATTERN-INTACT; then
    if [ "$online" -gt $(( before * 3 / 2 )) ]; then
      pass expand "PV 1Gi -> 2Gi; the running pod saw it online ($before -> $online KiB)"
    else
      pass expand "PV 1Gi -> 2Gi by the resizer while the pod ran; fuse: the running pod kept $online KiB (nbdfuse keeps the handshake's size, as documented); the re-created pod saw $after KiB, pattern intact"
    fi
  else
    fail expand "after restage: $after KiB (before $before, online $online): $(why grown)"
  fi
  delpod grown
}

sc_daemon_restart() {
  # a pod writing while the node's lull daemon restarts under it
  pod steady fs Filesystem Always "i=0; while true; do i=\$((i+1)); echo \$i > /data/counter.tmp && mv /data/counter.tmp /data/counter && sync || echo WRITE-FAILED \$i; sleep 0.2; done"
  wait_ready steady || { fail daemon-restart "pod steady not Ready: $(why steady)"; return; }
  sleep 2
  local np rc0 rc1
  np=$(kubectl -n lull-system get pods -l app=lull-node -o jsonpath='{.items[0].metadata.name}')
  rc0=$(kubectl -n lull-system get pod "$np" -o jsonpath='{.status.containerStatuses[?(@.name=="lull")].restartCount}')
  local c0; c0=$(k exec steady -- cat /data/counter)
  kubectl -n lull-system exec "$np" -c lull -- kill -TERM 1 >/dev/null 2>&1 || true
  for _ in $(seq "$DAEMON_RESTART_SECONDS"); do
    rc1=$(kubectl -n lull-system get pod "$np" -o jsonpath='{.status.containerStatuses[?(@.name=="lull")].restartCount}')
    [ "$rc1" != "$rc0" ] && kubectl -n lull-system get pod "$np" -o jsonpath='{.status.containerStatuses[?(@.name=="lull")].ready}' | grep -q true && break
    sleep 1
  done
  if [ "$rc1" = "$rc0" ]; then fail daemon-restart "the lull container did not restart (restartCount $rc0)"; delpod steady; return; fi
  sleep 5
  local c1 running_io
  c1=$(k exec steady -- cat /data/counter 2>&1 || true)
  sleep 3
  local c2; c2=$(k exec steady -- cat /data/counter 2>&1 || true)
  if [[ "$c2" =~ ^[0-9]+$ ]] && [[ "$c1" =~ ^[0-9]+$ ]] && [ "$c2" -gt "$c1" ]; then
    running_io="the running pod's writes went on ($c0 before, $c2 after)"
  else
    running_io="the running pod's I/O did not resume (fuse: nbdfuse's NBD connection to the daemon is not re-made; reads now: ${c2:0:80})"
  fi
  delpod steady
  # the data the pod had synced before the restart, read by a new pod
  # (unstage, restage against the restarted daemon)
  pod after-restart fs Filesystem Never "cat /data/counter && $CHECK_PATTERN"
  if wait_done after-restart && k logs after-restart | grep -q PATTERN-INTACT; then
    local c3; c3=$(k logs after-restart | head -1)
    # the counter read before the restart may be one renamed but not yet
    # synced (the loop syncs after its rename): c0 - 1 was synced
    if [ "$c3" -ge $(( c0 - 1 )) ] 2>/dev/null; then
      pass daemon-restart "lull container restarted (restartCount $rc0 -> $rc1); $running_io; a re-created pod read counter $c3 (>= $((c0 - 1)), synced before) and the pattern intact"
      echo "$running_io" > "$OUT/daemon-restart-behaviour.txt"
    else
      fail daemon-restart "counter $c3 < $((c0 - 1)), synced before the restart"
    fi
  else
    fail daemon-restart "after restart, a new pod could not read the volume: $(why after-restart); $running_io"
  fi
  delpod after-restart
}

sc_cleanup() {
  # every claim deleted: DeleteVolume of each, the PVs gone
  local pvs; pvs=$(k get pvc -o jsonpath='{.items[*].spec.volumeName}' 2>/dev/null)
  # in dependency order: lull refuses DeleteSnapshot while a volume made
  # from it exists (FAILED_PRECONDITION, docs/KUBERNETES.md), so the
  # claims made from others go first, then the snapshot, then the rest
  k delete pod --all --wait=true --timeout=120s >/dev/null 2>&1 || true
  k delete pvc restored clone --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1 || true
  k delete volumesnapshot --all --wait=true --timeout=120s >/dev/null 2>&1 || true
  k delete pvc --all --wait=true --timeout=120s >/dev/null 2>&1 || true
  local left="" pv
  for _ in $(seq 60); do
    left=""
    for pv in $pvs; do kubectl get pv "$pv" >/dev/null 2>&1 && left="$left $pv"; done
    [ -z "$left" ] && break
    sleep 1
  done
  if [ -z "$left" ]; then pass delete "every claim deleted, its PV gone (DeleteVolume): $(echo "$pvs" | wc -w) volumes"
  else fail delete "PVs left after their claims were deleted:$left"; fi
  kubectl delete namespace "$NS" --wait=true --timeout=120s >/dev/null 2>&1 || true
}

scenarios() { # scenarios [NAME...]: all when none are named
  local all=(fs_fio block_fio recreate snapshot clone expand daemon_restart cleanup) s t
  [ $# -gt 0 ] && all=("$@")
  kubectl create namespace "$NS" >/dev/null 2>&1 || true
  for s in "${all[@]}"; do
    t=$(date +%s)
    say "scenario $s"
    "sc_$s"
    echo "  ($s: $(( $(date +%s) - t )) s)"
  done
}
