# shellcheck shell=bash
# Helpers for lull in a scripts/netlab lab, sourced by
# scripts/netlab.d/scenarios and scripts/partition-campaign.
#
# The set-up (what the CSI plugin builds, on real addresses):
#   n1, n2   storage nodes: `lull serve --store` holding replica "v" each,
#            replica port REPLICA_PORT on the node's address
#   n3, n4   engine nodes: `lull serve --store` (node state only) with NBD
#            on NBD_PORT; the volume "v" is made on one of them by
#            `volume_create` with "resume": true, over n1 and n2 (a
#            failover makes it on the other, as a re-stage does)
#   client   fio and the recorded writer, to the engine's address
# Every daemon's RPC socket is a file in $WORK (reachable from any
# namespace), its log $WORK/HOST.log.
#
# The caller sets LULL (absolute path) and NETLAB (the lab's name), and
# defines fail() (which calls lab_fail) and fail_prefix() (what a failure
# line starts with); lab_start makes WORK and the trap.

NL=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/netlab
ND=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=/usr/bin/python3
VOL=v
SIZE=64M
REPLICA_PORT=7000
NBD_PORT=10809
# fio writes [0, 32 MiB); the recorded writers 1024 blocks of 4 KiB at 48 MiB.
FIO_SIZE=32M
REC_OFF=$((48 << 20)) REC_BLOCKS=1024
# Longest wait for a state (every replica healthy after a heal: the
# engine's 2 s reconnect interval plus a delta rebuild; an election).
STATE_WAIT_S=90

declare -A pid=()
lab_failed=1

now() { date +%s.%N | cut -c1-14; }
addr() { "$NL" addr "$1"; }
uri() { echo "nbd://$(addr "$1"):$NBD_PORT/$VOL"; }
rpc() { local h=$1; shift; "$LULL" rpc --socket "$WORK/$h.sock" "$@"; }
layer() { echo "$WORK/$1/replicas/$VOL/data.img"; }

# The caller's fail() calls lab_fail with its whole message: kept in
# $WORK/failure (the first one wins: a failure inside $(...) reaches the
# trap this way) and printed last, after the clean-up; an exit that no
# fail() explained is reported too, with the caller's fail_prefix.
lab_fail() {
  if [ -n "${WORK:-}" ] && [ -d "$WORK" ]; then
    [ -e "$WORK/failure" ] || echo "$*" >"$WORK/failure"
  else
    echo "$*" >&2
  fi
  exit 1
}

lab_cleanup() {
  local rc=$1 p
  for p in "${pid[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  "$NL" down >/dev/null 2>&1 || "$NL" down || true
  if [ "$lab_failed" = 0 ]; then
    if [ -z "${KEEP:-}" ]; then rm -rf "$WORK"; else echo "logs kept in $WORK" >&2; fi
    return
  fi
  echo "logs kept in $WORK" >&2
  if [ -e "$WORK/failure" ]; then
    cat "$WORK/failure"
  elif [ "$rc" = 0 ]; then
    echo "$(fail_prefix)stopped before the end (a signal; logs in $WORK)"
  else
    echo "$(fail_prefix)a command failed (exit $rc; logs in $WORK)"
  fi
}

lab_start() { # HOSTS
  for tool in fio "$PY"; do command -v "$tool" >/dev/null || { echo "$tool is missing (scripts/test installs it)" >&2; exit 2; }; done
  $PY -c 'import nbd' 2>/dev/null || { echo "python3-libnbd is missing (scripts/test installs it)" >&2; exit 2; }
  [ -x "$LULL" ] || { echo "no lull binary at $LULL" >&2; exit 2; }
  [ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 2; }
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/lull-netlab.XXXXXX")
  trap 'lab_cleanup $?' EXIT
  "$NL" down >/dev/null 2>&1 || true
  build_porcupine
  "$NL" up "$1" >"$WORK/netlab.up" 2>&1 || { cat "$WORK/netlab.up" >&2; fail "netlab up $1 failed"; }
}

# Waits until the daemon on HOST answers its RPC socket.
wait_rpc() {
  local i
  for i in $(seq 200); do
    rpc "$1" rpc_get_methods >/dev/null 2>&1 && return 0
    [ -n "${pid[$1]:-}" ] && ! kill -0 "${pid[$1]}" 2>/dev/null && fail "lull serve on $1 exited: $(tail -3 "$WORK/$1.log")"
    sleep 0.05
  done
  fail "lull serve on $1 never answered on its RPC socket"
}

# A storage node with replica "v" (made at its first start).
start_store() { # HOST
  local h=$1 new=
  [ -d "$WORK/$h" ] || new=1
  RUST_LOG=info "$NL" run "$h" "$LULL" serve --listen 127.0.0.1:0 --store "$WORK/$h" \
    --replica-listen "$(addr "$h"):$REPLICA_PORT" --replica-insecure --rpc-socket "$WORK/$h.sock" \
    >/dev/null 2>>"$WORK/$h.log" &
  pid[$h]=$!
  wait_rpc "$h"
  if [ -n "$new" ]; then
    rpc "$h" replica_create "{\"name\":\"$VOL\",\"size\":\"$SIZE\"}" >/dev/null || fail "replica_create on $h failed"
  fi
}

# An engine node's daemon (no volume yet).
start_engine_node() { # HOST
  local h=$1
  RUST_LOG=info "$NL" run "$h" "$LULL" serve --listen "$(addr "$h"):$NBD_PORT" --store "$WORK/$h" \
    --replica-listen "$(addr "$h"):$REPLICA_PORT" --replica-insecure --rpc-socket "$WORK/$h.sock" \
    >/dev/null 2>>"$WORK/$h.log" &
  pid[$h]=$!
  wait_rpc "$h"
}

# The volume's engine on HOST, as the CSI plugin makes it (its node stage,
# and a failover's re-stage): answers once the engine is elected.
create_volume() { # HOST
  rpc "$1" volume_create "{\"name\":\"$VOL\",\"size\":\"$SIZE\",\"backend\":\"replicas=$(addr n1):$REPLICA_PORT/$VOL+$(addr n2):$REPLICA_PORT/$VOL\",\"persist\":true,\"resume\":true}"
}

stop() { # HOST SIGNAL
  local p=${pid[$1]:-}
  [ -n "$p" ] || return 0
  kill -CONT "$p" 2>/dev/null || true
  kill -"$2" "$p" 2>/dev/null || true
  wait "$p" 2>/dev/null || true
  unset "pid[$1]"
}

# Prints the time WHAT holds on HOST's volume (watch.py wait), or fails.
wait_state() { # HOST WHAT [TIMEOUT_S]
  local out
  out=$($PY "$ND/watch.py" wait "$WORK/$1.sock" $VOL "$2" "${3:-$STATE_WAIT_S}") || fail "$1: $out"
  echo "$out"
}

watch_start() { # HOST NAME
  $PY "$ND/watch.py" record "$WORK/$1.sock" $VOL "$WORK/watch.$2" 50 &
  pid[watch.$2]=$!
}
watch_stop() { stop "watch.$1" TERM; }

# fio on the client: random 4 KiB writes with crc32c verify (backlog) and
# fsync, over fio's region, for SECONDS. Its JSON is $WORK/fio.NAME.
fio_start() { # NAME URI SECONDS [FROM_HOST]
  "$NL" run "${4:-client}" fio --name="$1" --ioengine=nbd --uri="$2" --rw=randwrite --bs=4k --iodepth=8 \
    --offset=0 --size=$FIO_SIZE --time_based --runtime="$3" --verify=crc32c --verify_backlog=64 \
    --verify_fatal=1 --verify_state_save=0 --fsync=32 --randseed="${SEED:-1}" \
    --output-format=json --output="$WORK/fio.$1" >"$WORK/fio.$1.stderr" 2>&1 &
  pid[fio.$1]=$!
}
# Sets FIO_RES to fio's outcome, "rc=N err=E stall_max_ms=M ... verify=ok";
# fails on bad data. (Not in $(...): it waits for a child of this shell.)
fio_wait() { # NAME
  local rc=0 name=$1
  wait "${pid[fio.$name]}" || rc=$?
  unset "pid[fio.$name]"
  local res
  res=$($PY - "$WORK/fio.$name" <<'EOF'
import json, sys
try:
    t = open(sys.argv[1]).read()
    j = json.loads(t[t.index("{"):])
    job = j["jobs"][0]
    # The longest wait of any request: writes, verify reads, and the
    # fsyncs (fio waits for each before it writes on, so a stall of the
    # volume often shows there and not in the writes).
    most = {k: job[k]["lat_ns"]["max"] / 1e6 for k in ("write", "read", "sync") if job.get(k, {}).get("lat_ns")}
    worst = max(most.values()) if most else 0
    detail = "/".join(f"{k} {v:.0f}" for k, v in most.items())
    print(f"err={job['error']} stall_max_ms={worst:.0f} ({detail}) writes={job['write']['total_ios']}")
except Exception as e:
    print(f"err=? (no JSON: {e})")
EOF
)
  local verify=ok
  if grep -qiE 'verify failed|bad magic|bad header|crc32c: verify|verify: bad' "$WORK/fio.$name" "$WORK/fio.$name.stderr"; then
    verify=BAD
  fi
  FIO_RES="rc=$rc $res verify=$verify"
  [ $verify = ok ] || fail "fio $name read back bad data: $(grep -hiE 'verify|bad' "$WORK/fio.$name.stderr" | head -3)"
}

writer_start() { # NAME URI TAG SECONDS [FROM_HOST] [--sweep]
  local name=$1 u=$2 tag=$3 secs=$4 from=${5:-client}
  shift 5 2>/dev/null || shift $#
  "$NL" run "$from" $PY "$ND/history.py" write "$u" "$WORK/rec.log.$name" $REC_OFF $REC_BLOCKS \
    "${SEED:-1}$RANDOM" "$tag" "$secs" "$@" >"$WORK/writer.$name" 2>&1 &
  pid[writer.$name]=$!
}
# Sets W_RES to the writer's summary line; a stale read (exit 3) or a
# crash fails. (Not in $(...).)
writer_wait() { # NAME
  local rc=0
  wait "${pid[writer.$1]}" || rc=$?
  unset "pid[writer.$1]"
  [ $rc = 0 ] || fail "writer $1 exited $rc: $(tail -3 "$WORK/writer.$1")"
  W_RES=$(tail -1 "$WORK/writer.$1")
}

# The Porcupine checker (scripts/netlab.d/porcupine), built once with Go
# from the Go module proxy (github.com/anishathalye/porcupine v1.3.1).
PORCUPINE=${LULL_PORCUPINE:-/var/tmp/lull-go/bin/lull-porcupine}
build_porcupine() {
  [ -x "$PORCUPINE" ] && [ "$PORCUPINE" -nt "$ND/porcupine/main.go" ] && return 0
  command -v go >/dev/null || fail "Go is missing (golang-go; scripts/test installs it): it builds the Porcupine checker"
  mkdir -p "$(dirname "$PORCUPINE")"
  (cd "$ND/porcupine" && nice -n 15 go build -o "$PORCUPINE" .) >"$WORK/porcupine.build" 2>&1 ||
    fail "building scripts/netlab.d/porcupine failed: $(tail -3 "$WORK/porcupine.build")"
}

# history.py check of SOURCE (URI or file) against every recorded log, then
# Porcupine on the same logs with every block's read (not for a snapshot:
# --as-of). Prints "strict: SUMMARY; porcupine: SUMMARY".
history_check() { # SOURCE [--fenced TAG@T]... [--as-of T0 T1]
  local src=$1 out reads p=() a snap=
  shift
  for a in "$@"; do
    case $a in --fenced) p+=(-fenced) ;; --as-of) snap=1 ;; *) p+=("$a") ;; esac
  done
  reads=$(mktemp "$WORK/reads.XXXXXX")
  out=$("$NL" run client $PY "$ND/history.py" check "$src" $REC_OFF $REC_BLOCKS "$WORK"/rec.log.* "$@" --reads-out "$reads" 2>&1) ||
    fail "history check of $src: $(echo "$out" | head -5 | tr '\n' ';') ... $(echo "$out" | tail -1)"
  if [ -n "$snap" ]; then echo "strict: $(echo "$out" | tail -1)"; return; fi
  local pc
  pc=$("$PORCUPINE" "${p[@]}" "$WORK"/rec.log.* "$reads" 2>&1) ||
    fail "porcupine on the history read from $src: $(echo "$pc" | head -5 | tr '\n' ';') ... $(echo "$pc" | tail -1)"
  echo "strict: $(echo "$out" | tail -1); $(echo "$pc" | tail -1)"
}
# campaign-io.py's own (flush-based) check, as scripts/campaign runs it, on
# every writer's log merged in time order (it replays one log, of one
# writer at a time: a fenced writer's lines from its fence on, which
# overlap the new engine's writer, are left out; the strict check and
# Porcupine judge those).
campaign_check() { # URI [--fenced TAG@T]...
  local out u=$1
  shift
  $PY -c 'import sys
fenced = {}
args = sys.argv[1:]
while args and args[0] == "--fenced":
    tag, _, t = args[1].partition("@")
    fenced[tag] = float(t)
    args = args[2:]
rows = []
for p in args:
    for ln in open(p):
        f = ln.split()
        if len(f) >= 4 and f[0] in ("A", "K", "E"):
            t = float(f[3])
            tag = f[2].rsplit(".", 1)[0]
            if tag in fenced and t >= fenced[tag]:
                continue
            rows.append((t, ln))
        elif len(f) >= 2 and f[0] == "F":
            rows.append((float(f[1]), ln))
rows.sort(key=lambda r: r[0])
sys.stdout.writelines(ln for _, ln in rows)' "$@" "$WORK"/rec.log.* >"$WORK/rec.all"
  out=$("$NL" run client $PY "$ND/../campaign-io.py" check "$u" "$WORK/rec.all" $REC_OFF $REC_BLOCKS 2>&1) ||
    fail "campaign-io.py check: $(echo "$out" | head -3 | tr '\n' ';')"
  echo "$out" | tail -1
}

# At the end: every daemon stopped cleanly, the two replicas' layers equal,
# and each layer alone passes the history check. Sets FINAL_RES. (Not in
# $(...).)
final_layers() { # [--fenced TAG@T]...
  local h
  for h in "${!pid[@]}"; do case $h in n3|n4) stop "$h" TERM ;; esac; done
  stop n1 TERM; stop n2 TERM
  cmp "$(layer n1)" "$(layer n2)" >/dev/null || fail "the replicas' data layers differ: $(cmp "$(layer n1)" "$(layer n2)" 2>&1 | head -1)"
  local c1 c2
  c1=$(history_check "$(layer n1)" "$@") || exit 1
  c2=$(history_check "$(layer n2)" "$@") || exit 1
  FINAL_RES="layers identical; n1's alone: $c1; n2's alone: $c2"
}
