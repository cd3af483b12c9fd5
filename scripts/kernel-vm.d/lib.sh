# Helpers for the kernel tier's guest test files (sourced; bash). The
# interface (environment, pass/fail/skip) is in scripts/kernel-vm's header.
# Everything here waits on state (a listening port in /proc/net/tcp, a block
# device in sysfs, a controller's state), each wait with a named deadline.

# Deadlines, seconds. TCG runs the guest 20-50x slower than KVM: generous.
PORT_WAIT=60        # a `lull serve` (or nvmf_tgt, nbdkit) listening after its start
DEV_WAIT=30         # a namespace's block device in sysfs after `nvme connect`
GONE_WAIT=30        # the block device and controller gone after a disconnect
RECONNECT_WAIT=90   # a controller `live` again after its target came back
RPC_TIMEOUT=30      # one `lull rpc` call (its own --timeout)

# One nvme connect's keep-alive and reconnect settings where the test does
# not choose them: reconnect every second (the kernel's default is 10 s),
# give up after CTRL_LOSS_TMO (the default 600 s would hold a failed test
# for 10 minutes).
CTRL_LOSS_TMO=60

T=${KVM_T:?run by scripts/kernel-vm.d/guest}
TOUT=${KVM_TOUT:?}
LULL=$KVM_LULL
FIOSZ=${KVM_FIOSZ:-16M}
NQN_PREFIX=nqn.2026-11.io.lull
mkdir -p "$T" "$TOUT"

say() { echo "kvm: [$(cut -d' ' -f1 /proc/uptime)s] $*"; echo "kvm: [$(cut -d' ' -f1 /proc/uptime)s] $*" > /dev/console; }
_res() { local v=$1 n=$2; shift 2; echo "$v $n: $*" >> "$KVM_RESULTS"; say "$v $n: $*"; }
pass() { _res PASS "$@"; }
fail() { _res FAIL "$@"; }
skip() { _res SKIP "$@"; }
info() { _res INFO "$@"; }
# check NAME REASON-IF-FAILED CMD...: pass or fail on CMD's exit
check() { local n=$1 why=$2; shift 2; if "$@"; then pass "$n" "${PASS_DETAIL:-ok}"; else fail "$n" "$why"; fi; PASS_DETAIL=""; }

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }
oneline() { tr '\n' ' ' | sed 's/  */ /g; s/ $//' | cut -c1-400; }

# wait_until SECONDS CMD...: poll CMD every 0.2 s until it succeeds
wait_until() {
  local end; end=$(awk -v n="$1" -v t="$(now)" 'BEGIN{printf "%d", t+n}'); shift
  while ! "$@"; do
    [ "$(date +%s)" -ge "$end" ] && return 1
    sleep 0.2
  done
}
listening() { awk -v p="$(printf ':%04X' "$1")" '$2 ~ p"$" && $4=="0A"{f=1} END{exit !f}' /proc/net/tcp; }
wait_port() { wait_until "${2:-$PORT_WAIT}" listening "$1"; }
alive() { kill -0 "$1" 2>/dev/null; }

# ---------------------------------------------------------------- lull ---
# lull_start VAR LOG PORT [BIN=...] ARGS...: start `lull serve ARGS` in the
# background (log LOG under TOUT, appended), wait until PORT listens, set
# $VAR to its pid. BIN=PATH as the 4th word takes another build;
# LULL_WRAP (e.g. "taskset -c 0") is put in front of it, unquoted.
lull_start() {
  local var=$1 log=$TOUT/$2 port=$3 bin=$LULL t0; shift 3
  case ${1:-} in BIN=*) bin=${1#BIN=}; shift ;; esac
  t0=$(now)
  echo "=== $(date +%T.%N) $bin serve $*" >> "$log"
  # shellcheck disable=SC2086
  RUST_LOG=${RUST_LOG:-info} ${LULL_WRAP:-} "$bin" serve "$@" >> "$log" 2>&1 &
  printf -v "$var" %s $!
  if ! wait_port "$port"; then
    LASTERR="lull serve $* not listening on $port after ${PORT_WAIT}s: $(tail -n 5 "$log" | oneline)"
    return 1
  fi
  LULL_UP_SECS=$(secs "$t0")
}
# stop PID [SIGNAL]: signal (TERM), wait up to 20 s, then KILL
STOP_WAIT=20        # a SIGTERMed server drains and exits within this
stop() {
  local pid=$1 sig=${2:-TERM} i
  [ -n "$pid" ] || return 0
  kill -"$sig" "$pid" 2>/dev/null
  for i in $(seq 1 $((STOP_WAIT * 5))); do alive "$pid" || break; sleep 0.2; done
  STOP_NOTE="exited within ${STOP_WAIT}s of SIG$sig"
  alive "$pid" && { kill -9 "$pid" 2>/dev/null; STOP_NOTE="did not exit within ${STOP_WAIT}s of SIG$sig: killed"; echo "stop: $pid $STOP_NOTE"; }
  wait "$pid" 2>/dev/null; STOP_RC=$?
  return 0
}
# rpc SOCK METHOD [JSON]: `lull rpc`, its output on stdout
rpc() { "$LULL" rpc -s "$1" -t "$RPC_TIMEOUT" "$2" ${3:+"$3"}; }
# json_num KEY: the first number after "KEY": in stdin
json_num() { grep -oE "\"$1\" *: *[0-9]+" | head -n1 | grep -oE '[0-9]+$'; }

# --------------------------------------------------------------- dmesg ---
# kmark TAG: a line in the kernel log that kerrs TAG reads after
kmark() { echo "kvm-mark: begin $1" > /dev/kmsg; }
# kerrs TAG: the kernel's I/O error lines since kmark TAG (empty: clean)
KERR_RE='I/O error|Buffer I/O|blk_print_req_error|print_req_error|critical (medium|target|nexus|space allocation) error|EXT4-fs (error|warning)|XFS \(.*\): .*(error|corrupt|Corrupt|shutdown|Shutdown)|nvme.*I/O.*(timeout|[Ee]rror)|block nbd[0-9]+: (Receive control failed|Dead|Other side returned error|.*timed out)|Call Trace|BUG:|WARNING:|Oops'
ksince() { dmesg | sed -n "/kvm-mark: begin $1\$/,\$p"; }
kerrs() { ksince "$1" | grep -E "$KERR_RE" | head -n 5; }
# kreconnect TAG CTRL: seconds from the controller's error recovery to its
# reconnect, by the kernel's own timestamps since kmark TAG (empty: none)
kreconnect() {
  ksince "$1" | awk -v c="nvme $2: " 'index($0, c) { t = $0; sub(/^\[ */, "", t); sub(/\].*/, "", t)
      if (s == "" && /starting error recovery/) s = t
      if (s != "" && /Successfully reconnected/) { printf "%.2f", t - s; exit } }'
}
# kclean NAME TAG: a PASS or FAIL line for the kernel log since kmark TAG
kclean() {
  local e; e=$(kerrs "$2")
  if [ -z "$e" ]; then pass "$1" "no I/O error in dmesg"; else fail "$1" "dmesg: $(echo "$e" | oneline)"; fi
}

# ---------------------------------------------------------------- nvme ---
# nvme_dev NQN: the namespace block device (nvmeXnY, head or not) of NQN
nvme_dev() {
  local b n
  for b in /sys/block/nvme*; do
    n=${b##*/}
    [[ $n =~ ^nvme[0-9]+n[0-9]+$ ]] || continue
    [ "$(cat "$b/device/subsysnqn" 2>/dev/null)" = "$1" ] && { echo "$n"; return 0; }
  done
  return 1
}
# nvme_ctrls NQN: the controllers (nvmeX) connected to NQN
nvme_ctrls() {
  local c
  for c in /sys/class/nvme/nvme*; do
    [ -e "$c" ] || continue
    [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$1" ] && echo "${c##*/}"
  done
}
ctrl_state() { cat "/sys/class/nvme/$1/state" 2>/dev/null; }
has_dev() { local d; d=$(nvme_dev "$1") && [ -b "/dev/$d" ] && [ "$(cat "/sys/block/$d/size")" != 0 ]; }
no_dev() { ! nvme_dev "$1" >/dev/null && [ -z "$(nvme_ctrls "$1")" ]; }
# nvme_conn NQN ARGS...: nvme connect to 127.0.0.1:4420 (or NVME_PORT),
# wait for the block device; sets DEV (nvmeXnY) and CTRL (nvmeX); on
# failure LASTERR says why.
NVME_PORT=4420
nvme_conn() {
  local nqn=$1 t0 out; shift
  t0=$(now)
  if ! out=$(nvme connect -t tcp -a 127.0.0.1 -s "$NVME_PORT" -n "$nqn" \
      --reconnect-delay=1 --ctrl-loss-tmo="$CTRL_LOSS_TMO" "$@" 2>&1); then
    LASTERR="nvme connect $nqn $* refused: $(echo "$out" | oneline)"; return 1
  fi
  if ! wait_until "$DEV_WAIT" has_dev "$nqn"; then
    LASTERR="nvme connect $nqn $*: no block device within ${DEV_WAIT}s ($(echo "$out" | oneline))"; return 1
  fi
  DEV=$(nvme_dev "$nqn"); CTRL=$(nvme_ctrls "$nqn" | head -n1)
  CONNECT_SECS=$(secs "$t0")
}
# nvme_disc NQN: nvme disconnect; the block device and controllers gone
nvme_disc() {
  local out
  out=$(nvme disconnect -n "$1" 2>&1) || { LASTERR="nvme disconnect -n $1: $(echo "$out" | oneline)"; return 1; }
  wait_until "$GONE_WAIT" no_dev "$1" || { LASTERR="after nvme disconnect ($(echo "$out" | oneline)) still there: $(nvme_dev "$1") $(nvme_ctrls "$1" | oneline)"; return 1; }
}

# ----------------------------------------------------------------- fio ---
# fio_verify DEV TAG [FIO ARGS...]: 4 KiB random writes of FIOSZ with
# crc32c verify (libaio, direct), then every block read back and checked.
# Sets FIO_SUMMARY; 0 when fio exited 0 with no error and no verify failure.
fio_verify() {
  local dev=$1 tag=$2 f=$TOUT/fio-$2.txt rc e w; shift 2
  fio --name="$tag" --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k \
      --iodepth=16 --size="$FIOSZ" --verify=crc32c --do_verify=1 --verify_fatal=1 \
      --verify_state_save=0 "$@" --output="$f" > "$f.stderr" 2>&1
  rc=$?
  e=$(grep -oE 'err= *[0-9]+' "$f" | grep -vE 'err= *0$' | head -n1)
  w=$(grep -m1 -E '^ +write:' "$f" | sed 's/^ *//')
  FIO_SUMMARY="rc=$rc ${e:-err=0} $w"
  if [ "$rc" != 0 ] || [ -n "$e" ] || grep -qiE 'verify: bad|bad magic|crc32c.*(wanted|bad)' "$f" "$f.stderr"; then
    FIO_SUMMARY="$FIO_SUMMARY $(grep -hiE 'verify|error|bad' "$f" "$f.stderr" | head -n 3 | oneline)"
    return 1
  fi
}
# clat_max_ms FILE: fio's largest completion latency in FILE (its text
# output, write side first), in milliseconds
clat_max_ms() {
  awk '/^ +clat \((n|u|m)sec\)/ { u=$2; m=$0; sub(/.*max= */, "", m); sub(/,.*/, "", m);
        f = (u ~ /nsec/) ? 1e-6 : (u ~ /usec/) ? 1e-3 : 1; v = m * f; if (m ~ /k$/) v *= 1000;
        if (v > best) best = v } END { printf "%.0f", best }' "$1"
}

# ---------------------------------------------------------- filesystem ---
# fs_roundtrip DEV FS TAG: mkfs, mount, write a random file, umount, drop
# caches, mount again, compare checksums. LASTERR on failure.
FS_FILE_MIB=8       # the file written through the filesystem
fs_roundtrip() {
  local dev=$1 fs=$2 tag=$3 mnt=$T/mnt-$3 sum1 sum2
  mkdir -p "$mnt"
  case $fs in
    ext4) mkfs.ext4 -q -F "$dev" > "$TOUT/mkfs-$tag.txt" 2>&1 ;;
    xfs) mkfs.xfs -q -f "$dev" > "$TOUT/mkfs-$tag.txt" 2>&1 ;;
  esac || { LASTERR="mkfs.$fs $dev: $(oneline < "$TOUT/mkfs-$tag.txt")"; return 1; }
  mount "$dev" "$mnt" 2> "$TOUT/mount-$tag.txt" || { LASTERR="mount $dev: $(oneline < "$TOUT/mount-$tag.txt")"; return 1; }
  head -c "${FS_FILE_MIB}M" /dev/urandom > "$T/file-$tag.bin"
  sum1=$(sha256sum < "$T/file-$tag.bin")
  if ! cp "$T/file-$tag.bin" "$mnt/file.bin" || ! sync; then umount "$mnt"; LASTERR="writing the file failed"; return 1; fi
  umount "$mnt" || { LASTERR="umount $mnt failed"; return 1; }
  echo 3 > /proc/sys/vm/drop_caches
  mount "$dev" "$mnt" 2>> "$TOUT/mount-$tag.txt" || { LASTERR="mount again: $(oneline < "$TOUT/mount-$tag.txt")"; return 1; }
  sum2=$(sha256sum < "$mnt/file.bin")
  umount "$mnt" || { LASTERR="umount after reading failed"; return 1; }
  [ "$sum1" = "$sum2" ] || { LASTERR="the file read back differs (sha256 ${sum1%% *} written, ${sum2%% *} read)"; return 1; }
  FS_DETAIL="mkfs.$fs, mount, ${FS_FILE_MIB} MiB file, remount with caches dropped: sha256 ${sum1:0:16} matches"
}
