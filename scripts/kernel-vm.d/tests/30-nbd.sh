#!/bin/bash
# The kernel's NBD client (`nbd-client`) against `lull serve`: plain and
# over TLS (X.509: lull's --tls-certs with a CA, server and client
# certificate made here by openssl; nbd-client's -certfile/-keyfile/
# -cacertfile/-tlshostname), fio with crc32c verify, ext4 and xfs with a
# file round trip, fstrim reaching the volume (its allocated bytes, as
# block status reports them, drop; volume_get_stats counts the trims), and
# `nbd-client -d` with the device released.
. "$KVM_DIR/lib.sh"

VOL_MIB=320        # mkfs.xfs (xfsprogs 6.1) refuses a filesystem under 300 MB
TRIM_FILE_MIB=64   # written, deleted, then trimmed: the allocation must drop by most of it
TRIM_MIN_DROP_MIB=$((TRIM_FILE_MIB / 2))   # memory volumes free whole 1 MiB chunks only; ext4 may keep some
E_SOCK=$T/e.sock

# ---- certificates (EC P-256: quick to make under TCG) ----
pki=$T/pki; mkdir -p "$pki"
(
  cd "$pki" || exit 1
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj /CN=kvm-ca \
    -keyout ca-key.pem -out ca-cert.pem
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=localhost \
    -keyout server-key.pem -out server.csr
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' > server.ext
  openssl x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial -days 2 -extfile server.ext -out server-cert.pem
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=kvm-client \
    -keyout client-key.pem -out client.csr
  printf 'extendedKeyUsage=clientAuth\n' > client.ext
  openssl x509 -req -in client.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial -days 2 -extfile client.ext -out client-cert.pem
) > "$TOUT/openssl.txt" 2>&1 || { fail nbd-setup "openssl: $(tail -n 3 "$TOUT/openssl.txt" | oneline)"; exit 1; }
# lull's directory: the server's files and the CA that signs clients
srv=$T/pki-server; mkdir -p "$srv"; cp "$pki"/{ca-cert.pem,server-cert.pem,server-key.pem} "$srv/"

# two servers: plain on 10809, TLS required on 10810 (so the TLS client
# cannot have passed in plaintext)
lull_start PE engine.log 10809 --listen 127.0.0.1:10809 --rpc-socket "$E_SOCK" \
  --volume "nbd0:${VOL_MIB}M" || { fail nbd-setup "$LASTERR"; exit 1; }
lull_start PT engine-tls.log 10810 --listen 127.0.0.1:10810 --rpc-socket "$T/t.sock" --tls require --tls-certs "$srv" \
  --volume "nbdt0:${VOL_MIB}M" || { fail nbd-setup "$LASTERR"; exit 1; }

nbd_size() { cat "/sys/block/${1#/dev/}/size" 2>/dev/null || echo 0; }
nbd_up() { [ "$(nbd_size "$1")" != 0 ]; }
nbd_released() { [ "$(nbd_size "$1")" = 0 ] && [ ! -e "/sys/block/${1#/dev/}/pid" ]; }

# allocated PORT EXPORT: bytes of data (not hole) by block status (nbdinfo --map)
allocated() {
  local uri="nbd://127.0.0.1:$1/$2"
  [ "$1" = 10810 ] && uri="nbds://127.0.0.1:$1/$2?tls-certificates=$pki-nbdinfo&tls-verify-peer=false"
  nbdinfo --map "$uri" 2> "$TOUT/map.err" | awk '($3 % 2) == 0 {s += $2} END {printf "%d", s}'
}
# libnbd's (GnuTLS's) client directory: ca-cert.pem, client-cert.pem, client-key.pem
mkdir -p "$pki-nbdinfo"; cp "$pki"/{ca-cert.pem,client-cert.pem,client-key.pem} "$pki-nbdinfo/"

# one_client TAG PORT EXPORT DEV NBD-CLIENT-ARGS...
one_client() {
  local tag=$1 port=$2 exp=$3 dev=$4 out t0 size; shift 4
  kmark "$tag"
  t0=$(now)
  if ! out=$(nbd-client -N "$exp" "$@" 127.0.0.1 "$port" "$dev" 2>&1) || ! wait_until "$DEV_WAIT" nbd_up "$dev"; then
    fail "nbd-connect-$tag" "nbd-client -N $exp $* 127.0.0.1 $port $dev: $(echo "$out" | oneline)"; return 1
  fi
  size=$(( $(nbd_size "$dev") * 512 ))
  if [ "$size" = $((VOL_MIB << 20)) ]; then pass "nbd-connect-$tag" "nbd-client ${*:-(plain)} -> $dev in $(secs "$t0")s, $size bytes"
  else fail "nbd-connect-$tag" "$dev is $size bytes, want $((VOL_MIB << 20))"; fi
  if fio_verify "$dev" "$tag"; then pass "nbd-fio-$tag" "$FIO_SUMMARY"; else fail "nbd-fio-$tag" "$FIO_SUMMARY"; fi
  local fs
  for fs in xfs ext4; do
    if fs_roundtrip "$dev" "$fs" "$tag-$fs"; then pass "nbd-$fs-$tag" "$FS_DETAIL"; else fail "nbd-$fs-$tag" "$LASTERR"; fi
  done
  trim "$tag" "$port" "$exp" "$dev"
  if nbd-client -d "$dev" > "$TOUT/disconnect-$tag.txt" 2>&1 && wait_until "$GONE_WAIT" nbd_released "$dev"; then
    pass "nbd-disconnect-$tag" "nbd-client -d $dev: size 0, no client pid"
  else fail "nbd-disconnect-$tag" "nbd-client -d $dev: $(oneline < "$TOUT/disconnect-$tag.txt"); size $(nbd_size "$dev")"; fi
  kclean "nbd-dmesg-$tag" "$tag"
}

# trim TAG PORT EXPORT DEV: ext4 (made by fs_roundtrip) gets a file, which
# is deleted and trimmed; the volume's allocation drops, lull counted trims
trim() {
  local tag=$1 port=$2 exp=$3 dev=$4 sock=$E_SOCK mnt=$T/mnt-trim-$1 a0 a1 a2 t0 t1 out
  mkdir -p "$mnt"
  mount "$dev" "$mnt" || { fail "nbd-fstrim-$tag" "mount $dev failed"; return; }
  fstrim "$mnt" > /dev/null 2>&1   # what mkfs left, so that the file's blocks are the difference
  [ "$port" = 10810 ] && sock=$T/t.sock
  a0=$(allocated "$port" "$exp")
  dd if=/dev/urandom of="$mnt/big.bin" bs=1M count="$TRIM_FILE_MIB" conv=fsync status=none
  a1=$(allocated "$port" "$exp")
  t0=$(rpc "$sock" volume_get_stats "{\"name\": \"$exp\"}" | json_num trims)
  rm "$mnt/big.bin"; sync
  out=$(fstrim -v "$mnt" 2>&1)
  umount "$mnt"
  a2=$(allocated "$port" "$exp")
  t1=$(rpc "$sock" volume_get_stats "{\"name\": \"$exp\"}" | json_num trims)
  local drop=$(( (a1 - a2) >> 20 ))
  if [ -z "$a1" ] || [ -z "$a2" ] || [ "$a1" = 0 ]; then
    fail "nbd-fstrim-$tag" "no allocation read by block status (nbdinfo --map): '$a1' '$a2' $(oneline < "$TOUT/map.err")"
  elif [ "$drop" -ge "$TRIM_MIN_DROP_MIB" ] && [ "${t1:-0}" -gt "${t0:-0}" ]; then
    pass "nbd-fstrim-$tag" "$out; allocated $((a0 >> 20)) MiB -> $((a1 >> 20)) MiB with a ${TRIM_FILE_MIB} MiB file -> $((a2 >> 20)) MiB after rm and fstrim (block status); volume_get_stats trims $t0 -> $t1"
  else
    fail "nbd-fstrim-$tag" "$out; allocated $((a1 >> 20)) MiB -> $((a2 >> 20)) MiB (dropped $drop MiB, want >= $TRIM_MIN_DROP_MIB); trims $t0 -> $t1"
  fi
}

one_client plain 10809 nbd0 /dev/nbd0
TLS_ARGS=(-certfile "$pki/client-cert.pem" -keyfile "$pki/client-key.pem" -cacertfile "$pki/ca-cert.pem" -tlshostname localhost)
one_client tls 10810 nbdt0 /dev/nbd1 "${TLS_ARGS[@]}"

# bad input: a plaintext client at the TLS-only server is refused, and a
# TLS client without a certificate the CA signed too
kmark nbd-refuse
if out=$(timeout 30 nbd-client -N nbdt0 127.0.0.1 10810 /dev/nbd2 2>&1); then
  fail nbd-refuse-plain "a plaintext nbd-client attached to the --tls require server: $(echo "$out" | oneline)"; nbd-client -d /dev/nbd2 >/dev/null 2>&1
else pass nbd-refuse-plain "refused: $(echo "$out" | oneline | cut -c1-200)"; fi
if out=$(timeout 30 nbd-client -N nbdt0 -cacertfile "$pki/ca-cert.pem" -tlshostname localhost -x 127.0.0.1 10810 /dev/nbd2 2>&1); then
  fail nbd-refuse-no-cert "a TLS client without a client certificate attached: $(echo "$out" | oneline)"; nbd-client -d /dev/nbd2 >/dev/null 2>&1
else pass nbd-refuse-no-cert "refused: $(echo "$out" | oneline | cut -c1-200)"; fi
alive "$PT" || fail nbd-refuse-plain "the TLS server died"

for p in plain:PE tls:PT; do
  pid=${p#*:}; stop "${!pid}"
  if [ "$STOP_RC" = 0 ]; then pass "nbd-stop-${p%:*}" "SIGTERM: lull exited 0"; else fail "nbd-stop-${p%:*}" "lull exited $STOP_RC on SIGTERM ($STOP_NOTE)"; fi
done
exit 0
